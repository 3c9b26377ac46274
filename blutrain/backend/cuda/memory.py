"""Device arrays: allocation from the caching allocator, host <-> device copies through pinned staging buffers,
and device-to-device copies. Everything is queued on the current stream (see runtime.py for the ordering)."""
from __future__ import annotations

import ctypes
import functools
import math
import threading
from typing import Callable

import numpy as np
from numpy.lib.stride_tricks import as_strided

from blutrain import dtypes, shapes
from blutrain.backend.cuda import runtime
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.runtime import Event, Stream, check, current_stream
from blutrain.dtypes import DType
from blutrain.shapes import contiguous_strides

CHUNK = 16 << 20  # bytes per pinned staging buffer; copies run in pieces of this size


class kept:
  """Allocations made inside are kept across steps (a cache's device tables, a workspace, the error flag): an
  allocator that follows a static memory plan (`graphs.PlannedAllocator`) must never serve them from a planned slot,
  which the plan hands to another value later in the step."""
  depth = 0

  def __enter__(self): kept.depth += 1
  def __exit__(self, *exc): kept.depth -= 1


def empty(shape, dtype: DType, device: int | None = None, stream: Stream | None = None) -> CudaArray:
  """A contiguous array of `shape` and `dtype` with undefined values, usable in the order of `stream`
  (default: the device's current stream)."""
  if shape.__class__ is not tuple: shape = tuple(shape)
  numel, strides = _dense(shape)
  s = stream or current_stream(device)
  block = s.allocator.malloc(numel * dtype.itemsize, s)
  return CudaArray(block.ptr, shape, strides, dtype, s.device, block)


@functools.lru_cache(maxsize=4096)
def _dense(shape: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
  """The element count and contiguous strides of a shape."""
  return math.prod(shape), contiguous_strides(shape)


def empty_like(a: CudaArray) -> CudaArray:
  return empty(a.shape, a.dtype, a.device)


# *** layout helpers ***

def span(shape, strides) -> tuple[int, int]:
  """The element offsets [lo, hi) that a non-empty strided array touches, relative to element (0, ..., 0)."""
  lo = sum(st * (n - 1) for n, st in zip(shape, strides) if st < 0)
  hi = 1 + sum(st * (n - 1) for n, st in zip(shape, strides) if st > 0)
  return lo, hi


def overlaps(a: CudaArray, b: CudaArray) -> bool:
  """Whether two arrays may share elements (conservatively: their byte ranges intersect)."""
  if a.size == 0 or b.size == 0: return False
  (alo, ahi), (blo, bhi) = span(a.shape, a.strides), span(b.shape, b.strides)
  return (a.ptr + alo * a.dtype.itemsize < b.ptr + bhi * b.dtype.itemsize
          and b.ptr + blo * b.dtype.itemsize < a.ptr + ahi * a.dtype.itemsize)


def is_dense(a: CudaArray) -> bool:
  """True when `a` is a permutation of a contiguous array: its elements fill [ptr, ptr + nbytes) exactly once."""
  return shapes.is_dense(a.shape, a.strides)


def broadcast_to(a: CudaArray, shape: tuple[int, ...]) -> CudaArray:
  """A stride-0 view of `a` with `shape` (NumPy's broadcasting rule)."""
  if a.shape == shape: return a
  lead = len(shape) - a.ndim
  if lead < 0 or any(n != m and n != 1 for n, m in zip(a.shape, shape[lead:])):
    raise ValueError(f"cannot broadcast a CUDA array of shape {a.shape} to {shape}")
  strides = (0,) * lead + tuple(0 if n != m else st for n, m, st in zip(a.shape, shape[lead:], a.strides))
  return CudaArray(a.ptr, shape, strides, a.dtype, a.device, a.owner)


# The kernel library's strided copy (kernels/copy.py sets it when it loads: the library sits above this module), for
# copies a memcpy cannot do: other layouts, dtype conversions, and compacting a sparse view before a download.
strided_copy: Callable[..., CudaArray] | None = None


# *** pinned staging ***

class _Staging:
  """Two pinned host buffers per device: while the DMA engine moves one piece, the CPU fills or drains the other."""

  def __init__(self, device: int):
    self.device, self.lock = device, threading.Lock()
    self.buffers: list[int] = []
    self.events = [Event(), Event()]  # the last copy through each buffer

  def buffer(self, j: int) -> int:
    """Buffer j, ready to be written: its last copy has completed."""
    while len(self.buffers) <= j:
      runtime.state(self.device)
      self.buffers.append(int(check(runtime.driver().cuMemAllocHost(CHUNK), f"cuMemAllocHost({CHUNK})")))
    self.events[j].synchronize()
    return self.buffers[j]


class _Ring:
  """Small pinned slots used in turn for small host-to-device copies (tables of pointers, scalars), so that such a
  copy waits only for the copy that used its slot SLOTS copies ago, not for the work queued before the last one:
  one shared staging buffer would make every small upload wait on the GPU, and the host could not run ahead."""
  SLOTS, SLOT = 32, 64 << 10

  def __init__(self, device: int):
    runtime.state(device)
    self.base = int(check(runtime.driver().cuMemAllocHost(self.SLOTS * self.SLOT), "cuMemAllocHost(ring)"))
    self.events, self.next = [Event() for _ in range(self.SLOTS)], 0

  def slot(self) -> tuple[int, Event]:
    """The next slot's address and event, its previous copy completed."""
    j, self.next = self.next, (self.next + 1) % self.SLOTS
    self.events[j].synchronize()
    return self.base + j * self.SLOT, self.events[j]


_staging: dict[int, _Staging] = {}
_rings: dict[int, _Ring] = {}


def _stage(device: int) -> _Staging:
  st = _staging.get(device)
  if st is None: st = _staging.setdefault(device, _Staging(device))
  return st


class PinnedCopy:
  """Pinned host memory holding the source of a host-to-device copy captured into a CUDA graph, which reads it at
  every replay: it lives, unchanged, as long as the graph."""

  def __init__(self, src: int, nbytes: int):
    self.ptr = int(check(runtime.driver().cuMemAllocHost(nbytes), f"cuMemAllocHost({nbytes})"))
    ctypes.memmove(self.ptr, src, nbytes)

  def __del__(self):
    if getattr(self, "ptr", None): runtime.driver().cuMemFreeHost(self.ptr)


def copy_h2d(dst: int, src: int, nbytes: int, s: Stream) -> None:
  """Queue a copy of `nbytes` from host address `src` to device address `dst` on `s`; `src` may be reused
  as soon as this returns. On a stream capturing a CUDA graph the copy reads a pinned copy of `src` that the graph
  keeps (`runtime.capture_holds`), so that each replay copies the same bytes."""
  runtime.state(s.device)  # its context current in this thread
  st, drv = _stage(s.device), runtime.driver()
  held = runtime.capture_holds.get(s.handle)
  if held is not None:
    held.append(buf := PinnedCopy(src, nbytes))
    check(drv.cuMemcpyHtoDAsync(dst, buf.ptr, nbytes, s._s.handle), "cuMemcpyHtoDAsync")
    return
  with st.lock:
    if nbytes <= _Ring.SLOT:
      ring = _rings.get(s.device) or _rings.setdefault(s.device, _Ring(s.device))
      buf, event = ring.slot()
      ctypes.memmove(buf, src, nbytes)
      check(drv.cuMemcpyHtoDAsync(dst, buf, nbytes, s._s.handle), "cuMemcpyHtoDAsync")
      event.record(s)
      return
    for k, off in enumerate(range(0, nbytes, CHUNK)):
      n, j = min(CHUNK, nbytes - off), k & 1
      buf = st.buffer(j)
      ctypes.memmove(buf, src + off, n)
      check(drv.cuMemcpyHtoDAsync(dst + off, buf, n, s._s.handle), "cuMemcpyHtoDAsync")
      st.events[j].record(s)


def copy_d2h(dst: int, src: int, nbytes: int, s: Stream) -> None:
  """Copy `nbytes` from device address `src` to host address `dst` after the work queued on `s`; returns
  when the host memory holds the data."""
  runtime.state(s.device)  # its context current in this thread
  st, drv = _stage(s.device), runtime.driver()
  with st.lock:
    last = None
    for k, off in enumerate(range(0, nbytes, CHUNK)):
      n, j = min(CHUNK, nbytes - off), k & 1
      buf = st.buffer(j)
      check(drv.cuMemcpyDtoHAsync(buf, src + off, n, s._s.handle), "cuMemcpyDtoHAsync")
      st.events[j].record(s)
      if last is not None: _drain(st, *last, dst)
      last = (j, buf, off, n)
    if last is not None: _drain(st, *last, dst)


def _drain(st: _Staging, j: int, buf: int, off: int, n: int, dst: int) -> None:
  st.events[j].synchronize()
  ctypes.memmove(dst + off, buf, n)


def copy_d2d(dst: int, src: int, nbytes: int, s: Stream) -> None:
  """Queue a device-to-device copy of `nbytes` on `s`."""
  if nbytes:
    runtime.state(s.device)
    check(runtime.driver().cuMemcpyDtoDAsync(dst, src, nbytes, s._s.handle), "cuMemcpyDtoDAsync")


def zero(a: CudaArray) -> None:
  """Queue a memset of the contiguous array `a` to zero bytes on the current stream."""
  if a.nbytes:
    s = current_stream(a.device)
    check(runtime.driver().cuMemsetD8Async(a.ptr, 0, a.nbytes, s._s.handle), "cuMemsetD8Async")


# *** host <-> device ***

def from_numpy(array: np.ndarray, device: int | None = None) -> CudaArray:
  """A contiguous device copy of a host array (any layout) on `device` (default: the current device)."""
  dtype = dtypes.to_dtype(array.dtype)
  host = np.asarray(array, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
  out = empty(host.shape, dtype, device)
  if out.nbytes: copy_h2d(out.ptr, host.ctypes.data, out.nbytes, current_stream(out.device))
  return out


def to_numpy(a: CudaArray) -> np.ndarray:
  """A host copy of a strided device array, after the work queued on the current stream."""
  out = np.empty(a.shape, a.dtype.np)
  if out.size == 0: return out
  s, item = current_stream(a.device), a.dtype.itemsize
  if a.is_contiguous():
    copy_d2h(out.ctypes.data, a.ptr, a.nbytes, s)
    return out
  lo, hi = span(a.shape, a.strides)
  if not is_dense(a) and hi - lo > 2 * a.size + (1 << 20) // item and (copy := strided_copy) is not None:
    return to_numpy(copy(a))  # a sparse view of a large buffer: gather it on the device first
  buf = np.empty(hi - lo, a.dtype.np)
  copy_d2h(buf.ctypes.data, a.ptr + lo * item, (hi - lo) * item, s)
  out[...] = as_strided(buf[-lo:], shape=a.shape, strides=tuple(st * item for st in a.strides))
  return out


# *** device -> device ***

def copy_into(dst: CudaArray, src: CudaArray) -> None:
  """dst[...] = src on the current stream: src broadcasts to dst's shape and is converted to its dtype.

  A memcpy when both share one dtype and one dense layout; otherwise the kernel library's `copy` kernel, which
  converts on store and reads a source that overlaps dst before writing."""
  if dst.size == 0: return
  if src.device != dst.device:
    raise RuntimeError(f"copy_into: source on cuda:{src.device}, destination on cuda:{dst.device}; "
                       "copy through .to(device) first")
  s = current_stream(dst.device)
  src = broadcast_to(src, dst.shape)
  for a in (src, dst):
    if a.owner.stream is not s: a.owner.record_stream(s)
  if src.dtype is dst.dtype:
    if src.ptr == dst.ptr and src.strides == dst.strides: return  # x.copy_(x)
    if src.strides == dst.strides and is_dense(dst) and not overlaps(dst, src):  # memcpy's ranges must not overlap
      lo, _ = span(dst.shape, dst.strides)
      copy_d2d(dst.ptr + lo * dst.dtype.itemsize, src.ptr + lo * src.dtype.itemsize, dst.nbytes, s)
      return
  if strided_copy is None:
    raise RuntimeError(f"copy_into: writing a {src.dtype.name} array of shape {src.shape} (strides {src.strides}) into "
                       f"a {dst.dtype.name} one with strides {dst.strides} on cuda:{dst.device} needs the CUDA "
                       "'copy' kernel, which is not loaded (blutrain.backend.cuda.kernels)")
  strided_copy(src, out=dst)
