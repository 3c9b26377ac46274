"""The matrix in an array's last two dims, as both GEMM paths (cuBLASLt in cublaslt.py, the synthesized Triton
kernels in gemm/) address it: its layout as a BLAS operand, its transpose as a view, its leading stride, and which
of its strides is the unit one. A dim of size 1 has no stride of its own; the other dim's extent stands in for it.
"""
from __future__ import annotations

from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels.copy import copy


def leading_stride(x: CudaArray, rowmajor: bool) -> int:
  """The leading stride of x's matrix read row-major (unit stride along its columns) or column-major."""
  (r, c), (s0, s1) = x.shape[-2:], x.strides[-2:]
  if rowmajor: return s0 if r > 1 else max(c, 1)
  return s1 if c > 1 else max(r, 1)


def blas_layout(x: CudaArray) -> tuple[bool, int] | None:
  """(stored transposed?, leading dim) of x's matrix as a BLAS operand, or None when neither dim has unit stride
  (or rows overlap), which needs a copy."""
  (r, c), (s0, s1) = x.shape[-2:], x.strides[-2:]
  if (s1 == 1 or c == 1) and (r == 1 or s0 >= max(c, 1)): return False, leading_stride(x, True)
  if (s0 == 1 or r == 1) and (c == 1 or s1 >= max(r, 1)): return True, leading_stride(x, False)
  return None


def blas_operand(x: CudaArray) -> CudaArray:
  """x, or its contiguous copy when its matrix has no BLAS layout."""
  return x if x.size == 0 or blas_layout(x) is not None else copy(x)


def transposed(x: CudaArray) -> CudaArray:
  """x with its last two dims swapped (a view)."""
  return CudaArray(x.ptr, x.shape[:-2] + x.shape[-2:][::-1], x.strides[:-2] + x.strides[-2:][::-1], x.dtype, x.device,
                   x.owner)


def unit_axis(x: CudaArray) -> tuple[str, list[int]]:
  """("n" | "m" | "", leading strides) of x's matrix as an epilogue addresses it: "n" when its unit stride runs
  along the columns (one leading stride, the rows'), "m" along the rows, "" neither (both strides)."""
  (r, c), (sr, sc) = x.shape[-2:], x.strides[-2:]
  if sc == 1 or c == 1: return "n", [leading_stride(x, True)]
  if sr == 1 or r == 1: return "m", [leading_stride(x, False)]
  return "", [sr, sc]
