"""Softmax cross-entropy of logits (N, C) against class indices, forward and backward, row-wise.

The forward keeps per-lane online logsumexp statistics over the row (norm.row_stats) and reads the target's logit
once: one read of the logits, no softmax stored. The backward recomputes the statistics and writes
(softmax - onehot(target)) * g in a second pass: two reads and one write of (N, C), never a softmax tensor.
Vocabularies of any size are walked in tiles of 4096 (GPT-2's 50304 takes 13).

cross_entropy_stats and cross_entropy_lse_backward are the vocabulary-parallel loss's halves: the first reads the
logits once for each row's max, sum of exponentials and target logit (the ranks combine them into the row's
logsumexp), the second writes (exp(x - lse) - onehot(target)) * g from that logsumexp in one read and one write.

Half logits are read as they are and computed on in float32; the losses come in the dtype asked for (float32 when
Nova folds autocast's cast of the logits into the forward), the gradient in the logits' dtype, from g of any floating
dtype. Targets equal to ignore_index give a zero loss and gradient. A target out of [0, C) makes that row's loss and
gradient NaN instead of raising, as the CPU backend does: checking would make the host wait for the GPU.
"""
from __future__ import annotations

import functools
import triton
import triton.language as tl

from blutrain import dtypes
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import TL, aligned, divisible, empty, needs_i64, ptr, run, spec
from blutrain.backend.cuda.kernels.norm import row_stats, stats_dtype
from blutrain.configurator import row_schedule
from blutrain.shapes import cdiv


@triton.jit
def _target(target, rows, m_mask, target_stride, C, ignore_index):
  """(target, ignored, out of range) per row."""
  t = tl.load(target + rows * target_stride, mask=m_mask, other=ignore_index).to(tl.int64)
  ignored = t == ignore_index
  bad = ~ignored & ((t < 0) | (t >= C))
  return t, ignored, bad


@triton.jit
def _ce_forward(out, logits, target, row_max_out, sum_out, N, C, row_stride, class_stride, target_stride, ignore_index,
                ACC: tl.constexpr, C_UNIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                IDX64: tl.constexpr, STATS: tl.constexpr):
  """out[n] = logsumexp(logits[n]) - logits[n, target[n]] (logits at n row_stride + c class_stride); with STATS the
  row's max and sum of exp(x - max) as well, for the backward."""
  pid = tl.program_id(0)
  if IDX64:
    pid = pid.to(tl.int64)
  rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
  m_mask = rows < N
  row_max, row_sum = row_stats(logits, rows * row_stride, m_mask, C, class_stride, ACC, C_UNIT, BLOCK_M, BLOCK_N)
  if STATS:
    tl.store(row_max_out + rows, row_max, mask=m_mask)
    tl.store(sum_out + rows, row_sum, mask=m_mask)
  t, ignored, bad = _target(target, rows, m_mask, target_stride, C, ignore_index)
  _store_loss(out, logits, rows, m_mask, row_stride, class_stride, t, ignored, bad, row_max, row_sum, ACC)


@triton.jit
def _store_loss(out, logits, rows, m_mask, row_stride, class_stride, t, ignored, bad, row_max, row_sum,
                ACC: tl.constexpr):
  """out[n] = logsumexp(logits[n]) - logits[n, t[n]] from the row's max and sum of exp(x - max); 0 where ignored,
  NaN where the target is out of range."""
  picked = tl.load(logits + rows * row_stride + t * class_stride, mask=m_mask & ~ignored & ~bad, other=0).to(ACC)
  loss = tl.where(ignored, 0.0, row_max + tl.log(row_sum) - picked)
  loss = tl.where(bad, float("nan"), loss)
  tl.store(out + rows, loss.to(out.dtype.element_ty), mask=m_mask)


@triton.jit
def _ce_backward(out, loss_out, g, logits, target, row_max_in, sum_in, N, C, row_stride, class_stride, target_stride,
                 g_stride, ignore_index, ACC: tl.constexpr, C_UNIT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, IDX64: tl.constexpr, STATS: tl.constexpr, LOSS: tl.constexpr):
  """out[n, c] = (softmax(logits[n])[c] - (c == target[n])) * g[n]; out is contiguous (N, C). With STATS the row's
  max and sum of exp(x - max) are the forward's (one read of the logits), else computed here; with LOSS (and not
  STATS) the forward's loss is stored too, from the same statistics, before the row is read again for its
  gradient."""
  pid = tl.program_id(0)
  if IDX64:
    pid = pid.to(tl.int64)
  rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
  m_mask = rows < N
  if STATS:
    row_max = tl.load(row_max_in + rows, mask=m_mask, other=0.0)
    row_sum = tl.load(sum_in + rows, mask=m_mask, other=1.0)
  else:
    row_max, row_sum = row_stats(logits, rows * row_stride, m_mask, C, class_stride, ACC, C_UNIT, BLOCK_M, BLOCK_N)
  t, ignored, bad = _target(target, rows, m_mask, target_stride, C, ignore_index)
  if LOSS:
    _store_loss(loss_out, logits, rows, m_mask, row_stride, class_stride, t, ignored, bad, row_max, row_sum, ACC)
  gt = tl.load(g + rows * g_stride, mask=m_mask, other=0).to(ACC)
  gt = tl.where(ignored, 0.0, tl.where(bad, float("nan"), gt))
  scale = gt / row_sum
  for c0 in range(0, C, BLOCK_N):
    cs = c0 + tl.arange(0, BLOCK_N)
    mask = m_mask[:, None] & (cs < C)[None, :]
    v = tl.load(logits + (rows * row_stride)[:, None] + (cs if C_UNIT else cs * class_stride)[None, :], mask=mask,
                other=0).to(ACC)
    d = tl.exp(v - row_max[:, None]) * scale[:, None] - tl.where(cs[None, :] == t[:, None], gt[:, None], 0.0)
    tl.store(out + (rows * C)[:, None] + cs[None, :], d.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _ce_stats(row_max_out, sum_out, picked_out, logits, target, N, C, row_stride, class_stride, target_stride, start,
              ACC: tl.constexpr, C_UNIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              IDX64: tl.constexpr):
  """Per row: max, sum of exp(x - max), and x[target - start] (0 where that is outside [0, C)), in one read."""
  pid = tl.program_id(0)
  if IDX64:
    pid = pid.to(tl.int64)
  rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
  m_mask = rows < N
  row_max, row_sum = row_stats(logits, rows * row_stride, m_mask, C, class_stride, ACC, C_UNIT, BLOCK_M, BLOCK_N)
  t = tl.load(target + rows * target_stride, mask=m_mask, other=0).to(tl.int64) - start
  mine = (t >= 0) & (t < C)
  picked = tl.load(logits + rows * row_stride + t * class_stride, mask=m_mask & mine, other=0).to(ACC)
  tl.store(row_max_out + rows, row_max, mask=m_mask)
  tl.store(sum_out + rows, row_sum, mask=m_mask)
  tl.store(picked_out + rows, picked, mask=m_mask)


@triton.jit
def _ce_lse_backward(out, g, logits, target, lse, N, C, row_stride, class_stride, target_stride, g_stride, lse_stride,
                     start, ignore_index, ACC: tl.constexpr, C_UNIT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, IDX64: tl.constexpr):
  """out[n, c] = (exp(logits[n, c] - lse[n]) - (c == target[n] - start)) * g[n], 0 where target[n] is ignore_index;
  out is contiguous (N, C). One read of the logits: the row's logsumexp is given."""
  pid = tl.program_id(0)
  if IDX64:
    pid = pid.to(tl.int64)
  rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
  m_mask = rows < N
  t = tl.load(target + rows * target_stride, mask=m_mask, other=ignore_index).to(tl.int64)
  gt = tl.load(g + rows * g_stride, mask=m_mask, other=0).to(ACC)
  gt = tl.where(t == ignore_index, 0.0, gt)
  t = t - start
  row_lse = tl.load(lse + rows * lse_stride, mask=m_mask, other=0).to(ACC)
  for c0 in range(0, C, BLOCK_N):
    cs = c0 + tl.arange(0, BLOCK_N)
    mask = m_mask[:, None] & (cs < C)[None, :]
    v = tl.load(logits + (rows * row_stride)[:, None] + (cs if C_UNIT else cs * class_stride)[None, :], mask=mask,
                other=0).to(ACC)
    d = tl.exp(v - row_lse[:, None]) * gt[:, None] - tl.where(cs[None, :] == t[:, None], gt[:, None], 0.0)
    tl.store(out + (rows * C)[:, None] + cs[None, :], d.to(out.dtype.element_ty), mask=mask)


_ROWS = ("out", "logits", "C", "row_stride")  # what the `vectors` variants promise multiples of 16


def _signature(logits, target, i64: bool, backward: bool, other, loss) -> dict:
  it, acc = ("i64" if i64 else "i32"), ptr(stats_dtype(logits))
  out, g = (logits, other) if backward else (other, None)
  stats = {"row_max_in": acc, "sum_in": acc} if backward else {"row_max_out": acc, "sum_out": acc}
  grads = {"loss_out": ptr(loss or logits), "g": ptr(g)} if backward else {}
  return {"out": ptr(out), **grads, "logits": ptr(logits), "target": ptr(target),
          **stats, "N": it, "C": it, "row_stride": it, "class_stride": it, "target_stride": it,
          **({"g_stride": it} if backward else {}), "ignore_index": "i64"}


@functools.lru_cache(maxsize=4096)
def ce_spec(backward: bool, logits, target, c_unit: bool, N: int, C: int, i64: bool, other=None,
            vectors: bool = False, stats: bool = False, loss=None):
  """The forward (losses in dtype `other`, default the logits') or the backward (the gradient in the logits' dtype,
  from g of dtype `other`, default the logits'). `vectors`: the rows' pointers, C and the row stride are promised
  multiples of 16, so rows load (and the backward stores) as 16-byte vectors. `stats`: the forward stores each row's
  max and sum of exp(x - max), the backward reads them (the same tiles, one more store or load). `loss`: the backward
  (without `stats`) stores the forward's losses too, in this dtype (`cross_entropy_with_grad`)."""
  bm, bn, warps, _ = row_schedule(N, C)
  bn = min(bn, 4096)  # NOTE: a streaming loop (no one-pass path): the backward without stats reads the row twice
  sig = _signature(logits, target, i64, backward, other or logits, loss)
  constexprs = dict(ACC=TL[stats_dtype(logits)], C_UNIT=c_unit, BLOCK_M=bm, BLOCK_N=bn, IDX64=i64, STATS=stats)
  if backward: constexprs["LOSS"] = loss is not None
  return spec(_ce_backward if backward else _ce_forward, divisible(sig, _ROWS) if vectors else sig, constexprs,
              num_warps=warps)


def _vectors(logits: CudaArray, *outs: CudaArray) -> bool:
  """Whether the `vectors` variants may run: unit class stride, rows (and outputs) on 16 bytes (see `aligned`)."""
  return logits.strides[1] == 1 and aligned((logits, *outs), (logits.shape[1], logits.strides[0]))


def cross_entropy(logits: CudaArray, target: CudaArray, ignore_index: int, dtype=None) -> CudaArray:
  return _forward(logits, target, ignore_index, dtype, False)[0]


def cross_entropy_with_stats(logits: CudaArray, target: CudaArray, ignore_index: int,
                             dtype=None) -> tuple[CudaArray, CudaArray, CudaArray]:
  return _forward(logits, target, ignore_index, dtype, True)


def _forward(logits: CudaArray, target: CudaArray, ignore_index: int, dtype, stats: bool) -> tuple:
  N, C = logits.shape
  out = empty((N,), dtype or logits.dtype, logits.device)
  row_max, sum_exp = (empty((N,), stats_dtype(logits.dtype), logits.device) for _ in range(2)) if stats else (out, out)
  if N > 0:
    i64 = needs_i64(logits.shape, logits.strides)
    s = ce_spec(False, logits.dtype, target.dtype, logits.strides[1] == 1, N, C, i64, out.dtype, _vectors(logits, out),
                stats)
    run(s, (cdiv(N, s.constexprs["BLOCK_M"]),), out.ptr, logits.ptr, target.ptr, row_max.ptr, sum_exp.ptr, N, C,
        *logits.strides, target.strides[0], ignore_index)
  return (out, row_max, sum_exp) if stats else (out,)


def cross_entropy_backward(g: CudaArray, logits: CudaArray, target: CudaArray, ignore_index: int,
                           out: CudaArray | None = None) -> CudaArray:
  """The gradient of the logits, into `out` when given (contiguous (N, C) of the logits' dtype, which may be the
  logits themselves: each row is read whole before it is written)."""
  return _backward(g, logits, target, None, ignore_index, out)


def cross_entropy_backward_with_stats(g: CudaArray, logits: CudaArray, target: CudaArray, row_max: CudaArray,
                                      sum_exp: CudaArray, ignore_index: int, out: CudaArray | None = None) -> CudaArray:
  """cross_entropy_backward from the forward's row statistics: one read of the logits (`out` as there)."""
  return _backward(g, logits, target, (row_max, sum_exp), ignore_index, out)


def cross_entropy_with_grad(g: CudaArray, logits: CudaArray, target: CudaArray, ignore_index: int, dtype=None,
                            out: CudaArray | None = None) -> tuple[CudaArray, CudaArray]:
  """The losses (in `dtype`, default the logits') and the logits' gradient from g, by one kernel that computes each
  row's statistics once for both (`out` as cross_entropy_backward's)."""
  if 0 in logits.shape:  # no row to read twice (the losses of empty rows come from the forward's kernel)
    return cross_entropy(logits, target, ignore_index, dtype), _backward(g, logits, target, None, ignore_index, out)
  loss = empty((logits.shape[0],), dtype or logits.dtype, logits.device)
  return loss, _backward(g, logits, target, None, ignore_index, out, loss)


def _backward(g: CudaArray, logits: CudaArray, target: CudaArray, stats: tuple | None, ignore_index: int,
              out: CudaArray | None, loss: CudaArray | None = None) -> CudaArray:
  N, C = logits.shape
  if out is None: out = empty((N, C), logits.dtype, logits.device)
  if out.size == 0: return out
  i64 = needs_i64(logits.shape, logits.strides, (C, 1))
  s = ce_spec(True, logits.dtype, target.dtype, logits.strides[1] == 1, N, C, i64, g.dtype, _vectors(logits, out),
              stats is not None, None if loss is None else loss.dtype)
  row_max, sum_exp = stats or (out, out)
  run(s, (cdiv(N, s.constexprs["BLOCK_M"]),), out.ptr, out.ptr if loss is None else loss.ptr, g.ptr, logits.ptr,
      target.ptr, row_max.ptr, sum_exp.ptr, N, C, *logits.strides, target.strides[0], g.strides[0] if g.ndim else 0,
      ignore_index)
  return out


@functools.lru_cache(maxsize=4096)
def ce_lse_spec(backward: bool, logits, target, c_unit: bool, N: int, C: int, i64: bool, g=None,
                vectors: bool = False):
  """cross_entropy_stats (backward False) or cross_entropy_lse_backward's kernel, from g of dtype `g` (`vectors` as
  `ce_spec`'s)."""
  bm, bn, warps, _ = row_schedule(N, C)
  bn = min(bn, 4096)
  it, acc = ("i64" if i64 else "i32"), stats_dtype(logits)
  rows = {"N": it, "C": it, "row_stride": it, "class_stride": it, "target_stride": it}
  if backward:
    sig = {"out": ptr(logits), "g": ptr(g), "logits": ptr(logits), "target": ptr(target), "lse": ptr(acc), **rows,
           "g_stride": it, "lse_stride": it, "start": "i64", "ignore_index": "i64"}
  else:
    sig = {"row_max_out": ptr(acc), "sum_out": ptr(acc), "picked_out": ptr(acc), "logits": ptr(logits),
           "target": ptr(target), **rows, "start": "i64"}
  return spec(_ce_lse_backward if backward else _ce_stats, divisible(sig, _ROWS) if vectors else sig,
              dict(ACC=TL[acc], C_UNIT=c_unit, BLOCK_M=bm, BLOCK_N=bn, IDX64=i64), num_warps=warps)


def cross_entropy_stats(logits: CudaArray, target: CudaArray, start: int) -> tuple[CudaArray, CudaArray, CudaArray]:
  N, C = logits.shape
  outs = tuple(empty((N,), stats_dtype(logits.dtype), logits.device) for _ in range(3))
  if N == 0: return outs
  i64 = needs_i64(logits.shape, logits.strides)
  s = ce_lse_spec(False, logits.dtype, target.dtype, logits.strides[1] == 1, N, C, i64, None, _vectors(logits))
  run(s, (cdiv(N, s.constexprs["BLOCK_M"]),), *(o.ptr for o in outs), logits.ptr, target.ptr, N, C, *logits.strides,
      target.strides[0], start)
  return outs


def cross_entropy_lse_backward(g: CudaArray, logits: CudaArray, target: CudaArray, lse: CudaArray, start: int,
                               ignore_index: int) -> CudaArray:
  N, C = logits.shape
  out = empty((N, C), logits.dtype, logits.device)
  if out.size == 0: return out
  i64 = needs_i64(logits.shape, logits.strides, (C, 1))
  s = ce_lse_spec(True, logits.dtype, target.dtype, logits.strides[1] == 1, N, C, i64, g.dtype, _vectors(logits, out))
  run(s, (cdiv(N, s.constexprs["BLOCK_M"]),), out.ptr, g.ptr, logits.ptr, target.ptr, lse.ptr, N, C, *logits.strides,
      target.strides[0], g.strides[0], lse.strides[0], start, ignore_index)
  return out


cross_entropy_backward.writes_out = cross_entropy_backward_with_stats.writes_out = True
cross_entropy_with_grad.writes_out = True
KERNELS = {"cross_entropy": cross_entropy, "cross_entropy_backward": cross_entropy_backward,
           "cross_entropy_with_stats": cross_entropy_with_stats,
           "cross_entropy_backward_with_stats": cross_entropy_backward_with_stats,
           "cross_entropy_with_grad": cross_entropy_with_grad,
           "cross_entropy_stats": cross_entropy_stats, "cross_entropy_lse_backward": cross_entropy_lse_backward}

SPECS = [ce_spec(b, dt, dtypes.int64, True, 16384, 50304, False, o, stats=st) for b in (False, True)
         for dt, o in ((dtypes.float32, None), (dtypes.bfloat16, None), (dtypes.bfloat16, dtypes.float32))
         for st in (False, True)] + \
        [ce_spec(b, dtypes.float64, dtypes.int32, False, 100, 10, True) for b in (False, True)] + \
        [ce_lse_spec(b, dt, dtypes.int64, True, 8192, 50304, False, dtypes.float32 if b else None)
         for b in (False, True) for dt in (dtypes.float32, dtypes.bfloat16)] + \
        [ce_lse_spec(b, dtypes.float64, dtypes.int32, False, 100, 10, True, dtypes.float64 if b else None)
         for b in (False, True)] + \
        [ce_spec(b, dtypes.bfloat16, dtypes.int64, True, 16384, 50304, False, dtypes.float32, True) for b in (False, True)] + \
        [ce_lse_spec(b, dtypes.bfloat16, dtypes.int64, True, 8192, 50304, False, dtypes.float32 if b else None, True)
         for b in (False, True)] + \
        [ce_spec(True, dt, dtypes.int64, True, 16384, 50304, False, dtypes.float32, True, loss=dtypes.float32)
         for dt in (dtypes.bfloat16, dtypes.float32)] + \
        [ce_spec(True, dtypes.float64, dtypes.int32, False, 100, 10, True, loss=dtypes.float64)]
