"""Flash attention (FlashAttention-2's algorithm) in Triton: `flash_attention` and `flash_attention_backward`.

Forward: a program owns BLOCK_M query rows of one (batch, head) and streams the keys in blocks of BLOCK_N, keeping a
running max `m` and sum `l` of exp(scores) (base 2: the scale folds log2(e) in), so the (L, S) weights never exist.
It writes the output and the row logsumexp `lse`. Backward, as FlashAttention-2: D = rowsum(dO * O); a dq program
per query block (it also computes D, and the lse when the forward's is not at hand), then a dk/dv program per key
block that walks the query blocks. Causal masking is top-left aligned (key n is seen by query m iff n <= m, as
PyTorch's is_causal); blocks wholly below the diagonal skip the mask. Memory is O(L + S) per (batch, head) beyond the
inputs and outputs.

Layouts: batch dims become (Z, H) with their own strides (the last batch dim is H; the others must merge, else that
input is copied), rows and the head dim are addressed by strides, the head dim must be contiguous (else copied).
float32 inputs use TF32 tensor cores when the op's `tf32` attribute is set (`bt.set_float32_matmul_precision` "high"
or "medium"), else 3xTF32
(Triton's "tf32x3": each operand split into TF32 high and low parts, three tensor-core products): float32-level
accuracy (5e-7 relative to float64 on GPT-2's shape, as IEEE products) at 3-5x the speed of IEEE products on the FMA
units (H200: forward 0.63 ms vs 2.05, backward 2.5 ms vs 12.0, B=16 H=12 T=1024 D=64 causal). Half inputs multiply
in their own type; all accumulation is float32.
"""
from __future__ import annotations

import functools
import math
import weakref

import triton
import triton.language as tl

from blutrain import dtypes
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import HALF, INT32_MAX, TY, Spec, aligned, empty, run, spec, view
from blutrain.configurator import attention_schedule
from blutrain.dtypes import DType
from blutrain.shapes import cdiv, next_pow2

_LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)


# *** kernels ***

@triton.jit
def _load(ptrs, rows, n_rows, cols, n_cols, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
  """A (rows, cols) tile; rows past n_rows and cols past n_cols read as 0 (masks only where the constexprs say)."""
  if MASK_ROWS and MASK_COLS:
    x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
  elif MASK_ROWS:
    x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
  elif MASK_COLS:
    x = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
  else:
    x = tl.load(ptrs)
  return x


@triton.jit
def _store(ptrs, x, rows, n_rows, cols, n_cols, MASK_COLS: tl.constexpr):
  if MASK_COLS:
    tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))
  else:
    tl.store(ptrs, x, mask=rows[:, None] < n_rows)


@triton.jit
def _query_block(CAUSAL: tl.constexpr):
  """This program's query block; causal programs with more keys start first, which evens out the grid's tail."""
  if CAUSAL:
    m = tl.num_programs(0) - 1 - tl.program_id(0)
  else:
    m = tl.program_id(0)
  return m


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, skn, svn, offs_m, offs_d, S, D, qk_scale, lo, hi,
                MASK: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
                PRECISION: tl.constexpr):
  """Fold the key blocks [lo, hi) into the running (acc, l, m); MASK: keys past S and (if CAUSAL) after the query."""
  for start_n in range(lo, hi, BLOCK_N):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load(k_base + offs_n[:, None] * skn + offs_d[None, :], offs_n, S, offs_d, D, MASK, not EVEN_D)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASK:
      keep = offs_n[None, :] < S
      if CAUSAL:
        keep = keep & (offs_m[:, None] >= offs_n[None, :])
      qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load(v_base + offs_n[:, None] * svn + offs_d[None, :], offs_n, S, offs_d, D, MASK, not EVEN_D)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    m_i = m_new
  return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, qk_scale, L, S, D,
              sqz, sqh, sqm, skz, skh, skn, svz, svh, svn, soz, soh, som,
              CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, PACKED: tl.constexpr):
  start_m = _query_block(CAUSAL)
  h, z = tl.program_id(1), tl.program_id(2)
  H = tl.num_programs(1)
  z64, h64 = z.to(tl.int64), h.to(tl.int64)
  offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
  offs_d = tl.arange(0, BLOCK_D)
  q = _load(Q + z64 * sqz + h64 * sqh + offs_m[:, None] * sqm + offs_d[None, :], offs_m, L, offs_d, D, True, not EVEN_D)
  k_base, v_base = K + z64 * skz + h64 * skh, V + z64 * svz + h64 * svh
  m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
  l_i = tl.zeros([BLOCK_M], tl.float32)
  acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
  full = S // BLOCK_N * BLOCK_N  # keys of whole blocks
  if CAUSAL:
    free = tl.minimum(start_m * BLOCK_M // BLOCK_N * BLOCK_N, full)  # seen by every row of this block
    end = tl.minimum((start_m + 1) * BLOCK_M, S)
  else:
    free, end = full, S
  acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, skn, svn, offs_m, offs_d, S, D, qk_scale, 0, free,
                              False, CAUSAL, EVEN_D, BLOCK_N, PRECISION)
  acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, skn, svn, offs_m, offs_d, S, D, qk_scale, free, end,
                              True, CAUSAL, EVEN_D, BLOCK_N, PRECISION)
  out = acc / l_i[:, None]
  _store(O + z64 * soz + h64 * soh + offs_m[:, None] * som + offs_d[None, :], out.to(O.dtype.element_ty),
         offs_m, L, offs_d, D, not EVEN_D)
  tl.store(LSE + (z64 * H + h64) * L + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < L)
  if PACKED:  # flash_attention_lse: the natural logsumexp in the output's column D
    tl.store(O + z64 * soz + h64 * soh + offs_m * som + D, (m_i + tl.math.log2(l_i)) * _LN2, mask=offs_m < L)


@triton.jit
def _dq_blocks(dq, q, do, lse, delta, k_base, v_base, skn, svn, offs_m, offs_d, S, D, qk_scale, lo, hi,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
               PRECISION: tl.constexpr):
  """dq += dS K over the key blocks [lo, hi); MASK: keys past S (whose exp2(-lse) could overflow) and, if CAUSAL,
  after the query."""
  for start_n in range(lo, hi, BLOCK_N):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load(k_base + offs_n[:, None] * skn + offs_d[None, :], offs_n, S, offs_d, D, MASK, not EVEN_D)
    v = _load(v_base + offs_n[:, None] * svn + offs_d[None, :], offs_n, S, offs_d, D, MASK, not EVEN_D)
    p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse[:, None])
    if MASK:
      keep = offs_n[None, :] < S
      if CAUSAL:
        keep = keep & (offs_m[:, None] >= offs_n[None, :])
      p = tl.where(keep, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
  return dq


@triton.jit
def _lse_blocks(l_i, m_i, q, k_base, skn, offs_m, offs_d, S, D, qk_scale, lo, hi,
                MASK: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
                PRECISION: tl.constexpr):
  """The forward's running (l, m) without the values: the logsumexp, when the forward's is not at hand."""
  for start_n in range(lo, hi, BLOCK_N):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load(k_base + offs_n[:, None] * skn + offs_d[None, :], offs_n, S, offs_d, D, MASK, not EVEN_D)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASK:
      keep = offs_n[None, :] < S
      if CAUSAL:
        keep = keep & (offs_m[:, None] >= offs_n[None, :])
      qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    l_i = l_i * tl.math.exp2(m_i - m_new) + tl.sum(tl.math.exp2(qk - m_new[:, None]), 1)
    m_i = m_new
  return l_i, m_i


@triton.jit
def _attn_bwd_dq(Q, K, V, O, DO, DQ, LSE, DELTA, DLSE, qk_scale, sm_scale, L, S, D,
                 sqz, sqh, sqm, skz, skh, skn, svz, svh, svn, soz, soh, som, sgz, sgh, sgm, sdz, sdh, sdm,
                 CAUSAL: tl.constexpr, HAVE_LSE: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, PACKED: tl.constexpr):
  start_m = _query_block(CAUSAL)
  h, z = tl.program_id(1), tl.program_id(2)
  H = tl.num_programs(1)
  z64, h64 = z.to(tl.int64), h.to(tl.int64)
  offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
  offs_d = tl.arange(0, BLOCK_D)
  q = _load(Q + z64 * sqz + h64 * sqh + offs_m[:, None] * sqm + offs_d[None, :], offs_m, L, offs_d, D, True, not EVEN_D)
  do = _load(DO + z64 * sgz + h64 * sgh + offs_m[:, None] * sgm + offs_d[None, :], offs_m, L, offs_d, D, True, not EVEN_D)
  o = _load(O + z64 * soz + h64 * soh + offs_m[:, None] * som + offs_d[None, :], offs_m, L, offs_d, D, True, not EVEN_D)
  delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
  row = (z64 * H + h64) * L + offs_m
  if PACKED:  # the logsumexp's gradient: dS = P * (dP - delta + dlse), so delta - dlse takes delta's place
    delta -= tl.load(DLSE + row, mask=offs_m < L, other=0.0)
  tl.store(DELTA + row, delta, mask=offs_m < L)
  k_base, v_base = K + z64 * skz + h64 * skh, V + z64 * svz + h64 * svh
  full = S // BLOCK_N * BLOCK_N
  if CAUSAL:
    free = tl.minimum(start_m * BLOCK_M // BLOCK_N * BLOCK_N, full)
    end = tl.minimum((start_m + 1) * BLOCK_M, S)
  else:
    free, end = full, S
  if HAVE_LSE:
    lse = tl.load(LSE + row, mask=offs_m < L, other=0.0)
  else:
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i, m_i = _lse_blocks(l_i, m_i, q, k_base, skn, offs_m, offs_d, S, D, qk_scale, 0, free, False, CAUSAL, EVEN_D,
                           BLOCK_N, PRECISION)
    l_i, m_i = _lse_blocks(l_i, m_i, q, k_base, skn, offs_m, offs_d, S, D, qk_scale, free, end, True, CAUSAL, EVEN_D,
                           BLOCK_N, PRECISION)
    lse = m_i + tl.math.log2(l_i)
    tl.store(LSE + row, lse, mask=offs_m < L)
  dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
  dq = _dq_blocks(dq, q, do, lse, delta, k_base, v_base, skn, svn, offs_m, offs_d, S, D, qk_scale, 0, free,
                  False, CAUSAL, EVEN_D, BLOCK_N, PRECISION)
  dq = _dq_blocks(dq, q, do, lse, delta, k_base, v_base, skn, svn, offs_m, offs_d, S, D, qk_scale, free, end,
                  True, CAUSAL, EVEN_D, BLOCK_N, PRECISION)
  _store(DQ + z64 * sdz + h64 * sdh + offs_m[:, None] * sdm + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
         offs_m, L, offs_d, D, not EVEN_D)


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_base, do_base, LSE_row, DELTA_row, sqm, sgm, offs_n, offs_d, L, D, qk_scale, lo, hi,
                 MASK: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
  """dv += P^T dO, dk += dS^T Q over the query blocks [lo, hi), working on transposed scores (keys are rows);
  MASK: the causal mask. Queries past L read as 0 (q, dO, lse and delta) and add nothing; keys past S only reach
  rows of dk and dv that are not stored."""
  for start_m in range(lo, hi, BLOCK_M):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load(q_base + offs_m[:, None] * sqm + offs_d[None, :], offs_m, L, offs_d, D, True, not EVEN_D)
    do = _load(do_base + offs_m[:, None] * sgm + offs_d[None, :], offs_m, L, offs_d, D, True, not EVEN_D)
    lse = tl.load(LSE_row + offs_m, mask=offs_m < L, other=0.0)
    delta = tl.load(DELTA_row + offs_m, mask=offs_m < L, other=0.0)
    pt = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse[None, :])
    if MASK:
      pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
    dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
    dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    dst = pt * (dpt - delta[None, :])
    dk += tl.dot(dst.to(q.dtype), q, input_precision=PRECISION)
  return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, qk_scale, sm_scale, L, S, D,
                   sqz, sqh, sqm, skz, skh, skn, svz, svh, svn, sgz, sgh, sgm, sdz, sdh, sdn,
                   CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
  start_n = tl.program_id(0)
  h, z = tl.program_id(1), tl.program_id(2)
  H = tl.num_programs(1)
  z64, h64 = z.to(tl.int64), h.to(tl.int64)
  offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
  offs_d = tl.arange(0, BLOCK_D)
  k = _load(K + z64 * skz + h64 * skh + offs_n[:, None] * skn + offs_d[None, :], offs_n, S, offs_d, D, True, not EVEN_D)
  v = _load(V + z64 * svz + h64 * svh + offs_n[:, None] * svn + offs_d[None, :], offs_n, S, offs_d, D, True, not EVEN_D)
  q_base, do_base = Q + z64 * sqz + h64 * sqh, DO + z64 * sgz + h64 * sgh
  LSE_row, DELTA_row = LSE + (z64 * H + h64) * L, DELTA + (z64 * H + h64) * L
  dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
  dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
  if CAUSAL:
    lo = start_n * BLOCK_N // BLOCK_M * BLOCK_M                         # the first query block that sees a key here
    free = tl.cdiv((start_n + 1) * BLOCK_N - 1, BLOCK_M) * BLOCK_M       # from here on every query sees every key
    free = tl.minimum(free, tl.cdiv(L, BLOCK_M) * BLOCK_M)
    dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, LSE_row, DELTA_row, sqm, sgm, offs_n, offs_d, L, D, qk_scale,
                          lo, free, True, EVEN_D, BLOCK_M, PRECISION)
  else:
    free = 0
  dk, dv = _dkdv_blocks(dk, dv, k, v, q_base, do_base, LSE_row, DELTA_row, sqm, sgm, offs_n, offs_d, L, D, qk_scale,
                        free, L, False, EVEN_D, BLOCK_M, PRECISION)
  dkv_off = z64 * sdz + h64 * sdh + offs_n[:, None] * sdn + offs_d[None, :]
  _store(DK + dkv_off, (dk * sm_scale).to(DK.dtype.element_ty), offs_n, S, offs_d, D, not EVEN_D)
  _store(DV + dkv_off, dv.to(DV.dtype.element_ty), offs_n, S, offs_d, D, not EVEN_D)


# *** configuration and variants ***

def _precision(dtype: DType, tf32: bool) -> str:
  return "tf32x3" if dtype is dtypes.float32 and not tf32 else "tf32"


_PTRS = {"fwd": "Q K V O LSE", "dq": "Q K V O DO DQ LSE DELTA DLSE", "dkdv": "Q K V DO DK DV LSE DELTA"}
_FNS = {"fwd": _attn_fwd, "dq": _attn_bwd_dq, "dkdv": _attn_bwd_dkdv}


@functools.lru_cache(maxsize=None)
def attention_spec(kernel: str, dtype: DType, head_dim: int, causal: bool, precision: str = "tf32",
                   aligned: bool = True, have_lse: bool = True, packed: bool = False) -> Spec:
  """The variant of `kernel` ("fwd", "dq", "dkdv"); `aligned` promises 16-divisible pointers and strides (but for the
  packed forward's output, of rows D + 1 wide: never promised); `packed`: flash_attention_lse's (the forward writes a
  float32 output with the logsumexp in column D, dq takes dlse)."""
  block_d = max(16, next_pow2(head_dim))
  bm, bn, warps, stages = attention_schedule(kernel, dtype.itemsize, block_d)
  packed_out = packed and kernel == "fwd"
  div = lambda name: ":16" if aligned and not (packed_out and name in ("O", "soz", "soh", "som")) else ""
  fp32 = ("LSE", "DELTA", "DLSE") + (("O",) if packed_out else ())
  sig = {name: ("*fp32" if name in fp32 else "*" + TY[dtype]) + div(name) for name in _PTRS[kernel].split()}
  sig |= {"qk_scale": "fp32", "L": "i32", "S": "i32", "D": "i32"} | ({} if kernel == "fwd" else {"sm_scale": "fp32"})
  for name in _FNS[kernel].arg_names:
    if name[0] == "s" and len(name) == 3: sig[name] = ("i64" if name[2] in "zh" else "i32") + div(name)  # strides
  consts = {"CAUSAL": causal, "EVEN_D": block_d == head_dim, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": block_d,
            "PRECISION": precision}
  if kernel == "dq": consts["HAVE_LSE"] = have_lse
  if kernel != "dkdv": consts["PACKED"] = packed
  return spec(_FNS[kernel], sig, consts, num_warps=warps, num_stages=stages)


# *** host wrappers ***

def _batch(a: CudaArray, nb: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
  """(Z, H) and their strides for a's nb batch dims (H the last), or None when the outer dims do not merge."""
  shape, strides = a.shape[:nb], a.strides[:nb]
  if nb == 0: return (1, 1), (0, 0)
  outer = [(n, s) for n, s in zip(shape[:-1], strides[:-1]) if n != 1]
  for (n0, s0), (n1, s1) in zip(outer, outer[1:]):
    if s0 != s1 * n1: return None
  return (math.prod(shape[:-1]), shape[-1]), (outer[-1][1] if outer else 0, strides[-1])


def _operand(a: CudaArray, nb: int) -> tuple[CudaArray, tuple[int, int, int]]:
  """a (copied when its head dim is strided or its batch dims do not merge) and its (z, h, row) strides."""
  zh = _batch(a, nb) if a.strides[-1] == 1 or a.shape[-1] == 1 else None
  if zh is None:
    from blutrain.backend.cuda.kernels.copy import copy
    a = copy(a)
    zh = _batch(a, nb)
  return a, (zh[1][0], zh[1][1], a.strides[-2])


def _check(q: CudaArray, k: CudaArray, v: CudaArray) -> None:
  if q.dtype not in (*HALF, dtypes.float32):
    raise TypeError(f"flash_attention: the CUDA kernel takes float16, bfloat16 or float32, got {q.dtype.name}")
  if q.shape[-1] > 256:
    raise ValueError(f"flash_attention: head dim {q.shape[-1]} is over the CUDA kernel's 256")
  for name, a in (("q", q), ("k", k), ("v", v)):
    if (a.shape[-2] - 1) * abs(a.strides[-2]) + a.shape[-1] > INT32_MAX:
      raise ValueError(f"flash_attention: {name} of shape {a.shape} (strides {a.strides}) spans over 2^31 elements "
                       f"within one head; make it contiguous or split the sequence")


# The forward's logsumexp, kept beside its output's memory (a primitive has one output) so that the backward need
# not recompute it: flash_attention's under its output, flash_attention_lse's (whose backward gets its output cast
# to q's dtype, a new array) under q, which the op's node holds until the backward. NOTE: a cache, not a contract:
# the backward recomputes the lse when no entry matches.
_saved_lse: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # anchor's owner -> {call key: lse}


def _lse_key(out: CudaArray, k: CudaArray, causal: bool, scale: float) -> tuple:
  return (out.ptr, out.shape, out.strides, k.shape, causal, scale)


def _inputs_key(q: CudaArray, k: CudaArray, v: CudaArray, causal: bool, scale: float) -> tuple:
  return tuple((a.ptr, a.shape, a.strides, a.dtype) for a in (q, k, v)) + (causal, scale)


def _remember(anchor: CudaArray, key: tuple, lse: CudaArray) -> None:
  try: _saved_lse.setdefault(anchor.owner, {})[key] = lse
  except TypeError: pass  # an owner that takes no weak reference (memory imported by DLPack): no cache


def _recall(anchor: CudaArray, key: tuple) -> CudaArray | None:
  try: return _saved_lse.get(anchor.owner, {}).get(key)
  except TypeError: return None


def _forward(q: CudaArray, k: CudaArray, v: CudaArray, causal: bool, scale: float, tf32: bool,
             packed: bool, transposed: bool = False) -> tuple[CudaArray, CudaArray]:
  """The output (packed: float32 (..., L, D + 1), the natural logsumexp in column D; transposed: (B, L, H, D) for
  q (B, H, L, D)) and the base-2 logsumexp."""
  _check(q, k, v)
  nb, (L, D), S = q.ndim - 2, q.shape[-2:], k.shape[-2]
  (q, sq), (k, sk), (v, sv) = (_operand(a, nb) for a in (q, k, v))
  (Z, H), _ = _batch(q, nb)
  width = D + 1 if packed else D
  if transposed:
    out = empty((q.shape[0], L, H, D), q.dtype, q.device)
    so = (L * H * D, D, H * D)
  else:
    out = empty(q.shape[:-1] + (width,), dtypes.float32 if packed else q.dtype, q.device)
    so = (H * L * width, L * width, width)
  lse = empty((Z * H * L,), dtypes.float32, q.device)
  # the packed output's rows (D + 1 wide) are never aligned: the spec promises nothing of them, the inputs may be
  vectors = aligned((q, k, v, lse) + (() if packed else (out,)), sq + sk + sv + (() if packed else so))
  s = attention_spec("fwd", q.dtype, D, causal, _precision(q.dtype, tf32), vectors, packed=packed)
  grid = (cdiv(L, s[2]["BLOCK_M"]), H, Z)
  run(s, grid, q, k, v, out, lse, scale * _LOG2E, L, S, D, *sq, *sk, *sv, *so)
  return out, lse


def flash_attention(q: CudaArray, k: CudaArray, v: CudaArray, causal: bool, scale: float, tf32: bool = False) -> CudaArray:
  out, lse = _forward(q, k, v, causal, scale, tf32, False)
  _remember(out, _lse_key(out, k, causal, scale), lse)
  return out


def flash_attention_transposed(q: CudaArray, k: CudaArray, v: CudaArray, causal: bool, scale: float,
                               tf32: bool = False) -> CudaArray:
  """flash_attention's output as a new (B, L, H, D) array for q (B, H, L, D); its logsumexp is kept for the backward
  under the (B, H, L, D) view of it, which the backward reads as its `out`."""
  out, lse = _forward(q, k, v, causal, scale, tf32, False, transposed=True)
  B, L, H, D = out.shape
  heads_first = view(out, (B, H, L, D), (L * H * D, D, H * D, 1))
  _remember(out, _lse_key(heads_first, k, causal, scale), lse)
  return out


def flash_attention_lse(q: CudaArray, k: CudaArray, v: CudaArray, causal: bool, scale: float,
                        tf32: bool = False) -> CudaArray:
  """(..., L, D + 1) float32: the output and, in column D, each query's natural logsumexp."""
  out, lse = _forward(q, k, v, causal, scale, tf32, True)
  _remember(q, _inputs_key(q, k, v, causal, scale), lse)
  return out


def _backward(g: CudaArray, q: CudaArray, k: CudaArray, v: CudaArray, out: CudaArray, causal: bool, scale: float,
              tf32: bool, glse: CudaArray | None, packed_into: CudaArray | None = None
              ) -> tuple[CudaArray, CudaArray, CudaArray]:
  _check(q, k, v)
  nb, (L, D), S = q.ndim - 2, q.shape[-2:], k.shape[-2]
  lse = (_recall(out, _lse_key(out, k, causal, scale)) if glse is None else
         _recall(q, _inputs_key(q, k, v, causal, scale)))
  batch = q.shape[:-2]
  (q, sq), (k, sk), (v, sv), (out, so), (g, sg) = (_operand(a, nb) for a in (q, k, v, out, g))
  (Z, H), _ = _batch(q, nb)
  if packed_into is None:
    dq, dk, dv = (empty(batch + (n, D), q.dtype, q.device) for n in (L, S, S))
    sdq, sdk = (H * L * D, L * D, D), (H * S * D, S * D, D)
  else:  # (B, L, 3, H, D): dq, dk, dv side by side in each row of the projection's gradient
    sdq = sdk = (L * 3 * H * D, D, 3 * H * D)
    dq, dk, dv = (view(packed_into, batch + (L, D), (*sdq, 1), i * H * D) for i in range(3))
  have_lse = lse is not None
  if not have_lse: lse = empty((Z * H * L,), dtypes.float32, q.device)
  delta = empty((Z * H * L,), dtypes.float32, q.device)
  packed = glse is not None
  if packed and not glse.is_contiguous():
    from blutrain.backend.cuda.kernels.copy import copy
    glse = copy(glse)
  prec = _precision(q.dtype, tf32)
  vectors = aligned((q, k, v, out, g, dq, dk, dv, lse, delta, *((glse,) if packed else ())),
                    sq + sk + sv + so + sg + sdq + sdk)
  s = attention_spec("dq", q.dtype, D, causal, prec, vectors, have_lse, packed)
  run(s, (cdiv(L, s[2]["BLOCK_M"]), H, Z), q, k, v, out, g, dq, lse, delta, glse if packed else delta, scale * _LOG2E,
      scale, L, S, D, *sq, *sk, *sv, *so, *sg, *sdq)
  s = attention_spec("dkdv", q.dtype, D, causal, prec, vectors)
  run(s, (cdiv(S, s[2]["BLOCK_N"]), H, Z), q, k, v, g, dk, dv, lse, delta, scale * _LOG2E, scale, L, S, D,
      *sq, *sk, *sv, *sg, *sdk)
  return dq, dk, dv


def flash_attention_backward(g: CudaArray, q: CudaArray, k: CudaArray, v: CudaArray, out: CudaArray, causal: bool,
                             scale: float, tf32: bool = False) -> tuple[CudaArray, CudaArray, CudaArray]:
  """(dq, dk, dv): three new contiguous arrays, which the kernels write (dk and dv share one layout)."""
  return _backward(g, q, k, v, out, causal, scale, tf32, None)


def flash_attention_backward_packed(g: CudaArray, q: CudaArray, k: CudaArray, v: CudaArray, out: CudaArray,
                                    causal: bool, scale: float, tf32: bool = False) -> CudaArray:
  """The self-attention's (dq, dk, dv) as one new (B, L, 3, H, D) array, which the kernels write in place (the
  projection's gradient, with no concatenation)."""
  B, H, L, D = q.shape
  packed = empty((B, L, 3, H, D), q.dtype, q.device)
  _backward(g, q, k, v, out, causal, scale, tf32, None, packed)
  return packed


def flash_attention_lse_backward(g: CudaArray, glse: CudaArray, q: CudaArray, k: CudaArray, v: CudaArray,
                                 out: CudaArray, causal: bool, scale: float,
                                 tf32: bool = False) -> tuple[CudaArray, CudaArray, CudaArray]:
  """flash_attention_lse's (dq, dk, dv) from the output's gradient g, the logsumexp's glse ((..., L) float32) and the
  output `out` in q's dtype; the logsumexp is the forward's (kept under q), else recomputed by the dq kernel (a cheap
  pass: no P V product)."""
  return _backward(g, q, k, v, out, causal, scale, tf32, glse)


def _specs() -> list[Spec]:
  """What CI compiles (a sample: each variant compiles in 0.5-10 s): each kernel in every dtype and matmul
  precision at GPT-2's head dim, unmasked, unaligned, the other head widths (32, 128, and 80, padded to 128), and the
  dq kernel that recomputes the lse."""
  out = []
  for kernel in ("fwd", "dq", "dkdv"):
    out += [attention_spec(kernel, dtypes.bfloat16, 64, True), attention_spec(kernel, dtypes.bfloat16, 64, False),
            attention_spec(kernel, dtypes.float16, 64, True), attention_spec(kernel, dtypes.float32, 64, True, "tf32"),
            attention_spec(kernel, dtypes.float32, 64, True, "tf32x3"), attention_spec(kernel, dtypes.bfloat16, 64, True, aligned=False)]
    out += [attention_spec(kernel, dtypes.bfloat16, d, True) for d in (32, 128, 80)]
  out.append(attention_spec("dq", dtypes.bfloat16, 64, True, have_lse=False))
  out.append(attention_spec("dq", dtypes.float32, 64, False, "tf32x3", have_lse=False))
  out += [attention_spec("fwd", dtypes.bfloat16, 64, True, packed=True),   # flash_attention_lse
          attention_spec("fwd", dtypes.bfloat16, 64, True, aligned=False, packed=True),
          attention_spec("fwd", dtypes.float32, 64, False, "tf32x3", aligned=False, packed=True),
          attention_spec("dq", dtypes.bfloat16, 64, True, have_lse=False, packed=True),
          attention_spec("dq", dtypes.bfloat16, 64, True, packed=True),
          attention_spec("dq", dtypes.float32, 64, False, "tf32x3", aligned=False, have_lse=False, packed=True)]
  return out


SPECS = _specs()
KERNELS = {"flash_attention": flash_attention, "flash_attention_backward": flash_attention_backward,
           "flash_attention_backward_packed": flash_attention_backward_packed,
           "flash_attention_transposed": flash_attention_transposed,
           "flash_attention_lse": flash_attention_lse, "flash_attention_lse_backward": flash_attention_lse_backward}
