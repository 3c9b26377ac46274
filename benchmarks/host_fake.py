"""The eager host path on the fake GPU (tests/fakegpu/fake_cuda.py: the driver is faked, nothing computes, everything
on the host runs: allocator, launch planning, argument packing, autograd, autocast). Host microseconds per call of
`x + y`, `x.add_(1)` and `x.sum(-1)` (4096 float32 elements) and host milliseconds of a GPT-2 124M-shaped training
step (bf16 autocast or TF32; forward, backward, clipping, fused AdamW); medians and bests of the trials, with the Python
function calls of each (cProfile's count, which noise does not move). With --profile, the profiles by own time.
With --resnet, only the kernel launches of a ResNet-18 eager step with SGD (momentum, weight decay), its update per
parameter (fused=False) and multi-tensor (the default). With --resnet-step, the host time of a channels-last bf16
ResNet-18 eager step (batch 8, 64x64 images, SGD), its convolutions through a stand-in cuDNN frontend
(tests/fakegpu/fake_cudnn.py), as they run on the GPU: the step #17's eager benchmark measures, host side.
Runs on any machine, so a change to the host path can be measured without a GPU. Times are this thread's CPU time
(`time.thread_time`): nothing waits on a fake device, and CPU time is far less disturbed than wall-clock time by
other work on a shared machine; still, compare figures of one run.

  python benchmarks/host_fake.py [--calls 5000] [--trials 5] [--steps 3] [--layers 12] [--precision bf16|tf32]
                                 [--profile] [--rows 30] [--skip-step] [--resnet] [--resnet-step]
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "fakegpu"), str(ROOT)]
import fake_cuda  # noqa: E402

fake_cuda.install()
import numpy as np  # noqa: E402

import blutrain as bt  # noqa: E402
from blutrain.models import GPT, GPTConfig  # noqa: E402
from blutrain.train import training_step  # noqa: E402

CASES = {"x + y": lambda x, y: x + y, "x.add_(1)": lambda x, y: x.add_(1), "x.sum(-1)": lambda x, y: x.sum(-1)}


def per_call_us(fn, calls: int, trials: int) -> tuple[float, float]:
  """Median and best of the trials' host microseconds per call (other work on the machine only adds time, so the
  best is the steadier figure on a shared machine)."""
  for _ in range(200): fn()
  times = []
  for _ in range(trials):
    t0 = time.thread_time()
    for _ in range(calls): fn()
    times.append((time.thread_time() - t0) / calls * 1e6)
  return statistics.median(times), min(times)


def profiled(fn, calls: int, rows: int = 0) -> float:
  """Python function calls per call of fn, counted by cProfile over `calls` calls (each result dropped at once, as in
  the timing): a figure that noise does not move. With `rows`, the profile by own time is printed."""
  prof = cProfile.Profile()
  prof.enable()
  for _ in range(calls): fn()
  prof.disable()
  stats = pstats.Stats(prof)
  if rows: stats.sort_stats("tottime").print_stats(rows)
  return stats.total_calls / calls


def resnet_sgd_launches() -> None:
  """Launches of the third eager step of ResNet-18 (batch 8, 64x64 images): forward and backward, then opt.step(),
  with SGD's per-parameter update and with its multi-tensor op."""
  from benchmarks.resnet_lstm import resnet18
  for fused in (False, None):
    bt.manual_seed(0)
    model = resnet18(bt.nn).to("cuda")
    opt = bt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, fused=fused)
    x, y = bt.randn(8, 3, 64, 64).to("cuda"), bt.from_numpy(np.arange(8)).to("cuda")
    for _ in range(3):
      before = fake_cuda.launches[0]
      bt.nn.functional.cross_entropy(model(x), y).backward()
      backward = fake_cuda.launches[0]
      opt.step(); opt.zero_grad()
    print(f"ResNet-18 eager step, SGD fused={fused}: {fake_cuda.launches[0] - before} launches "
          f"(forward and backward {backward - before}, opt.step() {fake_cuda.launches[0] - backward})", flush=True)


def resnet_step_host(steps: int, trials: int, rows: int) -> None:
  """Host milliseconds of a channels-last bf16 ResNet-18 eager training step (forward, backward, SGD), its
  convolutions on the stand-in cuDNN frontend; medians and bests of `trials` runs of `steps` steps, after 8 steps (the
  caching allocator settles by the 7th)."""
  import gc
  import fake_cudnn
  from benchmarks.resnet_lstm import resnet18
  fake_cudnn.install()
  bt.manual_seed(0)
  cl = bt.channels_last
  model = resnet18(bt.nn, 10).to("cuda").to(memory_format=cl).train()
  opt = bt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
  x, y = bt.randn(8, 3, 64, 64).to("cuda").contiguous(memory_format=cl), bt.randint(10, (8,)).to("cuda")

  def one_step():
    with bt.autocast(device_type="cuda", dtype=bt.bfloat16):
      loss = bt.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
  for _ in range(8): one_step()
  gc.collect()
  times = []
  for _ in range(trials):
    t0 = time.thread_time()
    for _ in range(steps): one_step()
    times.append((time.thread_time() - t0) / steps * 1e3)
  before = fake_cuda.launches[0]
  n = profiled(one_step, 1, rows)
  print(f"bf16 channels-last ResNet-18 eager step (B=8, 64x64): {statistics.median(times):.2f} ms of host time "
        f"(median of {trials} runs of {steps}; best {min(times):.2f}), {n:,.0f} Python calls, "
        f"{fake_cuda.launches[0] - before} launches, {len(fake_cudnn.executed) // (9 + trials * steps)} cuDNN calls",
        flush=True)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--calls", type=int, default=5000)
  ap.add_argument("--trials", type=int, default=5)
  ap.add_argument("--steps", type=int, default=3, help="timed training steps (after 2 warm-up steps)")
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--block", type=int, default=1024)
  ap.add_argument("--profile", action="store_true", help="cProfile by own time")
  ap.add_argument("--rows", type=int, default=30)
  ap.add_argument("--precision", choices=("bf16", "tf32"), default="bf16", help="bf16 autocast, or float32 with TF32")
  ap.add_argument("--skip-step", action="store_true")
  ap.add_argument("--resnet", action="store_true", help="only the launches of a ResNet-18 step with SGD")
  ap.add_argument("--resnet-step", action="store_true", help="only the host time of a channels-last bf16 ResNet-18 "
                  "eager step (--trials runs of 30 steps)")
  args = ap.parse_args()
  if args.resnet: return resnet_sgd_launches()
  if args.resnet_step: return resnet_step_host(30, args.trials, args.rows if args.profile else 0)
  x, y = bt.randn(4096, device="cuda"), bt.randn(4096, device="cuda")
  for name, fn in CASES.items():
    us, best = per_call_us(lambda: fn(x, y), args.calls, args.trials)
    n = profiled(lambda: fn(x, y), args.calls, args.rows // 2 if args.profile else 0)
    print(f"{name:>10}: {us:6.2f} us of host time per call (best {best:.2f}), {n:.0f} Python calls", flush=True)
  if args.skip_step: return
  bt.manual_seed(0)
  bt.set_float32_matmul_precision("high")
  bf16 = args.precision == "bf16"
  autocast = bt.autocast(device_type="cuda", dtype=bt.bfloat16) if bf16 else contextlib.nullcontext()
  model = GPT(GPTConfig(block_size=args.block, n_layer=args.layers)).to("cuda")
  step = training_step(model, model.configure_optimizers(0.1, 6e-4, betas=(0.9, 0.95), fused=True))
  rng = np.random.default_rng(0)
  xb, yb = (bt.from_numpy(rng.integers(0, 50257, (args.batch, args.block))).to("cuda") for _ in range(2))

  def one_step():
    with autocast: step(xb, yb)
  for _ in range(2): one_step()
  times = []
  for _ in range(args.steps):
    t0 = time.thread_time()
    one_step()
    times.append((time.thread_time() - t0) * 1e3)
  before = fake_cuda.launches[0]
  n = profiled(one_step, 1, args.rows if args.profile else 0)
  print(f"{args.precision} GPT-2 step ({args.layers} layers, B={args.batch}, T={args.block}): "
        f"{statistics.median(times):.1f} ms of host time (median of {args.steps}; best {min(times):.1f}), "
        f"{n:,.0f} Python calls, "
        f"{fake_cuda.launches[0] - before} launches", flush=True)


if __name__ == "__main__":
  main()
