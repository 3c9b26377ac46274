"""Launch overhead on the GPU: microseconds per call of a tiny op (x.add_(1), x + y and x.sum(-1) on 1 and 4096
float32 elements) through blutrain's whole eager dispatch, through a raw launch of the same compiled Triton kernel
(`launch.compile(...)`, then `Kernel(grid, *args)`), through the driver's cuLaunchKernel alone with the arguments
packed once (by the C launcher that launches use, and through ctypes), and through PyTorch's eager ops. Per variant and trial: host time
per call to issue `--calls` back-to-back calls, the same until synchronized, and GPU time per call (500 calls queued
behind long copies, so that they run back to back). Medians of the trials; writes
benchmarks/results/launch_overhead.json and prints a markdown table.

  python benchmarks/launch_overhead.py [--calls 10000] [--trials 5] [--out PATH] [--device cpu (a dry run)]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import blutrain as bt  # noqa: E402
from benchmarks.common import ROOT, copy_pad, metadata, require_gpu, table, write  # noqa: E402

GPU_CALLS = 500  # calls timed on the GPU side: fewer than CUDA's launch queue holds, so the host never waits
RAW = "blutrain raw kernel launch (x + y)"
DRIVER = "cuLaunchKernel alone (the C launcher, arguments packed once)"
CTYPES = "cuLaunchKernel alone (ctypes, arguments packed once)"


def raw_add(x: bt.Tensor, y: bt.Tensor, out: bt.Tensor, via: str = ""):
  """out = x + y by the elementwise kernel the op library picks for contiguous float32 operands, launched directly
  (`Kernel.__call__`), or by the bare call of cuLaunchKernel with the arguments that call packed (what a launch costs
  below blutrain's Python), `via` the C launcher ("launcher") or ctypes ("ctypes")."""
  import ctypes
  from blutrain.backend.cuda import launch, launcher, runtime
  from blutrain.shapes import cdiv
  from blutrain.backend.cuda.kernels.elementwise import flat_spec
  n = x.numel()
  fn, signature, constexprs, options = flat_spec("add", x.dtype, (x.dtype, y.dtype), (False, False), n, True, False)
  kernel = launch.compile(fn, signature, constexprs, **options)
  grid, a, b, o = (cdiv(n, constexprs["BLOCK"]),), x._array(), y._array(), out._array()
  if not via: return lambda: kernel(grid, o, a, b, b, n)
  kernel(grid, o, a, b, b, n)
  _, _, head = kernel._launches[grid]
  cu_launch = runtime.launch_function() if via == "launcher" else \
    launcher.ctypes_launch(ctypes.PyDLL("libcuda.so.1").cuLaunchKernel)
  slots, stream = kernel._parameters(), runtime.launch_stream(None).handle
  kernel._pack(slots.slots, o, a, b, b, n)
  return lambda: cu_launch(head, stream, slots.address)


def measure(fn, calls: int, trials: int, event=None, sync=None, pad=None) -> dict:
  """Microseconds per call: issuing `calls` calls on the host, until they are synchronized, and on the GPU."""
  for _ in range(100): fn()
  sync()
  host, wall, gpu = [], [], []
  for _ in range(trials):
    t0 = time.perf_counter()
    for _ in range(calls): fn()
    t1 = time.perf_counter()
    sync()
    host.append((t1 - t0) / calls * 1e6)
    wall.append((time.perf_counter() - t0) / calls * 1e6)
    if event is None: continue
    pad(1.5 * GPU_CALLS * host[-1] / 1e3)
    s, e = event(enable_timing=True), event(enable_timing=True)
    s.record()
    for _ in range(GPU_CALLS): fn()
    e.record()
    sync()
    gpu.append(s.elapsed_time(e) / GPU_CALLS * 1e3)
  return {"host_us": statistics.median(host), "wall_us": statistics.median(wall),
          "gpu_us": statistics.median(gpu) if gpu else None}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--calls", type=int, default=10000)
  ap.add_argument("--trials", type=int, default=5)
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "launch_overhead.json"))
  ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
  args = ap.parse_args()
  require_gpu(args.device)
  gpu, dev = args.device == "cuda", args.device
  ours_clock = (bt.cuda.Event, bt.cuda.synchronize) if gpu else (None, lambda: None)
  torch_clock = (torch.cuda.Event, torch.cuda.synchronize) if gpu else (None, lambda: None)
  big = torch.randn((256 << 20) if gpu else 1024, device=dev)  # 1 GiB of float32 to pad with
  ours_pad = copy_pad(bt.from_dlpack(big).clone(), bt.empty(big.numel(), device=dev), 5, *ours_clock)[1]
  torch_pad = copy_pad(big, torch.empty_like(big), 5, *torch_clock)[1]
  result, rows = {**metadata("launch_overhead", dev), "calls": args.calls, "trials": args.trials,
                  "gpu_calls": GPU_CALLS, "runs": {}}, []
  for n in (1, 4096):
    tx, ty = torch.rand(n, device=dev) + 1, torch.rand(n, device=dev) + 1
    if gpu: torch.cuda.synchronize()
    x, y, out = bt.from_dlpack(tx).clone(), bt.from_dlpack(ty).clone(), bt.empty(n, device=dev)
    variants = {"blutrain eager x.add_(1)": (lambda: x.add_(1), ours_clock, ours_pad),
                "blutrain eager x + y": (lambda: x + y, ours_clock, ours_pad),
                "blutrain eager x.sum(-1)": (lambda: x.sum(-1), ours_clock, ours_pad),
                "torch x.add_(1)": (lambda: tx.add_(1), torch_clock, torch_pad),
                "torch x + y": (lambda: tx + ty, torch_clock, torch_pad),
                "torch x.sum(-1)": (lambda: tx.sum(-1), torch_clock, torch_pad)}
    if gpu:  # made below, where a failure is caught
      variants[RAW] = variants[DRIVER] = variants[CTYPES] = (None, ours_clock, ours_pad)
    for name, (fn, clock, pad) in variants.items():
      try:
        via = {DRIVER: "launcher", CTYPES: "ctypes"}.get(name, "")
        r = measure(fn or raw_add(x, y, out, via), args.calls, args.trials, *clock, pad)
        if name in (RAW, DRIVER, CTYPES):  # x is no longer changed: out must hold the last x + y
          bt.cuda.synchronize()
          r["correct"] = torch.equal(torch.from_dlpack(out), torch.from_dlpack(x) + torch.from_dlpack(y))
      except Exception as e:  # a failed variant is reported, not hidden
        r = {"error": f"{type(e).__name__}: {e}"}
      result["runs"][f"{name} n={n}"] = r
      print(name, n, r, flush=True)
      rows.append([name, n, r.get("host_us"), r.get("wall_us"), r.get("gpu_us"),
                   r.get("error") or ("" if r.get("correct", True) else "**out != x + y**")])
  write(result, args.out)
  print(f"\n{result['gpu']}, {result['date']}; microseconds per call, median of {args.trials} trials of "
        f"{args.calls} calls (GPU: {GPU_CALLS} calls queued back to back)\n")
  table(["variant", "elements", "host us/call (issue)", "us/call until synced", "GPU us/call", "note"], rows)


if __name__ == "__main__":
  main()
