"""Norm fusion: a transformer's residual adds folded into the layer norms next to them, a ResNet's ReLUs and residual
adds into its batch norms (and max pooling's two kernels into one), a cross-entropy's row statistics kept for its
backward, attention's output and its q, k, v gradients written where the copies after them put them, and
gradient-norm clipping's scale folded into the optimizer's update after it (AdamW's or SGD's).

Each block of a pre-norm transformer adds a branch into the residual stream and normalizes the sum for the next
branch; the sum is used again later (the next residual add, the norm's backward), so it is written either way. One
kernel computes the sum and normalizes it from registers instead of reading it back:

  h = add(x: f32, y);  n = layer_norm(h, w, b)   ->  h, n = add_layer_norm(x, y, w, b)    (h used besides the norm)

In the backward the residual stream's gradient meets the norm's input gradient in an add; the norm's backward kernel
reads the residual gradient and adds it before its one store:

  d = layer_norm_backward(g, x, w)[0];  s = add(r, d)   ->  s = layer_norm_backward(g, x, w, residual=r)[0]
                                                             (d used by the add alone; either operand order)

and autocast's cast of that float32 gradient for the next matmul is the same kernel's second store:

  c = cast(layer_norm_backward(...)[0]: f32 -> half)     ->  c = layer_norm_backward(..., cast=half)[3]

A ResNet block's batch norms are followed by a ReLU, the second after a residual add; the norm's kernel applies both
to the value it computes (adding the residual to that value rounded as the norm stored it, after the bias's add, so
the sum is the add kernel's), and in the backward the norm's kernels read relu's mask where they read its gradient:

  y = relu(add(batch_norm(x, m, v, w, b), r))          ->  y = batch_norm(x, m, v, w, b, residual=r, relu=true)
  d = relu_backward(g, y);  batch_norm_backward(d, x, ...)  ->  batch_norm_backward(g, x, ..., relu_out=y)
                                                             (d read by the norm's backward alone)

Max pooling is a window search for each maximum's position and a gather of x there (the gather is what autodiff
differentiates); the search stores the maximum too, one pass over x instead of two:

  i = max_pool2d_indices(x);  v = max_pool2d_values(x, i)  ->  v, i = max_pool2d_with_indices(x)

A cross-entropy's backward computes each row's max and sum of exp(x - max) again before its one pass of stores;
the forward, which computes the same statistics with the same tiles, keeps them (8 bytes a row) and the backward
reads the logits once:

  l = cross_entropy(x, t);  d = cross_entropy_backward(g, x, t)
    ->  l, m, s = cross_entropy_with_stats(x, t);  d = cross_entropy_backward_with_stats(g, x, t, m, s)

and when g can be computed at the forward's place (a training step's g is the mean's 1/count, from the targets: the
few ops computing it move ahead), one kernel stores the loss and, reading each row again, the gradient:

  l, m, s = cross_entropy_with_stats(x, t);  d = cross_entropy_backward_with_stats(g, x, t, m, s)
    ->  l, d = cross_entropy_with_grad(g, x, t)

A self-attention's q, k and v are views of one projection, so autograd concatenates their gradients (each permuted
back from (B, H, L, E)) into the projection's gradient, a copy of all three; the backward's kernels take any output
strides and write them into their places instead:

  dq, dk, dv = flash_attention_backward(g, q, k, v, o);  c = cat(view(permute(d)) for d in (dq, dk, dv), dim=2)
    ->  c = flash_attention_backward_packed(g, q, k, v, o)     (B, L, 3, H, E); each read by the cat alone

Its forward's output is copied the other way, `y.transpose(1, 2).contiguous()` before the output projection; the
forward kernel writes it so instead, and the backward reads the output through the permuted view:

  o = flash_attention(q, k, v);  c = copy(permute(o, (0, 2, 1, 3)))
    ->  c = flash_attention_transposed(q, k, v) (B, L, H, E);  o = permute(c, (0, 2, 1, 3))   (a view)

clip_grad_norm_ scales every gradient by min(1, max_norm / (total + 1e-6)), a pass over all of them, and the update
(AdamW's or SGD's multi-tensor op) reads them right after; when nothing else reads the scaled gradients (the step ends
with zero_grad, so they are not written back to `.grad`), the update reads the factor from device memory and scales
each gradient as it reads it:

  gs = scale(g1, ..., gn, c);  adamw(p, gs, m, v, s, lr)  ->  adamw(p, g, m, v, s, lr, c, clip=true)
                                                             (every gs read by update ops alone, as gradients;
                                                             sgd(p, gs, b, lr) likewise)

Where the gradients are read after the step they stay scaled in memory, as PyTorch's in-place clip leaves them.

All are exact but the cross-entropy's: the same float32 arithmetic on the same values (y and r may be halves, read
as float32 as the add reads them; float32 addition is commutative), one rounding where there was one (the fused
backward adds with an explicitly rounded add and the update scales with an explicitly rounded multiply, rounded to
the gradient's dtype as the scale stored it, so the compiler cannot contract either with the arithmetic next to it).
Nothing changes where the pattern does not hold: a sum used by the norm alone, broadcast operands (shapes differ or
an `expand` makes one), float64 or half residual streams. The cross-entropy's is exact on the CPU (the statistics in
the logits' own arithmetic, as the backward's softmax computes them); on the GPU the forward's kernel may add a
row's terms in another order than the backward's did, so the gradient agrees to float32's rounding (one rounding of
its dtype).

The pass runs after rematerialization (pipeline.py): remat recomputes a norm's output in the backward instead of
keeping it, and clones single-result ops only, so fusing first would keep every norm's output alive across the peak.
"""
from __future__ import annotations

from dataclasses import dataclass

from xdsl.ir import Block, BlockArgument, Operation, SSAValue
from xdsl.pattern_rewriter import PatternRewriter, RewritePattern
from xdsl.rewriter import InsertPoint

from blutrain import dtypes
from blutrain.nova.dialect import (AddLayerNormOp, AddOp, AdamwOp, BatchNormBackwardOp, BatchNormOp, CastOp, CatOp,
                                   CopyOp, CreationOp, CrossEntropyBackwardOp, CrossEntropyBackwardWithStatsOp,
                                   CrossEntropyOp, CrossEntropyWithGradOp, CrossEntropyWithStatsOp, ElementwiseOp,
                                   ExpandOp, FlashAttentionBackwardOp, FlashAttentionBackwardPackedOp,
                                   FlashAttentionOp, FlashAttentionTransposedOp, LayerNormBackwardOp, LayerNormOp,
                                   LayoutOp, MaxPool2dIndicesOp, MaxPool2dValuesOp, MaxPool2dWithIndicesOp, PermuteOp,
                                   ReduceOp, ReluBackwardOp, ReluOp, ScaleOp, SgdOp, ViewOp, aval, decode, tensor_type)
from blutrain.nova.passes.base import PatternPass, op_type_rewrite_pattern

_OPERANDS = (dtypes.float32, dtypes.bfloat16, dtypes.float16)  # what the fused kernels read as float32
_HALVES = (dtypes.bfloat16, dtypes.float16)


def _before(v: SSAValue | None, op: Operation) -> bool:
  """Whether v (None: absent) is available at op: a block argument or made by an op before it."""
  return v is None or isinstance(v, BlockArgument) or v.owner.is_before_in_block(op)


def _plain(v: SSAValue, shape: tuple[int, ...]) -> bool:
  """v has `shape` and one of the fused kernels' operand dtypes, and is not a broadcast (`expand`) of a smaller one."""
  a = aval(v.type)
  return a.shape == shape and a.dtype in _OPERANDS and not isinstance(v.owner, ExpandOp)


class AddLayerNormPattern(RewritePattern):
  """layer_norm(add(x, y)) -> add_layer_norm(x, y), when the float32 sum has uses besides the norm.

    %h = nova.add %x, %y : (tensor<4x32xf32>, tensor<4x32xbf16>) -> tensor<4x32xf32>
    %n = nova.layer_norm %h weight %w : tensor<32xf32> bias %b : tensor<32xf32> {n = 1 : i64, eps = 1.0e-05 : f64}
         : tensor<4x32xf32> -> tensor<4x32xf32>
      =>   %h, %n = nova.add_layer_norm %x, %y weight %w : tensor<32xf32> bias %b : tensor<32xf32> {...}
                    : tensor<4x32xf32>, tensor<4x32xbf16> -> tensor<4x32xf32>, tensor<4x32xf32>
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: LayerNormOp, rewriter: PatternRewriter):
    add = op.x.owner
    if not isinstance(add, AddOp) or add.result.has_one_use(): return  # the norm is one use
    shape = aval(add.result.type).shape
    if aval(add.x.type).dtype is not dtypes.float32 or not (_plain(add.x, shape) and _plain(add.y, shape)): return
    if not (_before(op.weight, add) and _before(op.bias, add)): return
    fused = AddLayerNormOp.make([add.x, add.y, op.weight, op.bias], op.attrs(), [add.result.type, op.result.type])
    rewriter.insert(fused, InsertPoint.before(add))
    rewriter.replace(add, [], [fused.h])
    rewriter.replace(op, [], [fused.out])


class LayerNormBackwardResidualPattern(RewritePattern):
  """add(r, layer_norm_backward(g, x, w)[0]) -> layer_norm_backward(g, x, w, residual=r)[0], when the norm's float32
  input gradient is used by the add alone (add(d, r) too).

    %d, %dw, %db = nova.layer_norm_backward %g, %x weight %w : tensor<32xf32> {...} : (...) -> tensor<4x32xf32> ...
    %s = nova.add %r, %d : (tensor<4x32xf32>, tensor<4x32xf32>) -> tensor<4x32xf32>
      =>   %s, %dw, %db = nova.layer_norm_backward %g, %x weight %w : tensor<32xf32> residual %r : tensor<4x32xf32>
                          {...} : (...) -> tensor<4x32xf32> ...
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: AddOp, rewriter: PatternRewriter):
    for d, r in ((op.y, op.x), (op.x, op.y)):
      back = d.owner
      if isinstance(back, LayerNormBackwardOp) and d is back.dx and back.residual is None and d.has_one_use(): break
    else: return
    shape = aval(op.result.type).shape
    if aval(op.result.type).dtype is not dtypes.float32 or aval(d.type) != aval(op.result.type): return
    if not _plain(r, shape): return
    if _before(r, back): at = back
    elif all(v is None or all(not u.operation.is_before_in_block(op) for u in v.uses)
             for v in back.graph_outputs()[1:]):
      at = op  # r is made after the backward, whose other results are first read after the add: compute it there
    else: return
    g, x, w, _ = back.graph_inputs()
    outs = back.graph_outputs()
    fused = LayerNormBackwardOp.make([g, x, w, r], back.attrs(), [None if v is None else v.type for v in outs])
    rewriter.insert(fused, InsertPoint.before(at))
    rewriter.replace(op, [], [fused.dx])
    rewriter.replace(back, [], list(fused.results))


class CastOfNormGradientPattern(RewritePattern):
  """cast(layer_norm_backward(...)[0]: f32 -> half) -> layer_norm_backward(..., cast=half)[3]: autocast's cast of the
  residual stream's gradient for the next matmul comes out of the norm's backward kernel as a second store of dx,
  rounded from dx as stored (the cast kernel read dx back from memory).

    %s, %dw, %db = nova.layer_norm_backward %g, %x weight %w : tensor<32xf32> residual %r : tensor<4x32xf32> {...}
                   : (...) -> tensor<4x32xf32> dweight tensor<32xf32> dbias tensor<32xf32>
    %c = nova.cast %s {dtype = bf16} : (tensor<4x32xf32>) -> tensor<4x32xbf16>
      =>   %s, %dw, %db, %c = nova.layer_norm_backward ... {..., cast = bf16} : (...) -> tensor<4x32xf32> dweight ...
                              dbias tensor<32xf32> cast tensor<4x32xbf16>
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: CastOp, rewriter: PatternRewriter):
    back = op.x.owner
    if not isinstance(back, LayerNormBackwardOp) or op.x is not back.dx or back.attrs().get("cast") is not None: return
    if aval(back.dx.type).dtype is not dtypes.float32 or op.attrs()["dtype"] not in _HALVES: return
    types = [None if v is None else v.type for v in back.graph_outputs()]
    types[3] = op.result.type
    fused = LayerNormBackwardOp.make(back.graph_inputs(), {**back.attrs(), "cast": op.attrs()["dtype"]}, types)
    rewriter.insert(fused, InsertPoint.before(back))
    rewriter.replace(op, [], [fused.dx_cast])
    rewriter.replace(back, [], list(fused.results[:len(back.results)]))


class BatchNormResidualPattern(RewritePattern):
  """add(batch_norm(x), r) -> batch_norm(x, residual=r), when the norm's output is used by the add alone, has a bias
  and r is of its type (not a broadcast); the fused op stands at the add, where r is made.

    %n = nova.batch_norm %x, %m, %v weight %w : tensor<8xf32> bias %b : tensor<8xf32> {...} : ... -> tensor<4x8x6x6xf32>
    %s = nova.add %n, %r : (tensor<4x8x6x6xf32>, tensor<4x8x6x6xf32>) -> tensor<4x8x6x6xf32>
      =>   %s = nova.batch_norm %x, %m, %v weight %w : tensor<8xf32> bias %b : tensor<8xf32> residual %r :
                tensor<4x8x6x6xf32> {...} : ... -> tensor<4x8x6x6xf32>

  The kernel adds r to the normalized value rounded as the norm stored it, after the bias's add (an FMA at most), so
  the sum is the add kernel's; without a bias the multiply before it could be contracted into an FMA with it.
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: AddOp, rewriter: PatternRewriter):
    for n, r in ((op.x, op.y), (op.y, op.x)):
      norm = n.owner
      if isinstance(norm, BatchNormOp) and n.has_one_use() and norm.bias is not None and norm.residual is None and \
         not norm.attrs().get("relu"): break
    else: return
    if not n.type == r.type == op.result.type or isinstance(r.owner, ExpandOp): return
    fused = BatchNormOp.make([*norm.graph_inputs()[:5], r], norm.attrs(), [n.type])
    rewriter.insert(fused, InsertPoint.before(op))
    rewriter.replace(op, [], [fused.result])
    rewriter.erase(norm)


class BatchNormReluPattern(RewritePattern):
  """relu(batch_norm(x, ...)) -> batch_norm(x, ..., relu=true), when the norm's output is used by the relu alone (the
  relu's output is what its backward reads).

    %n = nova.batch_norm %x, %m, %v weight %w : tensor<8xf32> bias %b : tensor<8xf32> {...} : ... -> tensor<4x8x6x6xf32>
    %y = nova.relu %n : (tensor<4x8x6x6xf32>) -> tensor<4x8x6x6xf32>
      =>   %y = nova.batch_norm %x, %m, %v weight %w : tensor<8xf32> bias %b : tensor<8xf32> {..., relu = true} : ...
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: ReluOp, rewriter: PatternRewriter):
    norm = op.x.owner
    if not isinstance(norm, BatchNormOp) or not op.x.has_one_use() or norm.attrs().get("relu"): return
    fused = BatchNormOp.make(norm.graph_inputs(), {**norm.attrs(), "relu": True}, [op.result.type])
    rewriter.insert(fused, InsertPoint.before(op))
    rewriter.replace(op, [], [fused.result])
    rewriter.erase(norm)


class ReluGradientIntoBatchNormPattern(RewritePattern):
  """batch_norm_backward(relu_backward(g, y), x, ...) -> batch_norm_backward(g, x, ..., relu_out=y), when the ReLU's
  input gradient is read by the norm's backward alone: its kernels read g and y where they read that gradient.

    %d = nova.relu_backward %g, %y : (tensor<4x8x6x6xf32>, tensor<4x8x6x6xf32>) -> tensor<4x8x6x6xf32>
    %dx, %dw, %db = nova.batch_norm_backward %d, %x, %m, %v weight %w : tensor<8xf32> {...} : ...
      =>   %dx, %dw, %db = nova.batch_norm_backward %g, %x, %m, %v weight %w : tensor<8xf32> relu_out %y :
                           tensor<4x8x6x6xf32> {...} : ...
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: BatchNormBackwardOp, rewriter: PatternRewriter):
    back = op.g.owner
    if not isinstance(back, ReluBackwardOp) or not op.g.has_one_use() or op.relu_out is not None: return
    if not back.g.type == back.y.type == op.g.type or any(isinstance(v.owner, ExpandOp) for v in back.operands): return
    g, x, mean, var, w, _ = op.graph_inputs()
    fused = BatchNormBackwardOp.make([back.g, x, mean, var, w, back.y], op.attrs(),
                                     [None if v is None else v.type for v in op.graph_outputs()])
    rewriter.insert(fused, InsertPoint.before(op))
    rewriter.replace(op, [], list(fused.results))
    rewriter.erase(back)


class MaxPoolWithIndicesPattern(RewritePattern):
  """max_pool2d_values(x, max_pool2d_indices(x)) -> max_pool2d_with_indices(x): the window search stores each maximum
  as it stores its position, instead of a second kernel reading x there again (the same values: x's own).

    %i = nova.max_pool2d_indices %x {kernel = ..., out_size = ...} : (tensor<8x64x112x112xf32>) -> tensor<...xi64>
    %v = nova.max_pool2d_values %x, %i {kernel = ...} : (...) -> tensor<8x64x56x56xf32>
      =>   %v, %i = nova.max_pool2d_with_indices %x {kernel = ..., out_size = ...} : (...) -> (..., ...)
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: MaxPool2dValuesOp, rewriter: PatternRewriter):
    search = op.idx.owner
    if not isinstance(search, MaxPool2dIndicesOp) or search.x is not op.x: return
    geometry = search.attrs()
    if any(geometry[k] != v for k, v in op.attrs().items()): return
    fused = MaxPool2dWithIndicesOp.make([op.x], geometry, [op.result.type, search.result.type])
    rewriter.insert(fused, InsertPoint.before(search))
    rewriter.replace(search, [], [fused.indices])
    rewriter.replace(op, [], [fused.values])


class CrossEntropyStatsPattern(RewritePattern):
  """cross_entropy(x, t) and cross_entropy_backward(g, x, t) -> cross_entropy_with_stats(x, t) and
  cross_entropy_backward_with_stats(g, x, t, max, sum): the forward keeps each row's max and sum of exp(x - max) (8
  bytes a row), and the backward reads the logits once instead of twice (GPT-2's are 1.6 GB in bf16).

    %l = nova.cross_entropy %x, %t {ignore_index = -100 : i64, dtype = f32} : (...bf16..., ...) -> tensor<8xf32>
    %d = nova.cross_entropy_backward %g, %x, %t {ignore_index = -100 : i64} : (...) -> tensor<8x50xbf16>
      =>   %l, %m, %s = nova.cross_entropy_with_stats %x, %t {...} : (...) -> (tensor<8xf32>, tensor<8xf32>, ...)
           %d = nova.cross_entropy_backward_with_stats %g, %x, %t, %m, %s {ignore_index = -100 : i64} : ...
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: CrossEntropyBackwardOp, rewriter: PatternRewriter):
    index = decode(op.ignore_index)
    forward = next((u.operation for u in op.logits.uses if isinstance(u.operation, CrossEntropyOp)
                    and u.operation.target is op.target and decode(u.operation.ignore_index) == index
                    and u.operation.is_before_in_block(op)), None)
    if forward is None: return
    logits = aval(op.logits.type)
    stats = tensor_type(logits.shape[:1], dtypes.float64 if logits.dtype is dtypes.float64 else dtypes.float32)
    fused = CrossEntropyWithStatsOp.make([forward.logits, forward.target], forward.attrs(),
                                         [forward.result.type, stats, stats])
    rewriter.insert(fused, InsertPoint.before(forward))
    rewriter.replace(forward, [], [fused.loss])
    rewriter.replace(op, CrossEntropyBackwardWithStatsOp.make([op.g, op.logits, op.target, fused.row_max,
                                                               fused.sum_exp], op.attrs(), [op.result.type]))


MOVABLE = (ElementwiseOp, LayoutOp, CreationOp, ReduceOp)  # ops moved ahead to compute a gradient's g earlier
MAX_MOVED = 32


def _computed_after(v: SSAValue, op: Operation) -> list[Operation] | None:
  """The ops after `op` in its block that compute `v` (in block order), when they are all MAX_MOVED or fewer pure
  ops (`MOVABLE`) and none reads a result of `op`: moved before `op`, they compute `v` there. Else None."""
  found: dict[Operation, None] = {}
  todo = [v]
  while todo:
    owner = todo.pop().owner
    if isinstance(owner, Block) or owner in found or owner.is_before_in_block(op): continue
    if owner is op or not isinstance(owner, MOVABLE) or len(found) == MAX_MOVED: return None
    found[owner] = None
    todo.extend(owner.operands)
  block = op.parent_block()
  order = {o: i for i, o in enumerate(block.ops)} if found else {}
  return sorted(found, key=order.__getitem__)


class CrossEntropyWithGradientPattern(RewritePattern):
  """cross_entropy_with_stats(x, t) and its cross_entropy_backward_with_stats(g, x, t, max, sum) -> one
  cross_entropy_with_grad(g, x, t) at the forward's place, when g can be computed there (the mean's 1/count, from the
  targets alone: the few ops computing it move ahead): one kernel computes each row's statistics, stores its loss
  and reads the row again for its gradient. The same traffic as the pair (two reads of the logits, GPT-2's 1.6 GB in
  bf16, and a write), in one kernel whose programs overlap one row's exponentials with another's loads and stores,
  and one launch: the H200's GPT-2 step went from 1.53 to 1.35 ms for the two. The same arithmetic on the same tiles:
  exact.

    %l, %m, %s = nova.cross_entropy_with_stats %x, %t {ignore_index = -100 : i64, dtype = f32} : (...) -> (...)
    ...
    %d = nova.cross_entropy_backward_with_stats %g, %x, %t, %m, %s {ignore_index = -100 : i64} : (...) -> (...)
      =>   (the ops computing %g)
           %l, %d = nova.cross_entropy_with_grad %g, %x, %t {ignore_index = -100 : i64, dtype = f32} : (...) -> (...)
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: CrossEntropyBackwardWithStatsOp, rewriter: PatternRewriter):
    forward = op.row_max.owner
    if not isinstance(forward, CrossEntropyWithStatsOp) or op.sum_exp is not forward.sum_exp: return
    if op.logits is not forward.logits or op.target is not forward.target: return
    if decode(op.ignore_index) != decode(forward.ignore_index): return
    if not forward.row_max.has_one_use() or not forward.sum_exp.has_one_use(): return
    moved = _computed_after(op.g, forward)
    if moved is None: return
    for m in moved:
      m.detach()
      rewriter.insert(m, InsertPoint.before(forward))
    fused = CrossEntropyWithGradOp.make([op.g, forward.logits, forward.target], forward.attrs(),
                                        [forward.loss.type, op.result.type])
    rewriter.insert(fused, InsertPoint.before(forward))
    rewriter.replace(op, [], [fused.dlogits])
    rewriter.replace(forward, [], [fused.loss, None, None])


class PackedAttentionGradientPattern(RewritePattern):
  """cat along dim 2 of dq, dk, dv of one self-attention's flash_attention_backward, each permuted back to (B, L, H, E)
  and viewed as (B, L, 1, H, E), read by the cat alone -> flash_attention_backward_packed, whose kernels write the
  three into their places in the projection's gradient (B, L, 3, H, E): the cat's copy of them goes.

    %dq, %dk, %dv = nova.flash_attention_backward %g, %q, %k, %v, %o {...} : (...) -> (tensor<2x4x8x16xbf16>, ...)
    %p = nova.permute %dq {dims = array<i64: 0, 2, 1, 3>} : (...) -> tensor<2x8x4x16xbf16>    (and %dk's, %dv's)
    %u = nova.view %p {shape = array<i64: 2, 8, 1, 4, 16>} : (...) -> tensor<2x8x1x4x16xbf16>
    %c = nova.cat %u, %u', %u'' {dim = 2 : i64} : (...) -> tensor<2x8x3x4x16xbf16>
      =>   %c = nova.flash_attention_backward_packed %g, %q, %k, %v, %o {...} : (...) -> tensor<2x8x3x4x16xbf16>
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: CatOp, rewriter: PatternRewriter):
    if decode(op.dim) != 2 or len(op.operands) != 3: return
    back, chain = None, []
    for i, u in enumerate(op.operands):
      view = u.owner
      if not isinstance(view, ViewOp) or not u.has_one_use() or not isinstance(p := view.x.owner, PermuteOp): return
      if decode(p.dims) != (0, 2, 1, 3) or not view.x.has_one_use() or not p.x.has_one_use(): return
      if not isinstance(b := p.x.owner, FlashAttentionBackwardOp) or p.x is not b.results[i] or back not in (None, b):
        return
      back = b
      chain += [view, p]
    if len(aval(back.q.type).shape) != 4 or not back.k.type == back.v.type == back.q.type: return
    rewriter.replace(op, FlashAttentionBackwardPackedOp.make([back.g, back.q, back.k, back.v, back.out], back.attrs(),
                                                             [op.result.type]))
    for dead in (*chain, back): rewriter.erase(dead)  # read by the cat alone: nothing else runs them


class TransposedAttentionOutputPattern(RewritePattern):
  """copy(permute(flash_attention(q, k, v), (0, 2, 1, 3))) -> flash_attention_transposed(q, k, v): the kernel writes
  the output with its heads after its positions, (B, L, H, E), which a transformer's `y.transpose(1, 2).contiguous()`
  copied it into. Every copy of that permute becomes the new output (remat's clone of the copy too), and every other
  reader of the output (the backward) reads a permuted view of it, the same values.

    %o = nova.flash_attention %q, %k, %v {...} : (...) -> tensor<2x4x8x16xbf16>
    %p = nova.permute %o {dims = array<i64: 0, 2, 1, 3>} : (...) -> tensor<2x8x4x16xbf16>
    %c = nova.copy %p : (tensor<2x8x4x16xbf16>) -> tensor<2x8x4x16xbf16>
      =>   %c = nova.flash_attention_transposed %q, %k, %v {...} : (...) -> tensor<2x8x4x16xbf16>
           %o = nova.permute %c {dims = array<i64: 0, 2, 1, 3>}   (for the output's other readers)
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: CopyOp, rewriter: PatternRewriter):
    p = op.x.owner
    if not isinstance(p, PermuteOp) or decode(p.dims) != (0, 2, 1, 3): return
    if not isinstance(att := p.x.owner, FlashAttentionOp): return
    if len(aval(att.q.type).shape) != 4 or not all(isinstance(u.operation, CopyOp) for u in p.result.uses): return
    fused = FlashAttentionTransposedOp.make([att.q, att.k, att.v], att.attrs(), [op.result.type])
    heads_first = PermuteOp.make([fused.result], {"dims": (0, 2, 1, 3)}, [att.result.type])
    rewriter.insert(fused, InsertPoint.before(att))
    rewriter.insert(heads_first, InsertPoint.before(att))
    for u in list(p.result.uses): rewriter.replace(u.operation, [], [fused.result])
    rewriter.erase(p)
    rewriter.replace(att, [], [heads_first.result])


_UPDATES = (AdamwOp, SgdOp)  # multi-tensor updates: n params, then n gradients, ...; a `clip` factor last


class ClipIntoUpdatePattern(RewritePattern):
  """adamw(p, scale(g, c), m, v, s, lr) -> adamw(p, g, m, v, s, lr, c, clip=true), and sgd likewise, when every
  scaled gradient is read by update ops alone, as a gradient, and those read no other gradients.

    %gs = nova.scale %g, %c : (tensor<4xf32>, tensor<f32>) -> tensor<4xf32>
    %p2, %m2, %v2, %s2 = nova.adamw %p, %gs, %m, %v, %s, %lr {n = 1 : i64, ...} : (...) -> (...)
      =>   %p2, %m2, %v2, %s2 = nova.adamw %p, %g, %m, %v, %s, %lr, %c {n = 1 : i64, ..., clip = true} : (...) -> (...)
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: ScaleOp, rewriter: PatternRewriter):
    raw, factor = list(op.operands[:-1]), op.operands[-1]
    users: list[AdamwOp | SgdOp] = []
    for scaled in op.results:
      for use in scaled.uses:
        a = use.operation
        n = a.attrs()["n"] if isinstance(a, _UPDATES) else 0
        if not isinstance(a, _UPDATES) or a.attrs().get("clip") or not n <= use.index < 2 * n: return
        if a not in users: users.append(a)
    unscaled = dict(zip(op.results, raw))
    if not users or any(v not in unscaled for a in users for v in a.operands[a.attrs()["n"]:2 * a.attrs()["n"]]):
      return  # the clip factor would scale every gradient of the update, so all of them must come from this scale
    for a in users:
      xs = [unscaled.get(v, v) for v in a.operands]
      fused = type(a).make([*xs, factor], {**a.attrs(), "clip": True}, [r.type for r in a.results])
      rewriter.replace(a, fused)
    rewriter.erase(op)


@dataclass(frozen=True)
class FuseNormsPass(PatternPass):
  """Residual adds folded into the layer norms (forward) and their backward kernels (the gradient accumulation, and
  the half copy of the gradient autocast casts); residual adds and ReLUs after batch norms into them, and the ReLU's
  backward into theirs; max pooling's values stored by its window search; the cross-entropy's row statistics kept for
  its backward; attention's output written transposed and its gradients packed; clip_grad_norm_'s scale folded into
  the AdamW and SGD updates."""
  name = "fuse-norms"
  PATTERNS = (AddLayerNormPattern(), LayerNormBackwardResidualPattern(), CastOfNormGradientPattern(),
              BatchNormResidualPattern(), BatchNormReluPattern(), ReluGradientIntoBatchNormPattern(),
              MaxPoolWithIndicesPattern(), CrossEntropyStatsPattern(), CrossEntropyWithGradientPattern(),
              PackedAttentionGradientPattern(), TransposedAttentionOutputPattern(), ClipIntoUpdatePattern())
