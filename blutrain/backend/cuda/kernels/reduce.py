"""Reductions: sum, amax, amin over dims; argmax, argmin and cumsum (forward and reverse) along one dim.

Every reduction sees its input as an (M, N) problem: M runs over the kept dims (in order, so the output is contiguous)
and N over the reduced dims (ordered by falling stride, so the contiguous one is innermost), each collapsed to at most
5 dims. A program reduces BLOCK_M outputs over tiles of BLOCK_N; when one of M or N is a single unit-stride dim the
kernel knows it, so tiles load along it (innermost reductions load along N, reductions over leading dims, like a
bias gradient, along M). When M alone gives too few programs for the GPU, N is split: partial results of the
accumulation type go to a (SPLIT, M) buffer that the same kernel reduces once more. A 2-D problem whose pointer,
sizes, chunk and non-unit stride are multiples of 16 takes the `vectors` variant, whose tiles load 16-byte vectors
(unpromised, Triton loads them an element at a time). Half types accumulate in float32,
integers and bools in int64 (sum), float64 in float64. amax/amin propagate NaN, argmax/argmin treat NaN as the
extreme and return the first index, as numpy does.
"""
from __future__ import annotations

import functools
import math

import triton
import triton.language as tl

from blutrain import dtypes
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda import runtime
from blutrain.backend.cuda.runtime import current_stream
from blutrain.backend.cuda.kernels import (TL, axis_args, axis_offsets, axis_params, collapse, divisible, empty,
                                           max_nan, min_nan, needs_i64, ptr, run, spec)
from blutrain.backend.cuda.kernels.copy import copy
from blutrain.backend.cuda.kernels.creation import fill
from blutrain.backend.cuda.kernels.elementwise import gelu_backward, launch
from blutrain.configurator import (REDUCE_STAGES, ColumnSums, column_sums_schedule, partial_sums_schedule,
                                   reduce_schedule, split_rule)
from blutrain.dtypes import DType
from blutrain.shapes import cdiv


@triton.jit
def _reduce_kernel(out, x, M, N, chunk,
                   m_size1, m_size2, m_size3, m_size4, x_m_stride0, x_m_stride1, x_m_stride2, x_m_stride3, x_m_stride4,
                   n_size1, n_size2, n_size3, n_size4, x_n_stride0, x_n_stride1, x_n_stride2, x_n_stride3, x_n_stride4,
                   OP: tl.constexpr, IDENT: tl.constexpr, ACC: tl.constexpr, M_DIMS: tl.constexpr,
                   N_DIMS: tl.constexpr, M_UNIT: tl.constexpr, N_UNIT: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, STAGES: tl.constexpr, IDX64: tl.constexpr):
  """out[s * M + m] = OP over n in split s (= program_id(1), `chunk` wide) of x[m, n], STAGES tiles in flight."""
  pid_m = tl.program_id(0)
  pid_s = tl.program_id(1)
  if IDX64:
    pid_m = pid_m.to(tl.int64)
    pid_s = pid_s.to(tl.int64)
  ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
  m_off = axis_offsets(ms, m_size1, m_size2, m_size3, m_size4, x_m_stride0, x_m_stride1, x_m_stride2, x_m_stride3,
                       x_m_stride4, M_DIMS, M_UNIT)
  m_mask = ms < M
  start = pid_s * chunk
  end = tl.minimum(start + chunk, N)
  acc = tl.full([BLOCK_M, BLOCK_N], IDENT, ACC)
  for n0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
    ns = n0 + tl.arange(0, BLOCK_N)
    n_off = axis_offsets(ns, n_size1, n_size2, n_size3, n_size4, x_n_stride0, x_n_stride1, x_n_stride2, x_n_stride3,
                         x_n_stride4, N_DIMS, N_UNIT)
    v = tl.load(x + m_off[:, None] + n_off[None, :], mask=m_mask[:, None] & (ns < end)[None, :], other=IDENT).to(ACC)
    if OP == "sum":
      acc += v
    elif OP == "amax":
      acc = max_nan(acc, v)
    else:
      acc = min_nan(acc, v)
  if OP == "sum":
    r = tl.sum(acc, axis=1)
  elif OP == "amax":
    r = tl.reduce(acc, 1, max_nan)
  else:
    r = tl.reduce(acc, 1, min_nan)
  tl.store(out + pid_s * M + ms, r.to(out.dtype.element_ty), mask=m_mask)


@triton.jit
def _better(v1, i1, v2, i2, MAX: tl.constexpr):
  """Whether (v1, i1) wins over (v2, i2): the larger (MAX) or smaller value, NaN above all, the first index on ties."""
  nan1 = v1 != v1
  nan2 = v2 != v2
  if MAX:
    strict = (v1 > v2) | (nan1 & ~nan2)
  else:
    strict = (v1 < v2) | (nan1 & ~nan2)
  tie = (v1 == v2) | (nan1 & nan2)
  return strict | (tie & (i1 < i2))


@triton.jit
def _argmax_combine(v1, i1, v2, i2):
  b = _better(v1, i1, v2, i2, True)
  return tl.where(b, v1, v2), tl.where(b, i1, i2)


@triton.jit
def _argmin_combine(v1, i1, v2, i2):
  b = _better(v1, i1, v2, i2, False)
  return tl.where(b, v1, v2), tl.where(b, i1, i2)


@triton.jit
def _arg_kernel(out, x, M, N,
                m_size1, m_size2, m_size3, m_size4, x_m_stride0, x_m_stride1, x_m_stride2, x_m_stride3, x_m_stride4,
                x_n_stride, OP: tl.constexpr, IDENT: tl.constexpr, ACC: tl.constexpr, M_DIMS: tl.constexpr,
                M_UNIT: tl.constexpr, N_UNIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                IDX64: tl.constexpr):
  """out[m] = the first index n of the maximum (OP="argmax") or minimum of x[m, n] (n has stride x_n_stride)."""
  pid = tl.program_id(0)
  if IDX64:
    pid = pid.to(tl.int64)
  ms = pid * BLOCK_M + tl.arange(0, BLOCK_M)
  m_off = axis_offsets(ms, m_size1, m_size2, m_size3, m_size4, x_m_stride0, x_m_stride1, x_m_stride2, x_m_stride3,
                       x_m_stride4, M_DIMS, M_UNIT)
  m_mask = ms < M
  best = tl.full([BLOCK_M, BLOCK_N], IDENT, ACC)
  best_i = tl.zeros([BLOCK_M, BLOCK_N], tl.int64)
  for n0 in range(0, N, BLOCK_N):
    ns = n0 + tl.arange(0, BLOCK_N)
    n_off = ns if N_UNIT else ns * x_n_stride
    v = tl.load(x + m_off[:, None] + n_off[None, :], mask=m_mask[:, None] & (ns < N)[None, :], other=IDENT)
    v = v.to(ACC)
    i = tl.zeros([BLOCK_M, BLOCK_N], tl.int64) + ns[None, :]
    take = _better(v, i, best, best_i, OP == "argmax") & (ns < N)[None, :]
    best = tl.where(take, v, best)
    best_i = tl.where(take, i, best_i)
  if OP == "argmax":
    _, r = tl.reduce((best, best_i), 1, _argmax_combine)
  else:
    _, r = tl.reduce((best, best_i), 1, _argmin_combine)
  tl.store(out + ms, r, mask=m_mask)


@triton.jit
def _cumsum_kernel(out, x, M, N,
                   m_size1, m_size2, m_size3, m_size4, x_m_stride0, x_m_stride1, x_m_stride2, x_m_stride3, x_m_stride4,
                   out_m_stride0, out_m_stride1, out_m_stride2, out_m_stride3, out_m_stride4, x_n_stride, out_n_stride,
                   ACC: tl.constexpr, M_DIMS: tl.constexpr, M_UNIT: tl.constexpr, REVERSE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IDX64: tl.constexpr, PROD: tl.constexpr):
  """Running sums (products when PROD) of x[m, n] along n (from the end when REVERSE); tiles of BLOCK_N carry the
  total so far."""
  pid = tl.program_id(0)
  if IDX64:
    pid = pid.to(tl.int64)
  ms = pid * BLOCK_M + tl.arange(0, BLOCK_M)
  m_off = axis_offsets(ms, m_size1, m_size2, m_size3, m_size4, x_m_stride0, x_m_stride1, x_m_stride2, x_m_stride3,
                       x_m_stride4, M_DIMS, M_UNIT)
  o_off = axis_offsets(ms, m_size1, m_size2, m_size3, m_size4, out_m_stride0, out_m_stride1, out_m_stride2,
                       out_m_stride3, out_m_stride4, M_DIMS, M_UNIT)
  m_mask = ms < M
  carry = tl.zeros([BLOCK_M], ACC) + PROD
  n_tiles = tl.cdiv(N, BLOCK_N)
  for t in range(0, n_tiles):
    if REVERSE:
      t = n_tiles - 1 - t
    ns = t * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = m_mask[:, None] & (ns < N)[None, :]
    v = tl.load(x + m_off[:, None] + (ns * x_n_stride)[None, :], mask=mask, other=PROD).to(ACC)
    if PROD:
      s = tl.cumprod(v, axis=1, reverse=REVERSE) * carry[:, None]
    else:
      s = tl.cumsum(v, axis=1, reverse=REVERSE) + carry[:, None]
    tl.store(out + o_off[:, None] + (ns * out_n_stride)[None, :], s.to(out.dtype.element_ty), mask=mask)
    # NOTE: the carry is the scan's end column; `carry += tl.sum(v, 1)` trips an assertion in Triton 3.6's
    # OptimizeThreadLocality pass
    end = 0 if REVERSE else BLOCK_N - 1
    carry = tl.sum(tl.where((tl.arange(0, BLOCK_N) == end)[None, :], s, 0), axis=1)


# *** host side ***

def _layout(shape, strides, dims):
  """(perm, kept shape, kept strides, reduced shape, reduced strides), collapsed, the reduced dims by falling stride.
  A layout needing more than 5 dims on an axis is to be copied first with its dims in the order `perm` (kept dims
  first), which collapses it to (M, N); perm is None for any other."""
  kept = [d for d in range(len(shape)) if d not in dims]
  red = sorted(dims, key=lambda d: -strides[d])
  kshape, (kst,) = collapse([shape[d] for d in kept], [strides[d] for d in kept])
  rshape, (rst,) = collapse([shape[d] for d in red], [strides[d] for d in red])
  if len(kshape) <= 5 and len(rshape) <= 5: return None, kshape, kst, rshape, rst
  M, N = math.prod(kshape), math.prod(rshape)
  return kept + red, (M,), (N,), (N,), (1,)


def _permuted(a: CudaArray, perm) -> CudaArray:
  return CudaArray(a.ptr, tuple(a.shape[d] for d in perm), tuple(a.strides[d] for d in perm), a.dtype, a.device, a.owner)


def _identity(op: str, dtype: DType):
  """The value masked lanes load: the identity of the op in dtype."""
  if op == "sum": return 0
  if dtype.is_floating_point: return float("-inf") if op in ("amax", "argmax") else float("inf")
  if dtype is dtypes.bool_: return 0 if op in ("amax", "argmax") else 1
  if dtype is dtypes.uint8: return 0 if op in ("amax", "argmax") else 255
  bits = 8 * dtype.itemsize - 1
  return -2**bits if op in ("amax", "argmax") else 2**bits - 1


def accumulation_dtype(op: str, x: DType, out: DType) -> DType:
  """The accumulation dtype: float32 for half types, int64 for integer sums, int32 for bool extremes."""
  if op != "sum":
    return dtypes.float32 if x in (dtypes.float16, dtypes.bfloat16) else dtypes.int32 if x is dtypes.bool_ else x
  if dtypes.float64 in (x, out): return dtypes.float64
  return dtypes.float32 if out.is_floating_point else dtypes.int64


@functools.lru_cache(maxsize=4096)
def reduce_spec(op: str, x: DType, out: DType, m_dims: int, n_dims: int, m_unit: bool, n_unit: bool, M: int, N: int,
                i64: bool, vectors: bool = False, stages: int | None = None):
  """The reduction kernel's variant (m_dims, n_dims: the dims of the kept and reduced axes; *_unit: a single
  unit-stride dim; vectors: a 2-D problem whose pointers, M, N, chunk and non-unit stride are promised multiples of
  16, so its tiles load 16-byte vectors along the unit-stride axis; stages: tiles in flight, the configurator's
  REDUCE_STAGES unless given)."""
  bm, bn, warps = reduce_schedule(M, N, m_unit and m_dims == 1 and not (n_unit and n_dims == 1))
  it = "i64" if i64 else "i32"
  sig = {"out": ptr(out), "x": ptr(x), "M": it, "N": it, "chunk": it,
         **{k: it for k in axis_params("m", "x") + axis_params("n", "x")}}
  if vectors:
    strides = [f"x_{axis}_stride4" for axis, unit in (("m", m_unit), ("n", n_unit)) if not unit]
    sig = divisible(sig, ("out", "x", "M", "N", "chunk", *strides))
  return spec(_reduce_kernel, sig, dict(OP=op, IDENT=_identity(op, x), ACC=TL[accumulation_dtype(op, x, out)],
                                        M_DIMS=m_dims, N_DIMS=n_dims, M_UNIT=m_unit, N_UNIT=n_unit, BLOCK_M=bm,
                                        BLOCK_N=bn, STAGES=stages or REDUCE_STAGES, IDX64=i64), num_warps=warps)


def reduce(x: CudaArray, dims, keepdim: bool, op: str, out_dtype: DType, stages: int | None = None) -> CudaArray:
  """op ("sum", "amax", "amin") of x over `dims` in out_dtype, a new contiguous array (see the module's docstring;
  stages: the first pass's tiles in flight, to try other than the configurator's)."""
  out_shape, perm, passes = _reduce_plan(op, x.shape, x.strides, x.dtype, tuple(dims), keepdim, out_dtype,
                                         x.ptr % 16 == 0, stages)
  s = current_stream(x.device)
  out = empty(out_shape, out_dtype, x.device, s)
  if not passes: return out if 0 in out_shape else fill(out, 0)
  if perm is not None: x = copy(_permuted(x, perm))
  for variant, grid, scalars, partial in passes:
    dst = out if partial is None else empty(*partial, x.device, s)
    variant.kernel(grid, dst, x, *scalars, stream=s)
    x = dst
  return out


def _vectors(aligned: bool, kshape, kst, rshape, rst, chunk: int) -> bool:
  """Whether a pass may take `reduce_spec`'s vectors variant: x on 16 bytes, one kept and one reduced dim, their
  sizes, the chunk and every stride but a unit one multiples of 16."""
  return aligned and len(kshape) == len(rshape) == 1 and \
    all(n % 16 == 0 for n in (kshape[0], rshape[0], chunk, *(st for st in (kst[0], rst[0]) if st != 1)))


@functools.lru_cache(maxsize=4096)
def _reduce_plan(op: str, shape, strides, dtype: DType, dims: tuple[int, ...], keepdim: bool, out_dtype: DType,
                 aligned: bool = False, stages: int | None = None):
  """(output shape, the permutation of x to copy first or None, passes) of a reduction of x's layout (`aligned`: x
  starts on 16 bytes); each pass is (variant, grid, scalar arguments after the out and x pointers, (shape, dtype) of a
  partial result or None for the output), and reads the previous pass's result. No passes: the output or x is
  empty."""
  out_shape = (tuple(1 if d in dims else n for d, n in enumerate(shape)) if keepdim else
               tuple(n for d, n in enumerate(shape) if d not in dims))
  if 0 in out_shape or 0 in shape: return out_shape, None, []
  perm, kshape, kst, rshape, rst = _layout(shape, strides, dims)
  M, N = math.prod(kshape), math.prod(rshape)
  i64 = needs_i64(shape, strides) if perm is None else needs_i64((M, N), (N, 1))
  units = (kst[-1] == 1, rst[-1] == 1)
  s = reduce_spec(op, dtype, out_dtype, len(kshape), len(rshape), *units, M, N, i64)
  bm, bn = s.constexprs["BLOCK_M"], s.constexprs["BLOCK_N"]
  passes = []
  aligned = aligned or perm is not None  # a permuting copy is a new array
  if (pieces := split_rule(cdiv(M, bm), N, bn)) > 1:
    chunk = cdiv(cdiv(N, pieces), bn) * bn
    pieces = cdiv(N, chunk)
    acc = accumulation_dtype(op, dtype, out_dtype)
    s = reduce_spec(op, dtype, acc, len(kshape), len(rshape), *units, M, N, i64,
                    _vectors(aligned, kshape, kst, rshape, rst, chunk), stages)
    passes.append((s, (cdiv(M, bm), pieces), (M, N, chunk, *axis_args(kshape, kst), *axis_args(rshape, rst)),
                   ((pieces, M), acc)))
    kshape, kst, rshape, rst, N = (M,), (1,), (pieces,), (M,), pieces
    s = reduce_spec(op, acc, out_dtype, 1, 1, True, False, M, N, i64, _vectors(True, kshape, kst, rshape, rst, N))
  else:
    s = reduce_spec(op, dtype, out_dtype, len(kshape), len(rshape), *units, M, N, i64,
                    _vectors(aligned, kshape, kst, rshape, rst, N), stages)
  passes.append((s, (cdiv(M, s.constexprs["BLOCK_M"]), 1), (M, N, N, *axis_args(kshape, kst), *axis_args(rshape, rst)),
                 None))
  return out_shape, perm, passes


@functools.lru_cache(maxsize=4096)
def arg_spec(op: str, x: DType, m_dims: int, m_unit: bool, n_unit: bool, M: int, N: int, i64: bool):
  """The argmax/argmin kernel's variant."""
  bm, bn, warps = reduce_schedule(M, N, m_unit and m_dims == 1 and not n_unit)
  it = "i64" if i64 else "i32"
  sig = {"out": "*i64", "x": ptr(x), "M": it, "N": it, **{k: it for k in axis_params("m", "x")}, "x_n_stride": it}
  return spec(_arg_kernel, sig, dict(OP=op, IDENT=_identity(op, x), ACC=TL[accumulation_dtype(op, x, x)], M_DIMS=m_dims,
                                     M_UNIT=m_unit, N_UNIT=n_unit, BLOCK_M=bm, BLOCK_N=bn, IDX64=i64), num_warps=warps)


def _argreduce(x: CudaArray, dim: int, keepdim: bool, op: str) -> CudaArray:
  out = empty(tuple(1 if d == dim else n for d, n in enumerate(x.shape)) if keepdim else x.shape[:dim] + x.shape[dim + 1:],
              dtypes.int64, x.device)
  if out.size == 0: return out
  perm, kshape, kst, rshape, rst = _layout(x.shape, x.strides, (dim,))
  if perm is not None: x = copy(_permuted(x, perm))
  M, N = math.prod(kshape), math.prod(rshape)
  i64 = needs_i64(x.shape, x.strides)
  s = arg_spec(op, x.dtype, len(kshape), kst[-1] == 1, rst[-1] == 1, M, N, i64)
  run(s, (cdiv(M, s.constexprs["BLOCK_M"]),), out.ptr, x.ptr, M, N, *axis_args(kshape, kst), rst[-1])
  return out


@functools.lru_cache(maxsize=4096)
def cumsum_spec(x: DType, m_dims: int, m_unit: bool, reverse: bool, M: int, N: int, i64: bool, prod: bool = False):
  """The scan kernel's variant (of cumprod when `prod`)."""
  bm, bn, warps = reduce_schedule(M, N, m_unit and m_dims == 1)
  it = "i64" if i64 else "i32"
  sig = {"out": ptr(x), "x": ptr(x), "M": it, "N": it, **{k: it for k in axis_params("m", "x", "out")},
         "x_n_stride": it, "out_n_stride": it}
  return spec(_cumsum_kernel, sig, dict(ACC=TL[accumulation_dtype("sum", x, x)], M_DIMS=m_dims, M_UNIT=m_unit,
                                        REVERSE=reverse, BLOCK_M=bm, BLOCK_N=bn, IDX64=i64, PROD=int(prod)),
              num_warps=warps)


def cumsum(x: CudaArray, dim: int, reverse: bool = False, prod: bool = False) -> CudaArray:
  """Running sums (products when `prod`) along dim."""
  out = empty(x.shape, x.dtype, x.device)
  if out.size == 0: return out
  kept = [d for d in range(x.ndim) if d != dim]
  kshape, (kst, ost) = collapse([x.shape[d] for d in kept], [x.strides[d] for d in kept], [out.strides[d] for d in kept])
  if len(kshape) > 5:  # scan a copy with dim last, whose kept dims collapse to one, and copy back
    t = cumsum(copy(_permuted(x, kept + [dim])), x.ndim - 1, reverse, prod)
    launch("copy", _permuted(out, kept + [dim]), t)
    return out
  M, N = math.prod(kshape), x.shape[dim]
  i64 = needs_i64(x.shape, x.strides)
  s = cumsum_spec(x.dtype, len(kshape), kst[-1] == 1 and ost[-1] == 1, reverse, M, N, i64, prod)
  run(s, (cdiv(M, s.constexprs["BLOCK_M"]),), out.ptr, x.ptr, M, N, *axis_args(kshape, kst, ost), x.strides[dim],
      out.strides[dim])
  return out


# *** a pointwise op with its column sums ***

@triton.jit
def _column_sums(out, part, P, N, ns, n_mask, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
  """out[ns] = the sum of the P rows of N at part, columns ns, in out's dtype."""
  acc = tl.zeros([BLOCK_P, BLOCK_N], part.dtype.element_ty)
  for p0 in range(0, P, BLOCK_P):
    ps = p0 + tl.arange(0, BLOCK_P)
    acc += tl.load(part + ps[:, None] * N + ns[None, :], mask=(ps < P)[:, None] & n_mask[None, :], other=0)
  tl.store(out + ns, tl.sum(acc, axis=0).to(out.dtype.element_ty), mask=n_mask)


@triton.jit
def _partial_sums_kernel(out, part, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
  """out = the column sums of the P rows of N at part; program pid takes columns [pid BLOCK_N, (pid + 1) BLOCK_N)."""
  ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
  _column_sums(out, part, P, N, ns, ns < N, BLOCK_P, BLOCK_N)


@functools.lru_cache(maxsize=256)
def partial_sums_spec(acc: DType, blocks: tuple[int, int]):
  """The kernel adding up partial rows (acc: their dtype and the output's; blocks: partial_sums_schedule's)."""
  sig = {"out": ptr(acc), "part": ptr(acc), "P": "i32", "N": "i32"}
  return spec(_partial_sums_kernel, sig, dict(BLOCK_P=blocks[0], BLOCK_N=blocks[1]), num_warps=4)

@triton.jit
def _gelu_backward_sums_kernel(dx, part, g, x, M, N, ROWS, TANH: tl.constexpr, ACC: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                               IDX64: tl.constexpr):
  """dx = g gelu'(x) over M rows of N contiguous elements, computed in ACC and rounded to dx's dtype as the elementwise
  kernel rounds it, and the column sums of dx as stored over rows [p ROWS, (p + 1) ROWS), p = program_id(1), into row
  p of part (ACC); program_id(0) picks the BLOCK_N columns."""
  pid_n = tl.program_id(0)
  pid_m = tl.program_id(1)
  if IDX64:
    pid_n = pid_n.to(tl.int64)
    pid_m = pid_m.to(tl.int64)
  ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
  n_mask = ns < N
  end = tl.minimum(pid_m * ROWS + ROWS, M)
  acc = tl.zeros([BLOCK_M, BLOCK_N], ACC)
  for m0 in tl.range(pid_m * ROWS, end, BLOCK_M, num_stages=STAGES):
    ms = m0 + tl.arange(0, BLOCK_M)
    mask = (ms < end)[:, None] & n_mask[None, :]
    off = ms[:, None] * N + ns[None, :]
    gv = tl.load(g + off, mask=mask, other=0).to(ACC)
    v = gelu_backward(gv, tl.load(x + off, mask=mask, other=0).to(ACC), TANH).to(dx.dtype.element_ty)
    tl.store(dx + off, v, mask=mask)
    acc += tl.where(mask, v.to(ACC), 0.0)
  tl.store(part + pid_m * N + ns, tl.sum(acc, axis=0), mask=n_mask)


@functools.lru_cache(maxsize=1024)
def gelu_backward_sums_spec(g: DType, x: DType, out: DType, tanh: bool, i64: bool, vectors: bool,
                            schedule: ColumnSums):
  """The variant of GELU's backward with column sums (vectors: pointers and N promised multiples of 16)."""
  it, acc = "i64" if i64 else "i32", dtypes.float64 if dtypes.float64 in (g, x, out) else dtypes.float32
  sig = {"dx": ptr(out), "part": ptr(acc), "g": ptr(g), "x": ptr(x), "M": it, "N": it, "ROWS": it}
  if vectors: sig = divisible(sig, ("dx", "part", "g", "x", "N"))
  return spec(_gelu_backward_sums_kernel, sig, dict(TANH=tanh, ACC=TL[acc], BLOCK_M=schedule.block_m,
                                                     BLOCK_N=schedule.block_n, STAGES=schedule.stages, IDX64=i64),
              num_warps=schedule.warps)


def gelu_backward_sums(g: CudaArray, x: CudaArray, approximate: str, out: CudaArray | None = None,
                       schedule: ColumnSums | None = None) -> tuple[CudaArray, CudaArray]:
  """(dx, sums): GELU's backward g gelu'(x) (into `out` when given, else a new array of x's dtype), and the sums of dx
  as stored over all its dims but the last, in float32 (float64 for float64): a bias gradient from the kernel that
  writes the gradient it sums. Programs walk a column block down a run of rows (`configurator.column_sums_schedule`,
  or `schedule` to try another) and leave one row of partial sums each, which a reduction adds up (in a fixed order:
  the same bits on every run). Strided operands take the elementwise kernel and a reduction."""
  dx = out if out is not None else empty(x.shape, x.dtype, x.device)
  acc = dtypes.float64 if dtypes.float64 in (g.dtype, x.dtype, dx.dtype) else dtypes.float32
  N = dx.shape[-1] if dx.ndim else 1
  M = dx.size // N if N else 0
  lead = tuple(range(dx.ndim - 1))
  dense = g.is_contiguous() and x.is_contiguous() and dx.is_contiguous() and g.shape == x.shape == dx.shape
  if M * N == 0 or not dense:
    launch("gelu_backward_tanh" if approximate == "tanh" else "gelu_backward", dx, g, x)
    return dx, reduce(dx, lead, False, "sum", acc)
  schedule = schedule or column_sums_schedule(M, N, runtime.hardware(dx.device).sms)
  runs = cdiv(M, schedule.rows)
  parts = empty((runs, N), acc, dx.device)
  vectors = N % 16 == 0 and all(a.ptr % 16 == 0 for a in (dx, parts, g, x))
  s = gelu_backward_sums_spec(g.dtype, x.dtype, dx.dtype, approximate == "tanh", needs_i64(dx.shape, dx.strides),
                              vectors, schedule)
  run(s, (cdiv(N, schedule.block_n), runs), dx.ptr, parts.ptr, g.ptr, x.ptr, M, N, schedule.rows)
  sums = empty((N,), acc, dx.device)
  blocks = partial_sums_schedule(runs, N, runtime.hardware(dx.device).sms)
  run(partial_sums_spec(acc, blocks), (cdiv(N, blocks[1]),), sums.ptr, parts.ptr, runs, N)
  return dx, sums


KERNELS = {
  "sum": lambda x, dims, keepdim, dtype: reduce(x, dims, keepdim, "sum", dtype),
  "amax": lambda x, dims, keepdim: reduce(x, dims, keepdim, "amax", x.dtype),
  "amin": lambda x, dims, keepdim: reduce(x, dims, keepdim, "amin", x.dtype),
  "argmax": lambda x, dim, keepdim: _argreduce(x, dim, keepdim, "argmax"),
  "argmin": lambda x, dim, keepdim: _argreduce(x, dim, keepdim, "argmin"),
  "cumsum": cumsum,
  "cumprod": lambda x, dim: cumsum(x, dim, prod=True),
}


def _specs() -> list:
  f32, bf16, f16, f64, i64, b = dtypes.float32, dtypes.bfloat16, dtypes.float16, dtypes.float64, dtypes.int64, dtypes.bool_
  out = []
  for op in ("sum", "amax", "amin"):
    out.append(reduce_spec(op, f32, f32, 1, 1, True, True, 1 << 14, 768, False))     # rows
    out.append(reduce_spec(op, bf16, bf16, 1, 1, True, False, 768, 1 << 14, False))  # leading dims
    out.append(reduce_spec(op, f32, f32, 1, 1, False, True, 1 << 14, 768, False, True))  # and as 16-byte vectors
    out.append(reduce_spec(op, bf16, f32, 1, 1, True, False, 768, 1 << 14, False, True))
  out += [reduce_spec("sum", f32, f32, 1, 1, True, False, 768, 128, False),          # second pass of a split
          reduce_spec("sum", b, i64, 3, 2, False, False, 100, 100, True),
          reduce_spec("sum", f16, f32, 2, 1, True, True, 100, 3, False),
          reduce_spec("amax", i64, i64, 1, 2, False, True, 10, 1000, False),
          reduce_spec("amin", b, b, 1, 1, True, True, 10, 1000, False),
          reduce_spec("sum", f64, f64, 5, 5, False, False, 1000, 1000, False),
          reduce_spec("sum", dtypes.uint8, i64, 1, 1, True, True, 100, 1000, False),
          reduce_spec("amax", dtypes.uint8, dtypes.uint8, 1, 1, True, True, 100, 1000, False),
          reduce_spec("amin", dtypes.int8, dtypes.int8, 1, 1, True, False, 1000, 100, False)]
  for op in ("argmax", "argmin"):
    out += [arg_spec(op, f32, 1, True, True, 1 << 14, 50304, False), arg_spec(op, bf16, 2, True, False, 1000, 64, False),
            arg_spec(op, i64, 3, False, False, 1000, 64, True)]
  out += [cumsum_spec(f32, 1, True, False, 100, 1000, False), cumsum_spec(bf16, 1, True, True, 100, 1000, False),
          cumsum_spec(i64, 3, False, True, 1000, 10, True), cumsum_spec(f64, 1, False, False, 10, 10, False),
          cumsum_spec(f32, 1, True, False, 100, 1000, False, True), cumsum_spec(i64, 2, False, False, 10, 100, False, True)]
  gpt2 = column_sums_schedule(1 << 14, 3072, 132)  # GELU's backward with the bias gradient (fuse-bias-grads)
  out += [gelu_backward_sums_spec(bf16, bf16, bf16, False, False, True, gpt2),
          gelu_backward_sums_spec(f32, f32, f32, True, False, False, column_sums_schedule(100, 30, 132)),
          gelu_backward_sums_spec(f64, f64, f64, False, True, False, gpt2),
          partial_sums_spec(f32, partial_sums_schedule(43, 3072, 132)), partial_sums_spec(f64, (32, 64))]
  return out


SPECS = _specs()
