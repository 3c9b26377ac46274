"""A compiled step's memory budget: the size a user writes, and the budget the step is planned under."""
from __future__ import annotations

import re


def parse_size(size: int | str) -> int:
  """Bytes from an int or a string such as "10GiB", "512 MiB", "1.5GB" or "4096"."""
  if isinstance(size, bool) or not isinstance(size, (int, str)):
    raise TypeError(f"memory_budget: expected bytes (int) or a size such as '10GiB', got {type(size).__name__}")
  if isinstance(size, int):
    if size < 0: raise ValueError(f"memory_budget: expected a size >= 0, got {size}")
    return size
  units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
           "gib": 2**30, "tib": 2**40}
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", size)
  if m is None or m.group(2).lower() not in units:
    raise ValueError(f"memory_budget: cannot read {size!r}; write bytes or a number and a unit, such as '10GiB' or "
                     "'512MB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
  return int(float(m.group(1)) * units[m.group(2).lower()])


def step_budget(memory_budget: int | str | None, device, held: int = 0) -> int | None:
  """The budget a compiled step is planned under: `memory_budget` (bytes or a size string), or on a CUDA device the
  limit set by `bt.cuda.set_memory_limit`, less the `held` bytes under it that are not the step's (see
  `jit.held_outside`), when that is lower (or the only one set)."""
  budget = None if memory_budget is None else parse_size(memory_budget)
  if device is not None and device.type == "cuda":
    from blutrain.backend.cuda import runtime
    limit = runtime.state(device.index).allocator.limit
    if limit is not None: budget = max(limit - held, 0) if budget is None else min(budget, max(limit - held, 0))
  return budget
