"""The data-parallel wrappers' host cost on the fake GPU: host milliseconds of a GPT-2 124M-shaped eager training step
(bf16 autocast or TF32; forward, backward, clipping, fused AdamW) plain, under DistributedDataParallel and with
ZeroRedundancyOptimizer stage 2, at world size 1 on the NCCL backend. The CUDA driver is tests/fakegpu/fake_cuda.py's
and nccl4py is tests/fakegpu/fake_nccl.py's (its calls read their buffers by DLPack, as nccl4py's do, and transfer
nothing), so everything blutrain does on the host runs: the hooks, the buckets, the events and the NCCL backend's
enqueueing. Times are this thread's CPU time (see benchmarks/host_fake.py); the modes alternate step by step, so the
machine's load moves them alike (after gc.freeze(), as ddp_overhead.py), and each reports the median and best of its steps with its Python calls (cProfile's
count, which noise does not move). With --profile, each wrapper's profile by own time.

  python benchmarks/ddp_host_fake.py [--steps 10] [--layers 12] [--precision bf16|tf32] [--profile] [--rows 30]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time

from host_fake import profiled  # installs the fake driver  # noqa: I001
import fake_nccl  # noqa: E402

fake_nccl.install()
import numpy as np  # noqa: E402

import blutrain as bt  # noqa: E402
import blutrain.distributed as dist  # noqa: E402
from blutrain.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from blutrain.models import GPT, GPTConfig  # noqa: E402
from blutrain.nn.parallel import DistributedDataParallel  # noqa: E402

MODES = ("plain", "ddp", "zero2")


def make_step(mode: str, cfg: GPTConfig, state: dict, autocast):
  """One training step of a fresh GPT with `state`'s weights under `mode`, as benchmarks/ddp_overhead.py runs it."""
  model = GPT(cfg)
  model.load_state_dict(state)
  model.to("cuda")
  if mode == "zero2":
    opt = ZeroRedundancyOptimizer(model.parameters(), bt.optim.AdamW, stage=2, lr=6e-4, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=True)
  else: opt = model.configure_optimizers(0.1, 6e-4, betas=(0.9, 0.95), fused=True)
  net = DistributedDataParallel(model) if mode == "ddp" else model

  def step(x, y):
    with autocast(): loss = net(x, y)[1]
    loss.backward()
    if mode == "zero2": opt.clip_grad_norm_(1.0)
    else: bt.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
  return step


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=10, help="timed steps per mode (after 2 warm-up steps)")
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--block", type=int, default=1024)
  ap.add_argument("--precision", choices=("bf16", "tf32"), default="bf16", help="bf16 autocast, or float32 with TF32")
  ap.add_argument("--profile", action="store_true", help="cProfile by own time of the wrappers' steps")
  ap.add_argument("--rows", type=int, default=30)
  args = ap.parse_args()
  dist.init_process_group("nccl", world_size=1, rank=0)
  bt.manual_seed(0)
  bt.set_float32_matmul_precision("high")
  cfg = GPTConfig(block_size=args.block, n_layer=args.layers)
  state = GPT(cfg).state_dict()
  autocast = (lambda: bt.autocast(device_type="cuda", dtype=bt.bfloat16)) if args.precision == "bf16" else \
    contextlib.nullcontext
  rng = np.random.default_rng(0)
  xb, yb = (bt.from_numpy(rng.integers(0, 50257, (args.batch, args.block))).to("cuda") for _ in range(2))
  steps = {mode: make_step(mode, cfg, state, autocast) for mode in MODES}
  for step in steps.values():
    for _ in range(2): step(xb, yb)
  gc.collect()
  gc.freeze()  # as benchmarks/ddp_overhead.py: the models' objects are not walked by the timed steps' collections
  times: dict[str, list[float]] = {mode: [] for mode in MODES}
  for _ in range(args.steps):
    for mode, step in steps.items():
      t0 = time.thread_time()
      step(xb, yb)
      times[mode].append((time.thread_time() - t0) * 1e3)
      fake_nccl.log.clear()
  print(f"{args.precision} GPT-2 step ({args.layers} layers, B={args.batch}, T={args.block}), world size 1, fake GPU "
        "and NCCL: host ms (median and best of the steps)")
  for mode, step in steps.items():
    before = len(fake_nccl.log)
    n = profiled(lambda: step(xb, yb), 1, args.rows if args.profile and mode != "plain" else 0)
    calls = [e[0] for e in fake_nccl.log[before:]]
    med, best = statistics.median(times[mode]), min(times[mode])
    base = min(times["plain"])
    print(f"{mode:>6}: {med:7.1f} ms (best {best:6.1f}, x{best / base:.3f} of plain's best), {n:,.0f} Python calls, "
          f"{len(calls)} NCCL calls ({', '.join(f'{calls.count(c)} {c}' for c in sorted(set(calls)))})", flush=True)


if __name__ == "__main__":
  main()
