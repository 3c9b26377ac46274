"""Where the host time of one eager op goes: cProfile of many calls of `x + y`, `x.add_(1)` and `x.sum(-1)` on small
tensors, sorted by own time. The GPU runs ahead; what is printed is Python's share of each call. With --resnet, the
same for whole eager ResNet-18 training steps (bf16 autocast, channels-last, SGD with momentum, as
benchmarks/resnet_lstm.py runs them), sorted by cumulative time: which layers of the op path carry a step's host time.

  python benchmarks/host_profile.py [--device cuda] [--calls 20000] [--rows 25]
  python benchmarks/host_profile.py --resnet [--batch 128] [--steps 10] [--rows 40]
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
  ap.add_argument("--resnet", action="store_true", help="profile eager ResNet-18 training steps instead")
  ap.add_argument("--batch", type=int, default=128)
  ap.add_argument("--steps", type=int, default=10)
  args = ap.parse_args()
  if args.resnet: return resnet(args)
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


def resnet(args) -> None:
  from benchmarks.resnet_lstm import resnet18
  bt.manual_seed(0)
  net = resnet18(bt.nn).to(args.device).train().to(memory_format=bt.channels_last)
  opt = bt.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
  x = bt.randn(args.batch, 3, 224, 224, device=args.device).contiguous(memory_format=bt.channels_last)
  y = bt.randint(1000, (args.batch,)).to(args.device)

  def step():
    with bt.autocast(device_type=args.device, dtype=bt.bfloat16):
      loss = bt.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss
  for _ in range(3): step().item()
  prof = cProfile.Profile()
  t0 = time.perf_counter()
  prof.enable()
  for _ in range(args.steps): step()
  prof.disable()
  step().item()
  print(f"\n### eager ResNet-18 (batch {args.batch}): {(time.perf_counter() - t0) / (args.steps + 1) * 1e3:.1f} ms a "
        f"step, profiled")
  pstats.Stats(prof).sort_stats("cumulative").print_stats(args.rows)
  pstats.Stats(prof).sort_stats("tottime").print_stats(args.rows)


if __name__ == "__main__":
  main()
