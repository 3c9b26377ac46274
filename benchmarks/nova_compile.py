"""Nova on the CPU: capture + compile time of a GPT-2 124M training step (cold and warm disk cache, each in a
fresh process), op counts before and after the passes, and per-step time of the compiled char-level training
step against eager. Writes benchmarks/results/nova_compile.json and prints rows for BENCHMARKS.md.

  python benchmarks/nova_compile.py [--preset gpt2] [--steps 20]
  python benchmarks/nova_compile.py --lstm 32,64,128,256   # compile time of issue #17's LSTM step per T, only
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


def lstm_once(T: int) -> dict:
  """In this process: the seconds (wall and CPU) of the first two calls of a compiled LSTM language model step
  (`resnet_lstm.lstm_lm`: 2 layers, hidden 64, vocab 100, B=2, AdamW) whose time loop of T steps is unrolled into the
  graph; each call captures and compiles (the first call's graph creates the optimizer's state)."""
  import blutrain as bt
  from benchmarks.resnet_lstm import lstm_lm
  bt.manual_seed(0)
  net = lstm_lm(bt.nn, 100, 64)
  opt = bt.optim.AdamW(net.parameters(), lr=1e-3)

  def step(x, y):
    logits = net(x)
    loss = bt.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss
  compiled = bt.compile(step)
  x = bt.from_numpy(np.random.default_rng(0).integers(0, 100, (2, T)))
  result = {"T": T}
  for call in ("first", "second"):
    t, cpu = time.perf_counter(), time.process_time()
    compiled(x, x).item()
    result[call] = {"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - cpu,
                    "timings": compiled.info["timings"]}
  return result


def _child(preset: str, cache: str, flag: str = "--child") -> dict:
  env = dict(os.environ, BLUTRAIN_CACHE_DIR=cache)
  out = subprocess.run([sys.executable, __file__, flag, preset], env=env, capture_output=True, text=True, check=True)
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
  ap.add_argument("--lstm", help="comma-separated sequence lengths: time the LSTM step's compiles instead")
  ap.add_argument("--child")
  ap.add_argument("--child-lstm", type=int)
  args = ap.parse_args()
  if args.child:
    print(json.dumps(compile_once(args.child)))
    return
  if args.child_lstm:
    print(json.dumps(lstm_once(args.child_lstm)))
    return
  if args.lstm:
    print("| T | first call: wall (CPU) s | second call: wall (CPU) s |\n| --- | --- | --- |")
    for T in args.lstm.split(","):
      with tempfile.TemporaryDirectory() as cache:
        r = _child(T, cache, "--child-lstm")
      print(f"| {T} | " + " | ".join(f"{r[c]['wall_s']:.2f} ({r[c]['cpu_s']:.2f})" for c in ("first", "second")) + " |",
            flush=True)
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
