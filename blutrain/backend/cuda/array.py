"""CudaArray: what CUDA kernels take and return, the counterpart of a numpy strided view on the CPU."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from blutrain.dtypes import DType


@dataclass(eq=False, slots=True)
class CudaArray:
  """A strided view of device memory. `ptr` is the address of element (0, ..., 0); strides are in elements;
  `owner` keeps the memory alive (an allocator block)."""
  ptr: int
  shape: tuple[int, ...]
  strides: tuple[int, ...]
  dtype: DType
  device: int
  owner: Any

  @property
  def ndim(self) -> int: return len(self.shape)
  @property
  def size(self) -> int: return math.prod(self.shape)
  @property
  def nbytes(self) -> int: return self.size * self.dtype.itemsize

  def is_contiguous(self) -> bool:
    expected = 1
    for n, s in zip(reversed(self.shape), reversed(self.strides)):
      if n != 1 and s != expected: return False
      expected *= n
    return True
