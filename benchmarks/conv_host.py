"""Host microseconds per channels-last bf16 convolution call on the GPU: blutrain's cuDNN conv kernel
(`cudnn_conv.conv`: plan lookup, output and workspace from the allocator, execute), the frontend's `execute` of the same
built graph alone (its Python wrapper, and the C++ method under it), and PyTorch's conv2d. Calls of a large problem
queue behind the GPU (the figure is then its GPU time); the small one shows the host's cost. Writes
benchmarks/results/conv_host.json.

  python benchmarks/conv_host.py [--calls 1000] [--trials 3] [--out PATH]
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
from benchmarks.common import ROOT, metadata, require_gpu, table, write  # noqa: E402

PROBLEMS = [(128, 64, 56, 64, 3), (128, 256, 14, 256, 3), (32, 64, 56, 64, 3)]  # N, C, H = W, K, R = S (padding 1)


def per_call(fn, calls: int, trials: int) -> tuple[float, float]:
  """Best and median host microseconds per call over the trials."""
  for _ in range(50): fn()
  times = []
  for _ in range(trials):
    t0 = time.perf_counter()
    for _ in range(calls): fn()
    times.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize(); bt.cuda.synchronize()
  return min(times), statistics.median(times)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--calls", type=int, default=1000)
  ap.add_argument("--trials", type=int, default=3)
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "conv_host.json"))
  args = ap.parse_args()
  require_gpu("cuda")
  from blutrain.backend.cuda.kernels import cudnn_conv as cc
  result, rows = {**metadata("conv_host", "cuda"), "calls": args.calls, "trials": args.trials, "runs": {}}, []
  for n, c, hw, k, r in PROBLEMS:
    tx = torch.randn(n, c, hw, hw, device="cuda").bfloat16().to(memory_format=torch.channels_last)
    tw = torch.randn(k, c, r, r, device="cuda").bfloat16().to(memory_format=torch.channels_last)
    xa, wa = bt.from_dlpack(tx)._array(), bt.from_dlpack(tw)._array()
    geometry = ((1, 1), (1, 1), (1, 1))
    out = cc.conv(xa, wa, *geometry)
    g, uids, ws_bytes = cc._graph("fwd", xa.dtype, *(cc._as4d(t.shape, t.strides) for t in (xa, wa, out)), *geometry,
                                  out.device)
    h, ws = cc._handle(out.device), bt.empty(max(ws_bytes, 1), dtype=bt.uint8, device="cuda")._array()
    pointers = {uids[0]: xa.ptr, uids[1]: wa.ptr, uids[2]: out.ptr}
    variants = {"blutrain cuDNN conv kernel": lambda: cc.conv(xa, wa, *geometry),
                "frontend execute (Python wrapper)": lambda: g.execute(pointers, ws.ptr, h),
                "frontend _execute (its C++ method)": lambda: g._execute(pointers, ws.ptr, h),
                "torch conv2d": lambda: torch.nn.functional.conv2d(tx, tw, padding=1)}
    problem = f"{n}x{c}x{hw}x{hw} * {k}x{c}x{r}x{r}"
    for name, fn in variants.items():
      best, median = per_call(fn, args.calls, args.trials)
      result["runs"][f"{problem} {name}"] = {"host_us_best": best, "host_us_median": median}
      rows.append([problem, name, round(best, 1), round(median, 1)])
  write(result, args.out)
  table(["problem (channels-last bf16)", "variant", "host us/call (best)", "median"], rows)


if __name__ == "__main__":
  main()
