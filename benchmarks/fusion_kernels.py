"""Nova's norm fusions at the GPT-2 124M step's shapes (B=16, T=1024: 16384 rows of 768) under bf16 autocast: each
sequence of kernels the compiled step ran before the fusion ("unfused"), the fused kernel that replaces it, and
PyTorch's kernels for the same work; median GPU time of CUDA-event-timed calls, GB/s of the fused kernel's least
traffic and its share of a device-to-device copy measured in the same run. Checks: fused == unfused bit for bit, and
both against PyTorch's result. Writes benchmarks/results/fusion_kernels.json and prints a markdown table.

  add_layer_norm         h = x + y (x float32, y bf16: the residual stream and a branch's output), n = layer_norm(h)
                         in bf16 for the next matmul; 24 of GPT-2's 25 norms, per forward
  layer_norm_backward    the norm's backward (bf16 incoming gradient, float32 x) and the residual gradient's add
  +residual              (float32); 24 per backward
  layer_norm_backward    the backward alone, float32 and bf16 incoming gradients, against PyTorch's

  python benchmarks/fusion_kernels.py [--repeats 20] [--out PATH] [--device cpu (a tiny dry run of the script)]
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as TF

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import blutrain as bt  # noqa: E402
from benchmarks.common import NOMINAL_COPY_GBPS, ROOT, copy_pad, metadata, require_gpu, table, time_calls, write  # noqa: E402
from benchmarks.kernels import Inputs, allclose  # noqa: E402
from blutrain.ops import registry  # noqa: E402
from blutrain.ops.core import apply  # noqa: E402

EPS = 1e-5


def _bits_equal(a, b) -> bool:
  a, b = ([*x] if isinstance(x, (list, tuple)) else [x] for x in (a, b))
  return all((x is None and y is None) or bool((x.float() == y.float()).all().item()) for x, y in zip(a, b, strict=True))


def cases(S: Inputs) -> dict:
  """name -> (shape, least bytes of the fused kernel, fused, unfused or None, torch, (rtol, atol) against torch)."""
  M, N = S.rows(16384), 768
  (x, tx), (y32, ty32), (w, tw), (b, tb) = S.randn(M, N, scale=2.0), S.randn(M, N), S.randn(N), S.randn(N)
  y, ty = y32.to(bt.bfloat16), ty32.to(torch.bfloat16)
  (g32, tg32), (r, tr) = S.randn(M, N), S.randn(M, N)
  g, tg = g32.to(bt.bfloat16), tg32.to(torch.bfloat16)
  _, mean, rstd = torch.ops.aten.native_layer_norm(tx, [N], tw, tb, EPS)
  ln, lnb, add = registry["layer_norm"], registry["layer_norm_backward"], registry["add"]
  out = {}

  def torch_add_ln():
    h = tx + ty
    return h, TF.layer_norm(h, (N,), tw, tb, EPS).to(torch.bfloat16)

  def unfused_add_ln():
    h = apply(add, x, y)
    return h, apply(ln, h, w, b, n=1, eps=EPS, dtype=bt.bfloat16)
  out["add_layer_norm"] = (f"({M}, {N}) f32 + bf16 -> f32, bf16", M * N * (4 + 2 + 4 + 2),
                           lambda: apply(registry["add_layer_norm"], x, y, w, b, n=1, eps=EPS, dtype=bt.bfloat16),
                           unfused_add_ln, torch_add_ln, (1e-5, 2e-2))

  def torch_backward(gg, residual):
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(gg.float(), tx, [N], mean, rstd, tw, tb, [True, True, True])
    return (dx + residual if residual is not None else dx), dw, db

  def unfused_backward():
    dx, dw, db = apply(lnb, g, x, w, None, n=1, eps=EPS, has_bias=True)
    return apply(add, r, dx), dw, db
  out["layer_norm_backward+residual"] = (f"({M}, {N}) bf16 g, f32 x, f32 r", M * N * (2 + 4 + 4 + 4),
                                         lambda: apply(lnb, g, x, w, r, n=1, eps=EPS, has_bias=True), unfused_backward,
                                         lambda: torch_backward(tg, tr), (1e-4, 1e-2))
  for name, gg, tgg in (("f32", g32, tg32), ("bf16", g, tg)):
    out[f"layer_norm_backward_{name}_g"] = (f"({M}, {N}) {name} g, f32 x", M * N * (gg.dtype.itemsize + 4 + 4),
                                           lambda gg=gg: apply(lnb, gg, x, w, None, n=1, eps=EPS, has_bias=True), None,
                                           lambda tgg=tgg: torch_backward(tgg, None), (1e-4, 1e-2))
  return out


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fusion_kernels.json"))
  ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
  args = ap.parse_args()
  require_gpu(args.device)
  S = Inputs(args.device)
  gpu = args.device == "cuda"
  n = 64 << 10 if S.small else 256 << 20
  (src, tsrc), (dst, tdst) = S.randn(n), S.randn(n)
  clocks = [(bt.cuda.Event, bt.cuda.synchronize) if gpu else (None, None),
            (torch.cuda.Event, torch.cuda.synchronize) if gpu else (None, None)]
  (ours_copy, ours_pad), (torch_copy, torch_pad) = (copy_pad(a, b_, args.repeats, *c)
                                                    for a, b_, c in ((src, dst, clocks[0]), (tsrc, tdst, clocks[1])))
  ceiling = max(8 * n / t["ms"] / 1e6 for t in (ours_copy, torch_copy))
  result = {**metadata("fusion_kernels", args.device), "repeats": args.repeats, "copy_gbps": ceiling, "cases": {}}
  rows = []
  for name, (shape, nbytes, fused, unfused, theirs, tol) in cases(S).items():
    try:
      t_fused = time_calls(fused, args.repeats, *clocks[0], ours_pad if gpu else None)
      t_unfused = unfused and time_calls(unfused, args.repeats, *clocks[0], ours_pad if gpu else None)
      t_torch = time_calls(theirs, args.repeats, *clocks[1], torch_pad if gpu else None)
      if gpu: bt.cuda.synchronize()
      got = fused()
      exact = None if unfused is None else _bits_equal(got, unfused())
      err, ok = allclose(*tol)(got, theirs())
      gbps = nbytes / t_fused["ms"] / 1e6
      c = {"shape": shape, "bytes": nbytes, "fused_ms": t_fused["ms"], "unfused_ms": t_unfused and t_unfused["ms"],
           "torch_ms": t_torch["ms"], "gbps": gbps, "pct_copy": 100 * gbps / ceiling,
           "fused_equals_unfused": exact, "max_err_vs_torch": err, "ok": bool(ok) and exact is not False}
    except Exception as e:  # a failed case is reported, not hidden, and the others still run
      traceback.print_exc()
      c = {"shape": shape, "error": f"{type(e).__name__}: {e}"}
    result["cases"][name] = c
    rows.append([name, shape, *(None,) * 8, c["error"][:80]] if "error" in c else
                [name, shape, c["unfused_ms"], c["fused_ms"], c["torch_ms"],
                 c["unfused_ms"] and c["unfused_ms"] / c["fused_ms"], c["fused_ms"] / c["torch_ms"], c["gbps"],
                 c["pct_copy"], {None: "-", True: "yes", False: "**NO**"}[exact], "yes" if c["ok"] else "**NO**"])
  write(result, args.out)
  print(f"\n{result['gpu']}, {result['date']}; ms: median GPU time of {args.repeats}; GB/s of the fused kernel's least "
        f"traffic; % copy of {ceiling:.0f} GB/s (nominal {NOMINAL_COPY_GBPS:.0f})\n")
  table(["case", "shape", "unfused ms", "fused ms", "torch ms", "unfused/fused", "fused/torch", "GB/s", "% copy",
         "bits == unfused", "ok"], rows)


if __name__ == "__main__":
  main()
