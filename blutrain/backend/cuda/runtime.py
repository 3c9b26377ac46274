"""The CUDA runtime on cuda.core: devices, streams and events, initialized lazily per device.

Ordering: each device gets one compute stream and one communication stream, both created non-blocking, so they
do not synchronize with the legacy NULL stream. Everything blutrain queues (kernels, copies, the allocator's
stream-ordered reuse) goes on the calling thread's current stream, which is the device's compute stream unless
`stream(s)` selects another. Work that other libraries queue on the NULL stream or on their own streams is
ordered with ours only through DLPack's stream argument (an event wait, done by `dlpack` / `from_dlpack`) or
through explicit `Event.record` / `Stream.wait_event`. Host reads of device data (`to_numpy`) wait for the
current stream only.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import dataclass
from typing import Any

from blutrain.backend.cuda import launcher
from blutrain.backend.cuda.allocator import CachingAllocator
from blutrain.configurator import H200, Hardware

_probe: tuple[bool, str] | None = None  # (available, why not), probed once
_states: dict[int, _DeviceState] = {}
_init_lock = threading.Lock()


# *** availability ***

def driver():
  """cuda.bindings' driver module (imported on first use so that the package imports without it)."""
  from cuda.bindings import driver
  return driver


def check(ret: tuple, what: str) -> Any:
  """Unpack a cuda.bindings result `(CUresult, *values)` (or a raw CUresult in a 1-tuple), raising RuntimeError with
  the error's name."""
  err = ret[0]
  if err != 0:
    drv = driver()
    name = drv.cuGetErrorName(drv.CUresult(err))[1]
    desc = drv.cuGetErrorString(drv.CUresult(err))[1]
    raise RuntimeError(f"{what} failed: {name.decode() if name else int(err)} "
                       f"({desc.decode() if desc else 'no description'})")
  return ret[1] if len(ret) == 2 else ret[1:]


def _probe_driver() -> tuple[bool, str]:
  global _probe
  if _probe is None:
    try:
      import cuda.core  # noqa: F401
      drv = driver()
      (err,) = drv.cuInit(0)
      if err != 0: _probe = (False, f"cuInit failed with {drv.cuGetErrorName(err)[1].decode()}")
      else:
        n = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        _probe = (True, "") if n > 0 else (False, "the NVIDIA driver sees no GPU")
    except Exception as e:  # a missing package, library or driver: all mean "not available"
      _probe = (False, f"{type(e).__name__}: {e}")
  return _probe


def is_available() -> bool:
  """True when cuda.core, the NVIDIA driver and at least one GPU are present; never raises."""
  return _probe_driver()[0]


def unavailable_reason() -> str:
  """Why `is_available()` is False ('' when it is True)."""
  return _probe_driver()[1]


@functools.cache
def launch_function() -> launcher.Launch:
  """The driver's cuLaunchKernel as `launch(head, stream, params)` (see `launcher`), made once."""
  return launcher.driver_launch()


@functools.cache
def launch_args_function() -> launcher.LaunchArgs | None:
  """The driver's cuLaunchKernel as `launch_args(head, stream, kinds, args)`, packing in C (see `launcher`), made
  once; None where the C extension does not build."""
  return launcher.driver_launch_args()


def device_count() -> int:
  """The number of GPUs the driver sees (0 when CUDA is not available)."""
  return check(driver().cuDeviceGetCount(), "cuDeviceGetCount") if is_available() else 0


# *** per-device state ***

@dataclass(frozen=True)
class DeviceProperties:
  """What kernels and schedules need to know of a GPU (names as torch.cuda.get_device_properties)."""
  name: str
  major: int
  minor: int
  total_memory: int
  multi_processor_count: int
  max_threads_per_multi_processor: int
  shared_memory_per_block: int
  shared_memory_per_block_optin: int
  shared_memory_per_multiprocessor: int
  regs_per_multiprocessor: int
  L2_cache_size: int
  warp_size: int
  memory_clock_rate: int    # kHz
  memory_bus_width: int     # bits
  driver_version: int       # CUDA driver API version, e.g. 13000


class _DeviceDriver:
  """The allocator's driver: cuMemAlloc / cuMemFree / cuMemGetInfo and events, on one device."""

  def __init__(self, index: int): self.index = index

  def malloc(self, nbytes: int) -> int:
    state(self.index)
    drv = driver()
    err, ptr = drv.cuMemAlloc(nbytes)
    if err == drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY: raise MemoryError
    check((err,), f"cuMemAlloc({nbytes}) on cuda:{self.index}")
    return int(ptr)

  def free(self, ptr: int) -> None:
    state(self.index)
    check(driver().cuMemFree(ptr), f"cuMemFree on cuda:{self.index}")

  def mem_get_info(self) -> tuple[int, int]:
    state(self.index)
    free, total = check(driver().cuMemGetInfo(), "cuMemGetInfo")
    return int(free), int(total)

  def record_event(self, stream: Stream) -> Event:
    e = Event()
    e.record(stream)
    return e


class _DeviceState:
  def __init__(self, index: int):
    if not is_available(): raise RuntimeError(f"CUDA is not available: {unavailable_reason()}")
    from cuda.core import Device
    if not 0 <= index < device_count():
      raise RuntimeError(f"cuda:{index} does not exist: the driver sees {device_count()} GPU(s)")
    self.index, self.device = index, Device(index)
    self.device.set_current()
    self.allocator = CachingAllocator(_DeviceDriver(index), index)
    self.compute, self.comm = _new_stream(self, default=True), _new_stream(self)
    self._properties: DeviceProperties | None = None

  @property
  def properties(self) -> DeviceProperties:
    if self._properties is None:
      p, drv = self.device.properties, driver()
      total = check(drv.cuDeviceTotalMem(self.index), "cuDeviceTotalMem")
      self._properties = DeviceProperties(
        self.device.name, p.compute_capability_major, p.compute_capability_minor, int(total), p.multiprocessor_count,
        p.max_threads_per_multiprocessor, p.max_shared_memory_per_block, p.max_shared_memory_per_block_optin,
        p.max_shared_memory_per_multiprocessor, p.max_registers_per_multiprocessor, p.l2_cache_size, p.warp_size,
        p.memory_clock_rate, p.global_memory_bus_width, check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
    return self._properties


class _Local(threading.local):
  device = 0      # the thread's current device
  context = -1    # the device whose primary context is current in this thread

  def __init__(self): self.streams: dict[int, Stream] = {}  # device -> its current stream, once looked up


_tls = _Local()


def state(device: int | None = None) -> _DeviceState:
  """The device's state, created on first use, with its context made current in the calling thread."""
  i = _tls.device if device is None else device
  st = _states.get(i)
  if st is None:
    with _init_lock:
      st = _states.get(i)
      if st is None: st = _states[i] = _DeviceState(i)
  if _tls.context != i:
    st.device.set_current()
    _tls.context = i
  return st


def current_device() -> int:
  return _tls.device


def set_device(device: int) -> None:
  """Make `device` the calling thread's current GPU."""
  state(device)
  _tls.device = device


def get_device_properties(device: int | None = None) -> DeviceProperties:
  return state(device).properties


@functools.lru_cache(maxsize=None)
def hardware(device: int | None = None) -> Hardware:
  """The configurator's description of a CUDA device, its limits read from the driver (peak rates kept from H200,
  which the driver does not report), or H200's when no GPU is usable (offline compilation targets sm_90)."""
  try:
    p = get_device_properties(device)
  except Exception:  # no package, driver or GPU: offline defaults
    return H200
  return dataclasses.replace(H200, name=p.name, sms=p.multi_processor_count,
                             smem_per_block=p.shared_memory_per_block_optin, smem_per_sm=p.shared_memory_per_multiprocessor,
                             regs_per_sm=p.regs_per_multiprocessor, threads_per_sm=p.max_threads_per_multi_processor,
                             l2_bytes=p.L2_cache_size)


def synchronize(device: int | None = None) -> None:
  """Wait for all work queued on the device, on every stream."""
  state(device).device.sync()


# *** streams and events ***

class Stream:
  """A CUDA stream on one device, as torch.cuda.Stream: `Stream()` creates a new non-blocking stream on the
  current device. Lower `priority` numbers run first (None: the lowest priority). Each Stream object owns its CUDA
  stream, so streams compare (and hash) by identity.

  What launches need is kept on it: the device's `allocator`, the raw `handle` and whether it is the device's default (compute) stream, on which a launch records no cross-stream uses; and the `side`
  stream that `graphs.overlapped` work queued from this one runs on (a graph pool's own), else None."""
  __slots__ = ("_s", "device", "handle", "allocator", "is_default", "side", "__weakref__")

  def __init__(self, device: int | None = None, priority: int | None = None):
    self._create(state(device), priority, False)

  def _create(self, st: _DeviceState, priority: int | None, default: bool) -> None:
    from cuda.core import StreamOptions
    self._s = st.device.create_stream(options=StreamOptions(nonblocking=True, priority=priority))
    self.device, self.handle, self.allocator, self.is_default = st.index, int(self._s.handle), st.allocator, default
    self.side = None

  @property
  def cuda_stream(self) -> int:
    """The raw CUstream handle."""
    return self.handle

  def __cuda_stream__(self) -> tuple[int, int]: return (0, self.handle)
  def __repr__(self) -> str: return f"<blutrain.cuda.Stream device=cuda:{self.device} cuda_stream=0x{self.handle:x}>"

  def query(self) -> bool:
    """True when all work queued on this stream has completed."""
    drv = driver()
    (err,) = drv.cuStreamQuery(self._s.handle)
    if err == drv.CUresult.CUDA_ERROR_NOT_READY: return False
    check((err,), "cuStreamQuery")
    return True

  def synchronize(self) -> None:
    """Wait on the host for all work queued on this stream."""
    self._s.sync()

  def wait_event(self, event: Event) -> None:
    """Make future work on this stream wait for `event` (no host wait)."""
    if event._e is not None: self._s.wait(event._e)

  def wait_stream(self, stream: Stream) -> None:
    """Make future work on this stream wait for the work queued on `stream` so far."""
    self.wait_event(stream.record_event())

  def record_event(self, event: Event | None = None) -> Event:
    """Record `event` (a new one by default) on this stream and return it."""
    event = event or Event()
    event.record(self)
    return event


class Event:
  """A CUDA event, as torch.cuda.Event: a marker in a stream to wait on, query, or time with `elapsed_time`.
  The driver event is created at the first `record`, on the recording stream's device."""
  __slots__ = ("enable_timing", "blocking", "_e", "device")

  def __init__(self, enable_timing: bool = False, blocking: bool = False):
    self.enable_timing, self.blocking, self._e, self.device = enable_timing, blocking, None, None

  def record(self, stream: Stream | None = None) -> None:
    """Record the event on `stream` (default: the current stream)."""
    s = stream or current_stream()
    if self._e is None:
      from cuda.core import EventOptions
      self._e = state(s.device).device.create_event(
        EventOptions(timing_enabled=self.enable_timing, blocking_sync=self.blocking))
      self.device = s.device
    elif s.device != self.device:
      raise RuntimeError(f"Event.record: the event belongs to cuda:{self.device}, the stream to cuda:{s.device}")
    s._s.record(self._e)

  def wait(self, stream: Stream | None = None) -> None:
    """Make future work on `stream` (default: the current stream) wait for this event."""
    (stream or current_stream()).wait_event(self)

  def query(self) -> bool:
    """True when the work recorded before the event has completed (or the event was never recorded)."""
    return self._e is None or self._e.is_done

  def synchronize(self) -> None:
    """Wait on the host until the event has completed."""
    if self._e is not None: self._e.sync()

  def elapsed_time(self, end: Event) -> float:
    """Milliseconds between this event and `end`, both recorded with enable_timing=True and completed."""
    if not (self.enable_timing and end.enable_timing):
      raise RuntimeError("Event.elapsed_time: both events need enable_timing=True")
    if self._e is None or end._e is None: raise RuntimeError("Event.elapsed_time: both events must be recorded first")
    return float(end._e - self._e)


def _new_stream(st: _DeviceState, default: bool = False) -> Stream:
  """A stream made while the device's state is being built (Stream() would ask for that state)."""
  s = Stream.__new__(Stream)
  s._create(st, None, default)
  return s


capture_holds: dict[int, list] = {}  # handle of a stream capturing a CUDA graph -> what the graph must keep alive


def current_stream(device: int | None = None) -> Stream:
  """The stream that blutrain's work goes on in this thread: the one set by `stream(...)`, else the compute stream."""
  tls = _tls
  i = tls.device if device is None else device
  s = tls.streams.get(i)
  if s is None: s = tls.streams[i] = state(i).compute
  return s


def launch_stream(stream: Stream | None = None) -> Stream:
  """The stream a launch goes on (`stream`, else the current stream), with its device's context made current in the
  calling thread (a `with stream(...)` block on another GPU may have left another one current)."""
  tls = _tls
  s = stream or tls.streams.get(tls.device) or current_stream()
  if tls.context != s.device: state(s.device)
  return s


def default_stream(device: int | None = None) -> Stream:
  """The device's compute stream (a non-blocking stream, not the legacy NULL stream)."""
  return state(device).compute


def comm_stream(device: int | None = None) -> Stream:
  """The device's communication stream, for collectives that overlap with compute."""
  return state(device).comm


class stream:
  """Context manager that makes `s` the current stream (and its device the current device) in this thread, as
  torch.cuda.stream; `None` changes nothing."""

  def __init__(self, s: Stream | None):
    self.s, self._saved = s, []

  def __enter__(self) -> Stream | None:
    s = self.s
    if s is None: return None
    tls = _tls
    self._saved.append((tls.device, s.device, tls.streams.get(s.device)))
    state(s.device)
    tls.device, tls.streams[s.device] = s.device, s
    return s

  def __exit__(self, *exc) -> None:
    if self.s is None: return
    device, i, prev = self._saved.pop()
    if prev is None: del _tls.streams[i]
    else: _tls.streams[i] = prev
    _tls.device = device
