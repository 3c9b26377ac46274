"""ZeroRedundancyOptimizer: optimizer state (stage 1) and gradients (stage 2) sharded over the data-parallel ranks.

Each parameter group is cut, in order, into buckets of whole parameters (about `bucket_cap_mb` each); a bucket's
flattened values are padded to a multiple of the group size W and cut into W equal pieces, and rank r owns the r-th
piece of every bucket. The wrapped optimizer (AdamW, SGD, ... built by `optimizer_class`) steps one leaf tensor per
group holding only this rank's pieces, so its state (AdamW's two moments) is 1/W of the full one; after its step each
bucket's pieces are all-gathered back into the parameters. The parameters live in their buckets' gather buffers from
construction on (`p.data` carved from it), so the all-gather writes them in place, with no per-parameter copy; one
moved out since (`p.data = ...`, `module.to(...)`) is copied into instead. Elementwise optimizers therefore compute
exactly what they compute unsharded.

Stage 1 expects gradients already averaged over the ranks (wrap the model in DistributedDataParallel) and takes its
pieces of them at `step()`. Stage 2 averages them itself, during the backward: each parameter's post-accumulate-grad
hook counts its bucket in, and a complete bucket is reduce-scattered (ReduceOp.AVG, async: on GPUs on the
communication stream while the backward runs) so each rank receives only its piece, and the parameters' full gradients
are freed at once (set to None): the memory ZeRO-2 saves. Several backwards before a step accumulate. Do not wrap the
model in DDP then, and clip with `clip_grad_norm_` of this optimizer (the full gradients are gone). Under bt.compile
the reduce-scatters, the all-gathers and the norm's all-reduce are the functional ops of `blutrain.ops.collective`, one
graph op per bucket. Stage 3 (sharding the parameters themselves, gathered per layer before use) is not built: it needs
gathering hooks in the forward.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from blutrain import distributed as dist
from blutrain import ops
from blutrain.autograd.tape import hooks
from blutrain.distributed import buckets
from blutrain.ops import collective, no_grad
from blutrain.optim.optimizer import Optimizer, ParamsT
from blutrain.tensor import Tensor

__all__ = ["ZeroRedundancyOptimizer"]


class _Bucket:
  """Whole parameters of one group; `start` is its offset in the group's flattened values, `length` its padded size
  (a multiple of W), `piece` = length / W, `offset` where this rank's piece sits in the group's shard."""
  __slots__ = ("group", "params", "offsets", "start", "numel", "length", "piece", "offset", "arrived", "full")

  def __init__(self, group: int, params: list[Tensor], start: int, world: int, offset: int):
    self.group, self.params, self.start, self.arrived, self.offsets, n = group, params, start, 0, [], 0
    for p in params: self.offsets.append(n); n += p.numel()
    self.numel = n
    self.length = -(-self.numel // world) * world
    self.piece, self.offset = self.length // world, offset


class ZeroRedundancyOptimizer(Optimizer):
  """Shard `optimizer_class`'s state over the ranks of `process_group`, as torch.distributed.optim.
  ZeroRedundancyOptimizer, and with `stage=2` the gradients too.

  Args:
    params: the parameters (or parameter groups), as for any optimizer; one dtype and device per group.
    optimizer_class: the local optimizer, e.g. bt.optim.AdamW (elementwise optimizers shard exactly).
    process_group: the data-parallel group (default: the world).
    stage: 1 (optimizer state) or 2 (state and gradients, reduce-scattered during backward).
    bucket_cap_mb: the size of the buckets that are reduce-scattered and all-gathered together.
    **defaults: the local optimizer's hyperparameters (lr, betas, weight_decay, ...).

  Example:
    >>> opt = ZeroRedundancyOptimizer(model.parameters(), bt.optim.AdamW, stage=2, lr=3e-4)
    >>> model(x, y)[1].backward(); opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()
  """

  def __init__(self, params: ParamsT, optimizer_class: Callable[..., Optimizer], process_group=None, stage: int = 1,
               bucket_cap_mb: float = 25, **defaults: Any):
    if stage not in (1, 2): raise ValueError(f"ZeroRedundancyOptimizer: stage must be 1 or 2, got {stage} (stage 3 is not built)")
    super().__init__(params, defaults)
    self.process_group, self.stage = process_group, stage
    self.world, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    self._gid = dist.get_group(process_group).gid
    cap = int(bucket_cap_mb * 2**20)
    self.buckets: list[_Bucket] = []
    self.shards: list[Tensor] = []
    self.numels: list[int] = []
    with no_grad():
      for gi, g in enumerate(self.param_groups):
        ps = g["params"]
        if len({(p.dtype, p.device) for p in ps}) != 1:
          raise TypeError("ZeroRedundancyOptimizer: every parameter of a group needs one dtype and device, got "
                          f"{sorted({(p.dtype.name, str(p.device)) for p in ps})}; split them into groups")
        mine, start, offset, current, size = [], 0, 0, [], 0
        for i, p in enumerate(ps):
          current.append(p)
          size += p.numel() * p.dtype.itemsize
          if i + 1 == len(ps) or size + ps[i + 1].numel() * p.dtype.itemsize > cap:  # the next one would overflow
            b = _Bucket(gi, current, start, self.world, offset)
            self.buckets.append(b)
            b.full = buckets.flatten(current, current, b.length)
            mine.append(b.full[self.rank * b.piece:(self.rank + 1) * b.piece])
            for p, v in zip(current, buckets.unflatten(b.full, current, b.offsets)): p.data = v
            start, offset, current, size = start + b.numel, offset + b.piece, [], 0
        self.numels.append(start)
        self.shards.append(ops.cat(mine).requires_grad_(True))
    self.optim = optimizer_class([{**{k: v for k, v in g.items() if k != "params"}, "params": [s]}
                                  for g, s in zip(self.param_groups, self.shards)])
    self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
    self._pending: list = []  # (work, reduced piece, bucket) of stage 2's reduce-scatters in flight
    self._collected = False
    if stage == 2:
      for b in self.buckets:
        for p in b.params: p.register_post_accumulate_grad_hook(self._on_grad)

  # *** gradients ***

  def _on_grad(self, p: Tensor) -> None:
    b = self._bucket_of[id(p)]
    b.arrived += 1
    if b.arrived == len(b.params): self._reduce(b)

  def _reduce(self, b: _Bucket) -> None:
    """Reduce-scatter bucket b's gradients (async; under bt.compile the functional op) and free the parameters' full
    gradients."""
    with no_grad():
      flat = buckets.flatten([p.grad for p in b.params], b.params, b.length)
      for p in b.params: p.grad = None
      if hooks.trace is None:
        piece = ops.empty(b.piece, dtype=flat.dtype, device=flat.device)
        work = dist.reduce_scatter_tensor(piece, flat, dist.ReduceOp.AVG, group=self.process_group, async_op=True)
      else: piece, work = collective.reduce_scatter(flat, "avg", self._gid, self.world), None
    self._pending.append((work, piece, b))
    b.arrived, self._collected = 0, False

  def _collect(self) -> None:
    """Put this rank's pieces of the averaged gradients into the shards' .grad: stage 2 finishes its reduce-scatters
    (and reduces buckets some of whose parameters got no gradient), stage 1 slices the DDP-averaged gradients. Each
    shard's gradient is one cat of its buckets' pieces (no in-place writes into views: Nova captures this too)."""
    if self._collected: return
    pieces: dict[int, Tensor] = {}
    with no_grad():
      if self.stage == 2:
        for b in self.buckets:
          if b.arrived or any(p.grad is not None for p in b.params): self._reduce(b)
        for work, piece, b in self._pending:
          if work is not None: work.wait()
          pieces[id(b)] = piece if id(b) not in pieces else pieces[id(b)] + piece
        self._pending.clear()
      else:
        for b in self.buckets:
          if any(p.grad is not None for p in b.params):
            flat = buckets.flatten([p.grad for p in b.params], b.params, b.length)
            pieces[id(b)] = flat[self.rank * b.piece:(self.rank + 1) * b.piece]
      for gi, shard in enumerate(self.shards):
        mine = [b for b in self.buckets if b.group == gi]
        if not any(id(b) in pieces for b in mine): continue
        grad = ops.cat([pieces[id(b)] if id(b) in pieces else ops.zeros(b.piece, dtype=shard.dtype, device=shard.device)
                        for b in mine])
        shard.grad = grad if shard.grad is None else shard.grad + grad
    self._collected = True

  def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Scale the (sharded) gradients so that their total 2-norm over all ranks is at most `max_norm`; returns the
    norm before clipping, as nn.utils.clip_grad_norm_ on the full gradients would."""
    if norm_type != 2.0: raise ValueError(f"ZeroRedundancyOptimizer.clip_grad_norm_: only the 2-norm, got {norm_type}")
    self._collect()
    with no_grad():
      grads = [s.grad for s in self.shards if s.grad is not None]
      device = self.shards[0].device
      total = sum(((g.float() ** 2).sum() for g in grads), ops.zeros((), device=device)).reshape(1)
      if hooks.trace is None: dist.all_reduce(total, group=self.process_group)
      else: total = collective.all_reduce(total, "sum", self._gid, self.world)
      norm = total.sqrt().reshape(())
      scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
      for g in grads: g.mul_(scale.to(g.dtype))
    return norm

  # *** the step ***

  def step(self, closure: Callable[[], Any] | None = None) -> Any:
    """Step this rank's pieces with the local optimizer, then all-gather every bucket back into the parameters."""
    loss = None
    if closure is not None:
      with ops.enable_grad(): loss = closure()
    self._collect()
    with no_grad():
      for g, local in zip(self.param_groups, self.optim.param_groups):
        for k, v in g.items():
          if k != "params": local[k] = v  # schedulers change the wrapper's groups
      self.optim.step()
      gathered = []
      for b in self.buckets:
        piece = self.shards[b.group].detach()[b.offset:b.offset + b.piece]
        if hooks.trace is not None:
          gathered.append((None, collective.all_gather(piece, self._gid, self.world), b))
          continue
        into = self._gathers_into_parameters(b)
        full = b.full if into else ops.empty(b.length, dtype=piece.dtype, device=piece.device)
        work = dist.all_gather_into_tensor(full, piece, group=self.process_group, async_op=True)
        gathered.append((work, None if into else full, b))
      for work, full, b in gathered:
        if work is not None: work.wait()
        if full is None:  # gathered into the parameters' own memory: mark them changed, as an in-place op does
          for p in b.params: p._storage.version += 1
        else:
          for p, v in zip(b.params, buckets.unflatten(full, b.params, b.offsets)): p.copy_(v)
    self._collected = False
    return loss

  def _gathers_into_parameters(self, b: _Bucket) -> bool:
    """Whether bucket b's parameters still live in its gather buffer (as the constructor put them; `p.data = ...` or
    `module.to(...)` since moves them out, and the step then copies into them instead)."""
    data = b.full._storage.data
    return all(p._storage.data is data and p._offset == b.full._offset + off for p, off in zip(b.params, b.offsets))

  def zero_grad(self, set_to_none: bool = True) -> None:
    super().zero_grad(set_to_none)
    self.optim.zero_grad(set_to_none)
    self._collected = False

  # *** sharded state, for checkpoints ***

  def shard_state(self) -> dict[str, Any]:
    """This rank's pieces of every state tensor as ranges of the full (unsharded, flattened) vectors:
    {"pieces": {"group{i}.{key}#{bucket}": (full numel, start, tensor)}, "scalars": {"group{i}.{key}": value}}, the
    form checkpoint.save_sharded_checkpoint writes (the part after # only keeps the keys apart)."""
    pieces, scalars = {}, {}
    for gi, shard in enumerate(self.shards):
      for k, v in self.optim.state[shard].items():
        if not (isinstance(v, Tensor) and v.ndim == 1 and v.numel() == shard.numel()):
          scalars[f"group{gi}.{k}"] = v
          continue
        for bi, b in enumerate(self.buckets):
          keep = max(0, min(b.piece, b.numel - self.rank * b.piece))  # the padding is not state
          if b.group == gi and keep:
            pieces[f"group{gi}.{k}#{bi}"] = (self.numels[gi], b.start + self.rank * b.piece, v[b.offset:b.offset + keep])
    return {"pieces": pieces, "scalars": scalars}

  def load_full_state(self, tensors: dict[str, Tensor], scalars: dict[str, Any]) -> None:
    """Take this rank's pieces of full state vectors ({"group{i}.{key}": flat tensor}, as load_sharded_checkpoint
    assembles them from a checkpoint written at any world size) and the scalar state."""
    with no_grad():
      for gi, shard in enumerate(self.shards):
        state = self.optim.state[shard]
        for name, full in tensors.items():
          if not name.startswith(f"group{gi}."): continue
          mine = ops.zeros(shard.numel(), dtype=full.dtype, device=shard.device)
          for b in self.buckets:
            keep = max(0, min(b.piece, b.numel - self.rank * b.piece))
            if b.group == gi and keep:
              lo = b.start + self.rank * b.piece
              mine[b.offset:b.offset + keep].copy_(full[lo:lo + keep].to(shard.device))
          state[name.split(".", 1)[1]] = mine
        for name, v in scalars.items():
          if name.startswith(f"group{gi}."): state[name.split(".", 1)[1]] = v.clone() if isinstance(v, Tensor) else v
