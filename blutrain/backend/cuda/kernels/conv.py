"""Convolution as implicit GEMM: `conv`, `conv_grad_input` (dgrad, also conv_transpose) and `conv_grad_weight`
(wgrad), Triton kernels that gather each GEMM tile straight from the strided NCHW (or any-strided, NHWC included)
tensors, so no im2col buffer is ever written.

Per group (grid axis 2), with the 2-D problem (1-D convolutions run as H = 1; 3-D ones add a depth dim D that the
kernels' DEPTH variant walks as they walk H, which 1-D and 2-D convolutions skip):
  forward  out[n*OH*OW, o]  = sum over (c, kh, kw) of x[n, c, oh*s - p + kh*d, ...] w[o, c, kh, kw]
  dgrad    dx[n*H*W, c]     = sum over (o, kh, kw) of g[n, o, (ih + p - kh*d) / s, ...] w[o, c, kh, kw], where the
                              division is exact and lands inside g (masked otherwise)
  wgrad    dw[o, c*KH*KW]   = sum over (n, oh, ow) of g[n, o, oh, ow] x[n, c, oh*s - p + kh*d, ...], K split over
                              `split` programs into float32 partial sums, then summed by `reduce`
The tile sizes, stages and split come from `configurator.conv_schedule`. Half inputs accumulate in float32; float32
multiplies in TF32 when the op's `tf32` attribute is set, else in 3xTF32 (float32-accurate, as attention does);
float64 in float64 FMAs (a broadcast product; tl.dot takes no float64). Offsets are int64 only where the tensors need them (`IDX64`).

These general kernels decode each reduction index by `%` and `//` of runtime sizes and take every stride at run
time, so Triton cannot prove any tile contiguous: each element is its own 2-byte load and nothing is pipelined. The
channels-last variants (`_conv_*_cl_kernel`) read channels-last operands (unit channel stride, never passed) and
walk the reduction as (kd, kh, kw) x channel blocks in one flat loop, so a tile's channels are `c0 + arange` at unit
stride; with pointers, the other strides and the channel counts promised multiples of 16 (":16" in the signature),
their tiles load as 16-byte cp.async copies pipelined over `num_stages` buffers. wgrad's columns become (kd, kh,
kw, c) with one kernel position per column tile. The host wrappers take them for bfloat16, float16 and float32 with
channels per group of multiples of 16 (`vectorizes`), copying NCHW operands channels-last first (`_channels_last`:
one transposing copy costs far less than the scalar loads), and the forward and dgrad pad a single group's few input
channels (an image's 3) with zeros up to 16 (`padded_channels`); every other case runs the general kernels. The output
and the input gradient are new arrays in the dense layout of the input and of the output gradient (channels-last stays
channels-last, as PyTorch's memory formats do), the weight gradient is contiguous. Where `cudnn_conv.takes` a problem,
cuDNN runs it instead (cudnn_conv.py).
"""
from __future__ import annotations

import functools
import math

import triton
import triton.language as tl

from blutrain import configurator, dtypes
from blutrain.backend.cuda import runtime
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import TL, cudnn_conv, empty, empty_like, empty_suggested, needs_i64, ptr, run, spec, view
from blutrain.backend.cuda.kernels.copy import copy
from blutrain.backend.cuda.kernels.creation import fill
from blutrain.backend.cuda.kernels.reduce import reduce
from blutrain.dtypes import DType
from blutrain.shapes import cdiv, contiguous_strides

_GEOMETRY = ["C", "D", "H", "W", "OD", "OH", "OW", "KD", "KH", "KW", "sd", "sh", "sw", "pd", "ph", "pw", "dd", "dh",
             "dw"]


def _strides(*names: str) -> list[str]: return [f"{n}_s{i}" for n in names for i in range(5)]


@triton.jit
def _mma(a, b, acc, PRECISION: tl.constexpr):
  """acc + a @ b: tensor cores, or (float64, which tl.dot does not take) a broadcast product summed over K."""
  if PRECISION == "ieee":
    acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
  else:
    acc = tl.dot(a, b, acc, input_precision=PRECISION)
  return acc


@triton.jit
def _position(p, W, H, D, DEPTH: tl.constexpr, IDX64: tl.constexpr):
  """(w, h, d, n) of flat positions p over (n, [d,] h, w) (d 0 without DEPTH; n int64 with IDX64)."""
  w, t = p % W, p // W
  h, n = t % H, t // H
  d = 0
  if DEPTH:
    d, n = n % D, n // D
  if IDX64: n = n.to(tl.int64)
  return w, h, d, n


@triton.jit
def _store(out, acc, n, d, h, w, ch, mask, s0, s1, s2, s3, s4, DEPTH: tl.constexpr):
  """acc (positions x channels ch) into out at strides (s0..s4) of (n, channel, [d,] h, w)."""
  row = n * s0 + h * s3 + w * s4
  if DEPTH:
    row += d * s2
  tl.store(out + row[:, None] + (ch * s1)[None, :], acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _conv_fwd_kernel(out, x, w, M, N, K, C, D, H, W, OD, OH, OW, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                     x_s0, x_s1, x_s2, x_s3, x_s4, w_s0, w_s1, w_s2, w_s3, w_s4,
                     out_s0, out_s1, out_s2, out_s3, out_s4,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
                     PRECISION: tl.constexpr, IDX64: tl.constexpr, DEPTH: tl.constexpr):
  grp = tl.program_id(2)
  rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # output positions (n, od, oh, ow)
  rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output channels of the group
  ow, oh, od, n = _position(rm, OW, OH, OD, DEPTH, IDX64)
  ih0, iw0 = oh * sh - ph, ow * sw - pw
  x_row = x + n * x_s0 + grp * C * x_s1
  o = grp * N + rn
  if IDX64: o = o.to(tl.int64)
  w_col = w + o * w_s0
  m_ok, n_ok = rm < M, rn < N
  if DEPTH:
    id0 = od * sd - pd
  acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
  for k0 in range(0, K, BLOCK_K):
    rk = k0 + tl.arange(0, BLOCK_K)  # (c, kd, kh, kw), the weight's order
    kw, r = rk % KW, rk // KW
    kh, c = r % KH, r // KH
    ih, iw = ih0[:, None] + kh[None, :] * dh, iw0[:, None] + kw[None, :] * dw
    k_ok = rk < K
    a_off = x_row[:, None] + ih * x_s3 + iw * x_s4
    a_ok = m_ok[:, None] & k_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    b_off = kh * w_s3 + kw * w_s4
    if DEPTH:
      kd, c = c % KD, c // KD
      i_d = id0[:, None] + kd[None, :] * dd
      a_off += i_d * x_s2
      a_ok = a_ok & (i_d >= 0) & (i_d < D)
      b_off += kd * w_s2
    a = tl.load(a_off + (c * x_s1)[None, :], mask=a_ok, other=0.0)
    b = tl.load(w_col[None, :] + (c * w_s1 + b_off)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    acc = _mma(a, b, acc, PRECISION)
  _store(out, acc, n, od, oh, ow, o, m_ok[:, None] & n_ok[None, :], out_s0, out_s1, out_s2, out_s3, out_s4, DEPTH)


@triton.jit
def _conv_dgrad_kernel(dx, g, w, M, N, K, C, D, H, W, OD, OH, OW, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                       g_s0, g_s1, g_s2, g_s3, g_s4, w_s0, w_s1, w_s2, w_s3, w_s4, dx_s0, dx_s1, dx_s2, dx_s3, dx_s4,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
                       PRECISION: tl.constexpr, IDX64: tl.constexpr, DEPTH: tl.constexpr):
  # N: input channels of a group; C: output channels of a group (K = C * KD * KH * KW)
  grp = tl.program_id(2)
  rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # input positions (n, id, ih, iw)
  rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # input channels of the group
  iw, ih, i_d, n = _position(rm, W, H, D, DEPTH, IDX64)
  g_row = g + n * g_s0 + grp * C * g_s1
  c = grp * N + rn
  if IDX64: c = c.to(tl.int64)
  w_col = w + grp * C * w_s0 + rn * w_s1
  m_ok, n_ok = rm < M, rn < N
  acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
  for k0 in range(0, K, BLOCK_K):
    rk = k0 + tl.arange(0, BLOCK_K)  # (o, kd, kh, kw)
    kw, r = rk % KW, rk // KW
    kh, o = r % KH, r // KH
    th, tw = ih[:, None] + ph - kh[None, :] * dh, iw[:, None] + pw - kw[None, :] * dw
    th_ok, tw_ok = th >= 0, tw >= 0
    th, tw = tl.where(th_ok, th, 0), tl.where(tw_ok, tw, 0)
    oh, ow = th // sh, tw // sw
    k_ok = rk < K
    ok = m_ok[:, None] & k_ok[None, :] & th_ok & tw_ok & (oh * sh == th) & (ow * sw == tw) & (oh < OH) & (ow < OW)
    a_off = g_row[:, None] + oh * g_s3 + ow * g_s4
    b_off = kh * w_s3 + kw * w_s4
    if DEPTH:
      kd, o = o % KD, o // KD
      td = i_d[:, None] + pd - kd[None, :] * dd
      td_ok = td >= 0
      td = tl.where(td_ok, td, 0)
      od = td // sd
      ok = ok & td_ok & (od * sd == td) & (od < OD)
      a_off += od * g_s2
      b_off += kd * w_s2
    a = tl.load(a_off + (o * g_s1)[None, :], mask=ok, other=0.0)
    b = tl.load(w_col[None, :] + (o * w_s0 + b_off)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    acc = _mma(a, b, acc, PRECISION)
  _store(dx, acc, n, i_d, ih, iw, c, m_ok[:, None] & n_ok[None, :], dx_s0, dx_s1, dx_s2, dx_s3, dx_s4, DEPTH)


@triton.jit
def _conv_wgrad_kernel(part, g, x, M, N, K, C, D, H, W, OD, OH, OW, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                       g_s0, g_s1, g_s2, g_s3, g_s4, x_s0, x_s1, x_s2, x_s3, x_s4, STEPS, SPLIT,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
                       PRECISION: tl.constexpr, IDX64: tl.constexpr, DEPTH: tl.constexpr):
  # M: output channels of a group, N: C * KD * KH * KW, K: batch * OD * OH * OW, in SPLIT runs of STEPS * BLOCK_K;
  # part is (SPLIT, groups * M, N) partial sums
  grp, split = tl.program_id(2) // SPLIT, tl.program_id(2) % SPLIT
  rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # output channels of the group
  rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (c, kd, kh, kw)
  kw, t = rn % KW, rn // KW
  kh, c = t % KH, t // KH
  if DEPTH:
    kd, c = c % KD, c // KD
  o = grp * M + rm
  if IDX64: o = o.to(tl.int64)
  g_row = g + o * g_s1
  x_col = x + (grp * C + c) * x_s1
  m_ok, n_ok = rm < M, rn < N
  acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
  start = split * STEPS * BLOCK_K
  for step in range(0, STEPS):
    rk = start + step * BLOCK_K + tl.arange(0, BLOCK_K)  # (n, od, oh, ow)
    ow, oh, od, n = _position(rk, OW, OH, OD, DEPTH, IDX64)
    k_ok = rk < K
    ih, iw = (oh * sh - ph)[:, None] + kh[None, :] * dh, (ow * sw - pw)[:, None] + kw[None, :] * dw
    a_off = n * g_s0 + oh * g_s3 + ow * g_s4
    b_off = (n * x_s0)[:, None] + ih * x_s3 + iw * x_s4
    b_ok = k_ok[:, None] & n_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    if DEPTH:
      i_d = (od * sd - pd)[:, None] + kd[None, :] * dd
      a_off += od * g_s2
      b_off += i_d * x_s2
      b_ok = b_ok & (i_d >= 0) & (i_d < D)
    a = tl.load(g_row[:, None] + a_off[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    b = tl.load(x_col[None, :] + b_off, mask=b_ok, other=0.0)
    acc = _mma(a, b, acc, PRECISION)
  dst = part + split * (tl.num_programs(2) // SPLIT) * M * N + o[:, None] * N + rn[None, :]
  tl.store(dst, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _conv_fwd_cl_kernel(out, x, w, M, N, K, C, D, H, W, OD, OH, OW, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                        x_s0, x_s1, x_s2, x_s3, x_s4, w_s0, w_s1, w_s2, w_s3, w_s4,
                        out_s0, out_s1, out_s2, out_s3, out_s4,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
                        PRECISION: tl.constexpr, IDX64: tl.constexpr, DEPTH: tl.constexpr):
  # channels-last x and w (x_s1 == w_s1 == 1, unused): K steps over (kd, kh, kw, channel block), so a tile's
  # reduction index is a run of channels, contiguous in both operands
  grp = tl.program_id(2)
  rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # output positions (n, od, oh, ow)
  rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output channels of the group
  ow, oh, od, n = _position(rm, OW, OH, OD, DEPTH, IDX64)
  ih0, iw0 = oh * sh - ph, ow * sw - pw
  x_row = x + n * x_s0 + grp * C
  o = grp * N + rn
  if IDX64: o = o.to(tl.int64)
  w_col = w + o * w_s0
  m_ok, n_ok = rm < M, rn < N
  if DEPTH:
    id0 = od * sd - pd
  blocks = tl.cdiv(C, BLOCK_K)
  acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
  for step in range(0, KD * KH * KW * blocks):
    win, c = step // blocks, (step % blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
    kw, r = win % KW, win // KW
    kh, kd = r % KH, r // KH
    ih, iw = ih0 + kh * dh, iw0 + kw * dw
    a_ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    a_off = x_row + ih * x_s3 + iw * x_s4
    b_off = w_col + kh * w_s3 + kw * w_s4
    if DEPTH:
      i_d = id0 + kd * dd
      a_ok = a_ok & (i_d >= 0) & (i_d < D)
      a_off += i_d * x_s2
      b_off += kd * w_s2
    c_ok = c < C
    a = tl.load(a_off[:, None] + c[None, :], mask=a_ok[:, None] & c_ok[None, :], other=0.0)
    b = tl.load(b_off[None, :] + c[:, None], mask=c_ok[:, None] & n_ok[None, :], other=0.0)
    acc = _mma(a, b, acc, PRECISION)
  _store(out, acc, n, od, oh, ow, o, m_ok[:, None] & n_ok[None, :], out_s0, out_s1, out_s2, out_s3, out_s4, DEPTH)


@triton.jit
def _conv_dgrad_cl_kernel(dx, g, w, M, N, K, C, D, H, W, OD, OH, OW, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                          g_s0, g_s1, g_s2, g_s3, g_s4, w_s0, w_s1, w_s2, w_s3, w_s4, dx_s0, dx_s1, dx_s2, dx_s3, dx_s4,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
                          PRECISION: tl.constexpr, IDX64: tl.constexpr, DEPTH: tl.constexpr):
  # channels-last g and w (g_s1 == w_s1 == 1, unused): K steps over (kd, kh, kw, output-channel block); a tile of g
  # is contiguous along its output channels, one of w along its input channels
  grp = tl.program_id(2)
  rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # input positions (n, id, ih, iw)
  rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # input channels of the group
  iw, ih, i_d, n = _position(rm, W, H, D, DEPTH, IDX64)
  g_row = g + n * g_s0 + grp * C
  c = grp * N + rn
  if IDX64: c = c.to(tl.int64)
  w_col = w + grp * C * w_s0 + rn
  m_ok, n_ok = rm < M, rn < N
  blocks = tl.cdiv(C, BLOCK_K)
  acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
  for step in range(0, KD * KH * KW * blocks):
    win, o = step // blocks, (step % blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
    kw, r = win % KW, win // KW
    kh, kd = r % KH, r // KH
    th, tw = ih + ph - kh * dh, iw + pw - kw * dw
    th_ok, tw_ok = th >= 0, tw >= 0
    th, tw = tl.where(th_ok, th, 0), tl.where(tw_ok, tw, 0)
    oh, ow = th // sh, tw // sw
    ok = m_ok & th_ok & tw_ok & (oh * sh == th) & (ow * sw == tw) & (oh < OH) & (ow < OW)
    a_off = g_row + oh * g_s3 + ow * g_s4
    b_off = w_col + kh * w_s3 + kw * w_s4
    if DEPTH:
      td = i_d + pd - kd * dd
      td_ok = td >= 0
      td = tl.where(td_ok, td, 0)
      od = td // sd
      ok = ok & td_ok & (od * sd == td) & (od < OD)
      a_off += od * g_s2
      b_off += kd * w_s2
    o_ok = o < C
    a = tl.load(a_off[:, None] + o[None, :], mask=ok[:, None] & o_ok[None, :], other=0.0)
    b = tl.load(b_off[None, :] + (o * w_s0)[:, None], mask=o_ok[:, None] & n_ok[None, :], other=0.0)
    acc = _mma(a, b, acc, PRECISION)
  _store(dx, acc, n, i_d, ih, iw, c, m_ok[:, None] & n_ok[None, :], dx_s0, dx_s1, dx_s2, dx_s3, dx_s4, DEPTH)


@triton.jit
def _conv_wgrad_cl_kernel(part, g, x, M, N, K, C, D, H, W, OD, OH, OW, KD, KH, KW, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                          g_s0, g_s1, g_s2, g_s3, g_s4, x_s0, x_s1, x_s2, x_s3, x_s4, STEPS, SPLIT,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
                          PRECISION: tl.constexpr, IDX64: tl.constexpr, DEPTH: tl.constexpr):
  # channels-last g and x (g_s1 == x_s1 == 1, unused): a program's columns are one kernel position (kd, kh, kw) and
  # a block of input channels, so its tile of x is contiguous along them and its tile of g along the output
  # channels; part is (SPLIT, groups * M, N) partial sums with columns in (kd, kh, kw, c) order
  grp, split = tl.program_id(2) // SPLIT, tl.program_id(2) % SPLIT
  blocks = tl.cdiv(C, BLOCK_N)
  win = tl.program_id(1) // blocks
  kw, kh, kd = win % KW, win // KW % KH, win // KW // KH
  rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # output channels of the group
  rn = (tl.program_id(1) % blocks) * BLOCK_N + tl.arange(0, BLOCK_N)  # input channels of the group
  o = grp * M + rm
  if IDX64: o = o.to(tl.int64)
  g_row = g + o
  x_col = x + grp * C + rn
  m_ok, n_ok = rm < M, rn < C
  acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
  start = split * STEPS * BLOCK_K
  for step in range(0, STEPS):
    rk = start + step * BLOCK_K + tl.arange(0, BLOCK_K)  # (n, od, oh, ow)
    ow, oh, od, n = _position(rk, OW, OH, OD, DEPTH, IDX64)
    ih, iw = oh * sh - ph + kh * dh, ow * sw - pw + kw * dw
    a_off = n * g_s0 + oh * g_s3 + ow * g_s4
    b_off = n * x_s0 + ih * x_s3 + iw * x_s4
    k_ok = rk < K
    b_ok = k_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    if DEPTH:
      i_d = od * sd - pd + kd * dd
      a_off += od * g_s2
      b_off += i_d * x_s2
      b_ok = b_ok & (i_d >= 0) & (i_d < D)
    a = tl.load(g_row[:, None] + a_off[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    b = tl.load(x_col[None, :] + b_off[:, None], mask=b_ok[:, None] & n_ok[None, :], other=0.0)
    acc = _mma(a, b, acc, PRECISION)
  dst = part + split * (tl.num_programs(2) // SPLIT) * M * N + o[:, None] * N + (win * C + rn)[None, :]
  tl.store(dst, acc, mask=m_ok[:, None] & n_ok[None, :])


_FNS = {("fwd", False): _conv_fwd_kernel, ("dgrad", False): _conv_dgrad_kernel, ("wgrad", False): _conv_wgrad_kernel,
        ("fwd", True): _conv_fwd_cl_kernel, ("dgrad", True): _conv_dgrad_cl_kernel,
        ("wgrad", True): _conv_wgrad_cl_kernel}
_PTRS = {"fwd": ("out", "x", "w"), "dgrad": ("dx", "g", "w"), "wgrad": ("part", "g", "x")}
# scalars of the channels-last variants promised to be multiples of 16 (channel counts of a group; wgrad's M is one)
_ALIGNED = {"fwd": ("C", "N"), "dgrad": ("C", "N"), "wgrad": ("M", "N", "C")}
VECTOR = 16  # channels per group, strides and pointers (bytes) that the channels-last variants need multiples of


def precision(dtype: DType, tf32: bool) -> str:
  """tl.dot's input precision: "ieee" (no tl.dot, see `_mma`) for float64, TF32 for float32 when allowed (else 3xTF32), ignored for halves."""
  if dtype is dtypes.float64: return "ieee"
  return "tf32x3" if dtype is dtypes.float32 and not tf32 else "tf32"


def acc_dtype(dtype: DType) -> DType: return dtypes.float64 if dtype is dtypes.float64 else dtypes.float32


def _runs(kind: str, channels: int) -> tuple[int, int]:
  """conv_schedule's (k_run, n_run) of a variant (0 for the general ones)."""
  return (0, channels) if kind == "wgrad" else (channels, 0)


@functools.lru_cache(maxsize=1024)
def conv_spec(kind: str, dtype: DType, M: int, N: int, K: int, tf32: bool, i64: bool,
              hw: configurator.Hardware = configurator.H200, depth: bool = False, channels: int = 0):
  """The variant of kernel `kind` ("fwd", "dgrad", "wgrad") for an (M, N, K) problem of `dtype`; `depth` for 3-D
  convolutions (1-D and 2-D ones skip the depth dim's index arithmetic). `channels` > 0 picks the channels-last
  variant, whose tiles run along that many channels of a group (fwd: C_in, dgrad: C_out, the reduction's; wgrad:
  C_in, the result's columns); its caller promises unit channel strides and 16-divisible pointers, other strides of
  the operands it reads and channel counts (`plan` checks them)."""
  bm, bn, bk, warps, stages, _ = configurator.conv_schedule(M, N, K, dtype.itemsize, hw, *_runs(kind, channels))
  it, cl = "i64" if i64 else "i32", channels > 0
  first, second, third = _PTRS[kind]
  div = lambda name: ":16" if cl and not name.endswith("_s1") else ""
  sig = {name: ptr(acc_dtype(dtype) if kind == "wgrad" and name == first else dtype) + div(name)
         for name in (first, second, third)}
  sig |= {**dict.fromkeys(["M", "N", "K"] + _GEOMETRY, "i32"), **{n: it + div(n) for n in _strides(second, third)}}
  if cl: sig |= dict.fromkeys(_ALIGNED[kind], "i32:16")
  if kind == "wgrad": sig |= {"STEPS": "i32", "SPLIT": "i32"}
  else: sig |= dict.fromkeys(_strides(first), it)
  return spec(_FNS[kind, cl], sig, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, ACC=TL[acc_dtype(dtype)],
                                        PRECISION=precision(dtype, tf32), IDX64=i64, DEPTH=depth),
              num_warps=warps, num_stages=stages)


def _as3d(shape, strides) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """An array of 1 to 3 spatial dims as one of 3 (a 2-D convolution is a 3-D one of depth 1, a 1-D one also of
  height 1)."""
  pad = 5 - len(shape)
  if not 0 <= pad <= 2:
    raise NotImplementedError(f"CUDA convolution kernels take 1-D, 2-D and 3-D convolutions, got {len(shape) - 2}-D")
  return tuple(shape[:2]) + (1,) * pad + tuple(shape[2:]), tuple(strides[:2]) + (0,) * pad + tuple(strides[2:])


def _unit_channels(shape, strides) -> bool:
  """Whether an operand is channels-last as the vectorized variants read it: unit channel (dim 1) stride, every
  other stride a multiple of VECTOR."""
  return strides[1] == 1 and all(st % VECTOR == 0 for i, st in enumerate(strides) if i != 1)


def vectorizes(dtype: DType, w_shape, groups: int) -> bool:
  """Whether a convolution by a weight of `w_shape` has channels-last variants: a tensor-core dtype (float64 keeps
  the general kernels) and input and output channels per group that are multiples of VECTOR."""
  return dtype in (dtypes.bfloat16, dtypes.float16, dtypes.float32) and w_shape[1] % VECTOR == 0 and \
    (w_shape[0] // groups) % VECTOR == 0


def plan(kind: str, dtype: DType, x, w, out, stride, padding, dilation, groups: int, tf32: bool,
         hw: configurator.Hardware = configurator.H200, aligned: bool = False):
  """(spec, grid, scalar arguments, split, channels_last) of kernel `kind` for the convolution of x by w into out,
  each given as (shape, strides) of the op's N-d arrays: for "fwd" x and w are read and out written, for "dgrad"
  out (g) and w read and x (dx) written, for "wgrad" out (g) and x read into `split` float32 parts of w's shape (w's
  strides unused). With `aligned` (every pointer a multiple of 16 bytes) and the two operands read channels-last
  (`vectorizes` and `_unit_channels`), the channels-last variant (`channels_last`), whose wgrad parts have their
  columns in (kd, kh, kw, c) order rather than w's (c, kd, kh, kw). The kernel takes the pointers in _PTRS's order,
  then these scalars."""
  (xs, xst), (ws, wst), (os_, ost) = _as3d(*x), _as3d(*w), _as3d(*out)
  pad = 3 - len(stride)
  geometry = [*xs[2:], *os_[2:], *ws[2:], *(1,) * pad, *stride, *(0,) * pad, *padding, *(1,) * pad, *dilation]
  i64 = any(needs_i64(sh_, st) for sh_, st in (x, w, out))
  og, kernel = ws[0] // groups, ws[2] * ws[3] * ws[4]
  reads = {"fwd": ((xs, xst), (ws, wst)), "dgrad": ((os_, ost), (ws, wst)), "wgrad": ((os_, ost), (xs, xst))}[kind]
  cl = aligned and vectorizes(dtype, ws, groups) and all(_unit_channels(*a) for a in reads)
  if kind == "fwd": M, N, K, C, strides = xs[0] * math.prod(os_[2:]), og, ws[1] * kernel, ws[1], (*xst, *wst, *ost)
  elif kind == "dgrad": M, N, K, C, strides = xs[0] * math.prod(xs[2:]), ws[1], og * kernel, og, (*ost, *wst, *xst)
  else: M, N, K, C, strides = og, ws[1] * kernel, os_[0] * math.prod(os_[2:]), ws[1], (*ost, *xst)
  s = conv_spec(kind, dtype, M, N, K, tf32, i64, hw, pad == 0, C if cl else 0)
  c = s.constexprs
  cols = kernel * cdiv(C, c["BLOCK_N"]) if cl and kind == "wgrad" else cdiv(N, c["BLOCK_N"])
  grid, args, split = [cdiv(M, c["BLOCK_M"]), cols, groups], [M, N, K, C, *geometry, *strides], 1
  if kind == "wgrad":
    split = configurator.conv_schedule(M, N, K, dtype.itemsize, hw, *_runs(kind, C if cl else 0))[5]
    steps = cdiv(cdiv(K, c["BLOCK_K"]), split)
    split = cdiv(cdiv(K, c["BLOCK_K"]), steps)  # no empty part
    grid[2] *= split
    args += [steps, split]
  return s, tuple(grid), args, split, cl


def _layout(a: CudaArray) -> tuple: return a.shape, a.strides


def _aligned(*arrays: CudaArray) -> bool: return all(a.ptr % VECTOR == 0 for a in arrays)


def _channels_last(a: CudaArray) -> CudaArray:
  """a when the channels-last variants can read it as it is (`_unit_channels`, 16-byte aligned), else such a copy
  (N, C, *spatial) viewed over an (N, *spatial, C) array: one transposing copy costs far less than the general
  kernels' scalar loads."""
  if a.ptr % VECTOR == 0 and _unit_channels(a.shape, a.strides): return a
  buf = empty((a.shape[0], *a.shape[2:], a.shape[1]), a.dtype, a.device)
  return copy(a, out=view(buf, a.shape, (buf.strides[0], 1, *buf.strides[1:-1])))


def padded_channels(dtype: DType, w_shape, groups: int) -> int:
  """The input channels a convolution runs with: C rounded up to a multiple of VECTOR when only C keeps it from the
  channels-last variants (one group, output channels that `vectorizes`: an image's 3 channels), else C. The zero
  channels add K work (7x7x16 against 7x7x3 for a ResNet stem), far less than the general kernels' scalar loads."""
  c = w_shape[1]
  if groups != 1 or c % VECTOR == 0: return c
  c_pad = cdiv(c, VECTOR) * VECTOR
  return c_pad if vectorizes(dtype, (w_shape[0], c_pad), 1) else c


def _pad_channels(a: CudaArray, c: int) -> CudaArray:
  """a (N, C, *spatial) with zero channels appended up to c, channels-last (as the channels-last variants read it)."""
  buf = fill(empty((a.shape[0], *a.shape[2:], c), a.dtype, a.device), 0)
  strides = (buf.strides[0], 1, *buf.strides[1:-1])
  copy(a, out=view(buf, a.shape, strides))
  return view(buf, (a.shape[0], c, *a.shape[2:]), strides)


def _first_channels(a: CudaArray, c: int) -> CudaArray:
  """The first c channels (dim 1) of a, a new contiguous array."""
  return copy(view(a, (a.shape[0], c, *a.shape[2:]), a.strides))


def conv(x: CudaArray, w: CudaArray, stride, padding, dilation, groups: int, tf32: bool = False) -> CudaArray:
  """The convolution of x (N, C, *spatial) with w (C_out, C / groups, *kernel), a new array in x's layout. With channel
  counts that `vectorizes`, x and w are read channels-last (copied so unless they are); a few input channels are
  padded with zeros to such a count (`padded_channels`). cuDNN runs it instead where `cudnn_conv.takes` it."""
  if cudnn_conv.takes(x.dtype, groups, tf32, x, w): return cudnn_conv.conv(x, w, stride, padding, dilation)
  out_sp = [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in zip(x.shape[2:], w.shape[2:], stride, padding,
                                                                               dilation)]
  out = empty_like(x, shape=(x.shape[0], w.shape[0], *out_sp))
  c = padded_channels(x.dtype, w.shape, groups)
  if c != w.shape[1] and x.size and w.size: x, w = _pad_channels(x, c), _pad_channels(w, c)
  if out.size == 0: return out
  if x.size == 0 or w.size == 0: return fill(out, 0)
  if vectorizes(x.dtype, w.shape, groups): x, w = _channels_last(x), _channels_last(w)
  s, grid, args, _, _ = plan("fwd", x.dtype, _layout(x), _layout(w), _layout(out), stride, padding, dilation, groups,
                             tf32, runtime.hardware(x.device), _aligned(out, x, w))
  run(s, grid, out.ptr, x.ptr, w.ptr, *args)
  return out


def conv_grad_input(g: CudaArray, w: CudaArray, shape, stride, padding, dilation, groups: int,
                    tf32: bool = False) -> CudaArray:
  """conv's gradient for an input of `shape`: the transposed convolution of g (N, C_out, *out) with w, a new array
  in g's layout (g and w read channels-last as in `conv`; or cuDNN's, as there)."""
  if cudnn_conv.takes(g.dtype, groups, tf32, g, w):
    return cudnn_conv.conv_grad_input(g, w, shape, stride, padding, dilation)
  c = padded_channels(g.dtype, w.shape, groups)
  if c != w.shape[1] and g.size and w.size:
    dx = conv_grad_input(g, _pad_channels(w, c), (shape[0], c, *shape[2:]), stride, padding, dilation, groups, tf32)
    return _first_channels(dx, shape[1])
  dx = empty_like(g, shape=shape)
  if dx.size == 0: return dx
  if g.size == 0 or w.size == 0: return fill(dx, 0)
  if vectorizes(g.dtype, w.shape, groups): g, w = _channels_last(g), _channels_last(w)
  s, grid, args, _, _ = plan("dgrad", g.dtype, _layout(dx), _layout(w), _layout(g), stride, padding, dilation, groups,
                             tf32, runtime.hardware(g.device), _aligned(dx, g, w))
  run(s, grid, dx.ptr, g.ptr, w.ptr, *args)
  return dx


def conv_grad_weight(g: CudaArray, x: CudaArray, shape, stride, padding, dilation, groups: int,
                     tf32: bool = False) -> CudaArray:
  """conv's gradient for a weight of `shape`: g (N, C_out, *out) correlated with x, summed over split parts (g and
  x read channels-last as in `conv`; unlike `conv`'s, a few input channels are not padded: the channels-last wgrad's
  column tiles stop at a kernel position, so a padded 7x7 stem reads g 49 times, 3.9 ms against the general kernel's
  3.5 ms on the H200; or cuDNN's, as in `conv`). A new array, channels-last for a channels-last x, as cuDNN's."""
  if cudnn_conv.takes(g.dtype, groups, tf32, g, x):
    return cudnn_conv.conv_grad_weight(g, x, shape, stride, padding, dilation)
  dw = empty_suggested(x, g.dtype, shape)  # as cuDNN's (cudnn_conv.conv_grad_weight)
  if dw.size == 0: return dw
  if g.size == 0 or x.size == 0: return fill(dw, 0)
  if vectorizes(g.dtype, shape, groups): g, x = _channels_last(g), _channels_last(x)
  s, grid, args, split, cl = plan("wgrad", g.dtype, _layout(x), _layout(dw), _layout(g), stride, padding, dilation,
                                  groups, tf32, runtime.hardware(g.device), _aligned(g, x))
  part = empty((split, shape[0], dw.size // shape[0]), acc_dtype(g.dtype), g.device)
  run(s, grid, part.ptr, g.ptr, x.ptr, *args)
  total = part if split == 1 else reduce(part, (0,), False, "sum", part.dtype)
  # the channels-last variant's columns are (*kernel, c): view them in w's (c, *kernel) order
  inner = contiguous_strides((*shape[2:], shape[1]))
  rows = (dw.size // shape[0], 1, *inner[:-1]) if cl else contiguous_strides(tuple(shape))
  copy(view(total, dw.shape, rows), out=dw)
  return dw


KERNELS = {"conv": conv, "conv_grad_input": conv_grad_input, "conv_grad_weight": conv_grad_weight}


def _specs() -> list:
  f32, bf16, f16, f64 = dtypes.float32, dtypes.bfloat16, dtypes.float16, dtypes.float64
  out = []
  for kind, (M, N, K) in (("fwd", (128 * 56 * 56, 64, 576)), ("dgrad", (128 * 56 * 56, 64, 576)),
                          ("wgrad", (64, 576, 128 * 56 * 56))):
    out += [conv_spec(kind, bf16, M, N, K, True, False), conv_spec(kind, f16, 1000, 3, 27, True, False),
            conv_spec(kind, f32, M, N, K, True, False), conv_spec(kind, f32, 50, 10, 7, False, True),
            conv_spec(kind, f64, 50, 10, 7, False, False)]
    out += [conv_spec(kind, bf16, M, N, K, True, False, depth=True),  # 3-D
            conv_spec(kind, f32, 50, 10, 7, False, True, depth=True),
            conv_spec(kind, f64, 50, 10, 7, False, False, depth=True)]
    small = (16, 144, 1000) if kind == "wgrad" else (1000, 16, 144)  # 16 channels, 3x3
    out += [conv_spec(kind, bf16, M, N, K, True, False, channels=64),  # channels-last
            conv_spec(kind, f32, M, N, K, True, False, channels=64),
            conv_spec(kind, f16, *small, True, True, channels=16),
            conv_spec(kind, f32, *small, False, False, depth=True, channels=16),
            conv_spec(kind, bf16, M, N, K, True, True, depth=True, channels=64)]
  return out


SPECS = _specs()
