"""`bt.profiler`: where the time of a piece of eager code goes, op by op.

  with bt.profiler.profile() as prof:
    step(x, y)
  print(prof.table())

Every primitive that runs a kernel is timed twice: on the host (Python dispatch and the launch) and on its device
(CUDA events recorded around the kernel on the current stream; on the CPU the host time is the device time).
`record_function(name)` times a region that runs kernels outside the op library, such as the fused optimizer step.
Rows are keyed by op name and input shapes. Profiling adds two events per op, so profiled steps run slower. A profile
fills the `hooks.profile` slot of blutrain.autograd.tape, which `ops.apply` calls around every kernel.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from blutrain.autograd.tape import hooks
from blutrain.device import Device, to_device


@dataclass
class Row:
  """Totals of one (name, shapes) key: calls, host and device milliseconds."""
  name: str
  shapes: str
  calls: int = 0
  host_ms: float = 0.0
  device_ms: float = 0.0


class profile:
  """Time the ops run inside the `with` block. `table()` lists them by device time; `rows` holds the totals."""

  def __init__(self, by_shapes: bool = True):
    self.by_shapes, self.rows, self.wall_ms = by_shapes, [], 0.0
    self._pending: list[tuple[tuple[str, str], float, object, object]] = []

  def __enter__(self) -> profile:
    if hooks.profile is not None: raise RuntimeError("bt.profiler.profile: a profile is already active in this thread")
    hooks.profile, self._t0 = self._time, time.perf_counter()
    return self

  def __exit__(self, *exc) -> None:
    hooks.profile = None
    from blutrain.backend.cuda import runtime
    if any(start is not None for _, _, start, _ in self._pending): runtime.synchronize()
    self.wall_ms = (time.perf_counter() - self._t0) * 1e3
    totals: dict[tuple[str, str], Row] = {}
    for key, host_ms, start, end in self._pending:
      row = totals.get(key) or totals.setdefault(key, Row(*key))
      row.calls += 1
      row.host_ms += host_ms
      row.device_ms += host_ms if start is None else start.elapsed_time(end)
    self.rows, self._pending = sorted(totals.values(), key=lambda r: -r.device_ms), []

  @contextmanager
  def _time(self, name: str, device: Device | None, inputs=()) -> Iterator[None]:
    """Time one kernel call (or a `record_function` region) of `name` on `device`'s clock."""
    start = end = None
    if device is not None and device.type == "cuda":
      from blutrain.backend.cuda.runtime import Event
      start, end = Event(enable_timing=True), Event(enable_timing=True)
      start.record()
    t0 = time.perf_counter()
    yield
    host_ms = (time.perf_counter() - t0) * 1e3
    if end is not None: end.record()
    self._pending.append(((name, _shapes(inputs) if self.by_shapes else ""), host_ms, start, end))

  def table(self, limit: int = 30) -> str:
    """The `limit` rows with the most device time, with their share of the profile's total device time."""
    total = sum(r.device_ms for r in self.rows) or 1.0
    lines = [f"{'op':<24} {'input shapes':<44} {'calls':>6} {'host ms':>9} {'device ms':>10} {'%':>6}"]
    for r in self.rows[:limit]:
      lines.append(f"{r.name:<24} {r.shapes[:44]:<44} {r.calls:>6} {r.host_ms:>9.2f} {r.device_ms:>10.2f} "
                   f"{100 * r.device_ms / total:>6.1f}")
    host = sum(r.host_ms for r in self.rows)
    lines.append(f"{'total':<24} {'':<44} {sum(r.calls for r in self.rows):>6} {host:>9.2f} {total:>10.2f} "
                 f"(wall {self.wall_ms:.2f} ms)")
    return "\n".join(lines)


def _shapes(inputs) -> str:
  return " ".join("-" if t is None else f"{t.dtype.name}{list(t.shape)}" for t in inputs)


@contextmanager
def record_function(name: str, device: Device | str | None = None) -> Iterator[None]:
  """Time the block as one row named `name` when a profile is active (a no-op otherwise); `device` says which
  device's clock to read (default: the host's)."""
  if hooks.profile is None:
    yield
    return
  with hooks.profile(name, None if device is None else to_device(device)): yield
