"""Where the host time of one eager op goes: cProfile of many calls of `x + y`, `x.add_(1)` and `x.sum(-1)` on small
tensors, sorted by own time. The GPU runs ahead; what is printed is Python's share of each call.

  python benchmarks/host_profile.py [--device cuda] [--calls 20000] [--rows 25]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import blutrain as bt  # noqa: E402

CASES = {"x + y": lambda x, y: x + y, "x.add_(1)": lambda x, y: x.add_(1), "x.sum(-1)": lambda x, y: x.sum(-1)}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--device", default="cuda")
  ap.add_argument("--calls", type=int, default=20000)
  ap.add_argument("--rows", type=int, default=25)
  args = ap.parse_args()
  x, y = bt.randn(4096, device=args.device), bt.randn(4096, device=args.device)
  sync = bt.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
  for name, fn in CASES.items():
    for _ in range(200): fn(x, y)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.calls): fn(x, y)
    host_us = (time.perf_counter() - t0) / args.calls * 1e6
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls): fn(x, y)
    prof.disable()
    sync()
    print(f"\n### {name}: {host_us:.1f} us of host time per call (unprofiled)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.rows)


if __name__ == "__main__":
  main()
