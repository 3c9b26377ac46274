"""benchmarks/tp_cp.py's modes on the fake GPU (tests/fakegpu/fake_cuda.py, with the fake NCCL of
tests/distributed/test_nccl_host_path.py): per training step of each mode at world size 1, the kernel launches, the
collectives, the peak of allocated memory and the host milliseconds (this
thread's CPU time). Nothing computes on a fake device, so the figures say what the parallel machinery adds on the
host and in memory traffic, not device time: run on any machine, before taking a change to the H200.

  python benchmarks/tp_cp_fake.py [--modes plain,tp,cp] [--batch 8] [--block 1024] [--layers 12] [--steps 2]
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "fakegpu"), str(ROOT)]
from tests.distributed.test_nccl_host_path import PRELUDE  # noqa: E402

scope: dict = {}
exec(PRELUDE, scope)  # installs the fake driver and the fake nccl.core that logs each collective into scope["log"]
import fake_cuda  # noqa: E402

import blutrain as bt  # noqa: E402
import blutrain.distributed as dist  # noqa: E402
from benchmarks.tp_cp import MODES, build  # noqa: E402
from blutrain.models import GPT, GPTConfig, PRESETS  # noqa: E402

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "send", "recv", "broadcast")


def measure(mode: str, cfg, state, batch, chunks: int, steps: int) -> dict:
  model, shard, reduce = build(mode, cfg, state, "cuda", chunks)
  opt = bt.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
  x, y = batch

  def step():
    with bt.autocast(device_type="cuda", dtype=bt.bfloat16): loss = model(*shard(x, y))[1]
    loss.backward()
    reduce(model)
    opt.step()
    opt.zero_grad(set_to_none=True)

  step()  # the first step makes the optimizer's state
  bt.cuda.reset_peak_memory_stats()
  log = scope["log"]
  launches, log[:], t0 = fake_cuda.launches[0], [], time.thread_time()
  for _ in range(steps): step()
  host = (time.thread_time() - t0) / steps
  return {"launches": (fake_cuda.launches[0] - launches) / steps,
          "collectives": sum(e[0] in COLLECTIVES for e in log) / steps,
          "peak_gib": bt.cuda.max_memory_allocated() / 2**30, "host_ms": host * 1e3}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--modes", default=",".join(MODES))
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--block", type=int, default=1024)
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--chunks", type=int, default=4)
  ap.add_argument("--steps", type=int, default=2)
  args = ap.parse_args()
  dist.init_process_group("nccl")
  cfg = GPTConfig(**{**PRESETS["gpt2"], "n_layer": args.layers}, vocab_size=50304, block_size=args.block)
  bt.manual_seed(0)
  state = {k: v.detach().numpy() for k, v in GPT(cfg).state_dict().items()}
  batch = tuple(bt.randint(0, cfg.vocab_size, (args.batch, args.block)).to("cuda") for _ in range(2))
  print(f"{'mode':9s} {'launches':>9s} {'collectives':>11s} {'peak GiB':>9s} {'host ms':>8s}")
  for mode in args.modes.split(","):
    r = measure(mode, cfg, state, batch, args.chunks, args.steps)
    print(f"{mode:9s} {r['launches']:9.0f} {r['collectives']:11.0f} {r['peak_gib']:9.2f} "
          f"{r['host_ms']:8.1f}", flush=True)
  dist.destroy_process_group()


if __name__ == "__main__":
  main()
