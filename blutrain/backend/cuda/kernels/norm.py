"""Row kernels: softmax and log_softmax along any dim, layer_norm over the trailing dims (also fused with the residual
add before it, and its backward with the residual gradient's add after it: Nova's fuse-norms pass).

A row that fits a tile (up to 8192 elements) is loaded once and normalized in registers. A longer row takes two
passes: the first keeps per-lane running statistics (online max and rescaled sum of exponentials for softmax; Welford
mean and M2 for layer_norm) that are combined across lanes once at the end, the second writes the output. Statistics
are float32 (float64 for float64 inputs).

layer_norm's backward leaves per-program column sums of dw and db (float32) that one small kernel sums into dw and db;
how many rows a program takes and how many of its row tiles are in flight is `configurator.norm_backward_schedule`.
"""
from __future__ import annotations

import functools
import math

import triton
import triton.language as tl

from blutrain import dtypes
from blutrain.backend.cuda import runtime
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import (TL, aligned, axis_args, axis_offsets, axis_params, collapse, divisible, empty,
                                           empty_like, max_nan, needs_i64, ptr, run, spec, sqrt_rn, strided, view)
from blutrain.backend.cuda.kernels.copy import copy
from blutrain.backend.cuda.kernels.creation import fill
from blutrain.backend.cuda.kernels.elementwise import elementwise
from blutrain.backend.cuda.kernels.reduce import _column_sums
from blutrain.configurator import (H200, NormBackward, norm_backward_schedule, partial_sums_schedule, reduce_schedule,
                                   row_schedule, split_rule)
from blutrain.dtypes import DType
from blutrain.shapes import cdiv, contiguous_strides


@triton.jit
def _online(m, s, v):
  """One step of the online softmax statistics per lane: running max m and sum s of exp(x - m). One exponential a
  step: exp(-|v - m|) is the rescale exp(m - v) of s when v is the new max, else v's term exp(v - m) (the same bits as
  computing both, where the other is exp(0) = 1); a -inf v adds nothing, a +inf or NaN one makes the sum NaN."""
  d = v - m
  e = tl.exp(-tl.abs(d))
  t = tl.where(d > 0, s * e + 1.0, s + e)
  s = tl.where(v == float("-inf"), s, tl.where(v == float("inf"), float("nan"), t))
  return tl.maximum(m, v, propagate_nan=tl.PropagateNan.ALL), s


@triton.jit
def row_stats(x, m_off, m_mask, N, n_stride, ACC: tl.constexpr, N_UNIT: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
  """Per-row (max, sum of exp(x - max)) over N elements of stride n_stride, as [BLOCK_M] vectors."""
  m = tl.full([BLOCK_M, BLOCK_N], float("-inf"), ACC)
  s = tl.zeros([BLOCK_M, BLOCK_N], ACC)
  for n0 in range(0, N, BLOCK_N):
    ns = n0 + tl.arange(0, BLOCK_N)
    n_off = ns if N_UNIT else ns * n_stride
    v = tl.load(x + m_off[:, None] + n_off[None, :], mask=m_mask[:, None] & (ns < N)[None, :], other=float("-inf"))
    m, s = _online(m, s, v.to(ACC))
  row_max = tl.reduce(m, 1, max_nan)
  row_sum = tl.sum(s * tl.where(m == float("-inf"), 0.0, tl.exp(m - row_max[:, None])), axis=1)
  return row_max, row_sum


@triton.jit
def _softmax_kernel(out, x, M, N,
                    m_size1, m_size2, m_size3, m_size4, x_m_stride0, x_m_stride1, x_m_stride2, x_m_stride3, x_m_stride4,
                    out_m_stride0, out_m_stride1, out_m_stride2, out_m_stride3, out_m_stride4, x_n_stride, out_n_stride,
                    LOG: tl.constexpr, ACC: tl.constexpr, M_DIMS: tl.constexpr, M_UNIT: tl.constexpr,
                    N_UNIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
                    IDX64: tl.constexpr):
  """softmax (or log_softmax when LOG) of rows m along n: x at m_off + n x_n_stride, out at o_off + n out_n_stride."""
  pid = tl.program_id(0)
  if IDX64:
    pid = pid.to(tl.int64)
  ms = pid * BLOCK_M + tl.arange(0, BLOCK_M)
  m_mask = ms < M
  m_off = axis_offsets(ms, m_size1, m_size2, m_size3, m_size4, x_m_stride0, x_m_stride1, x_m_stride2, x_m_stride3,
                       x_m_stride4, M_DIMS, M_UNIT)
  o_off = axis_offsets(ms, m_size1, m_size2, m_size3, m_size4, out_m_stride0, out_m_stride1, out_m_stride2,
                       out_m_stride3, out_m_stride4, M_DIMS, M_UNIT)
  if ONE_PASS:
    ns = tl.arange(0, BLOCK_N)
    mask = m_mask[:, None] & (ns < N)[None, :]
    v = tl.load(x + m_off[:, None] + (ns if N_UNIT else ns * x_n_stride)[None, :], mask=mask, other=float("-inf"))
    v = v.to(ACC)
    row_max = tl.reduce(v, 1, max_nan)
    e = tl.exp(v - row_max[:, None])
    row_sum = tl.sum(e, axis=1)
    if LOG:
      y = (v - row_max[:, None]) - tl.log(row_sum)[:, None]
    else:
      y = e / row_sum[:, None]
    tl.store(out + o_off[:, None] + (ns if N_UNIT else ns * out_n_stride)[None, :], y.to(out.dtype.element_ty),
             mask=mask)
  else:
    row_max, row_sum = row_stats(x, m_off, m_mask, N, x_n_stride, ACC, N_UNIT, BLOCK_M, BLOCK_N)
    log_sum = tl.log(row_sum)
    for n0 in range(0, N, BLOCK_N):
      ns = n0 + tl.arange(0, BLOCK_N)
      mask = m_mask[:, None] & (ns < N)[None, :]
      v = tl.load(x + m_off[:, None] + (ns if N_UNIT else ns * x_n_stride)[None, :], mask=mask).to(ACC)
      if LOG:
        y = (v - row_max[:, None]) - log_sum[:, None]
      else:
        y = tl.exp(v - row_max[:, None]) / row_sum[:, None]
      tl.store(out + o_off[:, None] + (ns if N_UNIT else ns * out_n_stride)[None, :], y.to(out.dtype.element_ty),
               mask=mask)


@triton.jit
def _welford_combine(m1, q1, n1, m2, q2, n2):
  """Chan et al.'s merge of (mean, M2, count) pairs."""
  n = n1 + n2
  w = tl.where(n == 0, 0.0, n2 / tl.maximum(n, 1.0))
  d = m2 - m1
  return m1 + d * w, q1 + q2 + d * d * n1 * w, n


@triton.jit
def _row_moments(x, m_off, m_mask, N, eps, ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
  """Per-row mean and 1/sqrt(var + eps) of rows of N contiguous elements at m_off, by Welford over tiles of BLOCK_N."""
  mean = tl.zeros([BLOCK_M, BLOCK_N], ACC)
  m2 = tl.zeros([BLOCK_M, BLOCK_N], ACC)
  cnt = tl.zeros([BLOCK_M, BLOCK_N], ACC)
  for n0 in range(0, N, BLOCK_N):
    ns = n0 + tl.arange(0, BLOCK_N)
    mask = m_mask[:, None] & (ns < N)[None, :]
    v = tl.load(x + m_off[:, None] + ns[None, :], mask=mask, other=0).to(ACC)
    c = cnt + tl.where(mask, 1.0, 0.0)
    d = tl.where(mask, v - mean, 0.0)
    mean += d / tl.maximum(c, 1.0)
    m2 += d * tl.where(mask, v - mean, 0.0)
    cnt = c
  mean, m2, _ = tl.reduce((mean, m2, cnt), 1, _welford_combine)
  return mean, 1.0 / sqrt_rn(m2 / N + eps)


@triton.jit
def _layer_norm_kernel(out, h, x, addend, w, b, M, N, eps,
                       m_size1, m_size2, m_size3, m_size4,
                       x_m_stride0, x_m_stride1, x_m_stride2, x_m_stride3, x_m_stride4,
                       ACC: tl.constexpr, M_DIMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                       ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
                       IDX64: tl.constexpr):
  """(x - mean) / sqrt(var + eps) * w + b over rows of N contiguous elements (x at m_off + n, out at m * N + n). With
  ADD the rows are h = x + addend (at x's offsets, both read as ACC), stored at m * N + n and normalized as stored."""
  pid = tl.program_id(0)
  if IDX64:
    pid = pid.to(tl.int64)
  ms = pid * BLOCK_M + tl.arange(0, BLOCK_M)
  m_mask = ms < M
  m_off = strided(ms, m_size1, m_size2, m_size3, m_size4, x_m_stride0, x_m_stride1, x_m_stride2, x_m_stride3,
                  x_m_stride4, M_DIMS)
  if ONE_PASS:
    ns = tl.arange(0, BLOCK_N)
    mask = m_mask[:, None] & (ns < N)[None, :]
    v = tl.load(x + m_off[:, None] + ns[None, :], mask=mask, other=0).to(ACC)
    if ADD:
      v = (v + tl.load(addend + m_off[:, None] + ns[None, :], mask=mask, other=0).to(ACC)).to(h.dtype.element_ty)
      tl.store(h + ms[:, None] * N + ns[None, :], v, mask=mask)
      v = v.to(ACC)
    mean = tl.sum(v, axis=1) / N
    xc = tl.where(mask, v - mean[:, None], 0.0)
    rstd = 1.0 / sqrt_rn(tl.sum(xc * xc, axis=1) / N + eps)
    y = xc * rstd[:, None]
    if HAS_W:
      y = y * tl.load(w + ns, mask=ns < N).to(ACC)[None, :]
    if HAS_B:
      y = y + tl.load(b + ns, mask=ns < N).to(ACC)[None, :]
    tl.store(out + ms[:, None] * N + ns[None, :], y.to(out.dtype.element_ty), mask=mask)
  else:
    if ADD:  # the sum first, then the two passes over it as stored (the program's threads see their own stores)
      for n0 in range(0, N, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        mask = m_mask[:, None] & (ns < N)[None, :]
        v = tl.load(x + m_off[:, None] + ns[None, :], mask=mask, other=0).to(ACC)
        v += tl.load(addend + m_off[:, None] + ns[None, :], mask=mask, other=0).to(ACC)
        tl.store(h + ms[:, None] * N + ns[None, :], v.to(h.dtype.element_ty), mask=mask)
      tl.debug_barrier()
      x = h
      m_off = ms * N
    mean, rstd = _row_moments(x, m_off, m_mask, N, eps, ACC, BLOCK_M, BLOCK_N)
    for n0 in range(0, N, BLOCK_N):
      ns = n0 + tl.arange(0, BLOCK_N)
      mask = m_mask[:, None] & (ns < N)[None, :]
      v = tl.load(x + m_off[:, None] + ns[None, :], mask=mask, other=0).to(ACC)
      y = (v - mean[:, None]) * rstd[:, None]
      if HAS_W:
        y = y * tl.load(w + ns, mask=ns < N).to(ACC)[None, :]
      if HAS_B:
        y = y + tl.load(b + ns, mask=ns < N).to(ACC)[None, :]
      tl.store(out + ms[:, None] * N + ns[None, :], y.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _backward_tile(g, x, w, ms, m_mask, n0, N, mean, rstd, ACC: tl.constexpr, HAS_W: tl.constexpr,
                   BLOCK_N: tl.constexpr):
  """Columns n0 + [0, BLOCK_N) of rows ms: (columns, mask, offsets, xhat, g, g w)."""
  ns = n0 + tl.arange(0, BLOCK_N)
  mask = m_mask[:, None] & (ns < N)[None, :]
  off = ms[:, None] * N + ns[None, :]
  xhat = tl.where(mask, tl.load(x + off, mask=mask, other=0).to(ACC) - mean[:, None], 0.0) * rstd[:, None]
  gv = tl.load(g + off, mask=mask, other=0).to(ACC)
  gw = gv * tl.load(w + ns, mask=ns < N, other=0).to(ACC)[None, :] if HAS_W else gv
  return ns, mask, off, xhat, gv, gw


@triton.jit
def _add_partial(ptr, value, mask, first):
  """*ptr = value, or *ptr += value after the program's first row tile."""
  if not first:
    value += tl.load(ptr, mask=mask)
  tl.store(ptr, value, mask=mask)


@triton.jit
def _dx(dx, dxc, r, off, mask, v, ACC: tl.constexpr, HAS_R: tl.constexpr, CAST: tl.constexpr):
  """Store dx = v, or r + v (r read as ACC) by PTX's add.rn: an add with its rounding mode given is never contracted
  with the multiply that made v into an FMA (libdevice's add_rn would flush subnormals), so the sum is the one the
  separate add kernel computes. With CAST, dxc also gets dx rounded to its dtype (from dx's own rounding, as a cast
  of the stored dx would). Returns the last value stored, as ACC, zero where masked."""
  if HAS_R:
    rv = tl.load(r + off, mask=mask, other=0).to(ACC)
    if ACC == tl.float64:
      v = tl.inline_asm_elementwise("add.rn.f64 $0, $1, $2;", "=d,d,d", [rv, v], dtype=tl.float64, is_pure=True, pack=1)
    else:
      v = tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [rv, v], dtype=tl.float32, is_pure=True, pack=1)
  v = v.to(dx.dtype.element_ty)
  tl.store(dx + off, v, mask=mask)
  if CAST:
    v = v.to(dxc.dtype.element_ty)
    tl.store(dxc + off, v, mask=mask)
  return tl.where(mask, v.to(ACC), 0.0)


@triton.jit
def _layer_norm_backward_kernel(dx, dxc, dw_part, db_part, ds_part, g, x, w, r, M, N, eps, ROWS, ACC: tl.constexpr,
                                HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr, CAST: tl.constexpr,
                                SUMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                ONE_PASS: tl.constexpr, STAGES: tl.constexpr, IDX64: tl.constexpr):
  """dx = rstd (gw - mean(gw) - xhat mean(gw xhat)), gw = g w (plus the residual gradient r when HAS_R), over rows of
  N contiguous elements (g, x, r, dx; with CAST dx also rounded into dxc), and this program's column sums of g xhat,
  of g (dw's and db's partial sums) and with SUMS of dx as last stored (a bias gradient's) into row pid of dw_part,
  db_part and ds_part. Program pid takes rows [pid ROWS, (pid + 1) ROWS) in tiles of BLOCK_M rows,
  STAGES of them in flight; the stats are recomputed from x."""
  pid = tl.program_id(0)
  if IDX64:
    pid = pid.to(tl.int64)
  row_end = tl.minimum(pid * ROWS + ROWS, M)
  if ONE_PASS:  # a row is one tile: everything in registers, dw and db summed there too
    ns = tl.arange(0, BLOCK_N)
    n_mask = ns < N
    if HAS_W:
      wv = tl.load(w + ns, mask=n_mask, other=0).to(ACC)
    dw_acc = tl.zeros([BLOCK_N], ACC)
    db_acc = tl.zeros([BLOCK_N], ACC)
    ds_acc = tl.zeros([BLOCK_N], ACC)
    for m0 in tl.range(pid * ROWS, row_end, BLOCK_M, num_stages=STAGES):
      ms = m0 + tl.arange(0, BLOCK_M)
      mask = (ms < row_end)[:, None] & n_mask[None, :]
      off = ms[:, None] * N + ns[None, :]
      xv = tl.load(x + off, mask=mask, other=0).to(ACC)
      gv = tl.load(g + off, mask=mask, other=0).to(ACC)
      xc = tl.where(mask, xv - (tl.sum(xv, axis=1) / N)[:, None], 0.0)
      rstd = 1.0 / sqrt_rn(tl.sum(xc * xc, axis=1) / N + eps)
      xhat = xc * rstd[:, None]
      gw = gv * wv[None, :] if HAS_W else gv
      c1 = tl.sum(gw, axis=1) / N
      c2 = tl.sum(gw * xhat, axis=1) / N
      v = _dx(dx, dxc, r, off, mask, (gw - c1[:, None] - xhat * c2[:, None]) * rstd[:, None], ACC, HAS_R, CAST)
      dw_acc += tl.sum(gv * xhat, axis=0)
      db_acc += tl.sum(gv, axis=0)
      if SUMS:
        ds_acc += tl.sum(v, axis=0)
    if HAS_W:
      tl.store(dw_part + pid * N + ns, dw_acc, mask=n_mask)
    if HAS_B:
      tl.store(db_part + pid * N + ns, db_acc, mask=n_mask)
    if SUMS:
      tl.store(ds_part + pid * N + ns, ds_acc, mask=n_mask)
  else:  # long rows, one at a time: stats, then the two row sums, then dx and the partial sums (kept in memory)
    for m0 in range(pid * ROWS, row_end, BLOCK_M):
      ms = m0 + tl.arange(0, BLOCK_M)
      m_mask = ms < row_end
      mean, rstd = _row_moments(x, ms * N, m_mask, N, eps, ACC, BLOCK_M, BLOCK_N)
      c1 = tl.zeros([BLOCK_M, BLOCK_N], ACC)
      c2 = tl.zeros([BLOCK_M, BLOCK_N], ACC)
      for n0 in range(0, N, BLOCK_N):
        ns, mask, off, xhat, gv, gw = _backward_tile(g, x, w, ms, m_mask, n0, N, mean, rstd, ACC, HAS_W, BLOCK_N)
        c1 += gw
        c2 += gw * xhat
      c1s = tl.sum(c1, axis=1) / N
      c2s = tl.sum(c2, axis=1) / N
      for n0 in range(0, N, BLOCK_N):
        ns, mask, off, xhat, gv, gw = _backward_tile(g, x, w, ms, m_mask, n0, N, mean, rstd, ACC, HAS_W, BLOCK_N)
        v = _dx(dx, dxc, r, off, mask, (gw - c1s[:, None] - xhat * c2s[:, None]) * rstd[:, None], ACC, HAS_R, CAST)
        first = m0 == pid * ROWS  # the partial rows start at this program's first row, so nothing is read back
        tl.debug_barrier()  # the threads that read a partial sum back need not be the ones that stored it
        if HAS_W:
          _add_partial(dw_part + pid * N + ns, tl.sum(gv * xhat, axis=0), ns < N, first)
        if HAS_B:
          _add_partial(db_part + pid * N + ns, tl.sum(gv, axis=0), ns < N, first)
        if SUMS:
          _add_partial(ds_part + pid * N + ns, tl.sum(v, axis=0), ns < N, first)


@triton.jit
def _param_grads_kernel(dw, db, ds, parts, P, N, HAS_W: tl.constexpr, HAS_B: tl.constexpr, SUMS: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
  """dw, db and ds (in their dtypes) as the column sums of their P partial rows of N, dw's at parts, db's and ds's
  after them; program pid takes columns [pid BLOCK_N, (pid + 1) BLOCK_N)."""
  ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
  n_mask = ns < N
  if HAS_W:
    _column_sums(dw, parts, P, N, ns, n_mask, BLOCK_P, BLOCK_N)
  if HAS_B:
    _column_sums(db, parts + P * N, P, N, ns, n_mask, BLOCK_P, BLOCK_N)
  if SUMS:
    _column_sums(ds, parts + 2 * P * N, P, N, ns, n_mask, BLOCK_P, BLOCK_N)


def stats_dtype(dtype: DType) -> DType:
  """The dtype row statistics are kept in: float64 for float64 rows, else float32."""
  return dtypes.float64 if dtype is dtypes.float64 else dtypes.float32


@functools.lru_cache(maxsize=4096)
def softmax_spec(log: bool, x: DType, m_dims: int, m_unit: bool, n_unit: bool, M: int, N: int, i64: bool):
  """The (log-)softmax kernel's variant for M rows of N."""
  bm, bn, warps, one = row_schedule(M, N)
  it = "i64" if i64 else "i32"
  sig = {"out": ptr(x), "x": ptr(x), "M": it, "N": it, **{k: it for k in axis_params("m", "x", "out")},
         "x_n_stride": it, "out_n_stride": it}
  return spec(_softmax_kernel, sig, dict(LOG=log, ACC=TL[stats_dtype(x)], M_DIMS=m_dims, M_UNIT=m_unit, N_UNIT=n_unit,
                                         BLOCK_M=bm, BLOCK_N=bn, ONE_PASS=one, IDX64=i64), num_warps=warps)


def _softmax(x: CudaArray, dim: int, log: bool) -> CudaArray:
  out = empty(x.shape, x.dtype, x.device)
  if out.size == 0: return out
  kept = [d for d in range(x.ndim) if d != dim]
  kshape, (kst, ost) = collapse([x.shape[d] for d in kept], [x.strides[d] for d in kept], [out.strides[d] for d in kept])
  if len(kshape) > 5:  # a contiguous copy collapses the kept dims around dim to at most two
    return _softmax(copy(x), dim, log)
  M, N = math.prod(kshape), x.shape[dim]
  i64 = needs_i64(x.shape, x.strides)
  m_unit = kst[-1] == 1 and ost[-1] == 1
  s = softmax_spec(log, x.dtype, len(kshape), m_unit, x.strides[dim] == 1, M, N, i64)
  run(s, (cdiv(M, s.constexprs["BLOCK_M"]),), out.ptr, x.ptr, M, N, *axis_args(kshape, kst, ost), x.strides[dim],
      out.strides[dim])
  return out


def _same_vectors(extra: DType | None, *dtypes_: DType) -> bool:
  """Whether a fused kernel's extra row operand (add_layer_norm's addend, the backward's residual gradient) may be
  promised 16 bytes without changing the kernel's layout: Triton gives every row load the widest vector of the
  kernel's row accesses, and the row sums' order follows it, so a narrower element (float16 beside float32 rows)
  would make the fused kernel round differently from the plain one it must equal bit for bit."""
  return extra is None or extra.itemsize >= min(d.itemsize for d in dtypes_)


@functools.lru_cache(maxsize=4096)
def layer_norm_spec(x: DType, w: DType | None, b: DType | None, m_dims: int, M: int, N: int, i64: bool,
                    out: DType | None = None, y: DType | None = None, vectors: bool = False, schedule=None):
  """The layer-norm kernel's variant for M rows of N (w, b: the dtypes of the weight and bias, None when absent; out:
  the output's, default x's; y: the added operand's of add_layer_norm, None for a plain layer norm; vectors: every
  pointer, N and the row strides are promised multiples of 16, so rows load and store as 16-byte vectors; schedule:
  `row_schedule`'s (BLOCK_M, BLOCK_N, warps, one_pass) unless given)."""
  bm, bn, warps, one = schedule or row_schedule(M, N)
  it = "i64" if i64 else "i32"
  sig = {"out": ptr(out or x), "h": ptr(x), "x": ptr(x), "addend": ptr(y or x), "w": ptr(w or x), "b": ptr(b or x),
         "M": it, "N": it, "eps": "fp64" if x is dtypes.float64 else "fp32", **{k: it for k in axis_params("m", "x")}}
  if vectors:
    extra = ("addend",) if _same_vectors(y, x, out or x) else ()
    sig = divisible(sig, ("out", "h", "x", *extra, "w", "b", "N", *axis_params("m", "x")[4:]))  # [4:]: the strides
  return spec(_layer_norm_kernel, sig, dict(ACC=TL[stats_dtype(x)], M_DIMS=m_dims, HAS_W=w is not None,
                                            HAS_B=b is not None, ADD=y is not None, BLOCK_M=bm, BLOCK_N=bn,
                                            ONE_PASS=one, IDX64=i64), num_warps=warps)


def layer_norm(x: CudaArray, w: CudaArray | None, b: CudaArray | None, n: int, eps: float, dtype=None,
               schedule=None) -> CudaArray:
  out = empty(x.shape, dtype or x.dtype, x.device)
  if out.size == 0: return out
  lead = x.ndim - n
  rshape, (rst,) = collapse(x.shape[lead:], x.strides[lead:])
  kshape, (kst,) = collapse(x.shape[:lead], x.strides[:lead])
  if not (len(rshape) == 1 and (rst[0] == 1 or rshape[0] == 1)) or len(kshape) > 5:  # rows must be contiguous
    x = copy(x)
    kshape, (kst,) = collapse(x.shape[:lead], x.strides[:lead])
  w, b = (p if p is None or p.is_contiguous() else copy(p) for p in (w, b))
  M, N = math.prod(x.shape[:lead]), math.prod(x.shape[lead:])
  i64 = needs_i64(x.shape, x.strides)
  vectors = aligned([a for a in (out, x, w, b) if a is not None], (N, *kst))
  s = layer_norm_spec(x.dtype, w and w.dtype, b and b.dtype, len(kshape), M, N, i64, out.dtype, None, vectors,
                      schedule)
  run(s, (cdiv(M, s.constexprs["BLOCK_M"]),), out.ptr, x.ptr, x.ptr, x.ptr, (w or x).ptr, (b or x).ptr, M, N,
      float(eps), *axis_args(kshape, kst))
  return out


def add_layer_norm(x: CudaArray, y: CudaArray, w: CudaArray | None, b: CudaArray | None, n: int, eps: float,
                   dtype=None, schedule=None) -> tuple[CudaArray, CudaArray]:
  """(h, layer_norm(h)) with h = x + y (float32, y read as float32), new arrays, in one kernel (schedule: as
  `layer_norm_spec`'s)."""
  h, out = empty(x.shape, x.dtype, x.device), empty(x.shape, dtype or x.dtype, x.device)
  if out.size == 0: return h, out
  x, y, w, b = (p if p is None or p.is_contiguous() else copy(p) for p in (x, y, w, b))
  M, N = math.prod(x.shape[:x.ndim - n]), math.prod(x.shape[x.ndim - n:])
  i64 = needs_i64(x.shape, x.strides)
  vectors = aligned([a for a in (h, out, x, y, w, b) if a is not None], (N,))
  s = layer_norm_spec(x.dtype, w and w.dtype, b and b.dtype, 1, M, N, i64, out.dtype, y.dtype, vectors, schedule)
  run(s, (cdiv(M, s.constexprs["BLOCK_M"]),), out.ptr, h.ptr, x.ptr, y.ptr, (w or x).ptr, (b or x).ptr, M, N,
      float(eps), *axis_args((M,), (N,)))
  return h, out


@functools.lru_cache(maxsize=4096)
def layer_norm_backward_spec(x, g, w, has_b: bool, M: int, N: int, i64: bool, r: DType | None = None,
                             vectors: bool = False, schedule: NormBackward | None = None, cast: DType | None = None,
                             sums: bool = False):
  """The layer-norm backward kernel's variant for M rows of N (r: the residual gradient's dtype, None without;
  vectors: as `layer_norm_spec`'s; schedule: the configurator's for H200 unless given; cast: the dtype of dx's
  second, rounded copy, None without; sums: whether it also sums dx's columns)."""
  bm, bn, warps, one, _, stages = schedule or norm_backward_schedule(M, N, H200.sms)
  it, acc = "i64" if i64 else "i32", stats_dtype(x)
  sig = {"dx": ptr(x), "dxc": ptr(cast or x), "dw_part": ptr(acc), "db_part": ptr(acc), "ds_part": ptr(acc),
         "g": ptr(g), "x": ptr(x), "w": ptr(w or x), "r": ptr(r or x), "M": it, "N": it,
         "eps": "fp64" if x is dtypes.float64 else "fp32", "ROWS": it}
  if vectors:
    extra = ("r",) * _same_vectors(r, g, x) + ("dxc",) * _same_vectors(cast, g, x)
    sig = divisible(sig, ("dx", "dw_part", "db_part", "ds_part", "g", "x", "w", *extra, "N"))
  return spec(_layer_norm_backward_kernel, sig, dict(ACC=TL[acc], HAS_W=w is not None, HAS_B=has_b, HAS_R=r is not None,
                                                     CAST=cast is not None, SUMS=sums, BLOCK_M=bm, BLOCK_N=bn,
                                                     ONE_PASS=one, STAGES=stages, IDX64=i64), num_warps=warps)


@functools.lru_cache(maxsize=256)
def param_grads_spec(acc: DType, dw: DType | None, db: DType | None, sums: bool, blocks: tuple[int, int]):
  """The kernel summing the backward's partial rows into dw and db (their dtypes, None when absent) and, with `sums`,
  dx's column sums (in acc); blocks: (BLOCK_P, BLOCK_N), `configurator.partial_sums_schedule`'s."""
  sig = {"dw": ptr(dw or acc), "db": ptr(db or acc), "ds": ptr(acc), "parts": ptr(acc), "P": "i32", "N": "i32"}
  return spec(_param_grads_kernel, sig, dict(HAS_W=dw is not None, HAS_B=db is not None, SUMS=sums,
                                             BLOCK_P=blocks[0], BLOCK_N=blocks[1]), num_warps=4)


def layer_norm_backward(g: CudaArray, x: CudaArray, w: CudaArray | None, residual: CudaArray | None = None, *, n: int,
                        eps: float, has_bias: bool, cast: DType | None = None, bias_grad: bool = False,
                        schedule: NormBackward | None = None) -> tuple[CudaArray, ...]:
  """(dx, dw, db, dx in `cast`, dx's column sums) of layer_norm over x's last n dims (dw None without w, db None
  unless has_bias, the fourth None without cast, the last None unless bias_grad), new arrays; with a residual
  gradient dx is residual + dx; the column sums are of dx as stored (its cast copy when there is one), in float32
  (float64 for float64 x). Programs take equal runs of rows (`configurator.norm_backward_schedule`, or `schedule` to
  try another) and leave per-program column sums, which a second kernel sums into dw, db and the column sums."""
  lead = x.ndim - n
  M, N = math.prod(x.shape[:lead]), math.prod(x.shape[lead:])
  dx = empty(x.shape, x.dtype, x.device)
  dxc = None if cast is None else empty(x.shape, cast, x.device)
  params = [empty(x.shape[lead:], x.dtype, x.device) for _ in range((w is not None) + has_bias)]
  sums = empty(x.shape[lead:], stats_dtype(x.dtype), x.device) if bias_grad else None
  grads = (dx, params[0] if w is not None else None, params[-1] if has_bias else None, dxc, sums)
  if M * N == 0:
    for p in params + [sums] * bias_grad: fill(p, 0)
    return grads
  g, x, w, r = (a if a is None or a.is_contiguous() else copy(a) for a in (g, x, w, residual))
  schedule = schedule or norm_backward_schedule(M, N, runtime.hardware(x.device).sms)
  programs = cdiv(M, schedule.rows)
  parts = empty((3 if bias_grad else 2, programs, N), stats_dtype(x.dtype), x.device)
  vectors = aligned([a for a in (dx, dxc, parts, g, x, w, r) if a is not None], (N,))  # N | 16: db's part as dw's
  s = layer_norm_backward_spec(x.dtype, g.dtype, w and w.dtype, has_bias, M, N, needs_i64(x.shape, x.strides),
                               r and r.dtype, vectors, schedule, cast, bias_grad)
  part = programs * N * parts.dtype.itemsize
  run(s, (programs,), dx.ptr, (dxc or dx).ptr, parts.ptr, parts.ptr + part, parts.ptr + 2 * part * bias_grad, g.ptr,
      x.ptr, (w or x).ptr, (r or x).ptr, M, N, float(eps), schedule.rows)
  if params or bias_grad:
    dw, db = grads[1], grads[2]
    blocks = partial_sums_schedule(programs, N, runtime.hardware(x.device).sms)
    run(param_grads_spec(parts.dtype, dw and dw.dtype, db and db.dtype, bias_grad, blocks), (cdiv(N, blocks[1]),),
        (dw or parts).ptr, (db or parts).ptr, (sums or parts).ptr, parts.ptr, programs, N)
  return grads


# *** batch norm ***

@triton.jit
def _channel_offsets(cs, rs, c_stride, r_size1, r_size2, r_size3, r_size4, r_stride0, r_stride1, r_stride2, r_stride3,
                     r_stride4, R_DIMS: tl.constexpr, C_UNIT: tl.constexpr, R_UNIT: tl.constexpr):
  """[BLOCK_C, BLOCK_R] element offsets of channels cs at reduced positions rs (the N and spatial dims, collapsed)."""
  c_off = cs if C_UNIT else cs * c_stride
  r_off = axis_offsets(rs, r_size1, r_size2, r_size3, r_size4, r_stride0, r_stride1, r_stride2, r_stride3, r_stride4,
                       R_DIMS, R_UNIT)
  return c_off[:, None] + r_off[None, :]


@triton.jit
def _batch_norm_reduce_kernel(part0, part1, x, g, relu_out, mean, var, C, R, chunk, eps, r_size1, r_size2, r_size3,
                              r_size4, x_r_stride0, x_r_stride1, x_r_stride2, x_r_stride3, x_r_stride4,
                              g_r_stride0, g_r_stride1, g_r_stride2, g_r_stride3, g_r_stride4, x_c_stride, g_c_stride,
                              GRAD: tl.constexpr, MASK: tl.constexpr, ACC: tl.constexpr, R_DIMS: tl.constexpr,
                              C_UNIT: tl.constexpr, R_UNIT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                              IDX64: tl.constexpr):
  """Per channel, over the reduced positions [s chunk, (s + 1) chunk) of split s = program_id(1): the mean and M2 of
  x into part0[s] and part1[s], or with GRAD the sums of g xhat and of g, xhat = (x - mean) / sqrt(var + eps); with
  MASK, g is 0 where relu_out (laid out as g) <= 0."""
  pid_c = tl.program_id(0)
  pid_s = tl.program_id(1)
  if IDX64:
    pid_c = pid_c.to(tl.int64)
    pid_s = pid_s.to(tl.int64)
  cs = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
  c_mask = cs < C
  start = pid_s * chunk
  end = tl.minimum(start + chunk, R)
  if GRAD:
    mu = tl.load(mean + cs, mask=c_mask, other=0).to(ACC)
    invstd = 1.0 / sqrt_rn(tl.load(var + cs, mask=c_mask, other=1).to(ACC) + eps)
  else:  # per lane, sums of x - k and their squares, with k the chunk's first value of the channel (near the mean,
    # so the squares' sum loses little to cancellation; 3 operations an element where Welford's update has a division);
    # each lane's (mean, M2) then merged by Welford's rule, once. Positions past the chunk load k itself (d = 0).
    first = tl.zeros([1], tl.int32) + start
    k_x = tl.load(x + _channel_offsets(cs, first, x_c_stride, r_size1, r_size2, r_size3, r_size4, x_r_stride0,
                                       x_r_stride1, x_r_stride2, x_r_stride3, x_r_stride4, R_DIMS, C_UNIT, False),
                  mask=c_mask[:, None], other=0)
    k = k_x.to(ACC)
  s1 = tl.zeros([BLOCK_C, BLOCK_R], ACC)  # GRAD: sums of g xhat's numerator and of g; else of x - k and its square
  s2 = tl.zeros([BLOCK_C, BLOCK_R], ACC)
  for r0 in range(start, end, BLOCK_R):
    rs = r0 + tl.arange(0, BLOCK_R)
    mask = c_mask[:, None] & (rs < end)[None, :]
    x_at = x + _channel_offsets(cs, rs, x_c_stride, r_size1, r_size2, r_size3, r_size4, x_r_stride0, x_r_stride1,
                                x_r_stride2, x_r_stride3, x_r_stride4, R_DIMS, C_UNIT, R_UNIT)
    if GRAD:
      xv = tl.load(x_at, mask=mask, other=0).to(ACC)
      g_off = _channel_offsets(cs, rs, g_c_stride, r_size1, r_size2, r_size3, r_size4, g_r_stride0, g_r_stride1,
                               g_r_stride2, g_r_stride3, g_r_stride4, R_DIMS, C_UNIT, R_UNIT)
      gv = tl.load(g + g_off, mask=mask, other=0).to(ACC)
      if MASK:
        gv = tl.where(tl.load(relu_out + g_off, mask=mask, other=0) <= 0, 0, gv)
      s1 += gv * (xv - mu[:, None])
      s2 += gv
    else:
      d = tl.load(x_at, mask=mask, other=k_x).to(ACC) - k
      s1 += d
      s2 += d * d
  if GRAD:
    a = tl.sum(s1, axis=1) * invstd
    b = tl.sum(s2, axis=1)
  else:  # lane j took positions start + j, start + j + BLOCK_R, ... below end
    taken = (tl.maximum(end - start - tl.arange(0, BLOCK_R) + BLOCK_R - 1, 0) // BLOCK_R).to(ACC)
    lane_n = tl.broadcast_to(taken[None, :], [BLOCK_C, BLOCK_R])
    inv = 1.0 / tl.maximum(lane_n, 1.0)
    lane_m2 = tl.maximum(s2 - s1 * s1 * inv, 0.0)
    a, b, _ = tl.reduce((k + s1 * inv, lane_m2, lane_n), 1, _welford_combine)
  tl.store(part0 + pid_s * C + cs, a, mask=c_mask)
  tl.store(part1 + pid_s * C + cs, b, mask=c_mask)


@triton.jit
def _batch_norm_finalize_kernel(out0, out1, sums, part0, part1, C, R, S, chunk, new_mean, new_var, new_batches,
                                running_mean, running_var, batches, momentum, factor, s0, s1, s2, s3,
                                GRAD: tl.constexpr, HAS0: tl.constexpr, HAS1: tl.constexpr, RUNNING: tl.constexpr,
                                BATCHES: tl.constexpr, RACC: tl.constexpr, BLOCK_C: tl.constexpr,
                                BLOCK_S: tl.constexpr):
  """The S splits' partial results per channel merged: the mean and the biased variance into out0 and out1, or with
  GRAD the sums of g xhat and of g into sums[0] and sums[1] (the dx kernel reads them) and out0 (dweight) and out1
  (dbias) in their dtypes, each when HAS0 / HAS1. BLOCK_S splits at a time in lanes of their own, merged at the end
  (a channels-last reduction has hundreds of splits: one at a time, the loop's loads were the kernel's time).
  With RUNNING, the running statistics (strides s2, s3) move toward the stored mean and variance in RACC:
  new = (1 - momentum) running + momentum stat, the variance times `factor` (R / (R - 1), unbiased), into new_mean and
  new_var (strides s0, s1; each element read before it is written: they may be the running statistics themselves);
  with BATCHES, program 0 also stores the batch count plus one."""
  cs = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
  c_mask = cs < C
  a = tl.zeros([BLOCK_S, BLOCK_C], part0.dtype.element_ty)
  b = tl.zeros([BLOCK_S, BLOCK_C], part0.dtype.element_ty)
  cnt = tl.zeros([BLOCK_S, BLOCK_C], part0.dtype.element_ty)
  for s0_ in range(0, S, BLOCK_S):
    ss = s0_ + tl.arange(0, BLOCK_S)
    mask = (ss < S)[:, None] & c_mask[None, :]
    p0 = tl.load(part0 + ss[:, None] * C + cs[None, :], mask=mask, other=0)
    p1 = tl.load(part1 + ss[:, None] * C + cs[None, :], mask=mask, other=0)
    if GRAD:
      a += p0
      b += p1
    else:
      n = tl.where(mask, tl.minimum(chunk, R - ss * chunk)[:, None].to(cnt.dtype), 0.0)
      a, b, cnt = _welford_combine(a, b, cnt, p0, p1, n)
  if GRAD:
    a, b = tl.sum(a, 0), tl.sum(b, 0)
    tl.store(sums + cs, a, mask=c_mask)
    tl.store(sums + C + cs, b, mask=c_mask)
    if HAS0:
      tl.store(out0 + cs, a.to(out0.dtype.element_ty), mask=c_mask)
    if HAS1:
      tl.store(out1 + cs, b.to(out1.dtype.element_ty), mask=c_mask)
  else:
    a, b, _ = tl.reduce((a, b, cnt), 0, _welford_combine)
    mean, var = a.to(out0.dtype.element_ty), (b / R).to(out1.dtype.element_ty)
    tl.store(out0 + cs, mean, mask=c_mask)
    tl.store(out1 + cs, var, mask=c_mask)
    if RUNNING:
      if BATCHES:
        if tl.program_id(0) == 0:
          tl.store(new_batches, tl.load(batches) + 1)
      rm = tl.load(running_mean + cs * s2, mask=c_mask).to(RACC)
      rv = tl.load(running_var + cs * s3, mask=c_mask).to(RACC)
      tl.store(new_mean + cs * s0, ((1 - momentum) * rm + momentum * mean.to(RACC)).to(new_mean.dtype.element_ty),
               mask=c_mask)
      tl.store(new_var + cs * s1, ((1 - momentum) * rv + momentum * (var.to(RACC) * factor))
               .to(new_var.dtype.element_ty), mask=c_mask)


@triton.jit
def _batch_norm_apply_kernel(out, x, g, relu_out, mean, var, w, b, sums, C, R, eps, r_size1, r_size2, r_size3, r_size4,
                             x_r_stride0, x_r_stride1, x_r_stride2, x_r_stride3, x_r_stride4,
                             g_r_stride0, g_r_stride1, g_r_stride2, g_r_stride3, g_r_stride4,
                             out_r_stride0, out_r_stride1, out_r_stride2, out_r_stride3, out_r_stride4,
                             x_c_stride, g_c_stride, out_c_stride, MODE: tl.constexpr, ACC: tl.constexpr,
                             HAS_W: tl.constexpr, HAS_B: tl.constexpr, RESIDUAL: tl.constexpr, RELU: tl.constexpr,
                             MASK: tl.constexpr, R_DIMS: tl.constexpr, C_UNIT: tl.constexpr, R_UNIT: tl.constexpr,
                             BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, IDX64: tl.constexpr):
  """One [BLOCK_C, BLOCK_R] tile, with invstd = 1 / sqrt(var + eps): MODE "forward" out = (x - mean) invstd w + b,
  then with RESIDUAL that value rounded to out's dtype plus the residual in g, with RELU relu of the rounded value (as
  the separate add and relu kernels would compute them); "train" out = dx = (g - (sum(g) + xhat sum(g xhat)) / R)
  invstd w from the reduction's sums; "eval" out = dx = g invstd w (the statistics are constants); with MASK, g is 0
  where relu_out (laid out as g) <= 0. The blocks of R are the grid's first axis, which may pass 65535."""
  pid_r = tl.program_id(0)
  pid_c = tl.program_id(1)
  if IDX64:
    pid_c = pid_c.to(tl.int64)
    pid_r = pid_r.to(tl.int64)
  cs = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
  rs = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
  c_mask = cs < C
  mask = c_mask[:, None] & (rs < R)[None, :]
  mu = tl.load(mean + cs, mask=c_mask, other=0).to(ACC)
  invstd = 1.0 / sqrt_rn(tl.load(var + cs, mask=c_mask, other=1).to(ACC) + eps)
  scale = invstd * tl.load(w + cs, mask=c_mask, other=0).to(ACC) if HAS_W else invstd
  x_off = _channel_offsets(cs, rs, x_c_stride, r_size1, r_size2, r_size3, r_size4, x_r_stride0, x_r_stride1,
                           x_r_stride2, x_r_stride3, x_r_stride4, R_DIMS, C_UNIT, R_UNIT)
  g_off = _channel_offsets(cs, rs, g_c_stride, r_size1, r_size2, r_size3, r_size4, g_r_stride0, g_r_stride1,
                           g_r_stride2, g_r_stride3, g_r_stride4, R_DIMS, C_UNIT, R_UNIT)
  if MODE == "forward":
    y = (tl.load(x + x_off, mask=mask, other=0).to(ACC) - mu[:, None]) * scale[:, None]
    if HAS_B:
      y += tl.load(b + cs, mask=c_mask, other=0).to(ACC)[:, None]
    if RESIDUAL:  # y's last operation is an add (or FMA), so this add is never contracted into another FMA
      y = y.to(out.dtype.element_ty).to(ACC) + tl.load(g + g_off, mask=mask, other=0).to(ACC)
    if RELU:
      y = y.to(out.dtype.element_ty).to(ACC)
      y = tl.where(y < 0, 0, y)
  else:
    y = tl.load(g + g_off, mask=mask, other=0).to(ACC)
    if MASK:
      y = tl.where(tl.load(relu_out + g_off, mask=mask, other=0) <= 0, 0, y)
    if MODE == "train":
      xhat = (tl.load(x + x_off, mask=mask, other=0).to(ACC) - mu[:, None]) * invstd[:, None]
      sgx = tl.load(sums + cs, mask=c_mask, other=0)
      sg = tl.load(sums + C + cs, mask=c_mask, other=0)
      y = y - (sg[:, None] + xhat * sgx[:, None]) / R
    y = y * scale[:, None]
  tl.store(out + _channel_offsets(cs, rs, out_c_stride, r_size1, r_size2, r_size3, r_size4, out_r_stride0,
                                  out_r_stride1, out_r_stride2, out_r_stride3, out_r_stride4, R_DIMS, C_UNIT, R_UNIT),
           y.to(out.dtype.element_ty), mask=mask)


FINALIZE_BLOCK_C, FINALIZE_BLOCK_S = 64, 32  # the finalize kernel's tile: channels per program, splits per step


@functools.lru_cache(maxsize=4096)  # asked three times per batch-norm op (its layouts' dims, the reduction, the apply)
def _channel_problem(shape, *strides):
  """Arrays of one shape (N, C, *) (x's strides first) as one (C, R) problem: the reduced dims (all but 1, by x's
  falling strides) collapsed for all of them, as (R's shape, each array's strides along R, each array's channel
  stride, C_UNIT, R_UNIT), or None when more than 5 dims remain. C_UNIT and R_UNIT: the channels, or the reduced
  positions (one dim), at unit stride in every array."""
  red = sorted([0, *range(2, len(shape))], key=lambda d: -strides[0][d])
  rshape, rst = collapse([shape[d] for d in red], *([st[d] for d in red] for st in strides))
  if len(rshape) > 5: return None
  cst = [st[1] for st in strides]
  return rshape, rst, cst, shape[1] == 1 or all(c == 1 for c in cst), len(rshape) == 1 and all(r[0] == 1 for r in rst)


def _tile(C: int, R: int, c_unit: bool, r_unit: bool) -> tuple[int, int, int]:
  """(BLOCK_C, BLOCK_R, num_warps): a reduction's schedule over C outputs of R, loading along the channels when they
  are the unit-stride axis (channels-last)."""
  return reduce_schedule(C, R, c_unit and not r_unit)


@functools.lru_cache(maxsize=4096)
def batch_norm_reduce_spec(grad: bool, x: DType, g: DType | None, mean: DType | None, var: DType | None, r_dims: int,
                           c_unit: bool, r_unit: bool, C: int, R: int, i64: bool, relu_out: DType | None = None):
  """The per-channel reduction's variant: x's statistics, or with `grad` the sums of g xhat and g (mean, var: the
  dtypes of the statistics it reads then; relu_out: the dtype of the ReLU output masking g, None without)."""
  bc, br, warps = _tile(C, R, c_unit, r_unit)
  it, acc = "i64" if i64 else "i32", stats_dtype(x)
  sig = {"part0": ptr(acc), "part1": ptr(acc), "x": ptr(x), "g": ptr(g or x), "relu_out": ptr(relu_out or x),
         "mean": ptr(mean or acc),
         "var": ptr(var or acc), "C": it, "R": it, "chunk": it, "eps": "fp64" if x is dtypes.float64 else "fp32",
         **{k: it for k in axis_params("r", "x", "g")}, "x_c_stride": it, "g_c_stride": it}
  return spec(_batch_norm_reduce_kernel, sig, dict(GRAD=grad, MASK=relu_out is not None, ACC=TL[acc], R_DIMS=r_dims,
                                                   C_UNIT=c_unit, R_UNIT=r_unit, BLOCK_C=bc, BLOCK_R=br, IDX64=i64),
              num_warps=warps)


@functools.lru_cache(maxsize=256)
def batch_norm_finalize_spec(grad: bool, acc: DType, out0: DType | None, out1: DType | None,
                             running: DType | None = None, batches: bool = False):
  """The kernel merging the reduction's splits (out0, out1: mean and var, or dweight and dbias, None when absent);
  `running`: the dtype of running statistics moved toward the batch's (None without), `batches` a count's increment
  with them."""
  racc = dtypes.float64 if dtypes.float64 in (running, acc) else dtypes.float32
  stat, num = ptr(running or acc), "fp64" if racc is dtypes.float64 else "fp32"
  sig = {"out0": ptr(out0 or acc), "out1": ptr(out1 or acc), "sums": ptr(acc), "part0": ptr(acc), "part1": ptr(acc),
         "C": "i32", "R": "i64", "S": "i32", "chunk": "i64", "new_mean": stat, "new_var": stat, "new_batches": "*i64",
         "running_mean": stat, "running_var": stat, "batches": "*i64", "momentum": num, "factor": num,
         **dict.fromkeys(("s0", "s1", "s2", "s3"), "i32")}
  return spec(_batch_norm_finalize_kernel, sig, dict(GRAD=grad, HAS0=out0 is not None, HAS1=out1 is not None,
                                                     RUNNING=running is not None, BATCHES=batches, RACC=TL[racc],
                                                     BLOCK_C=FINALIZE_BLOCK_C, BLOCK_S=FINALIZE_BLOCK_S), num_warps=4)


@functools.lru_cache(maxsize=4096)
def batch_norm_apply_spec(mode: str, x: DType, g: DType | None, out: DType, mean: DType, var: DType, w: DType | None,
                          b: DType | None, r_dims: int, c_unit: bool, r_unit: bool, C: int, R: int, i64: bool,
                          relu: bool = False, relu_out: DType | None = None):
  """The elementwise kernel's variant: the forward normalization (g: the residual's dtype, None without one), or dx
  ("train", "eval"; relu_out: the dtype of the ReLU output masking g, None without)."""
  bc, br, warps = _tile(C, R, c_unit, r_unit)
  it, acc = "i64" if i64 else "i32", stats_dtype(x)
  sig = {"out": ptr(out), "x": ptr(x), "g": ptr(g or x), "relu_out": ptr(relu_out or x), "mean": ptr(mean),
         "var": ptr(var), "w": ptr(w or mean),
         "b": ptr(b or mean), "sums": ptr(acc), "C": it, "R": it, "eps": "fp64" if x is dtypes.float64 else "fp32",
         **{k: it for k in axis_params("r", "x", "g", "out")}, "x_c_stride": it, "g_c_stride": it, "out_c_stride": it}
  return spec(_batch_norm_apply_kernel, sig, dict(MODE=mode, ACC=TL[acc], HAS_W=w is not None, HAS_B=b is not None,
                                                  RESIDUAL=mode == "forward" and g is not None, RELU=relu,
                                                  MASK=relu_out is not None,
                                                  R_DIMS=r_dims, C_UNIT=c_unit, R_UNIT=r_unit, BLOCK_C=bc, BLOCK_R=br,
                                                  IDX64=i64), num_warps=warps)


@functools.lru_cache(maxsize=4096)  # a function of layouts only: asked by every batch-norm op
def reduce_plan(grad: bool, x: DType, g: DType | None, mean: DType | None, var: DType | None, shape, x_strides,
                g_strides, eps: float, hw=H200, relu_out: DType | None = None):
  """(spec, grid, scalar arguments after the pointers part0, part1, x, g, relu_out, mean, var, splits S, chunk) of the
  per-channel reduction over x of `shape` (and g with `grad`), whose layouts collapse to 5 reduced dims: `split_rule`
  cuts the R positions of each channel into S chunks when the channel blocks alone leave SMs idle."""
  C, R = shape[1], math.prod(shape) // shape[1]
  rshape, rst, cst, c_unit, r_unit = _channel_problem(shape, x_strides, g_strides if grad else x_strides)
  s = batch_norm_reduce_spec(grad, x, g, mean, var, len(rshape), c_unit, r_unit, C, R,
                             needs_i64(shape, x_strides, g_strides if grad else x_strides), relu_out)
  bc, br = s.constexprs["BLOCK_C"], s.constexprs["BLOCK_R"]
  pieces = split_rule(cdiv(C, bc), R, br, hw)
  chunk = cdiv(cdiv(R, pieces), br) * br
  S = cdiv(R, chunk)
  return s, (cdiv(C, bc), S), (C, R, chunk, float(eps), *axis_args(rshape, *rst), *cst), S, chunk


@functools.lru_cache(maxsize=4096)
def apply_plan(mode: str, x: DType, g: DType | None, out: DType, mean: DType, var: DType, w: DType | None,
               b: DType | None, shape, x_strides, g_strides, out_strides, eps: float, relu: bool = False,
               relu_out: DType | None = None):
  """(spec, grid, scalar arguments after the pointers out, x, g, relu_out, mean, var, w, b, sums) of the elementwise
  kernel
  over arrays of `shape` whose layouts collapse to 5 reduced dims (g_strides: x's when there is no g; the forward's g
  is its residual)."""
  C, R = shape[1], math.prod(shape) // shape[1]
  rshape, rst, cst, c_unit, r_unit = _channel_problem(shape, x_strides, g_strides, out_strides)
  s = batch_norm_apply_spec(mode, x, g, out, mean, var, w, b, len(rshape), c_unit, r_unit, C, R,
                            needs_i64(shape, x_strides, g_strides, out_strides), relu, relu_out)
  bc, br = s.constexprs["BLOCK_C"], s.constexprs["BLOCK_R"]
  return s, (cdiv(R, br), cdiv(C, bc)), (C, R, float(eps), *axis_args(rshape, *rst), *cst)


def _channel_reduce(grad: bool, x: CudaArray, g: CudaArray | None, mean, var, eps: float, out0, out1,
                    relu_out: CudaArray | None = None, running: tuple = ()) -> tuple[CudaArray, CudaArray, CudaArray]:
  """Run the per-channel reduction and its finalize over x (and g, masked by relu_out) into out0 and out1; returns
  them and the buffer whose first (new) 2C elements are the sums (2, C) of `grad`. The statistics (not `grad`) go to
  two new (C,) arrays; with `grad`, None outputs are not computed. New outputs, the sums and the splits' partials
  (2, S, C) share one allocation. `running`: (new mean, new var, new count or None, running mean, running var, count
  or None, momentum), the running statistics' update the finalize makes with the statistics."""
  s, grid, scalars, S, chunk = reduce_plan(grad, x.dtype, g and g.dtype, mean and mean.dtype, var and var.dtype,
                                           x.shape, x.strides, g and g.strides, eps, runtime.hardware(x.device),
                                           relu_out and relu_out.dtype)
  C, R, acc = x.shape[1], x.size // x.shape[1], stats_dtype(x.dtype)
  new = 0 if grad else 2
  buf = empty(((new + 2 + 2 * S) * C,), acc, x.device)
  if new: out0, out1 = view(buf, (C,), (1,)), view(buf, (C,), (1,), C)
  item = acc.itemsize
  sums = buf.ptr + new * C * item
  part0 = sums + 2 * C * item
  part1 = part0 + S * C * item
  run(s, grid, part0, part1, x.ptr, (g or x).ptr, (relu_out or x).ptr, (mean or buf).ptr, (var or buf).ptr, *scalars)
  if running:
    new_mean, new_var, new_batches, rm, rv, batches, momentum = running
    update = (new_mean.ptr, new_var.ptr, (new_batches or buf).ptr, rm.ptr, rv.ptr, (batches or buf).ptr,
              float(momentum), R / (R - 1), *(a.strides[0] for a in (new_mean, new_var, rm, rv)))
  else: update = (buf.ptr,) * 6 + (0.0, 0.0, 0, 0, 0, 0)
  run(batch_norm_finalize_spec(grad, acc, out0 and out0.dtype, out1 and out1.dtype,
                               running[3].dtype if running else None, bool(running) and running[5] is not None),
      (cdiv(C, FINALIZE_BLOCK_C),), (out0 or buf).ptr, (out1 or buf).ptr, sums, part0, part1, C, R, S, chunk, *update)
  return out0, out1, buf


def _channel_apply(mode: str, out: CudaArray, x: CudaArray, g: CudaArray | None, mean, var, w, b, sums: int,
                   eps: float, relu: bool = False, relu_out: CudaArray | None = None):
  s, grid, scalars = apply_plan(mode, x.dtype, g and g.dtype, out.dtype, mean.dtype, var.dtype, w and w.dtype,
                                b and b.dtype, x.shape, x.strides, (g or x).strides, out.strides, eps, relu,
                                relu_out and relu_out.dtype)
  run(s, grid, out.ptr, x.ptr, (g or x).ptr, (relu_out or x).ptr, mean.ptr, var.ptr, (w or mean).ptr, (b or mean).ptr,
      sums or mean.ptr, *scalars)


def _contiguous(*arrays: CudaArray | None) -> list[CudaArray | None]:
  return [a if a is None or a.is_contiguous() else copy(a) for a in arrays]


def _few_dims(x: CudaArray, *others: CudaArray | None) -> list[CudaArray | None]:
  """x and arrays of its shape (None passes through), copied contiguous when their reduced dims, with those of a
  contiguous output, would not collapse to 5 (7-D and more)."""
  if len(x.shape) <= 6: return [x, *others]  # at most 5 reduced dims to begin with
  given = [a.strides for a in others if a is not None]
  if _channel_problem(x.shape, x.strides, *given, contiguous_strides(x.shape)) is not None: return [x, *others]
  return [a if a is None else copy(a) for a in (x, *others)]


def batch_norm_stats(x: CudaArray, running_mean: CudaArray | None = None, running_var: CudaArray | None = None,
                     batches: CudaArray | None = None, *, momentum: float | None = None,
                     out=None) -> tuple[CudaArray | None, ...]:
  """The `batch_norm_stats` op: the mean and biased variance of each channel of x (N, C, *), float32 (float64 for
  float64 x), new arrays: a split reduction (`reduce_schedule`, `split_rule`) leaves per-split means and M2s that a
  second kernel merges. Given running statistics, that kernel also moves them toward the batch's (and counts the
  batch), into new arrays or `out`'s (None, None, running mean, running var[, count]): the update in place."""
  if running_mean is None:
    if x.size == 0:
      return (*(fill(empty((x.shape[1],), stats_dtype(x.dtype), x.device), float("nan")) for _ in range(2)),
              None, None, None)
    (x,) = _few_dims(x)
    return (*_channel_reduce(False, x, None, None, None, 0.0, None, None)[:2], None, None, None)
  new_mean, new_var, new_batches = (*out[2:], None)[:3] if out else \
    (empty_like(running_mean), empty_like(running_var), None if batches is None else empty_like(batches))
  (x,) = _few_dims(x)
  mean, var, _ = _channel_reduce(False, x, None, None, None, 0.0, None, None, None,
                                 (new_mean, new_var, new_batches, running_mean, running_var, batches, momentum))
  return mean, var, new_mean, new_var, new_batches


batch_norm_stats.writes_out = True


def batch_norm(x: CudaArray, mean: CudaArray, var: CudaArray, w: CudaArray | None, b: CudaArray | None,
               residual: CudaArray | None = None, *, eps: float, training: bool, relu: bool = False) -> CudaArray:
  """(x - mean) / sqrt(var + eps) * w + b per channel of x (N, C, *), a new array in x's dense layout; with Nova's
  epilogue, relu of that plus `residual` (x's shape and dtype), each when given."""
  x, residual = _few_dims(x, residual)
  out = empty_like(x)
  if out.size == 0: return out
  mean, var, w, b = _contiguous(mean, var, w, b)
  _channel_apply("forward", out, x, residual, mean, var, w, b, None, eps, relu)
  return out


def batch_norm_backward(g: CudaArray, x: CudaArray, mean: CudaArray, var: CudaArray, w: CudaArray | None,
                        relu_out: CudaArray | None = None, *, eps: float, training: bool, input_grad: bool,
                        weight_grad: bool, bias_grad: bool) -> tuple[CudaArray | None, ...]:
  """(dx, dweight, dbias) of batch_norm, each a new array when asked for (else None): dx in x's dense layout, the
  others float32 (float64 for float64 x). The sums over each channel (one split reduction) come first unless only
  dx of the eval form is asked for. With `relu_out`, g is 0 where relu_out <= 0: read as the kernels read g when
  both are laid out alike, else applied to g first."""
  acc = stats_dtype(x.dtype)
  if relu_out is not None and relu_out.strides != g.strides:
    g, relu_out = elementwise("relu_backward", g.dtype, g, relu_out), None
  x, g, relu_out = _few_dims(x, g, relu_out)
  mean, var, w = _contiguous(mean, var, w)
  dw = empty((x.shape[1],), acc, x.device) if weight_grad else None
  db = empty((x.shape[1],), acc, x.device) if bias_grad else None
  dx = empty_like(x) if input_grad else None
  if x.size == 0:
    for p in (dw, db):
      if p is not None: fill(p, 0)
    return dx, dw, db
  sums = buf = None
  if weight_grad or bias_grad or (input_grad and training):
    _, _, buf = _channel_reduce(True, x, g, mean, var, eps, dw, db, relu_out)
    sums = buf.ptr  # (buf kept until the apply is queued)
  if input_grad: _channel_apply("train" if training else "eval", dx, x, g, mean, var, w, None, sums, eps,
                                relu_out=relu_out)
  return dx, dw, db


KERNELS = {
  "softmax": lambda x, dim: _softmax(x, dim, False),
  "log_softmax": lambda x, dim: _softmax(x, dim, True),
  "layer_norm": layer_norm,
  "add_layer_norm": add_layer_norm,
  "layer_norm_backward": layer_norm_backward,
  "batch_norm_stats": batch_norm_stats,
  "batch_norm": batch_norm,
  "batch_norm_backward": batch_norm_backward,
}


def _specs() -> list:
  f32, bf16, f64 = dtypes.float32, dtypes.bfloat16, dtypes.float64
  out = []
  for log in (False, True):
    out += [softmax_spec(log, f32, 1, True, True, 1 << 14, 1024, False),
            softmax_spec(log, bf16, 3, True, True, 4096, 50304, False),
            softmax_spec(log, f32, 2, True, False, 1000, 17, True)]
  out += [softmax_spec(False, f64, 1, False, False, 10, 100000, False),
          layer_norm_spec(f32, f32, f32, 1, 1 << 14, 768, False), layer_norm_spec(bf16, f32, None, 2, 1000, 20000, False),
          layer_norm_spec(f32, f32, f32, 1, 1 << 14, 768, False, bf16), layer_norm_backward_spec(f32, bf16, f32, True, 1 << 14, 768, False),
          layer_norm_spec(f64, None, None, 3, 10, 64, True), layer_norm_spec(f32, None, f32, 1, 10, 100000, False),
          layer_norm_backward_spec(f32, f32, f32, True, 1 << 14, 768, False),
          layer_norm_backward_spec(bf16, bf16, bf16, False, 1000, 20000, False),
          layer_norm_backward_spec(f64, f64, None, True, 10, 64, True),
          layer_norm_backward_spec(f32, f32, None, False, 10, 100000, False),
          # fuse-norms: the residual add + norm (one-pass and two-pass rows), the backward adding a residual gradient
          layer_norm_spec(f32, f32, f32, 1, 1 << 14, 768, False, f32, f32),
          layer_norm_spec(f32, f32, f32, 1, 1 << 14, 768, False, bf16, bf16),
          layer_norm_spec(f32, None, f32, 1, 10, 100000, False, f32, dtypes.float16),
          layer_norm_backward_spec(f32, f32, f32, True, 1 << 14, 768, False, f32),
          layer_norm_backward_spec(f32, bf16, f32, True, 1 << 14, 768, False, bf16),
          layer_norm_backward_spec(f32, f32, f32, False, 10, 100000, False, f32),
          # GPT-2's rows of 768 as 16-byte vectors: forward to bf16, with the residual add, backward with a residual
          layer_norm_spec(f32, f32, f32, 1, 1 << 14, 768, False, bf16, None, True),
          layer_norm_spec(f32, f32, f32, 1, 1 << 14, 768, False, bf16, bf16, True),
          layer_norm_backward_spec(f32, bf16, f32, True, 1 << 14, 768, False, None, True),
          layer_norm_backward_spec(f32, bf16, f32, True, 1 << 14, 768, False, bf16, True),
          layer_norm_backward_spec(f32, bf16, f32, True, 1 << 14, 768, False, f32, True, None, bf16),  # + a half dx
          layer_norm_backward_spec(bf16, bf16, bf16, False, 1000, 20000, False, None, True),
          # fuse-bias-grads: the column sums of dx (GPT-2's half copy; two-pass rows)
          layer_norm_backward_spec(f32, bf16, f32, True, 1 << 14, 768, False, f32, True, None, bf16, True),
          layer_norm_backward_spec(f32, f32, None, False, 10, 100000, False, f32, False, None, None, True),
          *(param_grads_spec(acc, dw, db, sums, partial_sums_schedule(P, N, 132))
            for acc, dw, db, sums, P, N in ((f32, f32, f32, False, 256, 768), (f32, bf16, None, False, 100, 20000),
                                            (f64, None, f64, False, 3, 64), (f32, f32, f32, True, 256, 768),
                                            (f32, None, None, True, 1, 100000)))]
  # batch norm: NCHW (C, then N and H W collapsed), channels-last (the channels unit-stride), (N, C) and 1-D runs
  R = 256 * 56 * 56
  for grad, x, g, st in ((False, f32, None, None), (False, bf16, None, None), (True, f32, f32, f32),
                         (True, bf16, bf16, f32)):
    out += [batch_norm_reduce_spec(grad, x, g, st, st, 2, False, False, 64, R, False),
            batch_norm_reduce_spec(grad, x, g, st, st, 1, True, False, 64, R, False)]
  out += [batch_norm_reduce_spec(False, f64, None, None, None, 1, False, True, 3, 100, True),
          batch_norm_reduce_spec(True, f64, f64, f64, bf16, 1, True, False, 10, 64, False),
          batch_norm_finalize_spec(False, f32, f32, f32), batch_norm_finalize_spec(True, f32, f32, f32),
          batch_norm_finalize_spec(False, f32, f32, f32, f32), batch_norm_finalize_spec(False, f64, f64, f64, f64),
          batch_norm_finalize_spec(False, f32, f32, f32, f32, True), batch_norm_finalize_spec(False, f32, f32, f32, f64),
          batch_norm_finalize_spec(True, f32, None, f32), batch_norm_finalize_spec(True, f64, f64, None)]
  for mode, x, g in (("forward", f32, None), ("forward", bf16, None), ("train", f32, f32), ("train", bf16, bf16),
                     ("eval", bf16, bf16)):
    out += [batch_norm_apply_spec(mode, x, g, x, f32, f32, f32, f32 if mode == "forward" else None, 2, False, False,
                                  64, R, False),
            batch_norm_apply_spec(mode, x, g, x, f32, f32, f32, f32 if mode == "forward" else None, 1, True, False,
                                  64, R, False)]
  out += [batch_norm_apply_spec("forward", f64, None, f64, f64, f64, None, None, 3, False, False, 5, 100, True),
          batch_norm_apply_spec("forward", bf16, None, bf16, bf16, bf16, bf16, None, 1, False, True, 3, 100, False),
          batch_norm_apply_spec("train", f64, f64, f64, f64, f64, f64, None, 1, True, False, 10, 64, True)]
  # with Nova's epilogue: relu alone, and the residual add before it (NCHW float32, channels-last bf16)
  out += [batch_norm_apply_spec("forward", f32, None, f32, f32, f32, f32, f32, 2, False, False, 64, R, False, True),
          batch_norm_apply_spec("forward", f32, f32, f32, f32, f32, f32, f32, 2, False, False, 64, R, False, True),
          batch_norm_apply_spec("forward", bf16, bf16, bf16, f32, f32, f32, f32, 1, True, False, 64, R, False, True)]
  # the backward with g masked by the ReLU's output (Nova's fold of relu's backward)
  for x in (f32, bf16):
    out += [batch_norm_reduce_spec(True, x, x, f32, f32, 1, True, False, 64, R, False, x),
            batch_norm_apply_spec("train", x, x, x, f32, f32, f32, None, 1, True, False, 64, R, False, False, x)]
  return out


SPECS = _specs()
