"""GPT-2's memory-bound row kernels at its rows (16384 x 768) under schedules around the configurator's: layer_norm's
backward (`norm_backward_schedule`: row tile, warps, programs per SM, row tiles in flight), its forward and the
fused residual add (`row_schedule`'s tile and warps), and the bias gradients' sums over rows (REDUCE_STAGES, tiles in
flight), against PyTorch eager's kernels and torch.compile's for the same math in the same run, each with its GB/s and
share of a device-to-device copy. The figures behind those schedules (docs/configurator.md); writes
benchmarks/results/row_kernels.json and prints a markdown table.

  python benchmarks/row_kernels.py [--sweep] [--repeats 30] [--out PATH]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import blutrain as bt  # noqa: E402
from benchmarks.common import ROOT, copy_ceiling, copy_pad, metadata, require_gpu, table, time_calls, write  # noqa: E402
from blutrain import configurator  # noqa: E402
from blutrain.backend.cuda import runtime  # noqa: E402
from blutrain.backend.cuda.kernels import norm, reduce  # noqa: E402

M, N, EPS = 16384, 768, 1e-5
# (what, x, g, residual): the compiled bf16 GPT-2 step's layer norms take a bf16 gradient of a float32 residual stream
# and add the residual's float32 gradient; a float32 model's take float32 gradients
CASES = [("bf16 step: x f32, g bf16, + residual f32", bt.float32, bt.bfloat16, bt.float32),
         ("f32: x f32, g f32", bt.float32, bt.float32, None)]
SWEEP = dict(tile=((1, 2), (2, 4), (4, 4), (4, 8), (8, 8)), stages=(1, 2, 3), per_sm=(2, 4, 8))
FORWARD_TILES = ((1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8))  # (rows, warps) of 1024-wide tiles
BIAS_COLUMNS, REDUCE_STAGES = (768, 2304, 3072), (1, 2, 3, 4)


def schedules(sweep: bool) -> list[tuple[str, configurator.NormBackward]]:
  """The configurator's schedule first, then (with sweep) each tile (rows, warps) x stages x programs per SM."""
  sms = runtime.hardware(0).sms
  base = configurator.norm_backward_schedule(M, N, sms)
  out = [("configurator", base)]
  if not sweep: return out
  for (bm, warps), stages, per_sm in itertools.product(*SWEEP.values()):
    rows = configurator.cdiv(configurator.cdiv(M, bm), per_sm * sms) * bm
    s = base._replace(block_m=bm, warps=warps, rows=rows, stages=stages)
    if s != base: out.append((f"{bm} x {base.block_n}, {warps} warps, {stages} stages, {per_sm}/SM", s))
  return out


def torch_math(g, x, w, r):
  """The backward recomputing the row statistics from x, as blutrain's kernel does (torch.compile's peer)."""
  mean = x.mean(-1, keepdim=True)
  xc = x - mean
  rstd = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + EPS)
  xhat, gf = xc * rstd, g.float()
  gw = gf * w
  dx = rstd * (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True))
  return (dx if r is None else dx + r), (gf * xhat).sum(0), gf.sum(0)


def forward(args, record, pad, tpad, ours, theirs) -> None:
  """layer_norm (x float32 -> bf16, as autocast's) and add_layer_norm (x float32 + a bf16 branch), each tile."""
  x, y = bt.randn(M, N, device="cuda") * 2 + 1, bt.randn(M, N, device="cuda").to(bt.bfloat16)
  w, b = bt.randn(N, device="cuda"), bt.randn(N, device="cuda")
  xa, ya, wa, ba = (t._array() for t in (x, y, w, b))
  base = configurator.row_schedule(M, N)
  tiles = [("configurator", base)] + [(f"{bm} x {base[1]}, {warps} warps", (bm, base[1], warps, True))
                                      for bm, warps in FORWARD_TILES if args.sweep and (bm, warps) != (base[0], base[2])]
  for what, nbytes, fn in (
      ("layer_norm f32 -> bf16", M * N * 6,
       lambda s: norm.layer_norm(xa, wa, ba, 1, EPS, bt.bfloat16, schedule=s)),
      ("add_layer_norm f32 + bf16", M * N * 12,
       lambda s: norm.add_layer_norm(xa, ya, wa, ba, 1, EPS, bt.bfloat16, schedule=s))):
    for label, s in tiles:
      record(what, f"blutrain {label}", time_calls(lambda s=s: fn(s), args.repeats, pad=pad, **ours), nbytes)
  tx, ty, tw, tb = (torch.from_dlpack(t) for t in (x, y, w, b))
  plain = lambda: torch.nn.functional.layer_norm(tx, (N,), tw, tb, EPS).to(torch.bfloat16)

  def added():
    h = tx + ty.float()
    return h, torch.nn.functional.layer_norm(h, (N,), tw, tb, EPS).to(torch.bfloat16)
  for what, nbytes, fn in (("layer_norm f32 -> bf16", M * N * 6, plain), ("add_layer_norm f32 + bf16", M * N * 12, added)):
    record(what, "torch.compile", time_calls(torch.compile(fn), args.repeats, pad=tpad, **theirs), nbytes)
    record(what, "PyTorch eager", time_calls(fn, args.repeats, pad=tpad, **theirs), nbytes)


def bias_gradients(args, record, pad, tpad, ours, theirs) -> None:
  """The bf16 sums over GPT-2's 16384 rows of 768, 2304 and 3072 columns (its linears' bias gradients)."""
  for cols in BIAS_COLUMNS:
    g = bt.randn(16, M // 16, cols, device="cuda").to(bt.bfloat16)
    ga, what, nbytes = g._array(), f"bias gradient: bf16 sum over {M} rows of {cols}", M * cols * 2
    for stages in (None, *(REDUCE_STAGES if args.sweep else ())):
      fn = lambda stages=stages: reduce.reduce(ga, (0, 1), True, "sum", bt.bfloat16, stages)
      label = "configurator" if stages is None else f"{stages} stages"
      record(what, f"blutrain {label}", time_calls(fn, args.repeats, pad=pad, **ours), nbytes)
    tg = torch.from_dlpack(g)
    total = lambda: tg.sum((0, 1), keepdim=True)
    record(what, "torch.compile", time_calls(torch.compile(total), args.repeats, pad=tpad, **theirs), nbytes)
    record(what, "PyTorch eager", time_calls(total, args.repeats, pad=tpad, **theirs), nbytes)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sweep", action="store_true", help="time the schedules around the configurator's")
  ap.add_argument("--repeats", type=int, default=30)
  ap.add_argument("--out", default=str(ROOT / "benchmarks/results/row_kernels.json"))
  args = ap.parse_args()
  require_gpu("cuda")
  bt.manual_seed(0)
  ours = dict(event=bt.cuda.Event, sync=bt.cuda.synchronize)
  theirs = dict(event=torch.cuda.Event, sync=torch.cuda.synchronize)
  copy_gbps, pad = copy_ceiling(args.repeats)
  tsrc, tdst = torch.randn(1 << 27, device="cuda"), torch.empty(1 << 27, device="cuda")
  _, tpad = copy_pad(tsrc, tdst, args.repeats, **theirs)
  compiled = torch.compile(torch_math)
  result, rows = {**metadata("row_kernels", "cuda"), "copy_gbps": copy_gbps, "M": M, "N": N, "cases": []}, []

  def record(what: str, impl: str, t: dict, nbytes: int) -> None:
    gbps = nbytes / t["ms"] / 1e6
    result["cases"].append({"case": what, "impl": impl, "us": t["ms"] * 1e3, "gbps": gbps})
    rows.append([what, impl, t["ms"] * 1e3, gbps, gbps / copy_gbps])

  for what, xd, gd, rd in CASES:
    x, g, w = (bt.randn(M, N, device="cuda") * 2 + 1).to(xd), bt.randn(M, N, device="cuda").to(gd), bt.randn(N, device="cuda")
    r = None if rd is None else bt.randn(M, N, device="cuda").to(rd)
    xa, ga, wa, ra = (None if t is None else t._array() for t in (x, g, w, r))
    nbytes = M * N * (xd.itemsize * 2 + gd.itemsize + (rd.itemsize if rd else 0))  # x, g, r read; dx written
    for label, s in schedules(args.sweep):
      fn = lambda s=s: norm.layer_norm_backward(ga, xa, wa, ra, n=1, eps=EPS, has_bias=True, schedule=s)
      record(what, f"blutrain {label}", time_calls(fn, args.repeats, pad=pad, **ours), nbytes)
    tx, tg, tw = (torch.from_dlpack(t) for t in (x, g, w))
    tr = None if r is None else torch.from_dlpack(r)
    record(what, "torch.compile (same math)", time_calls(lambda: compiled(tg, tx, tw, tr), args.repeats, pad=tpad,
                                                          **theirs), nbytes)
    mean, rstd = tx.mean(-1, keepdim=True), torch.rsqrt(tx.var(-1, unbiased=False, keepdim=True) + EPS)
    tgf = tg.float()  # ATen's kernel takes a gradient of x's dtype: the cast is not timed
    aten = torch.ops.aten.native_layer_norm_backward

    def eager():
      dx = aten(tgf, tx, [N], mean, rstd, tw, tw, [True, True, True])[0]
      return dx if tr is None else dx.add_(tr)
    record(what, "PyTorch eager (ATen, g as float32)", time_calls(eager, args.repeats, pad=tpad, **theirs), nbytes)
  forward(args, record, pad, tpad, ours, theirs)
  bias_gradients(args, record, pad, tpad, ours, theirs)
  print(f"device-to-device copy: {copy_gbps:.0f} GB/s")
  table(["case", "implementation", "us", "GB/s", "of copy"], rows)
  write(result, args.out)


if __name__ == "__main__":
  main()
