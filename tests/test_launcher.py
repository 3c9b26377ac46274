"""The kernel launcher (blutrain/backend/cuda/launcher.py) on the CPU: the C extension and the ctypes path call a
stand-in for cuLaunchKernel with the same arguments; a launcher that does not build falls back with a warning."""
import ctypes
import os
import shutil
import sysconfig
from pathlib import Path

import pytest

from blutrain.backend.cuda import launcher

HAS_CC = bool(os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")) and \
  (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()  # what Triton's build helper needs
PROTOTYPE = ctypes.CFUNCTYPE(ctypes.c_int, *launcher.LAUNCH_ARGTYPES)
HEAD = (0xABC000, 3, 2, 1, 128, 1, 1, 49152)


def stand_in(result: int = 0):
  """A C-callable cuLaunchKernel that records what it was called with and returns `result`."""
  calls = []

  def record(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
    calls.append(((f, gx, gy, gz, bx, by, bz, shared), stream, params, extra))
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
  assert calls[0] == calls[1] == (HEAD, 0x5000, ctypes.addressof(addresses), None)
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
  assert calls == [(HEAD, 0x6000, ctypes.addressof(addresses), None)]


@pytest.mark.skipif(not HAS_CC, reason="no C compiler or Python headers")
def test_each_c_launcher_calls_its_own_driver_function():
  (first, first_calls), (second, second_calls) = stand_in(), stand_in(7)
  launch_first = launcher.c_launch(ctypes.cast(first, ctypes.c_void_p).value)
  launch_second = launcher.c_launch(ctypes.cast(second, ctypes.c_void_p).value)
  assert launch_second(HEAD, 1, 2) == 7 and launch_first(HEAD, 3, 4) == 0
  assert first_calls == [(HEAD, 3, 4, None)] and second_calls == [(HEAD, 1, 2, None)]
  with pytest.raises(ValueError, match="address of a cuLaunchKernel"):
    launcher.c_launch(0)
