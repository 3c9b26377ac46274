"""Elementwise primitives (unary, binary with broadcasting, compare, where, cast) and their composites."""
from __future__ import annotations

import math
from typing import Callable

from blutrain import dtypes
from blutrain.autograd.tape import grad_mode, hooks, record as tape_record
from blutrain.dtypes import DType, DTypeError, UnsupportedDType
from blutrain.ops.core import op
from blutrain.shapes import ShapeError, broadcast_shapes
from blutrain.ops.creation import as_tensor_like, ones_like, scalar_operand, zeros_like
from blutrain.tensor import Tensor


def _same(x, **_): return x.shape, x.dtype


def floating(x: Tensor) -> Tensor:
  """Integer and bool inputs of float functions (exp, sqrt, ...) are promoted to float32, as in PyTorch."""
  return x if x.dtype.is_floating_point else x.to(dtypes.default_float)


# *** unary ***

neg_op = op("neg", _same, lambda g, out, x: (-g,), saves=(), inputs="x")
exp_op = op("exp", _same, lambda g, out, x: (g * out,), saves=(), saves_output=True, inputs="x")
log_op = op("log", _same, lambda g, out, x: (g / x,), inputs="x")
sqrt_op = op("sqrt", _same, lambda g, out, x: (g / (2 * out),), saves=(), saves_output=True, inputs="x")
rsqrt_op = op("rsqrt", _same, lambda g, out, x: (-0.5 * g * out * out * out,), saves=(), saves_output=True, inputs="x")
abs_op = op("abs", _same, lambda g, out, x: (g * sign(x),), inputs="x")
sin_op = op("sin", _same, lambda g, out, x: (g * cos(x),), inputs="x")
cos_op = op("cos", _same, lambda g, out, x: (-g * sin(x),), inputs="x")
tanh_op = op("tanh", _same, lambda g, out, x: (g * (1 - out * out),), saves=(), saves_output=True, inputs="x")
sigmoid_op = op("sigmoid", _same, lambda g, out, x: (g * out * (1 - out),), saves=(), saves_output=True, inputs="x")
# relu's gradient in one op, PyTorch's threshold_backward at 0: 0 where y <= 0, else g (so a NaN y passes g)
relu_backward_op = op("relu_backward", lambda g, y: (broadcast_shapes(g.shape, y.shape, op="relu_backward"), g.dtype),
                      inputs="g y")
relu_op = op("relu", _same, lambda g, out, x: (relu_backward_op(g, out),), saves=(), saves_output=True, inputs="x")
erf_op = op("erf", _same, lambda g, out, x: (g * (2 / math.sqrt(math.pi)) * exp(-x * x),), inputs="x")
sign_op = op("sign", _same, lambda g, out, x: (zeros_like_grad(g),), saves=(), inputs="x")
floor_op = op("floor", _same, lambda g, out, x: (zeros_like_grad(g),), saves=(), inputs="x")
tan_op = op("tan", _same, lambda g, out, x: (g * (1 + out * out),), saves=(), saves_output=True, inputs="x")
asin_op = op("asin", _same, lambda g, out, x: (g * rsqrt(1 - x * x),), inputs="x")
acos_op = op("acos", _same, lambda g, out, x: (-g * rsqrt(1 - x * x),), inputs="x")
atan_op = op("atan", _same, lambda g, out, x: (g / (1 + x * x),), inputs="x")
sinh_op = op("sinh", _same, lambda g, out, x: (g * cosh_op(x),), inputs="x")
cosh_op = op("cosh", _same, lambda g, out, x: (g * sinh_op(x),), inputs="x")
asinh_op = op("asinh", _same, lambda g, out, x: (g * rsqrt(x * x + 1),), inputs="x")
acosh_op = op("acosh", _same, lambda g, out, x: (g * rsqrt(x * x - 1),), inputs="x")
atanh_op = op("atanh", _same, lambda g, out, x: (g / (1 - x * x),), inputs="x")
exp2_op = op("exp2", _same, lambda g, out, x: (g * out * math.log(2),), saves=(), saves_output=True, inputs="x")
log2_op = op("log2", _same, lambda g, out, x: (g / (x * math.log(2)),), inputs="x")
log10_op = op("log10", _same, lambda g, out, x: (g / (x * math.log(10)),), inputs="x")
log1p_op = op("log1p", _same, lambda g, out, x: (g / (x + 1),), inputs="x")
expm1_op = op("expm1", _same, lambda g, out, x: (g * (out + 1),), saves=(), saves_output=True, inputs="x")
ceil_op = op("ceil", _same, lambda g, out, x: (zeros_like_grad(g),), saves=(), inputs="x")
trunc_op = op("trunc", _same, lambda g, out, x: (zeros_like_grad(g),), saves=(), inputs="x")
round_op = op("round", _same, lambda g, out, x: (zeros_like_grad(g),), saves=(), inputs="x")  # half to even
gelu_backward_op = op("gelu_backward", lambda g, x, approximate: (x.shape, x.dtype), inputs="g x", attrs="approximate:str")
gelu_op = op("gelu", lambda x, approximate: (x.shape, x.dtype),
             lambda g, out, x, approximate: (gelu_backward_op(g, x, approximate=approximate),),
               inputs="x", attrs="approximate:str")


def _no_bool(x: Tensor, name: str) -> Tensor:
  if x.dtype is dtypes.bool_:
    raise UnsupportedDType(f"{name}: not defined for bool tensors (as in PyTorch); use ~x / logical_not to invert a "
                           f"mask, or convert first with .to(...)")
  return x


def neg(x: Tensor, *, into: Tensor | None = None) -> Tensor: return neg_op(_no_bool(x, "neg"), into=into)
def abs(x: Tensor, *, into: Tensor | None = None) -> Tensor: return abs_op(_no_bool(x, "abs"), into=into)
def relu(x: Tensor, *, into: Tensor | None = None) -> Tensor: return relu_op(_no_bool(x, "relu"), into=into)
def exp(x: Tensor, *, into: Tensor | None = None) -> Tensor: return exp_op(floating(x), into=into)
def log(x: Tensor) -> Tensor: return log_op(floating(x))
def sqrt(x: Tensor, *, into: Tensor | None = None) -> Tensor: return sqrt_op(floating(x), into=into)
def rsqrt(x: Tensor) -> Tensor: return rsqrt_op(floating(x))
def sin(x: Tensor) -> Tensor: return sin_op(floating(x))
def cos(x: Tensor) -> Tensor: return cos_op(floating(x))
def tanh(x: Tensor) -> Tensor: return tanh_op(floating(x))
def sigmoid(x: Tensor) -> Tensor: return sigmoid_op(floating(x))
def erf(x: Tensor) -> Tensor: return erf_op(floating(x))
def floor(x: Tensor) -> Tensor: return floor_op(x) if x.dtype.is_floating_point else copy(_no_bool(x, "floor"))
def ceil(x: Tensor) -> Tensor: return ceil_op(x) if x.dtype.is_floating_point else copy(_no_bool(x, "ceil"))
def trunc(x: Tensor) -> Tensor: return trunc_op(x) if x.dtype.is_floating_point else copy(_no_bool(x, "trunc"))
def tan(x: Tensor) -> Tensor: return tan_op(floating(x))
def asin(x: Tensor) -> Tensor: return asin_op(floating(x))
def acos(x: Tensor) -> Tensor: return acos_op(floating(x))
def atan(x: Tensor) -> Tensor: return atan_op(floating(x))
def sinh(x: Tensor) -> Tensor: return sinh_op(floating(x))
def cosh(x: Tensor) -> Tensor: return cosh_op(floating(x))
def asinh(x: Tensor) -> Tensor: return asinh_op(floating(x))
def acosh(x: Tensor) -> Tensor: return acosh_op(floating(x))
def atanh(x: Tensor) -> Tensor: return atanh_op(floating(x))
def exp2(x: Tensor) -> Tensor: return exp2_op(floating(x))
def log2(x: Tensor) -> Tensor: return log2_op(floating(x))
def log10(x: Tensor) -> Tensor: return log10_op(floating(x))
def log1p(x: Tensor) -> Tensor: return log1p_op(floating(x))
def expm1(x: Tensor) -> Tensor: return expm1_op(floating(x))


def round(x: Tensor, decimals: int = 0) -> Tensor:
  """Round half to even, at `decimals` places (negative: tens, hundreds...) as PyTorch: round(x * 10^d) / 10^d."""
  if not x.dtype.is_floating_point: return copy(_no_bool(x, "round"))
  if not decimals: return round_op(x)
  return round_op(x * 10.0 ** decimals) / 10.0 ** decimals if decimals > 0 else \
    round_op(x / 10.0 ** -decimals) * 10.0 ** -decimals


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
  """GELU: x * Phi(x) (`approximate="none"`, erf) or its tanh approximation (`approximate="tanh"`)."""
  if approximate not in ("none", "tanh"): raise ShapeError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
  if not x.dtype.is_floating_point:
    raise UnsupportedDType(f"gelu: expected a floating point tensor, got {x.dtype.name} (as PyTorch); convert with .float()")
  return gelu_op(x, approximate=approximate)


def zeros_like_grad(g: Tensor) -> Tensor: return g * 0
def silu(x: Tensor) -> Tensor: return x * sigmoid(x)                         # x * sigmoid(x)
def sign(x: Tensor) -> Tensor: return sign_op(x) if x.dtype is not dtypes.bool_ else copy(x)  # sign(nan) = 0, as torch
def square(x: Tensor) -> Tensor: return x * x
def reciprocal(x: Tensor) -> Tensor: return 1 / floating(x)


# *** binary ***

def _binary_rule(name: str, out_dtype: DType | None = None):
  """The rule of a broadcasting binary op; its errors name the op."""
  return lambda x, y, **_: (broadcast_shapes(x.shape, y.shape, op=name), out_dtype or x.dtype)


def _unbroadcast(g: Tensor, x) -> Tensor:
  """Sum a broadcast gradient back to the input's shape."""
  return g if g.shape == tuple(x.shape) else g.sum_to_size(x.shape)


def _binary_vjp(dx: Callable, dy: Callable) -> Callable:
  """A binary op's VJP from its two gradients at the broadcast shape (each a function of g, out, x, y), computing
  only those its inputs need: `x * 0.5` costs no product with x and no sum to a scalar in backward."""
  return lambda g, out, x, y, needs=(True, True): (_unbroadcast(dx(g, out, x, y), x) if needs[0] else None,
                                                   _unbroadcast(dy(g, out, x, y), y) if needs[1] else None)


def _extremum_vjp(less: bool):
  """maximum's VJP (`less`: minimum's): ties split the gradient evenly and a nan on either side passes all of it to
  both, as PyTorch's."""
  def vjp(g, out, x, y):
    gx = where(x == y, g * 0.5, g)
    lose_x, lose_y = (x > y, x < y) if less else (x < y, x > y)
    return _unbroadcast(where(lose_x, 0.0, gx), x), _unbroadcast(where(lose_y, 0.0, gx), y)
  return vjp


add_op = op("add", _binary_rule("add"), _binary_vjp(lambda g, out, x, y: g, lambda g, out, x, y: g), saves=(),
            inputs="x y")
sub_op = op("sub", _binary_rule("sub"), _binary_vjp(lambda g, out, x, y: g, lambda g, out, x, y: -g), saves=(),
            inputs="x y")
mul_op = op("mul", _binary_rule("mul"), _binary_vjp(lambda g, out, x, y: g * y, lambda g, out, x, y: g * x),
            inputs="x y")
div_op = op("div", _binary_rule("div"), _binary_vjp(lambda g, out, x, y: g / y, lambda g, out, x, y: -g * out / y),
            saves=(1,), saves_output=True, inputs="x y")

# PyTorch's edges of pow: d/dx is 0 where y == 0 (even at x = 0); d/dy is 0 where x == 0 and y >= 0, and out * log(x)
# elsewhere (nan for a negative base, -inf for 0 ** negative).
_pow_vjp = _binary_vjp(lambda g, out, x, y: g * where(y == 0, 0.0, y * pow_op(x, y - 1)),
                       lambda g, out, x, y: g * where((x == 0) & (y >= 0), 0.0, out * log_op(x)))


pow_op = op("pow", _binary_rule("pow"), _pow_vjp, saves_output=True, inputs="x y")


def _atan2_vjp(g, out, x, y):
  """0 at the origin, as PyTorch's."""
  r2 = x * x + y * y
  scale = where(r2 == 0, 0.0, g / r2)
  return _unbroadcast(scale * y, x), _unbroadcast(-scale * x, y)


atan2_op = op("atan2", _binary_rule("atan2"), _atan2_vjp, inputs="x y")
# integer division by 0 raises on the CPU, as PyTorch; C's semantics for remainder and truncation, Python's for floor
fmod_op = op("fmod", _binary_rule("fmod"), lambda g, out, x, y: (
  _unbroadcast(g, x), _unbroadcast(-g * trunc_op(x / y), y)), inputs="x y")
remainder_op = op("remainder", _binary_rule("remainder"), lambda g, out, x, y: (
  _unbroadcast(g, x), _unbroadcast(-g * floor_divide_op(x, y), y)), inputs="x y")
floor_divide_op = op("floor_divide", _binary_rule("floor_divide"), lambda g, out, x, y: (
  _unbroadcast(zeros_like_grad(g), x), _unbroadcast(zeros_like_grad(g), y)), saves=(), inputs="x y")
copysign_op = op("copysign", _binary_rule("copysign"), lambda g, out, x, y: (
  _unbroadcast(g * where(x == 0, 0.0, out / x), x), _unbroadcast(zeros_like_grad(g), y)), saves=(0,),
    saves_output=True, inputs="x y")
maximum_op = op("maximum", _binary_rule("maximum"), _extremum_vjp(False), inputs="x y")
minimum_op = op("minimum", _binary_rule("minimum"), _extremum_vjp(True), inputs="x y")

_cmp = {name: op(name, _binary_rule(name, dtypes.bool_), differentiable=False, inputs="x y")
        for name in ("eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor")}
# integer (and bool) bitwise ops; shifts by a negative amount or past the width give 0 (the sign for >>), as PyTorch
_bitwise = {name: op(name, _binary_rule(name), differentiable=False, inputs="x y")
            for name in ("bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift")}
bitwise_not_op = op("bitwise_not", _same, differentiable=False, inputs="x")
logical_not_op = op("logical_not", lambda x: (x.shape, dtypes.bool_), differentiable=False, inputs="x")


def operands(op_name: str, *xs, dtype: DType | None = None, commutes: bool = False) -> list[Tensor] | tuple:
  """Bring tensors and Python numbers to one dtype (PyTorch's promotion) and one device; numbers become CPU scalars
  that kernels take by value (`scalar_operand`). For an op that `commutes`, two float tensors of which one has the
  promoted dtype stay as they are, that one first (`_mixed_floats`)."""
  if dtype is None and len(xs) == 2:  # the common cases first: two tensors of one dtype, a float tensor and a number
    x, y = xs
    if isinstance(x, Tensor):
      if isinstance(y, Tensor):
        if x.dtype is y.dtype: return xs
      elif y.__class__ in (int, float) and x.dtype.category == 2: return x, scalar_operand(y, x.dtype, x.device)
  if commutes and (pair := _mixed_floats(*xs)): return pair
  dt = dtype or dtypes.result_type(*xs)
  like = next((x for x in xs if isinstance(x, Tensor)), None)
  if like is None: raise TypeError(f"{op_name}: expected at least one tensor, got {[type(x).__name__ for x in xs]}")
  out = []
  for x in xs:
    if isinstance(x, Tensor): out.append(x if x.dtype is dt else x.to(dt))
    elif isinstance(x, (bool, int, float)): out.append(scalar_operand(x, dt, like.device))
    else: raise TypeError(f"{op_name}: unsupported operand of type {type(x).__name__}")
  return out


def _scaled(y, alpha):
  """alpha * y, skipped for a Python 1 (alpha may be a tensor, e.g. a compiled step's learning rate)."""
  return y if alpha.__class__ is int and alpha == 1 or not isinstance(alpha, Tensor) and alpha == 1 else y * alpha


# `into`, here and below: a tensor that may receive the result in place of a new one (in-place methods pass theirs,
# see `ops.inplace` and `ops.core.apply`); the tensor returned holds the result either way

def _mixed_floats(x, y) -> tuple[Tensor, Tensor] | None:
  """(the operand of the promoted dtype, the other) when x and y are float tensors of two dtypes one of which is their
  promotion (float32 and bfloat16), neither 0-d, in eager mode: a kernel reading each operand in its own dtype then
  computes in the promoted one exactly as after a cast, with no cast op or kernel (under a capture Nova's own passes
  fold the casts)."""
  if not (isinstance(x, Tensor) and isinstance(y, Tensor)) or x.dtype is y.dtype or hooks.trace is not None: return None
  if not (x.dtype.is_floating_point and y.dtype.is_floating_point and x.shape and y.shape): return None
  dt = dtypes.result_type(x, y)
  return (x, y) if dt is x.dtype else (y, x) if dt is y.dtype else None


def add(x, y, *, alpha=1, into: Tensor | None = None) -> Tensor:
  """x + alpha * y, broadcasting."""
  if alpha.__class__ is not int or alpha != 1: return add_op(*operands("add", x, _scaled(y, alpha)), into=into)
  return add_op(*operands("add", x, y, commutes=into is None), into=into)  # IEEE addition commutes


def sub(x, y, *, alpha=1, into: Tensor | None = None) -> Tensor:
  """x - alpha * y, broadcasting."""
  return sub_op(*operands("sub", x, _scaled(y, alpha)), into=into)


def mul(x, y, *, into: Tensor | None = None) -> Tensor: return mul_op(*operands("mul", x, y), into=into)


def div(x, y, *, rounding_mode: str | None = None, into: Tensor | None = None) -> Tensor:
  """True division (integer inputs give float32); `rounding_mode="trunc"` rounds toward zero and `"floor"` down,
  in the inputs' dtype, as PyTorch."""
  if rounding_mode == "floor": return floor_divide(x, y)
  if rounding_mode == "trunc":
    if dtypes.result_type(x, y).is_floating_point: return trunc(div(x, y))
    q, r = floor_divide(x, y), remainder(x, y)
    return q + ((q < 0) & (r != 0)).to(q.dtype)  # floor is one below trunc for inexact negative quotients
  if rounding_mode is not None:
    raise ShapeError(f"div: rounding_mode must be None, 'trunc' or 'floor', got {rounding_mode!r}")
  dt = dtypes.result_type(x, y)
  return div_op(*operands("div", x, y, dtype=dt if dt.is_floating_point else dtypes.default_float), into=into)


def pow(x, y, *, into: Tensor | None = None) -> Tensor:
  """x ** y; an integer base with a float exponent gives float32."""
  if isinstance(y, int) and y < 0 and isinstance(x, Tensor) and not x.dtype.is_floating_point:
    raise ShapeError(f"pow: integers to negative integer powers are not allowed ({x.dtype.name} ** {y}); use a float base")
  return pow_op(*operands("pow", x, y), into=into)


def atan2(x, y) -> Tensor: return atan2_op(*_float_operands("atan2", x, y))
def copysign(x, y) -> Tensor: return copysign_op(*_float_operands("copysign", x, y))
def fmod(x, y) -> Tensor: return fmod_op(*_no_bools("fmod", x, y))
def remainder(x, y) -> Tensor: return remainder_op(*_no_bools("remainder", x, y))
def floor_divide(x, y) -> Tensor: return floor_divide_op(*_no_bools("floor_divide", x, y))


def _float_operands(name: str, x, y) -> list:
  dt = dtypes.result_type(x, y)
  return operands(name, x, y, dtype=dt if dt.is_floating_point else dtypes.default_float)


def _no_bools(name: str, x, y) -> list:
  xs = operands(name, x, y)
  return [_no_bool(t, name) for t in xs]


def logaddexp(x, y) -> Tensor:
  """log(exp(x) + exp(y)), without overflow; equal infinities give themselves, as PyTorch."""
  x, y = _float_operands("logaddexp", x, y)
  m = maximum(x, y)
  return where(isinf(m) & (x == y), x, m + log1p(exp(-abs_op(x - y))))


def maximum(x, y) -> Tensor: return maximum_op(*operands("maximum", x, y))
def minimum(x, y) -> Tensor: return minimum_op(*operands("minimum", x, y))
def eq(x, y) -> Tensor: return _cmp["eq"](*operands("eq", x, y))
def ne(x, y) -> Tensor: return _cmp["ne"](*operands("ne", x, y))
def lt(x, y) -> Tensor: return _cmp["lt"](*operands("lt", x, y))
def le(x, y) -> Tensor: return _cmp["le"](*operands("le", x, y))
def gt(x, y) -> Tensor: return _cmp["gt"](*operands("gt", x, y))
def ge(x, y) -> Tensor: return _cmp["ge"](*operands("ge", x, y))
def logical_and(x, y) -> Tensor: return _cmp["logical_and"](*operands("logical_and", x, y, dtype=dtypes.bool_))
def logical_or(x, y) -> Tensor: return _cmp["logical_or"](*operands("logical_or", x, y, dtype=dtypes.bool_))
def logical_xor(x, y) -> Tensor: return _cmp["logical_xor"](*operands("logical_xor", x, y, dtype=dtypes.bool_))
def logical_not(x: Tensor) -> Tensor: return logical_not_op(x.to(dtypes.bool_))


def _integers(name: str, *xs) -> list:
  out = operands(name, *xs)
  if out[0].dtype.is_floating_point:
    raise UnsupportedDType(f"{name}: defined for integer and bool tensors, got {out[0].dtype.name} (as PyTorch)")
  return out


def bitwise_and(x, y) -> Tensor: return _bitwise["bitwise_and"](*_integers("bitwise_and", x, y))
def bitwise_or(x, y) -> Tensor: return _bitwise["bitwise_or"](*_integers("bitwise_or", x, y))
def bitwise_xor(x, y) -> Tensor: return _bitwise["bitwise_xor"](*_integers("bitwise_xor", x, y))
def bitwise_not(x: Tensor) -> Tensor: return bitwise_not_op(*_integers("bitwise_not", x))


def bitwise_left_shift(x, y) -> Tensor:
  x, y = _integers("bitwise_left_shift", x, y)
  if x.dtype is dtypes.bool_: raise UnsupportedDType("bitwise_left_shift: not defined for bool tensors (as PyTorch)")
  return _bitwise["bitwise_left_shift"](x, y)


def bitwise_right_shift(x, y) -> Tensor:
  x, y = _integers("bitwise_right_shift", x, y)
  if x.dtype is dtypes.bool_: raise UnsupportedDType("bitwise_right_shift: not defined for bool tensors (as PyTorch)")
  return _bitwise["bitwise_right_shift"](x, y)
def isnan(x: Tensor) -> Tensor: return x != x
def isinf(x: Tensor) -> Tensor: return abs_op(x) == float("inf") if x.dtype.is_floating_point else zeros_like(x, dtype=dtypes.bool_)
def isfinite(x: Tensor) -> Tensor: return (x == x) & (abs_op(x) < float("inf")) if x.dtype.is_floating_point else ones_like(x, dtype=dtypes.bool_)


# *** where, cast, copy ***

def _where_rule(c, x, y):
  return broadcast_shapes(c.shape, x.shape, y.shape, op="where"), x.dtype


where_op = op("where", _where_rule, lambda g, out, c, x, y, needs=(False, True, True): (
  None, _unbroadcast(where_op(c, g, zeros_like(g)), x) if needs[1] else None,
  _unbroadcast(where_op(c, zeros_like(g), g), y) if needs[2] else None), saves=(0,), inputs="c x y")


def where(condition: Tensor, x, y, *, into: Tensor | None = None) -> Tensor:
  """Elementwise `x if condition else y`, broadcasting all three."""
  if not isinstance(condition, Tensor) or condition.dtype is not dtypes.bool_:
    raise DTypeError(f"where: condition must be a bool tensor, got {getattr(condition, 'dtype', type(condition).__name__)}")
  if not isinstance(x, Tensor) and not isinstance(y, Tensor):
    x = scalar_operand(x, dtypes.result_type(x, y), condition.device)
  x, y = operands("where", x, y)
  return where_op(condition, x, y, into=into)


cast_op = op("cast", lambda x, dtype: (x.shape, dtype), lambda g, out, x, dtype: (g.to(x.dtype),), saves=(),
             inputs="x", attrs="dtype:dtype")
# Many casts to one dtype at once, the same conversions, made only by Nova on the GPU (fuse_casts.group_casts): a
# step's autocast casts of its weights in one launch instead of one each.
cast_many_op = op("cast_many", lambda *xs, dtype: [(x.shape, dtype) for x in xs], multi=True, inputs="*xs",
                  attrs="dtype:dtype")
copy_op = op("copy", _same, lambda g, out, x: (g,), saves=(), inputs="x")


def copy(x: Tensor) -> Tensor:
  """A new tensor with x's values (contiguous)."""
  return copy_op(x)


def cast(x: Tensor, dtype: DType) -> Tensor:
  """x converted to dtype (`Tensor.to(dtype)`); gradients flow only between floating types."""
  out = cast_op(x, dtype=dtype)
  if not dtype.is_floating_point and out.requires_grad: out.requires_grad, out._node = False, None
  return out


def cast_each(xs: list[Tensor], dtype: DType) -> tuple[Tensor, ...]:
  """Each x (of one device) converted to the floating `dtype` by one multi-tensor op (`cast_many`: a launch per source
  dtype on CUDA), each result taped as its own `cast`, so that gradients flow back as from `x.to(dtype)`."""
  outs = cast_many_op(*xs, dtype=dtype)
  if grad_mode.enabled:
    for x, out in zip(xs, outs):
      if x.requires_grad: tape_record(cast_op, (x,), {"dtype": dtype}, out)
  return outs


# *** composites ***

def clamp(x: Tensor, min=None, max=None, *, into: Tensor | None = None) -> Tensor:
  """Limit x to [min, max]; the gradient passes where min <= x <= max."""
  if min is None and max is None: raise ShapeError("clamp: at least one of min and max must be given")
  if min is not None:
    x = where(x < min, min if not isinstance(min, Tensor) else min.to(x.dtype), x, into=into if max is None else None)
  if max is not None: x = where(x > max, max if not isinstance(max, Tensor) else max.to(x.dtype), x, into=into)
  return x


clip = clamp


def masked_fill(x: Tensor, mask: Tensor, value, *, into: Tensor | None = None) -> Tensor:
  """x with `value` where mask is True (mask broadcasts to x)."""
  if not isinstance(mask, Tensor) or mask.dtype is not dtypes.bool_:
    raise DTypeError(f"masked_fill: mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
  if broadcast_shapes(mask.shape, x.shape, op="masked_fill") != tuple(x.shape):
    raise ShapeError(f"masked_fill: mask of shape {mask.shape} does not broadcast to the tensor's shape {x.shape}")
  if isinstance(value, (bool, int, float)): value = scalar_operand(value, x.dtype, x.device)
  else: value = as_tensor_like(value, x).to(x.dtype)
  return where(mask, value, x, into=into)


def lerp(x: Tensor, end, weight, *, into: Tensor | None = None) -> Tensor:
  """x + weight * (end - x)."""
  return add(x, weight * (end - x), into=into)


def isclose(a: Tensor, b, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> Tensor:
  """|a - b| <= atol + rtol |b| elementwise (equal infinities are close; nans only with equal_nan), as PyTorch's."""
  a, b = operands("isclose", a, b)
  if a.dtype is dtypes.bool_: close = a == b
  else:
    err = abs_op(a - b)
    close = (a == b) | (isfinite(err) & (err <= atol + rtol * abs_op(b)))
  return close | (isnan(a) & isnan(b)) if equal_nan else close


def allclose(a: Tensor, b, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> bool:
  """Whether every element of a is close to b's (isclose)."""
  return bool(isclose(a, b, rtol, atol, equal_nan).all())


def equal(a: Tensor, b: Tensor) -> bool:
  """Whether a and b have one shape and equal elements (nan is equal to nothing)."""
  return tuple(a.shape) == tuple(b.shape) and bool((a == b).all())
