"""DistributedDataParallel: one model replica per rank, gradients averaged over the ranks during backward.

At wrap time rank 0's parameters and buffers are broadcast to every rank. Each parameter gets a post-accumulate-grad
hook (the autograd engine calls it as soon as that gradient is complete); gradients are packed into buckets of about
`bucket_cap_mb`, and a bucket whose gradients are all in is concatenated into one flat buffer and all-reduced
(ReduceOp.AVG) with async_op=True: on GPUs the NCCL call goes on the communication stream behind an event, so it
overlaps the rest of the backward. When the last bucket has been launched, every bucket's work is waited on (the
current stream waits on its event: no host sync) and each gradient becomes a tensor over its part of its bucket's
averaged buffer (no copy back, as PyTorch's gradient_as_bucket_view). The eager step is host-bound, so what runs per
parameter is only the hook, the cat's copy and two tensor headers made without an op (`distributed/buckets.py`).

Buckets are first laid out in reverse registration order (a forward's last parameters get their gradients first); after
the first backward they are rebuilt in the order that backward actually produced the gradients, as PyTorch does.

Under bt.compile each bucket's reduction is the functional `all_reduce` op of `blutrain.ops.collective` instead, so the
compiled step's graph holds one collective per bucket where backward completes it; on the GPU it runs on the step's
stream, inside the CUDA graph.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from blutrain import distributed as dist
from blutrain.autograd.tape import hooks
from blutrain.distributed import buckets
from blutrain.nn.module import Module
from blutrain.ops import collective, no_grad
from blutrain.tensor import Tensor


class _Bucket:
  __slots__ = ("params", "offsets", "numel", "flat", "arrived", "work")  # flat, work: this backward's buffer and its reduce

  def __init__(self, params: list[Tensor]):
    self.params, self.offsets, n = params, [], 0
    for p in params: self.offsets.append(n); n += p.numel()
    self.numel, self.flat, self.arrived, self.work = n, None, 0, None


class DistributedDataParallel(Module):
  """Wrap `module` for data-parallel training: call it as the module, and after `loss.backward()` every rank holds the
  gradients averaged over the ranks of `process_group`, as torch.nn.parallel.DistributedDataParallel.

  Args:
    module: the model (on this rank's device).
    device_ids: accepted for PyTorch compatibility; the module's device is used.
    bucket_cap_mb: the size of a gradient bucket in MiB (25: docs/distributed.md's cost model puts its latency at 7 %
      of its all-reduce on NVLink; configurator.ddp_bucket_bytes gives the smallest size for a latency share).
    process_group: the data-parallel group (default: the world).
    broadcast_buffers: broadcast rank 0's buffers at wrap time too.

  Example:
    >>> model = DistributedDataParallel(GPT(cfg).to(device))
    >>> loss = model(x, y)[1]; loss.backward(); opt.step()
    >>> with model.no_sync(): model(x2, y2)[1].backward()   # accumulate locally, reduce at the next backward
  """

  def __init__(self, module: Module, device_ids: list[int] | None = None, bucket_cap_mb: float = 25,
               process_group: dist.ProcessGroup | None = None, broadcast_buffers: bool = True):
    super().__init__()
    if not dist.is_initialized() and process_group is None:
      raise RuntimeError("DistributedDataParallel: the default process group is not initialized; call "
                         "blutrain.distributed.init_process_group(backend) first")
    self.module, self.process_group = module, process_group
    self.bucket_cap_bytes, self.require_sync, self._order, self._rebuilt = int(bucket_cap_mb * 2**20), True, [], False
    self._params = [p for p in module.parameters() if p.requires_grad]
    src = process_group.ranks[0] if process_group is not None else 0
    with no_grad():
      for t in list(module.parameters()) + (list(module.buffers()) if broadcast_buffers else []):
        dist.broadcast(t, src, group=process_group)
    self._build(list(reversed(self._params)))
    for p in self._params: p.register_post_accumulate_grad_hook(self._on_grad)

  def _build(self, order: list[Tensor]) -> None:
    """Pack parameters, in the order given, into buckets of at most bucket_cap_bytes, one dtype and device each."""
    self._buckets, self._bucket_of, current, size = [], {}, [], 0
    for p in order:
      nbytes = p.numel() * p.dtype.itemsize
      if current and (size + nbytes > self.bucket_cap_bytes or (p.dtype, p.device) != (current[0].dtype, current[0].device)):
        self._buckets.append(_Bucket(current)); current, size = [], 0
      current.append(p); size += nbytes
    if current: self._buckets.append(_Bucket(current))
    for i, b in enumerate(self._buckets):
      for p in b.params: self._bucket_of[id(p)] = i
    self._launched = 0

  def forward(self, *args, **kwargs) -> Any:
    late = [b for b in self._buckets if 0 < b.arrived < len(b.params)]
    if late:
      names = {id(p): n for n, p in self.module.named_parameters()}
      missing = [names[id(p)] for b in late for p in b.params if p.grad is None][:8]
      raise RuntimeError(f"DistributedDataParallel: the last backward gave no gradient to parameters {missing}; DDP "
                         "needs every parameter that requires grad to take part in the loss (or set requires_grad=False)")
    return self.module(*args, **kwargs)

  @contextlib.contextmanager
  def no_sync(self) -> Iterator[None]:
    """Backward passes inside the block accumulate gradients locally; the first backward after it reduces them all."""
    prev, self.require_sync = self.require_sync, False
    try: yield
    finally: self.require_sync = prev

  def _on_grad(self, p: Tensor) -> None:
    if not self.require_sync: return
    if not self._rebuilt: self._order.append(p)
    b = self._buckets[self._bucket_of[id(p)]]
    b.arrived += 1
    if b.arrived == len(b.params): self._launch(b)

  def _launch(self, b: _Bucket) -> None:
    with no_grad():
      b.flat = buckets.flatten([p.grad for p in b.params], b.params, b.numel)
      if hooks.trace is None:
        b.work = dist.all_reduce(b.flat, dist.ReduceOp.AVG, group=self.process_group, async_op=True)
      else:  # under bt.compile: the functional op, one graph op per bucket in the order backward completes them
        g = dist.get_group(self.process_group)
        b.flat = collective.all_reduce(b.flat, "avg", g.gid, g.size())
    self._launched += 1
    if self._launched == len(self._buckets): self._finish()

  def _finish(self) -> None:
    with no_grad():
      for b in self._buckets:
        if b.work is not None: b.work.wait()
        for p, g in zip(b.params, buckets.unflatten(b.flat, b.params, b.offsets)): p.grad = g
        b.flat, b.work, b.arrived = None, None, 0
    self._launched = 0
    if not self._rebuilt and len(self._order) == len(self._params):
      self._rebuilt = True
      self._build(self._order)
