"""What the generated step runs on: `load` executes its source, `cuda_view` makes its views of CudaArrays. Nothing
here imports the compiler (xDSL, the dialect, the passes), so a step whose code is in the disk cache runs without
loading it."""
from __future__ import annotations

import hashlib
import linecache
from typing import Any, Callable

import numpy as np


def load(source: str, name: str = "step") -> Callable[..., tuple[np.ndarray, ...]]:
  """Execute generated source (it imports numpy, dtypes and the kernels itself) and return its function. The source
  is registered with `linecache`, so tracebacks through the compiled step show the generated lines."""
  filename = f"<nova {hashlib.blake2b(source.encode(), digest_size=6).hexdigest()}>"
  linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
  namespace: dict[str, Any] = {}
  exec(compile(source, filename, "exec"), namespace)
  return namespace[name]


class _Layout:
  """What an op's layout rule reads of a tensor (shape, strides, offset, dtype, ndim), for a CudaArray."""
  __slots__ = ("shape", "_strides", "_offset", "dtype", "ndim")

  def __init__(self, x):
    self.shape, self._strides, self._offset, self.dtype, self.ndim = x.shape, x.strides, 0, x.dtype, len(x.shape)


def cuda_view(x, opname: str, attrs: dict):
  """The view that layout op `opname` makes of CudaArray x, by the op's own layout rule (`Op.view`), as eager mode
  makes it; a reshape whose layout cannot view x's memory reads a contiguous copy, as `reshape` does."""
  from blutrain.backend.cuda import kernels
  from blutrain.ops import registry
  shape, strides, offset = registry[opname].view(_Layout(x), **attrs)
  if strides is None:
    x = kernels["copy"](x)
    shape, strides, offset = registry[opname].view(_Layout(x), **attrs)
  return type(x)(x.ptr + offset * x.dtype.itemsize, tuple(shape), tuple(strides), x.dtype, x.device, x.owner)
