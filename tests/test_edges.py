"""The edges PyTorch defines (zeros, negative bases, infinities, nan, 0-d and empty tensors) and the exception types it
raises, compared with PyTorch CPU: first the cases found wrong by hand (issue #17), then a test generated over the op
registry (every elementwise op and reduction)."""
import numpy as np
import pytest
import torch

import blutrain as bt
from blutrain.dtypes import DTypeError
from blutrain.shapes import BoundsError, ShapeError
from tests.helpers import TORCH_DTYPES, assert_close

INF, NAN = float("inf"), float("nan")
pytestmark = pytest.mark.filterwarnings("ignore:.*degrees of freedom:UserWarning")  # torch's, at var's edges


def both(fn, *values, dtype=bt.float64, grad=True):
  """fn on blutrain and on torch tensors made of `values` (lists or numbers), with the gradients of sum(out * w) for
  a fixed w when `grad`: (bt out, torch out, bt grads, torch grads)."""
  bts = [bt.tensor(v, dtype=dtype, requires_grad=grad) for v in values]
  ths = [torch.tensor(v, dtype=TORCH_DTYPES[dtype], requires_grad=grad) for v in values]
  bo, to = fn(*bts), fn(*ths)
  if not grad: return bo, to, [], []
  w = np.random.default_rng(0).uniform(0.5, 1.5, tuple(to.shape))
  (bo * bt.tensor(w, dtype=bo.dtype)).sum().backward()
  (to * torch.tensor(w, dtype=to.dtype)).sum().backward()
  return bo, to, [t.grad for t in bts], [t.grad for t in ths]


def assert_same(got, want, what: str) -> None:
  """Equal shape and dtype, nan in the same places, infinities equal, finite values close."""
  if want is None or got is None:
    assert got is None and want is None or want is not None and not want.any(), f"{what}: {got} vs torch's {want}"
    return
  assert_close(got, want, got.dtype if got.dtype.is_floating_point else bt.float64, what)


# *** the cases found wrong (issue #17) ***

POW_X = [-2.0, -0.5, 0.0, 0.0, 0.0, 1.5, 2.0, 0.0, -0.0, INF, -INF, NAN]
POW_Y = [0.5, 2.0, 0.0, -1.0, 1.5, 0.0, -2.0, -1.5, 3.0, -1.0, 2.0, 0.0]


def test_pow_gradients_at_the_edges():
  for fn in (lambda x, y: x ** y, lambda x, y: x ** 0.0, lambda x, y: x ** 3, lambda x, y: (-2.0) ** y,
             lambda x, y: 0 ** y, lambda x, y: x ** -1.0):
    bo, to, bg, tg = both(fn, POW_X, POW_Y)
    assert_same(bo, to, "pow values")
    for i, (b, t) in enumerate(zip(bg, tg)): assert_same(b, t, f"pow gradient {i}")


def test_sign_has_a_zero_gradient():
  bo, to, bg, tg = both(lambda x: x.sign(), [-1.0, 0.0, 2.0, -0.0, INF, NAN])
  assert bo.requires_grad
  assert_same(bo, to, "sign")
  assert_same(bg[0], tg[0], "sign gradient")
  assert_same(bt.tensor([-3, 0, 5]).sign(), torch.tensor([-3, 0, 5]).sign(), "sign of integers")


REDUCTIONS_0D = ["sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "var", "std", "logsumexp", "all",
                 "any", "cumsum"]


@pytest.mark.parametrize("name", REDUCTIONS_0D)
@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("keepdim", [False, True])
def test_reductions_of_a_0d_tensor_over_its_dim(name, dim, keepdim):
  kw = {} if name == "cumsum" else {"keepdim": keepdim}
  grad = name not in ("argmax", "argmin", "all", "any")
  fn = lambda x: getattr(x, name)(dim, **kw)
  bo, to = fn(bt.tensor(2.5, requires_grad=grad)), fn(torch.tensor(2.5, dtype=torch.float32, requires_grad=grad))
  for b, t in zip(bo if isinstance(to, tuple) else [bo], to if isinstance(to, tuple) else [to]):
    assert_same(b, t, f"{name}({dim})")
  if grad:
    _, _, bg, tg = both(lambda x: fn(x)[0] if name in ("max", "min") else fn(x), 2.5)
    assert_same(bg[0], tg[0], f"gradient of {name}({dim})")
  beyond = 1 if dim == 0 else -2
  with pytest.raises(IndexError): getattr(torch.tensor(2.5), name)(beyond)
  with pytest.raises(IndexError, match="out of range"): getattr(bt.tensor(2.5), name)(beyond)


@pytest.mark.parametrize("name", ["var", "std"])
@pytest.mark.parametrize("values,kw", [([1.0, 2.0], {"correction": 2}), ([1.0, 2.0], {"correction": 3}),
                                       ([1.0, 1.0], {"correction": 2}), ([3.0], {}), ([], {}),
                                       ([[1.0, 2.0], [3.0, 5.0]], {"dim": 0, "correction": 2})])
def test_var_std_with_correction_at_least_n(name, values, kw):
  bo = getattr(bt.tensor(values), name)(**kw)
  with pytest.warns(UserWarning):  # torch warns of the degrees of freedom; blutrain returns the same quietly
    to = getattr(torch.tensor(values), name)(**kw)
  assert_same(bo, to, f"{name}{kw}")


def test_squeeze_and_linspace_reject_what_pytorch_rejects():
  with pytest.raises(IndexError, match="squeeze: dimension 10 out of range"): bt.tensor(2.0).squeeze(10)
  assert bt.tensor(2.0).squeeze(0).shape == bt.tensor(2.0).squeeze(-1).shape == ()
  with pytest.raises(NotImplementedError, match="linspace: bool"): bt.linspace(5, 10, 3, dtype=bt.bool)


def _sdpa(lib, **kw):
  q = lib.ones(1, 2, 4)
  return (torch.nn.functional if lib is torch else bt.nn.functional).scaled_dot_product_attention(q, q, q, **kw)


# (what, a call taking the library, the type blutrain raised before): PyTorch's type must be raised, and the old one too
ERRORS = [
  ("permute", lambda lib: lib.ones(2, 3).permute(0), ValueError),
  ("permute twice", lambda lib: lib.ones(2, 3).permute(0, 0), ValueError),
  ("clip", lambda lib: lib.ones(2, 3).clip(None, None), ValueError),
  ("gather bounds", lambda lib: lib.ones(2, 3).gather(0, lib.tensor([[5]])), IndexError),
  ("gather dims", lambda lib: lib.ones(2, 3).gather(0, lib.tensor([1])), ValueError),
  ("gather dtype", lambda lib: lib.ones(2, 3).gather(0, lib.ones(1, 1)), TypeError),
  ("scatter_add bounds", lambda lib: lib.ones(2, 3).scatter_add(0, lib.tensor([[7]]), lib.ones(2, 3)), IndexError),
  ("reshape", lambda lib: lib.ones(2, 3).reshape((-1, -1, 2)), ValueError),
  ("reshape size", lambda lib: lib.ones(6).reshape(4, 2), ValueError),
  ("matmul", lambda lib: lib.ones(2, 3) @ lib.ones(2, 3), ValueError),
  ("matmul 0-d", lambda lib: lib.ones(()) @ lib.ones(3), ValueError),
  ("matmul dtypes", lambda lib: lib.ones(2, 3) @ lib.ones(3, 2, dtype=lib.float64), TypeError),
  ("sdpa", lambda lib: _sdpa(lib, attn_mask=lib.ones(2, 2, dtype=lib.bool), is_causal=True), ValueError),
  ("broadcast", lambda lib: lib.ones(2, 3) + lib.ones(2, 4), ValueError),
  ("expand", lambda lib: lib.ones(2, 3).expand(4, 3), ValueError),
  ("cat", lambda lib: lib.cat([lib.ones(2, 3), lib.ones(3, 2)]), ValueError),
  ("stack", lambda lib: lib.stack([lib.ones(2, 3), lib.ones(3, 2)]), ValueError),
  ("split", lambda lib: lib.ones(4).split([1, 2]), ValueError),
  ("narrow", lambda lib: lib.ones(3).narrow(0, 2, 3), IndexError),
  ("where", lambda lib: lib.where(lib.ones(3), lib.ones(3), lib.ones(3)), TypeError),
  ("masked_fill", lambda lib: lib.ones(2, 3).masked_fill(lib.ones(4, dtype=lib.bool), 0), ValueError),
  ("sum dims", lambda lib: lib.ones(3).sum((0, 0)), ValueError),
  ("arange", lambda lib: lib.arange(0, 1, 0), ValueError),
  ("zeros", lambda lib: lib.zeros(-1), ValueError),
  ("tril", lambda lib: lib.ones(3).tril(), ValueError),
]


@pytest.mark.parametrize("what,call,old", ERRORS, ids=[e[0] for e in ERRORS])
def test_exception_types_are_pytorchs(what, call, old):
  with pytest.raises(Exception) as want: call(torch)
  with pytest.raises(want.type) as got: call(bt)
  assert isinstance(got.value, old), f"{what}: {type(got.value).__name__} is no longer a {old.__name__}"
  assert isinstance(got.value, (ShapeError, DTypeError, BoundsError, IndexError)), what
