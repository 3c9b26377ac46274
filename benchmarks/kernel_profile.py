"""Where a compiled GPT-2 124M step (B=16, T=1024) spends its GPU time, kernel by kernel, from the CUDA profiler
(CUPTI through torch.profiler, which records every kernel of the process, blutrain's CUDA-graph nodes included):
device milliseconds and launches per step, averaged over 3 steps after 4 warm-up steps.

  python benchmarks/kernel_profile.py --against torch_compile [--precision bf16|tf32] [--model gpt2|resnet18|lstm]
      blutrain compiled against torch.compile, same model, batch and optimizer (ResNet-18 and the LSTM LM as
      benchmarks/resnet_lstm.py builds and feeds them)
  python benchmarks/kernel_profile.py --against torch_eager [--precision bf16|tf32] [--model gpt2|resnet18|lstm]
      the eager step, blutrain against PyTorch eager (where an eager step's GPU time differs)
  NCCL_NVLS_ENABLE=0 python benchmarks/kernel_profile.py --against ddp [--precision tf32]
      the plain compiled step against the same step under DistributedDataParallel at world size 1 (NCCL), sorted by
      the difference: what the wrapper costs, kernel by kernel

Prints the table; with --out, writes it as JSON.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gc
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import blutrain as bt  # noqa: E402
from blutrain.models import GPT, GPTConfig, PRESETS  # noqa: E402

CFG = GPTConfig(**PRESETS["gpt2"], vocab_size=50304, block_size=1024)
STEPS = 3


def kernels(fn, sync) -> dict[str, tuple[float, float]]:
  """Kernel name -> (device ms per step, launches per step) over STEPS calls of fn after 4 warm-up calls."""
  for _ in range(4): fn()
  sync()
  with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(STEPS): fn()
    sync()
  ms, n = collections.Counter(), collections.Counter()
  for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
      ms[e.name[:70]] += e.device_time_total / 1e3 / STEPS
      n[e.name[:70]] += 1 / STEPS
  return {k: (ms[k], n[k]) for k in ms}


def blutrain_step(precision: str, ddp: bool, compiled: bool = True):
  from blutrain.nn.parallel import DistributedDataParallel
  bt.manual_seed(0)
  model = GPT(CFG).to("cuda")
  opt = model.configure_optimizers(0.1, 6e-4, betas=(0.9, 0.95), fused=True)
  net = DistributedDataParallel(model) if ddp else model
  ctx = (lambda: bt.autocast(device_type="cuda", dtype=bt.bfloat16)) if precision == "bf16" else contextlib.nullcontext

  def step(x, y):
    with ctx(): loss = net(x, y)[1]
    loss.backward()
    bt.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss
  if compiled: step = bt.compile(step)
  x = bt.from_numpy(np.random.default_rng(0).integers(0, CFG.vocab_size, (16, 1024))).to("cuda")
  return lambda: step(x, x)


def torch_step(precision: str, compiled: bool = True):
  from benchmarks.torch_gpt import GPT as TorchGPT, training_step
  torch.backends.cuda.matmul.allow_tf32 = True
  model = TorchGPT(CFG).cuda()
  step = training_step(model, model.configure_optimizers(0.1, 6e-4, betas=(0.9, 0.95), fused=True), precision)
  if compiled: step = torch.compile(step)
  x = torch.from_numpy(np.random.default_rng(0).integers(0, CFG.vocab_size, (16, 1024))).cuda()
  return lambda: step(x, x)


def resnet_lstm_steps(model: str, precision: str, channels_last: bool = False, compiled: bool = True) -> dict:
  """blutrain's and torch.compile's compiled steps of benchmarks/resnet_lstm.py's `model` (or both eager steps), same
  weights and batch (images and weights channels-last with `channels_last`)."""
  from benchmarks.resnet_lstm import SHAPES, batches, build, make_step
  s = SHAPES[model][0]
  bt.manual_seed(0)
  state = {k: v.detach().numpy().copy() for k, v in build(bt.nn, model, s).state_dict().items()}
  data = batches(model, s, 1)
  steps = {}
  for framework in ("blutrain", "torch"):
    step, dev, sync, _ = make_step(framework, model, s, state, data, precision, "cuda", compiled, channels_last)
    name = "blutrain" if framework == "blutrain" else "torch_compile" if compiled else "torch_eager"
    steps[name] = (lambda st=step, b=dev[0]: st(*b), sync)
  return steps


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--against", choices=("torch_compile", "torch_eager", "ddp"), default="torch_compile")
  ap.add_argument("--model", choices=("gpt2", "resnet18", "lstm"), default="gpt2")
  ap.add_argument("--precision", choices=("bf16", "tf32"), default="bf16")
  ap.add_argument("--rows", type=int, default=25)
  ap.add_argument("--channels-last", action="store_true",
                  help="resnet18: images (so activations) and weights channels-last")
  ap.add_argument("--gelu", choices=("none", "tanh"), default="none", help="gpt2: the MLP's GELU (train_gpt2.py's)")
  ap.add_argument("--out")
  args = ap.parse_args()
  global CFG
  CFG = dataclasses.replace(CFG, gelu=args.gelu)
  bt.set_float32_matmul_precision("high")
  if args.against == "ddp":
    import blutrain.distributed as dist
    dist.init_process_group("nccl")
  runs = {}
  if args.model != "gpt2":
    if args.against == "ddp": ap.error("--model resnet18 and lstm profile against torch_compile or torch_eager")
    compiled = args.against == "torch_compile"
    for name, (fn, sync) in resnet_lstm_steps(args.model, args.precision, args.channels_last, compiled).items():
      runs[name] = kernels(fn, sync)
  for name in ("blutrain", args.against) if args.model == "gpt2" else ():
    eager = args.against == "torch_eager"
    fn = torch_step(args.precision, compiled=not eager) if name.startswith("torch") else \
      blutrain_step(args.precision, ddp=name == "ddp", compiled=not eager)
    runs[name] = kernels(fn, torch.cuda.synchronize if name.startswith("torch") else bt.cuda.synchronize)
    del fn
    gc.collect()
  a, b = runs["blutrain"], runs[args.against]
  for name, r in runs.items():
    print(f"{name}: {sum(t for t, _ in r.values()):.2f} ms of kernels in {sum(n for _, n in r.values()):.0f} launches")
  if args.against == "ddp":
    keys = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, (0, 0))[0] - a.get(k, (0, 0))[0]))[:args.rows]
    print(f"| kernel | plain ms | DDP ms | difference | launches plain | launches DDP |\n|{' --- |' * 6}")
    for k in keys:
      (ta, na), (tb, nb) = a.get(k, (0, 0)), b.get(k, (0, 0))
      print(f"| {k} | {ta:.3f} | {tb:.3f} | {tb - ta:+.3f} | {na:.0f} | {nb:.0f} |")
  else:
    for name, r in runs.items():
      print(f"| {name} kernel | ms | launches |\n| --- | --- | --- |")
      for k, (t, n) in sorted(r.items(), key=lambda kv: -kv[1][0])[:args.rows]: print(f"| {k} | {t:.3f} | {n:.0f} |")
  if args.out:
    Path(args.out).write_text(json.dumps({"model": args.model, "precision": args.precision, "runs": runs}, indent=1))
  if args.against == "ddp": dist.destroy_process_group()


if __name__ == "__main__":
  main()
