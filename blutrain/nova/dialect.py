"""The `nova` dialect: one pure op on ranked tensors per primitive of `blutrain.ops`, declared as data.

`OPS` below is the whole vocabulary: op name (identical in `blutrain.ops.registry`, here as `nova.<name>`, and in
the kernels), its family, its operands and its properties. The classes are generated from it; a family base class
owns what its ops share (the result, traits, syntax, the verifier that calls the op's shape rule).

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

Random ops (rand, randn, randint, bernoulli) take one operand, the generator state `tensor<2xi64>` holding
(seed, base offset); their `offset` property is relative to the base offset. They are Pure like every other
nova op: the generator is counter-based, so a draw is a function of (seed, base offset, offset, shape, dtype).
Two draws equal in all of those are the same numbers (CSE may merge them) and an unused draw may be dropped (DCE):
advancing the generator is the runtime's business, not the graph's.
"""
from __future__ import annotations

from typing import Any, ClassVar

from xdsl.dialects.builtin import (ArrayAttr, DenseArrayBase, FloatAttr, IntegerAttr, StringAttr, TensorType, UnitAttr,
                                   bf16, f16, f32, f64, i1, i32, i64)
from xdsl.ir import Attribute, Dialect, SSAValue
from xdsl.irdl import (AttrSetConstraint, AttrSizedOperandSegments, BaseAttr, EqAttrConstraint, IRDLOperation,
                       ParsePropInAttrDict, irdl_op_definition, operand_def, opt_operand_def, opt_prop_def, prop_def,
                       result_def, traits_def, var_operand_def)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from blutrain import dtypes
from blutrain.dtypes import DType
from blutrain.ops import registry
from blutrain.autograd.tape import Aval

# *** types ***

ELEMENT_TYPES: dict[DType, Attribute] = {dtypes.bool_: i1, dtypes.int32: i32, dtypes.int64: i64, dtypes.float16: f16,
                                         dtypes.bfloat16: bf16, dtypes.float32: f32, dtypes.float64: f64}
DTYPES: dict[Attribute, DType] = {t: d for d, t in ELEMENT_TYPES.items()}

_ELEMENT = AttrSetConstraint(frozenset(ELEMENT_TYPES.values()))
_TENSOR = TensorType.constr(_ELEMENT)


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


def _type_str(t: Attribute) -> str:
  a = aval(t)
  return f"{a.dtype.name}{list(a.shape)}"


# *** attribute encoding ***

_encoded: dict[Any, Attribute] = {}


def _typed(v: Any) -> Any:
  """A cache key that keeps True, 1 and 1.0 (and 0.0, -0.0) apart."""
  if isinstance(v, (tuple, list)): return tuple(map(_typed, v))
  return (float, v.hex()) if isinstance(v, float) else (type(v), v)


def encode(v: Any) -> Attribute:
  """A Python attribute value as an xDSL attribute (the table in the module docstring); memoized, since a graph
  repeats few distinct values."""
  key = _typed(v)
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


# What each attribute kind of the table may hold; `?` after a kind marks an attribute that may be absent or None.
_KINDS = {
  "int": BaseAttr(IntegerAttr), "bool": AttrSetConstraint(frozenset((IntegerAttr(0, i1), IntegerAttr(1, i1)))),
  "float": BaseAttr(FloatAttr), "num": BaseAttr(IntegerAttr) | BaseAttr(FloatAttr), "str": BaseAttr(StringAttr),
  "dtype": _ELEMENT, "ints": BaseAttr(DenseArrayBase),
  "index": BaseAttr(ArrayAttr) | BaseAttr(DenseArrayBase),  # ((start, stop, step), ...); () for a 0-d tensor
}


# *** families ***

class NovaOp(IRDLOperation):
  """Base of every nova op: one ranked-tensor result, Pure, properties printed in the attribute dictionary, and a
  verifier that runs the op's shape rule from `blutrain.ops` on the operand types."""
  result = result_def(_TENSOR)
  traits = traits_def(Pure())
  irdl_options = (ParsePropInAttrDict(),)
  assembly_format = "operands attr-dict `:` functional-type(operands, results)"
  ATTRS: ClassVar[tuple[str, ...]] = ()   # attribute names in table order

  @property
  def opname(self) -> str:
    """The op library's name: `nova.add` -> `add`."""
    return self.name[5:]

  def graph_inputs(self) -> list[SSAValue | None]:
    """The operands in the op library's order, None where an optional one is absent."""
    return list(self.operands)

  def attrs(self) -> dict[str, Any]:
    """The attributes as the op library passes them (absent properties left out)."""
    props = self.properties
    return {k: decode(props[k]) for k in self.ATTRS if k in props}

  @classmethod
  def make(cls, inputs: list[SSAValue | None], attrs: dict[str, Any], result_type: Attribute) -> NovaOp:
    """Build the op from graph inputs (None for an absent optional operand) and Python attributes."""
    return cls.create(operands=inputs, result_types=[result_type], properties={k: encode(v) for k, v in attrs.items()})

  def rule_args(self) -> tuple:
    """What the shape rule takes positionally: the operands as Avals."""
    return tuple(None if v is None else aval(v.type) for v in self.graph_inputs())

  def verify_(self) -> None:
    args, attrs = self.rule_args(), self.attrs()
    operands = ", ".join("none" if a is None else f"{a.dtype.name}{list(a.shape)}" for a in args)
    try:
      shape, dtype = registry[self.opname].rule(*args, **attrs)
    except (ValueError, TypeError, IndexError, KeyError) as e:
      raise VerifyException(f"{self.name}: operands ({operands}) with {attrs} fail the shape rule: {e}") from None
    if (tuple(shape), dtype) != (aval(self.result.type).shape, aval(self.result.type).dtype):
      raise VerifyException(f"{self.name}: operands ({operands}) with {attrs} give {dtype.name}{list(shape)}, "
                            f"but the result type is {_type_str(self.result.type)}")


class CreationOp(NovaOp):
  """A tensor made from attributes alone (full, arange)."""
  assembly_format = "attr-dict `:` type($result)"


class RandomOp(NovaOp):
  """A counter-based random draw from the generator state `rng` = (seed, base offset)."""
  rng = operand_def(EqAttrConstraint(TensorType(i64, [2])))

  def rule_args(self) -> tuple: return ()  # the draw's shape and dtype are attributes; rng is not an input of the rule


class ElementwiseOp(NovaOp):
  """Elementwise ops: the result broadcasts the operands' shapes."""


class UnaryOp(ElementwiseOp):
  """One operand, same shape (neg, exp, ..., cast, copy)."""


class BinaryOp(ElementwiseOp):
  """Two broadcasting operands, the first operand's dtype (add, sub, mul, div, pow, maximum, minimum)."""


class CompareOp(ElementwiseOp):
  """Two broadcasting operands, a bool result (eq, ..., logical_xor)."""


class ReduceOp(NovaOp):
  """Reductions and scans along dims (sum, amax, amin, argmax, argmin, cumsum)."""


class LayoutOp(NovaOp):
  """Layout-only ops (view, permute, expand, slice): eager mode makes them views without a kernel."""


class MovementOp(NovaOp):
  """Ops that move data between positions (cat, indexing and the backward of slicing)."""


class NNOp(NovaOp):
  """Linear algebra, normalization, gathers and losses."""


# *** the ops ***

# name: (family, operands, attributes). Operands: `x` one, `?w` optional, `*xs` variadic. Attributes: `key:kind`.
OPS: dict[str, tuple[type[NovaOp], str, str]] = {
  # creation and random
  "full": (CreationOp, "", "shape:ints value:num dtype:dtype"),
  "arange": (CreationOp, "", "start:num step:num shape:ints dtype:dtype"),
  "rand": (RandomOp, "", "shape:ints dtype:dtype offset:int"),
  "randn": (RandomOp, "", "shape:ints dtype:dtype offset:int"),
  "randint": (RandomOp, "", "shape:ints dtype:dtype offset:int low:int high:int"),
  "bernoulli": (RandomOp, "", "shape:ints dtype:dtype offset:int p:float"),
  # elementwise
  **{name: (UnaryOp, "x", "") for name in ("neg", "exp", "log", "sqrt", "rsqrt", "abs", "sin", "cos", "tanh",
                                           "sigmoid", "relu", "erf", "floor", "logical_not", "copy")},
  "gelu": (UnaryOp, "x", "approximate:str"),
  "cast": (UnaryOp, "x", "dtype:dtype"),
  **{name: (BinaryOp, "x y", "") for name in ("add", "sub", "mul", "div", "pow", "maximum", "minimum")},
  **{name: (CompareOp, "x y", "") for name in ("eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
                                               "logical_xor")},
  "where": (ElementwiseOp, "c x y", ""),
  "gelu_backward": (ElementwiseOp, "g x", "approximate:str"),
  # reductions and scans
  "sum": (ReduceOp, "x", "dims:ints keepdim:bool dtype:dtype?"),
  "amax": (ReduceOp, "x", "dims:ints keepdim:bool"),
  "amin": (ReduceOp, "x", "dims:ints keepdim:bool"),
  "argmax": (ReduceOp, "x", "dim:int keepdim:bool"),
  "argmin": (ReduceOp, "x", "dim:int keepdim:bool"),
  "cumsum": (ReduceOp, "x", "dim:int reverse:bool?"),
  # views
  "view": (LayoutOp, "x", "shape:ints"),
  "permute": (LayoutOp, "x", "dims:ints"),
  "expand": (LayoutOp, "x", "shape:ints"),
  "slice": (LayoutOp, "x", "index:index"),
  # movement and indexing
  "slice_backward": (MovementOp, "g", "shape:ints index:index"),
  "cat": (MovementOp, "*xs", "dim:int"),
  "index": (MovementOp, "x *idx", "positions:ints"),
  "index_backward": (MovementOp, "g *idx", "shape:ints positions:ints"),
  "index_put": (MovementOp, "x v *idx", "positions:ints"),
  # linear algebra, normalization, gathers, losses
  "matmul": (NNOp, "a b", "tf32:bool?"),
  "softmax": (NNOp, "x", "dim:int"),
  "log_softmax": (NNOp, "x", "dim:int"),
  "layer_norm": (NNOp, "x ?weight ?bias", "n:int eps:float"),
  "layer_norm_backward": (NNOp, "g x ?weight", "n:int eps:float has_bias:bool"),
  "scatter_add": (NNOp, "x index src", "dim:int"),
  "gather": (NNOp, "x index", "dim:int"),
  "embedding_backward": (NNOp, "g idx", "num:int"),
  "embedding": (NNOp, "weight idx", ""),
  "cross_entropy_backward": (NNOp, "g logits target", "ignore_index:int"),
  "cross_entropy": (NNOp, "logits target", "ignore_index:int"),
  "flash_attention": (NNOp, "q k v", "causal:bool scale:float tf32:bool?"),
  "flash_attention_backward": (NNOp, "g q k v out", "causal:bool scale:float tf32:bool?"),
  # multi-tensor
  "sum_squares": (NNOp, "*xs", ""),
}

def _optional_format(operands: list[str]) -> str:
  """The assembly format of an op with optional operands (required ones first): with two optional operands the
  generic `operands` directive is ambiguous, so each optional operand prints with its keyword and type."""
  required, optional = [s for s in operands if s[0] != "?"], [s[1:] for s in operands if s[0] == "?"]
  return (" `,` ".join(f"${k}" for k in required) + "".join(f" (`{k}` ${k}^ `:` type(${k}))?" for k in optional)
          + " attr-dict `:` " + " `,` ".join(f"type(${k})" for k in required) + " `->` type($result)")


class _OptionalOperandsOp(NovaOp):
  """Mixin of ops with optional operands: they map to None in the graph and keep their position."""
  OPERANDS: ClassVar[tuple[str, ...]] = ()

  def graph_inputs(self) -> list[SSAValue | None]: return [getattr(self, k) for k in self.OPERANDS]

  @classmethod
  def make(cls, inputs, attrs, result_type):
    return cls.build(operands=[[] if v is None else v for v in inputs], result_types=[result_type],
                     properties={k: encode(v) for k, v in attrs.items()})


def _define(name: str, family: type[NovaOp], operands: str, attrs: str) -> type[NovaOp]:
  body: dict[str, Any] = {"name": f"nova.{name}", "__module__": __name__, "__doc__": f"`{name}` of blutrain.ops.",
                          "__annotations__": {"ATTRS": "ClassVar", "OPERANDS": "ClassVar"}}
  for spec in operands.split():
    kind, key = (spec[0], spec[1:]) if spec[0] in "*?" else ("", spec)
    body[key] = {"*": var_operand_def, "?": opt_operand_def, "": operand_def}[kind](_TENSOR)
  keys = []
  for spec in attrs.split():
    key, kind = spec.split(":")
    keys.append(key)
    body[key] = (opt_prop_def(_KINDS[kind[:-1]] | EqAttrConstraint(UnitAttr())) if kind.endswith("?")
                 else prop_def(_KINDS[kind]))
  body["ATTRS"] = tuple(keys)
  bases: tuple[type, ...] = (family,)
  if "?" in operands:
    bases = (_OptionalOperandsOp, family)
    body |= {"OPERANDS": tuple(s.lstrip("*?") for s in operands.split()), "assembly_format": _optional_format(operands.split()),
             "irdl_options": (AttrSizedOperandSegments(as_property=True), ParsePropInAttrDict())}
  cls_name = "".join(p.title() for p in name.split("_")) + "Op"
  return irdl_op_definition(type(cls_name, bases, body | {"__qualname__": cls_name}))


OP_CLASSES: dict[str, type[NovaOp]] = {name: _define(name, *spec) for name, spec in OPS.items()}
assert not {cls.__name__ for cls in OP_CLASSES.values()} & set(globals()), "an op class would shadow a family"
globals().update({cls.__name__: cls for cls in OP_CLASSES.values()})

Nova = Dialect("nova", list(OP_CLASSES.values()))
