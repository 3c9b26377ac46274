"""max_pool2d's three kernels, each one pass in the memory order of what it writes (NCHW, or channels-last when its
input is): `max_pool2d_indices` finds each window's maximum's flat position in H * W (each output reading its KH x KW
window of x, any strides) as PyTorch's kernels pick it (the first of equal maxima, the last NaN, padding never), and
as `max_pool2d_with_indices` (which Nova makes of the two ops) stores the maximum too; `max_pool2d_values` reads x
there; `max_pool2d_backward` gives each input position the sum of g over the windows
whose maximum it is (it visits only the windows that can hold it, found by one division per row: no atomics, no
zero-filled buffer). The window search and the gradient walk tiles of rows (positions channels-last, else (n, c, h))
by columns (channels, else w), so the divisions that locate an element are per row (`tile_schedule`); the values'
read is flat (`flat_schedule`)."""
from __future__ import annotations

import functools

import triton
import triton.language as tl

from blutrain import dtypes
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import TL, aligned, divisible, empty_ordered, needs_i64, ptr, run, spec
from blutrain.backend.cuda.kernels.copy import copy
from blutrain.configurator import flat_schedule, tile_schedule
from blutrain.dtypes import DType
from blutrain.shapes import cdiv, memory_order

CHANNELS_LAST = (0, 2, 3, 1)  # the memory order of an (N, C, H, W) array stored (N, H, W, C)


@triton.jit
def _flat(n, BLOCK: tl.constexpr, IDX64: tl.constexpr):
  """This program's flat positions in the array it writes, and which of them exist."""
  start = tl.program_id(0)
  if IDX64: start = start.to(tl.int64)
  o = start * BLOCK + tl.arange(0, BLOCK)
  return o, o < n


@triton.jit
def _nchw(o, C, H, W, CHANNELS_LAST: tl.constexpr):
  """(n, c, h, w) of flat positions o in the memory of an (N, C, H, W) array: (n, c, h, w) order, or (n, h, w, c)
  channels-last (then neighbouring lanes touch neighbouring channels)."""
  if CHANNELS_LAST:
    c, t = o % C, o // C
    w, t = t % W, t // W
    h, b = t % H, t // H
  else:
    w, t = o % W, o // W
    h, t = t % H, t // H
    c, b = t % C, t // C
  return b, c, h, w


@triton.jit
def _tile(P, Q, C, H, W, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, IDX64: tl.constexpr,
          CHANNELS_LAST: tl.constexpr):
  """This program's BLOCK_P x BLOCK_Q tile of an (N, C, H, W) array held densely in memory as P rows of Q: rows
  (n, h, w) and columns c channels-last, rows (n, c, h) and columns w otherwise. Returns the flat offsets, which
  exist, and (n, c, h, w), each a row or a column vector: the divisions are per row, not per element."""
  p = tl.program_id(0)
  if IDX64: p = p.to(tl.int64)
  p = p * BLOCK_P + tl.arange(0, BLOCK_P)[:, None]
  q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)[None, :]
  if CHANNELS_LAST:
    c, w, t = q, p % W, p // W
    h, b = t % H, t // H
  else:
    w, h, t = q, p % H, p // H
    c, b = t % C, t // C
  return p * Q + q, (p < P) & (q < Q), b, c, h, w


@triton.jit
def _max_pool2d_indices_kernel(out, values, x, P, Q, C, OH, OW, H, W, KH, KW, sh, sw, ph, pw, dh, dw, xs0, xs1, xs2,
                               xs3, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, IDX64: tl.constexpr,
                               CHANNELS_LAST: tl.constexpr, C_UNIT: tl.constexpr, VALUES: tl.constexpr):
  # C_UNIT: channels at unit stride (channels-last); with the other strides promised multiples of 16, 16-byte vectors.
  # VALUES: the maxima also stored, into `values` laid out as out
  o, ok, b, c, oh, ow = _tile(P, Q, C, OH, OW, BLOCK_P, BLOCK_Q, IDX64, CHANNELS_LAST)
  base = x + b * xs0 + (c if C_UNIT else c * xs1)
  best = tl.zeros([BLOCK_P, BLOCK_Q], x.dtype.element_ty)
  best_i = tl.full([BLOCK_P, BLOCK_Q], -1, tl.int64)
  for kh in range(KH):
    ih = oh * sh - ph + kh * dh
    for kw in range(KW):
      iw = ow * sw - pw + kw * dw
      inside = ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
      v = tl.load(base + ih * xs2 + iw * xs3, mask=inside, other=0)
      take = inside & ((best_i < 0) | (v > best) | (v != v))
      best = tl.where(take, v, best)
      best_i = tl.where(take, (ih * W + iw).to(tl.int64), best_i)
  tl.store(out + o, best_i, mask=ok)
  if VALUES:
    tl.store(values + o, best, mask=ok)


@triton.jit
def _max_pool2d_values_kernel(out, x, idx, n, C, OH, OW, W, xs0, xs1, xs2, xs3, BLOCK: tl.constexpr,
                              IDX64: tl.constexpr, CHANNELS_LAST: tl.constexpr):
  # out and idx share one dense layout: o is the same element of both
  o, ok = _flat(n, BLOCK, IDX64)
  b, c, _, _ = _nchw(o, C, OH, OW, CHANNELS_LAST)
  i = tl.load(idx + o, mask=ok, other=0)
  tl.store(out + o, tl.load(x + b * xs0 + c * xs1 + (i // W) * xs2 + (i % W) * xs3, mask=ok), mask=ok)


@triton.jit
def _max_pool2d_backward_kernel(dx, g, idx, P, Q, C, H, W, OH, OW, RH, RW, sh, sw, ph, pw, gs0, gs1, gs2, gs3,
                                is0, is1, is2, is3, ACC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
                                IDX64: tl.constexpr, CHANNELS_LAST: tl.constexpr, C_UNIT: tl.constexpr):
  # the windows that can hold row h are oh = (h + ph) // sh - r for r < RH (RH = (KH - 1) * dh // sh + 1); one whose
  # maximum is at (h, w) holds it, so comparing the index is the whole test (a dilated window that skips h never hits)
  o, ok, b, c, h, w = _tile(P, Q, C, H, W, BLOCK_P, BLOCK_Q, IDX64, CHANNELS_LAST)
  me = h * W + w
  oh_last, ow_last = (h + ph) // sh, (w + pw) // sw
  g_base = g + b * gs0 + (c if C_UNIT else c * gs1)
  i_base = idx + b * is0 + (c if C_UNIT else c * is1)
  acc = tl.zeros([BLOCK_P, BLOCK_Q], ACC)
  for r in range(RH):
    oh = oh_last - r
    row_ok = ok & (oh >= 0) & (oh < OH)
    for s in range(RW):
      ow = ow_last - s
      inside = row_ok & (ow >= 0) & (ow < OW)
      hit = tl.load(i_base + oh * is2 + ow * is3, mask=inside, other=-1) == me
      gv = tl.load(g_base + oh * gs2 + ow * gs3, mask=inside, other=0)  # masked by window, not by hit: vectors
      acc += tl.where(hit, gv.to(ACC), 0.0)
  tl.store(dx + o, acc.to(dx.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=4096)
def max_pool2d_indices_spec(dtype: DType, rows: int, cols: int, i64: bool, channels_last: bool = False,
                            vectors: bool = False, values: bool = False):
  """The window search's variant for an output of `rows` x `cols` in memory (`tiles`) of an input of `dtype`;
  `vectors` (channels-last only, `unit_channels`): 16-byte loads and stores along the channels; `values`: the maxima
  stored too."""
  block_p, block_q, warps = tile_schedule(rows, cols)
  it = "i64" if i64 else "i32"
  sig = {"out": "*i64", "values": ptr(dtype), "x": ptr(dtype),
         **dict.fromkeys(("P", "Q", "C", "OH", "OW", "H", "W", "KH", "KW", "sh", "sw", "ph", "pw", "dh", "dw", "xs0",
                          "xs1", "xs2", "xs3"), it)}
  if vectors: sig = divisible(sig, ("out", "x", "Q", "xs0", "xs2", "xs3") + (("values",) if values else ()))
  return spec(_max_pool2d_indices_kernel, sig, dict(BLOCK_P=block_p, BLOCK_Q=block_q, IDX64=i64,
                                                    CHANNELS_LAST=channels_last, C_UNIT=vectors, VALUES=values),
              num_warps=warps)


def tiles(shape: tuple[int, ...], channels_last: bool) -> tuple[int, int]:
  """(rows, cols) of a dense (N, C, H, W) array as `_tile` walks it: (N * H * W, C) channels-last, else (N * C * H, W)."""
  n, c, h, w = shape
  return (n * h * w, c) if channels_last else (n * c * h, w)


def grid(s, rows: int, cols: int) -> tuple[int, int]:
  """The launch grid of a tiled variant over rows x cols."""
  return cdiv(rows, s.constexprs["BLOCK_P"]), cdiv(cols, s.constexprs["BLOCK_Q"])


def windows_per_position(kernel: int, stride: int, dilation: int) -> int:
  """How many windows along one dim can hold a given input position: those starting within its window's extent."""
  return (kernel - 1) * dilation // stride + 1


def unit_channels(arrays) -> bool:
  """Whether (N, C, H, W) arrays all hold their channels at unit stride with 16-byte aligned starts and every other
  stride a multiple of 16 (channels-last with C a multiple of 16): the 16-byte vector variants' promise."""
  return all(a.strides[1] == 1 for a in arrays) and \
    aligned(arrays, [st for a in arrays for i, st in enumerate(a.strides) if i != 1] + [arrays[0].shape[1]])


def _order(a: CudaArray) -> tuple[int, ...] | None:
  """CHANNELS_LAST when a is stored so, else None (row-major)."""
  return CHANNELS_LAST if memory_order(a.shape, a.strides) == CHANNELS_LAST else None


def _window_search(x: CudaArray, kernel, stride, padding, dilation, out_size, values: bool):
  """The indices (N, C, *out_size), channels-last when x is (as PyTorch's max_pool2d keeps the memory format), else
  contiguous, and with `values` the maxima in the same layout (else None)."""
  order = _order(x)
  out = empty_ordered((*x.shape[:2], *out_size), dtypes.int64, x.device, order)
  vals = empty_ordered(out.shape, x.dtype, x.device, order) if values else None
  if out.size == 0: return out, vals
  rows, cols = tiles(out.shape, order is not None)
  s = max_pool2d_indices_spec(x.dtype, rows, cols, needs_i64(x.shape, x.strides) or needs_i64(out.shape, out.strides),
                              order is not None, order is not None and unit_channels([x, out]), values)
  run(s, grid(s, rows, cols), out.ptr, (vals or x).ptr, x.ptr, rows, cols, x.shape[1], *out_size, *x.shape[2:],
      *kernel, *stride, *padding, *dilation, *x.strides)
  return out, vals


def max_pool2d_indices(x: CudaArray, kernel, stride, padding, dilation, out_size) -> CudaArray:
  """The indices (N, C, *out_size), channels-last when x is, else contiguous."""
  return _window_search(x, kernel, stride, padding, dilation, out_size, False)[0]


def max_pool2d_with_indices(x: CudaArray, kernel, stride, padding, dilation, out_size) -> tuple[CudaArray, CudaArray]:
  """(the maxima, their indices), one pass over x, both laid out as `max_pool2d_indices` lays out the indices."""
  idx, vals = _window_search(x, kernel, stride, padding, dilation, out_size, True)
  return vals, idx


@functools.lru_cache(maxsize=4096)
def max_pool2d_values_spec(dtype: DType, n: int, i64: bool, channels_last: bool):
  """The read of n values of `dtype` at their indices, laid out NCHW or channels-last like the indices."""
  block, warps = flat_schedule(n, 8)
  it = "i64" if i64 else "i32"
  sig = {"out": ptr(dtype), "x": ptr(dtype), "idx": "*i64",
         **dict.fromkeys(("n", "C", "OH", "OW", "W", "xs0", "xs1", "xs2", "xs3"), it)}
  return spec(_max_pool2d_values_kernel, sig, dict(BLOCK=block, IDX64=i64, CHANNELS_LAST=channels_last),
              num_warps=warps)


@functools.lru_cache(maxsize=4096)
def max_pool2d_backward_spec(dtype: DType, rows: int, cols: int, i64: bool, channels_last: bool,
                             vectors: bool = False):
  """The gradient's variant for an input of `rows` x `cols` in memory of `dtype` (sums in float32, float64 for
  float64); `vectors` as the window search's."""
  block_p, block_q, warps = tile_schedule(rows, cols)
  it = "i64" if i64 else "i32"
  names = ("P", "Q", "C", "H", "W", "OH", "OW", "RH", "RW", "sh", "sw", "ph", "pw",
           *(f"gs{i}" for i in range(4)), *(f"is{i}" for i in range(4)))
  sig = {"dx": ptr(dtype), "g": ptr(dtype), "idx": "*i64", **dict.fromkeys(names, it)}
  acc = TL[dtypes.float64 if dtype is dtypes.float64 else dtypes.float32]
  if vectors: sig = divisible(sig, ("dx", "g", "idx", "Q", "gs0", "gs2", "gs3", "is0", "is2", "is3"))
  return spec(_max_pool2d_backward_kernel, sig,
              dict(ACC=acc, BLOCK_P=block_p, BLOCK_Q=block_q, IDX64=i64, CHANNELS_LAST=channels_last, C_UNIT=vectors),
              num_warps=warps)


def max_pool2d_values(x: CudaArray, idx: CudaArray, **geometry) -> CudaArray:
  """x at idx's positions, in idx's layout (idx copied contiguous unless it is so or channels-last)."""
  order = _order(idx)
  if order is None and not idx.is_contiguous(): idx = copy(idx)
  out = empty_ordered(idx.shape, x.dtype, x.device, order)
  if out.size == 0: return out
  s = max_pool2d_values_spec(x.dtype, out.size, needs_i64(x.shape, x.strides) or needs_i64(out.shape, out.strides),
                             order is not None)
  run(s, (cdiv(out.size, s.constexprs["BLOCK"]),), out.ptr, x.ptr, idx.ptr, out.size, *idx.shape[1:], x.shape[3],
      *x.strides)
  return out


def max_pool2d_backward(g: CudaArray, idx: CudaArray, size, kernel, stride, padding, dilation) -> CudaArray:
  """The input's gradient (N, C, *size), channels-last when idx is, else contiguous."""
  order = _order(idx)
  dx = empty_ordered((*g.shape[:2], *size), g.dtype, g.device, order)
  if dx.size == 0: return dx
  rows, cols = tiles(dx.shape, order is not None)
  s = max_pool2d_backward_spec(g.dtype, rows, cols, any(needs_i64(a.shape, a.strides) for a in (dx, g, idx)),
                               order is not None, order is not None and unit_channels([dx, g, idx]))
  run(s, grid(s, rows, cols), dx.ptr, g.ptr, idx.ptr, rows, cols, g.shape[1], *size, *g.shape[2:],
      *map(windows_per_position, kernel, stride, dilation), *stride, *padding, *g.strides, *idx.strides)
  return dx


KERNELS = {"max_pool2d_indices": max_pool2d_indices, "max_pool2d_values": max_pool2d_values,
           "max_pool2d_backward": max_pool2d_backward, "max_pool2d_with_indices": max_pool2d_with_indices}
SPECS = [max_pool2d_indices_spec(t, 1 << 16, 64, False) for t in (dtypes.bfloat16, dtypes.float16, dtypes.float32,
                                                                 dtypes.int64)] + \
  [max_pool2d_indices_spec(dtypes.float64, 64, 7, True),
   max_pool2d_indices_spec(dtypes.bfloat16, 1 << 16, 64, False, True),
   max_pool2d_indices_spec(dtypes.bfloat16, 1 << 16, 64, False, True, True),
   max_pool2d_indices_spec(dtypes.float32, 1 << 16, 56, False, False, False, True),
   max_pool2d_indices_spec(dtypes.bfloat16, 1 << 16, 64, False, True, True, True)] + \
  [max_pool2d_values_spec(t, 1 << 22, False, cl) for t in (dtypes.bfloat16, dtypes.float32) for cl in (False, True)] + \
  [max_pool2d_backward_spec(t, 1 << 16, 112, False, cl) for t in (dtypes.bfloat16, dtypes.float32)
   for cl in (False, True)] + [max_pool2d_backward_spec(dtypes.bfloat16, 1 << 16, 64, False, True, True)] + \
  [max_pool2d_values_spec(dtypes.float64, 64, True, False), max_pool2d_backward_spec(dtypes.float64, 64, 7, True, False)]
