"""Tensor- and context-parallel GPT training steps against the plain model, at any world size (the ranks come from the
launcher): GPT-2 124M AdamW steps, same weights and batches, for each mode:

  plain     the whole model on every rank (the baseline; at world size 1 the others' overhead is against it)
  tp        parallelize_gpt over all ranks (attention heads, MLP, vocabulary split)
  tp-sp     the same with sequence parallelism
  tp-ovl    tp with the row-parallel all-reduces in --chunks chunks overlapping the GEMMs
  tp-sp-ovl tp-sp with the all-gathers and reduce-scatters in --chunks chunks of the batch overlapping the GEMMs
  cp        the sequence split over all ranks (ring attention, load-balanced), gradients averaged over them

tokens/s counts the whole batch (B x T) once per step, whatever the split; peak memory is rank 0's. Writes
benchmarks/results/tp_cp.json (rank 0).

  NCCL_NVLS_ENABLE=0 python benchmarks/tp_cp.py [--steps 10] [--block 1024] [--batch 8] [--modes plain,tp,cp]
  NCCL_NVLS_ENABLE=0 blutrain launch --nproc-per-node 2 benchmarks/tp_cp.py      # world size 2 (issue #18's runs)
  python benchmarks/tp_cp.py --quick      # a tiny GPT on the CPU over MPI (world size 1, or under mpiexec -n N)
"""
from __future__ import annotations

import argparse
import contextlib
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
MODES = ("plain", "tp", "tp-sp", "tp-ovl", "tp-sp-ovl", "cp")


def build(mode: str, cfg, state, device: str, chunks: int):
  """The model to step for `mode`, how a batch becomes this rank's, and the gradients' reduction after backward."""
  import blutrain as bt
  import blutrain.distributed as dist
  from blutrain.nn.parallel.context_parallel import all_reduce_gradients, shard_sequence
  from blutrain.distributed.device_mesh import init_device_mesh
  from blutrain.models.parallelize import parallelize_gpt
  from blutrain.models import GPT
  model = GPT(cfg)
  model.load_state_dict({k: bt.from_numpy(v) for k, v in state.items()})
  model.to(device)
  whole, nothing = (lambda x, y: (x, y)), (lambda m: None)
  if mode == "plain": return model, whole, nothing
  if mode != "cp":
    return parallelize_gpt(model, None, sequence_parallel=mode.startswith("tp-sp"),
                           overlap_chunks=chunks if mode.endswith("ovl") else 1), whole, nothing
  mesh = init_device_mesh(device, (dist.get_world_size(), 1), mesh_dim_names=("cp", "tp"))
  cp = mesh.get_group("cp")
  par = parallelize_gpt(model, mesh.get_group("tp"), cp)
  return par, (lambda x, y: (shard_sequence(x, cp), shard_sequence(y, cp))), (
    lambda m: all_reduce_gradients(list(m.parameters()), cp))


def run(mode: str, cfg, state, batches, precision: str, device: str, warmup: int, chunks: int) -> dict:
  import blutrain as bt
  bt.set_float32_matmul_precision("highest" if precision == "fp32" else "high")
  if device == "cuda": bt.cuda.reset_peak_memory_stats()
  model, shard, reduce = build(mode, cfg, state, device, chunks)
  opt = bt.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
  ctx = (lambda: bt.autocast(device_type=device, dtype=bt.bfloat16)) if precision == "bf16" else contextlib.nullcontext

  def step(x, y):
    with ctx(): loss = model(*shard(x, y))[1]
    loss.backward()
    reduce(model)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

  sync = bt.cuda.synchronize if device == "cuda" else (lambda: None)
  dev = [(bt.from_numpy(x).to(device), bt.from_numpy(y).to(device)) for x, y in batches]
  losses = [float(step(*b).item()) for b in dev[:warmup]]
  sync()
  times = []
  for b in dev[warmup:]:
    t0 = time.perf_counter()
    losses.append(float(step(*b).item()))
    sync()
    times.append(time.perf_counter() - t0)
  out = {"step_s": statistics.median(times), "step_times_s": times, "losses": losses,
         "local_params": sum(p.numel() for p in model.parameters())}
  if device == "cuda": out["peak_bytes"] = bt.cuda.max_memory_allocated()
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=10, help="timed steps per run (after the warmup)")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--precision", default="bf16", choices=("fp32", "tf32", "bf16"))
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--block", type=int, default=1024)
  ap.add_argument("--chunks", type=int, default=4, help="the overlapped modes' chunks")
  ap.add_argument("--modes", default=",".join(MODES))
  ap.add_argument("--quick", action="store_true", help="a tiny GPT on the CPU over MPI")
  ap.add_argument("--out", help="the JSON file (default: benchmarks/results/tp_cp.json; --quick writes none)")
  args = ap.parse_args()

  import blutrain as bt
  import blutrain.distributed as dist
  from blutrain.models import GPT, GPTConfig, PRESETS
  device = "cpu" if args.quick else "cuda"
  if args.quick:
    cfg = GPTConfig(**{**PRESETS["char-tiny"], "vocab_size": 64, "block_size": 32})
    args.batch, args.block, args.steps, args.precision = 4, 32, min(args.steps, 3), "fp32"
  else:
    from benchmarks.common import require_gpu
    require_gpu("cuda")
    cfg = GPTConfig(**PRESETS["gpt2"], vocab_size=50304, block_size=args.block)
  dist.init_process_group("mpi" if args.quick else "nccl")
  modes = args.modes.split(",")
  unknown = sorted(set(modes) - set(MODES))
  if unknown: sys.exit(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
  bt.manual_seed(0)
  state = {k: v.detach().numpy() for k, v in GPT(cfg).state_dict().items()}
  rng = np.random.default_rng(0)
  batches = [tuple(rng.integers(0, cfg.vocab_size, (args.batch, args.block)) for _ in range(2))
             for _ in range(args.warmup + args.steps)]
  rows, tokens, lead = {}, args.batch * args.block, dist.get_rank() == 0
  for mode in modes:
    r = run(mode, cfg, state, batches, args.precision, device, args.warmup, args.chunks)
    r["tokens_per_s"] = tokens / r["step_s"]
    rows[mode] = r
    base = rows[modes[0]]["step_s"]
    mem = f"  peak {r['peak_bytes'] / 2**30:6.2f} GiB" if "peak_bytes" in r else ""
    if lead:
      print(f"{mode:7s} {r['tokens_per_s']:>12,.0f} tok/s  step {r['step_s'] * 1e3:8.1f} ms  x{r['step_s'] / base:.3f} "
            f"of {modes[0]}{mem}  params/rank {r['local_params']:,}", flush=True)
  meta = {"date": str(date.today()), "device": bt.cuda.get_device_name() if device == "cuda" else platform.processor(),
          "model": "char-tiny (quick)" if args.quick else "gpt2 124M", "batch": args.batch, "block": args.block,
          "precision": args.precision, "world_size": dist.get_world_size(), "backend": dist.get_backend(),
          "steps": args.steps, "chunks": args.chunks}
  out = args.out or (None if args.quick else ROOT / "benchmarks" / "results" / "tp_cp.json")
  if out and lead: Path(out).write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))
  dist.destroy_process_group()


if __name__ == "__main__":
  main()
