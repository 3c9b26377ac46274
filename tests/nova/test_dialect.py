"""The nova dialect: one op per primitive, attribute encoding, MLIR print/parse round trip, and the verifier."""
import math

import pytest
from xdsl.utils.exceptions import VerifyException

from blutrain import dtypes
from blutrain.nova import ir
from blutrain.nova.dialect import OP_CLASSES, OPS, decode, encode
from blutrain.nova.hashing import canonical, graph_key
from blutrain.ops import registry
from tests.nova.graphs import Builder, every_op, gpt_like


def _signature(graph):
  return [(eq.op, eq.out.shape, eq.out.dtype, {k: canonical(v) for k, v in eq.attrs.items()}) for eq in graph.equations]


def test_one_op_per_primitive():
  # adamw and scale have several results, which this table's single-result ops cannot declare
  assert set(OPS) == set(registry) - {"to_device", "adamw", "scale"}
  assert all(cls.name == f"nova.{name}" for name, cls in OP_CLASSES.items())
  graph, _ = every_op()
  assert {eq.op for eq in graph.equations} == set(OPS), "every_op() must cover every primitive"


@pytest.mark.parametrize("value", [True, False, 0, 1, -2**63, 2**63 - 1, 1.0, -0.0, 0.1, 1e-300, 0.35355339059327373,
                                   math.inf, -math.inf, "tanh", None, (), (1, 2), ((0, 3, 1), (2, 5, 2)),
                                   (1, 2.5, None, "a", (True,)), *dtypes.all_dtypes])
def test_attribute_encoding_round_trips(value):
  assert canonical(decode(encode(value))) == canonical(value)


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
  back = ir.to_graph(again)
  assert _signature(back) == _signature(graph)
  assert graph_key(back) == graph_key(graph)


def test_special_floats_survive_printing():
  b = Builder()
  values = [math.inf, -math.inf, -0.0, 1e-300, 0.1, 1 / 3, 2.0**-1074]
  graph = b.output(*(b.full((2,), v) for v in values))
  back = ir.to_graph(ir.parse_module(ir.print_module(ir.to_module(graph))))
  assert [canonical(eq.attrs["value"]) for eq in back.equations] == [canonical(v) for v in values]


def test_optional_operands_keep_their_place():
  b = Builder()
  x, w = b.input((2, 4)), b.input((4,))
  graph = b.output(b("layer_norm", x, None, w, n=1, eps=1e-5))
  text = ir.print_module(ir.to_module(graph))
  assert "bias %1" in text and "weight" not in text
  back = ir.to_graph(ir.parse_module(text))
  assert back.equations[0].inputs[1] is None and back.equations[0].inputs[2] is back.inputs[1]


def test_to_device_is_rejected():
  b = Builder()
  x = b.input((2,))
  graph = b.graph
  from blutrain.nova.graph import Equation, Value
  graph.equations.append(Equation("to_device", [x], {"device": "cuda:0"}, Value(1, (2,), dtypes.float32)))
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
  ("    %1 = nova.exp %0 : (tensor<4xi8>) -> tensor<4xi8>", "%0: tensor<4xi8>", "i8"),
  ("    %1 = nova.rand %0 {shape = array<i64: 2>, dtype = f32, offset = 0 : i64} : (tensor<3xi64>) -> tensor<2xf32>",
   "%0: tensor<3xi64>", "tensor<3xi64>"),
])
def test_invalid_ir_is_reported(body, args, expected):
  with pytest.raises(VerifyException, match=expected):
    ir.parse_module(_module(body, args))
