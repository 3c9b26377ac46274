"""Where a compiled GPT-2 124M bf16 training step's wall time goes beyond its CUDA graph, and what its first call
costs (B=16, T=1024, fused AdamW, as benchmarks/train_gpt2.py builds the step).

  python benchmarks/step_gaps.py gaps [--out FILE]     per step, medians: a step with its loss read (`.item()`),
      steps back to back, the graph replayed back to back (no host work between), a replay and a synchronize, the
      replay's launch call alone, the step's host enqueue and its parts (guard, bind, run, deliver)
  python benchmarks/step_gaps.py first [--cold] [--profile]    the first call's seconds, the second's and the
      third's: --cold in fresh, empty cache directories (blutrain's and Triton's), else with the caches as they are
      (run it twice for the warm figure: the second process finds the first's); with --profile, cProfile of the first

When the graph's back-to-back replays take as long as a step with its host work, the host is not what the step waits
for: the gap between the graph and the sum of its kernels (benchmarks/kernel_profile.py) is the GPU's own.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import blutrain as bt  # noqa: E402
from blutrain.models import GPT, GPTConfig  # noqa: E402
from blutrain.train import training_step  # noqa: E402


def _step():
  """The compiled step and a function running it on the i-th of four batches under bf16 autocast."""
  bt.set_float32_matmul_precision("high")
  model = GPT(GPTConfig()).to("cuda")
  opt = model.configure_optimizers(0.1, 6e-4, betas=(0.9, 0.95), fused=True)
  step = bt.compile(training_step(model, opt))
  rng = np.random.default_rng(0)
  batches = [tuple(bt.from_numpy(rng.integers(0, 50257, (16, 1024))).to("cuda") for _ in range(2)) for _ in range(4)]

  def one(i: int):
    for g in opt.param_groups: g["lr"] = 6e-4
    with bt.autocast(device_type="cuda", dtype=bt.bfloat16): return step(*batches[i % 4])
  bt.cuda.synchronize()
  return step, one


def first(profile: bool) -> None:
  step, one = _step()
  t0 = time.perf_counter()
  prof = cProfile.Profile() if profile else None
  if prof: prof.enable()
  one(0).item()
  if prof: prof.disable()
  print(f"first call {time.perf_counter() - t0:.3f} s",
        {k: v for k, v in step.info.items() if k in ("cache", "total_s", "compile_ahead", "capture_s", "hash_s")})
  for i, name in ((1, "second"), (2, "third")):
    t0 = time.perf_counter()
    one(i).item()
    print(f"{name} call {time.perf_counter() - t0:.3f} s")
  if prof:
    pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def _median_ms(fn, n: int) -> float:
  times = []
  for i in range(n):
    bt.cuda.synchronize()
    t0 = time.perf_counter()
    fn(i)
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3


def _per_call_ms(fn, n: int) -> float:
  bt.cuda.synchronize()
  t0 = time.perf_counter()
  for i in range(n): fn(i)
  bt.cuda.synchronize()
  return (time.perf_counter() - t0) / n * 1e3


def gaps(out: str | None) -> None:
  step, one = _step()
  for i in range(6): one(i).item()
  graph = next(iter(step._entries.values())).graph

  def replay_sync(_):
    graph.replay()
    bt.cuda.synchronize()
  res = {"step+item ms": _median_ms(lambda i: one(i).item(), 20),
         "steps back to back ms": _per_call_ms(one, 20),
         "graph replays back to back ms": _per_call_ms(lambda _: graph.replay(), 20),
         "replay+sync ms": _median_ms(replay_sync, 20),
         "replay call ms": _median_ms(lambda _: graph.replay(), 50)}
  parts: dict[str, list[float]] = {k: [] for k in ("guard", "bind", "run", "deliver")}
  enqueue = []
  for i in range(30):
    bt.cuda.synchronize()
    t0 = time.perf_counter()
    loss = one(i)
    enqueue.append(time.perf_counter() - t0)
    loss.item()
    for k in parts: parts[k].append(step.info["host_s"][k])
  res["enqueue ms"] = statistics.median(enqueue) * 1e3
  res.update({f"{k} ms": statistics.median(v) * 1e3 for k, v in parts.items()})
  res["graph nodes"] = step.info.get("graph_nodes")
  for k, v in res.items(): print(f"{k:32s} {v:8.3f}" if isinstance(v, float) else f"{k:32s} {v}")
  if out: Path(out).write_text(json.dumps(res, indent=1))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("mode", choices=("gaps", "first"))
  ap.add_argument("--profile", action="store_true", help="first: cProfile the first call")
  ap.add_argument("--cold", action="store_true", help="first: fresh, empty cache directories")
  ap.add_argument("--out", help="gaps: write the figures as JSON here")
  args = ap.parse_args()
  if args.cold:  # set before blutrain's first compile reads them (Triton reads its own when it first compiles)
    root = tempfile.mkdtemp(prefix="step_gaps_cold_")
    os.environ["BLUTRAIN_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"] = f"{root}/blutrain", f"{root}/triton"
  if args.mode == "first": first(args.profile)
  else: gaps(args.out)


if __name__ == "__main__":
  main()
