"""ZeroRedundancyOptimizer: optimizer state (stage 1) and gradients (stage 2) sharded over the data-parallel ranks.

Each parameter group is flattened, in order, into one vector padded to a multiple of the group size W; rank r owns the
r-th of W equal slices. The wrapped optimizer (AdamW, SGD, ... built by `optimizer_class`) steps a leaf tensor holding
only that slice, so its state (AdamW's two moments) is 1/W of the full one. After the step every rank's slice is
all-gathered (all_gather_into_tensor) back into the full parameters. Elementwise optimizers therefore compute exactly
what they compute unsharded.

Stage 1 expects gradients already averaged over the ranks (wrap the model in DistributedDataParallel). Stage 2 does the
averaging itself: `step()` reduce-scatters (ReduceOp.AVG) each group's flattened local gradients, so each rank receives
only its slice; do not wrap the model in DDP then. Stage 3 (sharding the parameters themselves, gathered per layer
before use) is not built: it needs gathering hooks in forward and backward, left for the tensor-parallel issue.
"""
from __future__ import annotations

from typing import Any, Callable

from blutrain import distributed as dist
from blutrain import ops
from blutrain.ops import no_grad
from blutrain.optim.optimizer import Optimizer, ParamsT
from blutrain.tensor import Tensor


class ZeroRedundancyOptimizer(Optimizer):
  """Shard `optimizer_class`'s state over the ranks of `process_group`, as torch.distributed.optim.
  ZeroRedundancyOptimizer (plus `stage=2`, which also shards the gradients).

  Args:
    params: the parameters (or parameter groups), as for any optimizer; one dtype and device per group.
    optimizer_class: the local optimizer, e.g. bt.optim.AdamW (elementwise optimizers shard exactly).
    process_group: the data-parallel group (default: the world).
    stage: 1 (optimizer state) or 2 (state and gradients).
    **defaults: the local optimizer's hyperparameters (lr, betas, weight_decay, ...).

  Example:
    >>> opt = ZeroRedundancyOptimizer(model.parameters(), bt.optim.AdamW, stage=2, lr=3e-4)
    >>> model(x, y)[1].backward(); opt.step(); opt.zero_grad()
  """

  def __init__(self, params: ParamsT, optimizer_class: Callable[..., Optimizer], process_group=None, stage: int = 1,
               **defaults: Any):
    if stage not in (1, 2): raise ValueError(f"ZeroRedundancyOptimizer: stage must be 1 or 2, got {stage} (stage 3 is not built)")
    super().__init__(params, defaults)
    self.process_group, self.stage = process_group, stage
    self.world, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    self.shards: list[Tensor] = []
    with no_grad():
      for g in self.param_groups:
        ps = g["params"]
        if len({(p.dtype, p.device) for p in ps}) != 1:
          raise TypeError("ZeroRedundancyOptimizer: every parameter of a group needs one dtype and device, got "
                          f"{sorted({(p.dtype.name, str(p.device)) for p in ps})}; split them into groups")
        n = sum(p.numel() for p in ps)
        g["numel"], g["shard"] = n, -(-n // self.world)
        flat = self._flatten(ps, g["shard"] * self.world)
        s = g["shard"]
        self.shards.append(flat[self.rank * s:(self.rank + 1) * s].clone().requires_grad_(True))
    self.optim = optimizer_class([{**{k: v for k, v in g.items() if k not in ("params", "numel", "shard")},
                                   "params": [s]} for g, s in zip(self.param_groups, self.shards)])

  @staticmethod
  def _flatten(tensors: list[Tensor], length: int) -> Tensor:
    """The tensors' values in one vector of `length` elements (zero-padded)."""
    out = ops.zeros(length, dtype=tensors[0].dtype, device=tensors[0].device)
    off = 0
    for t in tensors:
      out[off:off + t.numel()].copy_(t.reshape(-1))
      off += t.numel()
    return out

  def step(self, closure: Callable[[], Any] | None = None) -> Any:
    """Reduce (stage 2) the gradients, step this rank's slice with the local optimizer, and all-gather the slices back
    into the parameters."""
    loss = None
    if closure is not None:
      with ops.enable_grad(): loss = closure()
    with no_grad():
      for g, shard, local in zip(self.param_groups, self.shards, self.optim.param_groups):
        for k, v in g.items():
          if k not in ("params", "numel", "shard"): local[k] = v  # schedulers change the wrapper's groups
        ps, s = g["params"], g["shard"]
        grads = [p.grad if p.grad is not None else ops.zeros_like(p) for p in ps]
        flat = self._flatten(grads, s * self.world)
        if self.stage == 2:
          mine = ops.empty(s, dtype=flat.dtype, device=flat.device)
          dist.reduce_scatter_tensor(mine, flat, dist.ReduceOp.AVG, group=self.process_group)
        else:
          mine = flat[self.rank * s:(self.rank + 1) * s].clone()
        shard.grad = mine
      self.optim.step()
      for g, shard in zip(self.param_groups, self.shards):
        full = ops.empty(g["shard"] * self.world, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(full, shard.detach(), group=self.process_group)
        off = 0
        for p in g["params"]:
          p.copy_(full[off:off + p.numel()].view(p.shape))
          off += p.numel()
    return loss

  def zero_grad(self, set_to_none: bool = True) -> None:
    super().zero_grad(set_to_none)
    self.optim.zero_grad(set_to_none)

  # *** sharded state, for checkpoints ***

  def shard_state(self) -> dict[str, Any]:
    """This rank's slice of every state tensor, as flat pieces of the full vectors: {name: (full_numel, start,
    tensor)} for tensors, plus the scalar state under "scalars" (the same on every rank)."""
    pieces, scalars = {}, {}
    for i, (g, shard) in enumerate(zip(self.param_groups, self.shards)):
      start = self.rank * g["shard"]
      keep = max(0, min(g["shard"], g["numel"] - start))  # the padding past numel is not state
      for k, v in self.optim.state[shard].items():
        if isinstance(v, Tensor) and v.numel() == shard.numel(): pieces[f"group{i}.{k}"] = (g["numel"], start, v[:keep])
        else: scalars[f"group{i}.{k}"] = v
    return {"pieces": pieces, "scalars": scalars}

  def load_full_state(self, tensors: dict[str, Tensor], scalars: dict[str, Any]) -> None:
    """Take this rank's slices of full state vectors (as `shard_state` wrote them, merged at any world size)."""
    with no_grad():
      for i, (g, shard) in enumerate(zip(self.param_groups, self.shards)):
        state, s, start = self.optim.state[shard], g["shard"], self.rank * g["shard"]
        for name, full in tensors.items():
          if not name.startswith(f"group{i}."): continue
          piece = ops.zeros(s, dtype=full.dtype, device=shard.device)
          keep = max(0, min(s, g["numel"] - start))
          if keep: piece[:keep].copy_(full[start:start + keep].to(shard.device))
          state[name.split(".", 1)[1]] = piece
        for name, v in scalars.items():
          if name.startswith(f"group{i}."):
            state[name.split(".", 1)[1]] = v.clone() if isinstance(v, Tensor) else v
