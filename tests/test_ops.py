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
from tests.helpers import TOLS, TORCH_DTYPES, Bool, Int, assert_close, check_vjp, helper_test_op

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
  "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), lambda x: ops.gelu(x, approximate="tanh"), {"low": -4.0, "high": 4.0}),
  "silu": (lambda x: F.silu(x), lambda x: ops.silu(x), {}),
  "erf": (lambda x: x.erf(), None, {"low": -3.0, "high": 3.0}),
  "square": (lambda x: x.square(), None, {}),
  "reciprocal": (lambda x: x.reciprocal(), None, {"low": 0.5, "high": 2.0}),
  "sign": (lambda x: x.sign(), None, {}),
  "floor": (lambda x: x.floor(), None, {}),
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


def test_compare_ties():
  helper_test_op([np.array([1.0, 2.0, 3.0, 2.0]), np.array([2.0, 2.0, 1.0, 2.0])], lambda x, y: x <= y, grad=False)


@pytest.mark.parametrize("shapes", [((3, 4), (3, 4), (3, 4)), ((3, 1), (1, 4), (4,)), ((), (2, 3), ()), ((0, 2), (2,), (1, 2))])
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
  dims = data.draw(st.lists(st.integers(-len(shape), len(shape) - 1), unique_by=lambda d: d % len(shape), max_size=len(shape)))
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
@pytest.mark.parametrize("kw", [{}, {"dim": 0}, {"dim": 1, "keepdim": True}, {"dim": -1}])
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
