"""CudaArray: what CUDA kernels take and return, the counterpart of a numpy strided view on the CPU."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

from blutrain.dtypes import DType


@dataclass(eq=False, slots=True)
class CudaArray:
  """A strided view of device memory. `ptr` is the address of element (0, ..., 0); strides are in elements;
  `owner` keeps the memory alive (an allocator block). `layout_key` is made by `key()` on first use."""
  ptr: int
  shape: tuple[int, ...]
  strides: tuple[int, ...]
  dtype: DType
  device: int
  owner: Any
  layout_key: tuple | None = field(default=None, repr=False)

  def key(self) -> tuple:
    """(shape, strides, dtype, address mod 16): all that a kernel's launch plan depends on, which host wrappers
    cache their plans by (the array's layout never changes, so it is made once)."""
    k = self.layout_key = (self.shape, self.strides, self.dtype, self.ptr & 15)
    return k

  @property
  def ndim(self) -> int: return len(self.shape)
  @property
  def size(self) -> int: return math.prod(self.shape)
  @property
  def nbytes(self) -> int: return self.size * self.dtype.itemsize

  def is_contiguous(self) -> bool: return _dense_layout(tuple(self.shape), tuple(self.strides))


@functools.lru_cache(maxsize=4096)  # asked by kernels of every op, for a few layouts a step: cached per layout
def _dense_layout(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
  """Whether (shape, strides) is row-major without gaps (size-1 dims may have any stride)."""
  expected = 1
  for n, s in zip(reversed(shape), reversed(strides)):
    if n != 1 and s != expected: return False
    expected *= n
  return True
