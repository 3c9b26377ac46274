"""layer_norm's backward at GPT-2's rows (16384 x 768) under schedules around the configurator's
(`norm_backward_schedule`: row tile, warps, programs per SM, row tiles in flight), against PyTorch eager's kernel and
torch.compile's for the same math in the same run, each with its GB/s and share of a device-to-device copy. The
figures behind the schedule (docs/configurator.md); writes benchmarks/results/norm_backward.json and prints a markdown
table.

  python benchmarks/norm_backward.py [--sweep] [--repeats 30] [--out PATH]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import blutrain as bt  # noqa: E402
from benchmarks.common import ROOT, copy_pad, metadata, require_gpu, table, time_calls, write  # noqa: E402
from blutrain import configurator  # noqa: E402
from blutrain.backend.cuda import runtime  # noqa: E402
from blutrain.backend.cuda.kernels import norm  # noqa: E402

M, N, EPS = 16384, 768, 1e-5
# (what, x, g, residual): the compiled bf16 GPT-2 step's layer norms take a bf16 gradient of a float32 residual stream
# and add the residual's float32 gradient; a float32 model's take float32 gradients
CASES = [("bf16 step: x f32, g bf16, + residual f32", bt.float32, bt.bfloat16, bt.float32),
         ("f32: x f32, g f32", bt.float32, bt.float32, None)]
SWEEP = dict(tile=((1, 2), (2, 4), (4, 4), (4, 8), (8, 8)), stages=(1, 2, 3), per_sm=(2, 4, 8))


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


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sweep", action="store_true", help="time the schedules around the configurator's")
  ap.add_argument("--repeats", type=int, default=30)
  ap.add_argument("--out", default=str(ROOT / "benchmarks/results/norm_backward.json"))
  args = ap.parse_args()
  require_gpu("cuda")
  bt.manual_seed(0)
  ours = dict(event=bt.cuda.Event, sync=bt.cuda.synchronize)
  theirs = dict(event=torch.cuda.Event, sync=torch.cuda.synchronize)
  src, dst = bt.randn(1 << 27, device="cuda"), bt.empty(1 << 27, device="cuda")
  copy, pad = copy_pad(src, dst, args.repeats, **ours)
  copy_gbps = 2 * src.numel() * 4 / copy["ms"] / 1e6
  tsrc, tdst = torch.randn(1 << 27, device="cuda"), torch.empty(1 << 27, device="cuda")
  _, tpad = copy_pad(tsrc, tdst, args.repeats, **theirs)
  compiled = torch.compile(torch_math)
  result, rows = {**metadata("norm_backward", "cuda"), "copy_gbps": copy_gbps, "M": M, "N": N, "cases": []}, []

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
  print(f"device-to-device copy: {copy_gbps:.0f} GB/s")
  table(["case", "implementation", "us", "GB/s", "of copy"], rows)
  write(result, args.out)


if __name__ == "__main__":
  main()
