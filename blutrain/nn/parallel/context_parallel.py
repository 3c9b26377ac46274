"""Context parallelism: attention over a sequence split across the ranks of a group, by ring attention.

Each rank holds a part of the sequence's queries, keys and values. The key/value blocks travel around the ring (rank r
sends to r + 1 and receives from r - 1, n - 1 times); each rank attends its queries to each block as it arrives and
merges the partial results by their log-sum-exp: with partial outputs o_j and log-sum-exps l_j of the same queries,
l = logsumexp_j l_j and o = sum_j exp(l_j - l) o_j, which is exactly attention over all the keys. Each block is one
`flash_attention_lse` op, which returns o_j and l_j without keeping the scores; the merge's gradient reaches it as
(dO_j, dl_j) and its backward recomputes the block's weights. The ring shift is one tape node whose VJP shifts the
gradient the other way, so the backward carries dK/dV back around the ring to the rank that owns those keys.

Causal attention balances the work by the load-balancing permutation: the sequence is cut into 2n chunks and rank i
holds chunks i and 2n-1-i (`shard_sequence`, applied by the data loader, with `sequence_positions` for the tokens'
true positions). Then every rank does the same work at every step: its own block causally, then against an earlier
rank's block its queries meet only that block's first chunk, against a later rank's block only its second chunk of
queries attends (to all of it).

  >>> cp = dist.new_group([0, 1])
  >>> x = shard_sequence(tokens, cp)                   # (B, T / n): chunks r and 2n-1-r
  >>> y = ring_attention(q, k, v, cp, is_causal=True)  # q, k, v (B, H, T / n, D) of those tokens
"""
from __future__ import annotations

import math

from blutrain import distributed as dist, ops
from blutrain.autograd.tape import is_grad_enabled, no_grad, record
from blutrain.nn.parallel.tensor_parallel import Group, gather_from_parallel
from blutrain.ops.core import Op
from blutrain.ops.nn import flash_attention_lse
from blutrain.tensor import Tensor


def _ranks(group: Group) -> list[int]:
  return list(group.ranks) if group is not None else list(range(dist.get_world_size()))


def _start_shift(x: Tensor, group: Group, back: bool = False) -> tuple[Tensor, list]:
  """Start sending x to the next rank of the ring and receiving the previous rank's (`back`: the other way round);
  the received tensor and the Works to wait on before reading it (or changing x). Even ranks post the send first and
  odd ranks the receive, so the ring's transfers, in order on one stream (NCCL's), cannot wait on each other."""
  ranks, r = _ranks(group), dist.get_rank(group)
  step = -1 if back else 1
  dst, src = ranks[(r + step) % len(ranks)], ranks[(r - step) % len(ranks)]
  x, out = x.detach().contiguous(), ops.empty(x.shape, dtype=x.dtype, device=x.device)
  send = lambda: dist.isend(x, dst, group=group)
  recv = lambda: dist.irecv(out, src, group=group)
  works = [send(), recv()] if r % 2 == 0 else [recv(), send()]
  return out, works


def _shift(x: Tensor, group: Group, back: bool = False) -> Tensor:
  out, works = _start_shift(x, group, back)
  for w in works: w.wait()
  return out


_shift_node = Op("ring_shift", None, lambda g, out, x, group: (_shift(g, group, back=True),), saves=())


def start_ring_shift(x: Tensor, group: Group = None) -> tuple[Tensor, list]:
  """The previous rank's `x` (this rank's goes to the next), started asynchronously: returns the tensor and the
  Works to wait on before reading it. Differentiable: the backward sends the gradient back the other way."""
  with no_grad(): out, works = _start_shift(x, group)
  if is_grad_enabled() and x.requires_grad: record(_shift_node, (x,), {"group": group}, out)
  return out, works


def load_balance_indices(seq_len: int, world_size: int) -> Tensor:
  """The positions of a sequence in the order the ranks hold them: rank i's seq_len / world_size positions are
  chunks i and 2 world_size - 1 - i of 2 world_size equal chunks, and rank i's come i-th."""
  if seq_len % (2 * world_size):
    raise ValueError(f"load_balance_indices: a sequence of {seq_len} tokens does not split into 2 x {world_size} "
                     f"equal chunks; make it a multiple of {2 * world_size}")
  c = seq_len // (2 * world_size)
  order = [k for i in range(world_size) for k in (i, 2 * world_size - 1 - i)]
  return ops.cat([ops.arange(k * c, (k + 1) * c) for k in order])


def sequence_positions(seq_len: int, group: Group = None) -> Tensor:
  """This rank's true positions in a sequence of `seq_len` tokens (the whole sequence's length) under the
  load-balancing permutation: for position embeddings and rotary angles."""
  n, r = dist.get_world_size(group), dist.get_rank(group)
  local = seq_len // n
  return load_balance_indices(seq_len, n)[r * local:(r + 1) * local]


def shard_sequence(x: Tensor, group: Group = None, dim: int = 1) -> Tensor:
  """This rank's part of `x` along `dim` (the sequence) under the load-balancing permutation: chunks r and 2n-1-r."""
  dim = dim % x.ndim
  idx = sequence_positions(x.shape[dim], group).to(x.device)
  return x[(slice(None),) * dim + (idx,)]


def unshard_sequence(x: Tensor, group: Group = None, dim: int = 1) -> Tensor:
  """The whole sequence from every rank's part (the inverse of `shard_sequence`; differentiable)."""
  dim = dim % x.ndim
  n = dist.get_world_size(group)
  gathered = gather_from_parallel(x, group, dim)
  inverse = ops.argsort(load_balance_indices(gathered.shape[dim], n)).to(x.device)
  return gathered[(slice(None),) * dim + (inverse,)]


def _merge(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
  """The attention output and log-sum-exp over the union of the blocks, from each block's (output, log-sum-exp) of the
  same queries."""
  if len(parts) == 1: return parts[0]
  total = ops.stack([lse for _, lse in parts]).logsumexp(0)
  return sum((lse - total).exp().unsqueeze(-1) * out for out, lse in parts), total


def ring_attention(query: Tensor, key: Tensor, value: Tensor, group: Group = None, is_causal: bool = True,
                   scale: float | None = None) -> Tensor:
  """Attention of this rank's queries (..., L, E) to the keys and values (..., L, E) of every rank of `group`,
  their parts of one sequence. With `is_causal` the parts must be the load-balanced ones (`shard_sequence`): chunks
  r and 2n-1-r, L even. Returns this rank's outputs (..., L, E), as scaled_dot_product_attention on the whole
  sequence would give them."""
  if key.shape != value.shape or query.shape[:-2] != key.shape[:-2] or query.shape[-1] != key.shape[-1]:
    raise RuntimeError(f"ring_attention: expected q (..., L, E) and k, v (..., S, E) with the same batch dims, got "
                       f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}")
  L = query.shape[-2]
  if is_causal and (L % 2 or key.shape[-2] != L):
    raise RuntimeError(f"ring_attention: causal attention needs the load-balanced parts (two equal chunks of queries "
                       f"and keys on each rank), got {L} queries and {key.shape[-2]} keys")
  n, r = dist.get_world_size(group), dist.get_rank(group)
  scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
  k, v, h = key, value, L // 2
  # partial (output, lse), float32 at least, by flash attention that returns its logsumexp: no (L, S) scores are
  # kept, the backward recomputes them block by block. `whole`: of all L queries (this rank's block, and under causal
  # masking an earlier rank's first chunk); `second`: of the second chunk's only (a later rank's block, causal)
  whole, second = [], []
  # keys and values travel as one tensor, so that they share one shift and one gradient path
  incoming = start_ring_shift(ops.stack([k, v]), group) if n > 1 else None
  for step in range(n):
    if step:  # the block that arrived; the next one travels while this one is attended
      kv, works = incoming
      for w in works: w.wait()
      if step < n - 1: incoming = start_ring_shift(kv, group)
      k, v = kv[0], kv[1]
    src = (r - step) % n
    if not is_causal or step == 0: whole.append(flash_attention_lse(query, k, v, is_causal, scale))
    elif src < r:  # an earlier rank: all queries come after its first chunk, and before its second
      whole.append(flash_attention_lse(query, k[..., :h, :], v[..., :h, :], False, scale))
    else:          # a later rank: only the second chunk of queries comes after (all of) its keys
      second.append(flash_attention_lse(query[..., h:, :], k, v, False, scale))
  out, lse = _merge(whole)
  if second:
    tail, _ = _merge([(out[..., h:, :], lse[..., h:])] + second)
    out = ops.cat([out[..., :h, :], tail], -2)
  return out.to(query.dtype)


def all_reduce_gradients(parameters, group: Group = None, op: dist.ReduceOp = dist.ReduceOp.AVG,
                         bucket_cap_mb: float = 25) -> None:
  """All-reduce the `.grad` of every parameter that has one, in the given order: for the gradients of a model whose
  ranks saw different tokens (context parallelism). Unlike DDP's buckets, which are launched in the order the backward
  produces the gradients, the order here is the same on every rank even where the ranks' graphs differ. Consecutive
  gradients of one dtype go in buckets of up to `bucket_cap_mb` MiB, each concatenated and reduced by one call (a
  gradient larger than that alone, in place), so a model's hundreds of tensors cost tens of collectives; the reduced
  gradients are views of their bucket (as DDP's are of its buffers), so nothing is copied back."""
  cap, bucket = bucket_cap_mb * 2**20, []

  def flush() -> None:
    if len(bucket) == 1: dist.all_reduce(bucket[0].grad, op, group=group)
    elif bucket:
      flat = ops.cat([p.grad.reshape(-1) for p in bucket])
      dist.all_reduce(flat, op, group=group)
      for p, part in zip(bucket, flat.split([p.grad.numel() for p in bucket])): p.grad = part.view(p.grad.shape)
    bucket.clear()

  with no_grad():
    for p in parameters:
      g = p.grad
      if g is None: continue
      size = g.numel() * g.dtype.itemsize
      if bucket and (g.dtype is not bucket[0].grad.dtype or
                     sum(b.grad.numel() for b in bucket) * g.dtype.itemsize + size > cap): flush()
      bucket.append(p)
    flush()
