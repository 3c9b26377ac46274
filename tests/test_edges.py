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
                 "any", "cumsum", "cumprod", "prod"]


@pytest.mark.parametrize("name", REDUCTIONS_0D)
@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("keepdim", [False, True])
def test_reductions_of_a_0d_tensor_over_its_dim(name, dim, keepdim):
  kw = {} if name in ("cumsum", "cumprod") else {"keepdim": keepdim}
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
  ("pow of integers", lambda lib: lib.tensor([2]) ** -1, RuntimeError),
]


@pytest.mark.parametrize("what,call,old", ERRORS, ids=[e[0] for e in ERRORS])
def test_exception_types_are_pytorchs(what, call, old):
  with pytest.raises(Exception) as want: call(torch)
  with pytest.raises(want.type) as got: call(bt)
  assert isinstance(got.value, old), f"{what}: {type(got.value).__name__} is no longer a {old.__name__}"
  assert isinstance(got.value, (ShapeError, DTypeError, BoundsError, IndexError)) or old is RuntimeError, what


# *** generated over the op registry: every elementwise op and reduction at PyTorch's edges ***

def _registry_ops(module: str, n_inputs: int) -> list[str]:
  """The public primitives whose rule lives in `module` and that take n_inputs tensors (backward ops are checked
  through the VJPs; cast is `.to`, tested with dtypes)."""
  return sorted(name for name, o in bt.ops.registry.items()
                if o.rule.__module__ == f"blutrain.ops.{module}" and len(o.inputs) == n_inputs
                and not name.endswith("_backward") and name != "cast")


UNARY, BINARY = _registry_ops("elementwise", 1), _registry_ops("elementwise", 2)
# reductions: the primitives and the composites over them, each a Tensor method of PyTorch's name and signature
REDUCTIONS = _registry_ops("reduce", 1) + ["mean", "var", "std", "logsumexp", "all", "any", "max", "min", "prod",
                                            "logcumsumexp", "cummax", "cummin"]
METHODS = {"copy": "clone"}                       # primitives whose PyTorch (and blutrain) method has another name
FUNCTIONAL = {"gelu"}                             # reached through nn.functional in both libraries
SCANS = {"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"}  # running reductions: one dim, no keepdim
ONE_DIM = SCANS | {"prod"}           # reductions over one dim only
DIM_REQUIRED = SCANS | {"logsumexp"}            # reductions without a whole-tensor form
EDGES = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.0, 30.0, INF, -INF, NAN]
INT_EDGES = [0, 1, -1, 2, -3, 7]
SMALL_INT_EDGES = {bt.uint8: [0, 1, 2, 7, 200, 255], bt.int8: [0, 1, -1, 2, -128, 127]}  # wrap-around at both ends
# where blutrain keeps its own value: PyTorch's vectorized CPU gelu gives nan at +inf (its tanh form and its scalar path
# give inf, as blutrain does)
NOT_PYTORCHS = {"gelu": [INF]}
# gradients left unchecked: PyTorch's prod(dim) switches formula on whether the whole tensor holds a zero (products
# of the others then, so 0 * inf = nan after a zero); blutrain's is cumprod's everywhere (equal where all is finite)
GRAD_NOT_PYTORCHS = {("prod", "matrix")}
FLOATS = [bt.float32, bt.float64]


def call(name: str, *args, **kw):
  """The function calling op `name` of a library on its tensors, as PyTorch code calls it."""
  def fn(lib, x, *rest):
    if name in FUNCTIONAL: return getattr((torch.nn.functional if lib is torch else bt.nn.functional), name)(x, *rest)
    return getattr(x, METHODS.get(name, name))(*rest, *args, **kw)
  return fn


def compare(fn, make, what: str, grads: bool = True) -> None:
  """`make(lib)` gives the inputs in one library, `fn(lib, *inputs)` runs the op; where torch raises, blutrain must
  raise the same type; otherwise outputs (each of a tuple), then the gradients of a weighted sum of the float
  outputs, must match."""
  tins, bins = make(torch), make(bt)
  grad = all(t.dtype.is_floating_point for t in tins)
  for t, b in zip(tins, bins): t.requires_grad_(grad); b.requires_grad_(grad)
  try: tout = fn(torch, *tins)
  except Exception as e:
    with pytest.raises(type(e)): fn(bt, *bins)
    return
  bout = fn(bt, *bins)
  touts, bouts = (list(tout), list(bout)) if isinstance(tout, tuple) else ([tout], [bout])
  for t, b in zip(touts, bouts): assert_same(b, t, what)
  pairs = [(t, b) for t, b in zip(touts, bouts) if t.requires_grad]
  if not pairs or not grads: return
  rng = np.random.default_rng(1)
  ws = [rng.uniform(0.5, 1.5, tuple(t.shape)) for t, _ in pairs]
  tl = sum((t * torch.tensor(w, dtype=t.dtype)).sum() for (t, _), w in zip(pairs, ws))
  bl = sum((b * bt.tensor(w, dtype=b.dtype)).sum() for (_, b), w in zip(pairs, ws))
  try: tl.backward()
  except RuntimeError as e:  # floor_divide: PyTorch defines no derivative, blutrain's is 0 (as div(rounding_mode=))
    assert "derivative for" in str(e) and "not implemented" in str(e), e
    return
  if bl.requires_grad: bl.backward()
  for i, (t, b) in enumerate(zip(tins, bins)): assert_same(b.grad, t.grad, f"gradient {i} of {what}")


def tensor(lib, values, dtype):
  return lib.tensor(values, dtype=TORCH_DTYPES[dtype] if lib is torch else dtype)


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("dtype", FLOATS + [bt.int64, bt.uint8, bt.int8, bt.bool], ids=str)
def test_unary_at_the_edges(name, dtype):
  values = EDGES if dtype.is_floating_point else SMALL_INT_EDGES.get(dtype, INT_EDGES) if dtype is not bt.bool else \
    [True, False]
  values = [v for v in values if v not in NOT_PYTORCHS.get(name, [])]
  for what, v in (("edges", values), ("0-d", values[3 % len(values)]), ("empty", np.zeros((0, 3)).tolist())):
    compare(call(name), lambda lib: [tensor(lib, v, dtype)], f"{name} of {what} {dtype.name}")


@pytest.mark.parametrize("name", BINARY)
@pytest.mark.parametrize("dtype", FLOATS + [bt.int64, bt.uint8, bt.int8], ids=str)
def test_binary_at_the_edges(name, dtype):
  values = EDGES if dtype.is_floating_point else SMALL_INT_EDGES.get(dtype, INT_EDGES)
  x, y = np.repeat(values, len(values)).tolist(), np.tile(values, len(values)).tolist()  # every pair of edges
  for what, a, b in (("pairs", x, y), ("0-d and 1-d", values[4], values), ("empty", [], values[4])):
    compare(call(name), lambda lib: [tensor(lib, a, dtype), tensor(lib, b, dtype)], f"{name} of {what} {dtype.name}")


REDUCE_INPUTS = {  # rows with ties and signed zeros, with an infinity, with nan and -inf; 0-d; empty
  "matrix": [[0.0, -0.0, 1.0, -1.0, 1.0], [INF, 2.0, -3.0, 2.0, 0.5], [NAN, 1.0, -INF, 0.5, 4.0]],
  "0-d": -1.5,
  "empty": np.zeros((0, 3)).tolist(),
}


@pytest.mark.parametrize("name", REDUCTIONS)
@pytest.mark.parametrize("dtype", FLOATS + [bt.int64], ids=str)
@pytest.mark.parametrize("keepdim", [False, True])
def test_reduction_at_the_edges(name, dtype, keepdim):
  for what, v in REDUCE_INPUTS.items():
    if not dtype.is_floating_point: v = np.nan_to_num(np.asarray(v), posinf=9, neginf=-9).astype(np.int64).tolist()
    ndim = np.asarray(v).ndim
    for dim in ([] if name in DIM_REQUIRED else [None]) + [0, -1] + ([1, (0, 1)] if ndim == 2 else []):
      if name in ONE_DIM and isinstance(dim, tuple): continue
      kw = {} if name in SCANS or dim is None else {"keepdim": keepdim}
      fn = call(name, *(() if dim is None else (dim,)), **kw)
      compare(fn, lambda lib: [tensor(lib, v, dtype)], f"{name} of {what} {dtype.name}, dim={dim} {kw}",
              grads=(name, what) not in GRAD_NOT_PYTORCHS or dim is None)
