"""Device-side errors: kernels that find bad input (an index out of range) record it in a small flag in device memory
instead of making the host wait; the next synchronization that reads from the device (`to_numpy`, so `.item()` and
`.numpy()`, and `bt.cuda.synchronize()`) reads the flag and raises an error that names the op, the index and the bound.

The flag of a device is four int64: the code of the first op that failed (0: none), the largest and the smallest bad
index seen, and the size of the dim it indexed. Kernels update it with atomics, so it costs nothing while all is well;
the host reads it only after work that could have set it was queued since the last read (`mark`).
"""
from __future__ import annotations

import numpy as np

from blutrain.backend.cuda import memory
from blutrain.backend.cuda.array import CudaArray

OPS = ("embedding", "embedding_backward", "gather", "scatter_add", "index", "index_backward", "index_put",
       "scatter_reduce")
_CLEAR = np.array([0, np.iinfo(np.int64).min, np.iinfo(np.int64).max, 0], np.int64)
_flags: dict[int, CudaArray] = {}
_pending: set[int] = set()  # devices with work queued since their flag was last read


class DeviceIndexError(IndexError, RuntimeError):
  """An index out of range found by a kernel on the GPU. An IndexError, as the CPU backend raises for the same input,
  and a RuntimeError, as PyTorch's device-side assert is."""


def flag(device: int) -> CudaArray:
  """The device's error flag, for a kernel to record into; marks the device to be checked at the next sync."""
  f = _flags.get(device)
  if f is None:
    with memory.kept(): f = _flags[device] = memory.from_numpy(_CLEAR, device)
  _pending.add(device)
  return f


def mark(device: int) -> None:
  """Work that may record an error (a replayed CUDA graph holding index kernels) was queued on the device."""
  if device in _flags: _pending.add(device)


def check(device: int) -> None:
  """Raise DeviceIndexError when a kernel queued before this point recorded an error on the device (the caller has
  synchronized with that work), and clear the flag, so the process can go on."""
  if device not in _pending: return
  _pending.discard(device)
  f = _flags[device]
  code, hi, lo, bound = (int(v) for v in memory.to_numpy(f))
  if code == 0: return
  memory.copy_into(f, memory.from_numpy(_CLEAR, device))
  bad = hi if hi >= bound else lo
  raise DeviceIndexError(
    f"{OPS[code - 1]}: index {bad} is out of range for a dimension of size {bound} on cuda:{device} (found by a kernel "
    f"queued before this synchronization; the values it computed are undefined). Check the indices (token ids below "
    f"the vocabulary size, class targets below the number of classes); on device='cpu' the op itself raises.")
