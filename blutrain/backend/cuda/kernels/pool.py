"""Pooling's window search: `max_pool2d_indices`, each window's maximum's flat position in H * W, one pass over the
output elements, each reading its KH x KW window (any strides of x); max_pool2d gathers its values there and its
gradient scatters back to them (the op library's gather). Maxima as PyTorch's kernels pick them: the first of equal
maxima, the last NaN, padding never. The block size is the configurator's `flat_schedule` for the int64 output."""
from __future__ import annotations

import functools

import triton
import triton.language as tl

from blutrain import dtypes
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import empty_ordered, needs_i64, ptr, run, spec
from blutrain.configurator import flat_schedule
from blutrain.dtypes import DType
from blutrain.shapes import cdiv, memory_order

CHANNELS_LAST = (0, 2, 3, 1)  # the memory order of an (N, C, H, W) array stored (N, H, W, C)


@triton.jit
def _max_pool2d_indices_kernel(out, x, n, C, OH, OW, H, W, KH, KW, sh, sw, ph, pw, dh, dw, xs0, xs1, xs2, xs3,
                               BLOCK: tl.constexpr, IDX64: tl.constexpr, CHANNELS_LAST: tl.constexpr):
  # o walks out's memory: (n, c, oh, ow), or (n, oh, ow, c) channels-last (neighbouring lanes read neighbouring
  # channels of a channels-last x)
  start = tl.program_id(0)
  if IDX64: start = start.to(tl.int64)
  o = start * BLOCK + tl.arange(0, BLOCK)
  ok = o < n
  if CHANNELS_LAST:
    c, t = o % C, o // C
    ow, t = t % OW, t // OW
    oh, b = t % OH, t // OH
  else:
    ow, t = o % OW, o // OW
    oh, t = t % OH, t // OH
    c, b = t % C, t // C
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


@functools.lru_cache(maxsize=4096)
def max_pool2d_indices_spec(dtype: DType, n: int, i64: bool, channels_last: bool = False):
  """The window search's variant for n output elements of an input of `dtype`, written NCHW or channels-last."""
  block, warps = flat_schedule(n, 8)
  it = "i64" if i64 else "i32"
  sig = {"out": "*i64", "x": ptr(dtype), **dict.fromkeys(("n", "C", "OH", "OW", "H", "W", "KH", "KW", "sh", "sw", "ph",
                                                            "pw", "dh", "dw", "xs0", "xs1", "xs2", "xs3"), it)}
  return spec(_max_pool2d_indices_kernel, sig, dict(BLOCK=block, IDX64=i64, CHANNELS_LAST=channels_last),
              num_warps=warps)


def max_pool2d_indices(x: CudaArray, kernel, stride, padding, dilation, out_size) -> CudaArray:
  """The indices (N, C, *out_size), channels-last when x is (as PyTorch's max_pool2d keeps the memory format), else
  contiguous."""
  cl = memory_order(x.shape, x.strides) == CHANNELS_LAST
  out = empty_ordered((*x.shape[:2], *out_size), dtypes.int64, x.device, CHANNELS_LAST if cl else None)
  if out.size == 0: return out
  s = max_pool2d_indices_spec(x.dtype, out.size, needs_i64(x.shape, x.strides) or needs_i64(out.shape, out.strides),
                              cl)
  run(s, (cdiv(out.size, s.constexprs["BLOCK"]),), out.ptr, x.ptr, out.size, x.shape[1], *out_size, *x.shape[2:],
      *kernel, *stride, *padding, *dilation, *x.strides)
  return out


KERNELS = {"max_pool2d_indices": max_pool2d_indices}
SPECS = [max_pool2d_indices_spec(t, 1 << 22, False) for t in (dtypes.bfloat16, dtypes.float16, dtypes.float32,
                                                              dtypes.int64)] + \
  [max_pool2d_indices_spec(dtypes.float64, 64, True), max_pool2d_indices_spec(dtypes.bfloat16, 1 << 22, False, True)]
