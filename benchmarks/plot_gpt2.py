"""A bar chart of a train_gpt2.py results file: tokens/s of every run, grouped by precision, each bar labelled with
its tokens/s and peak memory (needs matplotlib, which only this script and loss_parity.py's plot use).

  python benchmarks/plot_gpt2.py benchmarks/results/train_gpt2_s17_all.json [--out PATH.png]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

NAMES = {"blutrain_compile": "blutrain compiled", "torch_compile": "torch.compile", "jax_xla": "JAX/XLA",
         "blutrain_eager": "blutrain eager", "torch_eager": "PyTorch eager"}


def plot(result: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  runs = result["runs"]
  precisions = list(dict.fromkeys(key.split("/")[1] for key in runs))
  frameworks = [f for f in NAMES if any(f"{f}/{p}" in runs for p in precisions)]
  fig, ax = plt.subplots(figsize=(10, 4.8))
  width = 0.8 / len(frameworks)
  for i, f in enumerate(frameworks):
    for j, p in enumerate(precisions):
      r = runs.get(f"{f}/{p}")
      if r is None or "tokens_per_s" not in r: continue
      x = j + (i - (len(frameworks) - 1) / 2) * width
      ax.bar(x, r["tokens_per_s"] / 1e3, width, color=f"C{i}", label=NAMES[f] if j == 0 else None)
      ax.text(x, r["tokens_per_s"] / 1e3, f"{r['tokens_per_s'] / 1e3:.0f}K\n{r['peak_bytes'] / 2**30:.1f} GiB",
              ha="center", va="bottom", fontsize=7)
  ax.set_xticks(range(len(precisions)), [p if p != "bf16" else "bf16 autocast" for p in precisions])
  ax.set_ylabel("tokens/s (thousands)")
  ax.set_title(f"GPT-2 124M training step, B={result['batch']}, T={result['block']}, on {result['gpu']}, "
               f"{result['date']} (labels: tokens/s, peak memory)", fontsize=9)
  ax.legend(fontsize=8)
  ax.margins(y=0.15)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("results")
  ap.add_argument("--out", help="the image (default: the results file's name with .png)")
  args = ap.parse_args()
  out = Path(args.out or Path(args.results).with_suffix(".png"))
  plot(json.loads(Path(args.results).read_text()), out)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
