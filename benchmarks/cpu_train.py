"""Per-step time of the default CPU char-level GPT training step: blutrain eager vs PyTorch CPU eager, same
config, same weights, same batches, in one run. Writes benchmarks/results/cpu_train.json and prints a row
for BENCHMARKS.md.

  python benchmarks/cpu_train.py [--preset char-small] [--batch-size 32] [--steps 30] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _time_steps(step, steps: int, warmup: int = 3) -> list[float]:
  for _ in range(warmup): step()
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
  return times


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="char-small")
  ap.add_argument("--batch-size", type=int, default=32)
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--threads", type=int, default=os.cpu_count())
  args = ap.parse_args()

  import torch
  import blutrain as bt
  from blutrain.models import GPT, GPTConfig, PRESETS
  from blutrain.train import training_step
  from benchmarks.torch_gpt import GPT as TorchGPT, load_from_blutrain

  torch.set_num_threads(args.threads)
  cfg = GPTConfig(**{**PRESETS[args.preset], "vocab_size": 65})
  bt.manual_seed(0)
  model = GPT(cfg)
  tmodel = TorchGPT(cfg)
  load_from_blutrain(tmodel, model.state_dict())
  opt = model.configure_optimizers(0.1, 1e-3, betas=(0.9, 0.99))
  topt = tmodel.configure_optimizers(0.1, 1e-3, betas=(0.9, 0.99))
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, 65, (2, args.batch_size, cfg.block_size)) for _ in range(args.steps + 3)]
  it_bt, it_t = iter(batches), iter(batches)

  step = training_step(model, opt)

  def bt_step():
    xy = next(it_bt)
    return step(bt.from_numpy(xy[0]), bt.from_numpy(xy[1])).item()

  def torch_step():
    xy = next(it_t)
    _, loss = tmodel(torch.from_numpy(xy[0]), torch.from_numpy(xy[1]))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(tmodel.parameters(), 1.0)
    topt.step(); topt.zero_grad(set_to_none=True)
    return loss.item()

  t_bt = _time_steps(bt_step, args.steps)
  t_torch = _time_steps(torch_step, args.steps)
  med_bt, med_torch = statistics.median(t_bt), statistics.median(t_torch)
  tokens = args.batch_size * cfg.block_size
  result = {
    "benchmark": "cpu_train", "date": date.today().isoformat(), "preset": args.preset, "batch_size": args.batch_size,
    "block_size": cfg.block_size, "params": model.num_params(), "steps_timed": args.steps, "threads": args.threads,
    "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
    "versions": {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
                 "blutrain": bt.__version__},
    "blutrain_ms": 1e3 * med_bt, "torch_ms": 1e3 * med_torch, "ratio_blutrain_over_torch": med_bt / med_torch,
    "blutrain_tokens_per_s": tokens / med_bt, "torch_tokens_per_s": tokens / med_torch,
  }
  out = Path(__file__).parent / "results" / "cpu_train.json"
  out.parent.mkdir(exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  print(json.dumps(result, indent=1))
  print(f"| {result['date']} | CPU {result['cores']} cores, {args.threads} threads | {args.preset} B={args.batch_size} "
        f"T={cfg.block_size} | {result['blutrain_ms']:.1f} ms | {result['torch_ms']:.1f} ms | "
        f"{result['ratio_blutrain_over_torch']:.2f}x | numpy {np.__version__}, torch {torch.__version__} | "
        f"`python benchmarks/cpu_train.py` |")


if __name__ == "__main__":
  main()
