"""Where a GPT training step's time goes, op by op (bt.profiler): one table per precision. With --python, where its
host time goes instead: cProfile of a few steps, by own time per function.

  python benchmarks/profile_step.py [--device cuda] [--batch 16] [--block 1024] [--precisions tf32,bf16] [--rows 25]
                                    [--python]
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import time

import numpy as np

import blutrain as bt
from blutrain.models import GPT, GPTConfig
from blutrain.train import training_step


def profile(device: str, batch: int, block: int, precision: str, rows: int, layers: int, python: bool = False) -> None:
  bt.set_float32_matmul_precision("highest" if precision == "fp32" else "high")
  bt.manual_seed(0)
  model = GPT(GPTConfig(block_size=block, n_layer=layers)).to(device)
  step = training_step(model, model.configure_optimizers(0.1, 6e-4, betas=(0.9, 0.95), fused=device == "cuda"))
  autocast = bt.autocast(device_type=device, dtype=bt.bfloat16) if precision == "bf16" else contextlib.nullcontext()
  rng = np.random.default_rng(0)
  x, y = (bt.from_numpy(rng.integers(0, 50257, (batch, block))).to(device) for _ in range(2))
  sync = bt.cuda.synchronize if device == "cuda" else (lambda: None)
  for _ in range(3):
    with autocast: step(x, y).item()
  sync()
  t0 = time.perf_counter()
  with autocast: step(x, y).item()
  sync()
  plain_ms = (time.perf_counter() - t0) * 1e3
  if python:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
      with autocast: step(x, y)
    prof.disable()
    sync()
    print(f"\n## {precision}: unprofiled step {plain_ms:.1f} ms; host time of 3 steps by function")
    pstats.Stats(prof).sort_stats("tottime").print_stats(rows)
    return
  with bt.profiler.profile() as prof:
    with autocast: step(x, y).item()
  print(f"\n## {precision}: unprofiled step {plain_ms:.1f} ms ({batch * block / plain_ms * 1e3:,.0f} tok/s)")
  print(prof.table(rows), flush=True)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--device", default="cuda")
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--block", type=int, default=1024)
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--precisions", default="tf32,bf16")
  ap.add_argument("--rows", type=int, default=25)
  ap.add_argument("--python", action="store_true", help="cProfile the host instead of timing ops")
  args = ap.parse_args()
  for precision in args.precisions.split(","):
    profile(args.device, args.batch, args.block, precision, args.rows, args.layers, args.python)


if __name__ == "__main__":
  main()
