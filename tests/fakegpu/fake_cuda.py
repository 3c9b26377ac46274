"""A fake CUDA device for running the CUDA backend's host code on a machine without a GPU.

Only the lowest layers are replaced: the driver module (`runtime.driver`: allocations hand out fake addresses,
copies and memsets do nothing, pinned staging is real host memory), the driver's cuLaunchKernel (the launcher still
packs every argument into its parameter buffer, which checks types and ranges), cuda.core's Device, Stream, Event and
ObjectCode, and cuBLASLt with its nvmath enums. Triton compiles every kernel for real. Nothing is computed: device
memory holds no values and host reads see zeros. What runs is everything above: the caching allocator, launch
planning and argument packing, autograd, autocast, optimizers, checkpoints and the CLI. Import it and call `install()`
in a fresh process before anything touches the GPU."""
from __future__ import annotations

import ctypes
import itertools
import types

import cuda.core

from blutrain.backend.cuda import launcher, runtime
from blutrain.backend.cuda.allocator import CachingAllocator
from blutrain.backend.cuda.kernels import cublaslt

_addresses = itertools.count(1 << 40, 1 << 36)
_handles = itertools.count(0x1000)
_pinned: list = []
launches = [0]


class FakeDriver:
  class CUresult(int):
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_READY = 600

  class CUfunction_attribute:
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

  CUkernel = int

  def cuInit(self, flags): return (0,)
  def cuDeviceGetCount(self): return (0, 1)
  def cuMemAlloc(self, n): return (0, next(_addresses))
  def cuMemFree(self, p): return (0,)
  def cuMemGetInfo(self): return (0, 100 << 30, 141 << 30)
  def cuDeviceTotalMem(self, i): return (0, 141 << 30)
  def cuDriverGetVersion(self): return (0, 13000)
  def cuKernelSetAttribute(self, *a): return (0,)
  def cuKernelGetFunction(self, kernel): return (0, kernel)
  def cuStreamQuery(self, h): return (0,)
  def cuGetErrorName(self, e): return (0, b"FAKE")
  def cuGetErrorString(self, e): return (0, b"fake")

  def cuMemAllocHost(self, n):
    buf = ctypes.create_string_buffer(n)
    _pinned.append(buf)
    return (0, ctypes.addressof(buf))

  def _nothing(self, *a): return (0,)
  cuMemcpyHtoDAsync = cuMemcpyDtoHAsync = cuMemcpyDtoDAsync = cuMemsetD8Async = cuMemsetD32Async = _nothing

  # CUDA graphs: a capture records nothing (nothing runs); a replay counts as one launch
  CUstreamCaptureMode = types.SimpleNamespace(CU_STREAM_CAPTURE_MODE_RELAXED=2)
  cuStreamBeginCapture = cuGraphExecDestroy = cuGraphDestroy = cuMemFreeHost = _nothing
  def cuStreamEndCapture(self, s): return (0, next(_handles))
  def cuGraphInstantiate(self, g, flags): return (0, next(_handles))
  def cuGraphGetNodes(self, g, n): return (0, None, 0)

  def cuGraphLaunch(self, exe, s):
    launches[0] += 1
    return (0,)


class FakeEvent:
  is_done = True
  def sync(self): pass
  def __sub__(self, other): return 0.0


class FakeStream:
  def __init__(self): self.handle = next(_handles)
  def record(self, e): pass
  def wait(self, e): pass
  def sync(self): pass


class FakeDevice:
  name = "Fake H200"
  def set_current(self): pass
  def create_stream(self, options=None): return FakeStream()
  def create_event(self, options=None): return FakeEvent()
  def sync(self): pass


class FakeKernel:
  handle = 0
  attributes = types.SimpleNamespace(max_threads_per_block=1024, num_regs=64, shared_size_bytes=0)
  def __init__(self, name): self.name = name


class FakeObjectCode:
  def __init__(self, cubin, name): self.cubin, self.name = cubin, name
  @staticmethod
  def from_cubin(cubin, name=None): return FakeObjectCode(cubin, name)
  def get_kernel(self, name): return FakeKernel(name)




class FakeLt:
  MatmulDescAttribute = types.SimpleNamespace(BIAS_POINTER=0)
  def matmul_desc_set_attribute(self, *a): pass
  def matmul(self, *a): pass


def fake_launch_kernel(head, stream, params) -> int:
  """The launcher's contract (`blutrain.backend.cuda.launcher`), checked: ints, a grid and block in range, a stream
  and the address of the parameters' addresses."""
  launches[0] += 1
  assert type(head) is tuple and len(head) == 8 and set(map(type, (*head, stream, params))) == {int}, head
  assert min(head[1:7]) > 0 and head[4] <= 1024 and head[7] <= 227 << 10 and stream and params, head
  return 0


@ctypes.CFUNCTYPE(ctypes.c_int, *launcher.LAUNCH_ARGTYPES)
def fake_cu_launch_kernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra) -> int:
  """The driver's cuLaunchKernel as `launch_args` (the launcher's C packing) calls it: counted and checked as
  fake_launch_kernel checks, returning CUDA_ERROR_INVALID_VALUE (1) where it would fail."""
  launches[0] += 1
  ok = min(gx, gy, gz, bx, by, bz) > 0 and bx <= 1024 and shared <= 227 << 10 and stream and params
  return 0 if ok and extra is None else 1


def fake_launch_args():
  """`launch_args` packing in C and calling fake_cu_launch_kernel; None where the C extension does not build."""
  try: return launcher.c_launch_args(ctypes.cast(fake_cu_launch_kernel, ctypes.c_void_p).value)
  except Exception: return None  # noqa: BLE001 (as the launcher's own fallback)


def install() -> None:
  drv = FakeDriver()
  runtime.driver = lambda: drv
  runtime.launch_function = lambda: fake_launch_kernel
  launch_args = fake_launch_args()
  runtime.launch_args_function = lambda: launch_args
  runtime._probe = (True, "")
  cuda.core.ObjectCode = FakeObjectCode
  st = object.__new__(runtime._DeviceState)
  st.index, st.device = 0, FakeDevice()
  st.allocator = CachingAllocator(runtime._DeviceDriver(0), 0)
  st.compute, st.comm = runtime._new_stream(st, default=True), runtime._new_stream(st)
  st._properties = runtime.DeviceProperties("Fake H200", 9, 0, 141 << 30, 132, 2048, 48 << 10, 227 << 10, 228 << 10,
                                            65536, 50 << 20, 32, 2619000, 6144, 13000)
  runtime._states[0] = st
  cublaslt._lt = FakeLt()
  cublaslt._handles[0] = 0
  cublaslt.compute_type = lambda dtype, tf32=False: (0, 0)  # nvmath's enums: nvmath need not be installed
  cublaslt.plan = lambda p, device: types.SimpleNamespace(problem=p, desc=0, alpha=0, beta=0, algo=0,
                                                          layouts={"a": 0, "b": 0, "d": 0})
