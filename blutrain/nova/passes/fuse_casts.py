"""Cast fusion: autocast's casts folded into the kernels that consume or produce them.

Under autocast a transformer's residual stream stays in float32 while attention and the MLP come out in bfloat16:
each residual add (and each gradient accumulation in the backward) reads a half tensor widened to float32 by a cast
of its own. The elementwise kernels read half operands and compute in float32 themselves (an exact conversion), and a
binary op's result takes its first operand's dtype, so

  add(x: f32, cast(y: half -> f32))  ->  add(x, y)      (sub, mul, div, maximum, minimum too; x and y swap for
                                                        the commutative ones when the cast is the first operand)

Under autocast the loss is computed in float32 from half logits: the captured step casts the (tokens, vocabulary)
logits up, computes the losses and their gradient in float32, and casts the gradient back down, two extra passes
over the largest tensor of a language model's step. The cross-entropy kernels compute half logits in float32
themselves (an exact conversion) and take the losses' dtype as an attribute, so:

  cross_entropy(cast(x: half -> f32), t)                 ->  cross_entropy(x, t, dtype=f32)
  cast(cross_entropy_backward(g, cast(x -> f32), t), half) ->  cross_entropy_backward(g, x, t)

and around the layer norms, which run in float32 between half matmuls:

  cast(layer_norm(x, w, b): f32 -> half)            ->  layer_norm(x, w, b, dtype=half)
  layer_norm_backward(cast(g: half -> f32), x, w)   ->  layer_norm_backward(g, x, w)

and an optimizer update that reads a weight's gradient widened from autocast's half copy of the weight:

  sgd(p, cast(g: half -> f32), b, lr)               ->  sgd(p, g, b, lr)             (adamw likewise; not with a
                                                                                      clip factor)

All are exact: the same float32 arithmetic on the same values, one rounding to the half dtype where there was one.
The casts left without users are dce's.

On the GPU, after remat and the other fusions, `group_casts` gathers autocast's casts of the step's inputs (the
weights, cast to the half dtype in every forward) into one multi-tensor cast_many at the first of them, one launch
instead of one per weight, the same conversions. The backward reads each cast weight again, so the casts before the
memory peak live across it anyway: only positions before the peak hold them longer, and the grouping is not made
if the live peak would grow.
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import BlockArgument
from xdsl.pattern_rewriter import PatternRewriter, RewritePattern

from blutrain import dtypes
from blutrain.nova.dialect import (AddOp, AdamwOp, BinaryOp, CastManyOp, CastOp, CrossEntropyBackwardOp, CrossEntropyOp,
                                   DivOp, LayerNormBackwardOp, LayerNormOp, MaximumOp, MinimumOp, MulOp, SgdOp, SubOp,
                                   aval, decode)
from blutrain.nova.ir import function
from blutrain.nova.memory import live_bytes, nbytes
from blutrain.nova.passes.base import PatternPass, op_type_rewrite_pattern

_HALVES = (dtypes.float16, dtypes.bfloat16)
_ARITHMETIC = (AddOp, SubOp, MulOp, DivOp, MaximumOp, MinimumOp)  # kernels that read halves as float32
_COMMUTATIVE = (AddOp, MulOp, MaximumOp, MinimumOp)  # exactly, in IEEE arithmetic (NaNs propagate either way)


def _widened_half(v) -> CastOp | None:
  """The cast that made v, when it widens a half tensor to float32."""
  op = v.owner
  if isinstance(op, CastOp) and aval(op.x.type).dtype in _HALVES and aval(op.result.type).dtype is dtypes.float32:
    return op
  return None


class CrossEntropyOfWidenedLogitsPattern(RewritePattern):
  """cross_entropy(cast(x: bf16 -> f32), t) -> cross_entropy(x, t, dtype=f32).

    %l = nova.cast %x {dtype = f32} : (tensor<8x50xbf16>) -> tensor<8x50xf32>
    %c = nova.cross_entropy %l, %t {ignore_index = -100 : i64} : (tensor<8x50xf32>, tensor<8xi64>) -> tensor<8xf32>
      =>   %c = nova.cross_entropy %x, %t {ignore_index = -100 : i64, dtype = f32} : (...bf16...) -> tensor<8xf32>
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: CrossEntropyOp, rewriter: PatternRewriter):
    if (cast := _widened_half(op.logits)) is None: return
    attrs = {"ignore_index": decode(op.ignore_index), "dtype": aval(op.result.type).dtype}
    rewriter.replace(op, CrossEntropyOp.make([cast.x, op.target], attrs, [op.result.type]))


class NarrowedCrossEntropyBackwardPattern(RewritePattern):
  """cast(cross_entropy_backward(g, cast(x: bf16 -> f32), t), bf16) -> cross_entropy_backward(g, x, t), when the
  float32 gradient has no other use.

    %l = nova.cast %x {dtype = f32} : (tensor<8x50xbf16>) -> tensor<8x50xf32>
    %d = nova.cross_entropy_backward %g, %l, %t {ignore_index = -100 : i64} : (...) -> tensor<8x50xf32>
    %e = nova.cast %d {dtype = bf16} : (tensor<8x50xf32>) -> tensor<8x50xbf16>
      =>   %e = nova.cross_entropy_backward %g, %x, %t {ignore_index = -100 : i64} : (...) -> tensor<8x50xbf16>
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: CastOp, rewriter: PatternRewriter):
    inner = op.x.owner
    if not isinstance(inner, CrossEntropyBackwardOp) or not inner.result.has_one_use(): return
    if (cast := _widened_half(inner.logits)) is None or cast.x.type != op.result.type: return
    rewriter.replace(op, CrossEntropyBackwardOp.make([inner.g, cast.x, inner.target],
                                                     {"ignore_index": decode(inner.ignore_index)}, [op.result.type]))


class WidenedOperandPattern(RewritePattern):
  """op(x: f32, cast(y: bf16 -> f32)) -> op(x, y) for the arithmetic binary ops (for add, mul, maximum and minimum
  also op(cast(y), x) -> op(x, y)).

    %w = nova.cast %y {dtype = f32} : (tensor<4x8xbf16>) -> tensor<4x8xf32>
    %s = nova.add %x, %w : (tensor<4x8xf32>, tensor<4x8xf32>) -> tensor<4x8xf32>
      =>   %s = nova.add %x, %y : (tensor<4x8xf32>, tensor<4x8xbf16>) -> tensor<4x8xf32>
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: BinaryOp, rewriter: PatternRewriter):
    if not isinstance(op, _ARITHMETIC): return
    x, y = op.x, op.y
    if _widened_half(x) is not None and _widened_half(y) is None and isinstance(op, _COMMUTATIVE): x, y = y, x
    if (cast := _widened_half(y)) is None or aval(x.type).dtype is not dtypes.float32: return
    rewriter.replace(op, type(op).make([x, cast.x], {}, [op.result.type]))


class NarrowedLayerNormPattern(RewritePattern):
  """cast(layer_norm(x, w, b): f32 -> bf16) -> layer_norm(x, w, b, dtype=bf16), when the float32 output has no other
  use.

    %y = nova.layer_norm %x weight %w : tensor<768xf32> bias %b : tensor<768xf32> {n = 1 : i64, eps = 1.0e-05 : f64}
         : (tensor<4x768xf32>) -> tensor<4x768xf32>
    %h = nova.cast %y {dtype = bf16} : (tensor<4x768xf32>) -> tensor<4x768xbf16>
      =>   %h = nova.layer_norm %x ... {n = 1 : i64, eps = 1.0e-05 : f64, dtype = bf16} : (...) -> tensor<4x768xbf16>
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: CastOp, rewriter: PatternRewriter):
    ln = op.x.owner
    if not isinstance(ln, LayerNormOp) or not ln.result.has_one_use(): return
    if aval(ln.result.type).dtype is not dtypes.float32 or aval(op.result.type).dtype not in _HALVES: return
    attrs = {**ln.attrs(), "dtype": aval(op.result.type).dtype}
    rewriter.replace(op, LayerNormOp.make(ln.graph_inputs(), attrs, [op.result.type]))


class LayerNormBackwardOfWidenedGradPattern(RewritePattern):
  """layer_norm_backward(cast(g: bf16 -> f32), x, w) -> layer_norm_backward(g, x, w): the kernel reads g as float32.

    %g32 = nova.cast %g {dtype = f32} : (tensor<4x768xbf16>) -> tensor<4x768xf32>
    %dx, %dw, %db = nova.layer_norm_backward %g32, %x, %w ...
      =>   %dx, %dw, %db = nova.layer_norm_backward %g, %x, %w ...
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: LayerNormBackwardOp, rewriter: PatternRewriter):
    if (cast := _widened_half(op.g)) is None: return
    rewriter.replace(op, LayerNormBackwardOp.make([cast.x, *op.graph_inputs()[1:]], op.attrs(),
                                                  [None if r is None else r.type for r in op.graph_outputs()]))


class UpdateOfWidenedGradPattern(RewritePattern):
  """sgd(p, cast(g: bf16 -> f32), b, lr) -> sgd(p, g, b, lr), and adamw likewise, when the widened gradient is read by
  updates alone, as a gradient, and none of them scales its gradients by a clip factor (the kernels round a clipped
  gradient to its own dtype, as `scale` stores it). The update kernels read half gradients as float32 themselves:
  autocast's weight casts leave one such widening per weight in the backward.

    %g32 = nova.cast %g {dtype = f32} : (tensor<64x3x7x7xbf16>) -> tensor<64x3x7x7xf32>
    %p2, %b2 = nova.sgd %p, %g32, %b, %lr {n = 1 : i64, ...} : (...) -> (...)
      =>   %p2, %b2 = nova.sgd %p, %g, %b, %lr {n = 1 : i64, ...} : (...) -> (...)
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: CastOp, rewriter: PatternRewriter):
    if _widened_half(op.result) is None or not op.result.uses: return
    users = []
    for use in op.result.uses:
      a = use.operation
      n = a.attrs()["n"] if isinstance(a, (AdamwOp, SgdOp)) else 0
      if not n <= use.index < 2 * n or a.attrs().get("clip"): return
      if a not in users: users.append(a)
    for a in users:
      xs = [op.x if v is op.result else v for v in a.operands]
      rewriter.replace(a, type(a).make(xs, a.attrs(), [r.type for r in a.results]))


@dataclass(frozen=True)
class FuseCastsPass(PatternPass):
  """Autocast's casts folded into the kernels that read or write them: the cross-entropy's, the layer norm's, the
  arithmetic ops' and the optimizer updates'."""
  name = "fuse-casts"
  PATTERNS = (CrossEntropyOfWidenedLogitsPattern(), NarrowedCrossEntropyBackwardPattern(), WidenedOperandPattern(),
              NarrowedLayerNormPattern(), LayerNormBackwardOfWidenedGradPattern(), UpdateOfWidenedGradPattern())


def group_casts(module: ModuleOp, written: dict[int, int] | None = None) -> bool:
  """Gather the casts of the function's arguments to a half dtype before the live peak into one cast_many per
  (source, target) dtype, at the first of them (module docstring), unless that would raise the live peak: a cast
  moved up keeps its result alive from the group's first position on. Returns whether the module changed."""
  live = live_bytes(module, written)
  block = function(module).body.block
  before_peak = list(block.ops)[:live.index(max(live))] if live else []
  groups: dict[tuple, list[CastOp]] = {}
  for op in before_peak:
    if isinstance(op, CastOp) and isinstance(op.x, BlockArgument) and aval(op.result.type).dtype in _HALVES:
      groups.setdefault((aval(op.x.type).dtype, aval(op.result.type).dtype), []).append(op)
  groups = {k: casts for k, casts in groups.items() if len(casts) > 1}
  pos = {op: i for i, op in enumerate(before_peak)}
  longer = [0] * (len(live) + 1)  # bytes alive longer, as differences by position
  for casts in groups.values():
    for c in casts[1:]:
      longer[pos[casts[0]]] += nbytes(c.result)
      longer[pos[c]] -= nbytes(c.result)
  if not groups or max(map(operator.add, live, itertools.accumulate(longer))) > max(live): return False
  for (_, dtype), casts in groups.items():
    many = CastManyOp.make([c.x for c in casts], {"dtype": dtype}, [c.result.type for c in casts])
    block.insert_op_before(many, casts[0])
    for c, r in zip(casts, many.results):
      c.result.replace_all_uses_with(r)
      block.erase_op(c)
  return True
