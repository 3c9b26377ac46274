"""The collective ops' kernels, the same for every backend: they hand their array to the communicator of the group the
op names. Communicators live above the backends (`blutrain.distributed` makes them with its process groups), so the
backend never imports them: `blutrain.distributed` registers each group it makes in `communicators` under its id, and
removes it when the group is destroyed.

A communicator implements, on its backend's arrays, functional and ordered on the current stream (so that a CUDA
graph captures the call): `all_reduce_array(x, reduce_op)`, `reduce_scatter_array(x, reduce_op)`,
`all_gather_array(x)`, each returning a new array, where reduce_op is a ReduceOp's value ("sum", "avg", ...).
A communicator whose calls complete asynchronously (NCCL) may also watch queued work (`watch_queued(count)`, which
its watchdog times out) and say whether it failed (`raise_if_failed()`): `check` and `watch` below, around a compiled
step whose collectives run without the host (a replayed CUDA graph).
"""
from __future__ import annotations

from typing import Any

communicators: dict[int, Any] = {}  # group id -> communicator, filled by blutrain.distributed


def _communicator(name: str, group: int, size: int):
  c = communicators.get(group)
  if c is None:
    raise RuntimeError(f"{name}: no process group with id {group} in this process; make the groups with "
                       "blutrain.distributed (init_process_group, new_group) before running the op, and in the same "
                       "order on every rank")
  if c.size() != size: raise RuntimeError(f"{name}: process group {group} has {c.size()} ranks, the op says {size}")
  return c


def all_reduce(x, *, reduce_op: str, group: int, size: int):
  return _communicator("all_reduce", group, size).all_reduce_array(x, reduce_op)


def reduce_scatter(x, *, reduce_op: str, group: int, size: int):
  return _communicator("reduce_scatter", group, size).reduce_scatter_array(x, reduce_op)


def all_gather(x, *, group: int, size: int):
  return _communicator("all_gather", group, size).all_gather_array(x)


def check(groups: dict[int, int]) -> None:
  """Raise the error of any of `groups` (group id -> collectives a step holds) that failed, before more is queued."""
  for gid in groups:
    c = communicators.get(gid)
    if c is not None and hasattr(c, "raise_if_failed"): c.raise_if_failed()


def watch(groups: dict[int, int]) -> None:
  """Have each of `groups` watch the work queued so far on the current stream, which holds that many of its
  collectives, so that a peer that never arrives ends in the group's timeout error rather than a hang."""
  for gid, count in groups.items():
    c = communicators.get(gid)
    if c is not None and hasattr(c, "watch_queued"): c.watch_queued(count)


KERNELS = {"all_reduce": all_reduce, "reduce_scatter": reduce_scatter, "all_gather": all_gather}
