"""`matmul` on CUDA through cuBLASLt (blas.py): row-major tensors as cuBLAS's column-major operands, with no copies.

A row-major (m x k) matrix is a column-major (k x m) one, so C = A B is computed as C^T = B^T A^T: cuBLAS's first
operand is our B, its second our A, and D (n x m, column-major) is our contiguous C. An operand whose last two dims
are row-major is used as is (op N) and one stored transposed (`x.mT` of a contiguous tensor, stride 1 in dim -2) as
op T, each with its own leading dim; only a matrix with neither unit stride (or overlapping rows) is copied.

Batch dims broadcast: they collapse into as few dims as the strides allow (a broadcast operand gets stride 0, which
cuBLASLt takes as "the same matrix for every batch"); the innermost collapsed dim is cuBLASLt's strided batch and
any outer ones loop on the host. A weight shared by the batch (b 2-D or broadcast) with a row-major A folds the
batch into the rows: one large GEMM instead of many small ones.

With `bt.backends.matmul = "triton"`, float32 and 16-bit matmuls run as Nova's synthesized GEMMs instead (gemm.py).
"""
from __future__ import annotations

import itertools

from blutrain import backends, dtypes
from blutrain.backend.cuda import blas, memory, runtime
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import broadcast_shape, broadcast_strides, collapse, empty


def layout(x: CudaArray) -> tuple[bool, int] | None:
  """(stored transposed?, leading dim) of the row-major matrix in x's last two dims as a cuBLAS operand, or None when
  neither dim has unit stride (or rows overlap), which needs a copy."""
  (r, c), (s0, s1) = x.shape[-2:], x.strides[-2:]
  if (s1 == 1 or c == 1) and (r == 1 or s0 >= max(c, 1)): return False, s0 if r > 1 else max(c, 1)
  if (s0 == 1 or r == 1) and (c == 1 or s1 >= max(r, 1)): return True, s1 if c > 1 else max(r, 1)
  return None


def _operand(x: CudaArray) -> CudaArray:
  if layout(x) is not None: return x
  from blutrain.backend.cuda.kernels.copy import copy
  return copy(x)


def _or(values) -> int:
  acc = 0
  for v in values: acc |= abs(v)
  return acc


def gemm_calls(a: CudaArray, b: CudaArray, out: CudaArray, bias: CudaArray | None,
               compute: tuple[int, int]) -> tuple[blas.Problem, list[tuple[int, int, int]]]:
  """The cuBLASLt problem computing out = a @ b (+ bias) and, per host-loop step, the byte offsets of cuBLAS's A, B
  and D from b's, a's and out's addresses; a and b have cuBLAS layouts (`layout` is not None), out is contiguous,
  k > 0. Pure: it depends on the layouts and the addresses' alignments only, so its result is cached."""
  (m, k), n = a.shape[-2:], b.shape[-1]
  (trans_a, lda), (trans_b, ldb) = layout(a), layout(b)
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
  item = a.dtype.itemsize
  align = [blas.alignment(x.ptr | _or(s * item for s in st)) for x, st in ((a, a_st), (b, b_st), (out, d_st))]
  if dims[-1] == 1: a_st, b_st, d_st = a_st[:-1] + (0,), b_st[:-1] + (0,), d_st[:-1] + (0,)  # one matrix: no stride
  # cuBLAS's first operand is our B, its second our A (C^T = B^T A^T)
  p = blas.Problem(n, rows, k, trans_b, trans_a, ldb, lda, n, dims[-1], b_st[-1], a_st[-1], d_st[-1], a.dtype, compute,
                   bias is not None, (align[1], align[0], align[2], 256 if bias is None else blas.alignment(bias.ptr)))
  calls = []
  for idx in itertools.product(*(range(d) for d in dims[:-1])):
    off = [sum(i * s for i, s in zip(idx, st[:-1])) * item for st in (a_st, b_st, d_st)]
    calls.append((off[1], off[0], off[2]))
  return p, calls


def _zero(out: CudaArray) -> None:
  s = runtime.current_stream(out.device)
  runtime.check(runtime._driver().cuMemsetD8Async(out.ptr, 0, out.nbytes, s._s.handle), "cuMemsetD8Async")


def _check(op: str, a: CudaArray, b: CudaArray) -> None:
  if a.dtype is not b.dtype or a.device != b.device:
    raise TypeError(f"{op}: operands must share dtype and device, got {a.dtype.name} on cuda:{a.device} and "
                    f"{b.dtype.name} on cuda:{b.device}")
  if not a.dtype.is_floating_point:
    raise RuntimeError(f"{op}: {a.dtype.name} matmul of {a.shape} and {b.shape} is not supported on CUDA (as in "
                       f"PyTorch); convert the operands with .float()")


_calls: dict[tuple, tuple[blas.Plan, list[tuple[int, int, int]]]] = {}  # layouts -> plan and offsets


def _matmul(a: CudaArray, b: CudaArray, bias: CudaArray | None, tf32: bool) -> CudaArray:
  out = empty(broadcast_shape(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), a.dtype, a.device)
  if out.size == 0: return out
  if a.shape[-1] == 0:  # an empty sum: zeros, or the bias
    if bias is None: _zero(out)
    else: memory.copy_into(out, bias)
    return out
  a, b = _operand(a), _operand(b)
  key = (a.shape, a.strides, b.shape, b.strides, a.dtype, tf32, a.ptr & 255,
         b.ptr & 255, out.ptr & 255, -1 if bias is None else bias.ptr & 255, out.device)
  hit = _calls.get(key)
  if hit is None:
    p, offsets = gemm_calls(a, b, out, bias, blas.compute_type(a.dtype, tf32))
    hit = _calls[key] = (blas.plan(p, out.device), offsets)
  pl, offsets = hit
  bias_ptr = 0 if bias is None else bias.ptr
  for oa, ob, od in offsets: blas.gemm(pl, b.ptr + oa, a.ptr + ob, out.ptr + od, out.device, bias_ptr)
  return out


_NOVA = (dtypes.float32, dtypes.bfloat16, dtypes.float16)


def matmul(a: CudaArray, b: CudaArray, tf32: bool = False) -> CudaArray:
  """a @ b over broadcast batch dims (the op library passes both operands with at least 2 dims); float32 through TF32
  tensor cores when `tf32`."""
  _check("matmul", a, b)
  if backends.matmul == "triton" and a.dtype in _NOVA:
    from blutrain.backend.cuda.kernels.gemm import gemm  # imported here: gemm.py imports `layout` from this module
    return gemm(a, b, precision="tf32" if tf32 else None)
  return _matmul(a, b, None, tf32)


def matmul_bias(a: CudaArray, b: CudaArray, bias: CudaArray, tf32: bool = False) -> CudaArray:
  """a @ b + bias (bias of shape (n,)) with the bias added in cuBLASLt's epilogue, not by another kernel."""
  _check("matmul_bias", a, b)
  if bias.shape != (b.shape[-1],):
    raise ValueError(f"matmul_bias: bias of shape {bias.shape} for an output with {b.shape[-1]} columns")
  if bias.dtype is not a.dtype or bias.strides != (1,):
    from blutrain.backend.cuda.kernels.copy import cast
    bias = cast(bias, a.dtype)
  return _matmul(a, b, bias, tf32)


SPECS: list = []  # no Triton kernels: cuBLASLt's are precompiled
KERNELS = {"matmul": matmul}
