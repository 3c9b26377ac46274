"""GPT-2 124M training on one GPU: blutrain eager and compiled (Nova's GPU target) vs PyTorch eager and
torch.compile, same weights, same batches, fused AdamW, in fp32 (no TF32), TF32 and bf16 autocast. Reports tokens/s,
peak memory, first-step time and ratios; writes benchmarks/results/train_gpt2.json.

  python benchmarks/train_gpt2.py [--batch 16] [--block 1024] [--steps 10] [--precisions fp32,tf32,bf16]
                                  [--order torch_eager,blutrain_eager,blutrain_compile,torch_compile]

A compiled run's peak is measured over its timed steps (after the warm-up, which for blutrain holds the first call's
graph, which creates the optimizer's state, and the capture of the steady one): the caching allocator's peak (which holds the CUDA graph's arena) plus the memory of the
graph's private caching allocator.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _timed(step, batches, warmup: int, sync, after_warmup=lambda: None) -> dict:
  """Run `step` (returning the loss as a device scalar) over the batches. Per step: the wall time until the loss is
  on the host, and the host's enqueue time until `step` returned; when the two are close the GPU waited on Python."""
  gc.collect()
  gc.freeze()  # for every run alike: full collections scan only what the steps make, as in `blutrain train`
  t0 = time.perf_counter()
  first_loss = float(step(*batches[0]).item())
  sync()
  first = time.perf_counter() - t0
  for b in batches[1:warmup]: step(*b).item()
  sync()
  after_warmup()
  times, enqueue, losses = [], [], [first_loss]
  for b in batches[warmup:]:
    t0 = time.perf_counter()
    loss = step(*b)
    t1 = time.perf_counter()
    losses.append(float(loss.item()))
    sync()
    times.append(time.perf_counter() - t0)
    enqueue.append(t1 - t0)
  gc.unfreeze()
  return {"first_step_s": first, "step_s": statistics.median(times), "step_times_s": times,
          "enqueue_s": statistics.median(enqueue), "enqueue_times_s": enqueue, "losses": losses}


def run_blutrain(cfg, state, batches, precision: str, warmup: int, compiled: bool = False) -> dict:
  import blutrain as bt
  from blutrain.models import GPT
  from blutrain.train import training_step
  bt.set_float32_matmul_precision("highest" if precision == "fp32" else "high")
  model = GPT(cfg)
  model.load_state_dict({k: bt.from_numpy(v) for k, v in state.items()})
  model.to("cuda")
  step = training_step(model, model.configure_optimizers(0.1, 6e-4, betas=(0.9, 0.95), fused=True))
  if compiled: step = bt.compile(step)
  ctx = (lambda: bt.autocast(device_type="cuda", dtype=bt.bfloat16)) if precision == "bf16" else contextlib.nullcontext

  def one(x, y):
    with ctx(): return step(x, y)
  dev = [(bt.from_numpy(x).to("cuda"), bt.from_numpy(y).to("cuda")) for x, y in batches]
  bt.cuda.synchronize()
  bt.cuda.reset_peak_memory_stats()
  held = {}

  def after_warmup():  # what the timed steps start from: parameters, gradients, optimizer state, batches
    bt.cuda.reset_peak_memory_stats()
    held["bytes"] = bt.cuda.memory_allocated()
  out = _timed(one, dev, warmup, bt.cuda.synchronize, after_warmup if compiled else lambda: None)
  out["peak_bytes"] = bt.cuda.max_memory_allocated()
  if compiled:
    out["held_at_start_bytes"] = held["bytes"]
    out["graph_pool_bytes"] = step.info.get("graph_pool_bytes", 0)
    out["peak_bytes"] += out["graph_pool_bytes"]
    out["nova"] = {k: v for k, v in step.info.items()
                   if k in ("cuda_graph", "graph_nodes", "graph_arena_bytes", "total_s", "equations", "memory_budget",
                            "planned_peak", "gemms_path")}
  del model, step, dev
  gc.collect()
  bt.cuda.empty_cache()
  return out


def run_torch(cfg, state, batches, precision: str, warmup: int, compiled: bool) -> dict:
  import torch
  from benchmarks.torch_gpt import GPT as TorchGPT, training_step
  torch.backends.cuda.matmul.allow_tf32 = precision != "fp32"
  torch.backends.cudnn.allow_tf32 = precision != "fp32"
  model = TorchGPT(cfg).cuda()
  with torch.no_grad():
    for name, p in model.state_dict().items(): p.copy_(torch.from_numpy(state[name]))
  step = training_step(model, model.configure_optimizers(0.1, 6e-4, betas=(0.9, 0.95), fused=True), precision)
  fn = torch.compile(step) if compiled else step
  dev = [(torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()) for x, y in batches]
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  out = _timed(fn, dev, warmup, torch.cuda.synchronize, torch.cuda.reset_peak_memory_stats if compiled else lambda: None)
  out["peak_bytes"] = torch.cuda.max_memory_allocated()
  del model, step, fn, dev
  gc.collect()
  torch.cuda.empty_cache()
  return out


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--block", type=int, default=1024)
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--precisions", default="fp32,tf32,bf16")
  ap.add_argument("--torch-compile", action="store_true")
  ap.add_argument("--order", default="torch_eager,blutrain_eager", help="which runs, in which order")
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_gpt2.json"))
  args = ap.parse_args()

  import torch
  import blutrain as bt
  from blutrain.models import GPT, GPTConfig
  cfg = GPTConfig(block_size=args.block)
  bt.manual_seed(0)
  state = {k: v.detach().numpy().copy() for k, v in GPT(cfg).state_dict().items()}
  rng = np.random.default_rng(0)
  batches = [(rng.integers(0, 50257, (args.batch, args.block)), rng.integers(0, 50257, (args.batch, args.block)))
             for _ in range(args.warmup + args.steps)]
  tokens = args.batch * args.block
  rows, result = [], {"benchmark": "train_gpt2", "date": date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                      "batch": args.batch, "block": args.block, "steps": args.steps,
                      "versions": {"python": platform.python_version(), "torch": torch.__version__,
                                   "blutrain": bt.__version__, "numpy": np.__version__}, "runs": {}}
  for precision in args.precisions.split(","):
    runs = {"torch_eager": lambda: run_torch(cfg, state, batches, precision, args.warmup, False),
            "blutrain_eager": lambda: run_blutrain(cfg, state, batches, precision, args.warmup),
            "blutrain_compile": lambda: run_blutrain(cfg, state, batches, precision, args.warmup, True),
            "torch_compile": lambda: run_torch(cfg, state, batches, precision, args.warmup, True)}
    order = args.order.split(",") + (["torch_compile"] if args.torch_compile else [])
    for name, fn in ((n, runs[n]) for n in order):
      try:
        r = fn()
        r["tokens_per_s"] = tokens / r["step_s"]
      except Exception as e:  # a failed run is reported, not hidden
        r = {"error": f"{type(e).__name__}: {e}"}
      result["runs"][f"{name}/{precision}"] = r
      print(name, precision, {k: [round(t * 1e3, 1) for t in v] if k.endswith("times_s") else v for k, v in r.items()
                              if k != "losses"}, flush=True)
    ref, ours = result["runs"].get(f"torch_eager/{precision}", {}), result["runs"].get(f"blutrain_eager/{precision}", {})
    if ref and ours and "error" not in ref and "error" not in ours:
      rows.append((precision, ours["tokens_per_s"], ref["tokens_per_s"], ours["tokens_per_s"] / ref["tokens_per_s"],
                   ours["peak_bytes"] / 2**30, ref["peak_bytes"] / 2**30, ours["step_s"] * 1e3,
                   ours["enqueue_s"] * 1e3, ours["first_step_s"],
                   max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"]))))
  Path(args.out).parent.mkdir(exist_ok=True)
  Path(args.out).write_text(json.dumps(result, indent=1))
  print("| precision | blutrain tok/s | torch eager tok/s | ratio | blutrain peak GiB | torch peak GiB "
        "| blutrain step ms | of which host enqueue ms | blutrain first step s | max loss diff |")
  for r in rows: print("| {} | {:,.0f} | {:,.0f} | {:.2f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.2e} |".format(*r))
  print("| precision | blutrain compiled tok/s | torch.compile tok/s | ratio | blutrain compiled peak GiB "
        "| torch.compile peak GiB | blutrain compiled step ms | of which host enqueue ms | first compiled step s |")
  for precision in args.precisions.split(","):
    ours, ref = (result["runs"].get(f"{n}/{precision}", {}) for n in ("blutrain_compile", "torch_compile"))
    if "tokens_per_s" in ours and "tokens_per_s" in ref:
      print("| {} | {:,.0f} | {:,.0f} | {:.2f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} |".format(
        precision, ours["tokens_per_s"], ref["tokens_per_s"], ours["tokens_per_s"] / ref["tokens_per_s"],
        ours["peak_bytes"] / 2**30, ref["peak_bytes"] / 2**30, ours["step_s"] * 1e3, ours["enqueue_s"] * 1e3,
        ours["first_step_s"]))


if __name__ == "__main__":
  main()
