"""Canonicalization: algebraic identities, the folding of view, permute, expand and cast chains, and the gradient
of a split as one cat.

Every pattern is exact: the rewritten IR computes the same values bit for bit, with one exception stated where it
applies (x + 0 turns -0.0 into +0.0, as XLA's simplifier also accepts). An identity fires only when the result type
equals the kept operand's type, so no rewrite changes a shape by dropping a broadcast or a dtype by dropping a cast.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from xdsl.pattern_rewriter import PatternRewriter, RewritePattern

from blutrain import dtypes
from blutrain.nova.dialect import (AddOp, CastOp, CatOp, CopyOp, DivOp, ExpandOp, MulOp, NegOp, PermuteOp,
                                   SliceBackwardOp, SubOp, ViewOp, aval, decode, tensor_type)
from blutrain.nova.passes.base import PatternPass, op_type_rewrite_pattern, splat


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


# *** the gradient of a split ***

def _below(v, op: AddOp) -> bool:
  """Whether v is made by an add inside the tree of adds rooted at op: op reads it, nothing else does, of op's type."""
  return isinstance(v.owner, AddOp) and v.has_one_use() and v.type == op.result.type


def _summands(op: AddOp) -> list | None:
  """The leaves of the tree of adds rooted at op, whose inner adds nothing else reads, when they are all of its type
  and slice_backwards nothing else reads (else None)."""
  leaves, todo = [], [op.x, op.y]
  while todo:
    v = todo.pop()
    if v.type != op.result.type or not v.has_one_use(): return None
    inner = v.owner
    if isinstance(inner, AddOp): todo += [inner.x, inner.y]
    elif isinstance(inner, SliceBackwardOp): leaves.append(v)
    else: return None
  return leaves


def _numel(v) -> int: return math.prod(aval(v.type).shape)


def _sizes(root: AddOp) -> list[tuple[AddOp, int | None]]:
  """Every add of the tree rooted at root, inner ones before the adds that read them, with the elements its
  `_summands` hold in all (None when it has none), in one walk of the tree."""
  order, todo = [], [root]
  while todo:
    op = todo.pop()
    order.append(op)
    todo += [v.owner for v in (op.x, op.y) if _below(v, op)]
  size: dict[AddOp, int | None] = {}
  for op in reversed(order):
    total: int | None = 0
    for v in (op.x, op.y):
      if v.owner in size: n = size[v.owner]
      elif isinstance(v.owner, SliceBackwardOp) and v.has_one_use() and v.type == op.result.type: n = _numel(v.owner.g)
      else: n = None
      total = None if total is None or n is None else total + n
    size[op] = total
  return list(size.items())


def _band(sb: SliceBackwardOp) -> tuple[int, int, int] | None:
  """(dim, start, stop) when the slice a slice_backward undoes takes a step-1 band of one dim and all of the others."""
  shape, index = decode(sb.shape), decode(sb.index)
  partial = [(d, lo, hi) for d, ((lo, hi, step), n) in enumerate(zip(index, shape)) if (lo, hi, step) != (0, n, 1)]
  if len(partial) != 1 or index[partial[0][0]][2] != 1: return None
  return partial[0]


def _split_cat(op: AddOp) -> CatOp | None:
  """The cat that op's sum of slice_backwards is, when their bands tile one dim."""
  leaves = _summands(op)
  if not leaves: return None
  bands = [_band(v.owner) for v in leaves]
  if None in bands or len({d for d, _, _ in bands}) != 1: return None
  order = sorted(range(len(leaves)), key=lambda i: bands[i][1])
  dim, stops = bands[0][0], [0] + [bands[i][2] for i in order]
  if [bands[i][1] for i in order] != stops[:-1] or stops[-1] != aval(op.result.type).shape[dim]: return None
  return CatOp.make([leaves[i].owner.g for i in order], {"dim": dim}, [op.result.type])


class SplitGradientPattern(RewritePattern):
  """A sum of slice_backwards whose bands tile one dim -> cat of their gradients along it, as the gradient of
  `x.split(...)` or of q, k, v sliced from one projection (each slice_backward writes a whole zero tensor, and the
  adds read them all). NOTE: inexact only where a gradient is -0.0, which the sum with zeros made +0.0.

    %a = nova.slice_backward %ga {shape = array<i64: 4, 6>, index = [array<i64: 0, 4, 1>, array<i64: 0, 3, 1>]}
    %b = nova.slice_backward %gb {shape = array<i64: 4, 6>, index = [array<i64: 0, 4, 1>, array<i64: 3, 6, 1>]}
    %s = nova.add %a, %b : (tensor<4x6xf32>, tensor<4x6xf32>) -> tensor<4x6xf32>
      =>   %s = nova.cat %ga, %gb {dim = 1 : i64} : (tensor<4x3xf32>, tensor<4x3xf32>) -> tensor<4x6xf32>

  Every add of a tree is tried at its root, in one walk: bands that tile a dim hold all of the sum's elements, so
  only the adds whose summands do are tried further (in a chain of nonempty bands, one at most). Tried at each add
  of a chain of T (the gradient of an LSTM's T slices of its input projection), the test would walk the chain T
  times. The pattern comes before `AddZeroPattern`, which would take the root of `tree + 0` first.
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: AddOp, rewriter: PatternRewriter):
    use = op.result.first_use
    if use is not None and isinstance(use.operation, AddOp) and _below(op.result, use.operation): return  # inner
    for add, n in _sizes(op):  # a replaced add fails the test of the adds above it, as when tried in program order
      if n == _numel(add.result) and (cat := _split_cat(add)) is not None: rewriter.replace(add, cat)


class CatOfCopiesPattern(RewritePattern):
  """cat along d of views that merge the dims from d on of contiguous copies of equal shape -> a view of the cat of
  the copies' sources along a new dim d: the cat's kernel reads any layout, so the copies go (the gradients of
  attention's q, k, v, each permuted back from (B, H, T, D) and copied, into one (B, T, 3C) tensor).

    %c = nova.copy %p : (tensor<2x3x4x5xf32>) -> tensor<2x3x4x5xf32>
    %v = nova.view %c {shape = array<i64: 2, 3, 20>} : (tensor<2x3x4x5xf32>) -> tensor<2x3x20xf32>
    %o = nova.cat %v, %w {dim = 2 : i64} : (tensor<2x3x20xf32>, tensor<2x3x20xf32>) -> tensor<2x3x40xf32>
      =>   %u = nova.view %p {shape = array<i64: 2, 3, 1, 4, 5>}  (and likewise for %w's source)
           %s = nova.cat %u, %u' {dim = 2 : i64} : (...) -> tensor<2x3x2x4x5xf32>
           %o = nova.view %s {shape = array<i64: 2, 3, 40>}
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: CatOp, rewriter: PatternRewriter):
    dim, copies = decode(op.dim), []
    for y in op.operands:
      if not isinstance(y.owner, ViewOp) or not isinstance(c := y.owner.x.owner, CopyOp): return
      copies.append(c)
    inner = aval(copies[0].result.type)
    shape = aval(op.operands[0].type).shape
    if any(c.result.type != copies[0].result.type for c in copies) or len(shape) != dim + 1 \
       or inner.shape[:dim] != shape[:dim] or math.prod(inner.shape[dim:]) != shape[dim]:
      return
    unit = inner.shape[:dim] + (1,) + inner.shape[dim:]
    views = [ViewOp.make([c.x], {"shape": unit}, [tensor_type(unit, inner.dtype)]) for c in copies]
    stacked = inner.shape[:dim] + (len(copies),) + inner.shape[dim:]
    cat = CatOp.make([v.result for v in views], {"dim": dim}, [tensor_type(stacked, inner.dtype)])
    out = ViewOp.make([cat.result], {"shape": aval(op.result.type).shape}, [op.result.type])
    rewriter.replace(op, [*views, cat, out], [out.result])


@dataclass(frozen=True)
class CanonicalizePass(PatternPass):
  """Algebraic identities (x*1, x+0, x-0, x/1, neg(neg(x))), layout/cast chain folding, and a split's gradient as a
  cat that reads its parts in any layout."""
  name = "canonicalize"
  PATTERNS = (MulOnePattern(), SplitGradientPattern(), AddZeroPattern(), SubZeroPattern(), DivOnePattern(),
              NegNegPattern(), PermutePattern(), ViewPattern(), ExpandPattern(), CastPattern(), CatOfCopiesPattern())
