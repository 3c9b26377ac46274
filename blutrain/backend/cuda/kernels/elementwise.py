"""Elementwise kernels: unary, binary, compare, where, cast and copy on strided, broadcast inputs.

Two Triton kernels serve every elementwise op, the op chosen by a constexpr (dead branches are pruned at compile
time): `_flat` for outputs whose inputs are contiguous or scalars (1-D, 16-byte vector loads when aligned, large
blocks), and `_tiled` for any other layout: dims are collapsed first, then a program covers a tile of rows
(the outer dims, up to 5) by columns (the innermost dim), so only one div/mod chain per row is paid. Half types
compute in float32, as the CPU backend does. An operand may be a number passed by value instead of a pointer (a CPU
scalar, such as a Python number in `x * 2.0`: no device memory, fill or copy), and the result may be written into
any strided `out` (in-place ops).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from blutrain import dtypes
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.runtime import Stream, current_stream
from blutrain.backend.cuda.kernels import (MAX_DIMS, broadcast_shape, broadcast_strides, collapse, empty, empty_ordered,
                                           in_memory_order, needs_i64, pad, ptr, spec, sqrt_rn, strided, view)
from blutrain.configurator import flat_schedule, tile_schedule
from blutrain.dtypes import DType
from blutrain.shapes import cdiv, is_dense, memory_order, strides_in_order

UNARY = ("neg", "exp", "log", "sqrt", "rsqrt", "abs", "sin", "cos", "tanh", "sigmoid", "relu", "erf", "floor",
         "sign", "logical_not", "gelu", "gelu_tanh", "copy", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh",
         "acosh", "atanh", "exp2", "log2", "log10", "log1p", "expm1", "ceil", "trunc", "round", "bitwise_not")
BINARY = ("add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "logical_and",
          "logical_or", "logical_xor", "gelu_backward", "gelu_backward_tanh", "relu_backward", "atan2", "copysign", "fmod",
          "remainder", "floor_divide", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_left_shift",
          "bitwise_right_shift")
COMPARE = ("eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor", "logical_not")
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_SQRT_2_PI = tl.constexpr(0.7978845608028654)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


# *** the ops ***

@triton.jit
def _compute(x, OP: tl.constexpr):
  """Half types widen to float32 (copy and where move values untouched)."""
  if OP != "copy" and OP != "where" and (x.dtype == tl.float16 or x.dtype == tl.bfloat16):
    x = x.to(tl.float32)
  return x


@triton.jit
def _ipow(a, b):
  """Integer power by squaring; negative exponents truncate toward zero as C does (1, -1 or 0)."""
  zero = a * 0 + b * 0  # the broadcast shape, so the loop carries one type when a or b is a scalar
  r = zero + 1
  base = a + zero
  e = b + zero
  for _ in range(63):
    r = tl.where((e & 1) != 0, r * base, r)
    base = base * base
    e = e >> 1
  neg = tl.where(a == 1, 1, tl.where(a == -1, tl.where((b & 1) != 0, -1, 1), 0))
  return tl.where(b < 0, neg, r)


@triton.jit
def _floor_divide(a, b):
  """Python's a // b. Floats as PyTorch's div_floor: from fmod, so that (a - mod) / b is exact, then rounded to the
  nearest integer; IEEE's a / b where b is 0. Integers from C's truncating division."""
  if a.dtype.is_floating():
    mod = libdevice.fmod(a, b)
    d = (a - mod) / b
    d = tl.where((mod != 0) & ((b < 0) != (mod < 0)), d - 1, d)
    fd = tl.floor(d)
    fd = tl.where(d - fd > 0.5, fd + 1, fd)
    fd = tl.where(d == 0, libdevice.copysign(d * 0, a / b), fd)
    r = tl.where(b == 0, a / b, fd)
  else:
    q = a // b
    r = tl.where((a % b != 0) & ((a < 0) != (b < 0)), q - 1, q)
  return r


@triton.jit
def _gelu_tanh_gate(x):
  # 0.5 (1 + tanh(u)) as sigmoid(2u): no cancellation where tanh(u) is near -1 (libdevice's tanh is approximate)
  return 1.0 / (1.0 + tl.exp(-2.0 * _SQRT_2_PI * (x + 0.044715 * x * x * x)))


@triton.jit
def gelu(x, TANH: tl.constexpr):
  """GELU of float32 x: x Phi(x), or its tanh approximation (TANH); the GEMM epilogues use it too."""
  if TANH:
    y = x * _gelu_tanh_gate(x)
  else:
    y = 0.5 * x * (1.0 + tl.math.erf(x * _SQRT1_2))
  return y


@triton.jit
def gelu_backward(g, x, TANH: tl.constexpr):
  """g times GELU's derivative at x (of the tanh approximation when TANH), in float32."""
  if TANH:
    s = _gelu_tanh_gate(x)  # 1 - tanh(u)^2 = 4 s (1 - s)
    d = s + 2.0 * x * s * (1.0 - s) * _SQRT_2_PI * (1.0 + 3 * 0.044715 * x * x)
  else:
    d = 0.5 * (1.0 + tl.math.erf(x * _SQRT1_2)) + x * tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
  return g * d


@triton.jit
def _apply(a, b, c, OP: tl.constexpr):
  """The op on computed values: unary ops read a, binary a and b, where reads (c, a, b)."""
  if OP == "copy":
    r = a
  elif OP == "neg":
    r = -a
  elif OP == "exp":
    r = libdevice.exp(a)
  elif OP == "log":
    r = libdevice.log(a)
  elif OP == "sqrt":
    r = sqrt_rn(a)
  elif OP == "rsqrt":
    r = libdevice.rsqrt(a)
  elif OP == "abs":
    r = tl.abs(a)
  elif OP == "sin":
    r = libdevice.sin(a)
  elif OP == "cos":
    r = libdevice.cos(a)
  elif OP == "tanh":
    r = libdevice.tanh(a)
  elif OP == "sigmoid":
    r = 1.0 / (1.0 + libdevice.exp(-a))
  elif OP == "relu":
    r = tl.where(a < 0, 0, a)  # NaN stays NaN, as np.maximum(x, 0)
  elif OP == "erf":
    r = tl.math.erf(a)
  elif OP == "floor":
    r = tl.floor(a)
  elif OP == "sign":
    r = (a > 0).to(a.dtype) - (a < 0).to(a.dtype)  # 0 at nan, as PyTorch
  elif OP == "tan":
    r = libdevice.tan(a)
  elif OP == "asin":
    r = libdevice.asin(a)
  elif OP == "acos":
    r = libdevice.acos(a)
  elif OP == "atan":
    r = libdevice.atan(a)
  elif OP == "sinh":
    r = libdevice.sinh(a)
  elif OP == "cosh":
    r = libdevice.cosh(a)
  elif OP == "asinh":
    r = libdevice.asinh(a)
  elif OP == "acosh":
    r = libdevice.acosh(a)
  elif OP == "atanh":
    r = libdevice.atanh(a)
  elif OP == "exp2":
    r = libdevice.exp2(a)
  elif OP == "log2":
    r = libdevice.log2(a)
  elif OP == "log10":
    r = libdevice.log10(a)
  elif OP == "log1p":
    r = libdevice.log1p(a)
  elif OP == "expm1":
    r = libdevice.expm1(a)
  elif OP == "ceil":
    r = libdevice.ceil(a)
  elif OP == "trunc":
    r = libdevice.trunc(a)
  elif OP == "round":
    r = libdevice.rint(a)  # half to even
  elif OP == "bitwise_not":
    r = ~a
  elif OP == "logical_not":
    r = a == 0
  elif OP == "gelu":
    r = gelu(a, False)
  elif OP == "gelu_tanh":
    r = gelu(a, True)
  elif OP == "add":
    r = a | b if a.dtype == tl.int1 else a + b
  elif OP == "sub":
    r = a - b
  elif OP == "mul":
    r = a & b if a.dtype == tl.int1 else a * b
  elif OP == "div":  # IEEE division: div_rn in float32, `/` is already exact in float64
    if a.dtype == tl.float32:
      r = tl.div_rn(a, b)
    else:
      r = a.to(tl.float64) / b.to(tl.float64)
  elif OP == "pow":
    if a.dtype.is_floating():
      r = libdevice.pow(a, b)
    else:
      r = _ipow(a, b)
  elif OP == "atan2":
    r = libdevice.atan2(a, b)
  elif OP == "copysign":
    r = libdevice.copysign(a, b)
  elif OP == "fmod":
    r = libdevice.fmod(a, b) if a.dtype.is_floating() else a % b  # C's: the sign of a
  elif OP == "remainder":
    r = libdevice.fmod(a, b) if a.dtype.is_floating() else a % b
    r = tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)  # Python's: the sign of b
  elif OP == "floor_divide":
    r = _floor_divide(a, b)
  elif OP == "bitwise_and":
    r = a & b
  elif OP == "bitwise_or":
    r = a | b
  elif OP == "bitwise_xor":
    r = a ^ b
  elif OP == "bitwise_left_shift":  # past the width (or negative) 0, as PyTorch: LLVM's shift would be poison there
    inside = (b >= 0) & (b < a.dtype.primitive_bitwidth)
    r = tl.where(inside, a << tl.where(inside, b, 0), 0)
  elif OP == "bitwise_right_shift":  # arithmetic; past the width the sign
    inside = (b >= 0) & (b < a.dtype.primitive_bitwidth)
    r = tl.where(inside, a >> tl.where(inside, b, 0), tl.where(a < 0, -1, 0))
  elif OP == "maximum":
    r = a | b if a.dtype == tl.int1 else tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
  elif OP == "minimum":
    r = a & b if a.dtype == tl.int1 else tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
  elif OP == "eq":
    r = a == b
  elif OP == "ne":
    r = a != b
  elif OP == "lt":
    r = a < b
  elif OP == "le":
    r = a <= b
  elif OP == "gt":
    r = a > b
  elif OP == "ge":
    r = a >= b
  elif OP == "logical_and":
    r = (a != 0) & (b != 0)
  elif OP == "logical_or":
    r = (a != 0) | (b != 0)
  elif OP == "logical_xor":
    r = (a != 0) ^ (b != 0)
  elif OP == "gelu_backward":
    r = gelu_backward(a, b, False)
  elif OP == "gelu_backward_tanh":
    r = gelu_backward(a, b, True)
  elif OP == "relu_backward":
    r = tl.where(b <= 0, 0, a)
  else:
    tl.static_assert(OP == "where", "unknown elementwise op")
    r = tl.where(c, a, b)
  return r


# *** kernels ***

@triton.jit
def _load_flat(p, offs, mask, SCALAR: tl.constexpr, ALIGNED: tl.constexpr, OP: tl.constexpr):
  if not p.dtype.is_ptr():  # a number passed by value
    x = p
  elif SCALAR:
    x = tl.load(p)
  else:
    q = p + offs
    if ALIGNED:
      q = tl.multiple_of(q, 16)
    x = tl.load(q, mask=mask)
  return _compute(x, OP)


@triton.jit
def _flat_block(out, a, b, c, offs, mask, OP: tl.constexpr, N_IN: tl.constexpr, A_SCALAR: tl.constexpr,
                B_SCALAR: tl.constexpr, C_SCALAR: tl.constexpr, ALIGNED: tl.constexpr):
  x = _load_flat(a, offs, mask, A_SCALAR, ALIGNED, OP)
  y = x
  z = x
  if N_IN >= 2:
    y = _load_flat(b, offs, mask, B_SCALAR, ALIGNED, OP)
  if N_IN == 3:  # where(c, a, b): the condition is the third pointer
    z = _load_flat(c, offs, mask, C_SCALAR, ALIGNED, OP)
  q = out + offs
  if ALIGNED:
    q = tl.multiple_of(q, 16)
  tl.store(q, _apply(x, y, z, OP).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _flat(out, a, b, c, n, OP: tl.constexpr, N_IN: tl.constexpr, A_SCALAR: tl.constexpr, B_SCALAR: tl.constexpr,
          C_SCALAR: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr, IDX64: tl.constexpr):
  """out[i] = op(a[i], b[i], c[i]) over contiguous operands; a *_SCALAR flag marks an operand that is one element.
  Full blocks run unmasked so their loads vectorize; only the last block is masked."""
  start = tl.program_id(0)
  if IDX64:
    start = start.to(tl.int64)
  start = start * BLOCK
  offs = start + tl.arange(0, BLOCK)
  if start + BLOCK <= n:
    _flat_block(out, a, b, c, offs, None, OP, N_IN, A_SCALAR, B_SCALAR, C_SCALAR, ALIGNED)
  else:
    _flat_block(out, a, b, c, offs, offs < n, OP, N_IN, A_SCALAR, B_SCALAR, C_SCALAR, ALIGNED)


@triton.jit
def _load_tile(p, rows, cols, size1, size2, size3, size4, stride0, stride1, stride2, stride3, stride4, col_stride, mask,
               ROW_DIMS: tl.constexpr, UNIT: tl.constexpr, ALIGNED: tl.constexpr, OP: tl.constexpr):
  if not p.dtype.is_ptr():  # a number passed by value
    x = p
  else:
    x = tl.load(_tile_ptrs(p, rows, cols, size1, size2, size3, size4, stride0, stride1, stride2, stride3, stride4,
                           col_stride, ROW_DIMS, UNIT, ALIGNED), mask=mask)
  return _compute(x, OP)


@triton.jit
def _tile_ptrs(p, rows, cols, size1, size2, size3, size4, stride0, stride1, stride2, stride3, stride4, col_stride,
               ROW_DIMS: tl.constexpr, UNIT: tl.constexpr, ALIGNED: tl.constexpr):
  """Pointers of a (rows, cols) tile: rows over the ROW_DIMS outer dims, columns along the innermost one (unit
  stride when UNIT, else col_stride)."""
  if UNIT:
    inner = cols
  else:
    inner = cols * col_stride
  q = p + strided(rows, size1, size2, size3, size4, stride0, stride1, stride2, stride3, stride4, ROW_DIMS)[:, None]
  q += inner[None, :]
  if UNIT and ALIGNED:
    q = tl.multiple_of(q, [16, 16])
  return q


@triton.jit
def _tiled(out, a, b, c, n_rows, n_cols, n_col_blocks, row_size1, row_size2, row_size3, row_size4,
           out_row_stride0, out_row_stride1, out_row_stride2, out_row_stride3, out_row_stride4, out_col_stride,
           a_row_stride0, a_row_stride1, a_row_stride2, a_row_stride3, a_row_stride4, a_col_stride,
           b_row_stride0, b_row_stride1, b_row_stride2, b_row_stride3, b_row_stride4, b_col_stride,
           c_row_stride0, c_row_stride1, c_row_stride2, c_row_stride3, c_row_stride4, c_col_stride,
           OP: tl.constexpr, N_IN: tl.constexpr, ROW_DIMS: tl.constexpr, OUT_UNIT: tl.constexpr,
           A_UNIT: tl.constexpr, B_UNIT: tl.constexpr, C_UNIT: tl.constexpr, BLOCK_R: tl.constexpr,
           BLOCK_C: tl.constexpr, EVEN_R: tl.constexpr, EVEN_C: tl.constexpr, ALIGNED: tl.constexpr,
           IDX64: tl.constexpr):
  """out = op(a, b, c) on any strided layout: rows index the ROW_DIMS outer dims (sizes row_size*, each operand's
  strides x_row_stride*), columns the innermost dim (stride x_col_stride, or 1 when X_UNIT says so)."""
  pid = tl.program_id(0)
  if IDX64:
    pid = pid.to(tl.int64)
  rows = (pid // n_col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
  cols = (pid % n_col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
  mask = None
  if not EVEN_R:
    mask = (rows < n_rows)[:, None]
  if not EVEN_C:
    mask = (cols < n_cols)[None, :] if EVEN_R else mask & (cols < n_cols)[None, :]
  x = _load_tile(a, rows, cols, row_size1, row_size2, row_size3, row_size4,
                 a_row_stride0, a_row_stride1, a_row_stride2, a_row_stride3, a_row_stride4, a_col_stride,
                 mask, ROW_DIMS, A_UNIT, ALIGNED, OP)
  y = x
  z = x
  if N_IN >= 2:
    y = _load_tile(b, rows, cols, row_size1, row_size2, row_size3, row_size4,
                   b_row_stride0, b_row_stride1, b_row_stride2, b_row_stride3, b_row_stride4, b_col_stride,
                   mask, ROW_DIMS, B_UNIT, ALIGNED, OP)
  if N_IN == 3:
    z = _load_tile(c, rows, cols, row_size1, row_size2, row_size3, row_size4,
                   c_row_stride0, c_row_stride1, c_row_stride2, c_row_stride3, c_row_stride4, c_col_stride,
                   mask, ROW_DIMS, C_UNIT, ALIGNED, OP)
  q = _tile_ptrs(out, rows, cols, row_size1, row_size2, row_size3, row_size4,
                 out_row_stride0, out_row_stride1, out_row_stride2, out_row_stride3, out_row_stride4, out_col_stride,
                 ROW_DIMS, OUT_UNIT, ALIGNED)
  tl.store(q, _apply(x, y, z, OP).to(out.dtype.element_ty), mask=mask)


# *** specs ***

# the argument type of an operand of each dtype passed by value (a CPU scalar): halves as the float32 they compute in
BY_VALUE = {dtypes.bool_: "i1", dtypes.uint8: "i32", dtypes.int8: "i32", dtypes.int16: "i32", dtypes.int32: "i32", dtypes.int64: "i64", dtypes.float16: "fp32",
            dtypes.bfloat16: "fp32", dtypes.float32: "fp32", dtypes.float64: "fp64"}


def _operand_types(out: DType, ins: tuple[DType, ...], values: tuple[bool, ...]) -> dict[str, str]:
  """The types of out, a, b and c: pointers, or numbers for operands passed by value; an absent operand repeats the
  last one."""
  ty = [BY_VALUE[d] if v else ptr(d) for d, v in zip(ins, values or (False,) * len(ins))]
  return {"out": ptr(out), "a": ty[0], "b": ty[min(1, len(ins) - 1)], "c": ty[-1]}


@functools.lru_cache(maxsize=4096)
def flat_spec(op: str, out: DType, ins: tuple[DType, ...], scalars: tuple[bool, ...], n: int, aligned: bool, i64: bool,
              values: tuple[bool, ...] = ()):
  """The flat kernel of op; `values` marks the operands passed by value (they are scalars too)."""
  block, warps = flat_schedule(n, min([out.itemsize] + [d.itemsize for d in ins]))
  sig = {**_operand_types(out, ins, values), "n": "i64" if i64 else "i32"}
  sa, sb, sc = (list(scalars) + [False, False])[:3]
  return spec(_flat, sig, dict(OP=op, N_IN=len(ins), A_SCALAR=sa, B_SCALAR=sb, C_SCALAR=sc, BLOCK=block,
                               ALIGNED=aligned, IDX64=i64), num_warps=warps)


_TILE_ARGS = ["n_rows", "n_cols", "n_col_blocks", *(f"row_size{i}" for i in range(1, 5))] + \
             [f"{x}_{s}" for x in ("out", "a", "b", "c") for s in [*(f"row_stride{i}" for i in range(5)), "col_stride"]]


@functools.lru_cache(maxsize=4096)
def tiled_spec(op: str, out: DType, ins: tuple[DType, ...], row_dims: int, units: tuple[bool, ...], n_rows: int,
               n_cols: int, aligned: bool, i64: bool, values: tuple[bool, ...] = ()):
  """The tiled kernel of op over rows of `row_dims` dims; `units` marks the operands (out first) whose columns have
  unit stride, `values` those passed by value."""
  br, bc, warps = tile_schedule(n_rows, n_cols)
  sig = {**_operand_types(out, ins, values), **{k: "i64" if i64 else "i32" for k in _TILE_ARGS}}
  uo, ua, ub, uc = (list(units) + [False, False])[:4]
  return spec(_tiled, sig, dict(OP=op, N_IN=len(ins), ROW_DIMS=row_dims, OUT_UNIT=uo, A_UNIT=ua, B_UNIT=ub, C_UNIT=uc,
                                BLOCK_R=br, BLOCK_C=bc, EVEN_R=n_rows % br == 0, EVEN_C=n_cols % bc == 0,
                                ALIGNED=aligned, IDX64=i64),
              num_warps=warps)


# *** host side ***

Layout = tuple[tuple[int, ...], tuple[int, ...], DType, int]  # shape, strides, dtype, address % 16 (-1: a value)
_BY_NP = {d.np: d for d in dtypes.all_dtypes}


class Value:
  """An operand passed to the kernel by value: a CPU scalar (a 0-d host array, `ops.core.is_cpu_scalar`) among the
  inputs of an elementwise op on CUDA, as PyTorch passes its CPU scalars."""
  __slots__ = ("value", "dtype", "layout_key")
  shape = strides = ()
  ndim = 0

  def __init__(self, a: np.ndarray):
    self.value, self.dtype = a.item(), _BY_NP[a.dtype]
    self.layout_key = ((), (), self.dtype, -1)


def launch(op: str, out: CudaArray, *ins: CudaArray | Value) -> CudaArray:
  """Write op(*ins) into `out` (any strided layout; inputs broadcast to out's shape). For where, ins is (c, x, y)."""
  if 0 in out.shape: return out
  return _launch(op, out, (ins[1], ins[2], ins[0]) if op == "where" else ins)  # the kernels read the condition third


_plans: dict[tuple, tuple] = {}  # (op, layouts of out and the inputs) -> _plan's result


def _launch(op: str, out: CudaArray, ins: tuple[CudaArray | Value, ...], stream: Stream | None = None) -> CudaArray:
  key = (op, out.layout_key or out.key(), *[a.layout_key or a.key() for a in ins])
  plan = _plans.get(key)
  if plan is None:
    if len(_plans) > 4096: _plans.clear()
    plan = _plans[key] = _plan(*key)
  if plan:
    _run(plan, out, ins, stream)
    return out
  cshape, (ost, *ists) = collapse(out.shape, out.strides, *(broadcast_strides(a, out.shape) for a in ins))
  for i in range(cshape[0]):  # too many dims for the kernels: loop over the outermost one on the host
    _launch(op, view(out, cshape[1:], ost[1:], i * ost[0]),
            tuple(a if a.__class__ is Value else view(a, cshape[1:], s[1:], i * s[0]) for a, s in zip(ins, ists)),
            stream)
  return out


def _run(plan: tuple, out: CudaArray, ins: tuple[CudaArray | Value, ...], stream: Stream | None) -> None:
  """Launch a plan; absent operands repeat the last one (the kernel does not read them). The plan keeps the variant,
  not its kernel: a plan made in a dry run must not have compiled it there (`Spec.kernel`)."""
  s, grid, scalars, by_value = plan
  if by_value: ins = [a.value if a.__class__ is Value else a for a in ins]
  s.kernel(grid, out, ins[0], ins[1] if len(ins) > 1 else ins[0], ins[-1], *scalars, stream=stream)


def _plan(op: str, *layouts: Layout) -> tuple:
  """(variant, grid, scalar arguments after the four operands, whether some operand goes by value) of op on the
  layouts of out and its inputs, or () when they have more than MAX_DIMS dims after collapsing. A function of the
  layouts only, so callers cache it: the arrays it reads are stand-ins with their layout and their address modulo 16,
  which is all alignment needs."""
  out, *ins = arrays = [CudaArray(p, shape, strides, dt, 0, None) for shape, strides, dt, p in layouts]
  values = tuple(a.ptr == -1 for a in ins)
  shape, strides = in_memory_order(out.shape, out.strides, *(broadcast_strides(a, out.shape) for a in ins))
  cshape, (ost, *ists) = collapse(shape, *strides)
  if len(cshape) > MAX_DIMS: return ()
  i64 = needs_i64(cshape, ost, *ists)
  dts = tuple(a.dtype for a in ins)
  if cshape == (1,): ost, ists = (1,), [(0,)] * len(ins)  # one element: any layout is flat
  if len(cshape) == 1 and ost[0] == 1 and all(s[0] in (0, 1) for s in ists):
    scalars = tuple(s[0] == 0 or cshape[0] == 1 for s in ists)
    aligned = all(a.ptr % 16 == 0 for a, sc in zip(arrays, (False,) + scalars) if not sc)
    s = flat_spec(op, out.dtype, dts, scalars, cshape[0], aligned, i64, values if any(values) else ())
    return s, (cdiv(cshape[0], s.constexprs["BLOCK"]),), (cshape[0],), any(values)
  nd = len(cshape) - 1
  n_rows, n_cols = math.prod(cshape[:-1]), cshape[-1]
  units = tuple(st[-1] == 1 for st in (ost, *ists))
  br, bc, _ = tile_schedule(n_rows, n_cols)
  aligned = n_cols % bc == 0 and bc * min(a.dtype.itemsize for a in arrays) >= 16 and all(
    a.ptr % 16 == 0 and all(x * a.dtype.itemsize % 16 == 0 for x in st[:-1])
    for a, st, u in zip(arrays, (ost, *ists), units) if u)
  s = tiled_spec(op, out.dtype, dts, nd, units, n_rows, n_cols, aligned, i64, values if any(values) else ())
  col_blocks = cdiv(n_cols, bc)
  strides = [pad(st, 6, 0) for st in (ost, *ists)] + [pad(ists[-1], 6, 0)] * (3 - len(ins))
  return (s, (cdiv(n_rows, br) * col_blocks,),
          (n_rows, n_cols, col_blocks, *pad(cshape[:-1], 5, 1)[1:], *(x for st in strides for x in st)), any(values))


_new_outputs: dict[tuple, tuple] = {}  # (op, output dtype, input layouts) -> (output shape, plan or None)


def elementwise(op: str, out_dtype: DType, *ins: CudaArray | Value) -> CudaArray:
  """A new array of the broadcast shape holding op(*ins), on the device of the first array among ins and its current
  stream, in the dense layout of the first input of that shape (channels-last stays channels-last), else contiguous.
  For where, ins is (c, x, y)."""
  if op == "where": ins = (ins[1], ins[2], ins[0])  # the kernels read the condition third
  key = (op, out_dtype, *[a.layout_key or a.key() for a in ins])
  hit = _new_outputs.get(key)
  if hit is None:
    if len(_new_outputs) > 4096: _new_outputs.clear()
    hit = _new_outputs[key] = _new_output(*key)
  shape, order, plan = hit
  a = ins[0]
  if a.__class__ is not CudaArray: a = next(x for x in ins if x.__class__ is CudaArray)
  s = current_stream(a.device)
  out = empty(shape, out_dtype, a.device, s) if order is None else empty_ordered(shape, out_dtype, a.device, order, s)
  if plan: _run(plan, out, ins, s)
  elif plan is not None: _launch(op, out, ins, s)
  return out


def output_order(shape: tuple[int, ...], layouts) -> tuple[int, ...] | None:
  """The memory order of a new output of `shape` (`shapes.memory_order`) computed from inputs of the given layouts
  (shape, strides, ...; None for a host scalar): that of the first dense input of the output's shape (broadcast ones
  have no order to give), else row-major."""
  first = next((lay for lay in layouts if lay is not None and tuple(lay[0]) == shape and is_dense(shape, lay[1])), None)
  return None if first is None else memory_order(shape, first[1])


def _new_output(op: str, out_dtype: DType, *layouts: Layout) -> tuple:
  """(shape, memory order, plan) of op writing a new array (512-byte aligned, as the allocator's blocks) in the
  order `output_order` gives; the plan is None when the array is empty, () when the host loops over dims."""
  shape = broadcast_shape(*(shape for shape, _, _, _ in layouts))
  order = output_order(shape, [lay if lay[3] != -1 else None for lay in layouts])
  strides = strides_in_order(tuple(shape), order)
  return shape, order, None if 0 in shape else _plan(op, (shape, strides, out_dtype, 0), *layouts)


def _op(op: str, arg: int = 0):
  """The kernel of an elementwise op: a new array of the broadcast shape (bool for comparisons, else the dtype of
  input `arg`), or the result written into `out=` (any strided layout, converted to its dtype on store; inputs that
  overlap it other than element for element are the caller's to avoid, see `ops.core.can_write_into`). Inputs may
  be CPU scalars (0-d host arrays), which go to the kernel by value."""
  out_dtype = dtypes.bool_ if op in COMPARE else None

  def kernel(*ins: CudaArray | np.ndarray, out: CudaArray | None = None) -> CudaArray:
    for a in ins:
      if a.__class__ is not CudaArray:
        ins = tuple(x if x.__class__ is CudaArray else Value(x) for x in ins)
        break
    return elementwise(op, out_dtype or ins[arg].dtype, *ins) if out is None else launch(op, out, *ins)
  kernel.__name__, kernel.writes_out, kernel.host_scalars = op, True, True
  return kernel


def _gelu(x: CudaArray, approximate: str, out: CudaArray | None = None) -> CudaArray:
  op = "gelu_tanh" if approximate == "tanh" else "gelu"
  return elementwise(op, x.dtype, x) if out is None else launch(op, out, x)


def _gelu_backward(g: CudaArray, x: CudaArray, approximate: str, out: CudaArray | None = None) -> CudaArray:
  op = "gelu_backward_tanh" if approximate == "tanh" else "gelu_backward"
  return elementwise(op, x.dtype, g, x) if out is None else launch(op, out, g, x)


_gelu.writes_out = _gelu_backward.writes_out = True
KERNELS = {  # copy.py wraps "copy"
  **{op: _op(op) for op in UNARY + BINARY if op not in ("gelu", "gelu_tanh", "copy") and not op.startswith("gelu_")},
  "where": _op("where", 1),
  "gelu": _gelu,
  "gelu_backward": _gelu_backward,
}


def _specs() -> list:
  """Every op once on the flat kernel in float32 (bool for logical ops, int32 for bitwise ones); the tiled kernel for
  one op of each kind; integer, half and float64 arithmetic; both alignments and index widths."""
  f32, bf16, b = dtypes.float32, dtypes.bfloat16, dtypes.bool_
  out = []
  for op in UNARY + BINARY:
    n_in = 1 if op in UNARY else 2
    dt = b if op.startswith("logical") else dtypes.int32 if op.startswith("bitwise") else f32
    out.append(flat_spec(op, b if op in COMPARE else dt, (dt,) * n_in, (False,) * n_in, 1 << 20, True, False))
  for op, dt in (("copy", f32), ("add", f32), ("gelu", f32), ("lt", bf16), ("pow", dtypes.int64), ("logical_xor", b)):
    n_in = 1 if op in UNARY else 2
    out.append(tiled_spec(op, b if op in COMPARE else dt, (dt,) * n_in, 2, (True,) + (True, False)[:n_in], 4096, 768,
                          True, False))
  for dt in (dtypes.float16, bf16, dtypes.float64, dtypes.uint8, dtypes.int8, dtypes.int16, dtypes.int32, dtypes.int64):
    for op in ("add", "lt", "pow", "div", "fmod", "remainder", "floor_divide") + (
        ("bitwise_and", "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift", "bitwise_not")
        if not dt.is_floating_point else ()):
      n_in = 1 if op in UNARY else 2
      out.append(flat_spec(op, b if op in COMPARE else dt, (dt,) * n_in, (False, True)[:n_in], 1000, False, False))
  for dt in (dtypes.float16, bf16, dtypes.float64):
    out.append(tiled_spec("gelu_backward", dt, (dt, dt), 5, (True, False, True), 1 << 12, 100, False, True))
  out.append(flat_spec("sqrt", dtypes.float64, (dtypes.float64,), (False,), 1 << 20, True, True))
  out.append(flat_spec("pow", dtypes.int64, (dtypes.int64,) * 2, (True, False), 1000, True, False))  # a scalar base
  out.append(flat_spec("where", f32, (f32, f32, b), (False, True, False), 1 << 20, True, True))
  out.append(tiled_spec("where", bf16, (bf16, bf16, b), 3, (True, False, True, False), 1 << 10, 64, False, False))
  for dt in (f32, bf16, dtypes.float16, dtypes.float64, dtypes.uint8, dtypes.int32, dtypes.int64):  # a number by value
    for op, values in (("mul", (False, True)), ("sub", (True, False)), ("lt", (False, True)), ("pow", (True, False))):
      out.append(flat_spec(op, b if op in COMPARE else dt, (dt, dt), values, 1 << 20, True, False, values))
  out.append(flat_spec("add", b, (b, b), (False, True), 1 << 20, True, False, (False, True)))
  out.append(flat_spec("div", f32, (f32, f32), (False, True), 1000, False, True, (False, True)))
  out.append(flat_spec("where", bf16, (bf16, bf16, b), (True, True, False), 1 << 20, True, False, (True, True, False)))
  out.append(tiled_spec("mul", bf16, (bf16, bf16), 2, (True, True, False), 4096, 768, True, False, (False, True)))
  out.append(tiled_spec("where", f32, (f32, f32, b), 3, (True, False, True, False), 1 << 10, 64, False, False,
                        (True, False, False)))
  return out


SPECS = _specs()
