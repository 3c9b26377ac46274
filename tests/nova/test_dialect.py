"""The nova dialect: one op class per primitive, held to the op library's signatures; attribute encoding, MLIR
print/parse round trip, and the verifier."""
import math

import pytest
from xdsl.irdl import (AttrSizedOperandSegments, IRDLOperation, OptPropertyDef, ParsePropInAttrDict, irdl_op_definition,
                       operand_def, opt_operand_def, prop_def, var_operand_def)
from xdsl.utils.exceptions import VerifyException

from blutrain import dtypes
from blutrain.nova import ir
from blutrain.nova.dialect import (COMPILER_OPS, FLOAT, INT, KINDS, NONE, OP_CLASSES, TENSOR, MultiResultOp, NNOp, Nova,
                                   NovaOp, RandomOp, SingleResultOp, decode, encode)
from blutrain.nova.graph import literal
from blutrain.ops import registry
from blutrain.ops.core import Op
from tests.nova.graphs import Builder, every_op, gpt_like


def _signature(module) -> list[tuple]:
  """Each nova op of the module's function: its name, its operands' positions (None for an absent one), its result
  types and its attributes (floats in hex: -0.0 is not 0.0)."""
  block = ir.function(module).body.block
  position = {v: i for i, v in enumerate(block.args)}
  out = []
  for op in block.ops:
    if not isinstance(op, NovaOp): continue
    out.append((op.opname, [None if v is None else position[v] for v in op.graph_inputs()],
                [str(r.type) for r in op.results], {k: literal(v) for k, v in op.attrs().items()}))
    position.update((r, len(position)) for r in op.results)
  return out


# *** the dialect against the op library ***

def _unmatched(classes: list[type[IRDLOperation]]) -> tuple[list[str], list[str]]:
  """Registry ops without a dialect class (to_device needs none), and dialect ops that are not one registry op."""
  names = [cls.name.removeprefix("nova.") for cls in classes]
  return (sorted(set(registry) - {"to_device"} - set(names)),
          sorted({n for n in names if n not in registry or names.count(n) > 1}))


def _kind(constr) -> str:
  return next((k for k, c in KINDS.items() if constr in (c, c | NONE)), str(constr))


def _differences(cls: type[NovaOp], op: Op) -> list[str]:
  """How the class's operands, properties and results differ from the op's signature. A random op's seed is its
  operand `rng`, not a property."""
  inputs, attrs = op.inputs, op.attrs
  if issubclass(cls, RandomOp): inputs, attrs = inputs + ("rng",), tuple(a for a in attrs if a.name != "seed")
  operands, names, _ = cls.signature()
  out = [] if operands == inputs else [f"operands ({', '.join(operands)}) != ({', '.join(inputs)})"]
  if issubclass(cls, MultiResultOp) != op.multi:
    out.append(f"{'several results' if issubclass(cls, MultiResultOp) else 'one result'} != "
               f"{'several outputs' if op.multi else 'one output'}")
  if names != tuple(a.name for a in attrs):
    out.append(f"properties ({', '.join(names)}) != ({', '.join(a.name for a in attrs)})")
  props = cls.get_irdl_definition().properties
  for a in attrs:
    if (d := props.get(a.name)) is None: continue
    if isinstance(d, OptPropertyDef) != a.optional:
      out.append(f"{a.name}: {'optional' if isinstance(d, OptPropertyDef) else 'required'} != "
                 f"{'optional' if a.optional else 'required'}")
    elif d.constr != (KINDS[a.kind] | NONE if a.optional else KINDS[a.kind]):
      out.append(f"{a.name}: {_kind(d.constr)} != {a.kind}")
  return out


def test_one_op_class_per_primitive():
  assert _unmatched([c for c in Nova.operations if c not in COMPILER_OPS]) == ([], [])
  graph, _ = every_op()
  assert {eq.op for eq in graph.equations} == set(OP_CLASSES), "every_op() must cover every primitive"


@pytest.mark.parametrize("name", sorted(OP_CLASSES))
def test_op_class_matches_the_op_library(name):
  assert _differences(OP_CLASSES[name], registry[name]) == []


def test_a_class_off_the_op_library_is_reported():
  @irdl_op_definition
  class LayerNormOp(NNOp):
    name = "nova.layer_norm"
    x = operand_def(TENSOR)
    bias = opt_operand_def(TENSOR)
    weight = opt_operand_def(TENSOR)
    n = prop_def(FLOAT)
    eps = prop_def(FLOAT)
    tf32 = prop_def(INT)
    irdl_options = (AttrSizedOperandSegments(as_property=True), ParsePropInAttrDict())
    assembly_format = None

  assert _differences(LayerNormOp, registry["layer_norm"]) == [
    "operands (x, ?bias, ?weight) != (x, ?weight, ?bias)", "properties (n, eps, tf32) != (n, eps, dtype)",
    "n: float != int"]
  classes = [cls for cls in Nova.operations if cls.name != "nova.add" and cls not in COMPILER_OPS] + [LayerNormOp]
  assert _unmatched(classes) == (["add"], ["layer_norm"])

  @irdl_op_definition
  class ScaleOp(SingleResultOp):
    name = "nova.scale"
    xs = var_operand_def(TENSOR)

  assert _differences(ScaleOp, registry["scale"]) == ["one result != several outputs"]


@pytest.mark.parametrize("value", [True, False, 0, 1, -2**63, 2**63 - 1, 1.0, -0.0, 0.1, 1e-300, 0.35355339059327373,
                                   math.inf, -math.inf, "tanh", None, (), (1, 2), ((0, 3, 1), (2, 5, 2)),
                                   (1, 2.5, None, "a", (True,)), *dtypes.all_dtypes])
def test_attribute_encoding_round_trips(value):
  assert literal(decode(encode(value))) == literal(value)


def test_nan_attribute_round_trips():
  assert math.isnan(decode(encode(math.nan)))


@pytest.mark.parametrize("make", [lambda: every_op()[0], lambda: gpt_like(2)[0]], ids=["every_op", "gpt"])
def test_print_parse_round_trip(make):
  graph = make()
  module = ir.to_module(graph)
  module.verify()
  text = ir.print_module(module)
  again = ir.parse_module(text)
  assert ir.print_module(again) == text
  assert _signature(again) == _signature(module)


def test_special_floats_survive_printing():
  b = Builder()
  values = [math.inf, -math.inf, -0.0, 1e-300, 0.1, 1 / 3, 2.0**-1074]
  graph = b.output(*(b.full((2,), v) for v in values))
  back = _signature(ir.parse_module(ir.print_module(ir.to_module(graph))))
  assert [attrs["value"] for *_, attrs in back] == [literal(v) for v in values]


def test_optional_operands_keep_their_place():
  b = Builder()
  x, w = b.input((2, 4)), b.input((4,))
  graph = b.output(b("layer_norm", x, None, w, n=1, eps=1e-5))
  text = ir.print_module(ir.to_module(graph))
  assert "bias %1" in text and "weight" not in text
  assert _signature(ir.parse_module(text))[0][1] == [0, None, 1]


def test_to_device_is_rejected():
  b = Builder()
  x = b.input((2,))
  graph = b.graph
  from blutrain.nova.graph import Equation, Value
  graph.equations.append(Equation("to_device", [x], {"device": "cuda:0"}, [Value(1, (2,), dtypes.float32)]))
  with pytest.raises(ValueError, match="to_device.*one device"):
    ir.to_module(graph)


def _module(body: str, args: str) -> str:
  return f"builtin.module {{\n  func.func @step({args}) {{\n{body}\n    func.return\n  }}\n}}\n"


@pytest.mark.parametrize("body, args, expected", [
  ("    %2 = nova.add %0, %1 : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x4xf32>",
   "%0: tensor<4x8xf32>, %1: tensor<8xf32>",
   r"nova.add: operands \(float32\[4, 8\], float32\[8\]\) with \{\} give float32\[4, 8\], but the result type is float32\[4, 4\]"),
  ("    %2 = nova.matmul %0, %1 : (tensor<4x8xf32>, tensor<7x3xf32>) -> tensor<4x3xf32>",
   "%0: tensor<4x8xf32>, %1: tensor<7x3xf32>",
   r"nova.matmul: operands \(float32\[4, 8\], float32\[7, 3\]\) .* fail the shape rule: matmul: cannot contract \(4, 8\) with \(7, 3\): 8 != 7"),
  ("    %1 = nova.cast %0 {dtype = f16} : (tensor<4xf32>) -> tensor<4xbf16>", "%0: tensor<4xf32>",
   r"nova.cast: operands \(float32\[4\]\) with \{'dtype': blutrain.float16\} give float16\[4\], but the result type is bfloat16\[4\]"),
  ("    %1 = nova.permute %0 {dims = array<i64: 0, 0>} : (tensor<4x2xf32>) -> tensor<4x4xf32>", "%0: tensor<4x2xf32>",
   r"nova.permute: .* fail the shape rule: permute: \(0, 0\) is not a permutation"),
  ("    %1 = nova.sum %0 {dims = array<i64: 0>, keepdim = 2 : i64} : (tensor<4xf32>) -> tensor<f32>", "%0: tensor<4xf32>",
   "Expected one of false, true, but got 2 : i64"),
  ("    %1 = nova.exp %0 : (tensor<4xui32>) -> tensor<4xui32>", "%0: tensor<4xui32>", "ui32"),
  ("    %1 = nova.rand %0 {shape = array<i64: 2>, dtype = f32, offset = 0 : i64} : (tensor<3xi64>) -> tensor<2xf32>",
   "%0: tensor<3xi64>", "tensor<3xi64>"),
  ("    %3, %4 = nova.scale %0, %1, %2 : (tensor<3x4xf32>, tensor<4xf32>, tensor<f32>) -> (tensor<3x4xf32>, tensor<3xf32>)",
   "%0: tensor<3x4xf32>, %1: tensor<4xf32>, %2: tensor<f32>",
   r"nova.scale: operands \(float32\[3, 4\], float32\[4\], float32\[\]\) with \{\} give \(float32\[3, 4\], float32\[4\]\), "
   r"but the result types are \(float32\[3, 4\], float32\[3\]\)"),
  ("    %3 = nova.scale %0, %1, %2 : (tensor<3x4xf32>, tensor<4xf32>, tensor<f32>) -> tensor<3x4xf32>",
   "%0: tensor<3x4xf32>, %1: tensor<4xf32>, %2: tensor<f32>",
   r"give \(float32\[3, 4\], float32\[4\]\), but the result type is float32\[3, 4\]"),
])
def test_invalid_ir_is_reported(body, args, expected):
  with pytest.raises(VerifyException, match=expected):
    ir.parse_module(_module(body, args))
