"""`bt.cuda`: devices, streams, events and the caching allocator's controls, with torch.cuda's names.

Importing this module needs no GPU; `is_available()` says whether one can be used, and the other functions
raise RuntimeError with the reason when none can.
"""
from __future__ import annotations

from typing import Any

import blutrain.backend.cuda as backend_cuda
from blutrain.backend.cuda import runtime
from blutrain.backend.cuda.errors import DeviceIndexError  # noqa: F401  (public API)
from blutrain.backend.cuda.allocator import OutOfMemoryError
from blutrain.backend.cuda.runtime import DeviceProperties, Event, Stream, stream  # noqa: F401  (public API)
from blutrain.device import Device, to_device

__all__ = ["is_available", "device_count", "current_device", "set_device", "synchronize", "current_stream",
           "default_stream", "Stream", "Event", "stream", "memory_stats", "memory_allocated", "max_memory_allocated",
           "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats", "empty_cache", "set_memory_limit",
           "OutOfMemoryError", "get_device_name", "get_device_properties", "get_device_capability", "DeviceProperties"]


def _index(device: int | str | Device | None) -> int | None:
  if device is None or isinstance(device, int): return device
  d = to_device(device)
  if d.type != "cuda": raise ValueError(f"expected a CUDA device, got {d}")
  return d.index


def is_available() -> bool:
  """True when an NVIDIA GPU, its driver and cuda.core can be used."""
  return runtime.is_available()


def device_count() -> int:
  """The number of GPUs (0 without CUDA)."""
  return runtime.device_count()


def current_device() -> int:
  """The index of the calling thread's current GPU."""
  return runtime.current_device()


def set_device(device: int | str | Device) -> None:
  """Make `device` the calling thread's current GPU."""
  runtime.set_device(_index(device))


def synchronize(device: int | str | Device | None = None) -> None:
  """Wait until all work queued on the device (every stream) has completed; raises the error a kernel recorded
  meanwhile (an index out of range: `DeviceIndexError`, an IndexError and a RuntimeError)."""
  backend_cuda.synchronize(_index(device))


def current_stream(device: int | str | Device | None = None) -> Stream:
  """The stream blutrain queues work on in this thread (the device's compute stream unless `stream(...)` set one)."""
  return runtime.current_stream(_index(device))


def default_stream(device: int | str | Device | None = None) -> Stream:
  """The device's compute stream: a non-blocking stream, so it does not wait for the legacy NULL stream."""
  return runtime.default_stream(_index(device))


# *** memory ***

def _allocator(device):
  return runtime.state(_index(device)).allocator


def memory_stats(device: int | str | Device | None = None) -> dict[str, Any]:
  """The caching allocator's statistics, with PyTorch's keys: 'allocated_bytes.all.current' / '.peak',
  'reserved_bytes.all.*', 'active.all.*', 'requested_bytes.all.*', 'segment.all.*', 'inactive_split_bytes.all.current'
  (free memory stranded in split segments: fragmentation), 'num_device_alloc', 'num_device_free',
  'num_alloc_retries', 'num_ooms'."""
  return _allocator(device).memory_stats()


def memory_allocated(device: int | str | Device | None = None) -> int:
  """Bytes held by tensors now."""
  return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device: int | str | Device | None = None) -> int:
  """The peak of `memory_allocated` since the start or the last `reset_peak_memory_stats`."""
  return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device: int | str | Device | None = None) -> int:
  """Bytes the allocator holds from the driver (allocated plus cached)."""
  return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device: int | str | Device | None = None) -> int:
  return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: int | str | Device | None = None) -> None:
  """Set every peak statistic to its current value."""
  _allocator(device).reset_peak_memory_stats()


def empty_cache(device: int | str | Device | None = None) -> None:
  """Return cached memory that holds no tensor to the driver (other processes can then use it)."""
  _allocator(device).empty_cache()


def set_memory_limit(nbytes: int | None, device: int | str | Device | None = None) -> None:
  """Cap the memory the allocator reserves on the device at `nbytes` (None: no cap), e.g. to emulate a 12 GiB card
  on a larger one; an allocation past it raises OutOfMemoryError, as on such a card."""
  _allocator(device).set_memory_limit(nbytes)


# *** properties ***

def get_device_properties(device: int | str | Device | None = None) -> DeviceProperties:
  """Name, compute capability, memory, SM count, shared memory and L2 sizes of a GPU."""
  return runtime.get_device_properties(_index(device))


def get_device_name(device: int | str | Device | None = None) -> str:
  return get_device_properties(device).name


def get_device_capability(device: int | str | Device | None = None) -> tuple[int, int]:
  """(major, minor) compute capability, e.g. (9, 0) for an H100 or H200."""
  p = get_device_properties(device)
  return p.major, p.minor
