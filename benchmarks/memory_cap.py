"""Training under a memory cap (default 12 GiB, as on a 12 GB card), GPT at T=1024 with fused AdamW and clipping:

- the largest batch that trains, for blutrain compiled (Nova: memory plan, remat under the cap), PyTorch eager and
  torch.compile (about 40 s of compilation per probe), in TF32 and bf16 autocast (--impls, --precisions);
- the largest GPT shape (layers x width, from --presets, in order of size) that blutrain compiled trains at B=8 in
  TF32 where PyTorch eager runs out of memory.

Each probe (one implementation, precision, shape and batch) runs in a subprocess of its own under the cap
(`bt.cuda.set_memory_limit`, which caps the device allocator and the CUDA graph pools together;
`torch.cuda.set_per_process_memory_fraction`) and trains without an out-of-memory error: 2 steps eagerly
(torch.compile: 3); for blutrain compiled, 4 calls at the batch probed: the first call's graph (it creates the
optimizer's state, run once under its own plan: no eager step), the kernel-by-kernel run of the steady plan, the
capture and replay of its graph and one more replay. The batch search doubles from --start, then bisects down to --step.
Each blutrain row reports the plan's peak (the step's inputs plus its arena) beside the measured peaks: what the
device allocator and the graph pools reserved together (what the cap caps) and what was allocated during the last
replay (the device allocator's peak plus the graph pool's). JSON to benchmarks/results/memory_cap.json.

  python benchmarks/memory_cap.py [--cap-gib 12] [--precisions tf32,bf16] [--impls torch_eager,blutrain_compile,
                                   torch_compile] [--start 8] [--step 4] [--quick]

Each probe prints its time: on an H200 (2026-12-01) about 10 s for PyTorch eager and blutrain compiled, about 40 s for
torch.compile; the TF32 searches of the first two took 71 s together. --quick leaves the shape search out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GiB = 1 << 30
PRESETS = "12x768,16x768,20x768,24x768,24x1024,32x1024"  # layers x width, in order of size; 64-wide heads


def _shape(preset: str) -> dict:
  layers, width = (int(n) for n in preset.split("x"))
  return dict(n_layer=layers, n_embd=width, n_head=width // 64)


def _is_oom(e: BaseException) -> bool:
  return "out of memory" in str(e).lower() or "ALLOC_FAILED" in str(e) or type(e).__name__ == "OutOfMemoryError"


# *** one probe, in its own process ***

def probe_blutrain(a) -> dict:
  import blutrain as bt
  from blutrain.models import GPT, GPTConfig
  from blutrain.train import training_step
  bt.cuda.set_memory_limit(int(a.cap_gib * GiB))
  bt.set_float32_matmul_precision("high")
  bt.manual_seed(0)
  model = GPT(GPTConfig(block_size=a.block, **_shape(a.preset))).to("cuda")
  step = bt.compile(training_step(model, model.configure_optimizers(0.1, 6e-4, fused=True)))
  bf16 = a.precision == "bf16"
  ctx = (lambda: bt.autocast(device_type="cuda", dtype=bt.bfloat16)) if bf16 else contextlib.nullcontext
  x, y = (bt.randint(50257, (a.batch, a.block)).to("cuda") for _ in range(2))
  for i in range(4):
    if i == 3: bt.cuda.reset_peak_memory_stats()
    with ctx(): loss = step(x, y)
    loss.item()
    if i == 0: first = step.info.get("planned_peak_bytes")  # the plan of the first call's graph, run once
  exe = next(iter(step._entries.values()))
  s, pool = bt.cuda.memory_stats(), exe.pool.scratch.memory_stats()
  remat = step.info.get("remat") or {}
  return {"loss": float(loss.item()), "planned_peak_bytes": exe.planned_peak(), "first_call_planned_peak_bytes": first,
          "arena_bytes": getattr(exe.fn, "arena_bytes", 0),
          "measured_reserved_peak_bytes": s["limited_reserved_bytes.all.peak"],
          "replay_allocated_peak_bytes": s["allocated_bytes.all.peak"] + pool["allocated_bytes.all.peak"],
          "memory_budget": step.info.get("memory_budget"), "cuda_graph": step.info.get("cuda_graph"),
          "remat": {k: remat.get(k) for k in ("bytes_saved", "flops_share", "over_budget", "live_peak_after")}}


def probe_torch(a, compiled: bool) -> dict:
  import torch
  from benchmarks.torch_gpt import GPT as TorchGPT, training_step
  from blutrain.models import GPTConfig
  torch.cuda.set_per_process_memory_fraction(a.cap_gib * GiB / torch.cuda.get_device_properties(0).total_memory)
  torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
  torch.manual_seed(0)
  model = TorchGPT(GPTConfig(block_size=a.block, **_shape(a.preset))).cuda()
  step = training_step(model, model.configure_optimizers(0.1, 6e-4, fused=True), a.precision)
  fn = torch.compile(step) if compiled else step
  x, y = (torch.randint(50257, (a.batch, a.block), device="cuda") for _ in range(2))
  for _ in range(3 if compiled else 2): loss = fn(x, y).item()
  return {"loss": loss, "measured_reserved_peak_bytes": torch.cuda.max_memory_reserved(),
          "allocated_peak_bytes": torch.cuda.max_memory_allocated()}


def probe(a) -> None:
  """Run one probe and print its result as the last line: ok, seconds, and the measurements (or the error)."""
  t0 = time.perf_counter()
  try:
    out = probe_blutrain(a) if a.impl == "blutrain_compile" else probe_torch(a, a.impl == "torch_compile")
    out["ok"] = True
  except Exception as e:  # an OOM is the answer; anything else is reported too, and counts as not training
    out = {"ok": False, "oom": _is_oom(e), "error": f"{type(e).__name__}: {str(e)[:400]}"}
  out["seconds"] = time.perf_counter() - t0
  print("RESULT " + json.dumps(out), flush=True)


# *** the searches, in the parent process ***

class Runner:
  """Runs probes. They share the Triton cache but not Nova's cache of generated steps, so that each compiles its step
  and reports the remat and plan it made (a cached step carries no report)."""
  def __init__(self, a):
    from blutrain import backend
    self.a, self.probes = a, []
    self.cache = tempfile.TemporaryDirectory(prefix="memory_cap-")
    triton = backend.cache_dir("triton")
    triton.mkdir(parents=True, exist_ok=True)
    os.symlink(triton, Path(self.cache.name) / "triton")
    self.env = {**os.environ, "BLUTRAIN_CACHE_DIR": self.cache.name}

  def __call__(self, impl: str, precision: str, batch: int, preset: str = "12x768") -> bool:
    a = self.a
    cmd = [sys.executable, __file__, "--probe", "--impl", impl, "--precision", precision, "--batch", str(batch),
           "--preset", preset, "--cap-gib", str(a.cap_gib), "--block", str(a.block)]
    try:
      r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.probe_timeout, cwd=ROOT, env=self.env)
      lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
      out = json.loads(lines[-1][7:]) if lines else {"ok": False, "error": f"exit {r.returncode}: {r.stderr[-400:]}"}
    except subprocess.TimeoutExpired:
      out = {"ok": False, "error": f"timed out after {a.probe_timeout} s"}
    out.update(impl=impl, precision=precision, batch=batch, preset=preset)
    self.probes.append(out)
    gib = out.get("measured_reserved_peak_bytes", 0) / GiB
    verdict = "ok " if out["ok"] else "OOM" if out.get("oom") else "err"
    print(f"  {impl:17} {precision} {preset:8} B={batch:<3} {verdict} {gib:6.2f} GiB reserved  "
          f"{out.get('seconds', 0):5.1f} s" + ("" if verdict != "err" else f"  {out.get('error')}"), flush=True)
    return out["ok"]

  def largest_batch(self, impl: str, precision: str) -> int:
    """The largest batch that trains: doubling from --start while it trains, then bisection down to --step."""
    a = self.a
    lo, b, hi = 0, a.start, None
    while hi is None and b <= a.max_batch:
      if self(impl, precision, b): lo, b = b, 2 * b
      else: hi = b
    if hi is None: return lo
    while hi - lo > a.step:
      mid = (lo + hi) // 2 // a.step * a.step
      if mid <= lo: break
      if self(impl, precision, mid): lo = mid
      else: hi = mid
    return lo

  def result(self, impl: str, precision: str, batch: int, preset: str = "12x768") -> dict | None:
    return next((p for p in self.probes if (p["impl"], p["precision"], p["batch"], p["preset"], p["ok"]) ==
                 (impl, precision, batch, preset, True)), None)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--cap-gib", type=float, default=12.0)
  ap.add_argument("--block", type=int, default=1024)
  ap.add_argument("--precisions", default="tf32,bf16")
  ap.add_argument("--impls", default="torch_eager,blutrain_compile,torch_compile", help="whose largest batch to search")
  ap.add_argument("--start", type=int, default=8, help="the first batch probed")
  ap.add_argument("--step", type=int, default=4, help="the bisection stops when the bounds are this close")
  ap.add_argument("--max-batch", type=int, default=128)
  ap.add_argument("--presets", default=PRESETS, help="layers x width, in order of size, for the shape search")
  ap.add_argument("--shape-batch", type=int, default=8)
  ap.add_argument("--quick", action="store_true", help="no shape search")
  ap.add_argument("--probe-timeout", type=int, default=300)
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory_cap.json"))
  ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--impl", help=argparse.SUPPRESS)
  ap.add_argument("--precision", help=argparse.SUPPRESS)
  ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
  ap.add_argument("--preset", default="12x768", help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.probe: return probe(a)
  from benchmarks.common import metadata, require_gpu, table, write
  require_gpu("cuda")
  t0 = time.perf_counter()
  run = Runner(a)
  precisions, impls = a.precisions.split(","), a.impls.split(",")
  batches = {}
  for precision in precisions:
    for impl in impls:
      print(f"largest batch: {impl} {precision}", flush=True)
      batches[(impl, precision)] = run.largest_batch(impl, precision)
  rows = []
  for (impl, precision), b in batches.items():
    r = run.result(impl, precision, b) or {}
    rows.append({"impl": impl, "precision": precision, "largest_batch": b, **{k: r.get(k) for k in (
      "planned_peak_bytes", "first_call_planned_peak_bytes",
      "measured_reserved_peak_bytes", "replay_allocated_peak_bytes", "allocated_peak_bytes",
      "arena_bytes", "remat", "memory_budget")}})
  shapes = None
  if not a.quick:  # PyTorch eager up its list until it runs out; blutrain compiled from there on until it does
    print(f"largest shape at B={a.shape_batch}, TF32", flush=True)
    presets, torch_fails = a.presets.split(","), None
    for p in presets:
      if not run("torch_eager", "tf32", a.shape_batch, p):
        torch_fails = p
        break
    largest = None
    for p in presets[presets.index(torch_fails):] if torch_fails else ():
      if not run("blutrain_compile", "tf32", a.shape_batch, p): break
      largest = p
    shapes = {"batch": a.shape_batch, "torch_eager_first_oom": torch_fails, "blutrain_compile_largest": largest,
              "blutrain_compile_row": largest and run.result("blutrain_compile", "tf32", a.shape_batch, largest)}
  result = {**metadata("memory_cap", "cuda"), "cap_gib": a.cap_gib, "block": a.block, "step": a.step,
            "largest_batch": rows, "largest_shape": shapes, "probes": run.probes,
            "total_s": time.perf_counter() - t0}
  write(result, a.out)
  gib = lambda n: None if n is None else n / GiB
  table(["impl", "precision", f"largest batch under {a.cap_gib:g} GiB", "planned peak GiB",
         "first call's planned peak GiB", "measured reserved GiB", "allocated GiB (blutrain: last replay)"],
        [[r["impl"], r["precision"], r["largest_batch"], gib(r["planned_peak_bytes"]),
          gib(r["first_call_planned_peak_bytes"]),
          gib(r["measured_reserved_peak_bytes"]), gib(r["replay_allocated_peak_bytes"] or r["allocated_peak_bytes"])]
         for r in rows])
  if shapes: print(f"at B={a.shape_batch} TF32: PyTorch eager runs out at {shapes['torch_eager_first_oom']}; "
                   f"blutrain compiled trains up to {shapes['blutrain_compile_largest']}")
  print(f"total {result['total_s']:.0f} s")


if __name__ == "__main__":
  main()
