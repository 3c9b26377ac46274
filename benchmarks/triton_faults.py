"""GEMM schedules the configurator avoids because Triton computed them wrong on the H200, run as they would be, beside
the configurator's own schedule of the same problem. Run it after a Triton upgrade: a fault whose rows read "exact,
reproducible" may have been fixed, and its NOTE in blutrain/configurator.py (or docs/configurator.md) can be
revisited with a full `pytest -m cuda` run.

Each row runs one GEMM through the production path (K-major copy, main kernel, split-K reduction) with the main
kernel's schedule or structure changed, on inputs TF32 multiplies exactly (so any error beyond float32 summation is
a wrong element), five times: the largest relative error against float64 and whether the five outputs are bitwise
equal. Writes benchmarks/results/triton_faults.json and prints a markdown table.

  python benchmarks/triton_faults.py
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

from blutrain.backend.cuda import runtime  # noqa: E402
from blutrain.backend.cuda.kernels.gemm.plan import Plan  # noqa: E402
from blutrain.backend.cuda.kernels.gemm.source import CONSTEXPRS, main_spec  # noqa: E402
from blutrain.backend.cuda.memory import empty  # noqa: E402
from blutrain.shapes import cdiv  # noqa: E402
from benchmarks.matmul import array, as_torch  # noqa: E402

G = importlib.import_module("blutrain.backend.cuda.kernels.gemm")
RUNS = 5


def _ws(s, BK: int, stages: int):
  """A schedule made warp-specialized (4 warps per consumer warpgroup, the epilogue whole)."""
  return dataclasses.replace(s, warp_specialize=True, num_warps=4, epi_subtile=False, BK=BK, num_stages=stages)


def _plain(s, BK: int, stages: int):
  """A schedule made unspecialized (8 warps over a 128x256 tile, the epilogue in halves)."""
  return dataclasses.replace(s, warp_specialize=False, num_warps=8, epi_subtile=True, BK=BK, num_stages=stages)


# (fault, precision, (M, K, N), A stored transposed, B stored transposed, change of (structure, schedule))
FAULTS = [
  ("TF32 split-K, unspecialized, 3 stages, partials by pointers", "tf32", (3072, 16384, 768), True, False,
   lambda st, s: (dataclasses.replace(st, tma_store=False), _plain(s, 32, 3))),
  ("TF32 split-K, warp-specialized, partials by pointers", "tf32", (2048, 50304, 768), False, False,
   lambda st, s: (dataclasses.replace(st, tma_store=False), s)),
  ("TF32 warp-specialized, B rounded in the kernel, BK 32 x 2 stages", "tf32", (1024, 768, 50304), False, True,
   lambda st, s: (st, _ws(s, 32, 2))),
  ("TF32 warp-specialized, 128x128 tiles, BK 32 x 3 stages", "tf32", (16384, 768, 2304), False, True,
   lambda st, s: (st, dataclasses.replace(s, BN=128, group_m=11, BK=32, num_stages=3))),
  ("bf16 warp-specialized, BK 32 x 6 stages", "bf16", (16384, 768, 2304), False, True,
   lambda st, s: (st, _ws(s, 32, 6))),
]


def exact(shape, transposed: bool, seed: int, scale: float) -> torch.Tensor:
  """Random float32 with 10 mantissa bits (exact in TF32 and, scaled by a power of two, close to bf16's grid)."""
  g = torch.Generator(device="cuda").manual_seed(seed)
  x = torch.randn(shape[::-1] if transposed else shape, device="cuda", generator=g) * scale
  x = ((x.view(torch.int32) + 0x1000) & -8192).view(torch.float32)
  return x.T if transposed else x


def changed(plan, K: int, st, s):
  """The plan with its main kernel built for structure `st` and schedule `s` (K_TILES follows s.BK)."""
  spec, grid, args = plan.launches[0]
  aligned = spec[1]["A"].endswith(":16")
  new = main_spec(st, s, aligned)
  names = [n for n in spec[0].arg_names if n not in CONSTEXPRS]
  k_tiles = cdiv(cdiv(K, s.BK), s.split_k)
  args = [("i", k_tiles) if n == "K_TILES" else x for n, x in zip(names, args)]
  return Plan(plan.copy, plan.steps, [(new, grid, args)] + plan.launches[1:], plan.workspace, s, st)


def run(plan, a, b) -> list[torch.Tensor]:
  outs = []
  for _ in range(RUNS):
    out = empty((a.shape[0], b.shape[1]), a.dtype, 0)
    plan.launch(a, b, out, None, [], 1.0)
    outs.append(as_torch(out).float().clone())
  return outs


def measure(fault, prec_name, shape, a_t, b_t, change) -> list[dict]:
  M, K, N = shape
  tdt = torch.float32 if prec_name == "tf32" else torch.bfloat16
  ta, tb = exact((M, K), a_t, 1, 1.0).to(tdt), exact((K, N), b_t, 2, 0.0625).to(tdt)
  ref = ta.double() @ tb.double()
  a, b = array(ta), array(tb)
  prec = "tf32" if prec_name == "tf32" else ""
  plan = G.plan(a, b, empty((M, N), a.dtype, 0), precision=prec)
  rows = []
  for which, p in (("configurator", plan), ("avoided", changed(plan, K, *change(plan.structure, plan.schedule)))):
    s, st = p.schedule, p.structure
    row = {"fault": fault, "precision": prec_name, "problem": f"{M}x{K}x{N}", "schedule": which,
           "kernel": f"{s.BM}x{s.BN}x{s.BK} s{s.num_stages} split{s.split_k}{' ws' if s.warp_specialize else ''}"
                     f"{' tma-store' if st.tma_store else ''}{' round-b' if st.round_b else ''}"}
    try:
      outs = run(p, a, b)
      row["max_rel_err"] = max(float((o.double() - ref).norm() / ref.norm()) for o in outs)
      row["reproducible"] = all(torch.equal(outs[0], o) for o in outs[1:])
    except Exception as e:  # a schedule that does not compile or launch is a finding too
      row["error"] = str(e).splitlines()[0][:100]
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def verdict(row: dict, bound: float) -> str:
  if "error" in row: return "error"
  if not row["max_rel_err"] < bound: return "WRONG"  # NaN included
  return "exact, reproducible" if row["reproducible"] else "not reproducible"


def main() -> None:
  rows = [r for f in FAULTS for r in measure(*f)]
  bound = {"tf32": 1e-4, "bf16": 5e-3}  # exact TF32 products: float32 summation only; bf16: the output's rounding
  for r in rows:
    r["verdict"] = verdict(r, bound[r["precision"]])
  env = {"date": str(date.today()), "gpu": runtime.get_device_properties(0).name, "torch": torch.__version__,
         "triton": triton.__version__}
  out = ROOT / "benchmarks" / "results" / "triton_faults.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"env": env, "runs": RUNS, "rows": rows}, indent=1))
  print(f"\n{env['gpu']}, Triton {env['triton']}, {env['date']}: {RUNS} runs each\n")
  print("| fault | problem (M x K x N) | schedule | kernel | largest error | bitwise equal | verdict |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for r in rows:
    err = f"{r['max_rel_err']:.1e}" if "max_rel_err" in r else r.get("error", "-")
    print(f"| {r['fault']} | {r['problem']} | {r['schedule']} | {r['kernel']} | {err} | "
          f"{r.get('reproducible', '-')} | {r['verdict']} |")


if __name__ == "__main__":
  main()
