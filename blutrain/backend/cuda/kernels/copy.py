"""Copies: strided -> contiguous (`copy`), strided -> strided with broadcast and dtype conversion (`copy_into`, which
the runtime uses for in-place writes and `.contiguous()`), `cast` between every pair of dtypes, and `cat`.

All of them are the elementwise "copy" op (elementwise.py): the store converts to the destination's dtype as numpy's
astype does (floats to ints truncate toward zero, anything to bool is `!= 0`), and the tiled kernel walks any layout.
"""
from __future__ import annotations

from blutrain import dtypes
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import empty, empty_like, view
from blutrain.backend.cuda.kernels.elementwise import flat_spec, launch, tiled_spec
from blutrain.backend.cuda import memory
from blutrain.backend.cuda.memory import overlaps
from blutrain.dtypes import DType


def copy_into(dst: CudaArray, src: CudaArray) -> None:
  """dst[...] = src, src broadcast to dst's shape and converted to dst's dtype; both any strided layout."""
  copy(src, out=dst)


def copy(x: CudaArray, out: CudaArray | None = None) -> CudaArray:
  """A contiguous copy of x, or x written into `out` (any layout, x broadcast to it and converted to its dtype). A
  source that overlaps `out` is first copied out, so the result is as if it were read before any write."""
  if out is None: return launch("copy", empty(x.shape, x.dtype, x.device), x)
  return launch("copy", out, copy(x) if overlaps(out, x) else x)


memory.strided_copy = copy  # the runtime's copies that a memcpy cannot do


def cast(x: CudaArray, dtype: DType) -> CudaArray:
  """x converted to dtype, contiguous."""
  return launch("copy", empty(x.shape, dtype, x.device), x)


def cat(*xs: CudaArray, dim: int) -> CudaArray:
  """Concatenation along dim: one strided copy into a slice of the output per input, except for an input already
  there (a compiled step's memory plan computes a cat's inputs in its output: `nova.memory`)."""
  shape = list(xs[0].shape)
  shape[dim] = sum(x.shape[dim] for x in xs)
  out = empty(shape, xs[0].dtype, xs[0].device)
  start = 0
  for x in xs:
    dst = view(out, x.shape, out.strides, start * out.strides[dim])
    if (dst.ptr, dst.strides, dst.dtype) != (x.ptr, x.strides, x.dtype): copy(x, out=dst)
    start += x.shape[dim]
  return out


def to_dtype(x: CudaArray, dtype: DType) -> CudaArray:
  """The `cast` op (`Tensor.to(dtype)`): x converted to dtype in x's dense layout (channels-last stays channels-last,
  as PyTorch's `to` keeps the memory format); `cast` above, for the kernels' own use, is always contiguous."""
  return launch("copy", empty_like(x, dtype), x)


KERNELS = {"copy": copy, "cast": to_dtype, "cat": cat}

_CASTS = (dtypes.bool_, dtypes.uint8, dtypes.int8, dtypes.int16, dtypes.int32, dtypes.int64, dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64)
SPECS = [flat_spec("copy", b, (a,), (False,), 1 << 16, True, False) for a in _CASTS for b in _CASTS] + [
  tiled_spec("copy", dtypes.float32, (dtypes.float32,), 3, (True, False), 1 << 16, 64, False, False),
  tiled_spec("copy", dtypes.bfloat16, (dtypes.float32,), 1, (True, True), 1 << 10, 4096, True, True),
]
