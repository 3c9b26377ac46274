"""An op with a fixed and two optional results, end to end: `split_layer_norm_backward` (layer_norm's gradients
apart: dx, then dweight when weight is given and dbias when `has_bias`) declared for these tests only, in the op
library, the dialect and the CPU kernels. No primitive of the op library has optional results yet."""
import math

import numpy as np
import pytest
from xdsl.irdl import (AttrSizedOperandSegments, AttrSizedResultSegments, ParsePropInAttrDict, irdl_op_definition,
                       operand_def, opt_operand_def, opt_result_def, prop_def, result_def)
from xdsl.parser import Parser

from blutrain.backend.cpu.kernels import kernels
from blutrain.nova import ir
from blutrain.nova.dialect import BOOL, FLOAT, INT, OP_CLASSES, TENSOR, MultiResultOp
from blutrain.nova.hashing import value_hashes
from blutrain.nova.pipeline import compile_graph
from blutrain.ops import registry
from blutrain.ops.core import Op, parse_signature
from tests.nova.graphs import Builder


@irdl_op_definition
class SplitLayerNormBackwardOp(MultiResultOp):
  """dx, then dweight when weight is given and dbias when `has_bias` (each absent otherwise)."""
  name = "nova.split_layer_norm_backward"
  g = operand_def(TENSOR)
  x = operand_def(TENSOR)
  weight = opt_operand_def(TENSOR)
  n = prop_def(INT)
  eps = prop_def(FLOAT)
  has_bias = prop_def(BOOL)
  dx = result_def(TENSOR)
  dweight = opt_result_def(TENSOR)
  dbias = opt_result_def(TENSOR)
  irdl_options = (AttrSizedOperandSegments(as_property=True), AttrSizedResultSegments(as_property=True),
                  ParsePropInAttrDict())
  assembly_format = ("$g `,` $x (`weight` $weight^ `:` type($weight))? attr-dict `:` type($g) `,` type($x) "
                     "`->` type($dx) (`dweight` type($dweight)^)? (`dbias` type($dbias)^)?")


def _rule(g, x, w, n, eps, has_bias):
  normalized = x.shape[x.ndim - n:]
  return [(x.shape, x.dtype), (normalized, x.dtype) if w is not None else None,
          (normalized, x.dtype) if has_bias else None]


def _kernel(g, x, w, n, eps, has_bias):
  """The CPU kernel of layer_norm_backward, its concatenated gradients split apart."""
  flat, normalized = kernels["layer_norm_backward"](g, x, w, n=n, eps=eps, has_bias=has_bias), x.shape[x.ndim - n:]
  rest = iter(flat[x.size:].reshape(-1, math.prod(normalized)))
  return (flat[:x.size].reshape(x.shape), next(rest).reshape(normalized) if w is not None else None,
          next(rest).reshape(normalized) if has_bias else None)


@pytest.fixture(autouse=True)
def _declared(monkeypatch):
  inputs, attrs = parse_signature("g x ?weight", "n:int eps:float has_bias:bool")
  monkeypatch.setitem(registry, "split_layer_norm_backward",
                      Op("split_layer_norm_backward", _rule, multi=True, inputs=inputs, attrs=attrs))
  monkeypatch.setitem(OP_CLASSES, "split_layer_norm_backward", SplitLayerNormBackwardOp)
  monkeypatch.setitem(kernels, "split_layer_norm_backward", _kernel)


def _graph(weight: bool, has_bias: bool, keep=(0, 1, 2)):
  b = Builder()
  g, x, w = b.input((3, 4)), b.input((3, 4)), b.input((4,))
  results = b("split_layer_norm_backward", g, x, w if weight else None, n=1, eps=1e-5, has_bias=has_bias)
  return b.output(*(v for i, v in enumerate(results) if v is not None and i in keep))


@pytest.mark.parametrize("weight, has_bias, printed", [
  (True, True, "%3, %4, %5 = nova.split_layer_norm_backward %0, %1 weight %2 : tensor<4xf32> {n = 1 : i64, "
               "eps = 1.000000e-05 : f64, has_bias = true} : tensor<3x4xf32>, tensor<3x4xf32> -> tensor<3x4xf32> "
               "dweight tensor<4xf32> dbias tensor<4xf32>"),
  (False, True, "%3, %4 = nova.split_layer_norm_backward %0, %1 {n = 1 : i64, eps = 1.000000e-05 : f64, "
                "has_bias = true} : tensor<3x4xf32>, tensor<3x4xf32> -> tensor<3x4xf32> dbias tensor<4xf32>"),
  (False, False, "%3 = nova.split_layer_norm_backward %0, %1 {n = 1 : i64, eps = 1.000000e-05 : f64, "
                 "has_bias = false} : tensor<3x4xf32>, tensor<3x4xf32> -> tensor<3x4xf32>"),
])
def test_absent_results_keep_their_place(weight, has_bias, printed):
  graph = _graph(weight, has_bias)
  (eq,) = graph.equations
  assert [v is None for v in eq.outs] == [False, not weight, not has_bias]
  text = ir.print_module(ir.to_module(graph))
  assert printed in text
  ctx = ir.context()
  ctx.load_op(SplitLayerNormBackwardOp)
  again = Parser(ctx, text).parse_module()
  again.verify()
  assert ir.print_module(again) == text
  op = next(op for op in ir.function(again).body.block.ops if isinstance(op, SplitLayerNormBackwardOp))
  assert [v is None for v in op.graph_outputs()] == [False, not weight, not has_bias]
  assert len(set(value_hashes(graph).values())) == len(graph.inputs) + len(graph.outputs)


@pytest.mark.parametrize("weight, has_bias", [(True, True), (False, True), (False, False)])
def test_compiled_equals_the_kernel(weight, has_bias):
  graph = _graph(weight, has_bias)
  arrays = [np.random.default_rng(0).standard_normal(v.shape).astype(np.float32) for v in graph.inputs]
  compiled = compile_graph(graph, verify=True)
  want = _kernel(arrays[0], arrays[1], arrays[2] if weight else None, n=1, eps=1e-5, has_bias=has_bias)
  got = compiled.fn(*arrays)
  assert len(got) == len(graph.outputs)
  for a, b in zip(got, (w for w in want if w is not None)): np.testing.assert_array_equal(a, b)


def test_an_unused_result_keeps_the_op_and_is_freed():
  compiled = compile_graph(_graph(True, True, keep=(1,)), verify=True)
  assert compiled.counts_after == {"split_layer_norm_backward": 1}
  assert "  v3, v4, v5 = kernels[\"split_layer_norm_backward\"](a0, a1, a2, n=1, eps=1e-05, has_bias=True)\n" \
         "  v3, v4, v5 = np.asarray(v3, float32), np.asarray(v4, float32), np.asarray(v5, float32)\n" \
         "  del a0, a1, a2, v3, v5\n" in compiled.source
