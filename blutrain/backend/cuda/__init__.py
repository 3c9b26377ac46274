"""The CUDA backend: device memory from our caching allocator, Triton kernels launched through cuda.core,
host copies through pinned staging, DLPack exchange. The module protocol is the CPU backend's; a tensor's
storage data is an allocator Block (or the owner of memory imported through DLPack), its view a CudaArray.

The module imports on any machine (CI compiles the kernel library without a GPU); `require()` raises ImportError
when no GPU can be used, which `blutrain.backend.get` turns into its "device is not available" error.
Kernel-library modules import from the submodules (memory, launch, runtime, array), never from this package.
"""
from __future__ import annotations

import importlib
import pkgutil

import numpy as np

from blutrain.backend import collective
from blutrain.backend.cuda import errors, interop, memory, runtime
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.memory import copy_into  # noqa: F401  (a protocol function)
from blutrain.backend.cuda.runtime import is_available  # noqa: F401
from blutrain.dtypes import DType


def _load_kernels() -> dict:
  """Merge the KERNELS tables of every module of the kernel library (a library not written yet gives none)."""
  try: pkg = importlib.import_module("blutrain.backend.cuda.kernels")
  except ModuleNotFoundError as e:
    if e.name != "blutrain.backend.cuda.kernels": raise
    return {}
  table: dict = {}
  for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
    mod = importlib.import_module(f"blutrain.backend.cuda.kernels.{info.name}")
    found = getattr(mod, "KERNELS", {})
    if table.keys() & found.keys():  # one kernel per op: a second one would silently win by module order
      raise RuntimeError(f"kernels {sorted(table.keys() & found.keys())} are defined twice (again in {info.name})")
    table.update(found)
  return table


kernels = _load_kernels()  # assigned after the imports, which bind the subpackage to this name
kernels |= collective.KERNELS  # the process group's own calls, on the current stream (backend/collective.py)


def to_device(x: CudaArray, target):
  """A copy of x on another device (the `to_device` op's kernel): a host array for the CPU, through host memory to
  another GPU."""
  host = memory.to_numpy(x)
  return host if target.type == "cpu" else memory.from_numpy(host, target.index)


kernels["to_device"] = to_device


def require() -> None:
  """Raise ImportError saying why, when this machine cannot run the CUDA backend."""
  if not runtime.is_available(): raise ImportError(f"no usable NVIDIA GPU: {runtime.unavailable_reason()}")


def empty(numel: int, dtype: DType):
  """A flat buffer of `numel` elements on the current device (a Block)."""
  return memory.empty((numel,), dtype).owner


def from_numpy(array: np.ndarray, device: int | None = None) -> CudaArray:
  """A device copy of a host array, of the same shape (contiguous)."""
  return memory.from_numpy(array, device)


def to_numpy(a: CudaArray) -> np.ndarray:
  """A host copy of a device array; raises the error a kernel queued before it recorded (`errors`)."""
  out = memory.to_numpy(a)
  errors.check(a.device)
  return out


def synchronize(device: int | None = None) -> None:
  """Wait for all work queued on the device; raises the error a kernel recorded (`errors`)."""
  runtime.synchronize(device)
  errors.check(runtime.state(device).index)


def view(data, shape, strides, offset: int, dtype: DType) -> CudaArray:
  """The CudaArray of a storage (a Block or imported memory) with a layout (strides and offset in elements)."""
  return CudaArray(data.ptr + offset * dtype.itemsize, tuple(shape), tuple(strides), dtype, data.device, data)


def wrap(array: CudaArray, dtype: DType) -> tuple:
  """A kernel's result as (storage data, shape, strides, offset, view)."""
  if type(array) is not CudaArray:
    raise TypeError(f"cuda backend: a kernel returned {type(array).__name__}, expected a CudaArray")
  if array.dtype is not dtype:
    raise TypeError(f"cuda backend: a kernel returned {array.dtype.name} where the op's rule says {dtype.name}")
  owner = array.owner
  if array.ptr == owner.ptr: return owner, array.shape, array.strides, 0, array  # a new array: the common case
  offset, rem = divmod(array.ptr - owner.ptr, dtype.itemsize)
  assert rem == 0 and offset >= 0, f"array at 0x{array.ptr:x} is not an element of its storage at 0x{owner.ptr:x}"
  return owner, array.shape, array.strides, offset, array


def data_ptr(array: CudaArray) -> int:
  """The device address of an array's first element."""
  return array.ptr


def dlpack(array: CudaArray, stream: int | None = None, **kw):
  """A DLPack capsule sharing `array`'s memory (the consumer's stream waits for our current stream)."""
  return interop.to_dlpack(array, stream, **kw)


def from_dlpack(ext) -> CudaArray:
  """A CudaArray sharing the memory of a CUDA DLPack producer (PyTorch, CuPy, JAX)."""
  return interop.from_dlpack(ext)


def describe(device: int | None = None) -> str:
  """One line about the GPU: name, SMs, memory, compute capability, driver."""
  p = runtime.get_device_properties(device)
  return (f"{p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, "
          f"L2 {p.L2_cache_size >> 20} MiB, CUDA driver {p.driver_version // 1000}.{p.driver_version % 1000 // 10}, "
          f"{len(kernels)} kernels")
