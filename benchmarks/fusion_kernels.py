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
  clip+adamw             clip_grad_norm_(max_norm=1) then AdamW over GPT-2's 124M float32 parameters: the gradient
                         norm, then the scale pass and the update (unfused) or the update scaling as it reads (fused);
                         PyTorch: clip_grad_norm_(foreach=True) and AdamW(fused=True). Checked on fresh copies of one
                         state after one step each

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
from benchmarks.kernels import Inputs, allclose, gpt2_shapes  # noqa: E402
from blutrain import dtypes  # noqa: E402
from blutrain.ops.creation import scalar_operand  # noqa: E402
from blutrain.ops import registry  # noqa: E402
from blutrain.ops.core import apply  # noqa: E402

EPS = 1e-5


def _bits_equal(a, b) -> bool:
  a, b = ([*x] if isinstance(x, (list, tuple)) else [x] for x in (a, b))
  return all((x is None and y is None) or bool((x.float() == y.float()).all().item())
             for x, y in zip(a, b, strict=True))


class ClipAdamw:
  """clip_grad_norm_ then AdamW over GPT-2's parameters, three ways (`step(kind)`, kind "fused", "unfused" or
  "torch"), each on its own copy of one random state (`reset`)."""

  def __init__(self, S: Inputs):
    self.S, self.shapes = S, gpt2_shapes(512, 64, 64, 2) if S.small else gpt2_shapes(50304, 1024, 768, 12)
    self.numel = sum(torch.Size(s).numel() for s in self.shapes)
    self.state: dict = {}
    for kind in ("fused", "unfused", "torch"): self.reset(kind)

  def reset(self, kind: str) -> None:
    gen, dev = torch.Generator(self.S.device).manual_seed(1), self.S.device
    ts = [[torch.randn(s, device=dev, generator=gen) * k for s in self.shapes] for k in (0.02, 1e-2, 1e-3)]
    ts.append([torch.rand(s, device=dev, generator=gen) * 1e-5 for s in self.shapes])
    if kind == "torch":
      params = [p.clone().requires_grad_() for p in ts[0]]
      for p, g in zip(params, ts[1]): p.grad = g
      opt = torch.optim.AdamW(params, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
      opt.step()  # makes the moments, then set to the state's
      for p, m, v in zip(params, ts[2], ts[3]):
        opt.state[p]["exp_avg"].copy_(m); opt.state[p]["exp_avg_sq"].copy_(v); opt.state[p]["step"].fill_(3.0)
      with torch.no_grad():
        for p, p0 in zip(params, ts[0]): p.copy_(p0)
      self.state[kind] = (params, opt)
    else:
      ours = [[self.S.ours(t) for t in group] for group in ts]
      steps = [bt.full((), 3.0, dtype=bt.float64, device=self.S.device) for _ in self.shapes]
      self.state[kind] = (*ours, steps)

  def step(self, kind: str):
    if kind == "torch":
      params, opt = self.state[kind]
      torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
      opt.step()
      return params
    p, g, m, v, steps = self.state[kind]
    coef = (1.0 / (apply(registry["sum_squares"], *g).sqrt() + 1e-6)).clamp(max=1.0)
    lr = scalar_operand(6e-4, dtypes.float64, p[0].device)
    attrs = dict(n=len(p), beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    if kind == "fused":
      apply(registry["adamw"], *p, *g, *m, *v, *steps, lr, coef, into=[*p, *m, *v, *steps], **attrs, clip=True)
    else:
      apply(registry["scale"], *g, coef, into=g)
      apply(registry["adamw"], *p, *g, *m, *v, *steps, lr, into=[*p, *m, *v, *steps], **attrs)
    return p

  def check(self) -> tuple[float, bool, bool]:
    """(largest difference from PyTorch, within tolerance, fused == unfused bit for bit) after one step each."""
    for kind in ("fused", "unfused", "torch"): self.reset(kind)
    fused, unfused, theirs = (self.step(k) for k in ("fused", "unfused", "torch"))
    err, ok = allclose(1e-5, 1e-6)(fused, [t.detach() for t in theirs])
    return err, ok, _bits_equal(fused, unfused)


def cases(S: Inputs) -> dict:
  """name -> (shape, least bytes of the fused kernel, fused, unfused or None, torch, (rtol, atol) against torch, or a
  check() -> (max error, ok, fused == unfused))."""
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
                           unfused_add_ln, torch_add_ln, (1e-2, 2e-2))  # a bf16 output: 1 ulp is 2^-8 relative

  def torch_backward(gg, residual):
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(gg.float(), tx, [N], mean, rstd, tw, tb, [True, True, True])
    return (dx + residual if residual is not None else dx), dw, db

  def unfused_backward():
    dx, dw, db, _ = apply(lnb, g, x, w, None, n=1, eps=EPS, has_bias=True)
    return apply(add, r, dx), dw, db
  out["layer_norm_backward+residual"] = (f"({M}, {N}) bf16 g, f32 x, f32 r", M * N * (2 + 4 + 4 + 4),
                                         lambda: apply(lnb, g, x, w, r, n=1, eps=EPS, has_bias=True), unfused_backward,
                                         lambda: torch_backward(tg, tr), (1e-4, 1e-2))
  for name, gg, tgg in (("f32", g32, tg32), ("bf16", g, tg)):
    out[f"layer_norm_backward_{name}_g"] = (f"({M}, {N}) {name} g, f32 x", M * N * (gg.dtype.itemsize + 4 + 4),
                                           lambda gg=gg: apply(lnb, gg, x, w, None, n=1, eps=EPS, has_bias=True), None,
                                           lambda tgg=tgg: torch_backward(tgg, None), (1e-4, 1e-2))
  c = ClipAdamw(S)
  out["clip+adamw"] = (f"{len(c.shapes)} tensors, {c.numel / 1e6:.1f}M f32", 32 * c.numel, lambda: c.step("fused"),
                       lambda: c.step("unfused"), lambda: c.step("torch"), c.check)
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
      if callable(tol):
        err, ok, exact = tol()
      else:
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
