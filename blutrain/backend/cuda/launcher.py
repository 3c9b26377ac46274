"""The driver's cuLaunchKernel as `launch(head, stream, params) -> CUresult`, the one call every kernel launch makes.

`head` is the tuple a kernel prepares once per grid: (CUfunction, grid x, y, z, block x, y, z, dynamic shared bytes),
all ints; `stream` is the CUstream handle and `params` the address of the array of parameter addresses (ints).

It is a small C extension (`SOURCE`), built on first use with Triton's build helper (the C compiler Triton's own
launcher needs; cached in Triton's cache directory, so a machine compiles it once) and handed the driver's
cuLaunchKernel as a function address. A call costs one Python-to-C call and the driver's own work: on the H200
machine 3.8 us against 4.7 us through ctypes (2026-12-03, 20,000 launches, best of 5), the difference being ctypes'
conversion of eleven arguments. Where no C compiler is found, the same call goes through ctypes. Both keep the GIL
during the call: releasing and taking it back cost 0.7 us of a launch, and a launch only waits when CUDA's launch
queue is full.
"""
from __future__ import annotations

import ctypes
import warnings
from typing import Callable

Launch = Callable[[tuple, int, int], int]

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef int (*launch_kernel_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                               void **, void **);

/* launch(head, stream, params), bound to the address of the cuLaunchKernel to call (its `self`): head = (function,
   grid x, y, z, block x, y, z, shared bytes), all ints */
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  if (n != 3 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != 8) {
    PyErr_SetString(PyExc_TypeError, "launch(head, stream, params): head is a tuple of 8 ints (function, grid x, y, "
                                     "z, block x, y, z, shared bytes), stream and params ints");
    return NULL;
  }
  launch_kernel_t launch_kernel = (launch_kernel_t)PyLong_AsVoidPtr(self);
  PyObject *head = args[0];
  unsigned dims[7];
  void *function = PyLong_AsVoidPtr(PyTuple_GET_ITEM(head, 0));
  for (int i = 0; i < 7; i++) dims[i] = (unsigned)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(head, i + 1));
  void *stream = PyLong_AsVoidPtr(args[1]);
  void **params = (void **)PyLong_AsVoidPtr(args[2]);
  if (PyErr_Occurred()) return NULL;
  return PyLong_FromLong(launch_kernel(function, dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6],
                                       stream, params, NULL));
}

static PyMethodDef launch_def = {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
                                 "launch(head, stream, params) -> CUresult"};

static PyObject *bind(PyObject *module, PyObject *address) {
  if (!PyLong_CheckExact(address) || PyLong_AsVoidPtr(address) == NULL) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bind(address): the address of a cuLaunchKernel");
    return NULL;
  }
  return PyCFunction_NewEx(&launch_def, address, NULL);
}

static PyMethodDef methods[] = {
  {"bind", bind, METH_O, "bind(address) -> launch: a launch calling the cuLaunchKernel at `address`"},
  {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "blutrain_launcher", NULL, -1, methods};
PyMODINIT_FUNC PyInit_blutrain_launcher(void) { return PyModule_Create(&module); }
"""

LAUNCH_ARGTYPES = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]


def build() -> Callable[[int], Launch]:
  """The C extension's `bind(address) -> launch`, compiled (or taken from Triton's cache) and loaded; raises when it
  cannot be built (no C compiler, no Python headers)."""
  from triton.runtime.build import compile_module_from_src
  return compile_module_from_src(SOURCE, "blutrain_launcher").bind


def c_launch(address: int) -> Launch:
  """`launch` calling the cuLaunchKernel-like C function at `address` (the driver's, or a test's stand-in)."""
  return build()(address)


def ctypes_launch(function) -> Launch:
  """`launch` through a ctypes function with cuLaunchKernel's signature (where the C extension cannot be built)."""
  function.argtypes, function.restype = LAUNCH_ARGTYPES, ctypes.c_int

  def launch(head: tuple, stream: int, params: int) -> int:
    return function(*head, stream, params, None)
  return launch


def best_launch(function) -> Launch:
  """`launch` on `function` (a ctypes function with cuLaunchKernel's signature): through the C extension, or through
  ctypes (with a warning saying why) where it does not build."""
  try:
    return c_launch(ctypes.cast(function, ctypes.c_void_p).value)
  except Exception as e:  # noqa: BLE001 (no compiler, headers or cache: any of them only costs speed)
    warnings.warn(f"blutrain: the C kernel launcher did not build ({type(e).__name__}: {e}); launching through "
                  f"ctypes, about 1 us slower a launch. Install a C compiler (gcc or clang) to build it.",
                  RuntimeWarning, stacklevel=2)
    return ctypes_launch(function)


def driver_launch() -> Launch:
  """`launch` on the driver's cuLaunchKernel (`best_launch`)."""
  return best_launch(ctypes.PyDLL("libcuda.so.1").cuLaunchKernel)
