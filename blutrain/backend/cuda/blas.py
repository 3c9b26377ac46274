"""cuBLASLt through `nvmath.bindings.cublasLt` (raw pointers): one handle per device, a workspace per (device, stream)
from our allocator, and matmul plans (descriptor, layouts, heuristic's algorithm) cached per problem.

cuBLAS is column-major; `gemm` speaks its language: D (m x n, leading dim ldd) = op_a(A) @ op_b(B), each operand a
column-major matrix with a leading dim, batched by strides (0 broadcasts an operand over the batch). The row-major
mapping, transposes and batching of tensors live in kernels/matmul.py.
"""
from __future__ import annotations

import threading
from typing import Any, NamedTuple

import numpy as np

from blutrain import dtypes
from blutrain.backend.cuda import memory, runtime
from blutrain.dtypes import DType

WORKSPACE = 32 << 20  # bytes: what cuBLASLt's fastest Hopper kernels ask for (split-K, stream-K)

_lt: Any = None


def _cublaslt():
  """nvmath's cuBLASLt bindings, imported on first use so that the package imports without nvmath."""
  global _lt
  if _lt is None:
    import nvmath.bindings.cublasLt as lt
    _lt = lt
  return _lt


def _data_type(dtype: DType) -> int:
  from nvmath import CudaDataType as T
  types = {dtypes.float16: T.CUDA_R_16F, dtypes.bfloat16: T.CUDA_R_16BF, dtypes.float32: T.CUDA_R_32F,
           dtypes.float64: T.CUDA_R_64F}
  if dtype not in types:
    raise TypeError(f"matmul: cuBLASLt multiplies float16, bfloat16, float32 and float64 on CUDA, got {dtype.name}; "
                    f"convert with .float() first")
  return int(types[dtype])


def compute_type(dtype: DType, tf32: bool = False) -> tuple[int, int]:
  """(cublasComputeType_t, scale cudaDataType) for inputs of `dtype`: float32 accumulation for 16-bit inputs,
  TF32 tensor cores for float32 when `tf32` (the matmul's attribute), float64 for float64."""
  from nvmath import CudaDataType as T
  from nvmath.bindings.cublas import ComputeType as C
  if dtype is dtypes.float64: return int(C.COMPUTE_64F), int(T.CUDA_R_64F)
  if dtype is dtypes.float32 and tf32:
    return int(C.COMPUTE_32F_FAST_TF32), int(T.CUDA_R_32F)
  return int(C.COMPUTE_32F), int(T.CUDA_R_32F)


# *** handles and workspaces ***

_handles: dict[int, int] = {}
_workspaces: dict[tuple[int, int], Any] = {}  # (device, stream handle) -> CudaArray
_lock = threading.RLock()  # plan() creates the handle under it


def handle(device: int) -> int:
  """The device's cuBLASLt handle, created on first use (with the device's context current)."""
  h = _handles.get(device)
  if h is None:
    runtime.state(device)
    with _lock:
      h = _handles.get(device)
      if h is None: h = _handles[device] = _cublaslt().create()
  return h


def workspace(device: int, stream: runtime.Stream) -> Any:
  """The stream's workspace: cuBLASLt kernels on one stream run in order, so they can share it."""
  key = (device, stream.handle)
  ws = _workspaces.get(key)
  if ws is None: ws = _workspaces[key] = memory.empty((WORKSPACE // 8,), dtypes.int64, device, stream)
  return ws


# *** plans ***

class Problem(NamedTuple):
  """One cuBLASLt matmul, column-major: D (m x n) = op_a(A) @ op_b(B) (+ bias), `batch` matrices apart by the strides."""
  m: int
  n: int
  k: int
  trans_a: bool
  trans_b: bool
  lda: int
  ldb: int
  ldd: int
  batch: int
  stride_a: int
  stride_b: int
  stride_d: int
  dtype: DType        # of A, B and D
  compute: tuple[int, int]
  bias: bool          # a bias epilogue: D[i, j] += bias[i]
  align: tuple[int, int, int, int]  # pointer alignments of A, B, D, bias in bytes (up to 256)


class Plan:
  """A descriptor, four layouts and the heuristic's best algorithm for one Problem, kept for the process's life."""

  def __init__(self, p: Problem, device: int):
    lt = _cublaslt()
    attr, lattr, pattr = lt.MatmulDescAttribute, lt.MatrixLayoutAttribute, lt.MatmulPreferenceAttribute
    self.problem, dt = p, _data_type(p.dtype)
    self.desc = lt.matmul_desc_create(*p.compute)
    self._set(lt.matmul_desc_set_attribute, self.desc, attr.TRANSA, np.int32(int(p.trans_a)))
    self._set(lt.matmul_desc_set_attribute, self.desc, attr.TRANSB, np.int32(int(p.trans_b)))
    if p.bias:
      self._set(lt.matmul_desc_set_attribute, self.desc, attr.EPILOGUE, np.uint32(int(lt.Epilogue.BIAS)))
      self._set(lt.matmul_desc_set_attribute, self.desc, attr.BIAS_DATA_TYPE, np.int32(dt))
    shapes = {"a": (p.k, p.m) if p.trans_a else (p.m, p.k), "b": (p.n, p.k) if p.trans_b else (p.k, p.n), "d": (p.m, p.n)}
    lds, strides = {"a": p.lda, "b": p.ldb, "d": p.ldd}, {"a": p.stride_a, "b": p.stride_b, "d": p.stride_d}
    self.layouts = {}
    for name, (rows, cols) in shapes.items():
      lay = self.layouts[name] = lt.matrix_layout_create(dt, rows, cols, lds[name])
      if p.batch > 1:
        self._set(lt.matrix_layout_set_attribute, lay, lattr.BATCH_COUNT, np.int32(p.batch))
        self._set(lt.matrix_layout_set_attribute, lay, lattr.STRIDED_BATCH_OFFSET, np.int64(strides[name]))
    pref = lt.matmul_preference_create()
    try:
      self._set(lt.matmul_preference_set_attribute, pref, pattr.MAX_WORKSPACE_BYTES, np.uint64(WORKSPACE))
      for key, align in zip(("A", "B", "C", "D"), (p.align[0], p.align[1], p.align[2], p.align[2])):
        self._set(lt.matmul_preference_set_attribute, pref, getattr(pattr, f"MIN_ALIGNMENT_{key}_BYTES"), np.uint32(align))
      self.heuristic = lt.MatmulHeuristicResult(1)
      found = np.zeros(1, np.int32)
      lay = self.layouts
      lt.matmul_algo_get_heuristic(handle(device), self.desc, lay["a"], lay["b"], lay["d"], lay["d"], pref, 1,
                                   self.heuristic.ptr, found.ctypes.data)
    finally:
      lt.matmul_preference_destroy(pref)
    if found[0] == 0:
      raise RuntimeError(f"matmul: cuBLASLt has no algorithm for {p} on cuda:{device}")
    self.algo = self.heuristic.ptr  # the algorithm is the first field of the heuristic's result
    one = np.float64 if p.dtype is dtypes.float64 else np.float32
    self._scalars = np.ones(1, one), np.zeros(1, one)  # host alpha and beta, kept alive with the plan
    self.alpha, self.beta = self._scalars[0].ctypes.data, self._scalars[1].ctypes.data

  @staticmethod
  def _set(setter, obj: int, attr, value: np.generic) -> None:
    buf = np.array(value)
    setter(obj, int(attr), buf.ctypes.data, buf.itemsize)


_plans: dict[tuple[Problem, int], Plan] = {}
_bias_lock = threading.Lock()


def plan(p: Problem, device: int) -> Plan:
  """The Plan of a problem (created once; it also creates the device's handle)."""
  pl = _plans.get((p, device))
  if pl is None:
    with _lock:
      pl = _plans.get((p, device))
      if pl is None: pl = _plans[(p, device)] = Plan(p, device)
  return pl


def alignment(ptr: int) -> int:
  """The largest power of two up to 256 dividing ptr: cuBLASLt's heuristics assume 256 unless told otherwise."""
  return min(256, ptr & -ptr) if ptr else 256


def gemm(pl: Plan, a: int, b: int, d: int, device: int, bias: int = 0) -> None:
  """Queue D = op_a(A) @ op_b(B) (+ bias) of a plan on the current stream; a, b, d and bias are device addresses."""
  lt = _lt
  s = runtime.current_stream(device)
  ws = _workspaces.get((device, s.handle)) or workspace(device, s)
  if pl.problem.bias:
    with _bias_lock:  # NOTE: the bias pointer lives in the shared descriptor; set and launch together
      Plan._set(lt.matmul_desc_set_attribute, pl.desc, lt.MatmulDescAttribute.BIAS_POINTER, np.int64(bias))
      lt.matmul(_handles[device], pl.desc, pl.alpha, a, pl.layouts["a"], b, pl.layouts["b"], pl.beta, d,
                pl.layouts["d"], d, pl.layouts["d"], pl.algo, ws.ptr, WORKSPACE, s.handle)
    return
  lt.matmul(_handles[device], pl.desc, pl.alpha, a, pl.layouts["a"], b, pl.layouts["b"], pl.beta, d, pl.layouts["d"], d,
            pl.layouts["d"], pl.algo, ws.ptr, WORKSPACE, s.handle)
