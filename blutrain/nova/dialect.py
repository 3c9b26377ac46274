"""The `nova` dialect: one pure op on ranked tensors per primitive of `blutrain.ops`.

Each op is an `@irdl_op_definition` class named after the op library's primitive (`AddOp` is `nova.add` is
`ops.registry["add"]` is `kernels["add"]`). It declares the primitive's operands in the op library's order (plain,
optional or variadic) and its attributes as properties; a family base class owns what its ops share: operands,
results, traits, syntax, and the verifier that runs the op's shape rule from `blutrain.ops`. A primitive with several
outputs (`Op.multi`) is a `MultiResultOp`, which declares its results as it declares operands. A test holds every
class to the op library's signature (`Op.inputs`, `Op.attrs`, `Op.multi`).

Attribute values are encoded generically (`encode` / `decode`), so any op's attributes round-trip exactly:

  Python                      xDSL                                   printed
  bool                        IntegerAttr of i1 (BoolAttr)           `true`
  int                         IntegerAttr of i64                     `3 : i64`
  float                       FloatAttr of f64                       `1.000000e+00 : f64`
  str                         StringAttr                             `"tanh"`
  DType                       its element type                       `f32`
  tuple of ints               DenseArrayBase of i64                  `array<i64: 0, 1>`
  other tuple (nested)        ArrayAttr                              `[array<i64: 0, 4, 1>, 1.5 : f64]`
  None                        UnitAttr                               the bare key, `{dtype}`

A property missing from an op means the attribute was not given (the shape rule's default applies), which is
not the same as a None value. Operands and results use the element types of `ELEMENT_TYPES`.

Random ops (rand, randn, randint, bernoulli) differ from the op library in one place: the library's `seed`
attribute is not a property but the operand `rng`, the generator state `tensor<2xi64>` holding (seed, base offset),
and the `offset` property is relative to the base offset. That makes a step's seed an input of the graph, not a
constant. They are Pure like every other nova op: the generator is counter-based, so a draw is a function of (seed,
base offset, offset, shape, dtype). Two draws equal in all of those are the same numbers (CSE may merge them) and an
unused draw may be dropped (DCE): advancing the generator is the runtime's business, not the graph's.

`to_device` has no nova op: a compiled graph runs on one device.
"""
from __future__ import annotations

import functools
from typing import Any

from xdsl.dialects.builtin import (ArrayAttr, DenseArrayBase, FloatAttr, IntegerAttr, StringAttr, TensorType, UnitAttr,
                                   IntegerType, Signedness, bf16, f16, f32, f64, i1, i8, i16, i32, i64)
from xdsl.ir import Attribute, Dialect, SSAValue
from xdsl.irdl import (AttrSetConstraint, AttrSizedOperandSegments, AttrSizedResultSegments, BaseAttr,
                       EqAttrConstraint, IRDLOperation, OptionalDef, ParsePropInAttrDict, VariadicDef,
                       irdl_op_definition, operand_def, opt_operand_def, opt_prop_def, opt_result_def, prop_def,
                       region_def, result_def, traits_def, var_operand_def, var_result_def)
from xdsl.traits import HasParent, IsTerminator, Pure
from xdsl.utils.exceptions import VerifyException

from blutrain import dtypes
from blutrain.autograd.tape import Aval
from blutrain.dtypes import DType
from blutrain.nova.graph import literal
from blutrain.ops import registry

# *** types ***

ELEMENT_TYPES: dict[DType, Attribute] = {dtypes.bool_: i1, dtypes.uint8: IntegerType(8, Signedness.UNSIGNED),
                                         dtypes.int8: i8, dtypes.int16: i16, dtypes.int32: i32, dtypes.int64: i64,
                                         dtypes.float16: f16, dtypes.bfloat16: bf16, dtypes.float32: f32,
                                         dtypes.float64: f64}
DTYPES: dict[Attribute, DType] = {t: d for d, t in ELEMENT_TYPES.items()}

ELEMENT = AttrSetConstraint(frozenset(ELEMENT_TYPES.values()))
TENSOR = TensorType.constr(ELEMENT)


def tensor_type(shape: tuple[int, ...], dtype: DType) -> TensorType:
  """The nova type of a value: `tensor<4x8xf32>`."""
  return TensorType(ELEMENT_TYPES[dtype], shape)


_avals: dict[Attribute, Aval] = {}


def aval(t: Attribute) -> Aval:
  """(shape, dtype) of a tensor type, as the op library's shape rules take it (cached: types are interned values)."""
  if (a := _avals.get(t)) is None:
    if not isinstance(t, TensorType) or t.element_type not in DTYPES:
      raise VerifyException(f"expected a ranked tensor of {', '.join(d.name for d in ELEMENT_TYPES)}, got {t}")
    a = _avals[t] = Aval(t.get_shape(), DTYPES[t.element_type], None)
  return a


# *** attribute encoding ***

_encoded: dict[Any, Attribute] = {}


def encode(v: Any) -> Attribute:
  """A Python attribute value as an xDSL attribute (the table in the module docstring); memoized, since a graph
  repeats few distinct values."""
  key = literal(v)  # tells True, 1 and 1.0 (and 0.0, -0.0) apart
  if (a := _encoded.get(key)) is None: a = _encoded[key] = _encode(v)
  return a


def _encode(v: Any) -> Attribute:
  if v is None: return UnitAttr()
  if isinstance(v, bool): return IntegerAttr(int(v), i1)
  if isinstance(v, int): return IntegerAttr(v, i64)
  if isinstance(v, float): return FloatAttr(v, f64)
  if isinstance(v, str): return StringAttr(v)
  if isinstance(v, DType): return ELEMENT_TYPES[v]
  if isinstance(v, (tuple, list)):
    if all(isinstance(x, int) and not isinstance(x, bool) for x in v): return DenseArrayBase.from_list(i64, v)
    return ArrayAttr([_encode(x) for x in v])
  if hasattr(v, "item"): return _encode(v.item())  # numpy scalars
  raise TypeError(f"nova: cannot encode attribute value {v!r} of type {type(v).__name__}")


def decode(a: Attribute) -> Any:
  """The Python value of an attribute made by `encode`."""
  if isinstance(a, IntegerAttr): return bool(a.value.data) if a.type == i1 else a.value.data
  if isinstance(a, FloatAttr): return a.value.data
  if isinstance(a, StringAttr): return a.data
  if isinstance(a, DenseArrayBase): return a.get_values()
  if isinstance(a, ArrayAttr): return tuple(decode(x) for x in a.data)
  if isinstance(a, UnitAttr): return None
  if a in DTYPES: return DTYPES[a]
  raise TypeError(f"nova: cannot decode attribute {a}")


# *** property constraints: one per attribute kind of the op library's signatures ***

INT = BaseAttr(IntegerAttr)
BOOL = AttrSetConstraint(frozenset((IntegerAttr(0, i1), IntegerAttr(1, i1))))
FLOAT = BaseAttr(FloatAttr)
NUM = INT | FLOAT
STR = BaseAttr(StringAttr)
INTS = BaseAttr(DenseArrayBase)
INDEX = BaseAttr(ArrayAttr) | BaseAttr(DenseArrayBase)  # ((start, stop, step), ...); () for a 0-d tensor
NONE = EqAttrConstraint(UnitAttr())  # an optional property (`opt_prop_def(BOOL | NONE)`) may also hold None
KINDS = {"int": INT, "bool": BOOL, "float": FLOAT, "num": NUM, "str": STR, "dtype": ELEMENT, "ints": INTS,
         "index": INDEX}

_SEGMENT_SIZES = (AttrSizedOperandSegments.attribute_name, AttrSizedResultSegments.attribute_name)


def _spec(name: str, definition: Any) -> str:
  """An operand or result as the op library writes it: `x`, `?weight` (optional) or `*xs` (variadic)."""
  return ("?" if isinstance(definition, OptionalDef) else "*" if isinstance(definition, VariadicDef) else "") + name


def _grouped(specs: tuple[str, ...], values: list) -> list:
  """A flat list of operands or result types (None for an absent optional one) grouped per definition, as `build`
  takes them; a variadic definition takes what the others leave, and trailing optional ones not given are absent."""
  if not any(spec[0] == "*" for spec in specs): values = [*values, *[None] * (len(specs) - len(values))]
  rest, groups, i = len(values) - len(specs) + 1, [], 0
  for spec in specs:
    if spec[0] == "*":
      groups.append(values[i:i + rest])
      i += rest
    else:
      groups.append([] if values[i] is None else values[i])
      i += 1
  return groups


def _types(avals: list) -> str:
  """`float32[4, 8]`, or `(float32[4], none)` for several (None for an absent one)."""
  text = ", ".join("none" if a is None else f"{a[1].name}{list(a[0])}" for a in avals)
  return text if len(avals) == 1 else f"({text})"


# *** families ***

class NovaOp(IRDLOperation):
  """Base of every nova op: Pure, properties printed in the attribute dictionary, and a verifier that runs the op's
  shape rule from `blutrain.ops` on the operand types."""
  traits = traits_def(Pure())
  irdl_options = (ParsePropInAttrDict(),)
  assembly_format = "operands attr-dict `:` functional-type(operands, results)"

  @property
  def opname(self) -> str:
    """The op library's name: `nova.add` -> `add`."""
    return self.name[5:]

  @classmethod
  @functools.cache
  def signature(cls) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Operand names as the op library writes them (`x`, `?weight` optional, `*xs` variadic), property names and
    result names (written likewise), in declaration order."""
    definition = cls.get_irdl_definition()
    return (tuple(_spec(name, d) for name, d in definition.operands),
            tuple(k for k in definition.properties if k not in _SEGMENT_SIZES),
            tuple(_spec(name, d) for name, d in definition.results))

  @classmethod
  @functools.cache
  def _segmented(cls) -> tuple[bool, bool]:
    """Whether optional operands, and optional results, keep their place through segment sizes (then they are read
    by name and built with `build`)."""
    options = cls.get_irdl_definition().options
    return (any(isinstance(o, AttrSizedOperandSegments) for o in options),
            any(isinstance(o, AttrSizedResultSegments) for o in options))

  def graph_inputs(self) -> list[SSAValue | None]:
    """The operands in the op library's order, None where an optional one is absent."""
    if not self._segmented()[0]: return list(self.operands)
    return [getattr(self, k.lstrip("?")) for k in self.signature()[0]]

  def graph_outputs(self) -> list[SSAValue | None]:
    """The results in the op library's order, None where an optional one is absent."""
    if not self._segmented()[1]: return list(self.results)
    return [getattr(self, k.lstrip("?")) for k in self.signature()[2]]

  def attrs(self) -> dict[str, Any]:
    """The attributes as the op library passes them (absent properties left out)."""
    props = self.properties
    return {k: decode(props[k]) for k in self.signature()[1] if k in props}

  @classmethod
  def make(cls, inputs: list[SSAValue | None], attrs: dict[str, Any], result_types: list[Attribute | None]) -> NovaOp:
    """Build the op from graph inputs and result types (None for an absent optional one) and Python attributes."""
    properties = {k: encode(v) for k, v in attrs.items()}
    if any(cls._segmented()):
      operands, _, results = cls.signature()
      return cls.build(operands=_grouped(operands, inputs), result_types=_grouped(results, result_types),
                       properties=properties)
    return cls.create(operands=inputs, result_types=result_types, properties=properties)

  def rule_args(self) -> tuple:
    """What the shape rule takes positionally: the operands as Avals."""
    return tuple(None if v is None else aval(v.type) for v in self.graph_inputs())

  def verify_(self) -> None:
    args, attrs = self.rule_args(), self.attrs()
    operands = ", ".join("none" if a is None else f"{a.dtype.name}{list(a.shape)}" for a in args)
    op = registry[self.opname]
    try:
      out = op.rule(*args, **attrs)
    except (ValueError, TypeError, IndexError, KeyError) as e:
      raise VerifyException(f"{self.name}: operands ({operands}) with {attrs} fail the shape rule: {e}") from None
    want = [None if a is None else (tuple(a[0]), a[1]) for a in (out if op.multi else [out])]
    got = [None if v is None else (aval(v.type).shape, aval(v.type).dtype) for v in self.graph_outputs()]
    if got != want:
      raise VerifyException(f"{self.name}: operands ({operands}) with {attrs} give {_types(want)}, but the result "
                            f"{'type is' if len(got) == 1 else 'types are'} {_types(got)}")


class SingleResultOp(NovaOp):
  """An op with one ranked-tensor result."""
  result = result_def(TENSOR)


class MultiResultOp(NovaOp):
  """An op with several results (`Op.multi` in the op library), each declared by the op: fixed (`result_def`),
  optional (`opt_result_def`: None in the graph when absent, with `AttrSizedResultSegments` and a syntax that names
  them) or variadic (`var_result_def`). Its CPU kernel returns a tuple of arrays, one per result (None for an absent
  one)."""


class CreationOp(SingleResultOp):
  """A tensor made from attributes alone (full, empty, arange)."""
  assembly_format = "attr-dict `:` type($result)"


class RandomOp(SingleResultOp):
  """A counter-based random draw of `shape` and `dtype` from the generator state `rng` = (seed, base offset), at
  `offset` past the base offset; `rng` is the last operand (after dropout's x)."""
  rng = operand_def(EqAttrConstraint(TensorType(i64, [2])))

  def rule_args(self) -> tuple: return ()  # the draw's shape and dtype are attributes; rng is not an input of the rule


class ElementwiseOp(SingleResultOp):
  """Elementwise ops: the result broadcasts the operands' shapes."""


class UnaryOp(ElementwiseOp):
  """One operand, same shape (neg, exp, ..., cast, copy)."""
  x = operand_def(TENSOR)


class BinaryOp(ElementwiseOp):
  """Two broadcasting operands, the first operand's dtype (add, sub, mul, div, pow, maximum, minimum)."""
  x = operand_def(TENSOR)
  y = operand_def(TENSOR)


class CompareOp(BinaryOp):
  """Two broadcasting operands, a bool result (eq, ..., logical_xor)."""


class ReduceOp(SingleResultOp):
  """Reductions and scans of `x` along dims (sum, amax, amin, argmax, argmin, cumsum)."""
  x = operand_def(TENSOR)


class LayoutOp(SingleResultOp):
  """Layout-only ops of `x` (view, permute, expand, slice): eager mode makes them views without a kernel."""
  x = operand_def(TENSOR)


class MovementOp(SingleResultOp):
  """Ops that move data between positions (cat, indexing and the backward of slicing)."""


class NNOp(SingleResultOp):
  """Linear algebra, normalization, gathers and losses."""


class CollectiveOp(SingleResultOp):
  """A collective over the ranks of process group `group` (an id that `blutrain.distributed` gives each group, equal
  on every rank) of `size` ranks: a new tensor from `x` and the other ranks' `x`. Every rank runs the same program, so
  passes that treat it as any pure op (cse, dce, the memory plan) do the same on every rank; remat never clones one
  (a recomputation would cost a round of communication)."""
  x = operand_def(TENSOR)
  group = prop_def(INT)
  size = prop_def(INT)


# *** creation and random ***

@irdl_op_definition
class FullOp(CreationOp):
  """A tensor filled with `value`."""
  name = "nova.full"
  shape = prop_def(INTS)
  value = prop_def(NUM)
  dtype = prop_def(ELEMENT)


@irdl_op_definition
class EmptyOp(CreationOp):
  """A tensor whose values are undefined: a buffer no kernel writes (its readers must not run before its writers)."""
  name = "nova.empty"
  shape = prop_def(INTS)
  dtype = prop_def(ELEMENT)


@irdl_op_definition
class ArangeOp(CreationOp):
  """start + step * i for i in range(shape[0])."""
  name = "nova.arange"
  start = prop_def(NUM)
  step = prop_def(NUM)
  shape = prop_def(INTS)
  dtype = prop_def(ELEMENT)


@irdl_op_definition
class RandOp(RandomOp):
  """Uniform in [0, 1)."""
  name = "nova.rand"
  shape = prop_def(INTS)
  dtype = prop_def(ELEMENT)
  offset = prop_def(INT)


@irdl_op_definition
class RandnOp(RandomOp):
  """Standard normal."""
  name = "nova.randn"
  shape = prop_def(INTS)
  dtype = prop_def(ELEMENT)
  offset = prop_def(INT)


@irdl_op_definition
class RandintOp(RandomOp):
  """Uniform integers in [low, high)."""
  name = "nova.randint"
  shape = prop_def(INTS)
  dtype = prop_def(ELEMENT)
  low = prop_def(INT)
  high = prop_def(INT)
  offset = prop_def(INT)


@irdl_op_definition
class BernoulliOp(RandomOp):
  """True with probability p."""
  name = "nova.bernoulli"
  shape = prop_def(INTS)
  dtype = prop_def(ELEMENT)
  p = prop_def(FLOAT)
  offset = prop_def(INT)


@irdl_op_definition
class DropoutOp(RandomOp):
  """x with each element kept (scaled by 1 / (1 - p)) where bernoulli's draw of a mask of x's shape with probability
  1 - p would be True, else 0; its gradient is the same op on the gradient (the same draws)."""
  name = "nova.dropout"
  x = operand_def(TENSOR)
  p = prop_def(FLOAT)
  offset = prop_def(INT)

  def rule_args(self) -> tuple: return (aval(self.x.type),)


# *** elementwise ***

@irdl_op_definition
class NegOp(UnaryOp):
  """-x."""
  name = "nova.neg"


@irdl_op_definition
class ExpOp(UnaryOp):
  """e ** x."""
  name = "nova.exp"


@irdl_op_definition
class LogOp(UnaryOp):
  """The natural logarithm."""
  name = "nova.log"


@irdl_op_definition
class SqrtOp(UnaryOp):
  """x ** 0.5."""
  name = "nova.sqrt"


@irdl_op_definition
class RsqrtOp(UnaryOp):
  """x ** -0.5."""
  name = "nova.rsqrt"


@irdl_op_definition
class AbsOp(UnaryOp):
  """|x|."""
  name = "nova.abs"


@irdl_op_definition
class SinOp(UnaryOp):
  """sin(x)."""
  name = "nova.sin"


@irdl_op_definition
class CosOp(UnaryOp):
  """cos(x)."""
  name = "nova.cos"


@irdl_op_definition
class TanhOp(UnaryOp):
  """tanh(x)."""
  name = "nova.tanh"


@irdl_op_definition
class SigmoidOp(UnaryOp):
  """1 / (1 + e ** -x)."""
  name = "nova.sigmoid"


@irdl_op_definition
class ReluOp(UnaryOp):
  """max(x, 0)."""
  name = "nova.relu"


@irdl_op_definition
class ErfOp(UnaryOp):
  """The error function."""
  name = "nova.erf"


@irdl_op_definition
class FloorOp(UnaryOp):
  """The largest integer not above x."""
  name = "nova.floor"


@irdl_op_definition
class SignOp(UnaryOp):
  """-1, 0 or 1 as x is negative, zero (or nan) or positive."""
  name = "nova.sign"


@irdl_op_definition
class TanOp(UnaryOp):
  """tan(x)."""
  name = "nova.tan"


@irdl_op_definition
class AsinOp(UnaryOp):
  """The inverse sine."""
  name = "nova.asin"


@irdl_op_definition
class AcosOp(UnaryOp):
  """The inverse cosine."""
  name = "nova.acos"


@irdl_op_definition
class AtanOp(UnaryOp):
  """The inverse tangent."""
  name = "nova.atan"


@irdl_op_definition
class SinhOp(UnaryOp):
  """The hyperbolic sine."""
  name = "nova.sinh"


@irdl_op_definition
class CoshOp(UnaryOp):
  """The hyperbolic cosine."""
  name = "nova.cosh"


@irdl_op_definition
class AsinhOp(UnaryOp):
  """The inverse hyperbolic sine."""
  name = "nova.asinh"


@irdl_op_definition
class AcoshOp(UnaryOp):
  """The inverse hyperbolic cosine."""
  name = "nova.acosh"


@irdl_op_definition
class AtanhOp(UnaryOp):
  """The inverse hyperbolic tangent."""
  name = "nova.atanh"


@irdl_op_definition
class Exp2Op(UnaryOp):
  """2 ** x."""
  name = "nova.exp2"


@irdl_op_definition
class Log2Op(UnaryOp):
  """The base-2 logarithm."""
  name = "nova.log2"


@irdl_op_definition
class Log10Op(UnaryOp):
  """The base-10 logarithm."""
  name = "nova.log10"


@irdl_op_definition
class Log1pOp(UnaryOp):
  """log(1 + x), exact near 0."""
  name = "nova.log1p"


@irdl_op_definition
class Expm1Op(UnaryOp):
  """e ** x - 1, exact near 0."""
  name = "nova.expm1"


@irdl_op_definition
class CeilOp(UnaryOp):
  """The smallest integer not below x."""
  name = "nova.ceil"


@irdl_op_definition
class TruncOp(UnaryOp):
  """x rounded toward zero."""
  name = "nova.trunc"


@irdl_op_definition
class RoundOp(UnaryOp):
  """x rounded to the nearest integer, half to even."""
  name = "nova.round"


@irdl_op_definition
class BitwiseNotOp(UnaryOp):
  """~x, bitwise."""
  name = "nova.bitwise_not"


@irdl_op_definition
class LogicalNotOp(UnaryOp):
  """not x, a bool result."""
  name = "nova.logical_not"


@irdl_op_definition
class CopyOp(UnaryOp):
  """x in new memory."""
  name = "nova.copy"


@irdl_op_definition
class GeluOp(UnaryOp):
  """x * Phi(x), exactly (`approximate = "none"`) or by tanh (`"tanh"`)."""
  name = "nova.gelu"
  approximate = prop_def(STR)


@irdl_op_definition
class CastOp(UnaryOp):
  """x converted to `dtype`."""
  name = "nova.cast"
  dtype = prop_def(ELEMENT)


@irdl_op_definition
class CastManyOp(MultiResultOp):
  """Each operand converted to `dtype` (`ops.elementwise.cast_many_op`), which only fuse_casts.group_casts makes."""
  name = "nova.cast_many"
  xs = var_operand_def(TENSOR)
  outs = var_result_def(TENSOR)
  dtype = prop_def(ELEMENT)


@irdl_op_definition
class AddOp(BinaryOp):
  """x + y."""
  name = "nova.add"


@irdl_op_definition
class SubOp(BinaryOp):
  """x - y."""
  name = "nova.sub"


@irdl_op_definition
class MulOp(BinaryOp):
  """x * y."""
  name = "nova.mul"


@irdl_op_definition
class DivOp(BinaryOp):
  """x / y."""
  name = "nova.div"


@irdl_op_definition
class PowOp(BinaryOp):
  """x ** y."""
  name = "nova.pow"


@irdl_op_definition
class Atan2Op(BinaryOp):
  """The angle of the point (y, x): atan(x / y) in the right quadrant."""
  name = "nova.atan2"


@irdl_op_definition
class CopysignOp(BinaryOp):
  """|x| with the sign of y."""
  name = "nova.copysign"


@irdl_op_definition
class FmodOp(BinaryOp):
  """The remainder of x / y truncated (the sign of x)."""
  name = "nova.fmod"


@irdl_op_definition
class RemainderOp(BinaryOp):
  """The remainder of x / y floored (the sign of y)."""
  name = "nova.remainder"


@irdl_op_definition
class FloorDivideOp(BinaryOp):
  """floor(x / y)."""
  name = "nova.floor_divide"


@irdl_op_definition
class BitwiseAndOp(BinaryOp):
  """x & y, bitwise."""
  name = "nova.bitwise_and"


@irdl_op_definition
class BitwiseOrOp(BinaryOp):
  """x | y, bitwise."""
  name = "nova.bitwise_or"


@irdl_op_definition
class BitwiseXorOp(BinaryOp):
  """x ^ y, bitwise."""
  name = "nova.bitwise_xor"


@irdl_op_definition
class BitwiseLeftShiftOp(BinaryOp):
  """x << y (0 past the width)."""
  name = "nova.bitwise_left_shift"


@irdl_op_definition
class BitwiseRightShiftOp(BinaryOp):
  """x >> y, arithmetic (the sign past the width)."""
  name = "nova.bitwise_right_shift"


@irdl_op_definition
class MaximumOp(BinaryOp):
  """max(x, y), NaN if either is."""
  name = "nova.maximum"


@irdl_op_definition
class MinimumOp(BinaryOp):
  """min(x, y), NaN if either is."""
  name = "nova.minimum"


@irdl_op_definition
class EqOp(CompareOp):
  """x == y."""
  name = "nova.eq"


@irdl_op_definition
class NeOp(CompareOp):
  """x != y."""
  name = "nova.ne"


@irdl_op_definition
class LtOp(CompareOp):
  """x < y."""
  name = "nova.lt"


@irdl_op_definition
class LeOp(CompareOp):
  """x <= y."""
  name = "nova.le"


@irdl_op_definition
class GtOp(CompareOp):
  """x > y."""
  name = "nova.gt"


@irdl_op_definition
class GeOp(CompareOp):
  """x >= y."""
  name = "nova.ge"


@irdl_op_definition
class LogicalAndOp(CompareOp):
  """x and y."""
  name = "nova.logical_and"


@irdl_op_definition
class LogicalOrOp(CompareOp):
  """x or y."""
  name = "nova.logical_or"


@irdl_op_definition
class LogicalXorOp(CompareOp):
  """x xor y."""
  name = "nova.logical_xor"


@irdl_op_definition
class WhereOp(ElementwiseOp):
  """x where c, else y."""
  name = "nova.where"
  c = operand_def(TENSOR)
  x = operand_def(TENSOR)
  y = operand_def(TENSOR)


@irdl_op_definition
class GeluBackwardOp(ElementwiseOp):
  """g * gelu'(x)."""
  name = "nova.gelu_backward"
  g = operand_def(TENSOR)
  x = operand_def(TENSOR)
  approximate = prop_def(STR)


@irdl_op_definition
class ReluBackwardOp(ElementwiseOp):
  """relu's gradient: 0 where y (relu's output) <= 0, else g."""
  name = "nova.relu_backward"
  g = operand_def(TENSOR)
  y = operand_def(TENSOR)


# *** reductions and scans ***

@irdl_op_definition
class SumOp(ReduceOp):
  """The sum over `dims`, accumulated in `dtype` (absent or None: x's, integers in int64)."""
  name = "nova.sum"
  dims = prop_def(INTS)
  keepdim = prop_def(BOOL)
  dtype = opt_prop_def(ELEMENT | NONE)


@irdl_op_definition
class AmaxOp(ReduceOp):
  """The maximum over `dims`."""
  name = "nova.amax"
  dims = prop_def(INTS)
  keepdim = prop_def(BOOL)


@irdl_op_definition
class AminOp(ReduceOp):
  """The minimum over `dims`."""
  name = "nova.amin"
  dims = prop_def(INTS)
  keepdim = prop_def(BOOL)


@irdl_op_definition
class ArgmaxOp(ReduceOp):
  """The int64 position of the maximum along `dim`."""
  name = "nova.argmax"
  dim = prop_def(INT)
  keepdim = prop_def(BOOL)


@irdl_op_definition
class ArgminOp(ReduceOp):
  """The int64 position of the minimum along `dim`."""
  name = "nova.argmin"
  dim = prop_def(INT)
  keepdim = prop_def(BOOL)


@irdl_op_definition
class CumsumOp(ReduceOp):
  """The running sum along `dim` (from the end when `reverse`)."""
  name = "nova.cumsum"
  dim = prop_def(INT)
  reverse = opt_prop_def(BOOL | NONE)


@irdl_op_definition
class CumprodOp(ReduceOp):
  """The running product along `dim`."""
  name = "nova.cumprod"
  dim = prop_def(INT)


@irdl_op_definition
class ArgsortOp(ReduceOp):
  """The int64 positions that sort x along `dim` (stable; nan above +inf; largest first when `descending`)."""
  name = "nova.argsort"
  dim = prop_def(INT)
  descending = prop_def(BOOL)


# *** views ***

@irdl_op_definition
class ViewOp(LayoutOp):
  """x's elements in row-major order, as `shape`."""
  name = "nova.view"
  shape = prop_def(INTS)


@irdl_op_definition
class PermuteOp(LayoutOp):
  """x with its dims reordered: out dim i is x's dim `dims[i]`."""
  name = "nova.permute"
  dims = prop_def(INTS)


@irdl_op_definition
class ExpandOp(LayoutOp):
  """x broadcast to `shape`."""
  name = "nova.expand"
  shape = prop_def(INTS)


@irdl_op_definition
class SliceOp(LayoutOp):
  """x[start:stop:step, ...], one (start, stop, step) per dim in `index`."""
  name = "nova.slice"
  index = prop_def(INDEX)


# *** movement and indexing ***

@irdl_op_definition
class SliceBackwardOp(MovementOp):
  """Zeros of `shape` with g written at `index` (the VJP of slice)."""
  name = "nova.slice_backward"
  g = operand_def(TENSOR)
  shape = prop_def(INTS)
  index = prop_def(INDEX)


@irdl_op_definition
class CatOp(MovementOp):
  """The operands joined along `dim`."""
  name = "nova.cat"
  xs = var_operand_def(TENSOR)
  dim = prop_def(INT)


@irdl_op_definition
class IndexOp(MovementOp):
  """x indexed by integer tensors `idx` at the dims `positions`."""
  name = "nova.index"
  x = operand_def(TENSOR)
  idx = var_operand_def(TENSOR)
  positions = prop_def(INTS)


@irdl_op_definition
class IndexBackwardOp(MovementOp):
  """Zeros of `shape` with g accumulated at the indexed places (the VJP of index)."""
  name = "nova.index_backward"
  g = operand_def(TENSOR)
  idx = var_operand_def(TENSOR)
  shape = prop_def(INTS)
  positions = prop_def(INTS)


@irdl_op_definition
class IndexPutOp(MovementOp):
  """x with v written at the indexed places."""
  name = "nova.index_put"
  x = operand_def(TENSOR)
  v = operand_def(TENSOR)
  idx = var_operand_def(TENSOR)
  positions = prop_def(INTS)


# *** linear algebra, normalization, gathers, losses ***

@irdl_op_definition
class MatmulOp(NNOp):
  """a @ b, batched and broadcast as numpy's matmul; float32 inputs multiply in TF32 when `tf32`."""
  name = "nova.matmul"
  a = operand_def(TENSOR)
  b = operand_def(TENSOR)
  tf32 = opt_prop_def(BOOL | NONE)


@irdl_op_definition
class LinearOp(NNOp):
  """x @ weight^T + bias (`ops.nn.linear_op`, eager mode's linear layer; a capture records it as matmul and add)."""
  name = "nova.linear"
  x = operand_def(TENSOR)
  weight = operand_def(TENSOR)
  bias = opt_operand_def(TENSOR)
  tf32 = opt_prop_def(BOOL | NONE)
  irdl_options = (AttrSizedOperandSegments(as_property=True), ParsePropInAttrDict())
  assembly_format = ("$x `,` $weight (`bias` $bias^ `:` type($bias))? attr-dict `:` type($x) `,` type($weight) "
                     "`->` type($result)")


@irdl_op_definition
class LinearBackwardOp(MultiResultOp):
  """linear's gradients (`ops.nn.linear_backward_op`, eager mode's): dx when `input_grad`, dweight when `weight_grad`,
  dbias when `bias`, each absent otherwise."""
  name = "nova.linear_backward"
  g = operand_def(TENSOR)
  x = operand_def(TENSOR)
  weight = operand_def(TENSOR)
  bias = prop_def(BOOL)
  input_grad = prop_def(BOOL)
  weight_grad = prop_def(BOOL)
  tf32 = opt_prop_def(BOOL | NONE)
  dx = opt_result_def(TENSOR)
  dweight = opt_result_def(TENSOR)
  dbias = opt_result_def(TENSOR)
  irdl_options = (AttrSizedResultSegments(as_property=True), ParsePropInAttrDict())
  assembly_format = ("$g `,` $x `,` $weight attr-dict `:` type($g) `,` type($x) `,` type($weight) `->` "
                     "(`dx` type($dx)^)? (`dweight` type($dweight)^)? (`dbias` type($dbias)^)?")


@irdl_op_definition
class ConvOp(NNOp):
  """Cross-correlation of x (N, C, *spatial) with weight (C_out, C / groups, *kernel), zero-padded by `padding` on
  both sides; float32 multiplies in TF32 when `tf32`."""
  name = "nova.conv"
  x = operand_def(TENSOR)
  weight = operand_def(TENSOR)
  stride = prop_def(INTS)
  padding = prop_def(INTS)
  dilation = prop_def(INTS)
  groups = prop_def(INT)
  tf32 = opt_prop_def(BOOL | NONE)


@irdl_op_definition
class ConvGradInputOp(NNOp):
  """conv's gradient with respect to an input of size `shape` (the transposed convolution of g)."""
  name = "nova.conv_grad_input"
  g = operand_def(TENSOR)
  weight = operand_def(TENSOR)
  shape = prop_def(INTS)
  stride = prop_def(INTS)
  padding = prop_def(INTS)
  dilation = prop_def(INTS)
  groups = prop_def(INT)
  tf32 = opt_prop_def(BOOL | NONE)


@irdl_op_definition
class ConvGradWeightOp(NNOp):
  """conv's gradient with respect to a weight of size `shape`: g correlated with x."""
  name = "nova.conv_grad_weight"
  g = operand_def(TENSOR)
  x = operand_def(TENSOR)
  shape = prop_def(INTS)
  stride = prop_def(INTS)
  padding = prop_def(INTS)
  dilation = prop_def(INTS)
  groups = prop_def(INT)
  tf32 = opt_prop_def(BOOL | NONE)


@irdl_op_definition
class GemmOp(MultiResultOp):
  """a @ b and its epilogue (`ops.linalg.gemm_op`), which only the fuse-gemm pass makes: results `outs` are the
  output, then the values the epilogue's "save" steps keep."""
  name = "nova.gemm"
  a = operand_def(TENSOR)
  b = operand_def(TENSOR)
  xs = var_operand_def(TENSOR)
  outs = var_result_def(TENSOR)
  epilogue = prop_def(STR)
  dtype = prop_def(ELEMENT)
  tf32 = opt_prop_def(BOOL | NONE)


@irdl_op_definition
class WeightGradOp(MultiResultOp):
  """A weight gradient's GEMM (`ops.linalg.weight_grad_op`), which only fuse-gemm makes: a @ b stored in `dtype`, then
  with `bias_grad` the sums of a's rows."""
  name = "nova.weight_grad"
  a = operand_def(TENSOR)
  b = operand_def(TENSOR)
  outs = var_result_def(TENSOR)
  dtype = prop_def(ELEMENT)
  bias_grad = prop_def(BOOL)
  tf32 = opt_prop_def(BOOL | NONE)


@irdl_op_definition
class SoftmaxOp(NNOp):
  """exp(x) / sum(exp(x)) along `dim`."""
  name = "nova.softmax"
  x = operand_def(TENSOR)
  dim = prop_def(INT)


@irdl_op_definition
class LogSoftmaxOp(NNOp):
  """x - logsumexp(x) along `dim`."""
  name = "nova.log_softmax"
  x = operand_def(TENSOR)
  dim = prop_def(INT)


@irdl_op_definition
class LayerNormOp(NNOp):
  """(x - mean) / sqrt(var + eps) * weight + bias over the last `n` dims, in `dtype` (absent: x's); weight and bias
  are optional."""
  name = "nova.layer_norm"
  x = operand_def(TENSOR)
  weight = opt_operand_def(TENSOR)
  bias = opt_operand_def(TENSOR)
  n = prop_def(INT)
  eps = prop_def(FLOAT)
  dtype = opt_prop_def(ELEMENT | NONE)
  irdl_options = (AttrSizedOperandSegments(as_property=True), ParsePropInAttrDict())
  assembly_format = ("$x (`weight` $weight^ `:` type($weight))? (`bias` $bias^ `:` type($bias))? attr-dict "
                     "`:` type($x) `->` type($result)")


@irdl_op_definition
class AddLayerNormOp(MultiResultOp):
  """h = x + y (float32; y may be a half, read as float32) and layer_norm(h, weight, bias) in `dtype` (absent:
  float32), both results (made by passes/fuse_norms.py)."""
  name = "nova.add_layer_norm"
  x = operand_def(TENSOR)
  y = operand_def(TENSOR)
  weight = opt_operand_def(TENSOR)
  bias = opt_operand_def(TENSOR)
  n = prop_def(INT)
  eps = prop_def(FLOAT)
  dtype = opt_prop_def(ELEMENT | NONE)
  h = result_def(TENSOR)
  out = result_def(TENSOR)
  irdl_options = (AttrSizedOperandSegments(as_property=True), ParsePropInAttrDict())
  assembly_format = ("$x `,` $y (`weight` $weight^ `:` type($weight))? (`bias` $bias^ `:` type($bias))? attr-dict "
                     "`:` type($x) `,` type($y) `->` type($h) `,` type($out)")


@irdl_op_definition
class LayerNormBackwardOp(MultiResultOp):
  """layer_norm's gradients: dx, then dweight when weight is given and dbias when `has_bias` (each absent otherwise),
  all of x's type, dx rounded to `cast` when that is given, and with `bias_grad` the column sums of dx as stored (its
  `cast` copy when there is one) in float32 (float64 for float64 x); with a `residual` gradient dx is residual + dx
  (passes/fuse_norms.py, passes/fuse_gemm.py)."""
  name = "nova.layer_norm_backward"
  g = operand_def(TENSOR)
  x = operand_def(TENSOR)
  weight = opt_operand_def(TENSOR)
  residual = opt_operand_def(TENSOR)
  n = prop_def(INT)
  eps = prop_def(FLOAT)
  has_bias = prop_def(BOOL)
  cast = opt_prop_def(ELEMENT | NONE)
  bias_grad = opt_prop_def(BOOL | NONE)
  dx = result_def(TENSOR)
  dweight = opt_result_def(TENSOR)
  dbias = opt_result_def(TENSOR)
  dx_cast = opt_result_def(TENSOR)
  dx_sum = opt_result_def(TENSOR)
  irdl_options = (AttrSizedOperandSegments(as_property=True), AttrSizedResultSegments(as_property=True),
                  ParsePropInAttrDict())
  assembly_format = ("$g `,` $x (`weight` $weight^ `:` type($weight))? (`residual` $residual^ `:` type($residual))? "
                     "attr-dict `:` type($g) `,` type($x) `->` type($dx) (`dweight` type($dweight)^)? "
                     "(`dbias` type($dbias)^)? (`cast` type($dx_cast)^)? (`sum` type($dx_sum)^)?")


@irdl_op_definition
class BatchNormStatsOp(MultiResultOp):
  """The mean and biased variance of each channel (dim 1) of x (N, C, *), float32 (float64 for float64 x). Given the
  running statistics (and the batch count), also their new values: (1 - momentum) r + momentum s, with the unbiased
  variance (var * count / (count - 1)), in their operands' types, and the count plus one."""
  name = "nova.batch_norm_stats"
  x = operand_def(TENSOR)
  running_mean = opt_operand_def(TENSOR)
  running_var = opt_operand_def(TENSOR)
  batches = opt_operand_def(TENSOR)
  mean = result_def(TENSOR)
  var = result_def(TENSOR)
  new_mean = opt_result_def(TENSOR)
  new_var = opt_result_def(TENSOR)
  new_batches = opt_result_def(TENSOR)
  momentum = opt_prop_def(FLOAT | NONE)
  irdl_options = (AttrSizedOperandSegments(as_property=True), AttrSizedResultSegments(as_property=True),
                  ParsePropInAttrDict())
  assembly_format = ("$x (`running` $running_mean^ `,` $running_var `:` type($running_mean) `,` type($running_var))? "
                     "(`batches` $batches^ `:` type($batches))? attr-dict `:` type($x) `->` type($mean) `,` "
                     "type($var) (`running` type($new_mean)^ `,` type($new_var))? (`batches` type($new_batches)^)?")

  def updated_operands(self) -> list[int | None]:
    """The operand each result is the new value of (None: the statistics, new values): the running mean and
    variance, and the count."""
    return [None, None, 1, 2, 3][:len(self.results)]


@irdl_op_definition
class BatchNormOp(NNOp):
  """(x - mean) / sqrt(var + eps) * weight + bias per channel (dim 1) of x, in x's type; `training`: mean and var are
  x's own statistics (batch_norm_stats), which the gradient flows through. With a `residual` (x's type) it is added to
  that value as stored, and with `relu` the result is relu's (passes/fuse_norms.py)."""
  name = "nova.batch_norm"
  x = operand_def(TENSOR)
  mean = operand_def(TENSOR)
  var = operand_def(TENSOR)
  weight = opt_operand_def(TENSOR)
  bias = opt_operand_def(TENSOR)
  residual = opt_operand_def(TENSOR)
  eps = prop_def(FLOAT)
  training = prop_def(BOOL)
  relu = opt_prop_def(BOOL | NONE)
  irdl_options = (AttrSizedOperandSegments(as_property=True), ParsePropInAttrDict())
  assembly_format = ("$x `,` $mean `,` $var (`weight` $weight^ `:` type($weight))? (`bias` $bias^ `:` type($bias))? "
                     "(`residual` $residual^ `:` type($residual))? attr-dict `:` type($x) `,` type($mean) `,` "
                     "type($var) `->` type($result)")


@irdl_op_definition
class BatchNormBackwardOp(MultiResultOp):
  """batch_norm's gradients, each present when asked for: dx (x's type), dweight and dbias (float32; float64 for
  float64 x). With `relu_out` (the output of a ReLU after the norm) g is the ReLU's output gradient, taken as 0 where
  relu_out <= 0 (passes/fuse_norms.py)."""
  name = "nova.batch_norm_backward"
  g = operand_def(TENSOR)
  x = operand_def(TENSOR)
  mean = operand_def(TENSOR)
  var = operand_def(TENSOR)
  weight = opt_operand_def(TENSOR)
  relu_out = opt_operand_def(TENSOR)
  eps = prop_def(FLOAT)
  training = prop_def(BOOL)
  input_grad = prop_def(BOOL)
  weight_grad = prop_def(BOOL)
  bias_grad = prop_def(BOOL)
  dx = opt_result_def(TENSOR)
  dweight = opt_result_def(TENSOR)
  dbias = opt_result_def(TENSOR)
  irdl_options = (AttrSizedOperandSegments(as_property=True), AttrSizedResultSegments(as_property=True),
                  ParsePropInAttrDict())
  assembly_format = ("$g `,` $x `,` $mean `,` $var (`weight` $weight^ `:` type($weight))? "
                     "(`relu_out` $relu_out^ `:` type($relu_out))? attr-dict `:` type($g) `,` type($x) `,` "
                     "type($mean) `,` type($var) `->` (`dx` type($dx)^)? (`dweight` type($dweight)^)? "
                     "(`dbias` type($dbias)^)?")


@irdl_op_definition
class ScatterAddOp(NNOp):
  """x with src added at `index` along `dim`."""
  name = "nova.scatter_add"
  x = operand_def(TENSOR)
  index = operand_def(TENSOR)
  src = operand_def(TENSOR)
  dim = prop_def(INT)


@irdl_op_definition
class ScatterReduceOp(NNOp):
  """x with src reduced (sum, prod, mean, amax, amin) at `index` along `dim`, x's values included unless not
  `include_self`."""
  name = "nova.scatter_reduce"
  x = operand_def(TENSOR)
  index = operand_def(TENSOR)
  src = operand_def(TENSOR)
  dim = prop_def(INT)
  reduce = prop_def(STR)
  include_self = prop_def(BOOL)


@irdl_op_definition
class MaxPool2dIndicesOp(NNOp):
  """The int64 flat position in H * W of each `kernel` window's maximum of x (N, C, H, W), windows at `stride`,
  `padding` and `dilation`, `out_size` of them per dim."""
  name = "nova.max_pool2d_indices"
  x = operand_def(TENSOR)
  kernel = prop_def(INTS)
  stride = prop_def(INTS)
  padding = prop_def(INTS)
  dilation = prop_def(INTS)
  out_size = prop_def(INTS)


@irdl_op_definition
class MaxPool2dValuesOp(NNOp):
  """x (N, C, H, W) at the flat positions idx (N, C, OH, OW) in H * W that `max_pool2d_indices` found for windows of
  this geometry."""
  name = "nova.max_pool2d_values"
  x = operand_def(TENSOR)
  idx = operand_def(TENSOR)
  kernel = prop_def(INTS)
  stride = prop_def(INTS)
  padding = prop_def(INTS)
  dilation = prop_def(INTS)


@irdl_op_definition
class MaxPool2dWithIndicesOp(MultiResultOp):
  """max_pool2d_values and max_pool2d_indices of x (N, C, H, W) for windows of this geometry, in one pass (made by
  passes/fuse_norms.py)."""
  name = "nova.max_pool2d_with_indices"
  x = operand_def(TENSOR)
  kernel = prop_def(INTS)
  stride = prop_def(INTS)
  padding = prop_def(INTS)
  dilation = prop_def(INTS)
  out_size = prop_def(INTS)
  values = result_def(TENSOR)
  indices = result_def(TENSOR)


@irdl_op_definition
class MaxPool2dBackwardOp(NNOp):
  """The gradient of `max_pool2d_values` for an input of `size` (H, W): g summed at each position over the windows
  whose maximum it is."""
  name = "nova.max_pool2d_backward"
  g = operand_def(TENSOR)
  idx = operand_def(TENSOR)
  size = prop_def(INTS)
  kernel = prop_def(INTS)
  stride = prop_def(INTS)
  padding = prop_def(INTS)
  dilation = prop_def(INTS)


@irdl_op_definition
class GatherOp(NNOp):
  """x read at `index` along `dim`."""
  name = "nova.gather"
  x = operand_def(TENSOR)
  index = operand_def(TENSOR)
  dim = prop_def(INT)


@irdl_op_definition
class EmbeddingOp(NNOp):
  """The rows of weight at idx."""
  name = "nova.embedding"
  weight = operand_def(TENSOR)
  idx = operand_def(TENSOR)


@irdl_op_definition
class EmbeddingBackwardOp(NNOp):
  """g's rows summed into `num` rows at idx (the VJP of embedding)."""
  name = "nova.embedding_backward"
  g = operand_def(TENSOR)
  idx = operand_def(TENSOR)
  num = prop_def(INT)


@irdl_op_definition
class CrossEntropyOp(NNOp):
  """The per-row loss -log_softmax(logits)[target], 0 where target is `ignore_index`, in `dtype` (absent: the
  logits')."""
  name = "nova.cross_entropy"
  logits = operand_def(TENSOR)
  target = operand_def(TENSOR)
  ignore_index = prop_def(INT)
  dtype = opt_prop_def(ELEMENT | NONE)


@irdl_op_definition
class CrossEntropyBackwardOp(NNOp):
  """g * (softmax(logits) - one_hot(target)), 0 in ignored rows."""
  name = "nova.cross_entropy_backward"
  g = operand_def(TENSOR)
  logits = operand_def(TENSOR)
  target = operand_def(TENSOR)
  ignore_index = prop_def(INT)


@irdl_op_definition
class CrossEntropyWithStatsOp(MultiResultOp):
  """cross_entropy's loss, and the row statistics its backward reads (the max of each row of logits and the sum of
  exp(x - max), float32; float64 for float64 logits)."""
  name = "nova.cross_entropy_with_stats"
  logits = operand_def(TENSOR)
  target = operand_def(TENSOR)
  ignore_index = prop_def(INT)
  dtype = opt_prop_def(ELEMENT | NONE)
  loss = result_def(TENSOR)
  row_max = result_def(TENSOR)
  sum_exp = result_def(TENSOR)


@irdl_op_definition
class CrossEntropyBackwardWithStatsOp(NNOp):
  """cross_entropy_backward from the forward's row statistics (one read of the logits)."""
  name = "nova.cross_entropy_backward_with_stats"
  g = operand_def(TENSOR)
  logits = operand_def(TENSOR)
  target = operand_def(TENSOR)
  row_max = operand_def(TENSOR)
  sum_exp = operand_def(TENSOR)
  ignore_index = prop_def(INT)


@irdl_op_definition
class CrossEntropyWithGradOp(MultiResultOp):
  """cross_entropy's loss (in `dtype`, absent: the logits') and cross_entropy_backward's gradient from g, in one
  op: each row's statistics are computed once, for both."""
  name = "nova.cross_entropy_with_grad"
  g = operand_def(TENSOR)
  logits = operand_def(TENSOR)
  target = operand_def(TENSOR)
  ignore_index = prop_def(INT)
  dtype = opt_prop_def(ELEMENT | NONE)
  loss = result_def(TENSOR)
  dlogits = result_def(TENSOR)


@irdl_op_definition
class CrossEntropyStatsOp(MultiResultOp):
  """Per row of logits (N, C), classes [start, start + C) of a vocabulary split over ranks: the max, the sum of
  exp(x - max) and the target's logit (0 where the target is outside that range), float32 (float64 for float64)."""
  name = "nova.cross_entropy_stats"
  logits = operand_def(TENSOR)
  target = operand_def(TENSOR)
  start = prop_def(INT)
  row_max = result_def(TENSOR)
  sum_exp = result_def(TENSOR)
  picked = result_def(TENSOR)


@irdl_op_definition
class CrossEntropyLseBackwardOp(NNOp):
  """g * (exp(logits - lse) - one_hot(target - start)) of the logits' type, 0 in rows whose target is ignore_index."""
  name = "nova.cross_entropy_lse_backward"
  g = operand_def(TENSOR)
  logits = operand_def(TENSOR)
  target = operand_def(TENSOR)
  lse = operand_def(TENSOR)
  start = prop_def(INT)
  ignore_index = prop_def(INT)


@irdl_op_definition
class LstmCellOp(NNOp):
  """One LSTM step after its matmuls: [h', c'] (N, 2H) from the gate pre-activations gi + gh (N, 4H) and c (N, H)."""
  name = "nova.lstm_cell"
  gi = operand_def(TENSOR)
  gh = operand_def(TENSOR)
  c = operand_def(TENSOR)


@irdl_op_definition
class LstmCellBackwardOp(NNOp):
  """[d gates, d c] (N, 5H) from the gradient g of lstm_cell's [h', c'], its inputs and its output."""
  name = "nova.lstm_cell_backward"
  g = operand_def(TENSOR)
  gi = operand_def(TENSOR)
  gh = operand_def(TENSOR)
  c = operand_def(TENSOR)
  out = operand_def(TENSOR)


@irdl_op_definition
class LstmSequenceOp(NNOp):
  """An LSTM direction's whole time loop: every step's [h, c] (L, N, 2H) from the input gates gi (L, N, 4H), h0 and
  c0 (N, H), w_hh (4H, H) and the optional b_hh (4H,), steps from the last when `reverse`; float32 recurrent matmuls
  in TF32 when `tf32`."""
  name = "nova.lstm_sequence"
  gi = operand_def(TENSOR)
  h0 = operand_def(TENSOR)
  c0 = operand_def(TENSOR)
  w_hh = operand_def(TENSOR)
  b_hh = opt_operand_def(TENSOR)
  reverse = prop_def(BOOL)
  tf32 = opt_prop_def(BOOL | NONE)
  irdl_options = (AttrSizedOperandSegments(as_property=True), ParsePropInAttrDict())
  assembly_format = ("$gi `,` $h0 `,` $c0 `,` $w_hh (`bias` $b_hh^ `:` type($b_hh))? attr-dict `:` type($gi) `,` "
                     "type($h0) `,` type($c0) `,` type($w_hh) `->` type($result)")


@irdl_op_definition
class LstmSequenceBackwardOp(MultiResultOp):
  """lstm_sequence's gradients from g (L, N, 2H) and its output: d gi, then d h0 and d c0 when `states`, d w_hh when
  `weights` and d b_hh when `weights` and b_hh is given (each absent otherwise), in their inputs' types."""
  name = "nova.lstm_sequence_backward"
  g = operand_def(TENSOR)
  gi = operand_def(TENSOR)
  h0 = operand_def(TENSOR)
  c0 = operand_def(TENSOR)
  w_hh = operand_def(TENSOR)
  b_hh = opt_operand_def(TENSOR)
  out = operand_def(TENSOR)
  reverse = prop_def(BOOL)
  states = prop_def(BOOL)
  weights = prop_def(BOOL)
  tf32 = opt_prop_def(BOOL | NONE)
  d_gi = result_def(TENSOR)
  d_h0 = opt_result_def(TENSOR)
  d_c0 = opt_result_def(TENSOR)
  d_w_hh = opt_result_def(TENSOR)
  d_b_hh = opt_result_def(TENSOR)
  irdl_options = (AttrSizedOperandSegments(as_property=True), AttrSizedResultSegments(as_property=True),
                  ParsePropInAttrDict())
  assembly_format = ("$g `,` $gi `,` $h0 `,` $c0 `,` $w_hh (`bias` $b_hh^ `:` type($b_hh))? `,` $out attr-dict `:` "
                     "type($g) `,` type($gi) `,` type($h0) `,` type($c0) `,` type($w_hh) `,` type($out) `->` "
                     "type($d_gi) (`d_h0` type($d_h0)^)? (`d_c0` type($d_c0)^)? (`d_w_hh` type($d_w_hh)^)? "
                     "(`d_b_hh` type($d_b_hh)^)?")


@irdl_op_definition
class GruSequenceOp(NNOp):
  """A GRU direction's whole time loop: every step's h (L, N, H) from the input gates gi (L, N, 3H), h0 (N, H), w_hh
  (3H, H) and the optional b_hh (3H,), steps from the last when `reverse`; float32 recurrent matmuls in TF32 when
  `tf32`."""
  name = "nova.gru_sequence"
  gi = operand_def(TENSOR)
  h0 = operand_def(TENSOR)
  w_hh = operand_def(TENSOR)
  b_hh = opt_operand_def(TENSOR)
  reverse = prop_def(BOOL)
  tf32 = opt_prop_def(BOOL | NONE)
  irdl_options = (AttrSizedOperandSegments(as_property=True), ParsePropInAttrDict())
  assembly_format = ("$gi `,` $h0 `,` $w_hh (`bias` $b_hh^ `:` type($b_hh))? attr-dict `:` type($gi) `,` type($h0) "
                     "`,` type($w_hh) `->` type($result)")


@irdl_op_definition
class GruSequenceBackwardOp(MultiResultOp):
  """gru_sequence's gradients from g (L, N, H) and its output: d gi, then d h0 when `states`, d w_hh when `weights`
  and d b_hh when `weights` and b_hh is given (each absent otherwise), in their inputs' types."""
  name = "nova.gru_sequence_backward"
  g = operand_def(TENSOR)
  gi = operand_def(TENSOR)
  h0 = operand_def(TENSOR)
  w_hh = operand_def(TENSOR)
  b_hh = opt_operand_def(TENSOR)
  out = operand_def(TENSOR)
  reverse = prop_def(BOOL)
  states = prop_def(BOOL)
  weights = prop_def(BOOL)
  tf32 = opt_prop_def(BOOL | NONE)
  d_gi = result_def(TENSOR)
  d_h0 = opt_result_def(TENSOR)
  d_w_hh = opt_result_def(TENSOR)
  d_b_hh = opt_result_def(TENSOR)
  irdl_options = (AttrSizedOperandSegments(as_property=True), AttrSizedResultSegments(as_property=True),
                  ParsePropInAttrDict())
  assembly_format = ("$g `,` $gi `,` $h0 `,` $w_hh (`bias` $b_hh^ `:` type($b_hh))? `,` $out attr-dict `:` type($g) "
                     "`,` type($gi) `,` type($h0) `,` type($w_hh) `,` type($out) `->` type($d_gi) "
                     "(`d_h0` type($d_h0)^)? (`d_w_hh` type($d_w_hh)^)? (`d_b_hh` type($d_b_hh)^)?")


@irdl_op_definition
class GruCellOp(NNOp):
  """One GRU step after its matmuls: h' (N, H) from the gate pre-activations gi and gh (N, 3H) and h (N, H)."""
  name = "nova.gru_cell"
  gi = operand_def(TENSOR)
  gh = operand_def(TENSOR)
  h = operand_def(TENSOR)


@irdl_op_definition
class GruCellBackwardOp(NNOp):
  """[d gi, d gh, d h] (N, 7H) from the gradient g of gru_cell's h' and its inputs."""
  name = "nova.gru_cell_backward"
  g = operand_def(TENSOR)
  gi = operand_def(TENSOR)
  gh = operand_def(TENSOR)
  h = operand_def(TENSOR)


@irdl_op_definition
class FlashAttentionOp(NNOp):
  """softmax(q k^T * scale [causal]) v without the weights in memory."""
  name = "nova.flash_attention"
  q = operand_def(TENSOR)
  k = operand_def(TENSOR)
  v = operand_def(TENSOR)
  causal = prop_def(BOOL)
  scale = prop_def(FLOAT)
  tf32 = opt_prop_def(BOOL | NONE)


@irdl_op_definition
class FlashAttentionTransposedOp(NNOp):
  """flash_attention of q, k, v (B, H, L, E) with its output's heads after its positions: (B, L, H, E), q's type."""
  name = "nova.flash_attention_transposed"
  q = operand_def(TENSOR)
  k = operand_def(TENSOR)
  v = operand_def(TENSOR)
  causal = prop_def(BOOL)
  scale = prop_def(FLOAT)
  tf32 = opt_prop_def(BOOL | NONE)


@irdl_op_definition
class FlashAttentionBackwardPackedOp(NNOp):
  """flash_attention_backward's dq, dk and dv of a self-attention (q, k, v of one shape (B, H, L, E)) as one
  (B, L, 3, H, E) tensor of q's type."""
  name = "nova.flash_attention_backward_packed"
  g = operand_def(TENSOR)
  q = operand_def(TENSOR)
  k = operand_def(TENSOR)
  v = operand_def(TENSOR)
  out = operand_def(TENSOR)
  causal = prop_def(BOOL)
  scale = prop_def(FLOAT)
  tf32 = opt_prop_def(BOOL | NONE)


@irdl_op_definition
class FlashAttentionBackwardOp(MultiResultOp):
  """flash_attention's gradients dq, dk and dv, of q's, k's and v's types."""
  name = "nova.flash_attention_backward"
  g = operand_def(TENSOR)
  q = operand_def(TENSOR)
  k = operand_def(TENSOR)
  v = operand_def(TENSOR)
  out = operand_def(TENSOR)
  causal = prop_def(BOOL)
  scale = prop_def(FLOAT)
  tf32 = opt_prop_def(BOOL | NONE)
  dq = result_def(TENSOR)
  dk = result_def(TENSOR)
  dv = result_def(TENSOR)


@irdl_op_definition
class FlashAttentionLseOp(NNOp):
  """flash_attention with each query's logsumexp packed as one more column: (..., L, E + 1), float32 (float64 for
  float64 inputs)."""
  name = "nova.flash_attention_lse"
  q = operand_def(TENSOR)
  k = operand_def(TENSOR)
  v = operand_def(TENSOR)
  causal = prop_def(BOOL)
  scale = prop_def(FLOAT)
  tf32 = opt_prop_def(BOOL | NONE)


@irdl_op_definition
class FlashAttentionLseBackwardOp(MultiResultOp):
  """flash_attention_lse's gradients dq, dk and dv from those of the output (g, of q's type) and of the logsumexp
  (glse); `out` is the output cast to q's type."""
  name = "nova.flash_attention_lse_backward"
  g = operand_def(TENSOR)
  glse = operand_def(TENSOR)
  q = operand_def(TENSOR)
  k = operand_def(TENSOR)
  v = operand_def(TENSOR)
  out = operand_def(TENSOR)
  causal = prop_def(BOOL)
  scale = prop_def(FLOAT)
  tf32 = opt_prop_def(BOOL | NONE)
  dq = result_def(TENSOR)
  dk = result_def(TENSOR)
  dv = result_def(TENSOR)


# *** multi-tensor ops: one op over a whole list of tensors (the optimizer's update, gradient clipping) ***

@irdl_op_definition
class AdamwOp(MultiResultOp):
  """AdamW's step on n parameters at once (PyTorch's update, decoupled weight decay), as `ops.adamw_` documents it.

  Operands `xs`: n params, n grads, n exp_avgs, n exp_avg_sqs, n steps (0-d float64), then lr (0-d float64), and
  with `clip` a 0-d float32 factor each gradient is multiplied by as it is read (passes/fuse_norms.py).
  Results `outs`: n new params, n new exp_avgs, n new exp_avg_sqs, n new steps, in the operands' types."""
  name = "nova.adamw"
  xs = var_operand_def(TENSOR)
  outs = var_result_def(TENSOR)
  n = prop_def(INT)
  beta1 = prop_def(FLOAT)
  beta2 = prop_def(FLOAT)
  eps = prop_def(FLOAT)
  weight_decay = prop_def(FLOAT)
  clip = opt_prop_def(BOOL | NONE)

  def updated_operands(self) -> list[int]:
    """The operand each result is the new value of: params, exp_avgs, exp_avg_sqs and steps (not grads, lr, clip)."""
    n = len(self.outs) // 4
    return [*range(n), *range(2 * n, 5 * n)]


@irdl_op_definition
class SgdOp(MultiResultOp):
  """SGD's step on n parameters at once (PyTorch's update), as `ops.sgd_` documents it.

  Operands `xs`: n params, n grads, n momentum buffers (none when momentum is 0), then lr (0-d float64), and with
  `clip` a 0-d float32 factor each gradient is multiplied by as it is read (passes/fuse_norms.py).
  Results `outs`: n new params and n new buffers (none when momentum is 0), in the operands' types."""
  name = "nova.sgd"
  xs = var_operand_def(TENSOR)
  outs = var_result_def(TENSOR)
  n = prop_def(INT)
  momentum = prop_def(FLOAT)
  dampening = prop_def(FLOAT)
  weight_decay = prop_def(FLOAT)
  nesterov = prop_def(BOOL)
  maximize = prop_def(BOOL)
  is_first_step = prop_def(BOOL)
  clip = opt_prop_def(BOOL | NONE)

  def updated_operands(self) -> list[int]:
    """The operand each result is the new value of: params and momentum buffers (not grads, lr, clip)."""
    n = self.attrs()["n"]
    return [*range(n), *range(2 * n, 2 * n + len(self.outs) - n)]


@irdl_op_definition
class SumSquaresOp(SingleResultOp):
  """The float32 sum of the squares of every element of every operand (their joint squared 2-norm)."""
  name = "nova.sum_squares"
  xs = var_operand_def(TENSOR)


@irdl_op_definition
class ScaleOp(MultiResultOp):
  """Operands `xs`: n tensors, then a 0-d float32 factor; results `outs`: the n tensors times the factor, each in
  its own dtype."""
  name = "nova.scale"
  xs = var_operand_def(TENSOR)
  outs = var_result_def(TENSOR)

  def updated_operands(self) -> list[int]:
    """The operand each result is the new value of: the n tensors."""
    return list(range(len(self.outs)))


# *** collectives (blutrain.ops.collective) ***

@irdl_op_definition
class AllReduceOp(CollectiveOp):
  """x reduced over the ranks with `reduce_op` (sum, avg, product, max, min)."""
  name = "nova.all_reduce"
  reduce_op = prop_def(STR)


@irdl_op_definition
class ReduceScatterOp(CollectiveOp):
  """This rank's block of x reduced over the ranks with `reduce_op`: dim 0 cut into `size` blocks, rank r gets the
  r-th."""
  name = "nova.reduce_scatter"
  reduce_op = prop_def(STR)


@irdl_op_definition
class AllGatherOp(CollectiveOp):
  """Every rank's x in rank order, joined along dim 0."""
  name = "nova.all_gather"


# *** fusion: ops the compiler makes, with no primitive of their own ***

@irdl_op_definition
class FusedOp(NovaOp):
  """A group of elementwise ops over one output shape, run as one kernel (`passes/fuse_pointwise.py`). The body is
  one block: its arguments stand for the operands `xs`, its ops are elementwise ops and splats (`nova.full`), and its
  `nova.yield` gives the results `outs`, the group's values used outside it. Operands broadcast to the shape of the
  results (all equal):

    %5, %6 = nova.fused %1, %2 : (tensor<8x32xf32>, tensor<32xf32>) -> (tensor<8x32xf32>, tensor<8x32xf32>) {
    ^bb0(%7: tensor<8x32xf32>, %8: tensor<32xf32>):
      %9 = nova.add %7, %8 : (tensor<8x32xf32>, tensor<32xf32>) -> tensor<8x32xf32>
      %10 = nova.gelu %9 {approximate = "tanh"} : (tensor<8x32xf32>) -> tensor<8x32xf32>
      nova.yield %9, %10 : tensor<8x32xf32>, tensor<8x32xf32>
    }
  """
  name = "nova.fused"
  xs = var_operand_def(TENSOR)
  outs = var_result_def(TENSOR)
  body = region_def("single_block")
  assembly_format = "$xs attr-dict-with-keyword `:` functional-type($xs, $outs) $body"

  def verify_(self) -> None:
    block = self.body.block
    if [a.type for a in block.args] != [v.type for v in self.xs]:
      raise VerifyException(f"{self.name}: the body's arguments ({', '.join(str(a.type) for a in block.args)}) do not "
                            f"match the operands ({', '.join(str(v.type) for v in self.xs)})")
    *ops, end = block.ops
    bad = [op.name for op in ops if not isinstance(op, (ElementwiseOp, FullOp))]
    if bad: raise VerifyException(f"{self.name}: the body may hold only elementwise ops and splats, not {bad}")
    if [v.type for v in end.operands] != [r.type for r in self.outs]:
      raise VerifyException(f"{self.name}: the body yields ({', '.join(str(v.type) for v in end.operands)}), but the "
                            f"results are ({', '.join(str(r.type) for r in self.outs)})")
    shapes = {aval(r.type).shape for r in self.outs}
    if len(shapes) != 1: raise VerifyException(f"{self.name}: the results differ in shape: {sorted(shapes)}")


@irdl_op_definition
class YieldOp(IRDLOperation):
  """The end of a fused op's body: the values it gives back, in the order of its results."""
  name = "nova.yield"
  values = var_operand_def(TENSOR)
  traits = traits_def(IsTerminator(), HasParent(FusedOp), Pure())
  assembly_format = "$values attr-dict `:` type($values)"


COMPILER_OPS = (FusedOp, YieldOp)  # not primitives of the op library: the dialect test leaves them out

Nova = Dialect("nova", [
  FullOp, EmptyOp, ArangeOp, RandOp, RandnOp, RandintOp, BernoulliOp, DropoutOp,
  NegOp, ExpOp, LogOp, SqrtOp, RsqrtOp, AbsOp,
  SinOp, CosOp, TanhOp, SigmoidOp, ReluOp, ErfOp, FloorOp, SignOp, TanOp, AsinOp, AcosOp, AtanOp, SinhOp, CoshOp,
  AsinhOp, AcoshOp, AtanhOp, Exp2Op, Log2Op, Log10Op, Log1pOp, Expm1Op, CeilOp, TruncOp, RoundOp, BitwiseNotOp,
  LogicalNotOp, CopyOp, GeluOp, CastOp, CastManyOp, AddOp, SubOp, MulOp, DivOp, PowOp, Atan2Op, CopysignOp, FmodOp,
  RemainderOp,
  FloorDivideOp, BitwiseAndOp, BitwiseOrOp, BitwiseXorOp, BitwiseLeftShiftOp, BitwiseRightShiftOp, MaximumOp, MinimumOp,
  EqOp, NeOp, LtOp, LeOp, GtOp, GeOp, LogicalAndOp, LogicalOrOp, LogicalXorOp, WhereOp, GeluBackwardOp, ReluBackwardOp,
  SumOp, AmaxOp,
  AminOp, ArgmaxOp, ArgminOp, CumsumOp, CumprodOp, ArgsortOp, ViewOp, PermuteOp, ExpandOp, SliceOp, SliceBackwardOp,
  CatOp, IndexOp, IndexBackwardOp, IndexPutOp, MatmulOp, LinearOp, LinearBackwardOp, GemmOp, WeightGradOp, ConvOp, ConvGradInputOp, ConvGradWeightOp,
  SoftmaxOp,
  LogSoftmaxOp, LayerNormOp, AddLayerNormOp, LayerNormBackwardOp, BatchNormStatsOp,
  BatchNormOp,
  BatchNormBackwardOp, ScatterAddOp, ScatterReduceOp, MaxPool2dIndicesOp, MaxPool2dValuesOp,
  MaxPool2dWithIndicesOp, MaxPool2dBackwardOp, GatherOp, EmbeddingOp,
  EmbeddingBackwardOp, CrossEntropyOp, CrossEntropyBackwardOp, CrossEntropyWithStatsOp,
  CrossEntropyBackwardWithStatsOp, CrossEntropyWithGradOp, CrossEntropyStatsOp, CrossEntropyLseBackwardOp,
  FlashAttentionOp, FlashAttentionTransposedOp, FlashAttentionBackwardOp, FlashAttentionBackwardPackedOp,
  FlashAttentionLseOp, FlashAttentionLseBackwardOp, LstmCellOp, LstmCellBackwardOp, LstmSequenceOp,
  LstmSequenceBackwardOp, GruCellOp, GruCellBackwardOp, GruSequenceOp, GruSequenceBackwardOp, AdamwOp, SgdOp, SumSquaresOp, ScaleOp, AllReduceOp, ReduceScatterOp,
  AllGatherOp, *COMPILER_OPS,
])

OP_CLASSES: dict[str, type[NovaOp]] = {op.name[5:]: op for op in Nova.operations
                                        if op not in COMPILER_OPS}  # the op library's name -> class
