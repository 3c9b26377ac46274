"""The K-major copy of a GEMM operand that the configurator asks for (`configurator.operand_copy`): a row-major copy
of A, or of B^T, rounded to TF32 on the way when the dot multiplies in TF32, so the kernel need not round it."""
from __future__ import annotations

import triton
import triton.language as tl

from blutrain import configurator as cfg
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import TY, Spec, collapse, empty, run, spec
from blutrain.backend.cuda.kernels.copy import copy
from blutrain.backend.cuda.kernels.gemm.source import round_tf32
from blutrain.shapes import cdiv, contiguous_strides


@triton.jit
def _rowmajor_kernel(x, y, rows, cols, ld_x, batch_stride_x, UNIT_ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr, ROUND: tl.constexpr):
  """y[z] (rows x cols, row-major) = x[z], whose unit stride runs along the rows (UNIT_ROWS; the column stride is
  ld_x) or along the columns (the row stride is ld_x): a transposing copy reads down the columns and writes along the
  rows, Triton turning the tile through shared memory. ROUND rounds float32 to TF32 on the way."""
  rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
  rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
  z = tl.program_id(2).to(tl.int64)
  mask = (rr[:, None] < rows) & (rc[None, :] < cols)
  if UNIT_ROWS:
    v = tl.load(x + z * batch_stride_x + rr[:, None] + rc[None, :].to(tl.int64) * ld_x, mask=mask)
  else:
    v = tl.load(x + z * batch_stride_x + rr[:, None].to(tl.int64) * ld_x + rc[None, :], mask=mask)
  if ROUND:
    v = round_tf32(v)
  tl.store(y + z * rows * cols + rr[:, None].to(tl.int64) * cols + rc[None, :], v, mask=mask)


def copy_spec(x: CudaArray, round_tf32: bool) -> Spec:
  """The copy kernel's variant for x (a unit stride in one of its last two dims): it reads down x's columns when
  their stride is the unit one."""
  rows, cols = x.shape[-2:]
  br, bc, warps = cfg.copy_schedule(rows, cols)
  return spec(_rowmajor_kernel, {"x": "*" + TY[x.dtype], "y": "*" + TY[x.dtype], "rows": "i32", "cols": "i32",
                                 "ld_x": "i32", "batch_stride_x": "i64"},
              dict(UNIT_ROWS=x.strides[-1] != 1 and cols > 1, BLOCK_R=br, BLOCK_C=bc, ROUND=round_tf32),
              num_warps=warps)


def copy_layout(x: CudaArray) -> tuple[tuple[int, ...], int, int]:
  """(strides, batch size, batch stride) of x's row-major copy: broadcast batch dims (stride 0) stay broadcast, the
  others are stored in order, collapsed into one (a layout they do not collapse into is copied by `copy`, whole:
  batch size 0)."""
  keep = [d for d in range(x.ndim - 2) if x.strides[d] != 0 and x.shape[d] != 1]
  zs, (zst,) = collapse([x.shape[d] for d in keep], [x.strides[d] for d in keep])
  if len(zs) > 1 or zs[0] > 65535: return contiguous_strides(x.shape), 0, 0
  rows, cols = x.shape[-2:]
  strides, acc = [0] * (x.ndim - 2), rows * cols
  for d in reversed(keep):
    strides[d] = acc
    acc *= x.shape[d]
  return tuple(strides) + (cols, 1), zs[0], zst[0]


def rowmajor_copy(x: CudaArray, round_tf32: bool) -> CudaArray:
  """A row-major copy of x (a unit stride in one of its last two dims), rounded to TF32 when asked."""
  strides, batch, batch_stride = copy_layout(x)
  if not batch: return copy(x)
  rows, cols = x.shape[-2:]
  y = empty((batch * rows * cols,), x.dtype, x.device)
  s = copy_spec(x, round_tf32)
  unit_rows = s.constexprs["UNIT_ROWS"]
  run(s, (cdiv(rows, s.constexprs["BLOCK_R"]), cdiv(cols, s.constexprs["BLOCK_C"]), batch), x, y, rows, cols,
      x.strides[-1 if unit_rows else -2], batch_stride)
  return CudaArray(y.ptr, x.shape, strides, x.dtype, x.device, y.owner)
