"""Constant folding of splats: an op whose operands are all `nova.full` becomes one `nova.full` when its result is a
splat too. That holds for elementwise ops (the op of the fill values, computed by the CPU kernel itself on one
element of each operand's dtype, then cast to the result dtype as eager mode does) and for views (same value, new
shape). Reductions are left alone: a sum of n equal floats is not n * value once rounded.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from xdsl.pattern_rewriter import PatternRewriter, RewritePattern

from blutrain.backend.cpu.kernels import kernels
from blutrain.nova.dialect import ElementwiseOp, FullOp, LayoutOp, NovaOp, aval
from blutrain.nova.passes.base import PatternPass, op_type_rewrite_pattern, splat


def _full(op: NovaOp, value) -> FullOp:
  out = aval(op.result.type)
  return FullOp.make([], {"shape": out.shape, "value": value, "dtype": out.dtype}, [op.result.type])


class FoldElementwisePattern(RewritePattern):
  """An elementwise op of splats is the splat of the op of their values.

    %a = nova.full {shape = array<i64>, value = 2.0 : f64, dtype = f32} : tensor<f32>
    %b = nova.full {shape = array<i64: 4>, value = 3.0 : f64, dtype = f32} : tensor<4xf32>
    %c = nova.mul %a, %b : (tensor<f32>, tensor<4xf32>) -> tensor<4xf32>
      =>   %c = nova.full {shape = array<i64: 4>, value = 6.0 : f64, dtype = f32} : tensor<4xf32>
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: ElementwiseOp, rewriter: PatternRewriter):
    if not all(isinstance(v.owner, FullOp) for v in op.operands): return
    args = [np.full((1,), splat(v), aval(v.type).dtype.np) for v in op.operands]
    value = np.asarray(kernels[op.opname](*args, **op.attrs()), aval(op.result.type).dtype.np).reshape(-1)[0].item()
    rewriter.replace(op, _full(op, value))


class FoldViewPattern(RewritePattern):
  """A view, permute, expand or slice of a splat is a splat of the new shape.

    %a = nova.full {shape = array<i64>, value = 0 : i64, dtype = i64} : tensor<i64>
    %b = nova.expand %a {shape = array<i64: 2, 3>} : (tensor<i64>) -> tensor<2x3xi64>
      =>   %b = nova.full {shape = array<i64: 2, 3>, value = 0 : i64, dtype = i64} : tensor<2x3xi64>
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: LayoutOp, rewriter: PatternRewriter):
    if isinstance(op.x.owner, FullOp): rewriter.replace(op, _full(op, splat(op.x)))


@dataclass(frozen=True)
class FoldPass(PatternPass):
  """Constant-fold ops of splats (`nova.full`) into splats."""
  name = "fold"
  PATTERNS = (FoldElementwisePattern(), FoldViewPattern())
