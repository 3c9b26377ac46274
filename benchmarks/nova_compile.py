"""Nova on the CPU: capture + compile time of a GPT-2 124M training step (cold and warm disk cache, each in a
fresh process), op counts before and after the passes, and per-step time of the compiled char-level training
step against eager. Writes benchmarks/results/nova_compile.json and prints rows for BENCHMARKS.md.

  python benchmarks/nova_compile.py [--preset gpt2] [--steps 20]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def compile_once(preset: str) -> dict:
  """In this process: build the model, run the first call (its graph creates the optimizer's state), then time the
  capture of the steady step."""
  import blutrain as bt
  from blutrain.models import GPT, GPTConfig, PRESETS
  from blutrain.train import training_step
  bt.manual_seed(0)
  model = GPT(GPTConfig(**{**PRESETS[preset], "block_size": 64}))
  step = bt.compile(training_step(model, model.configure_optimizers(0.1, 6e-4)))

  x = bt.randint(model.config.vocab_size, (1, 64))
  step(x, x)  # the first call's graph: creates the optimizer's state
  t0 = time.perf_counter()
  step(x, x)
  info = dict(step.info, first_step_s=time.perf_counter() - t0, params=model.num_params(non_embedding=False))
  return {k: v for k, v in info.items() if k != "source"}


def _child(preset: str, cache: str) -> dict:
  env = dict(os.environ, BLUTRAIN_CACHE_DIR=cache)
  out = subprocess.run([sys.executable, __file__, "--child", preset], env=env, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def per_step(preset: str, steps: int, batch: int) -> dict:
  """Median step time of the char-level training step, eager and compiled, same weights and batches."""
  import blutrain as bt
  from blutrain.models import GPT, GPTConfig, PRESETS
  from blutrain.train import training_step

  def make():
    bt.manual_seed(0)
    model = GPT(GPTConfig(**{**PRESETS[preset], "vocab_size": 65}))
    return model, training_step(model, model.configure_optimizers(0.1, 1e-3, betas=(0.9, 0.99)))

  model, eager = make()
  _, compiled = make()
  compiled = bt.compile(compiled)
  rng = np.random.default_rng(0)
  T = model.config.block_size
  batches = [(bt.from_numpy(rng.integers(0, 65, (batch, T))), bt.from_numpy(rng.integers(0, 65, (batch, T))))
             for _ in range(steps + 3)]
  times = {}
  for name, fn in (("eager", eager), ("compiled", compiled)):
    for x, y in batches[:3]: fn(x, y).item()
    samples = []
    for x, y in batches[3:]:
      t0 = time.perf_counter()
      fn(x, y).item()
      samples.append(time.perf_counter() - t0)
    times[name] = statistics.median(samples)
  return {"preset": preset, "batch": batch, "block_size": T, "eager_ms": 1e3 * times["eager"],
          "compiled_ms": 1e3 * times["compiled"], "speedup": times["eager"] / times["compiled"]}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="gpt2")
  ap.add_argument("--step-preset", default="char-small")
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--child")
  args = ap.parse_args()
  if args.child:
    print(json.dumps(compile_once(args.child)))
    return
  import blutrain as bt
  with tempfile.TemporaryDirectory() as cache:
    cold = _child(args.preset, cache)
    warm = _child(args.preset, cache)
  steps = per_step(args.step_preset, args.steps, args.batch)
  before, after = cold.get("counts_before", {}), cold.get("counts_after", {})
  result = {"benchmark": "nova_compile", "date": date.today().isoformat(), "cpu_cores": os.cpu_count(),
            "versions": {"python": platform.python_version(), "numpy": np.__version__, "blutrain": bt.__version__},
            "preset": args.preset, "cold": cold, "warm": warm,
            "ops_before": sum(before.values()), "ops_after": sum(after.values()), "per_step": steps}
  out = ROOT / "benchmarks" / "results" / "nova_compile.json"
  out.parent.mkdir(exist_ok=True)
  out.write_text(json.dumps(result, indent=1))
  print(json.dumps({k: v for k, v in result.items() if k not in ("cold", "warm")}, indent=1))
  print(f"| {result['date']} | CPU {os.cpu_count()} cores | {args.preset} step: capture {cold['capture_s']:.2f} s, "
        f"capture + compile cold {cold['total_s']:.2f} s, warm {warm['total_s']:.2f} s ({warm['cache']}); "
        f"{cold['equations']} equations, ops {result['ops_before']} -> {result['ops_after']} | "
        f"`python benchmarks/nova_compile.py` |")
  print(f"| {result['date']} | CPU {os.cpu_count()} cores | {args.step_preset} B={args.batch} step: eager "
        f"{steps['eager_ms']:.1f} ms, compiled {steps['compiled_ms']:.1f} ms ({steps['speedup']:.2f}x) | "
        f"`python benchmarks/nova_compile.py` |")


if __name__ == "__main__":
  main()
