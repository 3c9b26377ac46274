"""The cost of the data-parallel wrappers at world size 1: GPT-2 124M (B=16, T=1024) training steps, plain vs
DistributedDataParallel vs ZeroRedundancyOptimizer stage 2, in TF32 and bf16 autocast, same weights and batches, in one
run on one GPU over NCCL. Also counts the DDP all-reduces and ZeRO-2 reduce-scatters enqueued while backward was still
running (all of them, when the buckets overlap the backward). With --compile every step is compiled by Nova (one CUDA
graph, the bucket collectives as ops inside it) and the count is of the collectives in the compiled step. Writes
benchmarks/results/ddp_overhead.json (ddp_overhead_compiled.json with --compile).

  NCCL_NVLS_ENABLE=0 python benchmarks/ddp_overhead.py [--steps 20] [--precisions tf32,bf16] [--compile]
  python benchmarks/ddp_overhead.py --quick      # a tiny GPT on the CPU over MPI: checks that the script runs
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


def run(mode: str, cfg, state, batches, precision: str, device: str, warmup: int, compiled: bool) -> dict:
  import blutrain as bt
  import blutrain.distributed as dist
  from blutrain.distributed.optim import ZeroRedundancyOptimizer
  from blutrain.models import GPT
  from blutrain.nn.parallel import DistributedDataParallel
  bt.set_float32_matmul_precision("highest" if precision == "fp32" else "high")
  model = GPT(cfg)
  model.load_state_dict({k: bt.from_numpy(v) for k, v in state.items()})
  model.to(device)
  fused = device == "cuda"
  if mode == "zero2":
    opt = ZeroRedundancyOptimizer(model.parameters(), bt.optim.AdamW, stage=2, lr=6e-4, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=fused)
  else:
    opt = model.configure_optimizers(0.1, 6e-4, betas=(0.9, 0.95), fused=fused)
  net = DistributedDataParallel(model) if mode == "ddp" else model
  ctx = (lambda: bt.autocast(device_type=device, dtype=bt.bfloat16)) if precision == "bf16" else contextlib.nullcontext
  in_backward, during = [False], []
  reduce, scatter = dist.all_reduce, dist.reduce_scatter_tensor

  def counted(fn):  # which bucket collectives are enqueued before backward returns
    def call(*a, **k):
      during.append(in_backward[0])
      return fn(*a, **k)
    return call
  if mode == "ddp": dist.all_reduce = counted(reduce)
  if mode == "zero2": dist.reduce_scatter_tensor = counted(scatter)

  def step(x, y):
    with ctx(): loss = net(x, y)[1]
    in_backward[0] = True
    loss.backward()
    in_backward[0] = False
    if mode == "zero2": opt.clip_grad_norm_(1.0)  # the full gradients are gone: the norm over the shards
    else: bt.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

  fn = bt.compile(step) if compiled else step
  sync = bt.cuda.synchronize if device == "cuda" else (lambda: None)
  dev = [(bt.from_numpy(x).to(device), bt.from_numpy(y).to(device)) for x, y in batches]
  if device == "cuda": bt.cuda.reset_peak_memory_stats()
  try:
    gc.collect()
    gc.freeze()
    losses = [float(fn(*b).item()) for b in dev[:warmup]]
    sync()
    times = []
    for b in dev[warmup:]:
      t0 = time.perf_counter()
      losses.append(float(fn(*b).item()))
      sync()
      times.append(time.perf_counter() - t0)
    gc.unfreeze()
  finally:
    dist.all_reduce, dist.reduce_scatter_tensor = reduce, scatter
  out = {"step_s": statistics.median(times), "step_times_s": times, "losses": losses,
         "bucket_collectives": len(during), "enqueued_during_backward": sum(during)}
  if compiled:  # the collectives of the compiled step, read from its generated code (one kernel call a line)
    source = Path(fn.info["source"]).read_text()
    out.update(graph_collectives=sum(source.count(f'kernels["{k}"]') for k in ("all_reduce", "reduce_scatter")),
               captures=fn.captures, cuda_graph=fn.info.get("cuda_graph"))
  if device == "cuda": out["peak_bytes"] = bt.cuda.max_memory_allocated()
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=20, help="timed steps per run (after the warmup)")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--precisions", default="tf32,bf16")
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--block", type=int, default=1024)
  ap.add_argument("--quick", action="store_true", help="a tiny GPT on the CPU over MPI (world size 1)")
  ap.add_argument("--compile", action="store_true", help="compile every step with bt.compile (warmup at least 3)")
  ap.add_argument("--out", help="the JSON file (default: benchmarks/results/ddp_overhead.json; --quick writes none)")
  args = ap.parse_args()

  import blutrain as bt
  import blutrain.distributed as dist
  from blutrain.models import GPT, GPTConfig, PRESETS
  device = "cpu" if args.quick else "cuda"
  if args.quick:
    cfg = GPTConfig(**{**PRESETS["char-tiny"], "vocab_size": 65, "block_size": 32})
    args.batch, args.block, args.steps, precisions = 4, 32, min(args.steps, 3), ["fp32"]
  else:
    from benchmarks.common import require_gpu
    require_gpu("cuda")
    cfg = GPTConfig(**PRESETS["gpt2"], vocab_size=50304, block_size=args.block)
    precisions = args.precisions.split(",")
  dist.init_process_group("mpi" if args.quick else "nccl")
  bt.manual_seed(0)
  state = {k: v.detach().numpy() for k, v in GPT(cfg).state_dict().items()}
  rng = np.random.default_rng(0)
  batches = [tuple(rng.integers(0, cfg.vocab_size, (args.batch, args.block)) for _ in range(2))
             for _ in range(args.warmup + args.steps)]
  rows, tokens = {}, args.batch * args.block
  for precision in precisions:
    for mode in ("plain", "ddp", "zero2"):
      r = run(mode, cfg, state, batches, precision, device, args.warmup, args.compile)
      r["tokens_per_s"] = tokens / r["step_s"]
      rows[f"{precision}/{mode}"] = r
      base = rows[f"{precision}/plain"]["step_s"]
      counts = (f"bucket collectives in the compiled step {r['graph_collectives']}" if args.compile else
                f"bucket collectives during backward {r['enqueued_during_backward']}/{r['bucket_collectives']}")
      print(f"{precision:5s} {mode:6s} {r['tokens_per_s']:>12,.0f} tok/s  step {r['step_s'] * 1e3:8.1f} ms  "
            f"x{r['step_s'] / base:.3f} of plain  {counts}", flush=True)
  meta = {"date": str(date.today()), "device": bt.cuda.get_device_name() if device == "cuda" else platform.processor(),
          "model": "char-tiny (quick)" if args.quick else "gpt2 124M", "batch": args.batch, "block": args.block,
          "world_size": dist.get_world_size(), "backend": dist.get_backend(), "steps": args.steps,
          "compiled": args.compile}
  name = "ddp_overhead_compiled.json" if args.compile else "ddp_overhead.json"
  out = args.out or (None if args.quick else ROOT / "benchmarks" / "results" / name)
  if out: Path(out).write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))
  dist.destroy_process_group()


if __name__ == "__main__":
  main()
