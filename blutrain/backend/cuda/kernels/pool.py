"""max_pool2d's three kernels, each one pass in the memory order of what it writes (NCHW, or channels-last when its
input is): `max_pool2d_indices` finds each window's maximum's flat position in H * W (each output reading its KH x KW
window of x, any strides) as PyTorch's kernels pick it (the first of equal maxima, the last NaN, padding never);
`max_pool2d_values` reads x there; `max_pool2d_backward` gives each input position the sum of g over the windows
whose maximum it is (it visits the KH x KW windows that can hold it: no atomics, no zero-filled buffer). Block sizes
are the configurator's `flat_schedule`."""
from __future__ import annotations

import functools

import triton
import triton.language as tl

from blutrain import dtypes
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import TL, empty_ordered, needs_i64, ptr, run, spec
from blutrain.backend.cuda.kernels.copy import copy
from blutrain.configurator import flat_schedule
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
def _max_pool2d_indices_kernel(out, x, n, C, OH, OW, H, W, KH, KW, sh, sw, ph, pw, dh, dw, xs0, xs1, xs2, xs3,
                               BLOCK: tl.constexpr, IDX64: tl.constexpr, CHANNELS_LAST: tl.constexpr):
  o, ok = _flat(n, BLOCK, IDX64)
  b, c, oh, ow = _nchw(o, C, OH, OW, CHANNELS_LAST)
  base = x + b * xs0 + c * xs1
  best = tl.zeros([BLOCK], x.dtype.element_ty)
  best_i = tl.full([BLOCK], -1, tl.int64)
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


@triton.jit
def _max_pool2d_values_kernel(out, x, idx, n, C, OH, OW, W, xs0, xs1, xs2, xs3, BLOCK: tl.constexpr,
                              IDX64: tl.constexpr, CHANNELS_LAST: tl.constexpr):
  # out and idx share one dense layout: o is the same element of both
  o, ok = _flat(n, BLOCK, IDX64)
  b, c, _, _ = _nchw(o, C, OH, OW, CHANNELS_LAST)
  i = tl.load(idx + o, mask=ok, other=0)
  tl.store(out + o, tl.load(x + b * xs0 + c * xs1 + (i // W) * xs2 + (i % W) * xs3, mask=ok), mask=ok)


@triton.jit
def _max_pool2d_backward_kernel(dx, g, idx, n, C, H, W, OH, OW, KH, KW, sh, sw, ph, pw, dh, dw, gs0, gs1, gs2, gs3,
                                is0, is1, is2, is3, ACC: tl.constexpr, BLOCK: tl.constexpr, IDX64: tl.constexpr,
                                CHANNELS_LAST: tl.constexpr):
  o, ok = _flat(n, BLOCK, IDX64)
  b, c, h, w = _nchw(o, C, H, W, CHANNELS_LAST)
  me = h * W + w
  acc = tl.zeros([BLOCK], ACC)
  for kh in range(KH):  # the windows (oh, ow) whose kh-th row and kw-th column is (h, w)
    th = h + ph - kh * dh
    th_ok = th >= 0
    th = tl.where(th_ok, th, 0)
    oh = th // sh
    row_ok = ok & th_ok & (oh * sh == th) & (oh < OH)
    for kw in range(KW):
      tw = w + pw - kw * dw
      tw_ok = tw >= 0
      tw = tl.where(tw_ok, tw, 0)
      ow = tw // sw
      inside = row_ok & tw_ok & (ow * sw == tw) & (ow < OW)
      hit = inside & (tl.load(idx + b * is0 + c * is1 + oh * is2 + ow * is3, mask=inside, other=-1) == me)
      acc += tl.load(g + b * gs0 + c * gs1 + oh * gs2 + ow * gs3, mask=hit, other=0).to(ACC)
  tl.store(dx + o, acc.to(dx.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=4096)
def max_pool2d_indices_spec(dtype: DType, n: int, i64: bool, channels_last: bool = False):
  """The window search's variant for n output elements of an input of `dtype`, written NCHW or channels-last."""
  block, warps = flat_schedule(n, 8)
  it = "i64" if i64 else "i32"
  sig = {"out": "*i64", "x": ptr(dtype), **dict.fromkeys(("n", "C", "OH", "OW", "H", "W", "KH", "KW", "sh", "sw", "ph",
                                                            "pw", "dh", "dw", "xs0", "xs1", "xs2", "xs3"), it)}
  return spec(_max_pool2d_indices_kernel, sig, dict(BLOCK=block, IDX64=i64, CHANNELS_LAST=channels_last),
              num_warps=warps)


def _order(a: CudaArray) -> tuple[int, ...] | None:
  """CHANNELS_LAST when a is stored so, else None (row-major)."""
  return CHANNELS_LAST if memory_order(a.shape, a.strides) == CHANNELS_LAST else None


def max_pool2d_indices(x: CudaArray, kernel, stride, padding, dilation, out_size) -> CudaArray:
  """The indices (N, C, *out_size), channels-last when x is (as PyTorch's max_pool2d keeps the memory format), else
  contiguous."""
  order = _order(x)
  out = empty_ordered((*x.shape[:2], *out_size), dtypes.int64, x.device, order)
  if out.size == 0: return out
  s = max_pool2d_indices_spec(x.dtype, out.size, needs_i64(x.shape, x.strides) or needs_i64(out.shape, out.strides),
                              order is not None)
  run(s, (cdiv(out.size, s.constexprs["BLOCK"]),), out.ptr, x.ptr, out.size, x.shape[1], *out_size, *x.shape[2:],
      *kernel, *stride, *padding, *dilation, *x.strides)
  return out


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
def max_pool2d_backward_spec(dtype: DType, n: int, i64: bool, channels_last: bool):
  """The gradient's variant for n input positions of `dtype` (sums in float32, float64 for float64)."""
  block, warps = flat_schedule(n, 8)
  it = "i64" if i64 else "i32"
  names = ("n", "C", "H", "W", "OH", "OW", "KH", "KW", "sh", "sw", "ph", "pw", "dh", "dw",
           *(f"gs{i}" for i in range(4)), *(f"is{i}" for i in range(4)))
  sig = {"dx": ptr(dtype), "g": ptr(dtype), "idx": "*i64", **dict.fromkeys(names, it)}
  acc = TL[dtypes.float64 if dtype is dtypes.float64 else dtypes.float32]
  return spec(_max_pool2d_backward_kernel, sig, dict(ACC=acc, BLOCK=block, IDX64=i64, CHANNELS_LAST=channels_last),
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
  i64 = any(needs_i64(a.shape, a.strides) for a in (dx, g, idx))
  s = max_pool2d_backward_spec(g.dtype, dx.size, i64, order is not None)
  run(s, (cdiv(dx.size, s.constexprs["BLOCK"]),), dx.ptr, g.ptr, idx.ptr, dx.size, g.shape[1], *size, *g.shape[2:],
      *kernel, *stride, *padding, *dilation, *g.strides, *idx.strides)
  return dx


KERNELS = {"max_pool2d_indices": max_pool2d_indices, "max_pool2d_values": max_pool2d_values,
           "max_pool2d_backward": max_pool2d_backward}
SPECS = [max_pool2d_indices_spec(t, 1 << 22, False) for t in (dtypes.bfloat16, dtypes.float16, dtypes.float32,
                                                              dtypes.int64)] + \
  [max_pool2d_indices_spec(dtypes.float64, 64, True),
   max_pool2d_indices_spec(dtypes.bfloat16, 1 << 22, False, True)] + \
  [f(t, 1 << 22, False, cl) for f in (max_pool2d_values_spec, max_pool2d_backward_spec)
   for t in (dtypes.bfloat16, dtypes.float32) for cl in (False, True)] + \
  [f(dtypes.float64, 64, True, False) for f in (max_pool2d_values_spec, max_pool2d_backward_spec)]
