"""In-place ops written straight into the tensor (`apply(..., into=x)`, kernels with `out=`) against PyTorch, on views
of every layout, with broadcast and Python-number operands; the fallback to an out-of-place result and a write when
an operand overlaps the tensor other than element for element, when the tape needs the result, or when the kernel
cannot write into `out`."""
import numpy as np
import pytest
import torch

import blutrain as bt
from blutrain import backend
from blutrain.device import Device
from blutrain.ops.core import can_cast, can_write_into
from tests.helpers import TORCH_DTYPES, assert_close

CPU = Device("cpu")


def _views(layout: str, base):
  """A (3, 4) view of `base` (a (5, 9) tensor of torch or blutrain) in one layout."""
  if layout == "contiguous": return base.reshape(-1)[:12].reshape(3, 4)
  if layout == "transposed": return base[:4, :3].T
  if layout == "strided": return base[1:4, 1:9:2]
  return base[2:5, 5:9]  # offset rows of a wider buffer


OTHERS = {"tensor": lambda lib, dt: lib.tensor(np.linspace(-2, 3, 12).reshape(3, 4), dtype=dt),
          "row": lambda lib, dt: lib.tensor(np.linspace(0.5, 2, 4), dtype=dt),
          "column": lambda lib, dt: lib.tensor(np.linspace(0.5, 2, 3).reshape(3, 1), dtype=dt),
          "number": lambda lib, dt: 1.5}
METHODS = {
  "add_": lambda x, o: x.add_(o), "sub_alpha": lambda x, o: x.sub_(o, alpha=2), "mul_": lambda x, o: x.mul_(o),
  "div_": lambda x, o: x.div_(o), "pow_": lambda x, o: x.pow_(o), "iadd": lambda x, o: x.__iadd__(o),
  "lerp_": lambda x, o: x.lerp_(o, 0.25), "addcmul_": lambda x, o: x.addcmul_(o, o, value=0.5),
  "addcdiv_": lambda x, o: x.addcdiv_(o, o + 3, value=-2),
  "clamp_": lambda x, o: x.clamp_(o * 0 - 1 if hasattr(o, "shape") else -1.0, o),  # torch: both numbers or tensors
  "masked_fill_": lambda x, o: x.masked_fill_(x > o, -7.0), "copy_": lambda x, o: x.copy_(o),
  "fill_": lambda x, o: x.fill_(2.5), "zero_": lambda x, o: x.zero_(), "neg_": lambda x, o: x.neg_(),
  "exp_": lambda x, o: x.exp_(), "sqrt_": lambda x, o: x.sqrt_(), "relu_": lambda x, o: x.relu_(),
}


def _run(method, layout, other, dt):
  """The method on a view of a buffer, in torch and blutrain: the whole buffers are compared, so writes outside the
  view show; the version counter is bumped once."""
  out = []
  for lib in (torch, bt):
    d = TORCH_DTYPES[dt] if lib is torch else dt
    base = lib.tensor(np.linspace(0.1, 4, 45).reshape(5, 9), dtype=d)
    x, o = _views(layout, base), OTHERS[other](lib, d)
    if other == "number" and method in ("lerp_", "addcmul_", "addcdiv_"): o = lib.tensor(1.5, dtype=d)  # torch's rule
    if lib is bt: before = x._storage.version
    assert METHODS[method](x, o) is x
    if lib is bt: assert x._storage.version == before + 1, f"{method}: version {x._storage.version}, not {before + 1}"
    out.append(base)
  return out


@pytest.mark.parametrize("other", list(OTHERS))
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided", "offset"])
@pytest.mark.parametrize("method", list(METHODS))
def test_inplace_methods_match_torch(method, layout, other):
  want, got = _run(method, layout, other, bt.float32)
  assert_close(got, want, what=f"{method} on a {layout} view with a {other} operand")


@pytest.mark.parametrize("dt", [bt.float16, bt.bfloat16, bt.float64, bt.int64, bt.int32])
@pytest.mark.parametrize("method", ["add_", "mul_", "sub_alpha", "fill_", "copy_"])
def test_inplace_dtypes_match_torch(method, dt):
  want, got = _run(method, "strided", "row", dt)
  assert_close(got, want, what=f"{method} in {dt.name}")


def test_result_cast_to_the_tensors_dtype_once():
  """bfloat16 += float32: the sum in float32, rounded once to bfloat16, as torch."""
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32) * 1e-2
  x, tx = bt.tensor(a).to(bt.bfloat16), torch.tensor(a).to(torch.bfloat16)
  x.add_(bt.tensor(b)); tx.add_(torch.tensor(b))
  assert np.array_equal(x.float().numpy(), tx.float().numpy())
  h, th = bt.tensor(a, dtype=bt.float16), torch.tensor(a, dtype=torch.float16)
  h.mul_(bt.tensor(b, dtype=bt.float64)); th.mul_(torch.tensor(b, dtype=torch.float64))
  assert np.array_equal(h.float().numpy(), th.float().numpy())


class _Writes:
  """Counts the backend's copy_into calls: an in-place op that went straight into memory makes none."""
  def __init__(self, monkeypatch):
    self.n, cpu = 0, backend.get(CPU)
    real = cpu.copy_into

    def counting(dst, src):
      self.n += 1
      real(dst, src)
    monkeypatch.setattr(cpu, "copy_into", counting)


def test_direct_write_without_a_copy(monkeypatch):
  writes = _Writes(monkeypatch)
  x, y = bt.ones(3, 4), bt.arange(4.0)
  data = x._storage.data
  x.add_(y); x.mul_(2.0); x[1].sub_(x[2]); x.T.div_(x.T); x.fill_(3.0); x[:, 1::2].zero_(); x.clamp_(0.0, 1.0)
  assert writes.n == 0 and x._storage.data is data
  assert x.tolist() == [[1.0, 0.0, 1.0, 0.0]] * 3


@pytest.mark.parametrize("case", ["shifted", "transposed", "broadcast_self", "expanded_out", "pow_cpu"])
def test_overlap_falls_back_to_a_copy(monkeypatch, case):
  """Operands that overlap x other than element for element read x's values from before the op, as if copied
  first; a broadcast x (one element in several places) and a kernel without `out=` take the out-of-place path."""
  writes = _Writes(monkeypatch)
  a = np.arange(16.0, dtype=np.float32).reshape(4, 4) + 1
  x = bt.tensor(a)
  if case == "shifted":
    x[1:].add_(x[:-1]); want = a.copy(); want[1:] += a[:-1]
  elif case == "transposed":
    x.add_(x.T); want = a + a.T
  elif case == "broadcast_self":
    x.mul_(x[0]); want = a * a[0]
  elif case == "expanded_out":
    x = bt.tensor(a[0]).expand(4, 4)
    x.add_(1.0); want = a[0] + 1
  else:
    x.pow_(2); want = a ** 2
  assert writes.n == 1, f"{case}: {writes.n} writes"
  assert_close(x, np.broadcast_to(want, (4, 4)))


def test_disjoint_views_of_one_buffer_write_directly(monkeypatch):
  writes = _Writes(monkeypatch)
  a = np.arange(12.0, dtype=np.float32).reshape(3, 4)
  x = bt.tensor(a)
  x[0].add_(x[2]); x[:1].mul_(x[2:])
  want = a.copy(); want[0] += a[2]; want[0] *= a[2]
  assert writes.n == 0
  assert_close(x, want)


def test_tape_takes_the_out_of_place_path(monkeypatch):
  """A tensor in the graph is updated through a new result, which its node keeps; without grad mode the same op
  writes directly."""
  w = bt.ones(3, requires_grad=True)
  h = w * 2
  writes = _Writes(monkeypatch)
  h.add_(h)
  assert writes.n == 1 and h.grad_fn.op.name == "add"
  h.sum().backward()
  assert w.grad.tolist() == [4.0, 4.0, 4.0]
  with bt.no_grad(): h.mul_(2.0)
  assert writes.n == 1 and h.tolist() == [8.0, 8.0, 8.0]


def test_direct_write_bumps_the_version_saved_tensors_check():
  w = bt.ones(3, requires_grad=True)
  x = bt.arange(3.0)
  y = (x * w).sum()  # mul saves x
  with bt.no_grad(): x.add_(1.0)
  with pytest.raises(RuntimeError, match="modified by an in-place operation"): y.backward()


def test_integer_results_narrow_as_in_torch():
  """int32 += int64 computes in int64 and wraps into int32, as torch does (and bool takes only bool)."""
  big = np.array([2 ** 33 + 1, -(2 ** 40) - 3, 7], np.int64)
  for x, other in ((bt.ones(3, dtype=bt.int32), bt.tensor(big)), (bt.ones(6, dtype=bt.int32)[::2], bt.tensor(big))):
    t = torch.ones(3, dtype=torch.int32)
    x.add_(other); t.add_(torch.tensor(big))
    assert x.tolist() == t.tolist()
  with pytest.raises(RuntimeError, match="can't be cast"): bt.ones(3, dtype=bt.bool).add_(bt.ones(3, dtype=bt.int64))


def test_errors_of_in_place_ops_unchanged():
  i = bt.ones(3, dtype=bt.int64)
  with pytest.raises(RuntimeError, match="can't be cast"): i.add_(1.5)
  with pytest.raises(RuntimeError, match="can't be cast"): i.exp_()
  with pytest.raises(RuntimeError, match="does not fit"): bt.ones(3, 1).add_(bt.ones(3, 4))
  assert i.tolist() == [1, 1, 1]


def test_can_write_into():
  x = bt.zeros(4, 6)
  f32 = bt.float32
  assert can_write_into(x, (4, 6), f32, CPU, [x, bt.ones(6)])
  assert can_write_into(x[:2], (2, 6), bt.float64, CPU, [x[:2], x[2:]])  # aligned; disjoint
  assert can_write_into(x, (4, 6), bt.int64, CPU, [])  # int64 casts into float32
  assert not can_write_into(x[:, ::2], (4, 3), f32, CPU, [x[:, 1::2]])  # interleaved: spans cross (conservative)
  assert not can_write_into(x.int(), (4, 6), f32, CPU, [])  # no float into int
  assert not can_write_into(x, (4, 6, 1), f32, CPU, [])
  assert not can_write_into(x[1:], (3, 6), f32, CPU, [x[:-1]])
  assert not can_write_into(x, (4, 6), f32, CPU, [x[0]])  # x's first row broadcast over x
  assert not can_write_into(bt.zeros(6).expand(4, 6), (4, 6), f32, CPU, [])
  assert can_cast(bt.int32, bt.int64) and can_cast(bt.float64, bt.bfloat16) and can_cast(bt.bool, bt.int32)
  assert can_cast(bt.int64, bt.int32) and can_cast(bt.int64, bt.float16)  # as torch.can_cast
  assert not can_cast(bt.float16, bt.int64) and not can_cast(bt.int64, bt.bool)


def test_profiler_counts_a_direct_in_place_op_once():
  x, y = bt.ones(8), bt.ones(8)
  with bt.profiler.profile() as prof: x.add_(y)
  assert {r.name: r.calls for r in prof.rows} == {"add": 1}
