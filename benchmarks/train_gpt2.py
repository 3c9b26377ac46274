"""GPT-2 124M training on one GPU: blutrain eager and compiled (Nova's GPU target) vs PyTorch eager, torch.compile
and JAX/XLA (benchmarks/jax_gpt.py), same weights, same batches, fused AdamW, in fp32 (no TF32), TF32 and bf16
autocast. Reports tokens/s, peak memory, first-step time and ratios; writes benchmarks/results/train_gpt2.json.

  python benchmarks/train_gpt2.py [--batch 16] [--block 1024] [--steps 10] [--precisions fp32,tf32,bf16]
                                  [--order torch_eager,blutrain_eager,blutrain_compile,torch_compile,jax_xla]
  python benchmarks/train_gpt2.py --device cpu --quick   # a small dry run of the script itself (a 2-layer GPT)
  python benchmarks/train_gpt2.py --gelu tanh ...         # GPT-2's own tanh GELU in every framework (default: erf)
  python benchmarks/train_gpt2.py --repeat 3 ...          # the order three times, interleaved: each ratio's spread

The JAX run (jax_xla) runs in a process of its own (jax is imported there only): its allocator keeps the memory it
took until the process ends and its peak (`memory_stats()["peak_bytes_in_use"]`) cannot be reset, so it covers the
first step too. With `--isolate` every run does (one after another, on the same machine): a framework's host work
then shares its process with nothing of the other's (PyTorch loaded, torch.compile's compile workers, the other's
caches and garbage), which a step that synchronizes each time (`loss.item()`) feels.

A compiled run's peak is measured over its timed steps (after the warm-up, which for blutrain holds the first call's
graph, which creates the optimizer's state, and the capture of the steady one): the caching allocator's peak (which holds the CUDA graph's arena) plus the memory of the
graph's private caching allocator.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
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

from benchmarks.common import host_speed_us, spread  # noqa: E402


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
  host_us = host_speed_us()
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
          "enqueue_s": statistics.median(enqueue), "enqueue_times_s": enqueue, "losses": losses,
          "host_us": [host_us, host_speed_us()]}  # the host's Python speed before and after the timed steps


def _scheduled(opt, lrs):
  """A hook setting every group's learning rate to the next of `lrs` before each step (None: the optimizer's own)."""
  it = iter(lrs) if lrs is not None else None

  def set_lr():
    if it is None: return
    lr = next(it)
    for g in opt.param_groups: g["lr"] = lr
  return set_lr


def run_blutrain(cfg, state, batches, precision: str, warmup: int, compiled: bool = False, device: str = "cuda",
                 lrs: list[float] | None = None) -> dict:
  import blutrain as bt
  from blutrain.models import GPT
  from blutrain.train import training_step
  bt.set_float32_matmul_precision("highest" if precision == "fp32" else "high")
  model = GPT(cfg)
  model.load_state_dict({k: bt.from_numpy(v) for k, v in state.items()})
  model.to(device)
  opt = model.configure_optimizers(0.1, 6e-4, betas=(0.9, 0.95), fused=True)
  step, set_lr = training_step(model, opt), _scheduled(opt, lrs)
  if compiled: step = bt.compile(step)
  ctx = (lambda: bt.autocast(device_type=device, dtype=bt.bfloat16)) if precision == "bf16" else contextlib.nullcontext

  def one(x, y):
    set_lr()
    with ctx(): return step(x, y)
  dev = [(bt.from_numpy(x).to(device), bt.from_numpy(y).to(device)) for x, y in batches]
  if device != "cuda": return _timed(one, dev, warmup, lambda: None)
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
    out["host_ms_last_step"] = {k: v * 1e3 for k, v in step.info.get("host_s", {}).items()}
  del model, step, dev
  gc.collect()
  bt.cuda.empty_cache()
  return out


def run_torch(cfg, state, batches, precision: str, warmup: int, compiled: bool, device: str = "cuda",
              lrs: list[float] | None = None) -> dict:
  """`lrs` (a learning rate per step) is for eager runs: torch.compile would recompile for each new value."""
  import torch
  from benchmarks.torch_gpt import GPT as TorchGPT, training_step
  torch.backends.cuda.matmul.allow_tf32 = precision != "fp32"
  torch.backends.cudnn.allow_tf32 = precision != "fp32"
  model = TorchGPT(cfg).to(device)
  with torch.no_grad():
    for name, p in model.state_dict().items(): p.copy_(torch.from_numpy(state[name]))
  opt = model.configure_optimizers(0.1, 6e-4, betas=(0.9, 0.95), fused=True)
  step, set_lr = training_step(model, opt, precision), _scheduled(opt, lrs)
  fn = torch.compile(step) if compiled else step
  dev = [(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)) for x, y in batches]

  def one(x, y):
    set_lr()
    return fn(x, y)
  if device != "cuda": return _timed(one, dev, warmup, lambda: None)
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  out = _timed(one, dev, warmup, torch.cuda.synchronize,
               torch.cuda.reset_peak_memory_stats if compiled else lambda: None)
  out["peak_bytes"] = torch.cuda.max_memory_allocated()
  del model, step, fn, dev
  gc.collect()
  torch.cuda.empty_cache()
  return out


def run_jax(cfg, state, batches, precision: str, warmup: int, device: str = "cuda",
            lrs: list[float] | None = None) -> dict:
  """benchmarks/jax_gpt.py's step in a process of its own, on the same weights and batches (a constant 6e-4 learning
  rate unless `lrs` gives one per step); its result dict, as the other runs'."""
  with tempfile.TemporaryDirectory() as tmp:
    inputs, out = Path(tmp) / "inputs.npz", Path(tmp) / "result.json"
    np.savez(inputs, x=np.stack([x for x, _ in batches]), y=np.stack([y for _, y in batches]),
             lr=np.asarray(lrs if lrs is not None else [6e-4] * len(batches), np.float32), **state)
    env = {**os.environ, "JAX_PLATFORMS": "cuda" if device == "cuda" else "cpu"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "jax_gpt.py"), "--inputs", str(inputs),
                           "--n-head", str(cfg.n_head), "--gelu", cfg.gelu, "--precision", precision, "--warmup", str(warmup),
                           "--out", str(out)], env=env, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
      raise RuntimeError(f"benchmarks/jax_gpt.py exited with {proc.returncode}: {proc.stderr[-2000:]}")
    sys.stderr.write(proc.stderr)  # JAX's and XLA's warnings, and a note when cuDNN attention was refused
    return json.loads(out.read_text())


def _isolated(name: str, precision: str, args) -> dict:
  """The run `name` in `precision` by this script in a process of its own; its result dict."""
  with tempfile.TemporaryDirectory() as tmp:
    out = Path(tmp) / "result.json"
    cmd = [sys.executable, __file__, "--precisions", precision, "--order", name, "--out", str(out)]
    for flag in ("batch", "block", "steps", "warmup", "device", "gelu"): cmd += [f"--{flag}", str(getattr(args, flag))]
    proc = subprocess.run(cmd + ["--quick"] * args.quick, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
      raise RuntimeError(f"the {name} run exited with {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(out.read_text())["runs"][f"{name}/{precision}"]


def _version(package: str) -> str | None:
  """An installed package's version, without importing it."""
  from importlib import metadata
  try: return metadata.version(package)
  except metadata.PackageNotFoundError: return None


def _gib(r: dict) -> float:
  return (r.get("peak_bytes") or float("nan")) / 2**30  # nan where not measured (the CPU)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--block", type=int, default=1024)
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--precisions", default="fp32,tf32,bf16")
  ap.add_argument("--torch-compile", action="store_true")
  ap.add_argument("--order", default="torch_eager,blutrain_eager", help="which runs, in which order (of "
                  "torch_eager, blutrain_eager, blutrain_compile, torch_compile, jax_xla)")
  ap.add_argument("--device", default="cuda")
  ap.add_argument("--gelu", choices=("none", "tanh"), default="none",
                  help="the MLP's GELU: exact (erf, as nanoGPT) or GPT-2's own tanh approximation")
  ap.add_argument("--isolate", action="store_true", help="each run in a process of its own (see the docstring)")
  ap.add_argument("--repeat", type=int, default=1, help="run the order this many times, interleaved, and report the "
                  "spread of each pair's ratio with the host's Python speed (`runs` holds the first round)")
  ap.add_argument("--quick", action="store_true", help="1 warm-up and 2 timed steps (with --device cpu: a 2-layer GPT "
                  "of width 64, B=2, T=32)")
  ap.add_argument("--out", help="the results file (default: benchmarks/results/train_gpt2.json on a GPU, "
                  "train_gpt2_cpu.json in the temporary directory on the CPU)")
  args = ap.parse_args()
  args.out = args.out or str(ROOT / "benchmarks" / "results" / "train_gpt2.json" if args.device == "cuda" else
                             Path(tempfile.gettempdir()) / "train_gpt2_cpu.json")
  if args.quick: args.steps, args.warmup = 2, 1
  tiny = args.quick and args.device == "cpu"
  if tiny: args.batch, args.block = 2, 32

  import blutrain as bt
  from blutrain.models import GPT, GPTConfig
  cfg = GPTConfig(block_size=args.block, gelu=args.gelu, **(dict(n_layer=2, n_head=2, n_embd=64) if tiny else {}))
  bt.manual_seed(0)
  state = {k: v.detach().numpy().copy() for k, v in GPT(cfg).state_dict().items()}
  rng = np.random.default_rng(0)
  batches = [(rng.integers(0, 50257, (args.batch, args.block)), rng.integers(0, 50257, (args.batch, args.block)))
             for _ in range(args.warmup + args.steps)]
  tokens = args.batch * args.block
  gpu = bt.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
  rows, result = [], {"benchmark": "train_gpt2", "date": date.today().isoformat(), "gpu": gpu, "device": args.device,
                      "batch": args.batch, "block": args.block, "steps": args.steps, "config": cfg.to_dict(),
                      "isolated": args.isolate, "repeat": args.repeat, "repeats": {},
                      "versions": {"python": platform.python_version(), "torch": _version("torch"),
                                   "blutrain": bt.__version__, "numpy": np.__version__}, "runs": {}}
  for precision in args.precisions.split(","):
    runs = {"torch_eager": lambda: run_torch(cfg, state, batches, precision, args.warmup, False, args.device),
            "blutrain_eager": lambda: run_blutrain(cfg, state, batches, precision, args.warmup, False, args.device),
            "blutrain_compile": lambda: run_blutrain(cfg, state, batches, precision, args.warmup, True, args.device),
            "torch_compile": lambda: run_torch(cfg, state, batches, precision, args.warmup, True, args.device),
            "jax_xla": lambda: run_jax(cfg, state, batches, precision, args.warmup, args.device)}
    order = args.order.split(",") + (["torch_compile"] if args.torch_compile else [])
    for rep in range(args.repeat):
      for name, fn in ((n, runs[n]) for n in order):
        if args.isolate and name != "jax_xla": fn = functools.partial(_isolated, name, precision, args)
        try:
          r = fn()
          r["tokens_per_s"] = tokens / r["step_s"]
        except Exception as e:  # a failed run is reported, not hidden
          r = {"error": f"{type(e).__name__}: {e}"}
        if rep == 0: result["runs"][f"{name}/{precision}"] = r
        result["repeats"].setdefault(f"{name}/{precision}", []).append(
          {k: r[k] for k in ("tokens_per_s", "step_s", "enqueue_s", "host_us") if k in r})
        print(name, precision, {k: [round(t * 1e3, 1) for t in v] if k.endswith("times_s") else v
                                for k, v in r.items() if k != "losses"}, flush=True)
    ref, ours = result["runs"].get(f"torch_eager/{precision}", {}), result["runs"].get(f"blutrain_eager/{precision}", {})
    if ref and ours and "error" not in ref and "error" not in ours:
      rows.append((precision, ours["tokens_per_s"], ref["tokens_per_s"], ours["tokens_per_s"] / ref["tokens_per_s"],
                   _gib(ours), _gib(ref), ours["step_s"] * 1e3,
                   ours["enqueue_s"] * 1e3, ours["first_step_s"],
                   max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"]))))
  if args.repeat > 1:
    spread(result["repeats"], (("blutrain_eager", "torch_eager"), ("blutrain_compile", "torch_compile")),
           lambda ours, ref: ours["tokens_per_s"] / ref["tokens_per_s"])
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
        _gib(ours), _gib(ref), ours["step_s"] * 1e3, ours["enqueue_s"] * 1e3, ours["first_step_s"]))
      host = ours.get("host_ms_last_step", {})
      print(f"  blutrain compiled {precision}, the last step's host ms: " +
            ", ".join(f"{k} {v:.2f}" for k, v in host.items()))
  print("| precision | JAX/XLA tok/s | JAX / torch.compile | blutrain compiled / JAX | JAX peak GiB | JAX step ms "
        "| JAX first step s (compile) | attention | max loss diff vs torch eager |")
  for precision in args.precisions.split(","):
    jx, tc, bc, te = (result["runs"].get(f"{n}/{precision}", {}) for n in ("jax_xla", "torch_compile",
                                                                           "blutrain_compile", "torch_eager"))
    if "tokens_per_s" not in jx: continue
    ratio = lambda a, b: f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}" if "tokens_per_s" in a and "tokens_per_s" in b \
      else "-"
    diff = f"{max(abs(a - b) for a, b in zip(jx['losses'], te['losses'])):.2e}" if "losses" in te else "-"
    print(f"| {precision} | {jx['tokens_per_s']:,.0f} | {ratio(jx, tc)} | {ratio(bc, jx)} | {_gib(jx):.1f} "
          f"| {jx['step_s'] * 1e3:.1f} | {jx['first_step_s']:.1f} | {jx['attention']} | {diff} |")


if __name__ == "__main__":
  main()
