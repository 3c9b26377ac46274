"""`matmul` on CUDA through cuBLASLt (`nvmath.bindings.cublasLt`, raw pointers), the path of
`bt.backends.matmul = "cublas"` and of every float64 matmul: one handle per device, a workspace per (device, stream)
from our allocator, matmul plans (descriptor, layouts, heuristic's algorithm) cached per problem, and the mapping of
row-major tensors onto cuBLAS's column-major operands, with no copies.

cuBLAS is column-major: a `Problem` is D (m x n, leading dim ldd) = op_a(A) @ op_b(B), each operand a column-major
matrix with a leading dim, batched by strides (0 broadcasts an operand over the batch). A row-major (m x k) matrix is
a column-major (k x m) one, so C = A B is computed as C^T = B^T A^T: cuBLAS's first operand is our B, its second our
A, and D (n x m, column-major) is our contiguous C. An operand whose last two dims are row-major is used as is (op N)
and one stored transposed (`x.mT` of a contiguous tensor, stride 1 in dim -2) as op T, each with its own leading dim;
only a matrix with neither unit stride (or overlapping rows) is copied.

Batch dims broadcast: they collapse into as few dims as the strides allow (a broadcast operand gets stride 0, which
cuBLASLt takes as "the same matrix for every batch"); the innermost collapsed dim is cuBLASLt's strided batch and
any outer ones loop on the host. A weight shared by the batch (b 2-D or broadcast) with a row-major A folds the
batch into the rows: one large GEMM instead of many small ones.

With `bt.backends.matmul = "triton"`, float32 and 16-bit matmuls run as synthesized Triton GEMMs instead (gemm/).
Nova's `gemm` op (a matmul with the ops after it, fuse-gemm) runs here too, by the path its codegen chose: cuBLASLt
and a kernel per step its epilogue cannot do, or one synthesized GEMM with the whole epilogue (`fused_gemm`).
"""
from __future__ import annotations

import itertools
import math
import threading
from typing import Any, NamedTuple

import numpy as np

from blutrain import backends, dtypes
from blutrain.backend.cuda import memory, runtime
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import broadcast_shape, broadcast_strides, collapse, empty
from blutrain.backend.cuda.kernels.copy import cast, copy
from blutrain.backend.cuda.kernels.gemm import gemm
from blutrain.backend.cuda.kernels.matrix import blas_layout, blas_operand
from blutrain.backend.cuda.kernels.reduce import gelu_backward_sums, reduce
from blutrain.configurator import CUBLAS_GELU_EPILOGUES
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
  if ws is None:
    with memory.kept(): ws = _workspaces[key] = memory.empty((WORKSPACE // 8,), dtypes.int64, device, stream)
  return ws


# *** plans ***

class Problem(NamedTuple):
  """One cuBLASLt matmul, column-major: D (m x n) = op_a(A) @ op_b(B) and its epilogue, `batch` matrices apart by the
  strides."""
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
  dtype: DType        # of A and B
  out_dtype: DType    # of D (and of the bias or bias gradient)
  compute: tuple[int, int]
  epilogue: str       # "" none, "bias" adds bias[i] to D[i, j], "bgradb" writes sum_k B[k, j] to bias[j]; GELU's
                      # (tanh form): "gelu[_aux][_bias]" D = GELU(AB [+ bias]), the aux matrix AB [+ bias];
                      # "dgelu" D = AB GELU'(aux)
  align: tuple[int, int, int, int]  # pointer alignments of A, B, D, bias in bytes (up to 256)


AUX_EPILOGUES = ("gelu_aux", "gelu_aux_bias", "dgelu")  # write or read an aux matrix laid out as D


class Plan:
  """A descriptor, four layouts and the heuristic's best algorithm for one Problem, kept for the process's life."""

  def __init__(self, p: Problem, device: int):
    lt = _cublaslt()
    attr, lattr, pattr = lt.MatmulDescAttribute, lt.MatrixLayoutAttribute, lt.MatmulPreferenceAttribute
    self.problem, dt, out = p, _data_type(p.dtype), _data_type(p.out_dtype)
    self.desc = lt.matmul_desc_create(*p.compute)
    self._set(lt.matmul_desc_set_attribute, self.desc, attr.TRANSA, np.int32(int(p.trans_a)))
    self._set(lt.matmul_desc_set_attribute, self.desc, attr.TRANSB, np.int32(int(p.trans_b)))
    if p.epilogue:
      self._set(lt.matmul_desc_set_attribute, self.desc, attr.EPILOGUE, np.uint32(int(lt.Epilogue[p.epilogue.upper()])))
      if p.epilogue in ("bias", "bgradb") or p.epilogue.endswith("_bias"):
        self._set(lt.matmul_desc_set_attribute, self.desc, attr.BIAS_DATA_TYPE, np.int32(out))
      if p.epilogue in AUX_EPILOGUES:
        self._set(lt.matmul_desc_set_attribute, self.desc, attr.EPILOGUE_AUX_LD, np.int64(p.ldd))
        if p.batch > 1:
          self._set(lt.matmul_desc_set_attribute, self.desc, attr.EPILOGUE_AUX_BATCH_STRIDE, np.int64(p.stride_d))
    shapes = {"a": (p.k, p.m) if p.trans_a else (p.m, p.k), "b": (p.n, p.k) if p.trans_b else (p.k, p.n), "d": (p.m, p.n)}
    lds, strides = {"a": p.lda, "b": p.ldb, "d": p.ldd}, {"a": p.stride_a, "b": p.stride_b, "d": p.stride_d}
    self.layouts = {}
    for name, (rows, cols) in shapes.items():
      lay = self.layouts[name] = lt.matrix_layout_create(out if name == "d" else dt, rows, cols, lds[name])
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
      try:
        lt.matmul_algo_get_heuristic(handle(device), self.desc, lay["a"], lay["b"], lay["d"], lay["d"], pref, 1,
                                     self.heuristic.ptr, found.ctypes.data)
      except lt.cuBLASLtError as e:  # an epilogue or type it does not take with the others (INVALID_VALUE)
        raise NoAlgorithm(f"matmul: cuBLASLt takes no {p} on cuda:{device}: {e}") from e
    finally:
      lt.matmul_preference_destroy(pref)
    if found[0] == 0:
      raise NoAlgorithm(f"matmul: cuBLASLt has no algorithm for {p} on cuda:{device}")
    self.algo = self.heuristic.ptr  # the algorithm is the first field of the heuristic's result
    one = np.float64 if p.dtype is dtypes.float64 else np.float32
    self._scalars = np.ones(1, one), np.zeros(1, one)  # host alpha and beta, kept alive with the plan
    self.alpha, self.beta = self._scalars[0].ctypes.data, self._scalars[1].ctypes.data

  @staticmethod
  def _set(setter, obj: int, attr, value: np.generic) -> None:
    buf = np.array(value)
    setter(obj, int(attr), buf.ctypes.data, buf.itemsize)


class NoAlgorithm(RuntimeError):
  """cuBLASLt's heuristic found no kernel for a problem (an epilogue it does not offer for these layouts)."""


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


def alignment(ptr: int, byte_strides=()) -> int:
  """The largest power of two up to 256 dividing ptr and every stride (each matrix of a batch is that aligned):
  cuBLASLt's heuristics assume 256 unless told otherwise."""
  bits = ptr
  for s in byte_strides: bits |= abs(s)
  return min(256, bits & -bits) if bits else 256


def enqueue(pl: Plan, a: int, b: int, d: int, device: int, bias: int = 0, aux: int = 0) -> None:
  """Queue D = op_a(A) @ op_b(B) and the epilogue of a plan on the current stream; a, b, d, bias (the bias or the
  bias gradient) and aux (GELU's input, `AUX_EPILOGUES`) are device addresses."""
  lt = _lt
  s = runtime.current_stream(device)
  ws = _workspaces.get((device, s.handle)) or workspace(device, s)
  if pl.problem.epilogue:
    with _bias_lock:  # NOTE: the bias and aux pointers live in the shared descriptor; set and launch together
      Plan._set(lt.matmul_desc_set_attribute, pl.desc, lt.MatmulDescAttribute.BIAS_POINTER, np.int64(bias))
      if aux: Plan._set(lt.matmul_desc_set_attribute, pl.desc, lt.MatmulDescAttribute.EPILOGUE_AUX_POINTER, np.int64(aux))
      lt.matmul(_handles[device], pl.desc, pl.alpha, a, pl.layouts["a"], b, pl.layouts["b"], pl.beta, d,
                pl.layouts["d"], d, pl.layouts["d"], pl.algo, ws.ptr, WORKSPACE, s.handle)
    return
  lt.matmul(_handles[device], pl.desc, pl.alpha, a, pl.layouts["a"], b, pl.layouts["b"], pl.beta, d, pl.layouts["d"], d,
            pl.layouts["d"], pl.algo, ws.ptr, WORKSPACE, s.handle)


# *** row-major tensors as column-major operands ***

def gemm_calls(a: CudaArray, b: CudaArray, out: CudaArray, bias: CudaArray | None,
               compute: tuple[int, int], epilogue: str = "") -> tuple[Problem, list[tuple[int, int, int]]]:
  """The cuBLASLt problem computing out = a @ b and the epilogue ("bias": + bias; "bgradb": bias = the sums of a's
  rows, cuBLAS's B being our a) and, per host-loop step, the byte offsets of cuBLAS's A, B and D from b's, a's and
  out's addresses; a and b have BLAS layouts (`blas_layout` is not None), out is contiguous, k > 0. Pure: it depends
  on the layouts and the addresses' alignments only, so its result is cached."""
  (m, k), n = a.shape[-2:], b.shape[-1]
  (trans_a, lda), (trans_b, ldb) = blas_layout(a), blas_layout(b)
  batch = out.shape[:-2]
  a_bs = broadcast_strides(CudaArray(a.ptr, a.shape[:-2], a.strides[:-2], a.dtype, a.device, None), batch)
  b_bs = broadcast_strides(CudaArray(b.ptr, b.shape[:-2], b.strides[:-2], b.dtype, b.device, None), batch)
  d_bs = out.strides[:-2]
  rows = m
  if not trans_a and not any(b_bs):  # a weight shared by the batch: fold the batch into A's rows
    shape, (st,) = collapse(batch + (m,), a_bs + (lda,))
    if len(shape) == 1 and (shape[0] == 1 or st[0] >= k):  # (rows of one stride, not a broadcast row)
      rows, lda = shape[0], (st[0] if shape[0] > 1 else lda)
      batch, a_bs, b_bs, d_bs = (), (), (), ()
  dims, (a_st, b_st, d_st) = collapse(batch, a_bs, b_bs, d_bs) if batch else ((1,), [(0,), (0,), (0,)])
  align = [alignment(x.ptr, [s * x.dtype.itemsize for s in st]) for x, st in ((a, a_st), (b, b_st), (out, d_st))]
  if dims[-1] == 1: a_st, b_st, d_st = a_st[:-1] + (0,), b_st[:-1] + (0,), d_st[:-1] + (0,)  # one matrix: no stride
  # cuBLAS's first operand is our B, its second our A (C^T = B^T A^T)
  p = Problem(n, rows, k, trans_b, trans_a, ldb, lda, n, dims[-1], b_st[-1], a_st[-1], d_st[-1], a.dtype, out.dtype,
              compute, epilogue or ("bias" if bias is not None else ""),
              (align[1], align[0], align[2], 256 if bias is None else alignment(bias.ptr)))
  calls = []
  for idx in itertools.product(*(range(d) for d in dims[:-1])):
    off = [sum(i * s for i, s in zip(idx, st[:-1])) * x.dtype.itemsize for x, st in ((a, a_st), (b, b_st), (out, d_st))]
    calls.append((off[1], off[0], off[2]))
  return p, calls


def _check(op: str, a: CudaArray, b: CudaArray) -> None:
  if a.dtype is not b.dtype or a.device != b.device:
    raise TypeError(f"{op}: operands must share dtype and device, got {a.dtype.name} on cuda:{a.device} and "
                    f"{b.dtype.name} on cuda:{b.device}")
  if not a.dtype.is_floating_point:
    raise RuntimeError(f"{op}: {a.dtype.name} matmul of {a.shape} and {b.shape} is not supported on CUDA (as in "
                       f"PyTorch); convert the operands with .float()")


_calls: dict[tuple, tuple[Plan, list[tuple[int, int, int]]]] = {}  # layouts -> plan and offsets


def _matmul(a: CudaArray, b: CudaArray, bias: CudaArray | None, tf32: bool, out: CudaArray | None = None,
            epilogue: str = "", aux: CudaArray | None = None) -> CudaArray:
  """a @ b (+ bias) into a new array, or into `out` (contiguous, of the result's shape and a's dtype or a wider one);
  with epilogue "bgradb", `bias` receives the sums of a's rows instead; with a GELU epilogue (`Problem.epilogue`)
  `aux` (contiguous, out's shape and dtype) is GELU's input, written or read."""
  if out is None: out = empty(broadcast_shape(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), a.dtype, a.device)
  if out.size == 0: return out
  if a.shape[-1] == 0:  # an empty sum: zeros, or the bias
    if bias is None or epilogue == "bgradb": memory.zero(out)
    else: memory.copy_into(out, bias)
    if epilogue == "bgradb": memory.zero(bias)
    return out
  a, b = blas_operand(a), blas_operand(b)
  key = (a.shape, a.strides, b.shape, b.strides, a.dtype, out.dtype, epilogue, tf32, a.ptr & 255,
         b.ptr & 255, out.ptr & 255, -1 if bias is None else bias.ptr & 255, out.device)
  hit = _calls.get(key)
  if hit is None:
    p, offsets = gemm_calls(a, b, out, bias, compute_type(a.dtype, tf32), epilogue)
    hit = _calls[key] = (plan(p, out.device), offsets)
  pl, offsets = hit
  bias_ptr, aux_ptr = 0 if bias is None else bias.ptr, 0 if aux is None else aux.ptr
  for oa, ob, od in offsets: enqueue(pl, b.ptr + oa, a.ptr + ob, out.ptr + od, out.device, bias_ptr,
                                        aux_ptr and aux_ptr + od)
  return out


_TRITON_DTYPES = (dtypes.float32, dtypes.bfloat16, dtypes.float16)  # what bt.backends.matmul = "triton" takes


def matmul(a: CudaArray, b: CudaArray, tf32: bool = False, out: CudaArray | None = None) -> CudaArray:
  """a @ b over broadcast batch dims (the op library passes both operands with at least 2 dims); float32 through TF32
  tensor cores when `tf32`; into `out` when given (contiguous, of the result's shape and a's dtype)."""
  _check("matmul", a, b)
  if backends.matmul == "triton" and a.dtype in _TRITON_DTYPES:
    return gemm(a, b, out=out, precision="tf32" if tf32 else None)
  return _matmul(a, b, None, tf32, out)


def matmul_bias(a: CudaArray, b: CudaArray, bias: CudaArray, tf32: bool = False, out: CudaArray | None = None) -> CudaArray:
  """a @ b + bias (bias of shape (n,)) with the bias added in cuBLASLt's epilogue, not by another kernel (into `out`
  when given, contiguous)."""
  _check("matmul_bias", a, b)
  if bias.shape != (b.shape[-1],):
    raise ValueError(f"matmul_bias: bias of shape {bias.shape} for an output with {b.shape[-1]} columns")
  return _matmul(a, b, _bias_operand(bias, a.dtype), tf32, out)


def _bias_operand(bias: CudaArray, dtype: DType) -> CudaArray:
  """A bias as cuBLASLt's epilogue reads it: in the operands' dtype, one unit stride (else a cast copy)."""
  return bias if bias.dtype is dtype and bias.strides == (1,) else cast(bias, dtype)


def _transposed(a: CudaArray) -> CudaArray:
  """The transposed view of a matrix."""
  return CudaArray(a.ptr, a.shape[::-1], a.strides[::-1], a.dtype, a.device, a.owner)


def _rows(a: CudaArray) -> CudaArray:
  """a (..., K) as a (rows, K) matrix: a view when its leading dims collapse to one stride, else a copy's."""
  if a.ndim == 2: return a
  shape, (st,) = collapse(a.shape[:-1], a.strides[:-1])
  if len(shape) != 1:
    a = copy(a)
    shape, st = (math.prod(a.shape[:-1]),), (a.shape[-1],)
  return CudaArray(a.ptr, (shape[0], a.shape[-1]), (st[0], a.strides[-1]), a.dtype, a.device, a.owner)


def linear(x: CudaArray, weight: CudaArray, bias: CudaArray | None = None, tf32: bool = False) -> CudaArray:
  """x @ weight^T (+ bias) as nn.Linear (`ops.nn.linear_op`): one GEMM, whose epilogue adds the bias: cuBLASLt's
  (rounding once), or the synthesized GEMM's with `bt.backends.matmul = "triton"` (rounding as matmul and add)."""
  wt = _transposed(weight)
  if bias is None: return matmul(x, wt, tf32)
  if backends.matmul == "triton" and x.dtype in _TRITON_DTYPES:
    return fused_gemm(x, wt, bias, epilogue="bias", dtype=x.dtype, tf32=tf32, path="nova")[0]
  return matmul_bias(x, wt, bias, tf32)


def linear_backward(g: CudaArray, x: CudaArray, weight: CudaArray, *, bias: bool, input_grad: bool, weight_grad: bool,
                    tf32: bool = False) -> tuple:
  """linear's gradients (`ops.nn.linear_backward_op`): dx = g W, dW = g^T x and db from one GEMM with its BGRADB
  epilogue (the `weight_grad` op's kernel), db alone from a reduction of g's rows."""
  dx = matmul(g, weight, tf32) if input_grad else None
  g2 = _rows(g)
  if weight_grad:
    dw, *db = KERNELS["weight_grad"](_transposed(g2), _rows(x), dtype=weight.dtype, bias_grad=bias, tf32=tf32)
    return dx, dw, db[0] if db else None
  return dx, None, reduce(g2, (0,), False, "sum", weight.dtype) if bias else None


_without_bgradb: set[tuple] = set()  # weight_grad problems for which cuBLASLt offers no BGRADB kernel


def weight_grad(a: CudaArray, b: CudaArray, *, dtype: DType, bias_grad: bool, tf32: bool = False) -> tuple:
  """Nova's weight-gradient GEMM (`ops.linalg.weight_grad_op`): a @ b stored in `dtype` from cuBLASLt's float32
  accumulator and, with `bias_grad`, the sums of a's rows from its BGRADB epilogue in the same cuBLASLt call (on the
  H200 a second kernel of cuBLASLt's own), or from a reduction where cuBLASLt offers no such kernel for these
  layouts."""
  _check("weight_grad", a, b)
  out = empty((a.shape[0], b.shape[1]), dtype, a.device)
  if not bias_grad: return (_matmul(a, b, None, tf32, out),)
  db = empty((a.shape[0],), dtype, a.device)
  problem = (a.shape, a.strides, b.shape, b.strides, a.dtype, dtype, tf32, a.device)
  if problem not in _without_bgradb:
    try: return _matmul(a, b, db, tf32, out, "bgradb"), db
    except NoAlgorithm: _without_bgradb.add(problem)  # asked once: the heuristic's answer does not change
  _matmul(a, b, None, tf32, out)
  memory.copy_into(db, reduce(a, (1,), False, "sum", dtype))
  return out, db


_HALVES = (dtypes.bfloat16, dtypes.float16)


def _results(a: CudaArray, b: CudaArray, steps: tuple[str, ...], dtype: DType) -> tuple[CudaArray, ...]:
  """The gemm op's results, allocated first and in order (the output, then the saved values), so that a step replayed
  on a static memory plan gets each at its planned offset (the plan's slots go by size, in allocation order) and
  the temporaries after them take none."""
  shape = broadcast_shape(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
  return (empty(shape, dtype, a.device),) + tuple(empty(shape, a.dtype, a.device) for s in steps if s == "save")


def _separately(a: CudaArray, b: CudaArray, xs: tuple, steps: tuple[str, ...], dtype: DType, tf32: bool,
                sums: bool) -> tuple:
  """The gemm op through cuBLASLt, with its bias epilogue, and then the elementwise kernels of the other steps, as
  eager mode runs them; each stage writes the saved value or the output into its result array. With half operands
  the epilogue adds the bias to the float32 accumulator and rounds once, where eager mode rounds the product and then
  the sum (within one half ulp of eager's; PyTorch's addmm rounds once too): one pass over the output fewer. With
  `sums` a final GELU backward's kernel also sums the output's columns (else a reduction does)."""
  from blutrain.backend.cuda.kernels.elementwise import KERNELS as EW
  fused = _gelu_epilogue(a, b, xs, steps, dtype, tf32, sums)
  if fused is not None: return fused
  out, *saved = _results(a, b, steps, dtype)
  xs = iter(xs)
  bias = next(xs) if steps[:1] == ("bias",) else None
  rest = steps[1:] if bias is not None else steps
  stages = [s for s in rest if s != "save"]
  saved_stage = rest.index("save") if "save" in rest else -1  # the steps before it, one stage each
  # where each stage (0 the product, then each step) writes: the saved value, else the output (the steps after it
  # then run in place there), or a temporary when the output's dtype is not the stage's (a float32 residual sum)
  inner = out if out.dtype is a.dtype else None
  dests = [saved[0] if i == saved_stage else out if i == len(stages) else inner for i in range(len(stages) + 1)]
  y = _matmul(a, b, None, tf32, dests[0]) if bias is None else matmul_bias(a, b, bias, tf32, dests[0])
  total = None
  for step, dest in zip(stages, dests[1:]):
    approximate = "tanh" if step.endswith("tanh") else "none"
    if step == "bias": y = EW["add"](y, next(xs), out=dest)
    elif step.startswith("gelu_backward") and sums: y, total = gelu_backward_sums(y, next(xs), approximate, out=dest)
    elif step.startswith("gelu_backward"): y = EW["gelu_backward"](y, next(xs), approximate=approximate, out=dest)
    elif step.startswith("gelu"): y = EW["gelu"](y, approximate=approximate, out=dest)
    else:  # residual: add's result takes its first operand's dtype, and IEEE addition commutes
      r = next(xs)
      y = EW["add"](y, r, out=dest) if dtype is y.dtype else EW["add"](r, y, out=dest)
  return (out, *saved) + ((_column_sums(out) if total is None else total,) if sums else ())


_without_gelu: set[tuple] = set()  # problems for which cuBLASLt offers no kernel with that GELU epilogue


def _gelu_epilogue(a: CudaArray, b: CudaArray, xs: tuple, steps: tuple[str, ...], dtype: DType, tf32: bool,
                   sums: bool) -> tuple | None:
  """The gemm op in one cuBLASLt call when its steps are a tanh GELU (after the bias, its input saved) or a tanh
  GELU's backward without column sums (`configurator.CUBLAS_GELU_EPILOGUES`), on half operands and output; None
  otherwise or where cuBLASLt has no such kernel. GELU is applied to the float32 accumulator (plus the bias) and
  rounded once, its saved input rounded apart; the backward multiplies the float32 product by GELU'(saved input):
  one rounding fewer than the separate kernels, which round the product first."""
  name = CUBLAS_GELU_EPILOGUES.get(steps)
  if name is None or sums or a.dtype not in _HALVES or dtype is not a.dtype or a.shape[-1] == 0: return None
  shape = broadcast_shape(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
  x = xs[0] if xs else None
  if name == "dgelu" and (x.dtype is not dtype or x.shape != shape or not x.is_contiguous() or x.ptr % 16): return None
  key = (a.shape, a.strides, b.shape, b.strides, a.dtype, name, tf32, a.device)
  if key in _without_gelu or 0 in shape: return None
  out, *saved = _results(a, b, steps, dtype)
  bias = None if x is None or name == "dgelu" else _bias_operand(x, a.dtype)
  try: _matmul(a, b, bias, tf32, out, name, x if name == "dgelu" else saved[0] if saved else None)
  except NoAlgorithm:  # asked once: the heuristic's answer does not change
    _without_gelu.add(key)
    return None
  return (out, *saved)


def _column_sums(out: CudaArray) -> CudaArray:
  """The sums of `out` over all its dims but the last, in float32 (float64 for float64): a reduction reading it."""
  return reduce(out, tuple(range(out.ndim - 1)), False, "sum",
                dtypes.float64 if out.dtype is dtypes.float64 else dtypes.float32)


def _synthesized(a: CudaArray, b: CudaArray, xs: tuple, steps: tuple[str, ...], dtype: DType, tf32: bool) -> tuple:
  """The gemm op as one synthesized GEMM whose epilogue does every step, rounding the float32 accumulator to the
  operands' half type wherever the unfused ops rounded (after the product, the bias and the GELU)."""
  out, *saved = _results(a, b, steps, dtype)
  epilogue, tensors, half = [], {}, a.dtype in _HALVES
  xs = iter(xs)
  if half and steps: epilogue.append("round")
  for i, step in enumerate(steps):
    epilogue.append(step)
    if step == "save": tensors["saved"] = saved[0]
    elif step == "bias": tensors["bias"] = next(xs)
    elif step == "residual": tensors["residual"] = next(xs)
    elif step.startswith("gelu_backward"): tensors["gelu_input"] = next(xs)
    if half and step in ("bias", "gelu", "gelu_tanh") and i + 1 < len(steps):
      epilogue.append("round")
  gemm(a, b, out=out, epilogue=tuple(epilogue), precision="tf32" if tf32 else None, out_dtype=dtype, **tensors)
  return (out, *saved)


def fused_gemm(a: CudaArray, b: CudaArray, *xs: CudaArray, epilogue: str, dtype: DType, tf32: bool = False,
               path: str = "cublas") -> tuple:
  """Nova's gemm op (`ops.linalg.gemm_op`): a @ b and the epilogue steps, by `path`: "cublas" (cuBLASLt, then a
  kernel per step its epilogue cannot do) or "nova" (one synthesized GEMM); Nova's codegen passes the configurator's
  choice (`configurator.gemm_choice`). Returns the output, then the saved values, then with a final "bias_grad" step
  the output's column sums (from the GELU backward's kernel on the cuBLASLt path; a reduction after the synthesized
  GEMM, whose epilogue does not sum yet)."""
  _check("gemm", a, b)
  steps = tuple(epilogue.split(",")) if epilogue else ()
  sums = steps[-1:] == ("bias_grad",)
  steps = steps[:-1] if sums else steps
  if path == "nova" and a.dtype in _TRITON_DTYPES:
    results = _synthesized(a, b, xs, steps, dtype, tf32)
    return results + ((_column_sums(results[0]),) if sums else ())
  if path not in ("nova", "cublas"): raise ValueError(f"gemm: path must be 'cublas' or 'nova', got {path!r}")
  return _separately(a, b, xs, steps, dtype, tf32, sums)


KERNELS = {"matmul": matmul, "linear": linear, "linear_backward": linear_backward, "gemm": fused_gemm,
           "weight_grad": weight_grad}
