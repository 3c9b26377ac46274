"""Data types: names and parsing, sizes, casts and rounding, in-place casting rules and ops in every dtype,
against PyTorch."""
import pickle

import ml_dtypes
import numpy as np
import pytest
import torch

import blutrain as bt
from blutrain import dtypes
from tests.helpers import TORCH_DTYPES, assert_close, helper_test_op

ALL = [bt.bool, bt.int32, bt.int64, bt.float16, bt.bfloat16, bt.float32, bt.float64]
FLOATS = [bt.float16, bt.bfloat16, bt.float32, bt.float64]


def test_names_and_aliases():
  assert (bt.half, bt.float, bt.double, bt.long, bt.int, bt.bool_) == (bt.float16, bt.float32, bt.float64, bt.int64,
                                                                     bt.int32, bt.bool)
  for d in ALL:
    assert dtypes.to_dtype(d.name) is d and dtypes.to_dtype(d) is d and dtypes.to_dtype(d.np) is d
    assert repr(d) == f"blutrain.{d.name}" and str(TORCH_DTYPES[d]) == f"torch.{d.name}"
    assert d.itemsize == TORCH_DTYPES[d].itemsize
    assert d.is_floating_point == TORCH_DTYPES[d].is_floating_point
    assert pickle.loads(pickle.dumps(d)) is d
  assert dtypes.to_dtype(float) is bt.float32 and dtypes.to_dtype(int) is bt.int64 and dtypes.to_dtype(bool) is bt.bool
  assert dtypes.to_dtype("bf16") is bt.bfloat16 and dtypes.to_dtype(np.float16) is bt.float16
  assert dtypes.to_dtype(ml_dtypes.bfloat16) is bt.bfloat16
  assert isinstance(bt.float32, bt.dtype)


def test_unsupported_dtype_names_the_choices():
  for bad in ("float8", np.uint16, np.complex64, object):
    with pytest.raises(TypeError, match="unsupported dtype.*float32"): dtypes.to_dtype(bad)
  with pytest.raises(TypeError, match="unsupported dtype"): bt.zeros(2, dtype="uint32")


def test_small_integer_promotion_is_pytorchs():
  small = (bt.bool, bt.uint8, bt.int8, bt.int16, bt.int32, bt.int64, bt.float16, bt.bfloat16)
  for a in small:
    for b in small:
      want = torch.promote_types(getattr(torch, a.name), getattr(torch, b.name))
      assert bt.promote_types(a, b).name == str(want).removeprefix("torch."), (a, b)


@pytest.mark.parametrize("dst", FLOATS[:2])
def test_float_rounding_matches_torch(dst):
  """Round to nearest even, overflow to inf, subnormals, as torch's casts."""
  vals = np.array([1.0 + 2.0 ** -9, 1.0 + 3 * 2.0 ** -9, 65504.0, 65520.0, 70000.0, 3.0e38, 1e-8, 6e-5, -0.0, np.inf,
                   -np.inf, 2.0 ** -14, 2.0 ** -24, 2.0 ** -133, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8], np.float32)
  got = bt.tensor(vals).to(dst)
  want = torch.tensor(vals).to(TORCH_DTYPES[dst])
  np.testing.assert_array_equal(got.float().numpy(), want.float().numpy())
  assert np.isnan(bt.tensor([np.nan]).to(dst).float().item())


@pytest.mark.parametrize("dst", [bt.int32, bt.int64, bt.bool])
def test_float_to_int_and_bool_casts(dst):
  vals = np.array([-2.7, -0.5, 0.0, 0.4, 1.0, 2.5, 1e3], np.float32)
  for src in FLOATS:
    assert_close(bt.tensor(vals).to(src).to(dst), torch.tensor(vals).to(TORCH_DTYPES[src]).to(TORCH_DTYPES[dst]))
  assert_close(bt.tensor([-3, 0, 5]).to(dst), torch.tensor([-3, 0, 5]).to(TORCH_DTYPES[dst]))


def test_int_casts():
  big = np.array([2 ** 31 + 5, -(2 ** 40), 7], np.int64)
  assert_close(bt.tensor(big).to(bt.int32), torch.tensor(big).to(torch.int32))  # wraps around, as torch's
  assert_close(bt.tensor([True, False]).to(bt.float16), torch.tensor([True, False]).to(torch.float16))
  assert_close(bt.tensor([2 ** 24 + 1]).to(bt.float32), torch.tensor([2 ** 24 + 1]).to(torch.float32))


@pytest.mark.parametrize("dt", ALL)
def test_inplace_keeps_dtype_and_rejects_unsafe_casts(dt):
  x, t = bt.ones(3, dtype=dt), torch.ones(3, dtype=TORCH_DTYPES[dt])
  for other in (1, True, 2.5, bt.ones(3, dtype=bt.float64), bt.ones(3, dtype=bt.int32)):
    tother = torch.ones(3, dtype=TORCH_DTYPES[other.dtype]) if isinstance(other, bt.Tensor) else other
    try: t.add_(tother)
    except RuntimeError:
      with pytest.raises(RuntimeError, match="can't be cast"): x.add_(other)
      continue
    x.add_(other)
    assert x.dtype is dt
    assert_close(x, t)


@pytest.mark.parametrize("dt", [bt.float16, bt.bfloat16, bt.float64])
def test_ops_in_low_and_high_precision(dt):
  """A composite chain in one dtype, values and gradients against torch in the same dtype."""
  def chain(x, w, b):
    h = (x @ w + b).tanh() * x.sum(-1, keepdim=True).sigmoid()
    return h.softmax(-1).log().mean(0) + h.amax(0) - h.var(0)
  helper_test_op([(4, 6), (6, 5), (5,)], chain, dtype=dt, tol_scale=5 if dt is bt.bfloat16 else 2)


@pytest.mark.parametrize("dt", [bt.float16, bt.bfloat16])
def test_half_results_round_once(dt):
  """Kernels compute halves in float32 and round the result, as torch's CPU kernels."""
  x = np.random.default_rng(0).uniform(-3, 3, (64,)).astype(np.float32)
  for f in (lambda a: a.exp(), lambda a: a * 1.7, lambda a: a.sigmoid(), lambda a: a.sum(), lambda a: a.cumsum(0)):
    got = f(bt.tensor(x).to(dt)).float().numpy()
    want = f(torch.tensor(x).to(TORCH_DTYPES[dt])).float().numpy()
    ulp = 2.0 ** -7 if dt is bt.bfloat16 else 2.0 ** -10
    np.testing.assert_allclose(got, want, rtol=2 * ulp, atol=2 * ulp)


@pytest.mark.parametrize("dt", ALL)
def test_creation_in_every_dtype(dt):
  for make in (lambda lib, d: lib.zeros(2, 3, dtype=d), lambda lib, d: lib.ones(4, dtype=d),
               lambda lib, d: lib.full((2,), 1, dtype=d),
               lambda lib, d: lib.arange(5, dtype=d) if d is not lib.bool else lib.zeros(1, dtype=d),
               lambda lib, d: lib.eye(3, dtype=d), lambda lib, d: lib.tensor([[1, 0]], dtype=d)):
    assert_close(make(bt, dt), make(torch, TORCH_DTYPES[dt]))


def test_default_dtypes():
  assert bt.tensor(1.0).dtype is bt.float32 and bt.tensor(1).dtype is bt.int64 and bt.tensor(True).dtype is bt.bool
  assert bt.arange(3).dtype is bt.int64 and bt.arange(3.0).dtype is bt.float32 and bt.arange(0, 1, 0.5).dtype is bt.float32
  assert bt.full((1,), 2).dtype is bt.int64 and bt.full((1,), 2.0).dtype is bt.float32
  assert bt.randint(3, (2,)).dtype is bt.int64 and bt.rand(2).dtype is bt.float32
  assert bt.tensor([1, 2]).float().mean().dtype is bt.float32 and bt.tensor([1, 2]).sum().dtype is bt.int64
  with pytest.raises(RuntimeError, match="mean"): bt.tensor([1, 2]).mean()
  assert bt.tensor([1, 2], dtype=bt.int32).cumsum(0).dtype is bt.int64
