"""Kernel launch without a GPU: compiling for sm_90, the compile cache, signature checks, argument packing and its
per-launch cost (host side)."""
import ctypes
import struct
import threading
import time
import types

import ml_dtypes
import numpy as np
import pytest
import triton
import triton.language as tl

from blutrain import dtypes
from blutrain.backend.cuda import launch, launcher, runtime
from blutrain.backend.cuda.array import CudaArray


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
  offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  m = offs < n
  tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + alpha * tl.load(y_ptr + offs, mask=m), mask=m)


@triton.jit
def scale_kernel(x_ptr, n, a, b, flag, BLOCK: tl.constexpr):
  offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  m = offs < n
  x = tl.load(x_ptr + offs, mask=m)
  tl.store(x_ptr + offs, tl.where(flag, x * a.to(tl.float32) + b, x), mask=m)


@triton.jit
def tma_kernel(x_ptr, out_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
  desc = tl.make_tensor_descriptor(x_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
  tile = desc.load([tl.program_id(0) * BM, 0])
  tl.store(out_ptr + tl.arange(0, BM)[:, None] * N + tl.arange(0, BN)[None, :], tile)


ADD_SIG = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "alpha": "fp32"}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(launch, "_memory", {})


def array(ptr: int, n: int, owner=None) -> CudaArray: return CudaArray(ptr, (n,), (1,), dtypes.float32, 0, owner)


def test_compiles_for_sm90_with_metadata(tmp_path):
  c = launch.compiled(add_kernel, ADD_SIG, {"BLOCK": 1024}, num_warps=4, num_stages=2)
  assert c.cubin[:4] == b"\x7fELF" and c.cubin == launch.cubin(add_kernel, ADD_SIG, {"BLOCK": 1024}, 4, 2)
  assert c.name == "add_kernel" and c.num_warps == 4 and c.num_ctas == 1 and c.shared == 0
  assert c.params == (("x_ptr", "*fp32"), ("y_ptr", "*fp32"), ("out_ptr", "*fp32"), ("n", "i32"), ("alpha", "fp32"))
  assert c.global_scratch_size == 0 and c.profile_scratch_size == 0
  assert len(list((tmp_path / "triton").glob("*.cubin"))) == 1 and len(list((tmp_path / "triton").glob("*.json"))) == 1


def test_signature_may_list_constexprs_and_alignment():
  a = launch.cubin(add_kernel, {**ADD_SIG, "BLOCK": "constexpr"}, {"BLOCK": 1024}, num_warps=4)
  b = launch.cubin(add_kernel, {k: v + ":16" for k, v in ADD_SIG.items() if k != "alpha"} | {"alpha": "fp32"},
                   {"BLOCK": 1024}, num_warps=4)
  assert a[:4] == b[:4] == b"\x7fELF" and a != b  # the aligned variant vectorizes its loads


class Recompiled(Exception): pass


def test_disk_cache_serves_a_new_process(monkeypatch):
  first = launch.compiled(add_kernel, ADD_SIG, {"BLOCK": 256})
  monkeypatch.setattr(launch, "_memory", {})

  def recompile(*a): raise Recompiled

  monkeypatch.setattr(launch, "_compile", recompile)
  assert launch.compiled(add_kernel, ADD_SIG, {"BLOCK": 256}) == first
  with pytest.raises(Recompiled):  # another constexpr is another key
    launch.compiled(add_kernel, ADD_SIG, {"BLOCK": 512})


@pytest.mark.parametrize("sig, consts, message", [
  ({"x_ptr": "*fp32"}, {"BLOCK": 8}, "argument 'y_ptr' has no type"),
  ({**ADD_SIG, "z": "i32"}, {"BLOCK": 8}, r"name \['z'\], not arguments"),
  ({**ADD_SIG, "n": "int"}, {"BLOCK": 8}, "argument 'n' has type 'int'"),
  ({**ADD_SIG, "BLOCK": "constexpr"}, {}, "constexpr argument 'BLOCK' needs a value"),
  ({**ADD_SIG, "n": "i32:8"}, {"BLOCK": 8}, "only ':16' divisibility"),
])
def test_signature_errors_name_the_argument(sig, consts, message):
  with pytest.raises((TypeError, ValueError), match=message):
    launch.compiled(add_kernel, sig, consts)


def packed(k: launch.Kernel, *args) -> tuple:
  """The parameter slots a launch of k with args fills (through the checked path when `struct` refuses an argument),
  decoded by the parameters' types."""
  buf = launch._Parameters(len(k.compiled.params) + 2)
  try: k._pack(buf.slots, *args)
  except (struct.error, TypeError, OverflowError): k._pack_checked(buf.slots, args)
  codes = {"*": "Q", "i32": "i4x", "i64": "q", "fp32": "f4x", "fp16": "e6x", "bf16": "H6x", "i1": "b7x"}
  return struct.unpack_from("<" + "".join(codes["*" if t[0] == "*" else t] for _, t in k.compiled.params), buf.slots)


def test_packing_converts_each_argument_by_its_type():
  k = launch.compile(add_kernel, ADD_SIG, {"BLOCK": 1024})
  x, y, out = array(0x7000_0000_0000, 10, "block"), array(0x7000_0000_0200, 10), array(0x7000_0000_0400, 10)
  assert packed(k, x, y, out, 10, 2.5) == (x.ptr, y.ptr, out.ptr, 10, 2.5)
  assert packed(k, 123, None, out, np.int64(7), np.float32(1)) == (123, 0, out.ptr, 7, 1.0)
  assert packed(k, x, y, out, 10, 1e39)[4] == np.inf  # float32 overflows to inf, as numpy converts it
  assert packed(k, x, y, out, -2**31, 1.0)[3] == -2**31
  assert k._owners(x, 5, None, 10, 2.5) == ("block", None, None)
  with pytest.raises(TypeError, match=r"add_kernel: argument 'y_ptr' is a pointer; got str"):
    packed(k, x, "y", out, 10, 2.5)
  with pytest.raises(TypeError, match=r"add_kernel: takes 5 arguments \['x_ptr', 'y_ptr', 'out_ptr', 'n', 'alpha'\], "
                                      r"got 4"):
    packed(k, x, y, out, 10)
  for n in (2**31, -2**31 - 1):
    with pytest.raises(OverflowError, match="add_kernel: argument 'n' \\(i32\\)"):
      packed(k, x, y, out, n, 1.0)


def test_packing_of_half_types_and_flags():
  k = launch.compile(scale_kernel, {"x_ptr": "*fp32", "n": "i64", "a": "bf16", "b": "fp16", "flag": "i1"},
                     {"BLOCK": 128})
  p = packed(k, array(4096, 3), 3, 1.5, 0.25, True)
  assert p == (4096, 3, np.array(1.5, ml_dtypes.bfloat16).view(np.uint16), 0.25, 1)
  assert packed(k, array(4096, 3), 3, 1.5, 0.25, np.bool_(True))[4] == 1


def test_grids_are_checked():
  k = launch.compile(add_kernel, ADD_SIG, {"BLOCK": 1024}, num_warps=8)
  assert k._grid_dims((5, 2)) == (5, 2, 1) and k._grid_dims(7) == (7, 1, 1) and k._grid_dims((3, 0, 1)) == (3, 0, 1)
  with pytest.raises(ValueError, match=r"add_kernel: grid must be"):
    k._grid_dims((1, 2, 3, 4))
  with pytest.raises(ValueError, match=r"exceeds CUDA's limits"):
    k._grid_dims((1, 70000))


def test_kernels_with_a_global_scratch_buffer_take_it_after_the_arguments():
  k = launch.compile(tma_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "M": "i32", "N": "i32"}, {"BM": 64, "BN": 64},
                     num_stages=1)
  c = k.compiled
  assert c.global_scratch_size > 0 and c.global_scratch_align <= 512 and k._scratch
  assert packed(k, array(1 << 20, 1), array(2 << 20, 1), 64, 64) == (1 << 20, 2 << 20, 64, 64)  # the launch adds them


def _stubbed(k: launch.Kernel, monkeypatch, grid, streams: dict) -> list:
  """k launching `grid` on device 0 with the driver call recorded instead; `streams` is the thread's current ones."""
  monkeypatch.setattr(runtime._tls, "context", 0)
  monkeypatch.setattr(runtime._tls, "device", 0)
  monkeypatch.setattr(runtime._tls, "streams", streams)
  launched = []
  k._launches[grid] = (0, 4, ("function", 4, 1, 1, 128, 1, 1, 0))
  k._launch = lambda *args: launched.append(args) or 0
  return launched


def test_a_launch_on_another_stream_records_its_arrays_there(monkeypatch):
  k = launch.compile(add_kernel, ADD_SIG, {"BLOCK": 1024})
  compute = types.SimpleNamespace(device=0, is_default=True, handle="compute")
  side = types.SimpleNamespace(device=0, is_default=False, handle="side")
  launched = _stubbed(k, monkeypatch, (4,), {0: compute})

  class Owner:
    def __init__(self): self.stream, self.uses = compute, []
    def record_stream(self, s): self.uses.append(s)

  a, b = Owner(), Owner()
  x, out = array(1 << 40, 10, a), array(2 << 40, 10, b)
  k((4,), x, 3 << 40, out, 10, 2.5)
  assert a.uses == b.uses == [] and launched[-1][0] == ("function", 4, 1, 1, 128, 1, 1, 0)
  assert launched[-1][1] == "compute"
  params = ctypes.cast(launched[-1][2], ctypes.POINTER(ctypes.c_void_p))
  assert [ctypes.c_uint64.from_address(params[i]).value for i in range(3)] == [1 << 40, 3 << 40, 2 << 40]
  k((4,), x, 3 << 40, out, 10, 2.5, stream=side)
  assert a.uses == b.uses == [side] and launched[-1][1] == "side"


def _c_driver(slots: int) -> tuple:
  """A C-callable cuLaunchKernel recording its calls with their first `slots` parameters (read during the call: they
  live on the C packer's stack), kept alive by the caller, and `launch_args` bound to it."""
  calls = []

  @ctypes.CFUNCTYPE(ctypes.c_int, *launcher.LAUNCH_ARGTYPES)
  def driver(*args):
    read = ctypes.cast(args[9], ctypes.POINTER(ctypes.c_void_p))
    calls.append((*args[:9], b"".join(ctypes.string_at(read[i], 8) for i in range(slots))))
    return 0
  try: return driver, calls, launcher.c_launch_args(ctypes.cast(driver, ctypes.c_void_p).value)
  except Exception as e: pytest.skip(f"the C launcher does not build here: {e}")


def test_a_launch_packs_in_c_and_leaves_what_c_refuses_to_python(monkeypatch):
  k = launch.compile(add_kernel, ADD_SIG, {"BLOCK": 1024})
  assert k._kinds == b"pppif"
  compute = types.SimpleNamespace(device=0, is_default=True, handle=0x5000)
  side = types.SimpleNamespace(device=0, is_default=False, handle=0x6000)
  launched = _stubbed(k, monkeypatch, (4,), {0: compute})
  k._launches[(4,)] = (0, 4, (0xF00, 4, 1, 1, 128, 1, 1, 0))
  driver, calls, k._launch_args = _c_driver(5)
  x, y, out = array(1 << 40, 10), array(2 << 40, 10), array(3 << 40, 10)
  k((4,), x, y, out, 10, 2.5)
  assert launched == [] and len(calls) == 1 and calls[0][:9] == (0xF00, 4, 1, 1, 128, 1, 1, 0, 0x5000)
  assert struct.unpack("<QQQi4xf4x", calls[0][9]) == packed(k, x, y, out, 10, 2.5)
  k((4,), x, y, out, 10, 1e39)  # float32 overflow: C refuses, Python converts it as numpy does
  assert len(calls) == 1 and len(launched) == 1
  params = ctypes.cast(launched[-1][2], ctypes.POINTER(ctypes.c_void_p))
  assert ctypes.c_float.from_address(params[4]).value == np.inf
  k((4,), x, y, out, 10, 2.5, stream=side)  # another stream: Python records the arrays' uses there
  assert len(calls) == 1 and len(launched) == 2 and launched[-1][1] == 0x6000
  with pytest.raises(TypeError, match="add_kernel: argument 'y_ptr' is a pointer; got str"):
    k((4,), x, "y", out, 10, 2.5)
  assert len(calls) == 1 and len(launched) == 2


def test_kernels_with_half_scalars_or_scratch_pack_in_python():
  half = launch.compile(scale_kernel, {"x_ptr": "*fp32", "n": "i64", "a": "bf16", "b": "fp16", "flag": "i1"},
                        {"BLOCK": 128})
  tma = launch.compile(tma_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "M": "i32", "N": "i32"},
                       {"BM": 64, "BN": 64}, num_stages=1)
  assert half._kinds is None and tma._kinds is None


def test_threads_pack_into_buffers_of_their_own(monkeypatch):
  k = launch.compile(add_kernel, ADD_SIG, {"BLOCK": 1024})
  compute = types.SimpleNamespace(device=0, is_default=True, handle="compute")
  launched = _stubbed(k, monkeypatch, (4,), {0: compute})
  k((4,), 1 << 40, 2 << 40, 3 << 40, 10, 2.5)

  def other_thread():
    runtime._tls.context, runtime._tls.device, runtime._tls.streams = 0, 0, {0: compute}
    k((4,), 4 << 40, 5 << 40, 6 << 40, 10, 2.5)

  t = threading.Thread(target=other_thread)
  t.start()
  t.join()
  assert len(launched) == 2 and len(k._buffers) == 2 and launched[0][2] != launched[1][2]


def test_per_launch_host_overhead(monkeypatch):
  """The Python work of a launch before the driver call: argument packing and all of Kernel.__call__ with the driver
  call stubbed out. Printed for the record (benchmarks/launch_overhead.py measures whole launches on the GPU)."""
  k = launch.compile(add_kernel, ADD_SIG, {"BLOCK": 1024})
  x, y, out = array(1 << 40, 10), array(2 << 40, 10), array(3 << 40, 10)
  stream = types.SimpleNamespace(device=0, is_default=True, handle="stream")
  _stubbed(k, monkeypatch, (4,), {0: stream})
  k._launch = lambda *args: 0
  buf = launch._Parameters(7)
  n = 20000

  def per_call(f) -> float:
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1e6

  pack = per_call(lambda: k._pack(buf.slots, x, y, out, 10, 2.5))
  call = per_call(lambda: k((4,), x, y, out, 10, 2.5, stream=stream))
  print(f"\nper-launch host overhead: pack {pack:.2f} us, Kernel.__call__ without the driver call {call:.2f} us")
  assert pack < 50  # generous: the point is the printout, not a flaky timing bound
