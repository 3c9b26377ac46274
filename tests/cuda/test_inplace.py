"""In-place ops on CUDA tensors against the CPU backend: the elementwise kernels write into the tensor itself (any
strided layout, the other operand broadcast, the result converted to the tensor's dtype), overlapping operands take
the out-of-place path, and the whole buffer under a view is compared, so a write outside the view shows."""
import numpy as np
import pytest

import blutrain as bt
from blutrain import backend
from tests.cuda.test_kernels import TOL, check, rand

pytestmark = pytest.mark.cuda

CUDA = bt.device("cuda")
LAYOUTS = {  # a (6, 40) view of a (48, 90) buffer
  "contiguous": lambda b: b.reshape(-1)[:240].reshape(6, 40),
  "transposed": lambda b: b[:40, :6].T,
  "strided": lambda b: b[1:13:2, 3:83:2],
  "offset": lambda b: b[7:13, 50:90],
}
OTHERS = {  # the second operand: a tensor of the view's shape (its own transposed layout), a broadcast row, a number
  "tensor": lambda d: bt.from_numpy(rand((40, 6), d, seed=2)).T,
  "row": lambda d: bt.from_numpy(rand((40,), d, 0.5, 2.0, seed=3)),
  "number": lambda d: 1.5 if d.is_floating_point else 3,
}
METHODS = {
  "add_": lambda x, o: x.add_(o), "sub_": lambda x, o: x.sub_(o, alpha=2), "mul_": lambda x, o: x.mul_(o),
  "div_": lambda x, o: x.div_(o), "pow_": lambda x, o: x.pow_(o),
  "lerp_": lambda x, o: x.lerp_(o, 0.25), "addcmul_": lambda x, o: x.addcmul_(o, o, value=0.5),
  "addcdiv_": lambda x, o: x.addcdiv_(o, o + 4, value=-2), "clamp_": lambda x, o: x.clamp_(max=o),
  "masked_fill_": lambda x, o: x.masked_fill_(x > o, -7), "copy_": lambda x, o: x.copy_(o),
  "fill_": lambda x, o: x.fill_(o if not isinstance(o, bt.Tensor) else 2), "zero_": lambda x, o: x.zero_(),
  "neg_": lambda x, o: x.neg_(), "exp_": lambda x, o: x.exp_(), "sqrt_": lambda x, o: x.sqrt_(),
  "relu_": lambda x, o: x.relu_(),
}
FLOATS = (bt.float32, bt.bfloat16, bt.float16, bt.float64)


def both(base: np.ndarray, fn):
  """fn(view of the buffer) on the CPU and on CUDA; returns the two whole buffers."""
  out = []
  for device in ("cpu", "cuda"):
    buf = bt.from_numpy(base.copy()).to(device)
    fn(buf)
    out.append(buf)
  return out


def _operand(o, device):
  return o.to(device) if isinstance(o, bt.Tensor) else o


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("method", list(METHODS))
def test_inplace_methods_on_views(method, layout):
  for dtype in FLOATS:
    for other in OTHERS:
      o = OTHERS[other](dtype)
      low, high = (0.1, 3.0) if method in ("pow_", "sqrt_") else (-3.0, 3.0)

      def fn(buf):
        x = LAYOUTS[layout](buf)
        before = x._storage.version
        assert METHODS[method](x, _operand(o, buf.device)) is x
        assert x._storage.version == before + 1
      want, got = both(rand((48, 90), dtype, low, high), fn)
      tol = TOL[dtype] if dtype is not bt.float16 or method != "exp_" else (1e-2, 2e-3)
      check(f"{method} on a {layout} {dtype.name} view, {other} operand", got, want, tol)


@pytest.mark.parametrize("dtype", (bt.int32, bt.int64, bt.bool_), ids=lambda d: d.name)
def test_inplace_integer_and_bool(dtype):
  cases = ("add_", "mul_", "copy_", "fill_", "zero_") if dtype is not bt.bool_ else ("copy_", "fill_", "zero_")
  for method in cases:
    for layout in ("transposed", "strided"):
      for other in ("tensor", "row", "number"):
        o = OTHERS[other](dtype)
        if dtype is bt.bool_ and other == "number": o = True
        want, got = both(rand((48, 90), dtype, -50, 50),
                         lambda b: METHODS[method](LAYOUTS[layout](b), _operand(o, b.device)))
        check(f"{method} on a {layout} {dtype.name} view, {other} operand", got, want)


@pytest.mark.parametrize("x_dt, o_dt", [(bt.bfloat16, bt.float32), (bt.float16, bt.float64), (bt.float32, bt.int64),
                                        (bt.int32, bt.int64), (bt.float32, bt.bfloat16), (bt.int64, bt.bool_)])
def test_inplace_mixed_dtypes(x_dt, o_dt):
  """The result in the promoted dtype, rounded once to the tensor's; copy_ converts on store."""
  o = bt.from_numpy(rand((40,), o_dt, -20, 20, seed=5))
  for method in ("add_", "mul_", "copy_"):
    want, got = both(rand((48, 90), x_dt, -20, 20), lambda b: METHODS[method](LAYOUTS["strided"](b), o.to(b.device)))
    check(f"{method}: {x_dt.name} view, {o_dt.name} operand", got, want)


OVERLAPS = {
  "shifted rows": lambda b: b[1:].add_(b[:-1]),
  "shifted columns": lambda b: b[:, 2:].mul_(b[:, :-2]),
  "transposed self": lambda b: b[:40, :40].add_(b[:40, :40].T),
  "broadcast row of self": lambda b: b.sub_(b[3]),
  "interleaved": lambda b: b[:, ::2].add_(b[:, 1::2]),
  "disjoint halves": lambda b: b[:24].div_(b[24:]),
  "self": lambda b: b.mul_(b),
  "self transposed twice": lambda b: b.T.add_(b.T),
  "expanded destination": lambda b: b[:1].expand(48, 90).add_(1.0),
  "where on itself": lambda b: b.masked_fill_(b > b[0], 0.5),
}


@pytest.mark.parametrize("case", list(OVERLAPS))
def test_inplace_with_overlapping_operands(case):
  """Operands in the tensor's own memory read the values from before the op, as on the CPU."""
  for dtype in (bt.float32, bt.bfloat16):
    want, got = both(rand((48, 90), dtype, 0.5, 3.0), OVERLAPS[case])
    check(f"{case} ({dtype.name})", got, want)


def test_inplace_writes_without_a_copy(monkeypatch):
  """Elementwise in-place ops are one kernel into the tensor: the backend's copy_into is not called."""
  cuda = backend.get(CUDA)
  calls = []
  monkeypatch.setattr(cuda, "copy_into", lambda dst, src: calls.append((dst.shape, src.shape)))
  x = bt.from_numpy(rand((48, 90), bt.float32)).to("cuda")
  y = bt.from_numpy(rand((90,), bt.float32, seed=1)).to("cuda")
  x.add_(y); x[2:, 1::3].mul_(0.5); x.T.sub_(x.T); x[0].div_(x[1]); x.fill_(3.0); x[:, ::2].zero_(); x.clamp_(0.0, 1.0)
  assert not calls, f"copy_into called for {calls}"
  want = np.tile(np.array([0.0, 1.0], np.float32), 45)[None].repeat(48, 0)
  np.testing.assert_array_equal(x.numpy(), want)


def test_inplace_keeps_a_saved_tensors_check():
  w = bt.ones(5, device="cuda", requires_grad=True)
  x = bt.arange(5.0).to("cuda")
  y = (x * w).sum()
  with bt.no_grad(): x.add_(1.0)
  with pytest.raises(RuntimeError, match="modified by an in-place operation"): y.backward()


def test_inplace_on_a_tensor_in_the_graph_matches_the_cpu():
  """A non-leaf updated in place keeps its gradient (the out-of-place path with the tape), on CUDA as on the CPU."""
  grads = []
  for device in ("cpu", "cuda"):
    w = bt.from_numpy(rand((6, 40), bt.float32)).to(device).requires_grad_()
    h = w * 2
    h[1:].add_(h[:-1].detach()); h.mul_(w); h.clamp_(-3.0, 3.0)
    h.sum().backward()
    grads.append((h.detach(), w.grad))
  check("values", grads[1][0], grads[0][0])
  check("gradient", grads[1][1], grads[0][1])


def test_inplace_empty_and_0d():
  for shape in ((0, 5), ()):
    want, got = both(rand(shape, bt.float32), lambda b: b.add_(2.0).mul_(b))
    check(f"{shape}", got, want)
