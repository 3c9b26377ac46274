"""Creation kernels: `full` and `arange`, and `fill`, which writes one value into a contiguous array (the other
kernel modules start their zeroed buffers with it)."""
from __future__ import annotations

import functools

import numpy as np
import triton
import triton.language as tl

from blutrain import dtypes
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import empty, f64_bits, needs_i64, ptr, run, spec
from blutrain.backend.cuda.kernels.elementwise import launch
from blutrain.configurator import flat_schedule
from blutrain.dtypes import DType
from blutrain.shapes import cdiv


@triton.jit
def _fill_kernel(out, n, bits, BLOCK: tl.constexpr, IDX64: tl.constexpr):
  """Store the bit pattern `bits` (the value in out's dtype, read as an integer of its width) everywhere."""
  start = tl.program_id(0)
  if IDX64:
    start = start.to(tl.int64)
  offs = start * BLOCK + tl.arange(0, BLOCK)
  v = tl.full([BLOCK], 0, out.dtype.element_ty) + bits.to(out.dtype.element_ty)
  tl.store(out + offs, v, mask=offs < n)


@triton.jit
def _arange_kernel(out, n, start, step, BLOCK: tl.constexpr, FLOAT: tl.constexpr):
  """out[i] = start + step * i, in float64 (start and step arrive as their bits) or in int64."""
  i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
  if FLOAT:
    v = start.to(tl.float64, bitcast=True) + step.to(tl.float64, bitcast=True) * i.to(tl.float64)
  else:
    v = start + step * i
  tl.store(out + i, v.to(out.dtype.element_ty), mask=i < n)


@functools.lru_cache(maxsize=4096)
def fill_spec(itemsize: int, n: int, i64: bool):
  """The fill kernel's variant for n elements of `itemsize` bytes (it stores bits, whatever the dtype)."""
  block, warps = flat_schedule(n, itemsize)
  return spec(_fill_kernel, {"out": f"*i{8 * itemsize}", "n": "i64" if i64 else "i32", "bits": "i64"},
              dict(BLOCK=block, IDX64=i64), num_warps=warps)


def fill(out: CudaArray, value) -> CudaArray:
  """Write value (converted to out's dtype as numpy does) into every element of the contiguous `out`; returns out."""
  n = out.size
  if n == 0: return out
  s = fill_spec(out.dtype.itemsize, n, needs_i64(out.shape, out.strides))
  with np.errstate(all="ignore"):
    bits = int(np.array(value).astype(out.dtype.np).reshape(1).view(f"i{out.dtype.itemsize}")[0])
  s.kernel((cdiv(n, s.constexprs["BLOCK"]),), out, n, bits)
  return out


def full(*, shape, value, dtype: DType, out: CudaArray | None = None) -> CudaArray:
  """A new array of `value` in dtype on the current device, or `out` (any layout and dtype) filled with the value
  converted to dtype."""
  if out is None: return fill(empty(shape, dtype), value)
  if dtype is out.dtype and out.is_contiguous(): return fill(out, value)
  return launch("copy", out, fill(empty((), dtype, out.device), value))


full.writes_out = True


def empty_array(*, shape, dtype: DType, out: CudaArray | None = None) -> CudaArray:
  """A new array of dtype on the current device, its values whatever the memory held (no kernel), or `out` as it
  is."""
  return empty(shape, dtype) if out is None else out


empty_array.writes_out = True


def arange(*, start, step, shape, dtype: DType) -> CudaArray:
  """start + step * i for i in [0, prod(shape)), in dtype on the current device (computed in float64 when any of
  dtype, start and step is floating)."""
  out = empty(shape, dtype)
  if out.size == 0: return out
  fl = dtype.is_floating_point or isinstance(start, float) or isinstance(step, float)
  block, warps = flat_schedule(out.size, out.dtype.itemsize)
  s = spec(_arange_kernel, {"out": ptr(dtype), "n": "i64", "start": "i64", "step": "i64"}, dict(BLOCK=block, FLOAT=fl),
           num_warps=warps)
  run(s, (cdiv(out.size, block),), out.ptr, out.size, *((f64_bits(start), f64_bits(step)) if fl else (start, step)))
  return out


KERNELS = {"full": full, "empty": empty_array, "arange": arange}

SPECS = [spec(_fill_kernel, {"out": f"*i{bits}", "n": "i32", "bits": "i64"}, dict(BLOCK=1024, IDX64=False))
         for bits in (8, 16, 32, 64)] + \
        [spec(_arange_kernel, {"out": ptr(dt), "n": "i64", "start": "i64", "step": "i64"},
              dict(BLOCK=1024, FLOAT=dt.is_floating_point)) for dt in dtypes.all_dtypes]
