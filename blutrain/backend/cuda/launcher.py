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

`launch_args(head, stream, kinds, args)` is the same call with the arguments themselves: the C code packs each into
an 8-byte parameter slot on its stack as its kernel parameter's kind says (`kinds`, one byte per parameter: "p" a
pointer, from a CudaArray's `ptr`, an int or None; "b h i q" and "B H I Q" signed and unsigned integers of 1, 2, 4, 8
bytes; "f" float32, "d" float64), adds Triton's two NULL scratch pointers and launches. It raises TypeError or
OverflowError where `struct` would (a value of the wrong type or out of its type's range) before launching anything.
In a training step's launches the packing and the Python around it cost more than the driver (the kernel's
per-signature `struct` packing, its thread's parameter buffer): see launch.Kernel.
"""
from __future__ import annotations

import ctypes
import functools
import warnings
from typing import Callable

from blutrain.backend.cuda.array import CudaArray

Launch = Callable[[tuple, int, int], int]
LaunchArgs = Callable[[tuple, int, bytes, tuple], int]

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef int (*launch_kernel_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                               void **, void **);

#define MAX_PARAMS 256
static PyObject *ptr_name;  /* "ptr", interned */

/* cuLaunchKernel at `address` with head = (function, grid x, y, z, block x, y, z, shared bytes), all ints; NULL with
   an exception set when an argument is malformed */
static PyObject *call_driver(PyObject *address, PyObject *head, PyObject *stream_handle, void **params) {
  if (!PyTuple_CheckExact(head) || PyTuple_GET_SIZE(head) != 8) {
    PyErr_SetString(PyExc_TypeError, "launch: head is a tuple of 8 ints (function, grid x, y, z, block x, y, z, "
                                     "shared bytes)");
    return NULL;
  }
  unsigned dims[7];
  void *function = PyLong_AsVoidPtr(PyTuple_GET_ITEM(head, 0));
  for (int i = 0; i < 7; i++) dims[i] = (unsigned)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(head, i + 1));
  void *stream = PyLong_AsVoidPtr(stream_handle);
  if (PyErr_Occurred()) return NULL;
  launch_kernel_t launch_kernel = (launch_kernel_t)PyLong_AsVoidPtr(address);
  return PyLong_FromLong(launch_kernel(function, dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6],
                                       stream, params, NULL));
}

/* launch(head, stream, params), bound to the address of the cuLaunchKernel to call (its `self`) */
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  if (n != 3) {
    PyErr_SetString(PyExc_TypeError, "launch(head, stream, params): head a tuple of 8 ints, stream and params ints");
    return NULL;
  }
  void **params = (void **)PyLong_AsVoidPtr(args[2]);
  if (PyErr_Occurred()) return NULL;
  return call_driver(self, args[0], args[1], params);
}

/* One argument into its 8-byte slot as the kernel's parameter `kind` reads it (`KINDS`): a pointer from a CudaArray
   (`array_type`, its `ptr`), an int or None; an integer in its type's range; a float32 or float64. TypeError or
   OverflowError for anything else, as `struct` raises them. */
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the parameter slots hold little-endian values, as the GPU reads them"
#endif

/* the bytes of an integer kind */
static int width(char kind) {
  switch (kind) { case 'b': case 'B': return 1; case 'h': case 'H': return 2; case 'i': case 'I': return 4; }
  return 8;
}

static int out_of_range(void) {
  PyErr_SetString(PyExc_OverflowError, "integer argument out of its type's range");
  return -1;
}

static int pack(char kind, PyObject *v, PyObject *array_type, uint64_t *slot) {
  long long i = 0;
  unsigned long long u = 0;
  double d = 0;
  switch (kind) {
    case 'p':
      if (v == Py_None) { *slot = 0; return 0; }
      if ((PyObject *)Py_TYPE(v) == array_type) {
        PyObject *ptr = PyObject_GetAttr(v, ptr_name);
        if (ptr == NULL) return -1;
        u = PyLong_AsUnsignedLongLong(ptr);
        Py_DECREF(ptr);
      } else if (PyLong_Check(v)) u = PyLong_AsUnsignedLongLong(v);
      else { PyErr_SetString(PyExc_TypeError, "a pointer argument takes a CudaArray, an int or None"); return -1; }
      if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1;
      *slot = u;
      return 0;
    case 'b': case 'h': case 'i': case 'q':  /* the value's low `width` bytes: little-endian two's complement */
      i = PyLong_AsLongLong(v);
      if (i == -1 && PyErr_Occurred()) return -1;
      if (width(kind) < 8 && (i < -(1LL << (8 * width(kind) - 1)) || i >= (1LL << (8 * width(kind) - 1))))
        return out_of_range();
      memcpy(slot, &i, width(kind));
      return 0;
    case 'B': case 'H': case 'I': case 'Q':
      if (PyLong_Check(v)) u = PyLong_AsUnsignedLongLong(v);  /* OverflowError when negative */
      else {
        PyObject *index = PyNumber_Index(v);
        if (index == NULL) return -1;
        u = PyLong_AsUnsignedLongLong(index);
        Py_DECREF(index);
      }
      if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1;
      if (width(kind) < 8 && u >> (8 * width(kind))) return out_of_range();
      memcpy(slot, &u, width(kind));
      return 0;
    case 'f': case 'd':
      d = PyFloat_AsDouble(v);
      if (d == -1.0 && PyErr_Occurred()) return -1;
      if (kind == 'd') { memcpy(slot, &d, 8); return 0; }
      float f = (float)d;
      if (isinf(f) && isfinite(d)) {
        PyErr_SetString(PyExc_OverflowError, "float too large for a float32 argument");
        return -1;
      }
      memcpy(slot, &f, 4);
      return 0;
  }
  PyErr_Format(PyExc_TypeError, "unknown argument kind %c", kind);
  return -1;
}

/* launch_args(head, stream, kinds, args), bound to (the address of the cuLaunchKernel to call, the CudaArray type):
   packs args (a tuple, one per byte of `kinds`) into 8-byte slots on the stack, two NULL scratch pointers after
   them, and launches */
static PyObject *launch_args(PyObject *self, PyObject *const *args, Py_ssize_t n) {
  if (n != 4 || !PyBytes_CheckExact(args[2]) || !PyTuple_CheckExact(args[3])) {
    PyErr_SetString(PyExc_TypeError, "launch_args(head, stream, kinds, args): kinds bytes, args a tuple");
    return NULL;
  }
  const char *kinds = PyBytes_AS_STRING(args[2]);
  Py_ssize_t count = PyBytes_GET_SIZE(args[2]);
  if (PyTuple_GET_SIZE(args[3]) != count || count + 2 > MAX_PARAMS) {
    PyErr_Format(PyExc_TypeError, "launch_args: %zd arguments for %zd parameters", PyTuple_GET_SIZE(args[3]), count);
    return NULL;
  }
  uint64_t slots[MAX_PARAMS];
  void *params[MAX_PARAMS];
  PyObject *array_type = PyTuple_GET_ITEM(self, 1);
  for (Py_ssize_t i = 0; i < count; i++) {
    slots[i] = 0;
    if (pack(kinds[i], PyTuple_GET_ITEM(args[3], i), array_type, &slots[i]) < 0) return NULL;
    params[i] = &slots[i];
  }
  slots[count] = slots[count + 1] = 0;
  params[count] = &slots[count];
  params[count + 1] = &slots[count + 1];
  return call_driver(PyTuple_GET_ITEM(self, 0), args[0], args[1], params);
}

static PyMethodDef launch_def = {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
                                 "launch(head, stream, params) -> CUresult"};
static PyMethodDef launch_args_def = {"launch_args", (PyCFunction)(void (*)(void))launch_args, METH_FASTCALL,
                                      "launch_args(head, stream, kinds, args) -> CUresult"};

static int is_address(PyObject *address) {
  if (PyLong_CheckExact(address) && PyLong_AsVoidPtr(address) != NULL) return 1;
  if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bind(address): the address of a cuLaunchKernel");
  return 0;
}

static PyObject *bind(PyObject *module, PyObject *address) {
  return is_address(address) ? PyCFunction_NewEx(&launch_def, address, NULL) : NULL;
}

static PyObject *bind_args(PyObject *module, PyObject *const *args, Py_ssize_t n) {
  if (n != 2 || !PyType_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "bind_args(address, array_type)");
    return NULL;
  }
  if (!is_address(args[0])) return NULL;
  PyObject *bound = PyTuple_Pack(2, args[0], args[1]);
  if (bound == NULL) return NULL;
  PyObject *f = PyCFunction_NewEx(&launch_args_def, bound, NULL);
  Py_DECREF(bound);
  return f;
}

static PyMethodDef methods[] = {
  {"bind", bind, METH_O, "bind(address) -> launch: a launch calling the cuLaunchKernel at `address`"},
  {"bind_args", (PyCFunction)(void (*)(void))bind_args, METH_FASTCALL,
   "bind_args(address, array_type) -> launch_args: packing the arguments, then calling the cuLaunchKernel at `address`"},
  {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "blutrain_launcher", NULL, -1, methods};
PyMODINIT_FUNC PyInit_blutrain_launcher(void) {
  ptr_name = PyUnicode_InternFromString("ptr");
  return ptr_name == NULL ? NULL : PyModule_Create(&module);
}
"""

LAUNCH_ARGTYPES = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]


# the kind of each Triton parameter type that `launch_args` packs (half-precision scalars it does not: their kernels
# pack in Python, see launch.Kernel)
KINDS = {"i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "q", "u1": "B", "u8": "B", "u16": "H", "u32": "I",
         "u64": "Q", "fp32": "f", "f32": "f", "fp64": "d"}


def kinds(types: list[str]) -> bytes | None:
  """The `kinds` string of parameters of these Triton types ("*..." a pointer), or None when one has no kind."""
  out = [("p" if t[0] == "*" else KINDS.get(t.split(":")[0])) for t in types]
  return None if None in out else "".join(out).encode()


@functools.cache
def build():
  """The C extension (`bind`, `bind_args`), compiled (or taken from Triton's cache) and loaded; raises when it cannot
  be built (no C compiler, no Python headers)."""
  from triton.runtime.build import compile_module_from_src
  return compile_module_from_src(SOURCE, "blutrain_launcher")


def c_launch(address: int) -> Launch:
  """`launch` calling the cuLaunchKernel-like C function at `address` (the driver's, or a test's stand-in)."""
  return build().bind(address)


def c_launch_args(address: int) -> LaunchArgs:
  """`launch_args` calling the cuLaunchKernel-like C function at `address`: the arguments packed in C."""
  return build().bind_args(address, CudaArray)


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


def _driver_function():
  return ctypes.PyDLL("libcuda.so.1").cuLaunchKernel


def driver_launch() -> Launch:
  """`launch` on the driver's cuLaunchKernel (`best_launch`)."""
  return best_launch(_driver_function())


def driver_launch_args() -> LaunchArgs | None:
  """`launch_args` on the driver's cuLaunchKernel, or None where the C extension does not build (`driver_launch`
  warns of that)."""
  try:
    return c_launch_args(ctypes.cast(_driver_function(), ctypes.c_void_p).value)
  except Exception:  # noqa: BLE001 (as in best_launch)
    return None
