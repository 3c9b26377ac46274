"""How many programs a per-channel reduction wants: batch norm's statistics and its backward's sums over ResNet-18's
channels-last activations (bf16, batch 128), timed with the reduction cut into the configurator's number of pieces
(`split_rule`) and into fixed multiples of the SMs, each with its GB/s and share of a device-to-device copy timed in
the same run. The figures behind `split_rule`'s bytes in flight (docs/configurator.md); writes
benchmarks/results/reduce_split.json and prints a markdown table.

  python benchmarks/reduce_split.py [--per-sm 1,2,4,8,16] [--repeats 30] [--out PATH]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import blutrain as bt  # noqa: E402
from benchmarks.common import NOMINAL_COPY_GBPS, ROOT, copy_ceiling, metadata, require_gpu, table, time_calls, write  # noqa: E402
from blutrain import configurator  # noqa: E402
from blutrain.backend.cuda import runtime  # noqa: E402
from blutrain.backend.cuda.kernels import norm  # noqa: E402

SHAPES = [(128, 64, 112, 112), (128, 64, 56, 56), (128, 128, 28, 28), (128, 256, 14, 14), (128, 512, 7, 7)]


def pieces_as(per_sm: int | None):
  """split_rule itself (None), or a rule giving per_sm programs per SM (at least 2 tiles each)."""
  if per_sm is None: return configurator.split_rule
  return lambda m_blocks, N, block_n, *a, hw=configurator.H200, **k: \
    max(1, min(configurator.cdiv(per_sm * hw.sms, m_blocks), N // (2 * block_n)))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--per-sm", default="1,2,4,8,16")
  ap.add_argument("--repeats", type=int, default=30)
  ap.add_argument("--out", default=str(ROOT / "benchmarks/results/reduce_split.json"))
  args = ap.parse_args()
  require_gpu("cuda")
  bt.manual_seed(0)
  clock = dict(event=bt.cuda.Event, sync=bt.cuda.synchronize)
  copy_gbps, pad = copy_ceiling(args.repeats)
  rules = [None, *(int(p) for p in args.per_sm.split(","))]
  result, rows = {**metadata("reduce_split", "cuda"), "copy_gbps": copy_gbps, "cases": []}, []
  for shape in SHAPES:
    x = bt.randn(*shape, device="cuda").to(bt.bfloat16).contiguous(memory_format=bt.channels_last)
    g = bt.randn(*shape, device="cuda").to(bt.bfloat16).contiguous(memory_format=bt.channels_last)
    xa, ga = x._array(), g._array()
    mean, var = norm.batch_norm_stats(xa)
    for what, fn, nbytes in (("stats", lambda: norm.batch_norm_stats(xa), x.numel() * 2),
                             ("backward sums", lambda: norm.batch_norm_backward(
                               ga, xa, mean, var, None, eps=1e-5, training=True, input_grad=False, weight_grad=True,
                               bias_grad=True), 2 * x.numel() * 2)):
      for rule in rules:
        norm.split_rule = pieces_as(rule)
        norm.reduce_plan.cache_clear()
        grad = what != "stats"
        S = norm.reduce_plan(grad, xa.dtype, *((ga.dtype, mean.dtype, var.dtype) if grad else (None,) * 3), xa.shape,
                             xa.strides, ga.strides if grad else None, 1e-5, runtime.hardware(xa.device))[3]
        t = time_calls(fn, args.repeats, pad=pad, **clock)
        gbps = nbytes / t["ms"] / 1e6
        case = {"shape": shape, "what": what, "per_sm": rule, "splits": S, "ms": t["ms"], "gbps": gbps}
        result["cases"].append(case)
        rows.append([str(shape), what, "split_rule" if rule is None else rule, S, t["ms"] * 1e3, gbps,
                     gbps / copy_gbps])
  norm.split_rule = configurator.split_rule
  print(f"device-to-device copy: {copy_gbps:.0f} GB/s (nominal {NOMINAL_COPY_GBPS:.0f})")
  table(["shape (channels-last)", "reduction", "programs per SM", "splits", "us", "GB/s", "of copy"], rows)
  write(result, args.out)


if __name__ == "__main__":
  main()
