"""Tensor parallelism as Megatron-LM's: column- and row-parallel linear layers, a vocabulary-parallel embedding and
cross-entropy, sequence parallelism for the LayerNorm/dropout regions, and the plan that shards a GPT.

The collectives are autograd-aware: each is one tape node whose VJP is its dual collective (all-reduce <-> identity,
all-gather <-> reduce-scatter, split <-> all-gather), so a model written with them differentiates as usual.

  >>> tp = dist.new_group([0, 1])                                  # the tensor-parallel ranks
  >>> model = parallelize_gpt(GPT(cfg), tp, sequence_parallel=True)
  >>> logits, loss = model(idx, targets); loss.backward()          # logits: this rank's slice of the vocabulary

A column-parallel layer splits its output features over the ranks (its input is replicated: its backward all-reduces
the input's gradient); a row-parallel layer splits its input features and all-reduces its output. Attention and MLP
are a column-parallel layer followed by a row-parallel one: one all-reduce forward and one backward per block half.
With sequence parallelism the replicated activations between blocks are split along the sequence instead: the
all-reduce becomes a reduce-scatter, and the column-parallel layer all-gathers its input (same traffic, 1/n of the
LayerNorm/dropout activations and work per rank). Parameters used in that region (LayerNorm's) see a part of the
tokens, so their gradients are all-reduced over the group in backward.
"""
from __future__ import annotations

import math
from typing import Callable

from blutrain import backends, distributed as dist, dtypes, nn, ops
from blutrain.autograd.tape import is_grad_enabled, no_grad, record
from blutrain.nn import functional as F
from blutrain.nn.module import Module, Parameter
from blutrain.ops.core import Op, autocast_inputs
from blutrain.ops.linalg import matmul_op
from blutrain.tensor import Tensor

Group = dist.ProcessGroup | None


# *** the collectives with their duals as VJPs ***

def _all_reduce(x: Tensor, group: Group, dim: int) -> Tensor:
  out = x.detach().clone()
  dist.all_reduce(out, group=group)
  return out


def to_rank_major(x: Tensor, n: int, dim: int) -> Tensor:
  """x's dim cut into n blocks, the blocks stacked along dim 0 (the layout reduce_scatter_tensor reads and
  all_gather_into_tensor writes: rank r's block r-th), contiguous; a view of x wherever the layout allows (dim 0, or
  a group of one), else one copy. Differentiable."""
  _check_divisible("to_rank_major", x, dim, n)
  s = tuple(x.shape)
  blocks = x.reshape(*s[:dim], n, s[dim] // n, *s[dim + 1:]).permute(dim, *range(dim), *range(dim + 1, x.ndim + 1))
  return blocks.contiguous().reshape(n * blocks.shape[1], *blocks.shape[2:])


def from_rank_major(x: Tensor, n: int, dim: int) -> Tensor:
  """The inverse of to_rank_major: the n blocks stacked along x's dim 0 joined along dim; a view wherever the layout
  allows, else one copy. Differentiable."""
  block = (x.shape[0] // n, *x.shape[1:])
  joined = x.reshape(n, *block).permute(*range(1, dim + 1), 0, *range(dim + 1, len(block) + 1))
  return joined.reshape(*block[:dim], n * block[dim], *block[dim + 1:])


def _all_gather(x: Tensor, group: Group, dim: int) -> Tensor:
  n = dist.get_world_size(group)
  x = x.detach().contiguous()
  out = ops.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
  dist.all_gather_into_tensor(out, x, group=group)
  return from_rank_major(out, n, dim)


def _check_divisible(name: str, x: Tensor, dim: int, n: int) -> None:
  if x.shape[dim] % n:
    raise RuntimeError(f"{name}: dim {dim} of a tensor of shape {tuple(x.shape)} does not split over {n} ranks; "
                       f"make it a multiple of the group size")


def _reduce_scatter(x: Tensor, group: Group, dim: int) -> Tensor:
  n = dist.get_world_size(group)
  _check_divisible("reduce_scatter_to_sequence_parallel", x, dim, n)
  out = ops.empty((*x.shape[:dim], x.shape[dim] // n, *x.shape[dim + 1:]), dtype=x.dtype, device=x.device)
  dist.reduce_scatter_tensor(out, to_rank_major(x.detach(), n, dim), group=group)
  return out


def _split(x: Tensor, group: Group, dim: int) -> Tensor:
  n = dist.get_world_size(group)
  _check_divisible("scatter_to_parallel", x, dim, n)
  return x.detach().chunk(n, dim)[dist.get_rank(group)].contiguous()


def _identity(x: Tensor, group: Group, dim: int) -> Tensor: return x.detach()


def autograd_collective(name: str, forward: Callable[[Tensor, Group, int], Tensor],
                        backward: Callable[[Tensor, Group, int], Tensor]) -> Callable[..., Tensor]:
  """A function `(x, group, dim) -> Tensor` running `forward` on x, recorded on the tape as one node whose VJP is
  `backward` on the output's gradient (both take the tensor, the group and the dim)."""
  node_op = Op(name, None, lambda g, out, x, group, dim: (backward(g, group, dim),), saves=())

  def call(x: Tensor, group: Group = None, dim: int = -1) -> Tensor:
    dim = dim % x.ndim if x.ndim else 0
    with no_grad(): out = forward(x, group, dim)
    if is_grad_enabled() and x.requires_grad: record(node_op, (x,), {"group": group, "dim": dim}, out)
    return out
  call.__name__ = name
  return call


copy_to_parallel = autograd_collective("copy_to_parallel", _identity, _all_reduce)
copy_to_parallel.__doc__ = "Identity forward; backward all-reduces the gradient (a replicated input of sharded work)."
reduce_from_parallel = autograd_collective("reduce_from_parallel", _all_reduce, _identity)
reduce_from_parallel.__doc__ = "All-reduce (sum) forward; identity backward (partial sums made whole)."
gather_from_parallel = autograd_collective("gather_from_parallel", _all_gather, _split)
gather_from_parallel.__doc__ = "All-gather along `dim` forward; backward keeps this rank's slice of the gradient."
scatter_to_parallel = autograd_collective("scatter_to_parallel", _split, _all_gather)
scatter_to_parallel.__doc__ = "This rank's slice along `dim` forward; backward all-gathers the gradient."
gather_from_sequence_parallel = autograd_collective("gather_from_sequence_parallel", _all_gather, _reduce_scatter)
gather_from_sequence_parallel.__doc__ = ("All-gather along `dim` (the sequence) forward; backward reduce-scatters: the "
                                         "gathered activations feed sharded work whose gradients are partial sums.")
reduce_scatter_to_sequence_parallel = autograd_collective("reduce_scatter_to_sequence_parallel", _reduce_scatter,
                                                          _all_gather)
reduce_scatter_to_sequence_parallel.__doc__ = "Reduce-scatter along `dim` forward; backward all-gathers the gradient."


def _launch_all_reduce(x: Tensor, group: Group):
  out = x.detach()  # in place: the caller passes a fresh tensor
  return out, dist.all_reduce(out, group=group, async_op=True)


def _launch_all_gather(x: Tensor, group: Group):
  x = x.detach().contiguous()
  out = ops.empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
  return out, dist.all_gather_into_tensor(out, x, group=group, async_op=True)


def _launch_reduce_scatter(x: Tensor, group: Group):
  n = dist.get_world_size(group)
  _check_divisible("reduce_scatter_to_sequence_parallel", x, 0, n)
  x = x.detach().contiguous()
  out = ops.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
  return out, dist.reduce_scatter_tensor(out, x, group=group, async_op=True)


# the forward collective started asynchronously, and its dual (the VJP, run synchronously), as the functions above
_ASYNC = {"reduce_from_parallel": (_launch_all_reduce, _identity),
          "gather_from_sequence_parallel": (_launch_all_gather, _reduce_scatter),
          "reduce_scatter_to_sequence_parallel": (_launch_reduce_scatter, _all_gather)}
_ASYNC_NODES = {kind: Op(kind, None, lambda g, out, x, group, dim, dual=dual: (dual(g, group, 0),), saves=())
                for kind, (_, dual) in _ASYNC.items()}


def start_collective(kind: str, x: Tensor, group: Group = None) -> tuple[Tensor, dist.Work]:
  """Start `kind`, one of "reduce_from_parallel", "gather_from_sequence_parallel" and
  "reduce_scatter_to_sequence_parallel" (those functions along dim 0), with async_op=True: returns the output, to be
  read only after the Work's wait(), and the Work. Differentiable as those functions are. reduce_from_parallel
  reduces x's memory in place: pass a fresh tensor (a GEMM's output, which no node saves)."""
  launch, _ = _ASYNC[kind]
  with no_grad(): out, work = launch(x, group)
  if is_grad_enabled() and x.requires_grad: record(_ASYNC_NODES[kind], (x,), {"group": group, "dim": 0}, out)
  return out, work


def _check_chunks(name: str, chunks: int) -> None:
  if not isinstance(chunks, int) or chunks < 1:
    raise ValueError(f"{name}: overlap_chunks must be a positive int, got {chunks!r}")


# *** the overlapped layers: chunked forward, one tape node ***
# The forward runs in chunks, each chunk's collective in flight while another chunk's GEMM runs; the backward has
# nothing to overlap (the duals run synchronously), so the chunks make one node whose VJP is the dual collective on the
# whole gradient, once, and matmul's own VJP (blutrain.ops.linalg) on the whole of x @ w^T.

def _matmul_grads(g: Tensor, x: Tensor, wt: Tensor) -> tuple[Tensor, Tensor]:
  return matmul_op.vjp(g, None, x, wt, tf32=x.dtype is dtypes.float32 and backends.allow_tf32())


def _row_overlapped_vjp(g, out, x, wt, group, sequence_parallel):
  return _matmul_grads(_all_gather(g, group, 1) if sequence_parallel else g, x, wt)


def _column_overlapped_vjp(g, out, x, wt, gathered, group):
  dx, dwt = _matmul_grads(g, gathered, wt)
  return _reduce_scatter(dx, group, 1), dwt, None


_row_overlapped_node = Op("row_parallel_linear_overlapped", None, _row_overlapped_vjp, saves=(0, 1))
_column_overlapped_node = Op("column_parallel_linear_overlapped", None, _column_overlapped_vjp, saves=(1, 2))


def _record(node: Op, inputs: tuple, attrs: dict, out: Tensor) -> Tensor:
  if is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs): record(node, inputs, attrs, out)
  return out


# *** layers ***

def _shard(w: Tensor, dim: int, group: Group, parts: int = 1) -> Tensor:
  """This rank's slice of `w` along dim, taken from each of `parts` equal blocks (q, k, v of a fused projection)."""
  n, r = dist.get_world_size(group), dist.get_rank(group)
  blocks = w.detach().chunk(parts, dim)
  for b in blocks: _check_divisible("tensor parallel sharding", b, dim, n)
  return ops.cat([b.chunk(n, dim)[r] for b in blocks], dim).contiguous()


def _divide(name: str, what: str, size: int, group: Group) -> int:
  n = dist.get_world_size(group)
  if size % n: raise ValueError(f"{name}: {what} ({size}) must be divisible by the tensor-parallel group size ({n})")
  return size // n


class ColumnParallelLinear(Module):
  """y = x W^T + b with W's output features (rows) split over the ranks of `process_group`: each rank computes
  its out_features / n outputs.

  Args:
    in_features, out_features, bias: as nn.Linear (the whole layer's sizes).
    gather_output: all-gather the outputs so every rank gets all of them (default: keep this rank's slice).
    sequence_parallel: the input is split along dim 1 (the sequence): all-gather it first (backward reduce-scatters).
    process_group: the tensor-parallel group (default: the world).
    overlap_chunks: with sequence_parallel, all-gather the input in this many chunks of the batch (dim 0), each
      chunk's GEMM running while the next chunk's all-gather is in flight (on GPUs: on the communication stream).
  """

  def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
               sequence_parallel: bool = False, process_group: Group = None, overlap_chunks: int = 1, device=None,
               dtype=None) -> None:
    super().__init__()
    _check_chunks("ColumnParallelLinear", overlap_chunks)
    self.overlap_chunks, self.parts = overlap_chunks, 1  # parts: equal output blocks sharded each (from_linear)
    local = _divide("ColumnParallelLinear", "out_features", out_features, process_group)
    self.in_features, self.out_features, self.process_group = in_features, out_features, process_group
    self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
    bound = 1 / math.sqrt(in_features)
    self.weight = Parameter(nn.init.uniform_(ops.empty(local, in_features, device=device, dtype=dtype), -bound, bound))
    if bias: self.bias = Parameter(nn.init.uniform_(ops.empty(local, device=device, dtype=dtype), -bound, bound))
    else: self.register_parameter("bias", None)

  @classmethod
  def from_linear(cls, linear: nn.Linear, process_group: Group = None, parts: int = 1,
                  **kwargs) -> ColumnParallelLinear:
    """This rank's shard of `linear`; `parts` > 1 shards each of that many equal output blocks (fused q, k, v)."""
    m = cls(linear.in_features, linear.out_features, linear.bias is not None, process_group=process_group,
            device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
    m.parts = parts
    with no_grad():
      m.weight.copy_(_shard(linear.weight, 0, process_group, parts))
      if linear.bias is not None: m.bias.copy_(_shard(linear.bias, 0, process_group, parts))
    return m

  def forward(self, x: Tensor) -> Tensor:
    g = self.process_group
    if self.sequence_parallel and self.overlap_chunks > 1: y = self._overlapped(x)
    else:
      x = gather_from_sequence_parallel(x, g, 1) if self.sequence_parallel else copy_to_parallel(x, g)
      y = F.linear(x, self.weight, self.bias)
    return gather_from_parallel(y, g, -1) if self.gather_output else y

  def _overlapped(self, x: Tensor) -> Tensor:
    """The sequence-parallel all-gather in chunks of the batch, the next chunk's gather in flight during this GEMM;
    the chunks are gathered into one buffer, whose whole the backward reads (one reduce-scatter of dx)."""
    g, n, k = self.process_group, dist.get_world_size(self.process_group), self.overlap_chunks
    x, w, b = autocast_inputs("linear", x, self.weight, self.bias)
    wt = w.mT
    with no_grad():
      chunks = x.detach().chunk(k, 0)
      # chunk i's ranks' parts stacked along dim 0 in buf[i] (a whole batch chunk per slot; the last may be short)
      buf = ops.empty((len(chunks), n * chunks[0].shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
      slot = lambda i: buf[i, :n * chunks[i].shape[0]]
      gather = lambda i: dist.all_gather_into_tensor(slot(i), chunks[i].contiguous(), group=g, async_op=True)
      pending, outs = gather(0), []
      for i in range(len(chunks)):
        work = pending
        if i + 1 < len(chunks): pending = gather(i + 1)
        work.wait()
        outs.append(ops.matmul(from_rank_major(slot(i), n, 1), wt))
      y = ops.cat(outs, 0)
      if len(chunks) * chunks[0].shape[0] == x.shape[0]:  # equal chunks: buf is (chunk, rank, batch in chunk, ...)
        whole = buf.reshape(len(chunks), n, *chunks[0].shape).transpose(1, 2)  # a view for a group of one
        gathered = whole.reshape(x.shape[0], n * x.shape[1], *x.shape[2:])
      else: gathered = ops.cat([from_rank_major(slot(i), n, 1) for i in range(len(chunks))], 0)
    y = _record(_column_overlapped_node, (x, wt, gathered), {"group": g}, y)
    return y if b is None else y + b


class RowParallelLinear(Module):
  """y = x W^T + b with W's input features (columns) split over the ranks: each rank multiplies its slice of the
  input features, and the partial products are all-reduced (reduce-scattered along the sequence with
  `sequence_parallel`). The bias is whole on every rank and added after the reduction.

  Args:
    in_features, out_features, bias: as nn.Linear (the whole layer's sizes).
    input_is_parallel: the input is already split along its features (a column-parallel layer's output); else this
      layer takes its slice.
    sequence_parallel: reduce-scatter the output along dim 1 instead of all-reducing it.
    process_group: the tensor-parallel group (default: the world).
    overlap_chunks: split the tokens into this many chunks (of the batch, dim 0, with sequence_parallel) and start
      each chunk's all-reduce (reduce-scatter) as soon as its GEMM is done, so it runs while the next chunk's GEMM
      does (on GPUs the collective is on the communication stream, ordered by events: the two streams overlap; the
      compute stream waits for the reductions only after the last GEMM). 1: one GEMM, then its reduction.
  """

  def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
               sequence_parallel: bool = False, process_group: Group = None, overlap_chunks: int = 1, device=None,
               dtype=None) -> None:
    super().__init__()
    _check_chunks("RowParallelLinear", overlap_chunks)
    self.overlap_chunks = overlap_chunks
    local = _divide("RowParallelLinear", "in_features", in_features, process_group)
    self.in_features, self.out_features, self.process_group = in_features, out_features, process_group
    self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
    bound = 1 / math.sqrt(in_features)
    self.weight = Parameter(nn.init.uniform_(ops.empty(out_features, local, device=device, dtype=dtype), -bound, bound))
    if bias: self.bias = Parameter(nn.init.uniform_(ops.empty(out_features, device=device, dtype=dtype), -bound, bound))
    else: self.register_parameter("bias", None)

  @classmethod
  def from_linear(cls, linear: nn.Linear, process_group: Group = None, **kwargs) -> RowParallelLinear:
    """This rank's shard of `linear` (its input features' slice; the whole bias)."""
    m = cls(linear.in_features, linear.out_features, linear.bias is not None, process_group=process_group,
            device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
    with no_grad():
      m.weight.copy_(_shard(linear.weight, 1, process_group))
      if linear.bias is not None: m.bias.copy_(linear.bias.detach())
    return m

  def _overlapped(self, x: Tensor) -> Tensor:
    """x W^T in chunks (of the batch with sequence_parallel, else of the tokens), each chunk's reduction started as
    soon as its GEMM is done; one node for the backward (one all-gather of the gradient with sequence_parallel)."""
    g, n, sp = self.process_group, dist.get_world_size(self.process_group), self.sequence_parallel
    x, w = autocast_inputs("linear", x, self.weight)
    wt = w.mT
    with no_grad():
      if sp:  # each chunk's reduce-scatter into its rows of one output
        _check_divisible("RowParallelLinear", x, 1, n)
        y = ops.empty((x.shape[0], x.shape[1] // n, *x.shape[2:-1], wt.shape[1]), dtype=x.dtype, device=x.device)
        works, start = [], 0
        for c in x.detach().chunk(self.overlap_chunks, 0):
          out, start = y[start:start + c.shape[0]], start + c.shape[0]
          works.append(dist.reduce_scatter_tensor(out, to_rank_major(ops.matmul(c, wt), n, 1), group=g, async_op=True))
        for work in works: work.wait()
      else:  # in place: each chunk's GEMM output is fresh
        started = [(y, dist.all_reduce(y, group=g, async_op=True))
                   for y in (ops.matmul(c, wt) for c in x.detach().reshape(-1, x.shape[-1]).chunk(self.overlap_chunks))]
        for _, work in started: work.wait()
        y = ops.cat([out for out, _ in started], 0).reshape(*x.shape[:-1], wt.shape[1])
    return _record(_row_overlapped_node, (x, wt), {"group": g, "sequence_parallel": sp}, y)

  def forward(self, x: Tensor) -> Tensor:
    g = self.process_group
    if not self.input_is_parallel: x = scatter_to_parallel(x, g, -1)
    if self.overlap_chunks > 1:
      y = self._overlapped(x)
      if self.bias is None: return y
      return y + (copy_to_parallel(self.bias, g) if self.sequence_parallel else self.bias)
    y = F.linear(x, self.weight)
    if self.sequence_parallel:
      y = reduce_scatter_to_sequence_parallel(y, g, 1)
      return y if self.bias is None else y + copy_to_parallel(self.bias, g)  # each rank adds it to its tokens only
    y, work = start_collective("reduce_from_parallel", y, g)  # in place: the GEMM's output is fresh, and saved by none
    work.wait()
    return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(Module):
  """An embedding whose rows (the vocabulary) are split over the ranks: each rank looks up the indices in its range,
  zeros elsewhere, and the results are all-reduced (reduce-scattered along dim 1 with `sequence_parallel`).

  Args:
    num_embeddings, embedding_dim: the whole table's sizes; num_embeddings divisible by the group size.
    sequence_parallel: reduce-scatter the output along dim 1 (the sequence) instead of all-reducing it.
    process_group: the tensor-parallel group (default: the world).
  """

  def __init__(self, num_embeddings: int, embedding_dim: int, sequence_parallel: bool = False,
               process_group: Group = None, device=None, dtype=None) -> None:
    super().__init__()
    local = _divide("VocabParallelEmbedding", "num_embeddings", num_embeddings, process_group)
    self.num_embeddings, self.embedding_dim, self.process_group = num_embeddings, embedding_dim, process_group
    self.sequence_parallel, self.start = sequence_parallel, dist.get_rank(process_group) * local
    self.weight = Parameter(nn.init.normal_(ops.empty(local, embedding_dim, device=device, dtype=dtype)))

  @classmethod
  def from_embedding(cls, emb: nn.Embedding, process_group: Group = None, **kwargs) -> VocabParallelEmbedding:
    """This rank's rows of `emb`."""
    m = cls(emb.num_embeddings, emb.embedding_dim, process_group=process_group, device=emb.weight.device,
            dtype=emb.weight.dtype, **kwargs)
    with no_grad(): m.weight.copy_(_shard(emb.weight, 0, process_group))
    return m

  def forward(self, idx: Tensor) -> Tensor:
    local = self.weight.shape[0]
    mine = (idx >= self.start) & (idx < self.start + local)
    e = F.embedding((idx - self.start).clamp(0, local - 1), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
    g = self.process_group
    return reduce_scatter_to_sequence_parallel(e, g, 1) if self.sequence_parallel else reduce_from_parallel(e, g)


def unshard(module: Module, name: str, group: Group = None) -> Tensor:
  """The whole tensor of `module`'s parameter `name` gathered from the ranks' shards (the inverse of from_linear and
  from_embedding); a replicated parameter as it is."""
  p = getattr(module, name).detach()
  if isinstance(module, RowParallelLinear): return _all_gather(p, group, 1) if name == "weight" else p
  if not isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)): return p
  whole = _all_gather(p, group, 0)
  parts = getattr(module, "parts", 1)
  if parts == 1: return whole
  n = dist.get_world_size(group)  # rank-major [q_0, k_0, v_0, q_1, ...] -> [q_0, q_1, ..., k_0, ...]
  return whole.reshape(n, parts, -1, *p.shape[1:]).transpose(0, 1).reshape(whole.shape).contiguous()


def _vocab_parallel_ce_vjp(g, out, logits, target, lse, start, ignore_index):
  return ops.nn.cross_entropy_lse_backward_op(g, logits, target, lse, start=start, ignore_index=ignore_index), None, None


# the loss's node: its gradient is g (softmax - onehot) from the whole rows' logsumexp, which no rank's ops compute
_vocab_parallel_ce_node = Op("vocab_parallel_cross_entropy", None, _vocab_parallel_ce_vjp, saves=(0, 1, 2))


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, process_group: Group = None,
                                 ignore_index: int = -100, reduction: str = "mean") -> Tensor:
  """F.cross_entropy of logits whose last dim (the vocabulary) is split over the ranks, without gathering them:
  one pass over this rank's logits gives each row's max, sum of exponentials and target logit (`cross_entropy_stats`),
  the maxima are all-reduced (MAX), then the rescaled sums with the target logits (SUM): two numbers a row more. The
  backward is one pass too (`cross_entropy_lse_backward`). `logits` (..., V / n) is this rank's slice (rank r holds
  classes [r V/n, (r+1) V/n)), of any floating dtype (half logits are read as they are, the loss is float32);
  `target` (...) holds whole-vocabulary indices. Every rank gets the same loss."""
  if reduction not in ("mean", "sum", "none"):
    raise ValueError(f"vocab_parallel_cross_entropy: unknown reduction {reduction!r}")
  if tuple(target.shape) != tuple(logits.shape[:-1]):
    raise ValueError(f"vocab_parallel_cross_entropy: target of shape {tuple(target.shape)} does not match logits of "
                     f"shape {tuple(logits.shape)}; expected a target of shape {tuple(logits.shape[:-1])}")
  lead, local = tuple(target.shape), logits.shape[-1]
  logits, target = logits.reshape(-1, local), target.reshape(-1)
  start = dist.get_rank(process_group) * local
  with no_grad():
    row_max, sum_exp, picked = ops.nn.cross_entropy_stats_op(logits, target, start=start)
    top = row_max.clone()
    dist.all_reduce(top, dist.ReduceOp.MAX, group=process_group)
    sums = ops.stack([sum_exp * (row_max - top).exp(), picked])  # one all-reduce for both
    dist.all_reduce(sums, group=process_group)
    lse = top + sums[0].log()
    valid = target != ignore_index
    losses = ops.where(valid, lse - sums[1], 0.0)
  if is_grad_enabled() and logits.requires_grad:
    record(_vocab_parallel_ce_node, (logits, target, lse), {"start": start, "ignore_index": ignore_index}, losses)
  if reduction == "none": return losses.reshape(lead)
  if reduction == "sum": return losses.sum()
  return losses.sum() / valid.sum().to(losses.dtype)
