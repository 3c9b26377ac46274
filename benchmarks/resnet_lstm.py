"""Issue #17's benchmark: a ResNet-18 training step (batch 128, 224x224, 1000 classes, SGD with momentum) and a 2-layer
LSTM language model (hidden 1024, T = 256, AdamW), each as blutrain eager and compiled (Nova) vs PyTorch eager and
torch.compile in this process, same weights and batches, under bf16 autocast and in TF32. Targets: eager >= 0.9x
PyTorch eager, compiled >= 1.0x torch.compile. Writes benchmarks/results/resnet_lstm.json.

  python benchmarks/resnet_lstm.py [--quick] [--models resnet18,lstm] [--precisions bf16,tf32]
                                   [--order torch_eager,blutrain_eager,blutrain_compile,torch_compile]
  python benchmarks/resnet_lstm.py --device cpu --quick   # a small dry run of the script itself (tiny shapes)
  python benchmarks/resnet_lstm.py --order blutrain_eager --profile   # and blutrain's eager step op by op
  python benchmarks/resnet_lstm.py --models resnet18 --channels-last   # images and weights channels-last in every framework
  python benchmarks/resnet_lstm.py --repeat 3 ...   # the order three times, interleaved: each round's ratio and host speed
  python benchmarks/resnet_lstm.py --split ...      # and each eager step's host and GPU time apart

The models are written once against PyTorch's nn API (`resnet18(nn)`, `LSTMLM(nn)`) and built from `blutrain.nn` and
`torch.nn`; the torch copy loads blutrain's initial state dict, so both start from the same weights.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import host_and_gpu_ms, host_speed_us, metadata, require_gpu, spread  # noqa: E402


# *** the models, written against PyTorch's nn API ***

def resnet18(nn, num_classes: int = 1000):
  """torchvision's ResNet-18 (BasicBlock, [2, 2, 2, 2]) from the module namespace `nn`."""

  class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
      super().__init__()
      self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
      self.bn1 = nn.BatchNorm2d(cout)
      self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
      self.bn2 = nn.BatchNorm2d(cout)
      self.relu = nn.ReLU()
      self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else None)

    def forward(self, x):
      out = self.relu(self.bn1(self.conv1(x)))
      out = self.bn2(self.conv2(out))
      return self.relu(out + (x if self.downsample is None else self.downsample(x)))

  layers, cin = [], 64
  for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
    layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
    cin = cout
  return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                       *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))


def lstm_lm(nn, vocab: int, hidden: int, layers: int = 2):
  """Embedding, a batch-first LSTM, and a projection to the vocabulary."""

  class LSTMLM(nn.Module):
    def __init__(self):
      super().__init__()
      self.embed = nn.Embedding(vocab, hidden)
      self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
      self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
      return self.head(self.lstm(self.embed(x))[0])

  return LSTMLM()


SHAPES = {  # model -> (full, --quick on the CPU) keyword arguments
  "resnet18": (dict(batch=128, size=224, classes=1000), dict(batch=2, size=32, classes=10)),
  "lstm": (dict(batch=32, seq=256, hidden=1024, vocab=10000), dict(batch=2, seq=16, hidden=64, vocab=100)),
}


def build(nn, model: str, s: dict):
  return resnet18(nn, s["classes"]) if model == "resnet18" else lstm_lm(nn, s["vocab"], s["hidden"])


def batches(model: str, s: dict, n: int) -> list:
  rng = np.random.default_rng(0)
  if model == "resnet18":
    return [(rng.standard_normal((s["batch"], 3, s["size"], s["size"]), np.float32),
             rng.integers(0, s["classes"], (s["batch"],))) for _ in range(n)]
  return [(rng.integers(0, s["vocab"], (s["batch"], s["seq"])), rng.integers(0, s["vocab"], (s["batch"], s["seq"])))
          for _ in range(n)]


# *** timing ***

def timed(step, data, warmup: int, sync) -> dict:
  """Per step, the wall time until the loss is on the host; the first call (compilation) apart."""
  gc.collect()
  t0 = time.perf_counter()
  losses = [float(step(*data[0]).item())]
  sync()
  first = time.perf_counter() - t0
  for b in data[1:warmup]: losses.append(float(step(*b).item()))
  sync()
  times = []
  for b in data[warmup:]:
    t0 = time.perf_counter()
    losses.append(float(step(*b).item()))
    sync()
    times.append(time.perf_counter() - t0)
  return {"first_step_s": first, "step_s": statistics.median(times), "step_times_s": times, "losses": losses}


def make_step(framework: str, model: str, s: dict, state: dict, data: list, precision: str, device: str,
              compiled: bool, channels_last: bool = False):
  """(the training step of `model` in `framework`, compiled or eager, from the weights `state`; the batches on the
  device, images and the model's 4-d weights `channels_last` when asked, as PyTorch's channels-last recipe has it
  (then every activation is: outputs keep their inputs' memory format);
  the framework's synchronize; the eager step)."""
  if framework == "blutrain":
    import blutrain as bt
    lib, nn, F, tensor = bt, bt.nn, bt.nn.functional, lambda a: bt.from_numpy(a).to(device)
    bt.set_float32_matmul_precision("high")
    autocast = lambda: bt.autocast(device_type=device, dtype=bt.bfloat16)
    sync, compile_ = (bt.cuda.synchronize if device == "cuda" else lambda: None), bt.compile
  else:
    import torch
    lib, nn, F, tensor = torch, torch.nn, torch.nn.functional, lambda a: torch.from_numpy(a).to(device)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    autocast = lambda: torch.autocast(device, dtype=torch.bfloat16)
    sync, compile_ = (torch.cuda.synchronize if device == "cuda" else lambda: None), torch.compile
  net = build(nn, model, s)
  net.load_state_dict({k: lib.from_numpy(v.copy()) for k, v in state.items()})
  fmt = lib.channels_last if channels_last and model == "resnet18" else lib.contiguous_format
  net.to(device).to(memory_format=fmt).train()
  opt = (lib.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4) if model == "resnet18"
         else lib.optim.AdamW(net.parameters(), lr=1e-3))

  def step(x, y):
    with autocast() if precision == "bf16" else contextlib.nullcontext():
      logits = net(x)
      loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

  batches_ = [(tensor(x).contiguous(memory_format=fmt), tensor(y)) for x, y in data]
  return compile_(step) if compiled else step, batches_, sync, step


def run(framework: str, model: str, s: dict, state: dict, data: list, precision: str, device: str, warmup: int,
        compiled: bool, profile: bool = False, channels_last: bool = False, split: bool = False) -> dict:
  """One (framework, compiled) run of `model`'s training step; with `split`, an eager step's host and GPU time apart
  (`host_and_gpu_ms`)."""
  step, dev, sync, eager = make_step(framework, model, s, state, data, precision, device, compiled, channels_last)
  out = timed(step, dev, warmup, sync)
  if split and device == "cuda" and not compiled: out.update(host_and_gpu_ms(framework, lambda: eager(*dev[-1])))
  if profile and framework == "blutrain" and not compiled:  # one more eager step, op by op
    import blutrain as bt
    with bt.profiler.profile() as prof: eager(*dev[0]).item()
    print(prof.table(25), flush=True)
  del step, dev, eager
  gc.collect()
  return out


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="2 timed steps after 1 warm-up (and tiny shapes with --device cpu)")
  ap.add_argument("--device", default="cuda")
  ap.add_argument("--models", default="resnet18,lstm")
  ap.add_argument("--precisions", default="bf16,tf32")
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--order", default="torch_eager,blutrain_eager,blutrain_compile,torch_compile")
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "resnet_lstm.json"))
  ap.add_argument("--profile", action="store_true", help="print blutrain's eager step op by op (bt.profiler)")
  ap.add_argument("--repeat", type=int, default=1, help="run the order this many times, interleaved, and report the "
                  "ratio of every round with the host's Python speed (the first round's results are the runs')")
  ap.add_argument("--channels-last", action="store_true",
                  help="ResNet's images (so its activations) and weights channels-last")
  ap.add_argument("--split", action="store_true", help="after each eager run, its step's host time (queuing with no "
                  "sync) and GPU time (queued behind a sleep kernel) apart: which of them bounds the step")
  args = ap.parse_args()
  require_gpu(args.device)
  steps = 2 if args.quick else args.steps
  warmup = 1 if args.quick else args.warmup
  result = {**metadata("resnet_lstm", args.device), "steps": steps, "channels_last": args.channels_last, "runs": {},
            "ratios": {}, "repeat": args.repeat, "repeats": {}}
  for model in args.models.split(","):
    import blutrain as bt
    s = SHAPES[model][args.device == "cpu" and args.quick]
    bt.manual_seed(0)
    state = {k: v.detach().numpy().copy() for k, v in build(bt.nn, model, s).state_dict().items()}
    data = batches(model, s, warmup + steps)
    result[model] = s
    for precision in args.precisions.split(","):
      for rep, name in ((rep, name) for rep in range(args.repeat) for name in args.order.split(",")):
        framework, mode = name.split("_")
        try:
          host_us = host_speed_us()
          r = run(framework, model, s, state, data, precision, args.device, warmup, mode == "compile",
                  args.profile and rep == 0, args.channels_last, args.split)
          r["items_per_s"], r["host_us"] = s["batch"] / r["step_s"], [host_us, host_speed_us()]
        except Exception as e:  # a failed run is reported, not hidden
          r = {"error": f"{type(e).__name__}: {e}"}
        if rep == 0: result["runs"][f"{model}/{precision}/{name}"] = r
        result["repeats"].setdefault(f"{name}/{model}/{precision}", []).append(
          {k: r[k] for k in ("step_s", "items_per_s", "host_us", "enqueue_ms", "gpu_ms") if k in r})
        print(model, precision, name, {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()
                                       if k not in ("losses", "step_times_s")}, flush=True)
      for ours, ref in (("blutrain_eager", "torch_eager"), ("blutrain_compile", "torch_compile")):
        a, b = (result["runs"].get(f"{model}/{precision}/{n}", {}) for n in (ours, ref))
        if "step_s" in a and "step_s" in b:
          result["ratios"][f"{model}/{precision}/{ours}"] = b["step_s"] / a["step_s"]
  if args.repeat > 1:
    spread(result["repeats"], (("blutrain_eager", "torch_eager"), ("blutrain_compile", "torch_compile")),
           lambda ours, ref: ref["step_s"] / ours["step_s"])
  Path(args.out).parent.mkdir(exist_ok=True)
  Path(args.out).write_text(json.dumps(result, indent=1))
  print("| run | speed vs PyTorch (target: eager >= 0.9, compiled >= 1.0) |")
  for k, v in result["ratios"].items(): print(f"| {k} | {v:.2f} |")


if __name__ == "__main__":
  main()
