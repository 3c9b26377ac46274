"""The compiler's driver: graph -> nova IR -> passes -> memory plan -> host source (CPU or CUDA) -> callable.

`optimize` runs the passes: canonicalize and fold alternate until fold finds nothing to fold (each reaches its own
fixed point with one worklist walk, and only fold's new splats can expose new identities such as x * 1), then
fuse-casts, fuse-gemm (which folds what follows a matmul, after fuse-casts has moved autocast's casts out of the way),
cse and dce once (none of them exposes anything new: patterns look at the producers of operands, which
cse only swaps for identical ones). With a dump directory every stage is written in MLIR syntax: `00-captured.mlir`,
`01-canonicalize.mlir`, `02-fold.mlir`, ...

`compile_graph` then rematerializes activations (`remat.rematerialize`, dumped as `NN-remat.mlir` and `remat.txt`),
fuses residual adds into the layer norms (fuse-norms, `NN-fuse-norms.mlir`; after remat, which recomputes the norms'
single results), then pointwise groups (`passes.fuse_pointwise`, dumped as `NN-fuse-pointwise.mlir`; after remat,
whose cost model and clones are per primitive, so that recomputed ops fuse with their readers) and plans the memory of
what is left (`memory.plan`, dumped as `memory-plan.txt`).
"""
from __future__ import annotations

import contextlib
import gc
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from xdsl.dialects.builtin import ModuleOp

from blutrain.nova import codegen
from blutrain.nova.dialect import NovaOp
from blutrain.nova.graph import Graph
from blutrain.nova.ir import function, print_module, to_module
from blutrain.nova.memory import MemoryPlan, plan as plan_memory, reused_in_place, updated_in_place
from blutrain.nova.passes import (CanonicalizePass, CSEPass, DCEPass, FoldPass, FuseBiasGradientsPass, FuseCastsPass,
                                  FuseGemmPass, FuseNormsPass, FusePointwisePass, FuseWeightGradientsPass, NovaPass)
from blutrain.nova.passes.fuse_casts import group_casts
from blutrain.nova.passes.fuse_gemm import gemm_report
from blutrain.nova.remat import RematReport, rematerialize

MAX_ROUNDS = 8  # canonicalize/fold rounds; real graphs settle in two


def op_counts(module: ModuleOp) -> dict[str, int]:
  """How many ops of each kind the module's function holds, by op name (`add`, `matmul`, ...)."""
  return dict(sorted(Counter(op.opname for op in function(module).body.block.ops if isinstance(op, NovaOp)).items()))


class _Dumper:
  """Writes `NN-<stage>.mlir` files into a directory, numbered in order; does nothing without a directory."""

  def __init__(self, directory: str | os.PathLike | None):
    self.dir = Path(directory) if directory else None
    self.n = 0
    if self.dir: self.dir.mkdir(parents=True, exist_ok=True)

  def __call__(self, stage: str, module: ModuleOp) -> None:
    if self.dir: (self.dir / f"{self.n:02d}-{stage}.mlir").write_text(print_module(module))
    self.n += 1


def optimize(module: ModuleOp, dump_dir: str | os.PathLike | None = None, verify: bool = False) -> ModuleOp:
  """Run Nova's passes on `module` in place (and return it).

  Args:
    module: a nova module, as `ir.to_module` builds it.
    dump_dir: when given, the module is written there after capture and after every pass.
    verify: verify the module (types, properties, shape rules) before and after every pass.
  """
  return _optimize(module, _Dumper(dump_dir), verify)


def _optimize(module: ModuleOp, dump: _Dumper, verify: bool) -> ModuleOp:
  dump("captured", module)

  def run(p: NovaPass) -> bool:
    changed = p.run(module)
    if verify: module.verify()
    dump(p.name, module)
    return changed

  if verify: module.verify()
  for _ in range(MAX_ROUNDS):
    run(CanonicalizePass())
    if not run(FoldPass()): break
  run(FuseCastsPass())
  run(FuseGemmPass())
  run(CSEPass())
  run(DCEPass())
  return module


def _fuse_norms(module: ModuleOp, report: RematReport | None, written: dict[int, int] | None) -> ModuleOp:
  """The module with fuse-norms applied. A fused norm makes its sum and its output at once, which can hold one more
  activation at the peak: under a memory budget the fusion is kept only when the arena remat planned does not grow."""
  if report is None or report.budget is None:
    FuseNormsPass().run(module)
    return module
  fused = module.clone()
  return fused if FuseNormsPass().run(fused) and plan_memory(fused, written).arena <= report.arena_after else module


@dataclass(eq=False)
class CompiledGraph:
  """A graph compiled for a target (`codegen.TARGETS`): `fn(*arrays) -> tuple of arrays`, with what it took.

  Attributes:
    source: the generated Python source of `fn`.
    fn: the compiled step.
    module: the optimized nova module `source` was generated from.
    counts_before, counts_after: op counts of the captured and the optimized IR (before remat and fuse-norms;
      `op_counts(module)` counts the final one).
    memory: the static memory plan of the optimized module's intermediates (`memory.plan`).
    remat: what rematerialization recomputed and kept (`remat.rematerialize`); None when it was turned off.
    timings: seconds per phase (build, optimize, remat, fuse, plan, codegen, load).
    gemms: for the GPU, one line per fused GEMM: its problem and epilogue, the path chosen (cuBLASLt and separate
      kernels, or the synthesized GEMM) and both predicted times (`fuse_gemm.gemm_report`; dumped as gemms.txt).
  """
  source: str
  fn: Callable
  module: ModuleOp
  counts_before: dict[str, int]
  counts_after: dict[str, int]
  memory: MemoryPlan
  remat: RematReport | None
  timings: dict[str, float] = field(default_factory=dict)
  gemms: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _gc_paused():
  """CPython's cyclic garbage collector paused, as a context or decorator. NOTE: compiling allocates hundreds of
  thousands of IR objects that live until it ends, and each collection walks them all again (a quarter of the compile
  time of an LSTM step at T = 256); what the passes erase waits for the first collection after."""
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled: gc.enable()


@_gc_paused()
def compile_graph(graph: Graph, dump_dir: str | os.PathLike | None = None, verify: bool | None = None,
                  written: dict[int, int] | None = None, memory_budget: int | None = None,
                  remat: bool | None = None, target: str = "cpu", fuse: bool | None = None) -> CompiledGraph:
  """Compile a captured graph to a function of the target's arrays (numpy on the CPU, CudaArrays on the GPU). The
  graph's structural hash (`hashing.graph_key`) is the caller's
  business: the runtime computes it once, as its cache key, before deciding to compile.

  Args:
    graph: the captured graph.
    dump_dir: where to write the IR after capture and each pass, and the generated `step.py`
      (default: the `BLUTRAIN_DUMP_IR` environment variable; none when unset).
    verify: verify the IR before and after every pass (default: `BLUTRAIN_NOVA_VERIFY=1`; off, since the shape
      rules already ran at capture).
    written: output position -> input position of the inputs the step updates (their new values), for the memory
      plan.
    memory_budget: bytes the step may take (its inputs plus the arena); rematerialization recomputes activations
      until the plan fits (see `remat`). None: only the cheap recomputation of the default.
    remat: recompute activations in the backward (default: on, unless `BLUTRAIN_NOVA_REMAT=0`).
    target: "cpu" or "cuda" (`codegen.TARGETS`).
    fuse: run the fusion passes after remat, fuse-norms and fuse-pointwise (default: on, unless
      `BLUTRAIN_NOVA_FUSE=0`); on the CPU a pointwise group runs its ops one by one, as eagerly.
  """
  dump_dir = dump_dir or os.environ.get("BLUTRAIN_DUMP_IR") or None
  verify = os.environ.get("BLUTRAIN_NOVA_VERIFY") == "1" if verify is None else verify
  remat = os.environ.get("BLUTRAIN_NOVA_REMAT") != "0" if remat is None else remat
  fuse = os.environ.get("BLUTRAIN_NOVA_FUSE") != "0" if fuse is None else fuse
  timings: dict[str, float] = {}
  t = time.perf_counter()

  def lap(phase: str) -> None:
    nonlocal t
    now = time.perf_counter()
    timings[phase], t = now - t, now

  module = to_module(graph)
  counts_before = op_counts(module)
  lap("build")
  dump = _Dumper(dump_dir)
  _optimize(module, dump, verify)
  counts_after = op_counts(module)
  lap("optimize")
  report = None
  if remat:
    report = rematerialize(module, memory_budget, written)
    if verify: module.verify()
    dump("remat", module)
    if dump_dir: (Path(dump_dir) / "remat.txt").write_text(report.report())
  lap("remat")
  if fuse:
    module = _fuse_norms(module, report, written)
    if verify: module.verify()
    dump("fuse-norms", module)
    if target == "cuda":  # not exact (fuse_gemm.py): the CPU's compiled steps stay equal to eager mode
      FuseBiasGradientsPass().run(module)
      if verify: module.verify()
      dump(FuseBiasGradientsPass.name, module)
      FuseWeightGradientsPass().run(module)
      if verify: module.verify()
      dump(FuseWeightGradientsPass.name, module)
      group_casts(module, written)  # exact, but one launch instead of many only matters on the GPU
      if verify: module.verify()
      dump("group-casts", module)
    FusePointwisePass().run(module)
    if verify: module.verify()
    dump(FusePointwisePass.name, module)
  lap("fuse")
  memory_plan = plan_memory(module, written)
  if dump_dir: (Path(dump_dir) / "memory-plan.txt").write_text(memory_plan.report())
  lap("plan")
  in_place = updated_in_place(module, written)
  if target == "cuda": in_place |= reused_in_place(module)  # CUDA kernels return fresh arrays, never an input's memory
  source = codegen.generate(module, target=target, in_place=in_place, plan=memory_plan)
  gemms = gemm_report(module) if target == "cuda" else []
  if dump_dir and gemms: (Path(dump_dir) / "gemms.txt").write_text("\n".join(gemms) + "\n")
  if dump_dir: (Path(dump_dir) / "step.py").write_text(source)
  lap("codegen")
  fn = codegen.load(source)
  lap("load")
  return CompiledGraph(source, fn, module, counts_before, counts_after, memory_plan, report, timings, gemms)
