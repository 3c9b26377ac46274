"""An op with a fixed and two optional results, end to end: `layer_norm_backward` (dx, then dweight when weight is
given and dbias when `has_bias`, each absent otherwise) through the IR, printing and parsing, hashing, the passes and
codegen."""
import numpy as np
import pytest
from xdsl.parser import Parser

from blutrain.backend.cpu.kernels import kernels
from blutrain.nova import ir
from blutrain.nova.dialect import LayerNormBackwardOp
from blutrain.nova.hashing import value_hashes
from blutrain.nova.pipeline import compile_graph
from tests.nova.graphs import Builder


def _kernel(g, x, w, n, eps, has_bias):
  return kernels["layer_norm_backward"](g, x, w, n=n, eps=eps, has_bias=has_bias)


def _graph(weight: bool, has_bias: bool, keep=(0, 1, 2)):
  b = Builder()
  g, x, w = b.input((3, 4)), b.input((3, 4)), b.input((4,))
  results = b("layer_norm_backward", g, x, w if weight else None, None, n=1, eps=1e-5, has_bias=has_bias)
  return b.output(*(v for i, v in enumerate(results) if v is not None and i in keep))


@pytest.mark.parametrize("weight, has_bias, printed", [
  (True, True, "%3, %4, %5 = nova.layer_norm_backward %0, %1 weight %2 : tensor<4xf32> {n = 1 : i64, "
               "eps = 1.000000e-05 : f64, has_bias = true} : tensor<3x4xf32>, tensor<3x4xf32> -> tensor<3x4xf32> "
               "dweight tensor<4xf32> dbias tensor<4xf32>"),
  (False, True, "%3, %4 = nova.layer_norm_backward %0, %1 {n = 1 : i64, eps = 1.000000e-05 : f64, "
                "has_bias = true} : tensor<3x4xf32>, tensor<3x4xf32> -> tensor<3x4xf32> dbias tensor<4xf32>"),
  (False, False, "%3 = nova.layer_norm_backward %0, %1 {n = 1 : i64, eps = 1.000000e-05 : f64, "
                 "has_bias = false} : tensor<3x4xf32>, tensor<3x4xf32> -> tensor<3x4xf32>"),
])
def test_absent_results_keep_their_place(weight, has_bias, printed):
  graph = _graph(weight, has_bias)
  (eq,) = graph.equations
  assert [v is None for v in eq.outs] == [False, not weight, not has_bias, True, True]  # no cast, no column sums
  text = ir.print_module(ir.to_module(graph))
  assert printed in text
  ctx = ir.context()
  again = Parser(ctx, text).parse_module()
  again.verify()
  assert ir.print_module(again) == text
  op = next(op for op in ir.function(again).body.block.ops if isinstance(op, LayerNormBackwardOp))
  assert [v is None for v in op.graph_outputs()] == [False, not weight, not has_bias, True, True]
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
  assert compiled.counts_after == {"layer_norm_backward": 1}
  assert "  v3, v4, v5, _, _ = kernels[\"layer_norm_backward\"](a0, a1, a2, None, n=1, eps=1e-05, has_bias=True)\n" \
         "  v3, v4, v5 = np.asarray(v3, float32), np.asarray(v4, float32), np.asarray(v5, float32)\n" \
         "  del a0, a1, a2, v3, v5\n" in compiled.source
