"""The kernel launcher (blutrain/backend/cuda/launcher.py) on the CPU: the C extension and the ctypes path call a
stand-in for cuLaunchKernel with the same arguments; a launcher that does not build falls back with a warning;
`launch_args` packs each kind of argument as `struct` does and refuses what it refuses."""
import ctypes
import os
import shutil
import struct
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from blutrain.backend.cuda import launcher

HAS_CC = bool(os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")) and \
  (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()  # what Triton's build helper needs
PROTOTYPE = ctypes.CFUNCTYPE(ctypes.c_int, *launcher.LAUNCH_ARGTYPES)
HEAD = (0xABC000, 3, 2, 1, 128, 1, 1, 49152)


def stand_in(result: int = 0, slots: int = 0):
  """A C-callable cuLaunchKernel that records what it was called with and returns `result`; with `slots`, also the
  first `slots` 8-byte parameters, read through params during the call as the driver reads them (`launch_args`
  packs them on its stack)."""
  calls = []

  def record(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
    read = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
    calls.append(((f, gx, gy, gz, bx, by, bz, shared), stream, params, extra,
                  [ctypes.string_at(read[i], 8) for i in range(slots)]))
    return result
  return PROTOTYPE(record), calls


def params_array(values):
  slots = (ctypes.c_uint64 * len(values))(*values)
  base = ctypes.addressof(slots)
  addresses = (ctypes.c_void_p * len(values))(*range(base, base + 8 * len(values), 8))
  return slots, addresses


@pytest.mark.skipif(not HAS_CC, reason="no C compiler or Python headers")
@pytest.mark.parametrize("result", [0, 700])
def test_the_c_launcher_and_ctypes_pass_the_same_arguments(result):
  function, calls = stand_in(result)
  slots, addresses = params_array([1 << 40, 7, 99])
  c = launcher.c_launch(ctypes.cast(function, ctypes.c_void_p).value)
  via_ctypes = launcher.ctypes_launch(PROTOTYPE(ctypes.cast(function, ctypes.c_void_p).value))
  for launch in (c, via_ctypes):
    assert launch(HEAD, 0x5000, ctypes.addressof(addresses)) == result
  assert calls[0] == calls[1] == (HEAD, 0x5000, ctypes.addressof(addresses), None, [])
  read = ctypes.cast(calls[0][2], ctypes.POINTER(ctypes.c_void_p))  # what the driver would read through params
  assert [ctypes.c_uint64.from_address(read[i]).value for i in range(3)] == [1 << 40, 7, 99]


@pytest.mark.skipif(not HAS_CC, reason="no C compiler or Python headers")
@pytest.mark.parametrize("head, stream, params", [((1, 2, 3), 0, 0), ([0] * 8, 0, 0), ((0,) * 8, "s", 0),
                                                  ((0,) * 7 + (-1,), 0, 0)])
def test_the_c_launcher_refuses_malformed_arguments(head, stream, params):
  function, calls = stand_in()
  launch = launcher.c_launch(ctypes.cast(function, ctypes.c_void_p).value)
  with pytest.raises((TypeError, OverflowError)):
    launch(head, stream, params)
  assert calls == []


def test_a_launcher_that_does_not_build_falls_back_to_ctypes(monkeypatch):
  def no_compiler(): raise RuntimeError("Failed to find C compiler")
  monkeypatch.setattr(launcher, "build", no_compiler)
  function, calls = stand_in()
  with pytest.warns(RuntimeWarning, match="did not build .*Failed to find C compiler.*ctypes"):
    launch = launcher.best_launch(PROTOTYPE(ctypes.cast(function, ctypes.c_void_p).value))
  slots, addresses = params_array([5])
  assert launch(HEAD, 0x6000, ctypes.addressof(addresses)) == 0
  assert calls == [(HEAD, 0x6000, ctypes.addressof(addresses), None, [])]


@pytest.mark.skipif(not HAS_CC, reason="no C compiler or Python headers")
def test_each_c_launcher_calls_its_own_driver_function():
  (first, first_calls), (second, second_calls) = stand_in(), stand_in(7)
  launch_first = launcher.c_launch(ctypes.cast(first, ctypes.c_void_p).value)
  launch_second = launcher.c_launch(ctypes.cast(second, ctypes.c_void_p).value)
  assert launch_second(HEAD, 1, 2) == 7 and launch_first(HEAD, 3, 4) == 0
  assert first_calls == [(HEAD, 3, 4, None, [])] and second_calls == [(HEAD, 1, 2, None, [])]
  with pytest.raises(ValueError, match="address of a cuLaunchKernel"):
    launcher.c_launch(0)


STRUCT = {"p": "Q", "b": "b7x", "h": "h6x", "i": "i4x", "q": "q", "B": "B7x", "H": "H6x", "I": "I4x", "Q": "Q",
          "f": "f4x", "d": "d"}


@pytest.mark.skipif(not HAS_CC, reason="no C compiler or Python headers")
def test_launch_args_packs_each_kind_as_struct_does():
  from blutrain import dtypes
  from blutrain.backend.cuda.array import CudaArray
  function, calls = stand_in(slots=21)
  launch = launcher.c_launch_args(ctypes.cast(function, ctypes.c_void_p).value)
  x = CudaArray(0x7F00_0000_0200, (4,), (1,), dtypes.float32, 0, None)
  cases = [("p", x, x.ptr), ("p", 1 << 45, 1 << 45), ("p", None, 0), ("b", -128, -128), ("b", True, 1),
           ("h", -12345, -12345), ("i", -2**31, -2**31), ("i", np.int64(2**31 - 1), 2**31 - 1), ("q", -2**63, -2**63),
           ("B", 255, 255), ("H", 65535, 65535), ("I", 2**32 - 1, 2**32 - 1), ("Q", 2**64 - 1, 2**64 - 1),
           ("f", 0.1, 0.1), ("f", 3, 3.0), ("f", float("-inf"), float("-inf")), ("f", np.float32(2.5), 2.5),
           ("d", 0.1, 0.1), ("d", -7, -7.0)]
  kinds = "".join(k for k, _, _ in cases).encode()
  assert launch(HEAD, 0x5000, kinds, tuple(v for _, v, _ in cases)) == 0
  (call,) = calls
  assert call[0] == HEAD and call[1] == 0x5000 and call[3] is None
  got = call[4]
  assert len(got) == len(cases) + 2
  assert got[:-2] == [struct.pack("<" + STRUCT[k], want) for k, _, want in cases]
  assert got[-2:] == [bytes(8)] * 2  # Triton's scratch pointers, NULL


@pytest.mark.skipif(not HAS_CC, reason="no C compiler or Python headers")
@pytest.mark.parametrize("kinds, args, error", [
  (b"i", (2**31,), OverflowError), (b"i", (-2**31 - 1,), OverflowError), (b"b", (128,), OverflowError),
  (b"B", (-1,), OverflowError), (b"I", (2**32,), OverflowError), (b"Q", (2**64,), OverflowError),
  (b"f", (1e39,), OverflowError), (b"i", (1.5,), TypeError), (b"i", ("3",), TypeError), (b"f", ("x",), TypeError),
  (b"p", (object(),), TypeError), (b"p", (-1,), OverflowError), (b"pi", (0,), TypeError), (b"i", [3], TypeError),
  (b"z", (3,), TypeError)])
def test_launch_args_refuses_what_struct_refuses_before_launching(kinds, args, error):
  function, calls = stand_in()
  launch = launcher.c_launch_args(ctypes.cast(function, ctypes.c_void_p).value)
  with pytest.raises(error):
    launch(HEAD, 0x5000, kinds, args)
  assert calls == []


def test_kinds_of_parameter_types():
  assert launcher.kinds(["*fp32", "*bf16:16", "i32", "i64:16", "fp32", "fp64", "u8", "i1"]) == b"ppiqfdBb"
  assert launcher.kinds(["*fp32", "bf16"]) is None and launcher.kinds(["fp16"]) is None
