"""Memory-bound kernels of the CUDA backend against PyTorch's on the same GPU, through the public API: exp, gelu, add,
broadcast mul, cast, transposed copy, sum/amax over the last dim and dim 0, softmax, log_softmax, layer norm forward
and backward, cross-entropy forward and backward at GPT-2's shape, embedding forward and backward, fused AdamW over
GPT-2 124M's parameters, dropout. Per op: the least bytes it must move (reads + writes), the median GPU time of
event-timed calls, GB/s and its share of a device-to-device copy timed in the same run, PyTorch's time beside it, and
the largest difference from PyTorch's result (a fast but wrong kernel fails the check). Random inputs; writes
benchmarks/results/kernels.json and prints a markdown table.

  python benchmarks/kernels.py [--only exp,add,...] [--repeats 20] [--out PATH] [--device cpu (a tiny dry run)]
"""
from __future__ import annotations

import argparse
import gc
import math
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as TF

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import blutrain as bt  # noqa: E402
import blutrain.nn.functional as F  # noqa: E402
from benchmarks.common import NOMINAL_COPY_GBPS, ROOT, copy_pad, metadata, require_gpu, table, time_calls, write  # noqa: E402


@dataclass
class Case:
  shape: str
  nbytes: int                 # the least traffic: every input read once, every output written once
  ours: Callable
  theirs: Callable
  tol: tuple[float, float] = (1e-5, 1e-5)  # allclose's (rtol, atol) against PyTorch's result
  check: Callable | None = None            # (ours, theirs) -> (max error, ok), instead of allclose


class Inputs:
  """Random inputs drawn by torch on the device, and blutrain's own copies of them (DLPack, then a clone into
  blutrain's allocator). Sizes shrink on the CPU, where the run only checks the script."""

  def __init__(self, device: str):
    self.device, self.small = device, device != "cuda"
    self.gen = torch.Generator(device).manual_seed(0)

  def rows(self, n: int) -> int: return max(n // 1024, 4) if self.small else n

  def ours(self, t: torch.Tensor, grad: bool = False) -> bt.Tensor:
    if self.device == "cuda": torch.cuda.synchronize()
    x = bt.from_dlpack(t.detach()).clone()
    return x.requires_grad_() if grad else x

  def randn(self, *shape: int, scale: float = 1.0, grad: bool = False) -> tuple[bt.Tensor, torch.Tensor]:
    t = torch.randn(shape, device=self.device, generator=self.gen) * scale
    return self.ours(t, grad), t.requires_grad_(grad)

  def randint(self, high: int, *shape: int) -> tuple[bt.Tensor, torch.Tensor]:
    t = torch.randint(0, high, shape, device=self.device, generator=self.gen)
    return self.ours(t), t


def to_torch(x: bt.Tensor) -> torch.Tensor:
  x = x.detach()
  return torch.from_dlpack(x.float() if x.dtype is bt.bfloat16 else x).float()


def allclose(rtol: float, atol: float) -> Callable:
  def check(ours, theirs) -> tuple[float, bool]:
    ours, theirs = ([*x] if isinstance(x, (list, tuple)) else [x] for x in (ours, theirs))
    err, ok = 0.0, True
    for a, b in zip(ours, theirs, strict=True):
      a, b = to_torch(a), b.detach().float()
      err, ok = max(err, (a - b).abs().max().item()), ok and torch.allclose(a, b, rtol, atol)
    return err, ok
  return check


def gpt2_shapes(V: int, T: int, D: int, L: int) -> list[tuple[int, ...]]:
  """GPT-2's parameters (the LM head tied to the token embedding)."""
  block = [(D,), (D,), (3 * D, D), (3 * D,), (D, D), (D,), (D,), (D,), (4 * D, D), (4 * D,), (D, 4 * D), (D,)]
  return [(V, D), (T, D)] + block * L + [(D,), (D,)]


CASES: dict[str, Callable[[Inputs], Case]] = {}


def case(fn):
  CASES[fn.__name__] = fn
  return fn


# ops written alike in both libraries. name: (f(lib, x, y, v) with lib blutrain or torch, x and y (65536, 1024) and
# v (1024,) random float32; the inputs f reads; allclose's (rtol, atol)). Float32 sums of 1024 and 65536 terms taken
# in another order differ by about 1e-5 and 1e-3; a wrong kernel by far more.
SIMPLE = {
  "exp": (lambda m, x, y, v: x.exp(), "x", (1e-5, 1e-5)),
  "gelu_tanh": (lambda m, x, y, v: m.nn.functional.gelu(x, approximate="tanh"), "x", (1e-5, 1e-5)),
  "add": (lambda m, x, y, v: x + y, "xy", (0, 0)),
  "mul_broadcast": (lambda m, x, y, v: x * v, "xv", (0, 0)),
  "cast_bf16": (lambda m, x, y, v: x.to(m.bfloat16), "x", (0, 0)),
  "copy_transposed": (lambda m, x, y, v: x.t().contiguous(), "x", (0, 0)),
  "sum_last": (lambda m, x, y, v: x.sum(-1), "x", (1e-5, 1e-3)),
  "sum_dim0": (lambda m, x, y, v: x.sum(0), "x", (1e-4, 1e-2)),
  "amax_last": (lambda m, x, y, v: x.amax(-1), "x", (0, 0)),
  "amax_dim0": (lambda m, x, y, v: x.amax(0), "x", (0, 0)),
  "softmax": (lambda m, x, y, v: m.nn.functional.softmax(x, -1), "x", (1e-5, 1e-7)),
  "log_softmax": (lambda m, x, y, v: m.nn.functional.log_softmax(x, -1), "x", (1e-5, 1e-5)),
}


def _simple(name: str, f: Callable, reads: str, tol: tuple[float, float]) -> None:
  def make(S: Inputs) -> Case:
    R = S.rows(65536)
    (x, tx), (y, ty), (v, tv) = S.randn(R, 1024), S.randn(R, 1024), S.randn(1024)
    out = f(torch, tx, ty, tv)
    ins = {"x": tx, "y": ty, "v": tv}
    nbytes = sum(ins[k].numel() * 4 for k in reads) + out.numel() * out.element_size()
    shape = ", ".join(str(tuple(ins[k].shape)) for k in reads) + " f32"
    return Case(shape, nbytes, lambda: f(bt, x, y, v), lambda: f(torch, tx, ty, tv), tol)
  make.__name__ = name
  case(make)


for _name, _spec in SIMPLE.items(): _simple(_name, *_spec)


@case
def layer_norm(S):
  R, D = S.rows(65536), 768
  (x, tx), (w, tw), (b, tb) = S.randn(R, D), S.randn(D), S.randn(D)
  return Case(f"({R}, {D}) f32", 8 * R * D + 8 * D, lambda: F.layer_norm(x, (D,), w, b),
              lambda: TF.layer_norm(tx, (D,), tw, tb))


@case
def layer_norm_bwd(S):
  R, D = S.rows(65536), 768
  (x, tx), (w, tw), (b, tb) = S.randn(R, D, grad=True), S.randn(D, grad=True), S.randn(D, grad=True)
  g, tg = S.randn(R, D)
  y, ty = F.layer_norm(x, (D,), w, b), TF.layer_norm(tx, (D,), tw, tb)
  return Case(f"({R}, {D}) f32 -> dx, dw, db", 12 * R * D + 12 * D,
              lambda: bt.autograd.grad(y, (x, w, b), g, retain_graph=True),
              lambda: torch.autograd.grad(ty, (tx, tw, tb), tg, retain_graph=True), tol=(1e-4, 1e-2))


def _ce(S, grad: bool):
  N, C = S.rows(16384), 50304
  (z, tz), (y, ty) = S.randn(N, C, grad=grad), S.randint(C, N)
  return N, C, f"({N}, {C}) f32", z, tz, y, ty


@case
def cross_entropy(S):
  N, C, s, z, tz, y, ty = _ce(S, False)
  return Case(s, 4 * N * C + 8 * N, lambda: F.cross_entropy(z, y), lambda: TF.cross_entropy(tz, ty))


@case
def cross_entropy_bwd(S):
  N, C, s, z, tz, y, ty = _ce(S, True)
  loss, tloss = F.cross_entropy(z, y), TF.cross_entropy(tz, ty)
  return Case(s + " -> dlogits", 8 * N * C + 8 * N, lambda: bt.autograd.grad(loss, z, retain_graph=True),
              lambda: torch.autograd.grad(tloss, tz, retain_graph=True), tol=(1e-4, 1e-10))


def _emb(S, grad: bool):
  T, V, D = S.rows(65536), 1000 if S.small else 50304, 768
  (w, tw), (i, ti) = S.randn(V, D, grad=grad), S.randint(V, T)
  return T, V, D, f"{T} rows of ({V}, {D}) f32", w, tw, i, ti


@case
def embedding(S):
  T, V, D, s, w, tw, i, ti = _emb(S, False)
  return Case(s, 8 * T * D + 8 * T, lambda: F.embedding(i, w), lambda: TF.embedding(ti, tw), tol=(0, 0))


@case
def embedding_bwd(S):
  T, V, D, s, w, tw, i, ti = _emb(S, True)
  g, tg = S.randn(T, D)
  y, ty = F.embedding(i, w), TF.embedding(ti, tw)
  return Case(s + " -> dweight", 4 * T * D + 8 * T + 4 * V * D, lambda: bt.autograd.grad(y, w, g, retain_graph=True),
              lambda: torch.autograd.grad(ty, tw, tg, retain_graph=True))


@case
def adamw(S):
  shapes = gpt2_shapes(512, 64, 64, 2) if S.small else gpt2_shapes(50304, 1024, 768, 12)
  ps, tps = [], []
  for shape in shapes:
    (p, tp), (g, tg) = S.randn(*shape, scale=0.02, grad=True), S.randn(*shape, scale=1e-3)
    p.grad, tp.grad = g, tg
    ps.append(p)
    tps.append(tp)
  opt = bt.optim.AdamW(ps, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
  topt = torch.optim.AdamW(tps, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
  n = sum(math.prod(s) for s in shapes)

  def step(o, params):
    o.step()
    return params
  # each call reads param, grad and both moments and writes param and moments; both sides take the same steps
  return Case(f"{len(shapes)} tensors, {n / 1e6:.1f}M f32", 28 * n, lambda: step(opt, ps), lambda: step(topt, tps),
              tol=(1e-5, 1e-6))


@case
def dropout(S):
  R, p = S.rows(65536), 0.1
  x, tx = S.randn(R, 1024)

  def check(out, _) -> tuple[float, bool]:
    o, ref = to_torch(out), tx * (1.0 / (1.0 - p))
    kept = o != 0
    err, frac = (o[kept] - ref[kept]).abs().max().item(), kept.float().mean().item()
    print(f"  dropout: kept {frac:.4f} (expected {1 - p})", flush=True)
    return err, torch.allclose(o[kept], ref[kept], 1e-6, 0) and abs(frac - (1 - p)) < 0.01
  return Case(f"({R}, 1024) f32, p={p}", 8 * R * 1024, lambda: F.dropout(x, p), lambda: TF.dropout(tx, p), check=check)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--only", help=f"comma-separated names of: {', '.join(CASES)}")
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernels.json"))
  ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
  args = ap.parse_args()
  names = args.only.split(",") if args.only else list(CASES)
  unknown = [n for n in names if n not in CASES]
  if unknown: sys.exit(f"unknown benchmark(s) {unknown}; choose from {list(CASES)}")
  require_gpu(args.device)
  S = Inputs(args.device)
  gpu = args.device == "cuda"
  n = 64 << 10 if S.small else 256 << 20  # 1 GiB of float32
  (src, tsrc), (dst, tdst) = S.randn(n), S.randn(n)
  clocks = [(bt.cuda.Event, bt.cuda.synchronize) if gpu else (None, None),
            (torch.cuda.Event, torch.cuda.synchronize) if gpu else (None, None)]
  (ours_copy, ours_pad), (torch_copy, torch_pad) = (copy_pad(a, b, args.repeats, *c)
                                                    for a, b, c in ((src, dst, clocks[0]), (tsrc, tdst, clocks[1])))
  copy_gbps = {k: 8 * n / t["ms"] / 1e6 for k, t in (("blutrain", ours_copy), ("torch", torch_copy))}
  ceiling = max(copy_gbps.values())
  result = {**metadata("kernels", args.device), "repeats": args.repeats, "copy_bytes": 8 * n, "copy_gbps": copy_gbps,
            "nominal_copy_gbps": NOMINAL_COPY_GBPS, "ops": {}}
  print(f"copy ceiling ({4 * n >> 20} MiB device-to-device): blutrain {copy_gbps['blutrain']:.0f} GB/s, "
        f"torch {copy_gbps['torch']:.0f} GB/s, nominal {NOMINAL_COPY_GBPS:.0f}", flush=True)
  rows = []
  for name in names:
    try:
      c = CASES[name](S)
      ours = time_calls(c.ours, args.repeats, *clocks[0], ours_pad if gpu else None)
      theirs = time_calls(c.theirs, args.repeats, *clocks[1], torch_pad if gpu else None)
      if gpu: bt.cuda.synchronize()
      err, ok = (c.check or allclose(*c.tol))(c.ours(), c.theirs())
      gbps, tgbps = c.nbytes / ours["ms"] / 1e6, c.nbytes / theirs["ms"] / 1e6
      r = {"shape": c.shape, "bytes": c.nbytes, "ms": ours["ms"], "host_ms": ours["host_ms"], "gbps": gbps,
           "pct_copy": 100 * gbps / ceiling, "pct_nominal": 100 * gbps / NOMINAL_COPY_GBPS, "torch_ms": theirs["ms"],
           "torch_host_ms": theirs["host_ms"], "torch_gbps": tgbps, "ratio": ours["ms"] / theirs["ms"],
           "max_err": err, "ok": bool(ok)}
      rows.append([name, c.shape, c.nbytes / 2**20, r["ms"], gbps, r["pct_copy"], r["torch_ms"], tgbps, r["ratio"],
                   r["host_ms"], err, "yes" if ok else "**NO**"])
    except Exception as e:  # a failed op is reported, not hidden, and the others still run
      traceback.print_exc()
      r = {"error": f"{type(e).__name__}: {e}"}
      rows.append([name, r["error"][:80]] + [None] * 10)
    result["ops"][name] = r
    print(f"{name}: {r['error']}" if "error" in r else
          f"{name}: ours {r['ms']:.4f} ms ({r['gbps']:.0f} GB/s, {r['pct_copy']:.0f}% of copy), torch {r['torch_ms']:.4f} ms, "
          f"ours/torch {r['ratio']:.2f}, max err {r['max_err']:.2e} {'ok' if r['ok'] else 'MISMATCH'}", flush=True)
    c = None
    gc.collect()
  write(result, args.out)
  print(f"\n{result['gpu']}, {result['date']}; % copy: of the faster measured copy ({ceiling:.0f} GB/s; nominal "
        f"{NOMINAL_COPY_GBPS:.0f}); ms: median GPU time of {args.repeats}; ratio: ours / torch time\n")
  table(["op", "shape", "MiB moved", "ours ms", "ours GB/s", "% copy", "torch ms", "torch GB/s", "ours/torch",
         "ours host ms", "max err", "ok"], rows)


if __name__ == "__main__":
  main()
