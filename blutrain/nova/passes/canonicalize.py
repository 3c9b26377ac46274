"""Canonicalization: algebraic identities and the folding of view, permute, expand and cast chains.

Every pattern is exact: the rewritten IR computes the same values bit for bit, with one exception stated where it
applies (x + 0 turns -0.0 into +0.0, as XLA's simplifier also accepts). An identity fires only when the result type
equals the kept operand's type, so no rewrite changes a shape by dropping a broadcast or a dtype by dropping a cast.
"""
from __future__ import annotations

from dataclasses import dataclass

from xdsl.pattern_rewriter import PatternRewriter, RewritePattern, op_type_rewrite_pattern

from blutrain import dtypes
from blutrain.nova.dialect import (AddOp, CastOp, DivOp, ExpandOp, MulOp, NegOp, PermuteOp, SubOp, ViewOp, aval,
                                   decode)
from blutrain.nova.passes.base import PatternPass, splat


def _keep(op, x, rewriter: PatternRewriter) -> bool:
  """Replace op by its operand x when the types agree; say whether it did."""
  if x.type != op.result.type: return False
  rewriter.replace(op, [], [x])
  return True


# *** identities ***

class MulOnePattern(RewritePattern):
  """x * 1 -> x and 1 * x -> x.

    %one = nova.full {shape = array<i64>, value = 1.0 : f64, dtype = f32} : tensor<f32>
    %y = nova.mul %x, %one : (tensor<4xf32>, tensor<f32>) -> tensor<4xf32>      =>   %x
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: MulOp, rewriter: PatternRewriter):
    if splat(op.y) == 1: _keep(op, op.x, rewriter)
    elif splat(op.x) == 1: _keep(op, op.y, rewriter)


class AddZeroPattern(RewritePattern):
  """x + 0 -> x and 0 + x -> x. NOTE: inexact only for x = -0.0, where x + 0.0 is +0.0.

    %y = nova.add %x, %zero : (tensor<4xf32>, tensor<f32>) -> tensor<4xf32>     =>   %x
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: AddOp, rewriter: PatternRewriter):
    if splat(op.y) == 0: _keep(op, op.x, rewriter)
    elif splat(op.x) == 0: _keep(op, op.y, rewriter)


class SubZeroPattern(RewritePattern):
  """x - 0 -> x.

    %y = nova.sub %x, %zero : (tensor<4xf32>, tensor<f32>) -> tensor<4xf32>     =>   %x
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: SubOp, rewriter: PatternRewriter):
    if splat(op.y) == 0: _keep(op, op.x, rewriter)


class DivOnePattern(RewritePattern):
  """x / 1 -> x.

    %y = nova.div %x, %one : (tensor<4xf32>, tensor<f32>) -> tensor<4xf32>      =>   %x
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: DivOp, rewriter: PatternRewriter):
    if splat(op.y) == 1: _keep(op, op.x, rewriter)


class NegNegPattern(RewritePattern):
  """neg(neg(x)) -> x.

    %a = nova.neg %x : (tensor<4xf32>) -> tensor<4xf32>
    %b = nova.neg %a : (tensor<4xf32>) -> tensor<4xf32>                         =>   %x
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: NegOp, rewriter: PatternRewriter):
    if isinstance(inner := op.x.owner, NegOp): _keep(op, inner.x, rewriter)


# *** layout chains ***

class PermutePattern(RewritePattern):
  """permute(x, identity) -> x; permute(permute(x, p), q) -> permute(x, p[q]) (or x when that is the identity).

    %a = nova.permute %x {dims = array<i64: 1, 2, 0>} : (tensor<2x3x4xf32>) -> tensor<3x4x2xf32>
    %b = nova.permute %a {dims = array<i64: 2, 0, 1>} : (tensor<3x4x2xf32>) -> tensor<2x3x4xf32>    =>   %x
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: PermuteOp, rewriter: PatternRewriter):
    dims = decode(op.dims)
    x = op.x
    if isinstance(inner := x.owner, PermuteOp):
      outer, x = dims, inner.x
      dims = tuple(decode(inner.dims)[d] for d in outer)
    if dims == tuple(range(len(dims))): _keep(op, x, rewriter)
    elif x is not op.x: rewriter.replace(op, PermuteOp.make([x], {"dims": dims}, [op.result.type]))


class ViewPattern(RewritePattern):
  """view(x, x.shape) -> x; view(view(x, s), t) -> view(x, t).

    %a = nova.view %x {shape = array<i64: 8>} : (tensor<2x4xf32>) -> tensor<8xf32>
    %b = nova.view %a {shape = array<i64: 4, 2>} : (tensor<8xf32>) -> tensor<4x2xf32>
      =>   %b = nova.view %x {shape = array<i64: 4, 2>} : (tensor<2x4xf32>) -> tensor<4x2xf32>
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: ViewOp, rewriter: PatternRewriter):
    x = op.x.owner.x if isinstance(op.x.owner, ViewOp) else op.x
    if not _keep(op, x, rewriter) and x is not op.x:
      rewriter.replace(op, ViewOp.make([x], {"shape": decode(op.shape)}, [op.result.type]))


class ExpandPattern(RewritePattern):
  """expand(x, x.shape) -> x; expand(expand(x, s), t) -> expand(x, t) (a dim of x that is not 1 keeps its size
  through both, so t is a valid expansion of x).

    %a = nova.expand %x {shape = array<i64: 3, 4>} : (tensor<1x4xf32>) -> tensor<3x4xf32>
    %b = nova.expand %a {shape = array<i64: 2, 3, 4>} : (tensor<3x4xf32>) -> tensor<2x3x4xf32>
      =>   %b = nova.expand %x {shape = array<i64: 2, 3, 4>} : (tensor<1x4xf32>) -> tensor<2x3x4xf32>
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: ExpandOp, rewriter: PatternRewriter):
    x = op.x.owner.x if isinstance(op.x.owner, ExpandOp) else op.x
    if not _keep(op, x, rewriter) and x is not op.x:
      rewriter.replace(op, ExpandOp.make([x], {"shape": decode(op.shape)}, [op.result.type]))


# B holds every value of A exactly: bool into anything, wider integers and floats, int32 into float64.
_WIDENS = {dtypes.bool_: set(dtypes.all_dtypes),
           dtypes.uint8: {dtypes.int16, dtypes.int32, dtypes.int64, dtypes.float16, dtypes.bfloat16, dtypes.float32,
                          dtypes.float64},
           dtypes.int8: {dtypes.int16, dtypes.int32, dtypes.int64, dtypes.float16, dtypes.bfloat16, dtypes.float32,
                         dtypes.float64},
           dtypes.int16: {dtypes.int32, dtypes.int64, dtypes.float32, dtypes.float64},
           dtypes.int32: {dtypes.int64, dtypes.float64},
           dtypes.float16: {dtypes.float32, dtypes.float64}, dtypes.bfloat16: {dtypes.float32, dtypes.float64},
           dtypes.float32: {dtypes.float64}}


class CastPattern(RewritePattern):
  """cast(x, x.dtype) -> x; cast(cast(x, B), C) -> cast(x, C) (or x when C is x's dtype) when B holds every value
  of x's dtype, so the first cast changes no value (f32 -> f64 -> f32 is x; f16 -> f32 -> bf16 rounds once).

    %a = nova.cast %x {dtype = f64} : (tensor<4xf32>) -> tensor<4xf64>
    %b = nova.cast %a {dtype = f32} : (tensor<4xf64>) -> tensor<4xf32>          =>   %x
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: CastOp, rewriter: PatternRewriter):
    x, inner = op.x, op.x.owner
    if isinstance(inner, CastOp) and aval(x.type).dtype in _WIDENS.get(aval(inner.x.type).dtype, ()):
      x = inner.x
    if not _keep(op, x, rewriter) and x is not op.x:
      rewriter.replace(op, CastOp.make([x], {"dtype": decode(op.dtype)}, [op.result.type]))


@dataclass(frozen=True)
class CanonicalizePass(PatternPass):
  """Algebraic identities (x*1, x+0, x-0, x/1, neg(neg(x))) and layout/cast chain folding."""
  name = "canonicalize"
  PATTERNS = (MulOnePattern(), AddZeroPattern(), SubZeroPattern(), DivOnePattern(), NegNegPattern(), PermutePattern(),
              ViewPattern(), ExpandPattern(), CastPattern())
