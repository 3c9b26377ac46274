"""Issue #13's loss-parity run: GPT-2 124M trained for 300 steps on the bundled corpus by blutrain compiled (Nova) and
by PyTorch eager (benchmarks/torch_gpt.py), from the same initial weights on the same batches, under bf16 autocast by
default. Writes both loss curves, their difference over the last 100 steps and the curves' own step-to-step noise to
benchmarks/results/loss_parity.json, and both curves with their difference to loss_parity.png.

  python benchmarks/loss_parity.py [--steps 300] [--batch 16] [--block 1024] [--precision bf16] [--jax]
                                   [--fp32-reference]
  python benchmarks/loss_parity.py --device cpu --quick   # a small dry run of the script itself (char-tiny, 20 steps)

The data are `blutrain train`'s: the bundled Tiny Shakespeare, its byte-level BPE tokenizer (8192 tokens; the model's
vocabulary stays GPT-2's 50304 as `blutrain train --preset gpt2` builds it), its 90 % training split and its batch
sampler seeded with 1337. The optimizer is the benchmarks' (train_gpt2.py): fused AdamW, betas (0.9, 0.95), weight
decay 0.1 on matrices, clipping to 1.0; the learning rate follows `blutrain train`'s schedule (linear warmup over a
tenth of the run, at most 100 steps, then cosine decay to a tenth) to a peak of --lr (6e-4). With --jax, JAX/XLA
(benchmarks/jax_gpt.py) adds a third curve; with --fp32-reference, PyTorch eager in fp32 adds the rounding scale.

The noise scale: a curve's standard deviation over a sliding window of --window steps (the spread of the loss from
batch to batch), averaged over the last 100 steps. With identical batches the batch-to-batch spread cancels from the
difference; what remains is the peers' rounding, amplified by training. A tighter scale is --fp32-reference's: how far
PyTorch's own bf16 curve lies from its fp32 curve (a peer is within it when its mean difference from PyTorch's bf16
curve is at most twice that: each rounds independently around the fp32 curve).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import metadata, require_gpu, write  # noqa: E402
from benchmarks.train_gpt2 import run_blutrain, run_jax, run_torch  # noqa: E402

PEERS = {"blutrain_compile": "blutrain compiled", "torch_eager": "PyTorch eager", "jax_xla": "JAX/XLA",
         "torch_eager_fp32": "PyTorch eager fp32"}
REF = "torch_eager"


def corpus_batches(cfg, n: int) -> tuple[list, int]:
  """n batches (x, y) of int64 numpy arrays as `blutrain train` draws them, and the tokenizer's vocabulary size."""
  from blutrain import data
  text = data.load_text(cfg.corpus)
  tok = data.get_tokenizer("bpe", text, vocab_size=cfg.bpe_vocab_size)
  with tempfile.TemporaryDirectory() as tmp:
    train_path, _ = data.prepare(text, tok, tmp)
    tokens = np.array(data.load_tokens(train_path))
  rng = np.random.default_rng(cfg.seed)
  return [tuple(t.numpy() for t in data.get_batch(tokens, cfg.batch_size, cfg.block_size, rng)) for _ in range(n)], \
    tok.vocab_size


def schedule(cfg) -> list[float]:
  """The learning rate of each step under `blutrain train`'s warmup-cosine schedule."""
  import blutrain as bt
  from blutrain.train import warmup_steps
  opt = bt.optim.AdamW([bt.nn.Parameter(bt.zeros(1))], lr=cfg.lr)
  sched = bt.optim.lr_scheduler.warmup_cosine(opt, warmup_steps(cfg), cfg.steps, cfg.min_lr_ratio)
  lrs = []
  for _ in range(cfg.steps):
    lrs.append(opt.param_groups[0]["lr"])
    sched.step()
  return lrs


def noise(curve: np.ndarray, window: int, last: int) -> float:
  """The mean over the last `last` steps of the curve's standard deviation in a sliding window of `window` steps."""
  tail = curve[-(last + window - 1):]
  return float(np.mean([tail[i:i + window].std() for i in range(len(tail) - window + 1)]))


def plot(result: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
  steps, color = np.arange(1, result["steps"] + 1), dict(zip(PEERS, ("C0", "C1", "C2", "C3")))
  for name, curve in result["curves"].items(): top.plot(steps, curve, lw=1, color=color[name], label=PEERS[name])
  top.set(ylabel="training loss", title=f"{result['preset']} on {result['corpus']}, {result['precision']}, "
          f"B={result['batch']}, T={result['block']}, on {result['gpu']}")
  top.legend()
  for name, d in result["diff"].items():  # |difference| on a log scale: it sits orders below the curves' noise
    bottom.semilogy(steps, np.abs(np.asarray(result["curves"][name]) - result["curves"][REF]), lw=1, color=color[name],
                    label=f"|{PEERS[name]} - {PEERS[REF]}| (last {d['last']} steps: mean {d['mean_abs']:.2g})")
  bottom.axhline(result["noise"][REF], color="k", ls="--", lw=1,
                 label=f"{PEERS[REF]}'s noise: std over {result['window']} steps ({result['noise'][REF]:.2g})")
  bottom.set(xlabel="step", ylabel="|loss difference|")
  bottom.legend(fontsize=8)
  for ax in (top, bottom): ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--block", type=int, default=1024)
  ap.add_argument("--precision", default="bf16", choices=["fp32", "tf32", "bf16"])
  ap.add_argument("--lr", type=float, default=6e-4, help="the schedule's peak learning rate")
  ap.add_argument("--window", type=int, default=20, help="steps of the sliding window of the noise scale")
  ap.add_argument("--jax", action="store_true", help="and a JAX/XLA curve (benchmarks/jax_gpt.py)")
  ap.add_argument("--fp32-reference", action="store_true", help="and PyTorch eager in fp32: its distance to PyTorch "
                  "eager in --precision is what that precision's rounding alone does to the curve")
  ap.add_argument("--device", default="cuda")
  ap.add_argument("--quick", action="store_true", help="a dry run: char-tiny's 2-layer GPT, B=4, T=32, 20 steps")
  ap.add_argument("--out", help="the results file (default: benchmarks/results/loss_parity.json on a GPU, "
                  "loss_parity_cpu.json in the temporary directory on the CPU)")
  args = ap.parse_args()
  args.out = args.out or str(ROOT / "benchmarks" / "results" / "loss_parity.json" if args.device == "cuda" else
                             Path(tempfile.gettempdir()) / "loss_parity_cpu.json")
  require_gpu(args.device)
  from blutrain.train import TrainConfig, build_model
  shape = dict(preset="char-tiny", batch_size=4, block_size=32, steps=20) if args.quick else \
    dict(preset="gpt2", batch_size=args.batch, block_size=args.block, steps=args.steps)
  cfg = TrainConfig(tokenizer="bpe", lr=args.lr, **shape)
  last = min(100, cfg.steps // 2)
  batches, vocab = corpus_batches(cfg, cfg.steps)
  import blutrain as bt
  bt.manual_seed(cfg.seed)
  model = build_model(cfg, vocab)
  state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
  lrs = schedule(cfg)
  result = {**metadata("loss_parity", args.device), "preset": cfg.preset, "corpus": cfg.corpus,
            "tokenizer": f"bpe {vocab}", "model": model.config.to_dict(), "precision": args.precision,
            "batch": cfg.batch_size, "block": cfg.block_size, "steps": cfg.steps, "lr": lrs, "seed": cfg.seed,
            "window": args.window, "curves": {}, "step_s": {}, "errors": {}}
  model_cfg = model.config
  del model  # each run builds its own from `state`
  runs = {"blutrain_compile": lambda: run_blutrain(model_cfg, state, batches, args.precision, 1, True, args.device, lrs),
          "torch_eager": lambda: run_torch(model_cfg, state, batches, args.precision, 1, False, args.device, lrs),
          "jax_xla": lambda: run_jax(model_cfg, state, batches, args.precision, 1, args.device, lrs),
          "torch_eager_fp32": lambda: run_torch(model_cfg, state, batches, "fp32", 1, False, args.device, lrs)}
  names = ["blutrain_compile", "torch_eager"] + ["jax_xla"] * args.jax + ["torch_eager_fp32"] * args.fp32_reference
  for name in names:
    try:
      r = runs[name]()
    except Exception as e:  # a failed peer is reported, not hidden
      result["errors"][name] = f"{type(e).__name__}: {e}"
      print(name, "failed:", result["errors"][name], flush=True)
      continue
    result["curves"][name], result["step_s"][name] = r["losses"], r["step_s"]
    print(f"{name}: first loss {r['losses'][0]:.4f}, last {r['losses'][-1]:.4f}, {r['step_s'] * 1e3:.1f} ms/step "
          f"(first step {r['first_step_s']:.1f} s)", flush=True)
  curves = {k: np.asarray(v) for k, v in result["curves"].items()}
  result["noise"] = {k: noise(c, args.window, last) for k, c in curves.items()}
  result["diff"] = {}
  for name, c in curves.items():
    if name == REF or REF not in curves: continue
    d = np.abs(c - curves[REF])[-last:]
    result["diff"][name] = {"last": last, "max_abs": float(d.max()), "mean_abs": float(d.mean()),
                            "within_noise": bool(d.mean() <= result["noise"][REF])}
  rounding = result["diff"].get("torch_eager_fp32", {}).get("mean_abs")
  for name, d in result["diff"].items():
    # two runs rounding independently, each at that distance from the fp32 curve, lie up to twice it apart
    if rounding is not None and name != "torch_eager_fp32": d["within_fp32_rounding"] = d["mean_abs"] <= 2 * rounding
  write(result, args.out)
  print(f"noise (std over {args.window} steps, mean over the last {last}): "
        + ", ".join(f"{PEERS[k]} {v:.4f}" for k, v in result["noise"].items()))
  for name, d in result["diff"].items():
    print(f"{PEERS[name]} - {PEERS[REF]}, last {last} steps: max |d| {d['max_abs']:.3g}, mean |d| {d['mean_abs']:.3g}; "
          + ", ".join(f"{k}: {v}" for k, v in d.items() if k.startswith("within")))
  png = Path(args.out).with_suffix(".png")
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    print(f"matplotlib is not installed: {png} skipped (the curves are in {args.out})")
    return
  if REF in curves:
    plot(result, png)
    print(f"wrote {png}")
  else:
    print(f"no {PEERS[REF]} curve: {png} skipped")


if __name__ == "__main__":
  main()
