"""The ready plan for GPT models: tensor parallelism (with or without sequence parallelism) and context parallelism.

`parallelize_gpt(model, tp_group, cp_group=...)` returns a `ParallelGPT` holding this rank's shards of `model`'s
weights: the fused q/k/v projection and the MLP's first layer column-parallel (each rank n_head / n_tp heads and
4 n_embd / n_tp hidden units), the attention and MLP output projections row-parallel, the token embedding
vocabulary-parallel and tied to the column-parallel output layer, whose logits stay split over the vocabulary for
the vocabulary-parallel cross-entropy. LayerNorms and the position embedding are replicated. With a context-parallel
group the tokens are split along the sequence (the loader's `shard_sequence`), positions are the tokens' true ones,
and attention is ring attention.
"""
from __future__ import annotations

from blutrain import distributed as dist, nn, ops
from blutrain.nn.parallel.context_parallel import ring_attention, sequence_positions
from blutrain.nn.parallel.tensor_parallel import (ColumnParallelLinear, Group, RowParallelLinear,
                                                  VocabParallelEmbedding, copy_to_parallel, scatter_to_parallel,
                                                  unshard, vocab_parallel_cross_entropy)
from blutrain.models.gpt import GPT, Block
from blutrain.nn import functional as F
from blutrain.nn.module import Module
from blutrain.tensor import Tensor


def _norm(ln: nn.LayerNorm, x: Tensor, group: Group, sequence_parallel: bool) -> Tensor:
  """LayerNorm; in the sequence-parallel region its parameters see this rank's tokens only, so their gradients are
  all-reduced over the tensor-parallel group (copy_to_parallel's backward)."""
  if not sequence_parallel: return ln(x)
  w = None if ln.weight is None else copy_to_parallel(ln.weight, group)
  b = None if ln.bias is None else copy_to_parallel(ln.bias, group)
  return F.layer_norm(x, ln.normalized_shape, w, b, ln.eps)


class ParallelSelfAttention(Module):
  """Causal self-attention over this rank's heads (tensor parallel) and, with a context-parallel group, over the
  whole sequence by ring attention."""

  def __init__(self, block: Block, tp_group: Group, cp_group: Group, sequence_parallel: bool, tp_size: int,
               overlap_chunks: int) -> None:
    super().__init__()
    a = block.attn
    if a.n_head % tp_size:
      raise ValueError(f"parallelize_gpt: n_head ({a.n_head}) must be divisible by the tensor-parallel size "
                       f"({tp_size})")
    self.c_attn = ColumnParallelLinear.from_linear(a.c_attn, tp_group, parts=3, sequence_parallel=sequence_parallel,
                                                   overlap_chunks=overlap_chunks)
    self.c_proj = RowParallelLinear.from_linear(a.c_proj, tp_group, sequence_parallel=sequence_parallel,
                                                overlap_chunks=overlap_chunks)
    self.resid_dropout, self.attn_dropout, self.cp_group = a.resid_dropout, a.attn_dropout, cp_group
    self.n_head, self.n_embd = a.n_head // tp_size, a.n_embd // tp_size

  def forward(self, x: Tensor) -> Tensor:
    qkv = self.c_attn(x)
    B, T, _ = qkv.shape
    q, k, v = (t.view(B, T, self.n_head, self.n_embd // self.n_head).transpose(1, 2)
               for t in qkv.split(self.n_embd, dim=2))
    if self.cp_group is not None:
      if self.training and self.attn_dropout: raise NotImplementedError("ring attention has no attention dropout")
      y = ring_attention(q, k, v, self.cp_group, is_causal=True)
    else:
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.attn_dropout if self.training else 0.0)
    return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, self.n_embd)))


class ParallelMLP(Module):
  def __init__(self, block: Block, tp_group: Group, sequence_parallel: bool, overlap_chunks: int) -> None:
    super().__init__()
    m = block.mlp
    self.c_fc = ColumnParallelLinear.from_linear(m.c_fc, tp_group, sequence_parallel=sequence_parallel,
                                                 overlap_chunks=overlap_chunks)
    self.gelu, self.dropout = m.gelu, m.dropout
    self.c_proj = RowParallelLinear.from_linear(m.c_proj, tp_group, sequence_parallel=sequence_parallel,
                                                overlap_chunks=overlap_chunks)

  def forward(self, x: Tensor) -> Tensor: return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class ParallelBlock(Module):
  def __init__(self, block: Block, tp_group: Group, cp_group: Group, sequence_parallel: bool, tp_size: int,
               overlap_chunks: int) -> None:
    super().__init__()
    self.ln_1, self.ln_2 = block.ln_1, block.ln_2
    self.attn = ParallelSelfAttention(block, tp_group, cp_group, sequence_parallel, tp_size, overlap_chunks)
    self.mlp = ParallelMLP(block, tp_group, sequence_parallel, overlap_chunks)
    self.tp_group, self.sequence_parallel = tp_group, sequence_parallel

  def forward(self, x: Tensor) -> Tensor:
    x = x + self.attn(_norm(self.ln_1, x, self.tp_group, self.sequence_parallel))
    return x + self.mlp(_norm(self.ln_2, x, self.tp_group, self.sequence_parallel))


class ParallelGPT(Module):
  """A GPT sharded by `parallelize_gpt`: `logits, loss = model(idx, targets)` on this rank's tokens.

  Shape:
    idx, targets: (B, T_local) token indices; with a context-parallel group T_local = T / n_cp, this rank's
      load-balanced part of the sequence (`shard_sequence`), else the whole sequence.
    logits: (B, T_local, vocab_size / n_tp), this rank's slice of the vocabulary (all of it on a group of one).
    loss: the mean over this rank's tokens (targets equal to -1 ignored), the same on every tensor-parallel rank;
      average the gradients over the context-parallel group (`all_reduce_gradients`).
  """

  def __init__(self, model: GPT, tp_group: Group = None, cp_group: Group = None, sequence_parallel: bool = False,
               overlap_chunks: int = 1) -> None:
    super().__init__()
    tp_size = dist.get_world_size(tp_group)
    self.config, self.tp_group, self.cp_group = model.config, tp_group, cp_group
    self.sequence_parallel = sequence_parallel
    t = model.transformer
    self.wte = VocabParallelEmbedding.from_embedding(t.wte, tp_group, sequence_parallel=sequence_parallel)
    self.wpe, self.drop, self.ln_f = t.wpe, t.drop, t.ln_f
    self.h = nn.ModuleList([ParallelBlock(b, tp_group, cp_group, sequence_parallel, tp_size, overlap_chunks)
                            for b in t.h])
    self.lm_head = ColumnParallelLinear.from_linear(model.lm_head, tp_group, sequence_parallel=sequence_parallel,
                                                    overlap_chunks=overlap_chunks)
    self.lm_head.weight = self.wte.weight  # weight tying: both are this rank's rows of the vocabulary

  def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    B, T = idx.shape
    if self.cp_group is None: pos = ops.arange(T, device=idx.device)
    else: pos = sequence_positions(T * dist.get_world_size(self.cp_group), self.cp_group).to(idx.device)
    p = self.wpe(pos)
    if self.sequence_parallel: p = scatter_to_parallel(p, self.tp_group, 0)  # this rank's part of the sequence
    x = self.drop(self.wte(idx) + p)
    for block in self.h: x = block(x)
    logits = self.lm_head(_norm(self.ln_f, x, self.tp_group, self.sequence_parallel))
    if targets is None: return logits, None
    return logits, vocab_parallel_cross_entropy(logits, targets, self.tp_group, ignore_index=-1)


  def full_state_dict(self) -> dict[str, Tensor]:
    """The unsharded GPT's state_dict (its names), gathered over the tensor-parallel group on every rank: for a
    checkpoint, or a GPT to evaluate or sample with (`GPT(cfg).load_state_dict(model.full_state_dict())`)."""
    out = {}
    for prefix, m in self.named_modules():
      for name, _ in m.named_parameters(recurse=False, remove_duplicate=False):
        key = f"{prefix}.{name}" if prefix else name
        out[key if key.startswith("lm_head.") else "transformer." + key] = unshard(m, name, self.tp_group)
    return out

  def clip_grad_norm_(self, max_norm: float) -> Tensor:
    """Scale the gradients so that the whole model's gradient 2-norm is at most `max_norm`; returns that norm before
    clipping, as nn.utils.clip_grad_norm_ on the unsharded model's gradients would. The sharded parameters' squares
    are summed over the tensor-parallel group (one all-reduce), the replicated ones counted once."""
    sharded = {id(p) for m in self.modules() if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding))
               for p in m.parameters()}
    sharded |= {id(m.weight) for m in self.modules() if isinstance(m, RowParallelLinear)}
    with ops.no_grad():
      grads = [(p.grad, id(p) in sharded) for p in self.parameters() if p.grad is not None]
      wide = lambda g: g.float() if g.dtype.itemsize < 4 else g  # 16-bit gradients' squares summed in float32
      squares = lambda part: sum(((wide(g) ** 2).sum() for g, s in grads if s == part),
                                 ops.zeros((), device=grads[0][0].device)).reshape(1)
      total = squares(True)
      dist.all_reduce(total, group=self.tp_group)
      norm = (total + squares(False)).sqrt().reshape(())
      scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
      for g, _ in grads: g.mul_(scale.to(g.dtype))
    return norm


def parallelize_gpt(model: GPT, tp_group: Group = None, cp_group: Group = None, sequence_parallel: bool = False,
                    overlap_chunks: int = 1) -> ParallelGPT:
  """This rank's tensor- and context-parallel form of `model` (a blutrain GPT with the same weights on every rank).
  The sharded layers hold copies of this rank's shards; the replicated ones (LayerNorms, position embedding, dropout)
  are `model`'s own modules, shared: drop `model` afterwards rather than training both.

  Args:
    tp_group: the tensor-parallel group (default: the world; for context parallelism alone, a group of this rank).
    cp_group: the context-parallel group (None: no context parallelism).
    sequence_parallel: split the LayerNorm/dropout regions along the sequence over tp_group (reduce-scatter and
      all-gather instead of all-reduce); the sequence length must be divisible by the tp size.
    overlap_chunks: the layers' forward collectives in this many chunks, each overlapping another chunk's GEMM
      (Column/RowParallelLinear's overlap_chunks: with sequence_parallel the all-gathers and reduce-scatters, in
      chunks of the batch; without it the row-parallel all-reduces, in chunks of the tokens).
  """
  return ParallelGPT(model, tp_group, cp_group, sequence_parallel, overlap_chunks)
