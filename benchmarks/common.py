"""Shared by the GPU kernel benchmarks: the no-GPU message, timing (median GPU time of event-timed calls and host time
per call), the run's metadata, the results file and the markdown table."""
from __future__ import annotations

import json
import math
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOMINAL_COPY_GBPS = 4300.0  # H200 device-to-device copy, the anchor in DESIGN.md
PAD_COPIES = 400            # at most this many copies queued ahead (CUDA's launch queue holds about a thousand)
SLEEP_CYCLES = 300_000_000  # a sleep kernel of ~150 ms at the H200's 1.98 GHz, for `host_and_gpu_ms`


def require_gpu(device: str) -> None:
  """Exit with the reason when `device` is "cuda" and blutrain or torch cannot use a GPU."""
  if device != "cuda": return
  import torch
  from blutrain.backend.cuda import runtime
  if not runtime.is_available():
    sys.exit(f"no usable NVIDIA GPU for blutrain ({runtime.unavailable_reason()}); run on a GPU machine, "
             f"or pass --device cpu for a small dry run of the script itself")
  if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no GPU (a CPU-only build?); install a CUDA build of torch to compare")


def time_calls(fn, repeats: int, event=None, sync=None, pad=None) -> dict:
  """Milliseconds per call of fn: {"ms": median GPU time between CUDA events around each call (wall time on the
  CPU, event=None), "host_ms": the host's time to issue one call}. A first call compiles and allocates, three more
  warm up; then `pad(ms)` queues that much GPU work, so the host runs ahead and its dispatch gaps between calls do
  not count as GPU time."""
  fn()
  if sync: sync()
  t0 = time.perf_counter()
  for _ in range(3): fn()
  host = (time.perf_counter() - t0) / 3 * 1e3
  if event is None:
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      fn()
      times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": statistics.median(times), "host_ms": statistics.median(times)}
  sync()
  if pad: pad(1.5 * repeats * host)
  events = [(event(enable_timing=True), event(enable_timing=True)) for _ in range(repeats)]
  t0 = time.perf_counter()
  for s, e in events:
    s.record()
    fn()
    e.record()
  host = (time.perf_counter() - t0) / repeats * 1e3
  sync()
  return {"ms": statistics.median(s.elapsed_time(e) for s, e in events), "host_ms": host}


def copy_pad(src, dst, repeats: int, event=None, sync=None) -> tuple[dict, object]:
  """Time `dst.copy_(src)` (a device-to-device copy: the bandwidth ceiling) and return (its timing, pad), where
  pad(ms) queues about ms of such copies (time_calls' pad)."""
  t = time_calls(lambda: dst.copy_(src), repeats, event, sync)

  def pad(ms: float) -> None:
    for _ in range(min(PAD_COPIES, math.ceil(ms / t["ms"]))): dst.copy_(src)
  return t, pad


def copy_ceiling(repeats: int) -> tuple[float, object]:
  """(GB/s of a 512 MiB device-to-device copy on blutrain's GPU, its `copy_pad`'s pad): the bandwidth the memory-bound
  kernel benchmarks report their kernels against, timed with blutrain's events."""
  import blutrain as bt
  src, dst = bt.randn(1 << 27, device="cuda"), bt.empty(1 << 27, device="cuda")
  copy, pad = copy_pad(src, dst, repeats, bt.cuda.Event, bt.cuda.synchronize)
  return 2 * src.numel() * src.element_size() / copy["ms"] / 1e6, pad


def _two(a, b): return a


def host_speed_us(calls: int = 100, reps: int = 200, trials: int = 5) -> float:
  """Microseconds this host takes now for `calls` calls of a two-argument Python function (the best of `trials`
  timings of `reps` rounds): the speed of its Python, which a host-bound eager step moves with. Lent machines differ
  by 2-3x and have slow stretches of minutes, so a benchmark records it beside each run to tell a slow host from a
  slow change (2.0-2.1 us on the 2-core development machine, 2026-12-03)."""
  best = math.inf
  for _ in range(trials):
    t0 = time.perf_counter()
    for _ in range(reps):
      for _ in range(calls // 10):
        _two(1, 2); _two(1, 2); _two(1, 2); _two(1, 2); _two(1, 2); _two(1, 2); _two(1, 2); _two(1, 2); _two(1, 2)
        _two(1, 2)
    best = min(best, (time.perf_counter() - t0) / reps * 1e6)
  return best


def host_and_gpu_ms(framework: str, step, steps: int = 3) -> dict:
  """A CUDA step's host time and GPU time apart, in ms per step: `enqueue_ms`, the wall time of queuing `steps` steps
  with no sync (the host's work; a host-bound step's GPU waits on it), and `gpu_ms`, the GPU time of `steps` steps
  queued behind a sleep kernel (~150 ms), so that the GPU runs them back to back whatever the host's speed (timed by
  events on the framework's stream, which waits for PyTorch's sleep). `step()` queues one step. Exact while the steps'
  launches fit CUDA's launch queue (about a thousand: a ResNet-18 step makes ~1,000); past that the host waits for
  room and `gpu_ms` is an upper bound."""
  import torch
  import blutrain as bt
  from cuda.bindings import driver
  bt.cuda.synchronize(); torch.cuda.synchronize()
  t0 = time.perf_counter()
  for _ in range(steps): step()
  enqueue = (time.perf_counter() - t0) / steps * 1e3
  bt.cuda.synchronize(); torch.cuda.synchronize()
  torch.cuda._sleep(SLEEP_CYCLES)
  slept = torch.cuda.Event()
  slept.record()
  if framework == "blutrain":
    (err,) = driver.cuStreamWaitEvent(driver.CUstream(bt.cuda.current_stream().handle), driver.CUevent(slept.cuda_event),
                                      0)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    start, end = bt.cuda.Event(enable_timing=True), bt.cuda.Event(enable_timing=True)
  else: start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  start.record()
  for _ in range(steps): step()
  end.record()
  bt.cuda.synchronize(); torch.cuda.synchronize()
  return {"enqueue_ms": enqueue, "gpu_ms": start.elapsed_time(end) / steps}


def metadata(benchmark: str, device: str) -> dict:
  """Date, device name and versions, the head of every results file."""
  import numpy as np
  import torch
  import triton
  import blutrain as bt
  name = bt.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
  return {"benchmark": benchmark, "date": date.today().isoformat(), "device": device, "gpu": name,
          "versions": {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                       "blutrain": bt.__version__, "numpy": np.__version__}}


def write(result: dict, out: str) -> None:
  Path(out).parent.mkdir(parents=True, exist_ok=True)
  Path(out).write_text(json.dumps(result, indent=1))
  print(f"wrote {out}", flush=True)


def table(header: list[str], rows: list[list]) -> None:
  """Print a markdown table: floats to 3 significant digits (whole numbers from 100 up), None as a dash."""
  def cell(v):
    if v is None: return "-"
    if isinstance(v, float): return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)
  print("| " + " | ".join(header) + " |")
  print("|" + "---|" * len(header))
  for r in rows: print("| " + " | ".join(cell(v) for v in r) + " |")


def spread(repeats: dict, pairs: tuple, ratio) -> None:
  """Print each pair's ratio round by round (repeated runs interleave), with the host's Python speed measured before
  each of our runs (`host_speed_us`): a host-bound step's ratio moves with it. `repeats` maps "run/rest of the key"
  to a list of per-round results (dicts with "host_us"), `pairs` are (ours, reference) run names, `ratio(ours, ref)`
  a round's ratio (higher: ours faster)."""
  for ours, ref in pairs:
    for key in [k for k in repeats if k.startswith(ours + "/")]:
      a, b = repeats[key], repeats.get(ref + key[len(ours):], [])
      rounds = [(ratio(x, y), x["host_us"][0]) for x, y in zip(a, b) if "host_us" in x and "host_us" in y]
      if not rounds: continue
      ratios = sorted(r for r, _ in rounds)
      print(f"{key} / {ref}: ratio median {statistics.median(ratios):.2f}, min {ratios[0]:.2f}, max {ratios[-1]:.2f} "
            f"over {len(ratios)} rounds; per round (ratio, host us): " +
            ", ".join(f"({r:.2f}, {h:.1f})" for r, h in rounds))
