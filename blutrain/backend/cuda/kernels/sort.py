"""argsort: a bitonic sorting network over each row (the sorted dim made last and contiguous, rows padded to a power
of two P), one launch per compare-exchange step (log2(P) (log2(P) + 1) / 2 steps).

Elements carry their position: ties order by it, so the sort is stable, and positions >= N mark the padding, which
sorts after everything. nan sorts above +inf (first when descending), as PyTorch's and numpy's sorts; half types
compare in float32.
"""
from __future__ import annotations

import functools

import triton
import triton.language as tl

from blutrain import dtypes
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import empty, ptr, run, spec, view
from blutrain.backend.cuda.kernels.copy import copy
from blutrain.backend.cuda.kernels.elementwise import launch
from blutrain.configurator import flat_schedule
from blutrain.dtypes import DType
from blutrain.shapes import cdiv, contiguous_strides, next_pow2


@triton.jit
def _init_kernel(vals, idx, x, total, P, N, BLOCK: tl.constexpr):
  """vals[r, p] = x[r, p] and idx[r, p] = p for p < N; padding (p >= N) keeps only its position."""
  i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
  r, p = i // P, i % P
  m = i < total
  tl.store(vals + i, tl.load(x + r * N + p, mask=m & (p < N), other=0), mask=m)
  tl.store(idx + i, p, mask=m)


@triton.jit
def _after(va, ia, vb, ib, N, DESC: tl.constexpr):
  """Whether element (va, ia) comes after (vb, ib) in the final order."""
  if va.dtype == tl.float16 or va.dtype == tl.bfloat16:
    va = va.to(tl.float32)
    vb = vb.to(tl.float32)
  nan_a = va != va
  nan_b = vb != vb
  if DESC:
    beyond = (nan_b & ~nan_a) | (~nan_a & ~nan_b & (va < vb))
  else:
    beyond = (nan_a & ~nan_b) | (~nan_a & ~nan_b & (va > vb))
  same = (nan_a & nan_b) | (va == vb)
  pad_a = ia >= N
  pad_b = ib >= N
  return tl.where(pad_a | pad_b, pad_a & (~pad_b | (ia > ib)), beyond | (same & (ia > ib)))


@triton.jit
def _step_kernel(vals, idx, total, P, N, k, j, DESC: tl.constexpr, BLOCK: tl.constexpr):
  """One compare-exchange step (k, j) of the network: element i and i ^ j swap when out of order for the run of
  length k they belong to (ascending where its position p in the row has p & k == 0, so every row ends ascending).
  Rows are P apart and j < P, so partners share a row."""
  i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
  partner = i ^ j
  m = (i < total) & (partner > i)
  va = tl.load(vals + i, mask=m)
  vb = tl.load(vals + partner, mask=m)
  ia = tl.load(idx + i, mask=m, other=0)
  ib = tl.load(idx + partner, mask=m, other=0)
  swap = tl.where(((i & (P - 1)) & k) == 0, _after(va, ia, vb, ib, N, DESC), _after(vb, ib, va, ia, N, DESC))
  tl.store(vals + i, tl.where(swap, vb, va), mask=m)
  tl.store(vals + partner, tl.where(swap, va, vb), mask=m)
  tl.store(idx + i, tl.where(swap, ib, ia), mask=m)
  tl.store(idx + partner, tl.where(swap, ia, ib), mask=m)


@functools.lru_cache(maxsize=1024)
def init_spec(dtype: DType, total: int):
  block, warps = flat_schedule(total, 4)
  return spec(_init_kernel, {"vals": ptr(dtype), "idx": "*i64", "x": ptr(dtype), "total": "i64", "P": "i64",
                             "N": "i64"}, dict(BLOCK=block), num_warps=warps)


@functools.lru_cache(maxsize=1024)
def step_spec(dtype: DType, descending: bool, total: int):
  block, warps = flat_schedule(total, 4)
  return spec(_step_kernel, {"vals": ptr(dtype), "idx": "*i64", "total": "i64", "P": "i64", "N": "i64", "k": "i64",
                              "j": "i64"},
              dict(DESC=descending, BLOCK=block), num_warps=warps)


def argsort(x: CudaArray, dim: int, descending: bool) -> CudaArray:
  out = empty(x.shape, dtypes.int64, x.device)
  if out.size == 0: return out
  perm = [d for d in range(x.ndim) if d != dim] + [dim]
  rows_shape = tuple(x.shape[d] for d in perm)
  xc = copy(view(x, rows_shape, tuple(x.strides[d] for d in perm)))  # the sorted dim last, contiguous
  N = x.shape[dim]
  P = next_pow2(N)
  total = out.size // N * P
  vals, idx = empty((total,), x.dtype, x.device), empty((total,), dtypes.int64, x.device)
  s = init_spec(x.dtype, total)
  run(s, (cdiv(total, s.constexprs["BLOCK"]),), vals.ptr, idx.ptr, xc.ptr, total, P, N)
  s = step_spec(x.dtype, descending, total)
  k = 2
  while k <= P:
    j = k // 2
    while j:
      run(s, (cdiv(total, s.constexprs["BLOCK"]),), vals.ptr, idx.ptr, total, P, N, k, j)
      j //= 2
    k *= 2
  rows_strides = contiguous_strides(rows_shape[:-1] + (P,))
  launch("copy", view(out, rows_shape, tuple(out.strides[d] for d in perm)), view(idx, rows_shape, rows_strides))
  return out


KERNELS = {"argsort": argsort}

SPECS = [f(dt, 1 << 16) for f in (init_spec,) for dt in (dtypes.float32, dtypes.int64)] + [
  step_spec(dt, desc, n) for dt, desc, n in ((dtypes.float32, True, 1 << 16), (dtypes.float32, False, 1 << 22),
                                             (dtypes.bfloat16, False, 1 << 10), (dtypes.float64, True, 1 << 10),
                                             (dtypes.int64, False, 1 << 16), (dtypes.int32, True, 1 << 10))]
