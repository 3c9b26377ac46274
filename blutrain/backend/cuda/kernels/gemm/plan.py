"""Planning a synthesized GEMM: from the operands' shapes, layouts, dtypes and pointer alignments to the configurator's
schedule, the kernel's `Structure` and the launches with their arguments, cached per layout; then queueing them.

Batch dims broadcast (a weight shared by the batch folds the batch into A's rows); the innermost remaining batch dim
is a grid axis and outer ones loop on the host. When the configurator asks (TF32 wants a K-major B), C^T = B^T A^T
is computed instead: operands, output and epilogue tensors are then transposed views.
"""
from __future__ import annotations

import functools
import itertools

from blutrain import configurator as cfg
from blutrain import dtypes
from blutrain.backend.cuda import runtime
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import TY, broadcast_strides, collapse, empty, needs_i64
from blutrain.backend.cuda.kernels.gemm.operand_copy import copy_layout, rowmajor_copy
from blutrain.backend.cuda.kernels.gemm.source import (CONSTEXPRS, UNALIGNED_INTS, Structure, epilogue_pointers,
                                                       main_spec, reduce_spec)
from blutrain.backend.cuda.kernels.matrix import blas_layout, leading_stride, transposed, unit_axis
from blutrain.backend.cuda.launch import Kernel
from blutrain.dtypes import DType
from blutrain.shapes import cdiv

PRECISIONS = ("tf32", "tf32x3")


def precision_of(dtype: DType, precision: str | None = None) -> str:
  """The dot's input precision for operands of `dtype`: for float32 `precision` when given, else "tf32x3"
  (float32-level error; a matmul op whose `tf32` attribute is set passes "tf32"); "" for 16-bit operands, which
  multiply in their own type."""
  if dtype is not dtypes.float32: return ""
  if precision is None: return "tf32x3"
  if precision not in PRECISIONS:
    raise ValueError(f"gemm: precision must be one of {PRECISIONS} for float32 operands, got {precision!r}")
  return precision


class Plan:
  """The launches of one problem layout: (kernel, grid, arguments) where a pointer argument names the array it comes
  from ("a", "b", "out", "bias", "x0", "x1" for the epilogue's tensors, "ws" for split-K's workspace) with a byte
  offset per host-loop step; `copy` names the operands first copied K-major (the offsets are the copies')."""

  def __init__(self, copy: str, steps: int, launches: list, workspace: tuple[int, ...] | None,
               schedule: cfg.GemmSchedule, structure: Structure):
    self.copy, self.steps, self.launches, self.workspace = copy, steps, launches, workspace
    self.schedule, self.structure = schedule, structure

  @functools.cached_property
  def kernels(self) -> list[Kernel]:
    """The launches' compiled kernels (compiled on first use: planning needs no compiler)."""
    return [sp.kernel for sp, _, _ in self.launches]

  def launch(self, a: CudaArray, b: CudaArray, out: CudaArray, bias: CudaArray | None, aux: list[int],
             alpha: float) -> None:
    """Queue the kernels (and the K-major copies and workspace they read) on the current stream; `aux` holds the
    addresses of the epilogue's tensors."""
    ptrs = {"a": a.ptr, "b": b.ptr, "out": out.ptr, "bias": 0 if bias is None else bias.ptr, "ws": 0}
    for i, x in enumerate(aux): ptrs[f"x{i}"] = x
    keep = []  # the copies and the workspace, alive until the launches are queued
    for op in self.copy:
      keep.append(rowmajor_copy(a if op == "a" else transposed(b), self.structure.precision == "tf32"))
      ptrs[op] = keep[-1].ptr
    if self.workspace:
      keep.append(empty(self.workspace, dtypes.float32, a.device))
      ptrs["ws"] = keep[-1].ptr
    for step in range(self.steps):
      for kernel, (_, grid, args) in zip(self.kernels, self.launches):
        kernel(grid, *[ptrs[x[1]] + x[2][step] if x[0] == "p" else alpha if x[0] == "alpha" else x[1] for x in args])


def _args(fn, ptrs: dict[str, tuple[str, list[int]]], ints: dict[str, int]) -> list[tuple]:
  """A kernel's runtime arguments in order: ("p", source, offsets) for pointers, ("i", value) or ("alpha",)."""
  out = []
  for name in fn.arg_names:
    if name in CONSTEXPRS: continue
    if name in ptrs: out.append(("p",) + ptrs[name])
    elif name == "ALPHA": out.append(("alpha",))
    else: out.append(("i", ints[name]))
  return out


def _matrices(a: CudaArray, b: CudaArray, out: CudaArray, aux: list[CudaArray]):
  """The 2-D matrices of a, b, out and the epilogue's tensors, their batch strides, and their rows: a weight shared
  by the batch (b without batch strides) folds the batch into the rows of A, C and the others when their strides
  allow; the remaining batch dims are collapsed, the innermost run by the kernel (Z entries, strides `zst`) and the
  outer ones by host-loop steps (byte `offsets`)."""
  batch = out.shape[:-2]
  mats = {"a": a, "b": b, "out": out, **{f"x{i}": x for i, x in enumerate(aux)}}
  bst = {k: broadcast_strides(CudaArray(0, x.shape[:-2], x.strides[:-2], x.dtype, 0, None), batch)
         for k, x in mats.items()}
  mats = {k: CudaArray(x.ptr, x.shape[-2:], x.strides[-2:], x.dtype, x.device, None) for k, x in mats.items()}
  if batch and not any(bst["b"]):
    keys = [k for k in mats if k != "b"]
    shape, sts = collapse(batch + (a.shape[-2],), *[bst[k] + (mats[k].strides[0],) for k in keys])
    folded = {k: CudaArray(x.ptr, (shape[0], x.shape[1]), (st[0] if shape[0] > 1 else x.strides[0], x.strides[1]),
                           x.dtype, x.device, None) for k, st in zip(keys, sts) for x in (mats[k],)}
    if len(shape) == 1 and blas_layout(folded["a"]) is not None:
      mats |= folded
      batch, bst = (), {k: () for k in mats}
  if not batch: return mats, 1, {k: 0 for k in mats}, {k: [0] for k in mats}
  dims, sts = collapse(batch, *bst.values())
  steps = list(itertools.product(*(range(d) for d in dims[:-1])))
  offsets = {k: [sum(i * s for i, s in zip(idx, st[:-1])) * mats[k].dtype.itemsize for idx in steps]
             for k, st in zip(bst, sts)}
  return mats, dims[-1], {k: st[-1] for k, st in zip(bst, sts)}, offsets


def _planned_copy(x: CudaArray) -> CudaArray:
  """The layout of x's row-major copy, at an address as aligned as the allocator's."""
  return CudaArray(0, x.shape, copy_layout(x)[0], x.dtype, x.device, None)


def _build(a: CudaArray, b: CudaArray, out: CudaArray, bias: CudaArray | None, aux: list[CudaArray],
           epilogue: tuple[str, ...], prec: str) -> Plan:
  """The plan of gemm(a, b) into out, for these shapes, layouts, dtypes and pointer alignments (its cache key)."""
  M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
  i64 = any(needs_i64(x.shape, x.strides) for x in (a, b, out, *aux))
  a_k, b_k = (not blas_layout(a)[0], blas_layout(b)[0]) if K else (True, True)  # K = 0: nothing is read
  copied = cfg.operand_copy(prec, M, N, a_k, b_k, runtime.hardware(out.device))
  if "a" in copied: a, a_k = _planned_copy(a), True  # plan on the K-major copies' layouts
  if "b" in copied: b, b_k = transposed(_planned_copy(transposed(b))), True
  mats, Z, zst, offsets = _matrices(a, b, out, aux)
  item, rows = a.dtype.itemsize, mats["a"].shape[0]
  lda, ldb = leading_stride(mats["a"], a_k), leading_stride(mats["b"], not b_k)
  tma = Z == 1 and all(mats[k].ptr % 16 == 0 and ld > 0 and ld * item % 16 == 0 and all(o % 16 == 0 for o in offsets[k])
                       for k, ld in (("a", lda), ("b", ldb)))
  c_unit, c_ld = unit_axis(mats["out"])
  c_aligned = mats["out"].ptr % 16 == 0 and c_ld[0] * out.dtype.itemsize % 16 == 0 and \
    all(o % 16 == 0 for o in offsets["out"])
  s = cfg.gemm_schedule(cfg.GemmProblem(rows, N, K, Z, item, out.dtype.itemsize, prec, a_k, b_k, tma, copied,
                                        c_unit if c_aligned else "", sum(x.dtype.itemsize for x in aux)),
                        runtime.hardware(out.device))
  src = {"A": "a", "B": "b"}
  if s.swap:  # C^T = B^T A^T: every matrix transposed, the bias now runs along M
    mats = {k: transposed(x) for k, x in mats.items()}
    mats["a"], mats["b"], src = mats["b"], mats["a"], {"A": "b", "B": "a"}
    rows, N = N, rows
  lda, ldb = leading_stride(mats["a"], s.a_kmajor), leading_stride(mats["b"], not s.b_kmajor)
  c_unit, c_ld = unit_axis(mats["out"])
  units = [unit_axis(mats[f"x{i}"]) for i in range(len(aux))]
  split = s.split_k > 1 or K == 0
  st = Structure("tma" if s.persistent else "ptr", TY[a.dtype], TY[out.dtype], prec, s.a_kmajor, s.b_kmajor,
                 s.round_a, s.round_b, c_unit, epilogue, s.swap, tuple(u for u, _ in units),
                 tuple(TY[x.dtype] for x in ([bias] if bias is not None else []) + aux), split, s.tma_store,
                 not s.persistent and Z > 1, i64)
  aux_names = [n for n in epilogue_pointers(st) if n != "BIAS"]
  k_tiles = cdiv(K, s.BK)
  wm = cdiv(rows, s.BM) * s.BM if s.tma_store and split else rows  # TMA-stored partials: whole tile rows per slice
  ints = {"M": rows, "N": N, "K": K, "LDA": lda, "LDB": ldb, "SAZ": zst[src["A"]], "SBZ": zst[src["B"]],
          "SCZ": zst["out"], "K_TILES": cdiv(k_tiles, s.split_k), "SPLITS": s.split_k if K else 0,
          "GROUP_M": s.group_m, "SPLIT_K": s.split_k, "WM": wm}
  for name, (unit, lds) in [("LDC", (c_unit, c_ld))] + [("LD" + n, u) for n, u in zip(aux_names, units)]:
    ints |= {name: lds[0]} if unit else {name + "M": lds[0], name + "N": lds[1]}
  names = {"A": src["A"], "B": src["B"], "BIAS": "bias"} | {n: f"x{i}" for i, n in enumerate(aux_names)}
  for i, n in enumerate(aux_names): ints[f"S{n}Z"] = zst[f"x{i}"]
  offsets |= {"bias": [0] * len(offsets["a"]), "ws": [0] * len(offsets["a"])}
  aligned = all(v % 16 == 0 for k, v in ints.items() if k not in UNALIGNED_INTS) and \
    all(x.ptr % 16 == 0 for x in mats.values()) and all(o % 16 == 0 for offs in offsets.values() for o in offs)
  ptrs = {n: (v, offsets[v]) for n, v in names.items()}
  launches = []
  if K:
    sp = main_spec(st, s, aligned, K % s.BK == 0)
    ptrs_main = ptrs | {"C": ("ws", offsets["ws"]) if split else ("out", offsets["out"])}
    launches.append((sp, s.grid if s.persistent else (s.tiles, s.split_k, Z), _args(sp[0], ptrs_main, ints)))
  if split:
    sp = reduce_spec(st, rows, N, aligned)
    ptrs_reduce = ptrs | {"W": ("ws", offsets["ws"]), "C": ("out", offsets["out"])}
    grid = (cdiv(rows, sp.constexprs["BLOCK_R"]), cdiv(N, sp.constexprs["BLOCK_C"]), Z)
    launches.append((sp, grid, _args(sp[0], ptrs_reduce, ints)))
  return Plan(copied, len(offsets["a"]), launches, (s.split_k, Z, wm, N) if split and K else None, s, st)


_plans: dict[tuple, Plan] = {}


def layout_key(x: CudaArray | None) -> tuple:
  """What a plan depends on of an array: its layout, dtype and whether its address is 16-byte aligned."""
  return () if x is None else (x.shape, x.strides, x.dtype, x.ptr % 16 == 0)


def plan(a: CudaArray, b: CudaArray, out: CudaArray, bias: CudaArray | None = None, aux: tuple[CudaArray, ...] = (),
         epilogue: tuple[str, ...] = (), precision: str = "") -> Plan:
  """The cached plan of a problem (its schedule and structure, for inspection: `plan(...).schedule`)."""
  if a.shape[-1] != b.shape[-2] or out.shape[-2:] != (a.shape[-2], b.shape[-1]):
    raise ValueError(f"gemm: cannot contract {a.shape} with {b.shape} into {out.shape}")
  key = (layout_key(a), layout_key(b), layout_key(out), layout_key(bias), tuple(layout_key(x) for x in aux), epilogue,
         precision, out.device)
  hit = _plans.get(key)
  if hit is None: hit = _plans[key] = _build(a, b, out, bias, list(aux), epilogue, precision)
  return hit
