"""Every primitive and composite of the op library, forward and gradient, against PyTorch CPU; VJPs against float64
finite differences."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

import blutrain as bt
from blutrain import ops
from tests.helpers import TORCH_DTYPES, Bool, Int, assert_close, check_vjp, helper_test_op
from tests.loopback import LOOPBACK

LAYOUTS = ("contiguous", "transposed", "strided")
SHAPES = [(), (5,), (3, 4), (2, 3, 4), (0, 3), (1, 1, 3)]

# *** unary ***

UNARY = {
  "neg": (lambda x: -x, None, {}),
  "exp": (lambda x: x.exp(), None, {}),
  "log": (lambda x: x.log(), None, {"low": 0.1, "high": 3.0}),
  "sqrt": (lambda x: x.sqrt(), None, {"low": 0.1, "high": 3.0}),
  "rsqrt": (lambda x: x.rsqrt(), None, {"low": 0.1, "high": 3.0}),
  "abs": (lambda x: x.abs(), None, {}),
  "sin": (lambda x: x.sin(), None, {}),
  "cos": (lambda x: x.cos(), None, {}),
  "tanh": (lambda x: x.tanh(), None, {}),
  "sigmoid": (lambda x: x.sigmoid(), None, {"low": -6.0, "high": 6.0}),
  "relu": (lambda x: x.relu(), None, {}),
  "gelu": (lambda x: F.gelu(x), lambda x: ops.gelu(x), {"low": -4.0, "high": 4.0}),
  "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), lambda x: ops.gelu(x, approximate="tanh"),
                {"low": -4.0, "high": 4.0}),
  "silu": (lambda x: F.silu(x), lambda x: ops.silu(x), {}),
  "erf": (lambda x: x.erf(), None, {"low": -3.0, "high": 3.0}),
  "square": (lambda x: x.square(), None, {}),
  "reciprocal": (lambda x: x.reciprocal(), None, {"low": 0.5, "high": 2.0}),
  "sign": (lambda x: x.sign(), None, {}),
  "floor": (lambda x: x.floor(), None, {}),
  "ceil": (lambda x: x.ceil(), None, {}),
  "trunc": (lambda x: x.trunc(), None, {}),
  "round": (lambda x: x.round(), None, {"low": -4.0, "high": 4.0}),
  "round_decimals": (lambda x: x.round(decimals=2), None, {}),
  "round_tens": (lambda x: x.round(decimals=-1), None, {"low": -80.0, "high": 80.0}),
  "tan": (lambda x: x.tan(), None, {"low": -1.2, "high": 1.2}),
  "asin": (lambda x: x.asin(), None, {"low": -0.9, "high": 0.9}),
  "acos": (lambda x: x.acos(), None, {"low": -0.9, "high": 0.9}),
  "atan": (lambda x: x.atan(), None, {}),
  "sinh": (lambda x: x.sinh(), None, {}),
  "cosh": (lambda x: x.cosh(), None, {}),
  "asinh": (lambda x: x.asinh(), None, {}),
  "acosh": (lambda x: x.acosh(), None, {"low": 1.5, "high": 3.0}),
  "atanh": (lambda x: x.atanh(), None, {"low": -0.9, "high": 0.9}),
  "exp2": (lambda x: x.exp2(), None, {}),
  "log2": (lambda x: x.log2(), None, {"low": 0.1, "high": 3.0}),
  "log10": (lambda x: x.log10(), None, {"low": 0.1, "high": 3.0}),
  "log1p": (lambda x: x.log1p(), None, {"low": -0.5, "high": 3.0}),
  "expm1": (lambda x: x.expm1(), None, {}),
  "isinf": (lambda x: (x / 0).isinf(), None, {}),
}


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 0, 3)])
def test_unary(name, shape):
  torch_fn, bt_fn, kw = UNARY[name]
  helper_test_op([shape], torch_fn, bt_fn, **kw)


@pytest.mark.parametrize("name", UNARY)
def test_unary_layouts(name):
  torch_fn, bt_fn, kw = UNARY[name]
  helper_test_op([(4, 6)], torch_fn, bt_fn, layouts=LAYOUTS, **kw)


@pytest.mark.parametrize("dtype", [bt.float64, bt.float16, bt.bfloat16])
@pytest.mark.parametrize("name", ["exp", "log", "sqrt", "tanh", "sigmoid", "gelu", "gelu_tanh", "silu", "erf", "relu"])
def test_unary_dtypes(name, dtype):
  torch_fn, bt_fn, kw = UNARY[name]
  helper_test_op([(4, 5)], torch_fn, bt_fn, dtype=dtype, **kw)


@pytest.mark.parametrize("name", ["exp", "log", "sqrt", "sin", "tanh", "sigmoid", "erf"])
def test_unary_int_input_gives_float(name):
  torch_fn, bt_fn, _ = UNARY[name]
  helper_test_op([Int((3, 4), 1, 5)], torch_fn, bt_fn, grad=False)


# *** binary ***

BINARY = {
  "add": (lambda x, y: x + y, {}),
  "sub": (lambda x, y: x - y, {}),
  "mul": (lambda x, y: x * y, {}),
  "div": (lambda x, y: x / y, {"low": 0.5, "high": 2.0}),
  "pow": (lambda x, y: x ** y, {"low": 0.5, "high": 2.0}),
  "maximum": (lambda x, y: x.maximum(y), {}),
  "minimum": (lambda x, y: x.minimum(y), {}),
  "atan2": (lambda x, y: x.atan2(y), {}),
  "copysign": (lambda x, y: x.copysign(y), {}),
  "fmod": (lambda x, y: x.fmod(y), {"low": 0.6, "high": 1.9}),
  "remainder": (lambda x, y: x % (y - 1.25), {"low": 0.6, "high": 1.9}),
  "floor_divide": (lambda x, y: (x * 3) // (y - 1.25), {"low": 0.6, "high": 1.9, "grad": False}),  # torch: no derivative
  "div_trunc": (lambda x, y: (x * 3).div(y - 1.25, rounding_mode="trunc"), {"low": 0.6, "high": 1.9}),
  "div_floor": (lambda x, y: (x * 3).div(y - 1.25, rounding_mode="floor"), {"low": 0.6, "high": 1.9}),
  "logaddexp": (lambda x, y: x.logaddexp(y), {}),
}


@pytest.mark.parametrize("name", BINARY)
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 4), (3, 1)), ((), (2, 3)), ((2, 3), ()),
                                    ((0, 4), (1, 4)), ((1, 1), (0, 1)), ((), ()), ((5, 1, 1), (1, 1))])
def test_binary_broadcast(name, shapes):
  fn, kw = BINARY[name]
  helper_test_op(list(shapes), fn, **kw)


@pytest.mark.parametrize("name", BINARY)
def test_binary_layouts(name):
  fn, kw = BINARY[name]
  helper_test_op([(3, 4), (3, 4)], fn, layouts=LAYOUTS, **kw)


@pytest.mark.parametrize("name", BINARY)
@pytest.mark.parametrize("dtype", [bt.float64, bt.float16, bt.bfloat16])
def test_binary_dtypes(name, dtype):
  fn, kw = BINARY[name]
  helper_test_op([(3, 4), (4,)], fn, dtype=dtype, **kw)


@given(mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=4, min_side=0, max_side=3))
def test_binary_broadcast_property(shapes):
  for name in ("add", "mul", "div"):
    fn, kw = BINARY[name]
    helper_test_op(list(shapes.input_shapes), fn, **kw)


@pytest.mark.parametrize("fn", [
  lambda x: x + 2.5, lambda x: 2.5 + x, lambda x: x - 3, lambda x: 3 - x, lambda x: x * -2, lambda x: 0.5 * x,
  lambda x: x / 4, lambda x: 4 / x, lambda x: x ** 2, lambda x: x ** 0.5, lambda x: 2 ** x, lambda x: x ** -1.5,
  lambda x: x + True, lambda x: x.add(x, alpha=2), lambda x: x.sub(1.5, alpha=3)])
def test_binary_python_scalar(fn):
  helper_test_op([(3, 4)], fn, low=0.5, high=2.0)


INT_BINARY = {
  "add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y, "div": lambda x, y: x / y,
  "add_float": lambda x, y: x + 1.5, "mul_int": lambda x, y: x * 2, "div_int": lambda x, y: x / 2,
  "radd_int": lambda x, y: 3 + x, "pow_int": lambda x, y: x ** 2, "pow_float": lambda x, y: x ** 0.5,
  "maximum": lambda x, y: x.maximum(y), "lt": lambda x, y: x < y, "eq_float": lambda x, y: x == 1.0,
}


@pytest.mark.parametrize("name", INT_BINARY)
@pytest.mark.parametrize("dt", [bt.int32, bt.int64, bt.bool])
def test_binary_integer_promotion(name, dt):
  fn = INT_BINARY[name]
  try: fn(torch.ones(3, 4, dtype=TORCH_DTYPES[dt]), torch.ones(4, dtype=TORCH_DTYPES[dt]))
  except RuntimeError: pytest.skip("torch rejects this combination")
  specs = [Bool((3, 4)), Bool((4,))] if dt is bt.bool else [Int((3, 4), 1, 5, dt), Int((4,), 1, 5, dt)]
  helper_test_op(specs, fn, grad=False)


def test_binary_mixed_float_dtypes():
  for a, b in [(bt.float16, bt.float32), (bt.bfloat16, bt.float16), (bt.float32, bt.float64), (bt.int32, bt.float16)]:
    x = np.random.default_rng(0).uniform(1, 2, (3,))
    tx, ty = torch.tensor(x, dtype=TORCH_DTYPES[a]), torch.tensor(x, dtype=TORCH_DTYPES[b])
    bx, by = bt.tensor(x, dtype=a), bt.tensor(x, dtype=b)
    assert_close(bx * by, tx * ty, bt.bfloat16)
    assert_close(bx[0] + by, tx[0] + ty, bt.bfloat16)
    assert_close(bx + by[0], tx + ty[0], bt.bfloat16)


# *** comparisons, where, clamp, masked_fill ***

@pytest.mark.parametrize("fn", [lambda x, y: x == y, lambda x, y: x != y, lambda x, y: x < y, lambda x, y: x <= y,
                                lambda x, y: x > y, lambda x, y: x >= y, lambda x, y: x > 0.5, lambda x, y: 0.5 < x,
                                lambda x, y: x == 1, lambda x, y: (x > 0) & (y > 0), lambda x, y: (x > 0) | (y > 0),
                                lambda x, y: (x > 0) ^ (y > 0), lambda x, y: ~(x > y), lambda x, y: x.isnan(),
                                lambda x, y: (x / 0).isfinite(), lambda x, y: (x > 0).logical_not()])
def test_compare(fn):
  helper_test_op([(3, 4), (4,)], fn, grad=False)
  helper_test_op([Int((3, 4), 0, 3), Int((4,), 0, 3)], fn, grad=False)


def test_bool_operators():
  helper_test_op([Bool((3, 4)), Bool((4,))],
                 lambda a, b: (a & b, a | b, a ^ b, ~a, True & a, False | b, a ^ True, a.sign()), grad=False)
  helper_test_op([()], lambda x: (x.logsumexp(0), x.logsumexp(-1)))


def test_compare_ties():
  helper_test_op([np.array([1.0, 2.0, 3.0, 2.0]), np.array([2.0, 2.0, 1.0, 2.0])], lambda x, y: x <= y, grad=False)


@pytest.mark.parametrize("shapes", [((3, 4), (3, 4), (3, 4)), ((3, 1), (1, 4), (4,)), ((), (2, 3), ()),
                                    ((0, 2), (2,), (1, 2))])
def test_where(shapes):
  c, x, y = shapes
  helper_test_op([Bool(c), x, y], lambda c, x, y: torch.where(c, x, y), lambda c, x, y: bt.where(c, x, y))


@pytest.mark.parametrize("scalars", [(0.5, None), (None, -0.5), (1.5, 2.5)])
def test_where_scalars(scalars):
  a, b = scalars
  tf = lambda c, x: torch.where(c, x if a is None else a, x if b is None else b)
  bf = lambda c, x: bt.where(c, x if a is None else a, x if b is None else b)
  helper_test_op([Bool((3, 4)), (3, 4)], tf, bf)


def test_where_int_and_float_scalar():
  helper_test_op([Bool((3, 4)), Int((3, 4), 0, 9)], lambda c, x: torch.where(c, x, 2.5), lambda c, x: bt.where(c, x, 2.5),
                 grad=False)


@pytest.mark.parametrize("lo_hi", [(-0.5, 0.5), (None, 0.3), (-1.0, None), (0.2, 0.2)])
def test_clamp(lo_hi):
  lo, hi = lo_hi
  helper_test_op([(4, 5)], lambda x: x.clamp(lo, hi), layouts=LAYOUTS)


def test_clamp_tensor_bounds():
  helper_test_op([(4, 5), (5,), (4, 1)], lambda x, lo, hi: x.clamp(lo, hi + 1.0))


def test_clamp_int():
  helper_test_op([Int((4, 5), -5, 5)], lambda x: x.clamp(-2, 3), grad=False)
  helper_test_op([Int((4, 5), -5, 5)], lambda x: x.clamp(-2.5, 3.5), grad=False)


@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 3, 4), (3, 1)), ((3, 4), ())])
def test_masked_fill(shapes):
  x, m = shapes
  helper_test_op([x, Bool(m)], lambda x, m: x.masked_fill(m, -1.5))
  helper_test_op([x, Bool(m)], lambda x, m: x.masked_fill(m, float("-inf")).exp())


def test_masked_fill_tensor_value():
  helper_test_op([(3, 4), Bool((3, 4))], lambda x, m: x.masked_fill(m, torch.tensor(2.0)),
                 lambda x, m: x.masked_fill(m, bt.tensor(2.0)))


def test_lerp():
  helper_test_op([(3, 4), (3, 4)], lambda x, y: x.lerp(y, 0.3))


# *** reductions ***

REDUCE_ARGS = [{}, {"dim": 0}, {"dim": 1}, {"dim": -1}, {"dim": (0, 2)}, {"dim": (-1, 0)}, {"dim": 1, "keepdim": True},
               {"dim": (0, 1, 2), "keepdim": True}, {"dim": ()}]


@pytest.mark.parametrize("kw", REDUCE_ARGS)
@pytest.mark.parametrize("name", ["sum", "mean", "amax", "amin", "var", "std", "logsumexp"])
def test_reduce(name, kw):
  if name == "logsumexp" and kw.get("dim", ()) == (): kw = {"dim": (0, 1, 2)}
  grad = not (name in ("var", "std") and kw.get("dim") == ())  # torch's var backward for dim=() gives inf
  helper_test_op([(2, 3, 4)], lambda x: getattr(x, name)(**kw), layouts=LAYOUTS, grad=grad)


@pytest.mark.parametrize("name", ["sum", "mean", "amax", "amin", "logsumexp", "var"])
@pytest.mark.parametrize("shape", [(), (1,), (5,), (1, 1), (3, 1, 2)])
def test_reduce_small_shapes(name, shape):
  dims = [None, 0, -1] if shape else [None]
  for d in dims:
    kw = {} if d is None else {"dim": d}
    if name == "logsumexp" and d is None: kw = {"dim": tuple(range(len(shape)))}
    if name == "var" and (np.prod(shape) <= 1 or (d is not None and shape[d] == 1)): continue
    helper_test_op([shape], lambda x: getattr(x, name)(**kw))


@pytest.mark.parametrize("name", ["sum", "mean", "logsumexp"])
def test_reduce_empty(name):
  helper_test_op([(0, 3)], lambda x: getattr(x, name)(dim=0))
  helper_test_op([(3, 0)], lambda x: getattr(x, name)(dim=0))
  if name != "logsumexp": helper_test_op([(0, 3)], lambda x: getattr(x, name)())


def test_reduce_empty_max_raises():
  with pytest.raises((IndexError, RuntimeError), match="amax"): bt.zeros(0, 3).amax(0)
  with pytest.raises((IndexError, RuntimeError), match="argmax"): bt.zeros(0, 3).argmax(0)


@given(st.lists(st.integers(0, 3), min_size=1, max_size=4).map(tuple), st.data())
def test_reduce_property(shape, data):
  dims = data.draw(st.lists(st.integers(-len(shape), len(shape) - 1), unique_by=lambda d: d % len(shape),
                            max_size=len(shape)))
  keepdim = data.draw(st.booleans())
  kw = {"dim": tuple(dims), "keepdim": keepdim}
  helper_test_op([shape], lambda x: x.sum(**kw))
  helper_test_op([shape], lambda x: x.mean(**kw) if np.prod(shape) else x.sum(**kw))
  if all(shape[d] > 0 for d in dims) and (dims or all(shape)):
    helper_test_op([shape], lambda x: x.amax(**kw))


@pytest.mark.parametrize("name", ["amax", "amin", "max", "min"])
def test_reduce_extreme_ties(name):
  x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0], [0.0, -1.0, 5.0]])
  fn = (lambda x: getattr(x, name)(1)) if name in ("amax", "amin") else (lambda x: getattr(x, name)())
  helper_test_op([x], fn)
  helper_test_op([x], lambda x: getattr(x, name)(dim=0) if name in ("amax", "amin") else getattr(x, name)(0)[0])


@pytest.mark.parametrize("name", ["max", "min"])
@pytest.mark.parametrize("kw", [{"dim": 0}, {"dim": 1, "keepdim": True}, {"dim": -1}])
def test_max_min_with_dim(name, kw):
  helper_test_op([(3, 4)], lambda x: tuple(getattr(x, name)(**kw)))
  ties = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [3.0, 3.0, 1.0, 0.0]])
  helper_test_op([ties], lambda x: tuple(getattr(x, name)(**kw)))  # the gradient goes to the returned index only


@pytest.mark.parametrize("name", ["argmax", "argmin"])
@pytest.mark.parametrize("kw", [{}, {"dim": 0}, {"dim": 1, "keepdim": True}, {"dim": -1},
                                {"dim": None, "keepdim": True}])
def test_argmax(name, kw):
  helper_test_op([(3, 4, 5)], lambda x: getattr(x, name)(**kw), grad=False, layouts=LAYOUTS)
  helper_test_op([Int((3, 4, 5), 0, 3)], lambda x: getattr(x, name)(**kw), grad=False)


@pytest.mark.parametrize("correction", [0, 1, 2])
def test_var_correction(correction):
  helper_test_op([(4, 5)], lambda x: x.var(1, correction=correction))
  helper_test_op([(4, 5)], lambda x: x.std(0, keepdim=True, correction=correction))


def test_sum_dtypes():
  helper_test_op([Int((3, 4), -5, 5, bt.int32)], lambda x: x.sum(1), grad=False)
  helper_test_op([Bool((3, 4))], lambda x: x.sum(), grad=False)
  helper_test_op([(3, 4)], lambda x: x.sum(0, dtype=torch.float64), lambda x: x.sum(0, dtype=bt.float64))
  helper_test_op([(3, 4)], lambda x: x.sum(), dtype=bt.bfloat16)
  helper_test_op([(3, 4)], lambda x: x.mean(1), dtype=bt.float16)


@pytest.mark.parametrize("name", ["all", "any"])
def test_all_any(name):
  helper_test_op([Bool((3, 4), 0.8)], lambda x: getattr(x, name)(), grad=False)
  helper_test_op([Bool((3, 4), 0.8)], lambda x: getattr(x, name)(1), grad=False)
  helper_test_op([Int((3, 4), 0, 2)], lambda x: getattr(x, name)(0, keepdim=True), grad=False)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cumsum(dim):
  helper_test_op([(3, 4)], lambda x: x.cumsum(dim), layouts=LAYOUTS)
  helper_test_op([Int((3, 4), -3, 3, bt.int32)], lambda x: x.cumsum(dim), grad=False)
  helper_test_op([(0, 4)], lambda x: x.cumsum(dim))


def test_cumsum_0d():
  helper_test_op([()], lambda x: x.cumsum(0))


def test_logsumexp_inf():
  x = np.array([[0.0, -np.inf], [-np.inf, -np.inf], [np.inf, 1.0]])
  tx, bx = torch.tensor(x), bt.tensor(x, dtype=bt.float64)
  assert_close(bx.logsumexp(1), tx.logsumexp(1))
  helper_test_op([(3, 4)], lambda x: (x * 300).logsumexp(1))


# *** matmul ***

@pytest.mark.parametrize("shapes", [((4,), (4,)), ((3, 4), (4,)), ((4,), (4, 5)), ((3, 4), (4, 5)), ((2, 3, 4), (4, 5)),
                                    ((3, 4), (2, 4, 5)), ((2, 3, 4), (2, 4, 5)), ((2, 1, 3, 4), (5, 4, 2)),
                                    ((4,), (2, 4, 5)), ((2, 3, 4), (4,)), ((0, 4), (4, 3)), ((3, 0), (0, 2)),
                                    ((1, 1), (1, 1))])
def test_matmul(shapes):
  helper_test_op(list(shapes), lambda a, b: a @ b)


def test_matmul_layouts():
  helper_test_op([(5, 6), (6, 7)], lambda a, b: a @ b, layouts=LAYOUTS)
  helper_test_op([(2, 5, 6), (6, 7)], lambda a, b: a.matmul(b), layouts=LAYOUTS)


@pytest.mark.parametrize("dtype", [bt.float64, bt.float16, bt.bfloat16])
def test_matmul_dtypes(dtype):
  helper_test_op([(3, 8), (8, 5)], lambda a, b: a @ b, dtype=dtype, tol_scale=4)


def test_matmul_int():
  helper_test_op([Int((3, 4), -3, 3), Int((4, 2), -3, 3)], lambda a, b: a @ b, grad=False)


@given(st.integers(1, 3), st.integers(0, 4), st.integers(1, 4), st.integers(0, 4), st.booleans())
def test_matmul_property(batch, m, k, n, broadcast):
  helper_test_op([(batch, m, k), (k, n) if broadcast else (batch, k, n)], lambda a, b: a @ b)


# *** softmax, normalization ***

@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax(name, dim):
  helper_test_op([(3, 4, 5)], lambda x: getattr(x, name)(dim), layouts=LAYOUTS, low=-5, high=5)
  helper_test_op([(3, 4, 5)], lambda x: getattr(x, name)(dim), dtype=bt.bfloat16)
  helper_test_op([(3, 4, 5)], lambda x: getattr(x, name)(dim), dtype=bt.float64)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_extreme(name):
  x = np.array([[1000.0, 0.0, -1000.0], [-np.inf, 0.0, 1.0], [5.0, 5.0, 5.0]])
  helper_test_op([x], lambda x: getattr(x, name)(-1))
  helper_test_op([(0, 3)], lambda x: getattr(x, name)(-1))
  helper_test_op([()], lambda x: getattr(x, name)(0))


@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, False), (False, True)])
@pytest.mark.parametrize("shape_n", [((4, 6), (6,)), ((2, 3, 5), (5,)), ((2, 3, 5), (3, 5)), ((3, 1), (1,))])
def test_layer_norm(shape_n, affine):
  shape, n = shape_n
  specs = [shape] + ([n] if affine[0] else []) + ([n] if affine[1] else [])

  def fn(lib, F):
    def f(x, *params):
      params = list(params)
      w = params.pop(0) if affine[0] else None
      b = params.pop(0) if affine[1] else None
      return F.layer_norm(x, n, w, b, eps=1e-5) if lib is torch else ops.layer_norm(x, n, w, b, eps=1e-5)
    return f
  helper_test_op(specs, fn(torch, F), fn(bt, None), tol_scale=10)
  helper_test_op(specs, fn(torch, F), fn(bt, None), dtype=bt.float64)


def test_layer_norm_layouts():
  helper_test_op([(4, 6), (6,), (6,)], lambda x, w, b: F.layer_norm(x, (6,), w, b),
                 lambda x, w, b: ops.layer_norm(x, (6,), w, b), layouts=LAYOUTS, tol_scale=10)


@pytest.mark.parametrize("dtype", [bt.float16, bt.bfloat16])
def test_layer_norm_half(dtype):
  helper_test_op([(4, 16), (16,), (16,)], lambda x, w, b: F.layer_norm(x, (16,), w, b),
                 lambda x, w, b: ops.layer_norm(x, (16,), w, b), dtype=dtype, tol_scale=2)


@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rms_norm(weight, eps):
  specs = [(3, 4, 8)] + ([(8,)] if weight else [])
  helper_test_op(specs, lambda x, *w: F.rms_norm(x, (8,), *w, eps=eps), lambda x, *w: ops.rms_norm(x, (8,), *w, eps=eps),
                 tol_scale=10)
  helper_test_op(specs, lambda x, *w: F.rms_norm(x, (4, 8), *([w[0].expand(4, 8)] if w else []), eps=eps),
                 lambda x, *w: ops.rms_norm(x, (4, 8), *([w[0].expand(4, 8)] if w else []), eps=eps), tol_scale=10)


# *** gather, scatter, embedding, one_hot ***

@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gather(dim):
  helper_test_op([(4, 5), Int((3, 2), 0, 4)], lambda x, i: x.gather(dim, i))
  helper_test_op([(4, 5, 3), Int((4, 5, 3), 0, 3)], lambda x, i: x.gather(dim, i), layouts=LAYOUTS)


def test_gather_repeated_indices():
  helper_test_op([(3, 4), np.array([[0, 0, 0, 0], [2, 2, 1, 0]])], lambda x, i: x.gather(0, i))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_add(dim):
  helper_test_op([(4, 5), Int((4, 5), 0, 4), (4, 5)], lambda x, i, s: x.scatter_add(dim, i, s))
  helper_test_op([(4, 5), Int((2, 3), 0, 4), (2, 3)], lambda x, i, s: x.scatter_add(dim, i, s))


def test_scatter_add_src_larger_than_index():
  helper_test_op([(4, 5), Int((2, 3), 0, 4), (3, 5)], lambda x, i, s: x.scatter_add(0, i, s), grad=False)


REDUCTIONS = ["sum", "prod", "mean", "amax", "amin"]


def _ties(shape, seed: int) -> np.ndarray:
  """Small whole numbers as floats: repeated values (ties for amax/amin) and zeros (prod's special cases)."""
  return np.random.default_rng(seed).integers(-2, 3, shape).astype(np.float64)


@pytest.mark.parametrize("reduce", REDUCTIONS)
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dim", [0, -1])
def test_scatter_reduce(reduce, include_self, dim):
  fn = lambda x, i, s: x.scatter_reduce(dim, i, s, reduce, include_self=include_self)
  ishape = (6, 3) if dim == 0 else (3, 7)  # repeated positions; index smaller than x off dim, as PyTorch allows
  helper_test_op([(4, 5), Int(ishape, 0, 4 if dim == 0 else 5), ishape], fn, layouts=("contiguous", "transposed"))
  helper_test_op([_ties((4, 5), 1), Int(ishape, 0, 4 if dim == 0 else 5), _ties(ishape, 2)], fn)


@pytest.mark.parametrize("reduce", REDUCTIONS)
def test_scatter_reduce_integers_and_edges(reduce):
  rng = np.random.default_rng(3)
  for dtype in (torch.int64, torch.int32, torch.float64):
    x, s = (torch.tensor(rng.integers(-9, 10, shape), dtype=dtype) for shape in ((4, 3), (5, 3)))
    i = torch.tensor(rng.integers(0, 4, (5, 3)))
    for include_self in (True, False):  # integer mean rounds down, as PyTorch's
      want = x.scatter_reduce(0, i, s, reduce, include_self=include_self)
      assert_close(bt.tensor(x.numpy()).scatter_reduce(0, bt.tensor(i.numpy()), bt.tensor(s.numpy()), reduce,
                                                       include_self=include_self), want, what=str(dtype))
  nan = torch.tensor([1.0, float("nan"), 3.0, 4.0])
  cases = [(nan, torch.tensor([0, 0, 1]), torch.tensor([float("nan"), 2.0, 5.0])),  # nan in src and in self
           (torch.tensor([1.0, 2.0]), torch.zeros(0, dtype=torch.int64), torch.zeros(0)),  # nothing scattered
           (torch.tensor(1.5), torch.tensor(0), torch.tensor(-2.0)),  # 0-d
           (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2, 0]), torch.tensor([4.0, 5.0, 6.0, 7.0]))]  # src larger
  for x, i, s in cases:
    for include_self in (True, False):
      want = x.scatter_reduce(0, i, s, reduce, include_self=include_self)
      got = bt.scatter_reduce(bt.tensor(x.numpy()), 0, bt.tensor(i.numpy()), bt.tensor(s.numpy()), reduce,
                              include_self=include_self)
      assert_close(got, want, what=f"{x.tolist()} {i.tolist()} {s.tolist()}")


def test_scatter_reduce_in_place():
  x, i, s = bt.randn(3, 4), bt.tensor([[2, 0, 0, 1]]), bt.randn(1, 4)
  want = x.scatter_reduce(0, i, s, "amin", include_self=False)
  assert x.scatter_reduce_(0, i, s, "amin", include_self=False) is x
  assert_close(x, want.numpy())


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_index_select(dim):
  helper_test_op([(4, 5, 3), Int((6,), 0, 3)], lambda x, i: x.index_select(dim, i), layouts=LAYOUTS)
  helper_test_op([(4, 5, 3), Int((), 0, 3)], lambda x, i: x.index_select(dim, i))
  helper_test_op([(4, 5, 3), Int((0,), 0, 3)], lambda x, i: x.index_select(dim, i))


@pytest.mark.parametrize("idx_shape", [(5,), (2, 3), (), (0,)])
def test_embedding(idx_shape):
  helper_test_op([Int(idx_shape, 0, 7), (7, 4)], lambda i, w: F.embedding(i, w), lambda i, w: ops.embedding(i, w))


def test_embedding_layouts_and_dtypes():
  helper_test_op([Int((2, 3), 0, 7), (7, 4)], lambda i, w: F.embedding(i, w), lambda i, w: ops.embedding(i, w),
                 layouts=LAYOUTS)
  helper_test_op([Int((2, 3), 0, 7, bt.int32), (7, 4)], lambda i, w: F.embedding(i, w), lambda i, w: ops.embedding(i, w),
                 dtype=bt.bfloat16)


@pytest.mark.parametrize("num_classes", [-1, 6])
def test_one_hot(num_classes):
  helper_test_op([Int((3, 4), 0, 5)], lambda i: F.one_hot(i, num_classes), lambda i: ops.one_hot(i, num_classes),
                 grad=False)


# *** dropout ***

@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_statistics(p):
  x = bt.ones(200, 500)
  y = ops.dropout(x, p)
  zeroed = (y == 0).float().mean().item()
  assert abs(zeroed - p) < 0.01, f"fraction zeroed {zeroed} for p={p}"
  assert abs(y.mean().item() - 1.0) < 0.03, f"mean {y.mean().item()} not preserved for p={p}"
  kept = y[y != 0]
  np.testing.assert_allclose(kept.numpy(), 1 / (1 - p), rtol=1e-6)


def test_dropout_seeding_and_grad():
  x = bt.randn(50, 40, requires_grad=True)
  bt.manual_seed(3)
  a = ops.dropout(x, 0.3)
  bt.manual_seed(3)
  b = ops.dropout(x, 0.3)
  c = ops.dropout(x, 0.3)
  assert (a == b).all().item() and not (a == c).all().item()
  g = bt.Generator().manual_seed(5)
  d = ops.dropout(x, 0.3, generator=g)
  e = ops.dropout(x, 0.3, generator=bt.Generator().manual_seed(5))
  assert (d == e).all().item()
  a.sum().backward()
  np.testing.assert_allclose(x.grad.numpy(), (a.detach() != 0).float().numpy() / 0.7, rtol=1e-6)


def test_dropout_edges():
  x = bt.randn(4, 5)
  assert ops.dropout(x, 0.5, training=False) is x
  assert (ops.dropout(x, 0.0) == x).all().item()
  assert (ops.dropout(x, 1.0) == 0).all().item()
  with pytest.raises(ValueError, match="dropout"): ops.dropout(x, 1.5)


# *** losses ***

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(5, 7), (3, 4, 6), (2, 3, 4, 5), (7,)])
def test_cross_entropy(shape, reduction):
  tshape = (shape[0],) + shape[2:] if len(shape) > 1 else ()
  fn = lambda x, t: F.cross_entropy(x, t, reduction=reduction)
  helper_test_op([shape, Int(tshape, 0, shape[1] if len(shape) > 1 else shape[0])], fn,
                 lambda x, t: ops.cross_entropy(x, t, reduction=reduction), low=-4, high=4)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_cross_entropy_ignore_index(reduction, ignore_index):
  t = np.array([0, -100, 2, 3, 2, -100, 1])
  if ignore_index == 2: t = np.where(t == -100, 2, t)
  helper_test_op([(7, 4), t], lambda x, t: F.cross_entropy(x, t, ignore_index=ignore_index, reduction=reduction),
                 lambda x, t: ops.cross_entropy(x, t, ignore_index=ignore_index, reduction=reduction))
  t3 = np.array([[0, ignore_index, 2], [3, 1, ignore_index]])
  helper_test_op([(2, 4, 3), t3], lambda x, t: F.cross_entropy(x, t, ignore_index=ignore_index, reduction=reduction),
                 lambda x, t: ops.cross_entropy(x, t, ignore_index=ignore_index, reduction=reduction))


def test_cross_entropy_layouts_and_dtypes():
  f = lambda x, t: F.cross_entropy(x, t)
  g = lambda x, t: ops.cross_entropy(x, t)
  helper_test_op([(6, 5), Int((6,), 0, 5)], f, g, layouts=LAYOUTS)
  helper_test_op([(6, 5), Int((6,), 0, 5)], f, g, dtype=bt.bfloat16)
  helper_test_op([(6, 5), Int((6,), 0, 5)], f, g, dtype=bt.float64)
  helper_test_op([(6, 5), Int((6,), 0, 5, bt.int32)], lambda x, t: F.cross_entropy(x, t.long()), g)


def test_cross_entropy_all_ignored():
  helper_test_op([(3, 4), np.array([-100, -100, -100])], lambda x, t: F.cross_entropy(x, t),
                 lambda x, t: ops.cross_entropy(x, t), grad=False)


def _split_vocab_case(dtype, seed=0):
  """Logits (6, 12) scaled to a wide range, targets with an ignored row and one in each third of the classes."""
  rng = np.random.default_rng(seed)
  full = rng.standard_normal((6, 12)) * 4
  target = np.array([0, 5, -100, 11, 4, 8])
  return full, target, bt.tensor(full, dtype=bt.float32).to(dtype), bt.tensor(target)


@pytest.mark.parametrize("dtype", [bt.float32, bt.float64, bt.bfloat16])
@pytest.mark.parametrize("start", [0, 4, 8])
def test_cross_entropy_stats_and_lse_backward_match_torch_on_a_slice_of_the_classes(start, dtype):
  """The vocabulary-parallel loss's primitives on classes [start, start + 4) of 12 (a strided slice of the whole
  logits): the stats against torch's max, sum of exponentials and picked logit; the gradient from the whole rows'
  logsumexp against torch's gradient of the whole cross-entropy, in the slice."""
  full, target, x, t = _split_vocab_case(dtype)
  tx = torch.tensor(full, dtype=torch.float32).to(TORCH_DTYPES[dtype]).float().double()  # the values blutrain holds
  local, tl = x[:, start:start + 4], tx[:, start:start + 4]
  row_max, sum_exp, picked = ops.nn.cross_entropy_stats_op(local, t, start=start)
  stats = bt.float64 if dtype is bt.float64 else bt.float32
  assert all(a.dtype is stats and tuple(a.shape) == (6,) for a in (row_max, sum_exp, picked))
  mine = torch.tensor((target >= start) & (target < start + 4))
  want_picked = torch.where(mine, tl.gather(1, torch.tensor(np.clip(target - start, 0, 3))[:, None])[:, 0], 0.0)
  for got, want, what in ((row_max, tl.amax(1), "max"), (sum_exp, (tl - tl.amax(1, keepdim=True)).exp().sum(1), "sum"),
                          (picked, want_picked, "picked")):
    assert_close(got, want.numpy(), stats, what=what)
  g = np.random.default_rng(1).standard_normal(6)
  lse = bt.tensor(torch.logsumexp(tx, 1).numpy(), dtype=stats)
  got = ops.nn.cross_entropy_lse_backward_op(bt.tensor(g, dtype=stats), local, t, lse, start=start, ignore_index=-100)
  whole = tx.clone().requires_grad_()
  (F.cross_entropy(whole, torch.tensor(target), reduction="none") * torch.tensor(g)).sum().backward()
  assert got.dtype is dtype and tuple(got.shape) == (6, 4)
  assert_close(got, whole.grad[:, start:start + 4].numpy(), dtype, what="gradient")


def test_cross_entropy_lse_backward_is_the_loss_gradient_by_finite_differences():
  """float64: <backward(g), v> against the central difference of sum(g * (logsumexp - x[target])) along v, with a
  broadcast g (the gradient of a mean)."""
  full, target, x, t = _split_vocab_case(bt.float64, seed=2)
  valid = target != -100
  loss = lambda a: (np.log(np.exp(a).sum(1)) - a[np.arange(6), np.where(valid, target, 0)]) * valid
  v, g = np.random.default_rng(3).standard_normal((6, 12)), np.full(6, 0.25)
  lse = bt.tensor(np.log(np.exp(full).sum(1)))
  d = ops.nn.cross_entropy_lse_backward_op(bt.tensor(0.25, dtype=bt.float64).expand(6), x, t, lse, start=0,
                                           ignore_index=-100)
  eps = 1e-6
  fd = ((loss(full + eps * v) - loss(full - eps * v)) * g).sum() / (2 * eps)
  np.testing.assert_allclose((d.numpy() * v).sum(), fd, rtol=1e-7, atol=1e-9)


def test_cross_entropy_stats_and_lse_backward_reject_bad_inputs():
  x, t = bt.randn(4, 8), bt.tensor([0, 1, 2, 3])
  with pytest.raises(ValueError, match=r"cross_entropy_stats: expected logits \(N, C\) and target \(N,\), got "
                                       r"\(4, 8\) and \(3,\)"):
    ops.nn.cross_entropy_stats_op(x, t[:3], start=0)
  with pytest.raises(TypeError, match="cross_entropy_stats: expected floating logits and integer targets, got "
                                      "float32 and float32"):
    ops.nn.cross_entropy_stats_op(x, t.float(), start=0)
  with pytest.raises(ValueError, match=r"cross_entropy_lse_backward: expected g and lse of shape \(4,\), got "
                                       r"\(4,\) and \(3,\)"):
    ops.nn.cross_entropy_lse_backward_op(bt.randn(4), x, t, bt.randn(3), start=0, ignore_index=-100)


def test_nll_mse():
  helper_test_op([(5, 4), np.array([0, 3, -100, 1, 1])], lambda x, t: F.nll_loss(x.log_softmax(-1), t),
                 lambda x, t: ops.nll_loss(x.log_softmax(-1), t))
  for red in ("mean", "sum", "none"):
    helper_test_op([(3, 4), (3, 4)], lambda x, y: F.mse_loss(x, y, reduction=red),
                   lambda x, y: ops.mse_loss(x, y, reduction=red))


# *** attention ***

def _sdpa(lib, **kw):
  f = F.scaled_dot_product_attention if lib is torch else ops.scaled_dot_product_attention
  return lambda q, k, v, *m: f(q, k, v, *m, **kw)


@pytest.mark.parametrize("shapes", [((2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 5, 8)), ((4, 8), (6, 8), (6, 3)),
                                    ((2, 1, 4, 8), (2, 3, 6, 8), (2, 3, 6, 4))])
@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"scale": 0.3}])
def test_sdpa(shapes, kw):
  helper_test_op(list(shapes), _sdpa(torch, **kw), _sdpa(bt, **kw), tol_scale=5)


def test_sdpa_masks():
  shapes = [(2, 3, 5, 8), (2, 3, 6, 8), (2, 3, 6, 8)]
  mask = np.random.default_rng(1).random((5, 6)) < 0.7
  mask[:, 0] = True
  helper_test_op(shapes + [mask], _sdpa(torch), _sdpa(bt), tol_scale=5)
  helper_test_op(shapes + [Bool((2, 1, 5, 6), 0.9)], _sdpa(torch), _sdpa(bt), tol_scale=5, seed=3)
  fmask = np.random.default_rng(2).standard_normal((3, 5, 6)).astype(np.float32)
  helper_test_op(shapes + [fmask], _sdpa(torch), _sdpa(bt), tol_scale=5)


def test_sdpa_layouts():
  helper_test_op([(2, 5, 8), (2, 6, 8), (2, 6, 8)], _sdpa(torch, is_causal=True), _sdpa(bt, is_causal=True),
                 layouts=LAYOUTS, tol_scale=5)


# *** triu, tril, cat, stack, split, chunk ***

@pytest.mark.parametrize("diagonal", [-2, -1, 0, 1, 3])
@pytest.mark.parametrize("name", ["triu", "tril"])
def test_triangle(name, diagonal):
  helper_test_op([(4, 5)], lambda x: getattr(x, name)(diagonal), layouts=LAYOUTS)
  helper_test_op([(2, 3, 3)], lambda x: getattr(x, name)(diagonal))
  helper_test_op([Int((3, 3), 0, 9)], lambda x: getattr(x, name)(diagonal), grad=False)
  helper_test_op([Bool((3, 3))], lambda x: getattr(x, name)(diagonal), grad=False)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cat_stack(dim):
  helper_test_op([(2, 3), (2, 3), (2, 3)], lambda a, b, c: torch.cat([a, b, c], dim) if isinstance(a, torch.Tensor)
                 else bt.cat([a, b, c], dim), layouts=LAYOUTS)
  helper_test_op([(2, 3), (2, 3)], lambda a, b: torch.stack([a, b], dim) if isinstance(a, torch.Tensor)
                 else bt.stack([a, b], dim), layouts=LAYOUTS)


def test_cat_sizes():
  helper_test_op([(2, 3), (0, 3), (4, 3)], lambda *xs: torch.cat(xs), lambda *xs: bt.cat(xs))
  helper_test_op([(2, 1), (2, 4)], lambda *xs: torch.cat(xs, 1), lambda *xs: bt.cat(xs, 1))
  helper_test_op([(2,)], lambda x: torch.cat([x]), lambda x: bt.cat([x]))
  helper_test_op([(2, 3), Int((2, 3), 0, 5)], lambda a, b: torch.cat([a, b]), lambda a, b: bt.cat([a, b]))
  helper_test_op([()], lambda x: torch.stack([x, x * 2, x]), lambda x: bt.stack([x, x * 2, x]))


@pytest.mark.parametrize("arg", [1, 2, 3, 5, [1, 4], [0, 5], [2, 2, 1]])
def test_split(arg):
  helper_test_op([(5, 3)], lambda x: x.split(arg))
  helper_test_op([(3, 5)], lambda x: x.split(arg, -1), layouts=LAYOUTS)


@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 6])
def test_chunk(chunks):
  helper_test_op([(5, 3)], lambda x: x.chunk(chunks))
  helper_test_op([(3, 6)], lambda x: x.chunk(chunks, 1), layouts=LAYOUTS)


def test_unbind_repeat():
  helper_test_op([(3, 4)], lambda x: x.unbind(1))
  helper_test_op([(3, 4)], lambda x: x.repeat(2, 1, 3))
  helper_test_op([(3,)], lambda x: x.repeat(2))


# *** indexing ***

BASIC_KEYS = [1, -1, (1, 2), (-2, -1), slice(1, 3), slice(None, None, 2), slice(1, None, 3), slice(-3, None),
              slice(None, 100), slice(5, 2), (), (Ellipsis, 1), None, (slice(None), None, 1), (Ellipsis, None),
              (1, Ellipsis, 2), (None, Ellipsis, None), (slice(None), slice(1, None, 2), -1), (-4, slice(None, -1)),
              (Ellipsis,), (slice(None, None, 3), None, slice(2, 4), 0)]


@pytest.mark.parametrize("key", BASIC_KEYS, ids=repr)
def test_getitem_basic(key):
  helper_test_op([(4, 5, 6)], lambda x: x[key], layouts=LAYOUTS)


def test_getitem_0d_and_1d():
  helper_test_op([()], lambda x: x[None])
  helper_test_op([()], lambda x: x[...])
  helper_test_op([(5,)], lambda x: x[-5])
  helper_test_op([(5,)], lambda x: x[::4])


TENSOR_KEYS = {
  "first": (lambda x, i: x[i], Int((3,), -4, 4)),
  "second": (lambda x, i: x[:, i], Int((2, 3), 0, 5)),
  "last": (lambda x, i: x[..., i], Int((7,), -6, 6)),
  "with_int": (lambda x, i: x[1, i], Int((3,), 0, 5)),
  "int_after": (lambda x, i: x[i, :, -1], Int((2, 2), 0, 4)),
  "with_none": (lambda x, i: x[None, i], Int((3,), 0, 4)),
  "with_slice": (lambda x, i: x[1:, i, ::2], Int((4,), 0, 5)),
  "repeated": (lambda x, i: x[i], np.array([0, 0, 2, 0])),
  "scalar": (lambda x, i: x[i], Int((), 0, 4)),
  "empty": (lambda x, i: x[:, i], np.zeros((0,), np.int64)),
  "two_adjacent": (lambda x, i: x[i, i + 1], Int((3,), 0, 3)),
  "two_apart": (lambda x, i: x[i, :, i], Int((2, 3), 0, 4)),
  "two_apart_none": (lambda x, i: x[:, i, None, i], Int((5,), 0, 4)),
  "broadcast": (lambda x, i: x[i.reshape(-1, 1), i.reshape(1, -1) + 1], Int((3,), 0, 4)),
  "int32": (lambda x, i: x[i], Int((3,), 0, 4, bt.int32)),
}


@pytest.mark.parametrize("name", TENSOR_KEYS)
def test_getitem_tensor(name):
  fn, spec = TENSOR_KEYS[name]
  helper_test_op([(4, 5, 6), spec], fn, layouts=LAYOUTS)


def test_getitem_lists():
  helper_test_op([(4, 5)], lambda x: x[[0, 2, -1]])
  helper_test_op([(4, 5)], lambda x: x[[0, 2], [1, 1]])
  helper_test_op([(4, 5)], lambda x: x[:, [3]])


@pytest.mark.parametrize("name", ["full", "first", "second", "with_slice", "with_int", "all_false", "0d"])
def test_getitem_bool_mask(name):
  cases = {"full": (lambda x, m: x[m], Bool((4, 5, 6))), "first": (lambda x, m: x[m], Bool((4,))),
           "second": (lambda x, m: x[:, m], Bool((5,))), "with_slice": (lambda x, m: x[1:, m], Bool((5, 6))),
           "with_int": (lambda x, m: x[m, 2], Bool((4,))), "all_false": (lambda x, m: x[m], Bool((4, 5), 0.0)),
           "0d": (lambda x, m: x[m], Bool(()))}
  fn, spec = cases[name]
  helper_test_op([(4, 5, 6), spec], fn, layouts=LAYOUTS)


def test_getitem_mask_from_comparison():
  helper_test_op([(6, 7)], lambda x: x[x > 0.5])
  helper_test_op([(6, 7)], lambda x: x[(x > 0).all(1)] if isinstance(x, torch.Tensor) else x[(x > 0).all(1)])


def test_getitem_is_a_view():
  x = bt.arange(24).reshape(2, 3, 4)
  for key in [1, (slice(None), 1), (Ellipsis, slice(1, None, 2)), (None, 0)]:
    assert x[key]._storage is x._storage


@pytest.mark.parametrize("key,value", [(1, 5.0), ((slice(None), slice(1, 3)), (2, 6)), ((Ellipsis, 0), (5,)),
                                       (-1, (5, 6)), ((1, 2, 3), -1.5), (slice(None, None, 2), (1, 6)),
                                       ((None, 2), (6,))], ids=repr)
def test_setitem_basic(key, value):
  for layout in ("contiguous", "transposed"):
    rng = np.random.default_rng(0)
    base = rng.standard_normal((4, 5, 6) if layout == "contiguous" else (4, 6, 5))
    v = value if isinstance(value, float) else rng.standard_normal(value)
    t, b = torch.tensor(base), bt.tensor(base, dtype=bt.float64)
    if layout == "transposed": t, b = t.transpose(-1, -2), b.transpose(-1, -2)
    t[key] = v if isinstance(v, float) else torch.tensor(v)
    b[key] = v if isinstance(v, float) else bt.tensor(v, dtype=bt.float64)
    assert_close(b, t)


@pytest.mark.parametrize("case", ["tensor_idx", "tensor_idx_2", "mask", "mask_tensor_value", "list", "int_value"])
def test_setitem_advanced(case):
  rng = np.random.default_rng(0)
  base = rng.standard_normal((4, 5))
  idx = np.array([0, 2, -1])
  mask = rng.random((4, 5)) < 0.5
  for lib, new in ((torch, lambda a: torch.tensor(a)), (bt, lambda a: bt.tensor(a))):
    x = new(base)
    if case == "tensor_idx": x[new(idx)] = 7.0
    elif case == "tensor_idx_2": x[new(idx), 1:3] = new(np.ones((3, 2)) * 2)
    elif case == "mask": x[new(mask)] = 0.0
    elif case == "mask_tensor_value": x[new(mask)] = new(np.arange(mask.sum()) * 1.0)
    elif case == "list": x[[1, 3]] = new(np.arange(5.0))
    elif case == "int_value": x[new(mask)] = 3
    if lib is torch: want = x
    else: got = x
  assert_close(got, want)


def test_setitem_dtype_cast_and_int_tensor():
  x, t = bt.zeros(3, dtype=bt.int64), torch.zeros(3, dtype=torch.int64)
  x[1], t[1] = 2.7, 2.7
  assert_close(x, t)
  y = bt.zeros(2, 3)
  y[0] = bt.tensor([1, 2, 3])
  assert y.tolist() == [[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]


def test_setitem_repeated_indices_last_write_wins():
  for grad in (False, True):
    t, tv = torch.zeros(4, requires_grad=grad), torch.tensor([1.0, 2.0, 3.0], requires_grad=grad)
    b, bv = bt.zeros(4, requires_grad=grad), bt.tensor([1.0, 2.0, 3.0], requires_grad=grad)
    ty, by = t * 2, b * 2
    ty[torch.tensor([3, -1, 2])] = tv
    by[bt.tensor([3, -1, 2])] = bv
    assert_close(by, ty)


def test_setitem_grad_through_nonleaf():
  def fn(x):
    y = x * 2
    y[1] = 0.0
    y[:, 0] = 5.0
    return y * x
  helper_test_op([(3, 4)], fn)


# *** VJPs against float64 finite differences ***

_mv = ops.movement
SCATTER_AT = bt.tensor([[0, 3], [1, 1], [2, 0]])  # src's last column is left out (src larger than index)
_POOL = dict(kernel=(3, 3), stride=(2, 2), padding=(0, 0), dilation=(1, 1))
_POOL_IDX = np.tile(np.array([[0, 12], [10, 24]]), (2, 3, 1, 1))  # a position inside each window (12 lies in all four)

VJP_CASES = {
  "neg": (lambda x: -x, [(3, 4)], {}),
  "exp": (lambda x: x.exp(), [(3, 4)], {}),
  "log": (lambda x: x.log(), [(3, 4)], {"low": 0.5}),
  "sqrt": (lambda x: x.sqrt(), [(3, 4)], {"low": 0.5}),
  "rsqrt": (lambda x: x.rsqrt(), [(3, 4)], {"low": 0.5}),
  "abs": (lambda x: x.abs(), [(3, 4)], {}),
  "sin": (lambda x: x.sin(), [(3, 4)], {}),
  "cos": (lambda x: x.cos(), [(3, 4)], {}),
  "tanh": (lambda x: x.tanh(), [(3, 4)], {}),
  "sigmoid": (lambda x: x.sigmoid(), [(3, 4)], {}),
  "relu": (lambda x: x.relu(), [(3, 4)], {}),
  "erf": (lambda x: x.erf(), [(3, 4)], {}),
  "floor": (lambda x: x.floor() * x, [(3, 4)], {}),
  "sign": (lambda x: x.sign() * x, [(3, 4)], {}),
  "cumprod": (lambda x: x.cumprod(1), [(3, 4)], {}),
  "tan": (lambda x: x.tan(), [(3, 4)], {"low": -1.2, "high": 1.2}),
  "asin": (lambda x: x.asin(), [(3, 4)], {"low": -0.9, "high": 0.9}),
  "acos": (lambda x: x.acos(), [(3, 4)], {"low": -0.9, "high": 0.9}),
  "atan": (lambda x: x.atan(), [(3, 4)], {}),
  "sinh": (lambda x: x.sinh(), [(3, 4)], {}),
  "cosh": (lambda x: x.cosh(), [(3, 4)], {}),
  "asinh": (lambda x: x.asinh(), [(3, 4)], {}),
  "acosh": (lambda x: x.acosh(), [(3, 4)], {"low": 1.5, "high": 3.0}),
  "atanh": (lambda x: x.atanh(), [(3, 4)], {"low": -0.9, "high": 0.9}),
  "exp2": (lambda x: x.exp2(), [(3, 4)], {}),
  "log2": (lambda x: x.log2(), [(3, 4)], {"low": 0.5}),
  "log10": (lambda x: x.log10(), [(3, 4)], {"low": 0.5}),
  "log1p": (lambda x: x.log1p(), [(3, 4)], {"low": -0.5}),
  "expm1": (lambda x: x.expm1(), [(3, 4)], {}),
  "ceil": (lambda x: x.ceil() * x, [(3, 4)], {}),
  "trunc": (lambda x: x.trunc() * x, [(3, 4)], {}),
  "round": (lambda x: x.round() * x, [(3, 4)], {}),
  "atan2": (lambda x, y: x.atan2(y), [(3, 4), (4,)], {}),
  "copysign": (lambda x, y: x.copysign(y), [(3, 4), (3, 1)], {}),
  "fmod": (lambda x, y: x.fmod(y), [(3, 4), (4,)], {"low": 0.6, "high": 1.9}),
  "remainder": (lambda x, y: x.remainder(y), [(3, 4), (4,)], {"low": 0.6, "high": 1.9}),
  "floor_divide": (lambda x, y: x.floor_divide(y) * x * y, [(3, 4), (4,)], {"low": 0.6, "high": 1.9}),
  "gelu": (lambda x: ops.gelu(x), [(3, 4)], {}),
  "gelu_tanh": (lambda x: ops.gelu(x, approximate="tanh"), [(3, 4)], {}),
  "add": (lambda x, y: x + y, [(3, 4), (4,)], {}),
  "sub": (lambda x, y: x - y, [(3, 1), (4,)], {}),
  "mul": (lambda x, y: x * y, [(2, 3, 4), (3, 1)], {}),
  "div": (lambda x, y: x / y, [(3, 4), (3, 4)], {"low": 0.5}),
  "pow": (lambda x, y: x ** y, [(3, 4), (4,)], {"low": 0.5}),
  "maximum": (lambda x, y: x.maximum(y), [(3, 4), (3, 4)], {}),
  "minimum": (lambda x, y: x.minimum(y), [(3, 4), (4,)], {}),
  "where": (lambda c, x, y: bt.where(c, x, y), [Bool((3, 4)), (3, 4), (4,)], {}),
  "copy": (lambda x: x.clone() * x, [(3, 4)], {}),
  "sum": (lambda x: x.sum((0, 2)), [(2, 3, 4)], {}),
  "amax": (lambda x: x.amax(1), [(3, 4)], {}),
  "amin": (lambda x: x.amin((0, 1), keepdim=True), [(3, 4)], {}),
  "cumsum": (lambda x: x.cumsum(1), [(3, 4)], {}),
  "view": (lambda x: x.view(2, 6) * x.view(2, 6), [(3, 4)], {}),
  "permute": (lambda x: x.permute(2, 0, 1), [(2, 3, 4)], {}),
  "expand": (lambda x: x.expand(2, 3, 4), [(3, 1)], {}),
  "slice": (lambda x: x[1:, ::2], [(3, 5)], {}),
  "slice_backward": (lambda g: _mv.slice_backward_op(g, shape=(4, 5), index=((1, 4, 1), (0, 5, 2))), [(3, 3)], {}),
  "cat": (lambda x, y: bt.cat([x, y, x], 1), [(3, 4), (3, 2)], {}),
  "index": (lambda x, i: x[i, 1:], [(5, 3), np.array([0, 4, 4, -1])], {}),
  "index_backward": (lambda g, i: _mv.index_backward_op(g, i, shape=(5, 3), positions=(0,)),
    [(4, 3), np.array([0, 4, 4, 2])], {}),
  "matmul": (lambda a, b: a @ b, [(2, 3, 4), (4, 5)], {}),
  "linear": (lambda x, w, b: ops.nn.linear_op(x, w, b) * ops.nn.linear_op(x, w), [(2, 3, 4), (5, 4), (5,)], {}),
  "softmax": (lambda x: x.softmax(-1), [(3, 4)], {}),
  "log_softmax": (lambda x: x.log_softmax(0), [(3, 4)], {}),
  "layer_norm": (lambda x, w, b: ops.layer_norm(x, (4,), w, b), [(3, 4), (4,), (4,)], {}),
  "scatter_add": (lambda x, i, s: x.scatter_add(1, i, s), [(3, 4), np.array([[0, 3], [1, 1], [2, 0]]), (3, 2)], {}),
  "scatter_reduce": (lambda x, s: bt.cat([x.scatter_reduce(1, SCATTER_AT, s, r, include_self=r != "mean") for r in
                                           REDUCTIONS]), [(3, 4), (3, 3)], {}),
  "gather": (lambda x, i: x.gather(0, i), [(3, 4), np.array([[0, 2, 2, 1], [1, 1, 0, 2]])], {}),
  # max pooling's values at fixed indices (3x3 windows at stride 2 over 5x5) and their gradient, each the other's VJP
  "max_pool2d_values": (lambda x, i: ops.nn.max_pool2d_values(x, i, **_POOL), [(2, 3, 5, 5), _POOL_IDX], {}),
  "max_pool2d_backward": (lambda g, i: ops.nn.max_pool2d_backward_op(g, i, size=(5, 5), **_POOL),
                          [(2, 3, 2, 2), _POOL_IDX], {}),
  "embedding": (lambda i, w: ops.embedding(i, w), [np.array([[1, 0], [3, 3]]), (4, 5)], {}),
  "cross_entropy": (lambda x, t: ops.cross_entropy(x, t, reduction="none"), [(4, 5), np.array([0, 4, -100, 2])], {}),
  "flash_attention": (lambda q, k, v: ops.nn.flash_attention_op(q, k, v, causal=True, scale=0.4),
    [(2, 3, 4), (2, 5, 4), (2, 5, 4)], {}),
  "flash_attention_lse": (lambda q, k, v: ops.nn.flash_attention_lse_op(q, k, v, causal=True, scale=0.4),
    [(2, 3, 4), (2, 5, 4), (2, 5, 4)], {}),
  # heads (B, H, L, E) split from one (B, L, 3 H E): q, k, v side by side (the packed backward), and v, k, q
  "flash_attention_transposed": (lambda x: bt.cat([ops.nn.flash_attention_transposed_op(
    *(q, k, v)[::1 - 2 * swap], causal=True, scale=0.4).flatten() for q, k, v in [_heads(x)] for swap in (0, 1)]),
    [(2, 3, 12)], {}),
  "conv": (lambda x, w: ops.conv(x, w, (2, 1), (1, 0), (1, 2), 2), [(2, 4, 5, 6), (4, 2, 3, 2)], {}),
  "conv_grad_input": (lambda g, w: ops.conv_transpose(g, w, (2, 4, 5, 6), (2, 1), (1, 0), (1, 2), 2),
    [(2, 4, 3, 4), (4, 2, 3, 2)], {}),
  "conv_grad_weight": (lambda g, x: ops.nn.conv_grad_weight_op(g, x, shape=(4, 2, 3), stride=(2,), padding=(1,),
                                                               dilation=(2,), groups=2), [(2, 4, 3), (2, 4, 7)], {}),
  "lstm_cell": (lambda gi, gh, c: ops.nn.lstm_cell_op(gi, gh, c), [(3, 8), (3, 8), (3, 2)], {}),
  # the training form (statistics of x, which the finite differences move with x) plus the eval form (constants)
  "batch_norm": (lambda x, w, b: ops.nn.batch_norm(x, *ops.nn.batch_norm_stats(x), w, b, 1e-3, True) * 2 +
                 ops.nn.batch_norm(x, bt.tensor([0.5, -1.0, 0.25]), bt.tensor([0.5, 1.0, 2.0]), w, b, 1e-3, False),
                 [(4, 3, 5), (3,), (3,)], {}),
  "gru_cell": (lambda gi, gh, h: ops.gru_cell(gi, gh, h), [(3, 6), (3, 6), (3, 2)], {}),
  "lstm_sequence": (lambda gi, h0, c0, w, b: bt.cat([ops.nn.lstm_sequence_op(gi, h0, c0, w, b, reverse=r) for r in
                                                     (False, True)]), [(5, 2, 12), (2, 3), (2, 3), (12, 3), (12,)],
                    dict(low=-1.0, high=1.0)),
  "gru_sequence": (lambda gi, h0, w, b: bt.cat([ops.nn.gru_sequence_op(gi, h0, w, b, reverse=r) for r in
                                                (False, True)]), [(5, 2, 9), (2, 3), (9, 3), (9,)], dict(low=-1.0, high=1.0)),
  "dropout": (lambda x: ops.dropout(x, 0.4, generator=bt.Generator().manual_seed(3)), [(6, 7)], {}),  # the same draws
  # a group of one rank here; tests/distributed/test_mpi.py checks the gradients of 3 ranks against the math
  "all_reduce": (lambda x: ops.collective.all_reduce(x * x, "avg", LOOPBACK, 1), [(3, 4)], {}),
  "reduce_scatter": (lambda x: ops.collective.reduce_scatter(x.exp(), "avg", LOOPBACK, 1), [(3, 4)], {}),
  "all_gather": (lambda x: ops.collective.all_gather(x.sin(), LOOPBACK, 1), [(3, 4)], {}),
}


@pytest.mark.parametrize("name", VJP_CASES)
def test_vjp_finite_differences(name):
  fn, specs, kw = VJP_CASES[name]
  check_vjp(fn, specs, **kw)


def test_vjp_cast():
  check_vjp(lambda x: x.to(bt.float32).to(bt.float64) * 3, [(3, 4)], eps=1e-2, rtol=1e-5, atol=1e-5)


def _heads(x):
  """q, k, v of 2 heads, each (B, H, L, E), as views of the three column blocks of x (B, L, 3 H E)."""
  B, L, C3 = x.shape
  return tuple(t.view(B, L, 2, C3 // 6).transpose(1, 2) for t in x.split(C3 // 3, dim=2))


def test_every_primitive_with_a_vjp_is_checked():
  differentiable = {n for n, o in ops.registry.items() if o.vjp is not None and o.differentiable}
  covered = set(VJP_CASES) | {"cast", "to_device"}  # to_device needs a second device
  assert differentiable <= covered, f"primitives without a finite-difference check: {sorted(differentiable - covered)}"


# *** bad inputs: errors name the op, the shapes or dtypes, and what was expected ***

_x = lambda: bt.randn(2, 3)
BAD_INPUTS = {
  "matmul_shapes": (lambda: _x() @ bt.randn(4, 5),
    ValueError, r"matmul: cannot contract \(2, 3\) with \(4, 5\): 3 != 4"),
  "matmul_batch": (lambda: bt.randn(2, 2, 3) @ bt.randn(3, 3, 4),
    ValueError, r"matmul.*\(2, 2, 3\).*\(3, 3, 4\).*broadcast"),
  "matmul_dtype": (lambda: _x() @ bt.randn(3, 2, dtype=bt.float64), TypeError, "matmul:.*float32 and float64"),
  "matmul_0d": (lambda: _x() @ bt.tensor(1.0), ValueError, "matmul:.*at least 1 dimension"),
  "add_broadcast": (lambda: _x() + bt.randn(4, 5), ValueError, r"add: shapes \(2, 3\) and \(4, 5\) cannot broadcast"),
  "mul_broadcast": (lambda: bt.randn(2, 3, 4) * bt.randn(3, 3), ValueError, r"mul: shapes \(2, 3, 4\) and \(3, 3\)"),
  "lt_broadcast": (lambda: _x() < bt.randn(4), ValueError, r"lt: shapes \(2, 3\) and \(4,\)"),
  "where_broadcast": (lambda: bt.where(bt.ones(5, dtype=bt.bool), _x(), 0.0), ValueError, r"where: shapes \(5,\)"),
  "where_cond": (lambda: bt.where(_x(), _x(), 0.0), TypeError, "where: condition must be a bool tensor"),
  "masked_fill": (lambda: _x().masked_fill(bt.ones(4, dtype=bt.bool), 0.0),
    ValueError, r"masked_fill: shapes \(4,\) and \(2, 3\)"),
  "cat_shapes": (lambda: bt.cat([_x(), bt.randn(4, 5)]), ValueError, r"cat: shapes \[\(2, 3\), \(4, 5\)\] differ"),
  "cat_ndim": (lambda: bt.cat([_x(), bt.randn(3)]), ValueError, r"cat: shapes \[\(2, 3\), \(3,\)\]"),
  "cat_empty": (lambda: bt.cat([]), ValueError, "cat: expected a non-empty list"),
  "stack_shapes": (lambda: bt.stack([_x(), bt.randn(3, 2)]), ValueError, r"stack:.*\(2, 3\)"),
  "view_numel": (lambda: _x().view(4), ValueError, r"view: shape \(4,\) is invalid for input of shape \(2, 3\)"),
  "view_layout": (lambda: _x().T.view(6), RuntimeError, r"view:.*strides.*reshape"),
  "reshape_two_minus_one": (lambda: _x().reshape(-1, -1), ValueError, "reshape: only one dimension can be -1"),
  "permute": (lambda: _x().permute(0, 0), ValueError, r"permute: \(0, 0\) is not a permutation"),
  "expand": (lambda: _x().expand(4, 3), ValueError, r"expand: cannot expand shape \(2, 3\) to \(4, 3\)"),
  "expand_new_minus_one": (lambda: bt.ones(3).expand(-1, 3), ValueError, "expand: -1 .* new leading dim"),
  "flatten_order": (lambda: _x().flatten(1, 0), ValueError, "flatten: start_dim 1 comes after end_dim 0"),
  "dim_range": (lambda: _x().sum(2), IndexError, r"sum: dimension 2 out of range.*\[-2, 1\]"),
  "dim_repeated": (lambda: _x().sum((0, -2)), ValueError, "sum: dimension repeated"),
  "softmax_dim": (lambda: _x().softmax(-3), IndexError, "softmax: dimension -3 out of range"),
  "index_int": (lambda: _x()[2], IndexError, "index 2 is out of bounds for dimension 0 with size 2"),
  "index_negative": (lambda: _x()[0, -4], IndexError, "index -4 is out of bounds for dimension 1 with size 3"),
  "index_tensor": (lambda: _x()[:, bt.tensor([0, 3])],
    IndexError, "index 3 is out of bounds for dimension 1 with size 3"),
  "index_tensor_negative": (lambda: _x()[bt.tensor([-3])],
    IndexError, "index -3 is out of bounds for dimension 0 with size 2"),
  "index_too_many": (lambda: _x()[0, 0, 0], IndexError, "too many indices for a tensor of dimension 2"),
  "index_float": (lambda: _x()[bt.tensor([0.5])], TypeError, "must be integer, got float32"),
  "index_type": (lambda: _x()["a"], TypeError, "unsupported index of type str"),
  "index_mask": (lambda: _x()[bt.ones(3, dtype=bt.bool)], IndexError, r"mask of shape \(3,\) does not match.*\(2,\)"),
  "setitem_shape": (lambda: _x().__setitem__(0, bt.ones(4)), ValueError, r"setitem: a value of shape \(4,\).*\(3,\)"),
  "gather_range": (lambda: _x().gather(1, bt.tensor([[0, 5]])),
    IndexError, "gather: index 5 is out of bounds for dimension 1 with size 3"),
  "gather_float": (lambda: _x().gather(1, bt.tensor([[0.0]])), TypeError, "gather: index must be an integer tensor"),
  "scatter_range": (lambda: _x().scatter_add(0, bt.tensor([[0, 7, 1]]), bt.ones(1, 3)),
    IndexError, "scatter_add: index 7.*dimension 0 with size 2"),
  "scatter_reduce_range": (lambda: _x().scatter_reduce(1, bt.tensor([[0, 3]]), bt.ones(1, 2), "amax"),
    IndexError, "scatter_reduce: index 3.*dimension 1 with size 3"),
  "scatter_reduce_mode": (lambda: _x().scatter_reduce(1, bt.tensor([[0]]), bt.ones(1, 2), "max"),
    RuntimeError, "scatter_reduce: reduce must be one of sum, prod, mean, amax, amin, got 'max'"),
  "scatter_reduce_dtype": (lambda: _x().scatter_reduce(1, bt.tensor([[0]]), bt.ones(1, 2, dtype=bt.float64), "sum"),
    RuntimeError, "scatter_reduce: src must be a tensor of the input's dtype float32, got float64"),
  "scatter_reduce_shape": (lambda: _x().scatter_reduce(0, bt.tensor([[0, 1, 1, 0]]), bt.ones(2, 4), "sum"),
    RuntimeError, r"scatter_reduce: index \(1, 4\) must be no larger than src \(2, 4\), and no larger than input \(2, 3\)"),
  "embedding_range": (lambda: ops.embedding(bt.tensor([0, 9]), bt.randn(4, 3)),
    IndexError, "embedding: index 9 is out of bounds for dimension 0 with size 4"),
  "index_select_range": (lambda: _x().index_select(1, bt.tensor([3])),
    IndexError, "index 3 is out of bounds for dimension 1 with size 3"),
  "cross_entropy_target": (lambda: ops.cross_entropy(bt.randn(3, 5), bt.tensor([0, 5, 1])),
    IndexError, "cross_entropy: target 5 is out of bounds for 5 classes"),
  "cross_entropy_negative": (lambda: ops.cross_entropy(bt.randn(3, 5), bt.tensor([0, -3, 1])),
    IndexError, "cross_entropy: target -3 is out of bounds"),
  "cross_entropy_shape": (lambda: ops.cross_entropy(bt.randn(3, 5), bt.tensor([0, 1])),
    ValueError, r"cross_entropy: target of shape \(2,\).*\(3, 5\)"),
  "cross_entropy_dtype": (lambda: ops.cross_entropy(bt.randn(3, 5), bt.randn(3)),
    TypeError, "cross_entropy: index must be an integer tensor"),
  "layer_norm": (lambda: ops.layer_norm(_x(), (4,)), ValueError, r"layer_norm: normalized_shape \(4,\).*\(2, 3\)"),
  "layer_norm_weight": (lambda: ops.layer_norm(_x(), (3,), bt.ones(4)),
    ValueError, r"layer_norm: weight of shape \(4,\)"),
  "rms_norm": (lambda: ops.rms_norm(_x(), (4,)), ValueError, r"rms_norm: normalized_shape \(4,\)"),
  "split_sizes": (lambda: _x().split([1, 3], 1), ValueError, "split: sizes .* do not add up to dimension 1 of size 3"),
  "split_zero": (lambda: _x().split(0), ValueError, "split: split_size must be positive"),
  "chunk_zero": (lambda: _x().chunk(0), ValueError, "chunk: the number of chunks must be positive"),
  "narrow": (lambda: _x().narrow(1, 2, 3), IndexError, "narrow: start 2 \\+ length 3 exceeds dimension 1 of size 3"),
  "sdpa": (lambda: ops.scaled_dot_product_attention(bt.randn(2, 4), bt.randn(3, 5), bt.randn(3, 5)),
    ValueError, "scaled_dot_product_attention: incompatible shapes"),
  "pow_int_negative": (lambda: bt.tensor([2]) ** -1, RuntimeError, "pow: integers to negative integer powers"),
  "tensor_ragged": (lambda: bt.tensor([[1, 2], [3]]), ValueError, "tensor: nested sequences of unequal lengths"),
  "size_type": (lambda: bt.zeros("a"), TypeError, "expected a size made of ints"),
  "negative_size": (lambda: bt.zeros(2, -1), ValueError, "negative dimension"),
  "item": (lambda: _x().item(), RuntimeError, r"item\(\): a tensor with 6 elements"),
  "mean_int": (lambda: bt.tensor([1, 2]).mean(), RuntimeError, "mean: expected a floating point tensor"),
  "bitwise_float": (lambda: _x() & _x(), NotImplementedError, "bitwise_and: defined for integer and bool tensors, got float32"),
  "invert_float": (lambda: ~_x(), TypeError, "bitwise_not: defined for integer and bool tensors, got float32"),
  "shift_bool": (lambda: bt.tensor([True]) << bt.tensor([True]), NotImplementedError, "bitwise_left_shift: not defined for bool"),
  "amax_empty": (lambda: bt.zeros(0, 2).amax(0), IndexError, r"amax: cannot reduce over an empty dimension.*\(0, 2\)"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_messages(name):
  fn, exc, pattern = BAD_INPUTS[name]
  with pytest.raises(exc, match=pattern) as info:
    fn()
  raised_in = info.traceback[-1].path
  assert "blutrain" in str(raised_in) and "numpy" not in str(raised_in), f"raised in {raised_in}, not by a check"
