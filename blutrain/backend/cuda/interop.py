"""DLPack exchange of device memory, zero-copy both ways, with the DLPack C structs declared in ctypes.

Export makes a capsule ("dltensor_versioned" when the consumer asks for DLPack >= 1.0, else "dltensor") whose
manager context keeps the array's Block alive until the consumer calls the deleter (or the unconsumed capsule is
garbage collected). Import reads either capsule kind, renames it "used_..." as the protocol says, and wraps the
memory in a `Foreign` owner that calls the producer's deleter when blutrain's last view of it is gone.
Stream ordering follows the protocol: the consumer passes its stream, and the producer makes that stream wait
for an event recorded on the producer's current stream.
"""
from __future__ import annotations

import ctypes
import math
import sys
from ctypes import (CFUNCTYPE, POINTER, Structure, c_char_p, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64,
                    c_void_p)
from typing import Any

from blutrain import dtypes
from blutrain.backend.cuda import runtime
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.runtime import Event, check, current_stream

kDLCUDA, kDLCUDAHost, kDLCUDAManaged = 2, 3, 13
_CODES = {dtypes.bool_: (6, 8), dtypes.uint8: (1, 8), dtypes.int8: (0, 8), dtypes.int16: (0, 16), dtypes.int32: (0, 32), dtypes.int64: (0, 64), dtypes.float16: (2, 16),
          dtypes.bfloat16: (4, 16), dtypes.float32: (2, 32), dtypes.float64: (2, 64)}
_DTYPES = {v: k for k, v in _CODES.items()}
_CODE_NAMES = {0: "int", 1: "uint", 2: "float", 4: "bfloat", 5: "complex", 6: "bool"}


class DLDevice(Structure):
  _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(Structure):
  _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(Structure):
  _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32), ("dtype", DLDataType),
              ("shape", POINTER(c_int64)), ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]


class DLManagedTensor(Structure): pass


DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p),
                            ("deleter", CFUNCTYPE(None, POINTER(DLManagedTensor)))]


class DLPackVersion(Structure):
  _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(Structure): pass


DLManagedTensorVersioned._fields_ = [("version", DLPackVersion), ("manager_ctx", c_void_p),
                                     ("deleter", CFUNCTYPE(None, POINTER(DLManagedTensorVersioned))),
                                     ("flags", c_uint64), ("dl_tensor", DLTensor)]

_api = ctypes.pythonapi
_api.PyCapsule_New.restype, _api.PyCapsule_New.argtypes = ctypes.py_object, [c_void_p, c_char_p, c_void_p]
_api.PyCapsule_IsValid.restype, _api.PyCapsule_IsValid.argtypes = ctypes.c_int, [c_void_p, c_char_p]
_api.PyCapsule_GetPointer.restype, _api.PyCapsule_GetPointer.argtypes = c_void_p, [c_void_p, c_char_p]
_api.PyCapsule_SetName.restype, _api.PyCapsule_SetName.argtypes = ctypes.c_int, [c_void_p, c_char_p]
# the names must outlive every capsule: module constants
_NAME, _USED = b"dltensor", b"used_dltensor"
_NAME_V, _USED_V = b"dltensor_versioned", b"used_dltensor_versioned"

# *** export ***

_exports: dict[int, Any] = {}  # managed-struct address -> what it keeps alive


def _release(addr: int) -> None:
  _exports.pop(addr, None)


@CFUNCTYPE(None, POINTER(DLManagedTensor))
def _deleter(m) -> None: _release(ctypes.addressof(m.contents))


@CFUNCTYPE(None, POINTER(DLManagedTensorVersioned))
def _deleter_v(m) -> None: _release(ctypes.addressof(m.contents))


@CFUNCTYPE(None, c_void_p)
def _capsule_destructor(capsule: int) -> None:
  """An unconsumed capsule still owns its tensor; a consumed one was renamed and belongs to the consumer."""
  for name in (_NAME, _NAME_V):
    if _api.PyCapsule_IsValid(capsule, name): _release(_api.PyCapsule_GetPointer(capsule, name))


_capsule_destructor_ptr = ctypes.cast(_capsule_destructor, c_void_p)


def to_dlpack(a: CudaArray, stream: int | None = None, max_version: tuple[int, int] | None = None,
              dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
  """A DLPack capsule sharing `a`'s memory, after ordering the consumer's `stream` behind our current stream
  (None or 1: the legacy default stream, 2: the per-thread default stream, -1: no ordering)."""
  if dl_device is not None and tuple(dl_device) != (kDLCUDA, a.device):
    raise BufferError(f"__dlpack__: the tensor is on cuda:{a.device}; it cannot be exported to device {dl_device}")
  if copy: raise BufferError("__dlpack__(copy=True) is not supported; clone() the tensor and export the clone")
  if a.dtype not in _CODES: raise BufferError(f"__dlpack__: {a.dtype.name} has no DLPack type")
  if stream != -1: _order(a.device, stream)
  versioned = max_version is not None and tuple(max_version) >= (1, 0)
  return make_capsule(a.ptr, a.shape, a.strides, a.dtype, (kDLCUDA, a.device), a.owner, versioned)


def make_capsule(ptr: int, shape, strides, dtype, device: tuple[int, int], owner: Any, versioned: bool) -> Any:
  """A capsule describing memory at `ptr` that keeps `owner` alive until the consumer deletes it."""
  m = DLManagedTensorVersioned() if versioned else DLManagedTensor()
  c_shape, c_strides = (c_int64 * len(shape))(*shape), (c_int64 * len(shape))(*strides)
  t = m.dl_tensor
  t.data, t.byte_offset, t.ndim = ptr or None, 0, len(shape)
  t.device = DLDevice(*device)
  t.dtype = DLDataType(*_CODES[dtype], 1)
  t.shape, t.strides = c_shape, c_strides
  addr = ctypes.addressof(m)
  m.manager_ctx = addr
  if versioned: m.version, m.deleter, m.flags = DLPackVersion(1, 0), _deleter_v, 0
  else: m.deleter = _deleter
  _exports[addr] = (m, c_shape, c_strides, owner)
  return _api.PyCapsule_New(addr, _NAME_V if versioned else _NAME, _capsule_destructor_ptr)


def _order(device: int, stream: int | None) -> None:
  s = current_stream(device)
  if stream == s.handle: return
  if stream == 0: raise BufferError("__dlpack__: stream=0 is ambiguous for CUDA; pass 1 for the legacy default stream")
  e = Event()
  e.record(s)
  check(runtime.driver().cuStreamWaitEvent(1 if stream is None else stream, e._e.handle, 0), "cuStreamWaitEvent")


# *** import ***

class Foreign:
  """Device memory owned by another library, kept until blutrain's last view of it is gone."""
  __slots__ = ("ptr", "nbytes", "device", "stream", "_managed", "_deleter", "__weakref__")

  def __init__(self, ptr: int, nbytes: int, device: int, managed: Any, deleter: Any):
    self.ptr, self.nbytes, self.device, self.stream = ptr, nbytes, device, None
    self._managed, self._deleter = managed, deleter

  def record_stream(self, stream: Any) -> None:
    """The producer's memory is not reused by blutrain's allocator, so there is nothing to order."""

  def __del__(self):
    if self._deleter and not sys.is_finalizing(): self._deleter(self._managed)


def from_dlpack(ext: Any) -> CudaArray:
  """A CudaArray sharing the memory of a DLPack producer on a CUDA device (PyTorch, CuPy, JAX, blutrain)."""
  dev_type, dev_id = (int(v) for v in ext.__dlpack_device__())
  if dev_type not in (kDLCUDA, kDLCUDAManaged):
    raise TypeError(f"from_dlpack: the producer's memory is on DLPack device type {dev_type}, not CUDA (2)")
  handle = current_stream(dev_id).handle
  try: capsule = ext.__dlpack__(stream=handle, max_version=(1, 0))
  except TypeError: capsule = ext.__dlpack__(stream=handle)
  return import_capsule(capsule)


def import_capsule(capsule: Any) -> CudaArray:
  """Take ownership of the tensor in a DLPack capsule (any device type: the caller checked it)."""
  cap = id(capsule)  # the PyObject* that the PyCapsule_* calls take
  if _api.PyCapsule_IsValid(cap, _NAME_V):
    addr = _api.PyCapsule_GetPointer(cap, _NAME_V)
    m = DLManagedTensorVersioned.from_address(addr)
    if m.version.major > 1:
      raise BufferError(f"from_dlpack: DLPack {m.version.major}.{m.version.minor} is not supported")
    used = _USED_V
  elif _api.PyCapsule_IsValid(cap, _NAME):
    addr = _api.PyCapsule_GetPointer(cap, _NAME)
    m, used = DLManagedTensor.from_address(addr), _USED
  else:
    raise TypeError("from_dlpack: __dlpack__ returned neither a 'dltensor' nor a 'dltensor_versioned' capsule")
  t = m.dl_tensor
  code = (t.dtype.code, t.dtype.bits)
  if code not in _DTYPES or t.dtype.lanes != 1:
    raise TypeError(f"from_dlpack: DLPack type {_CODE_NAMES.get(code[0], code[0])}{code[1]}x{t.dtype.lanes} has no "
                    f"blutrain dtype (supported: {', '.join(d.name for d in _CODES)})")
  dtype, ndim = _DTYPES[code], t.ndim
  shape = tuple(t.shape[i] for i in range(ndim))
  if t.strides: strides = tuple(t.strides[i] for i in range(ndim))
  else: strides = tuple(math.prod(shape[i + 1:]) for i in range(ndim))
  ptr = (t.data or 0) + t.byte_offset
  _api.PyCapsule_SetName(cap, used)  # the consumer owns it now: the capsule's destructor must not delete it
  owner = Foreign(ptr, math.prod(shape) * dtype.itemsize, t.device.device_id, ctypes.pointer(m), m.deleter)
  return CudaArray(ptr, shape, strides, dtype, t.device.device_id, owner)
