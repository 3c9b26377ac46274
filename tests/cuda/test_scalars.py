"""Python numbers (and 0-d CPU tensors) as operands of CUDA elementwise ops, passed to the kernels by value, against the
CPU backend: every binary op and dtype, the number on either side, every layout (also past the kernels' dims), where
and masked_fill, gradients, autocast, and the device rule's errors."""
import numpy as np
import pytest

import blutrain as bt
from blutrain import ops
from blutrain.backend.cuda.kernels import creation
from tests.cuda.test_kernels import check, pair

pytestmark = pytest.mark.cuda

BINARY = {"add": ops.add, "sub": ops.sub, "mul": ops.mul, "div": ops.div, "pow": ops.pow, "maximum": ops.maximum,
          "minimum": ops.minimum, "eq": ops.eq, "ne": ops.ne, "lt": ops.lt, "ge": ops.ge}
NUMBERS = {bt.float32: (2.5, -0.0, 3, 1e-3), bt.bfloat16: (0.1, 3, -2.75), bt.float16: (0.1, -7), bt.float64: (0.1, 2),
           bt.int32: (3, -2, 2.5), bt.int64: (5, 0, True)}


@pytest.mark.parametrize("name", list(BINARY))
@pytest.mark.parametrize("dtype", list(NUMBERS), ids=lambda d: d.name)
def test_binary_ops_with_numbers(name, dtype):
  for shape, layout in (((1000,), "contiguous"), ((7, 33, 5), "transposed"), ((4, 300), "strided"), ((6, 128), "broadcast"),
                        ((), "contiguous"), ((3 << 20,), "contiguous")):
    low, high = (0.5, 3.0) if name in ("pow", "div") else (-5.0, 5.0)  # no float16 overflow: numpy warns on the CPU
    a, b = pair(shape, dtype, layout, low, high)
    for v in NUMBERS[dtype]:
      for left in (False, True):
        if name == "pow" and not dtype.is_floating_point and (left or v < 0 or isinstance(v, float)): continue
        fn = (lambda t: BINARY[name](v, t)) if left else (lambda t: BINARY[name](t, v))
        check(f"{name}({'number, ' if left else ''}{dtype.name} {shape} {layout}{'' if left else ', number'}) with {v!r}",
              fn(b), fn(a))


def test_numbers_past_the_kernels_dims():
  x = bt.from_numpy(np.random.default_rng(0).standard_normal((2,) * 8).astype(np.float32)).permute(7, 2, 5, 0, 3, 6, 1, 4)
  g = x.to("cuda")
  check("8 uncollapsible dims * 0.5", g * 0.5, x * 0.5)
  check("1.5 - 8 uncollapsible dims", 1.5 - g, 1.5 - x)


def test_where_and_masked_fill_with_numbers():
  for dtype in (bt.float32, bt.bfloat16, bt.int64):
    a, b = pair((33, 40), dtype, "transposed")
    check(f"where(c, 1, x) {dtype.name}", bt.where(b > 0, 1, b), bt.where(a > 0, 1, a))
    check(f"where(c, x, -2) {dtype.name}", bt.where(b > 0, b, -2), bt.where(a > 0, a, -2))
    check(f"where(c, 1.0, 0.0) {dtype.name}", bt.where(b > 0, 1.0, 0.0), bt.where(a > 0, 1.0, 0.0))
    check(f"masked_fill {dtype.name}", b.masked_fill(b < 1, 7), a.masked_fill(a < 1, 7))
    check(f"clamp {dtype.name}", b.clamp(-1, 2), a.clamp(-1, 2))
  a, b = pair((100,), bt.bool_, "strided")
  check("bool & True", b & True, a & True)
  check("bool + True", b + True, a + True)


def test_numbers_launch_one_kernel_and_no_fill(monkeypatch):
  fills = []
  monkeypatch.setattr(creation, "fill", lambda out, value: fills.append(value) or out)
  x = bt.from_numpy(np.arange(6.0, dtype=np.float32)).to("cuda")
  y = (x * 2.0 - 1) / 4 + 2 ** x
  assert not fills, f"fills of {fills}"
  np.testing.assert_allclose(y.numpy(), (np.arange(6.0) * 2 - 1) / 4 + 2 ** np.arange(6.0), rtol=1e-6)


def test_cpu_0d_tensors_join_cuda_tensors():
  a, b = pair((5, 7), bt.float32, "transposed")
  s = bt.tensor(1.25)
  check("cuda + cpu 0-d", b + s, a + s)
  check("cpu 0-d * cuda", s * b, s * a)
  check("where(c, cpu 0-d, cuda)", bt.where(b > 0, s, b), bt.where(a > 0, s, a))
  for bad in (bt.ones(1), bt.ones(7), bt.tensor(2.0, requires_grad=True)):
    with pytest.raises(RuntimeError, match="expected all tensors on one device"): b + bad
  with pytest.raises(RuntimeError, match="gelu_backward: expected all tensors on one device"):
    ops.registry["gelu_backward"](s, bt.ones((), device="cuda"), approximate="none")


def test_gradients_through_numbers_match_the_cpu():
  grads = []
  for device in ("cpu", "cuda"):
    w = bt.tensor(np.linspace(0.5, 2.0, 12, dtype=np.float32).reshape(3, 4), device=device, requires_grad=True)
    (w * 2.0 + 2.0 ** w + w ** 3 + 1.5 / w - (w > 1) * w * 0.5 + w.clamp(0.75, 1.5)).sum().backward()
    grads.append(w.grad)
  check("gradient", grads[1], grads[0])


def test_autocast_pow_with_a_number_runs_in_float32():
  a, b = pair((64,), bt.bfloat16, "contiguous", 0.5, 2.0)
  with bt.autocast("cuda"):
    left, right = 2.0 ** b, b ** 2.0
  assert left.dtype is bt.float32 and right.dtype is bt.float32, (left.dtype, right.dtype)
  check("2.0 ** bf16 under autocast", left, 2.0 ** a.float())
  check("bf16 ** 2.0 under autocast", right, a.float() ** 2.0)


def test_integer_numbers_out_of_range_fail_as_on_the_cpu():
  x = bt.ones(3, dtype=bt.int32)
  for t in (x, x.to("cuda")):
    with pytest.raises(OverflowError): t + 2 ** 40
