"""Indexing: embedding and its backward, gather, scatter_add, scatter_reduce, index (numpy advanced indexing),
index_backward, index_put and slice_backward.

One Triton kernel serves them all. Each walks the positions of an index space O (tiled as rows of outer dims by
columns of the innermost dim, as elementwise's `_tiled`) and addresses a `target` at
  target_positional_offset(o) + sum_k wrap(index_k[o]) * target_stride_k,
where up to 4 index tensors (broadcast over O) pick positions along some target dims. MODE "get" reads the target
into `values` (index, gather, embedding), "add" adds values into it atomically (index_backward, scatter_add,
embedding_backward), "put" stores values into it (index_put; repeated positions keep one of the values), "max",
"min" and "mul" combine values into it atomically (scatter_reduce).

Negative indices wrap as in numpy. An index out of range reads 0 and writes nothing, and is recorded in the device's
error flag (`backend.cuda.errors`), which the next synchronization reads and raises from: raising at the op, as the
CPU backend does, would make the host wait for the GPU.

Atomics accumulate in float32 for half types (int32 for narrower integers and bool) and are cast once at the end, so
results match the CPU's float32 accumulation up to the order of additions, which atomics do not fix: sums (and
products) over repeated indices can differ between runs in the last bits of float32.
"""
from __future__ import annotations

import functools
import math

import numpy as np

import triton
import triton.language as tl

from blutrain import dtypes
from blutrain.backend.cuda import errors
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import (HALF, MAX_DIMS, broadcast_shape, broadcast_strides, collapse, empty,
                                           empty_like, needs_i64, pad, ptr, run, spec, strided, view)
from blutrain.backend.cuda.kernels.copy import cast, copy
from blutrain.backend.cuda.kernels.creation import fill
from blutrain.backend.cuda.kernels.elementwise import launch
from blutrain.configurator import index_schedule
from blutrain.dtypes import DType
from blutrain.shapes import cdiv, contiguous_strides

MAX_INDICES = 4


@triton.jit
def _tile_offsets(rows, cols, size1, size2, size3, size4, stride0, stride1, stride2, stride3, stride4, col_stride,
                  ROW_DIMS: tl.constexpr, UNIT: tl.constexpr):
  """Element offsets of a (rows, cols) tile: rows over the ROW_DIMS outer dims, columns along the innermost one
  (unit stride when UNIT, else col_stride)."""
  if UNIT:
    inner = cols
  else:
    inner = cols * col_stride
  return strided(rows, size1, size2, size3, size4, stride0, stride1, stride2, stride3, stride4, ROW_DIMS)[:, None] + \
    inner[None, :]


@triton.jit
def _index_term(p, rows, cols, mask, size1, size2, size3, size4, stride0, stride1, stride2, stride3, stride4,
                col_stride, dim_stride, dim_size, ROW_DIMS: tl.constexpr, PER_ROW: tl.constexpr):
  """(offset along the indexed target dim, in range, the index as given) for one index tensor, whose entries wrap
  around dim_size; PER_ROW: the index is constant along columns, so it is loaded once per row."""
  if PER_ROW:  # rows are clamped in range, so this load needs no mask
    i = tl.load(p + strided(rows, size1, size2, size3, size4, stride0, stride1, stride2, stride3, stride4,
                            ROW_DIMS))[:, None]
  else:
    i = tl.load(p + _tile_offsets(rows, cols, size1, size2, size3, size4, stride0, stride1, stride2, stride3, stride4,
                                  col_stride, ROW_DIMS, False), mask=mask)
  given = i.to(tl.int64)
  i = tl.where(given < 0, given + dim_size, given)
  return i * dim_stride, (i >= 0) & (i < dim_size), given


@triton.jit
def _record(err, op_code, given, dim_size, bad):
  """Record the bad indices of a tile in the error flag: the op, the largest and smallest bad index, the dim size."""
  z = tl.zeros_like(bad).to(tl.int64)
  tl.atomic_max(err + z, op_code + z, mask=bad, sem="relaxed")
  tl.atomic_max(err + 1 + z, given + z, mask=bad, sem="relaxed")
  tl.atomic_min(err + 2 + z, given + z, mask=bad, sem="relaxed")
  tl.atomic_max(err + 3 + z, dim_size + z, mask=bad, sem="relaxed")


@triton.jit
def _combine(old, v, MODE: tl.constexpr):
  """PyTorch's scatter reductions of one value into another: a nan in v wins, and a nan in old stays."""
  if MODE == "mul":
    return old * v
  elif MODE == "max":
    return tl.where((v != v) | (old < v), v, old)
  else:
    return tl.where((v != v) | (v < old), v, old)


@triton.jit
def _cas_reduce(p, v, valid, scratch, MODE: tl.constexpr, CAS_BITS: tl.constexpr):
  """*p = _combine(*p, v) where valid, atomically by compare-and-swap on the bits: read, combine, swap if the bits are
  still those read, else combine again with the bits found. Lanes that are done (or not valid) swap on `scratch`, whose
  value nobody reads, as a swap has no mask."""
  if CAS_BITS == 64:
    bits: tl.constexpr = tl.int64
  else:
    bits: tl.constexpr = tl.int32
  ip = p.to(tl.pointer_type(bits), bitcast=True)
  sp = scratch.to(tl.pointer_type(bits), bitcast=True)
  pending = valid
  seen = tl.load(ip, mask=valid, other=0)
  while tl.max(pending.to(tl.int32)) > 0:
    new = _combine(seen.to(v.dtype, bitcast=True), v, MODE).to(bits, bitcast=True)
    found = tl.atomic_cas(tl.where(pending, ip, sp), seen, new, sem="relaxed")
    pending = pending & (found != seen)
    seen = found


@triton.jit
def _index_kernel(target, values, i0, i1, i2, i3, err, scratch, op_code, n_rows, n_cols, n_col_blocks,
                  row_size1, row_size2, row_size3, row_size4,
                  values_row_stride0, values_row_stride1, values_row_stride2, values_row_stride3, values_row_stride4,
                  values_col_stride,
                  target_row_stride0, target_row_stride1, target_row_stride2, target_row_stride3, target_row_stride4,
                  target_col_stride,
                  i0_row_stride0, i0_row_stride1, i0_row_stride2, i0_row_stride3, i0_row_stride4, i0_col_stride,
                  i1_row_stride0, i1_row_stride1, i1_row_stride2, i1_row_stride3, i1_row_stride4, i1_col_stride,
                  i2_row_stride0, i2_row_stride1, i2_row_stride2, i2_row_stride3, i2_row_stride4, i2_col_stride,
                  i3_row_stride0, i3_row_stride1, i3_row_stride2, i3_row_stride3, i3_row_stride4, i3_col_stride,
                  dim_stride0, dim_stride1, dim_stride2, dim_stride3, dim_size0, dim_size1, dim_size2, dim_size3,
                  MODE: tl.constexpr, N_INDICES: tl.constexpr, ROW_DIMS: tl.constexpr, VALUES_UNIT: tl.constexpr,
                  TARGET_UNIT: tl.constexpr, I0_PER_ROW: tl.constexpr, I1_PER_ROW: tl.constexpr,
                  I2_PER_ROW: tl.constexpr, I3_PER_ROW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                  IDX64: tl.constexpr, CAS_BITS: tl.constexpr):
  """Over the index space (rows by columns, as `_tile_offsets`): the target's element at its positional offset plus,
  per index tensor k, wrap(i_k) * dim_stride_k; MODE "get" reads it into values, "add" adds values to it
  atomically, "put" stores values in it, "max", "min" and "mul" combine values into it atomically (by
  compare-and-swap on CAS_BITS-bit words unless CAS_BITS is 0). Out-of-range indices read 0, write nothing and are
  recorded in `err`."""
  pid = tl.program_id(0)
  if IDX64:
    pid = pid.to(tl.int64)
  rows = (pid // n_col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
  cols = (pid % n_col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
  mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
  rows = tl.minimum(rows, n_rows - 1)  # masked rows read row n_rows - 1, so per-row loads need no mask
  t_off = _tile_offsets(rows, cols, row_size1, row_size2, row_size3, row_size4, target_row_stride0, target_row_stride1,
                        target_row_stride2, target_row_stride3, target_row_stride4, target_col_stride, ROW_DIMS,
                        TARGET_UNIT).to(tl.int64)
  d, ok, given = _index_term(i0, rows, cols, mask, row_size1, row_size2, row_size3, row_size4,
                      i0_row_stride0, i0_row_stride1, i0_row_stride2, i0_row_stride3, i0_row_stride4, i0_col_stride,
                      dim_stride0, dim_size0, ROW_DIMS, I0_PER_ROW)
  _record(err, op_code, given, dim_size0, mask & ~ok)
  t_off += d
  valid = mask & ok
  if N_INDICES > 1:
    d, ok, given = _index_term(i1, rows, cols, mask, row_size1, row_size2, row_size3, row_size4,
                        i1_row_stride0, i1_row_stride1, i1_row_stride2, i1_row_stride3, i1_row_stride4, i1_col_stride,
                        dim_stride1, dim_size1, ROW_DIMS, I1_PER_ROW)
    _record(err, op_code, given, dim_size1, mask & ~ok)
    t_off += d
    valid = valid & ok
  if N_INDICES > 2:
    d, ok, given = _index_term(i2, rows, cols, mask, row_size1, row_size2, row_size3, row_size4,
                        i2_row_stride0, i2_row_stride1, i2_row_stride2, i2_row_stride3, i2_row_stride4, i2_col_stride,
                        dim_stride2, dim_size2, ROW_DIMS, I2_PER_ROW)
    _record(err, op_code, given, dim_size2, mask & ~ok)
    t_off += d
    valid = valid & ok
  if N_INDICES > 3:
    d, ok, given = _index_term(i3, rows, cols, mask, row_size1, row_size2, row_size3, row_size4,
                        i3_row_stride0, i3_row_stride1, i3_row_stride2, i3_row_stride3, i3_row_stride4, i3_col_stride,
                        dim_stride3, dim_size3, ROW_DIMS, I3_PER_ROW)
    _record(err, op_code, given, dim_size3, mask & ~ok)
    t_off += d
    valid = valid & ok
  v_ptr = values + _tile_offsets(rows, cols, row_size1, row_size2, row_size3, row_size4, values_row_stride0,
                                 values_row_stride1, values_row_stride2, values_row_stride3, values_row_stride4,
                                 values_col_stride, ROW_DIMS, VALUES_UNIT)
  if MODE == "get":
    tl.store(v_ptr, tl.load(target + t_off, mask=valid, other=0).to(values.dtype.element_ty), mask=mask)
  elif MODE == "add":
    tl.atomic_add(target + t_off, tl.load(v_ptr, mask=mask).to(target.dtype.element_ty), mask=valid, sem="relaxed")
  elif MODE == "put":
    tl.store(target + t_off, tl.load(v_ptr, mask=mask).to(target.dtype.element_ty), mask=valid)
  elif CAS_BITS != 0:
    _cas_reduce(target + t_off, tl.load(v_ptr, mask=mask).to(target.dtype.element_ty), valid, scratch, MODE, CAS_BITS)
  elif MODE == "max":
    tl.atomic_max(target + t_off, tl.load(v_ptr, mask=mask).to(target.dtype.element_ty), mask=valid, sem="relaxed")
  else:
    tl.atomic_min(target + t_off, tl.load(v_ptr, mask=mask).to(target.dtype.element_ty), mask=valid, sem="relaxed")


_TILE_ARGS = ["n_rows", "n_cols", "n_col_blocks", *(f"row_size{i}" for i in range(1, 5))] + \
             [f"{x}_{s}" for x in ("values", "target", "i0", "i1", "i2", "i3")
              for s in [*(f"row_stride{i}" for i in range(5)), "col_stride"]]
_DIM_ARGS = [f"dim_stride{k}" for k in range(MAX_INDICES)] + [f"dim_size{k}" for k in range(MAX_INDICES)]


@functools.lru_cache(maxsize=4096)
def index_spec(mode: str, target: DType, values: DType, idx: tuple[DType, ...], row_dims: int, values_unit: bool,
               target_unit: bool, per_row: tuple[bool, ...], n_rows: int, n_cols: int, i64: bool):
  """The indexing kernel's variant (idx: the index tensors' dtypes; per_row: which of them are constant along
  columns). max and min of floats and every mul go by compare-and-swap: Triton's float atomic max/min (signed max of
  the bits for a positive value, unsigned min for a negative one) would lose nans that PyTorch keeps."""
  br, bc, warps = index_schedule(n_rows, n_cols)
  it = "i64" if i64 else "i32"
  sig = {"target": ptr(target), "values": ptr(values), **{f"i{k}": ptr(idx[min(k, len(idx) - 1)]) for k in range(4)},
         "err": "*i64", "scratch": ptr(target), "op_code": "i64", **{k: it for k in _TILE_ARGS},
         **{k: "i64" for k in _DIM_ARGS}}
  r = list(per_row) + [False] * (4 - len(per_row))
  cas = mode == "mul" or (mode in ("max", "min") and target.is_floating_point)
  return spec(_index_kernel, sig, dict(MODE=mode, N_INDICES=len(idx), ROW_DIMS=row_dims, VALUES_UNIT=values_unit,
                                       TARGET_UNIT=target_unit, I0_PER_ROW=r[0], I1_PER_ROW=r[1], I2_PER_ROW=r[2],
                                       I3_PER_ROW=r[3], BLOCK_R=br, BLOCK_C=bc, IDX64=i64,
                                       CAS_BITS=8 * target.itemsize if cas else 0), num_warps=warps)


def _launch_index(op: str, mode: str, target: CudaArray, values: CudaArray, shape, vst, tst,
                  idx: list[tuple[CudaArray, tuple]], xs, xn, scratch: CudaArray | None = None):
  """Launch over the index space `shape`: values and the target's positional part walk it with strides vst and tst,
  index tensor k with its strides over it, adding wrap(index) * xs[k] (xn[k] the size of that target dim). A bad
  index is recorded as one of op's. Compare-and-swap modes need a `scratch` element of the target's dtype."""
  if math.prod(shape) == 0: return
  if len(idx) > MAX_INDICES:
    raise NotImplementedError(f"index: at most {MAX_INDICES} index tensors on the cuda backend, got {len(idx)}")
  cshape, (cv, ct, *ci) = collapse(shape, vst, tst, *(s for _, s in idx))
  if len(cshape) > MAX_DIMS:  # loop over the outermost dim on the host
    for i in range(cshape[0]):
      _launch_index(op, mode, view(target, target.shape, target.strides, i * ct[0]),
                    view(values, values.shape, values.strides, i * cv[0]), cshape[1:], cv[1:], ct[1:],
                    [(view(a, a.shape, a.strides, i * s[0]), s[1:]) for (a, _), s in zip(idx, ci)], xs, xn, scratch)
    return
  n_rows, n_cols = math.prod(cshape[:-1]), cshape[-1]
  i64 = needs_i64(cshape, cv, ct, *ci) or needs_i64(target.shape, target.strides)
  s = index_spec(mode, target.dtype, values.dtype, tuple(a.dtype for a, _ in idx), len(cshape) - 1, cv[-1] == 1,
                 ct[-1] == 1, tuple(st[-1] == 0 for st in ci), n_rows, n_cols, i64)
  col_blocks = cdiv(n_cols, s.constexprs["BLOCK_C"])
  ptrs = [a.ptr for a, _ in idx] + [idx[-1][0].ptr] * (4 - len(idx))
  strides = [pad(st, 6, 0) for st in [cv, ct] + ci + [ci[-1]] * (4 - len(idx))]
  run(s, (cdiv(n_rows, s.constexprs["BLOCK_R"]) * col_blocks,), target.ptr, values.ptr, *ptrs,
      errors.flag(target.device).ptr, (target if scratch is None else scratch).ptr, errors.OPS.index(op) + 1, n_rows,
      n_cols, col_blocks,
      *pad(cshape[:-1], 5, 1)[1:], *(x for st in strides for x in st), *xs, *[0] * (4 - len(xs)), *xn,
      *[1] * (4 - len(xn)))


def _atomic_dtype(dtype: DType) -> DType:
  """The dtype atomics accumulate in: 32 bits at least."""
  return dtypes.float32 if dtype in HALF else dtypes.int32 if dtype.itemsize < 4 else dtype


def _zeros(shape, dtype: DType, device: int) -> CudaArray: return fill(empty(shape, dtype, device), 0)


def _cast_back(acc: CudaArray, dtype: DType) -> CudaArray: return acc if acc.dtype is dtype else cast(acc, dtype)


def _contiguous_zero(shape, dim: int) -> tuple[int, ...]:
  st = list(contiguous_strides(shape))
  st[dim] = 0
  return tuple(st)


def embedding(weight: CudaArray, idx: CudaArray) -> CudaArray:
  out = empty(idx.shape + weight.shape[1:], weight.dtype, weight.device)
  _launch_index("embedding", "get", weight, out, out.shape, out.strides, (0,) * idx.ndim + (weight.strides[1],),
                [(idx, idx.strides + (0,))], [weight.strides[0]], [weight.shape[0]])
  return out


def embedding_backward(g: CudaArray, idx: CudaArray, num: int) -> CudaArray:
  acc = _zeros((num, g.shape[-1]), _atomic_dtype(g.dtype), g.device)
  _launch_index("embedding_backward", "add", acc, g, g.shape, g.strides, (0,) * idx.ndim + (1,),
                [(idx, broadcast_strides(idx, g.shape[:-1]) + (0,))], [g.shape[-1]], [num])
  return _cast_back(acc, g.dtype)


def gather(x: CudaArray, index: CudaArray, dim: int) -> CudaArray:
  """x's values at index along dim, a new array in index's dense layout."""
  out = empty_like(index, x.dtype)
  tst = tuple(0 if d == dim else s for d, s in enumerate(x.strides))
  _launch_index("gather", "get", x, out, out.shape, out.strides, tst, [(index, index.strides)], [x.strides[dim]],
                [x.shape[dim]])
  return out


def scatter_add(x: CudaArray, index: CudaArray, src: CudaArray, dim: int) -> CudaArray:
  acc = cast(x, _atomic_dtype(x.dtype))
  _launch_index("scatter_add", "add", acc, src, index.shape, src.strides, _contiguous_zero(acc.shape, dim),
                [(index, index.strides)], [acc.strides[dim]], [x.shape[dim]])
  return _cast_back(acc, x.dtype)


_SCATTER_MODES = {"sum": "add", "mean": "add", "prod": "mul", "amax": "max", "amin": "min"}


def scatter_reduce(x: CudaArray, index: CudaArray, src: CudaArray, dim: int, reduce: str,
                   include_self: bool) -> CudaArray:
  """x with src reduced into it at index along dim, in the atomics' dtype: without include_self the positions src
  lands on start from the reduction's identity; mean divides by a count made the same way (floor division for
  integers, as PyTorch's)."""
  acc = cast(x, _atomic_dtype(x.dtype))
  const = lambda v: fill(empty((1,), acc.dtype, x.device), v)
  at = lambda mode, target, values, vst: _launch_index(
    "scatter_reduce", mode, target, values, index.shape, vst, _contiguous_zero(acc.shape, dim),
    [(index, index.strides)], [acc.strides[dim]], [x.shape[dim]], const(0))
  every = (0,) * index.ndim
  if not include_self:
    lo, hi = (-math.inf, math.inf) if acc.dtype.is_floating_point else \
      (int(np.iinfo(acc.dtype.np).min), int(np.iinfo(acc.dtype.np).max))
    at("put", acc, const({"sum": 0, "mean": 0, "prod": 1, "amax": lo, "amin": hi}[reduce]), every)
  at(_SCATTER_MODES[reduce], acc, src, src.strides)
  if reduce == "mean":
    count = fill(empty(acc.shape, acc.dtype, x.device), int(include_self))
    at("add", count, const(1), every)
    launch("maximum", count, count, const(1))
    launch("div" if acc.dtype.is_floating_point else "floor_divide", acc, acc, count)
  return _cast_back(acc, x.dtype)


def _index_space(shape, idx: tuple[CudaArray, ...], positions) -> tuple[tuple, list]:
  """numpy's advanced-indexing result shape, and per result dim where it comes from: ("x", dim) or ("b", j), a
  dim of the broadcast index shape. Adjacent indexed dims are replaced in place, others go to the front."""
  b = broadcast_shape(*(i.shape for i in idx))
  rest = [("x", d) for d in range(len(shape)) if d not in positions]
  bdims = [("b", j) for j in range(len(b))]
  p = positions[0]
  src = rest[:p] + bdims + rest[p:] if list(positions) == list(range(p, p + len(positions))) else bdims + rest
  return tuple(shape[d] if k == "x" else b[d] for k, d in src), src


def _index_args(x_shape, x_strides, idx, positions):
  out_shape, src = _index_space(x_shape, idx, positions)
  b = broadcast_shape(*(i.shape for i in idx))
  tst = tuple(x_strides[d] if k == "x" else 0 for k, d in src)
  terms = []
  for i in idx:
    bst = broadcast_strides(i, b)
    terms.append((i, tuple(0 if k == "x" else bst[d] for k, d in src)))
  return out_shape, tst, terms, [x_strides[p] for p in positions], [x_shape[p] for p in positions]


def index(x: CudaArray, *idx: CudaArray, positions) -> CudaArray:
  out_shape, tst, terms, xs, xn = _index_args(x.shape, x.strides, idx, positions)
  out = empty(out_shape, x.dtype, x.device)
  _launch_index("index", "get", x, out, out_shape, out.strides, tst, terms, xs, xn)
  return out


def index_backward(g: CudaArray, *idx: CudaArray, shape, positions) -> CudaArray:
  acc = _zeros(shape, _atomic_dtype(g.dtype), g.device)
  out_shape, tst, terms, xs, xn = _index_args(acc.shape, acc.strides, idx, positions)
  _launch_index("index_backward", "add", acc, g, out_shape, broadcast_strides(g, out_shape), tst, terms, xs, xn)
  return _cast_back(acc, g.dtype)


def index_put(x: CudaArray, v: CudaArray, *idx: CudaArray, positions) -> CudaArray:
  out = copy(x)
  out_shape, tst, terms, xs, xn = _index_args(out.shape, out.strides, idx, positions)
  _launch_index("index_put", "put", out, v, out_shape, broadcast_strides(v, out_shape), tst, terms, xs, xn)
  return out


def slice_backward(g: CudaArray, shape, index) -> CudaArray:
  """Zeros of `shape` with g written at the slices (start, stop, step) per dim."""
  out = _zeros(shape, g.dtype, g.device)
  launch("copy", view(out, g.shape, [s * step for s, (_, _, step) in zip(out.strides, index)],
                      sum(s * start for s, (start, _, _) in zip(out.strides, index))), g)
  return out


KERNELS = {"embedding": embedding, "embedding_backward": embedding_backward, "gather": gather, "scatter_add": scatter_add,
           "scatter_reduce": scatter_reduce, "index": index, "index_backward": index_backward, "index_put": index_put, "slice_backward": slice_backward}


def _specs() -> list:
  f32, bf16, i64, i32 = dtypes.float32, dtypes.bfloat16, dtypes.int64, dtypes.int32
  return [
    index_spec("get", f32, f32, (i64,), 2, True, True, (True,), 16384, 768, False),       # embedding
    index_spec("add", f32, bf16, (i64,), 2, True, True, (True,), 16384, 768, False),      # embedding_backward
    index_spec("get", bf16, bf16, (i32,), 3, True, False, (False,), 1000, 16, False),     # gather
    index_spec("add", f32, f32, (i64,), 1, False, False, (False,), 1, 1000, True),        # scatter_add
    *(index_spec(mode, t, t, (i64,), 2, True, True, (False,), 64, 512, False)            # scatter_reduce
      for mode in ("max", "min", "mul") for t in (f32, dtypes.float64, dtypes.int64, i32)),
    index_spec("add", dtypes.int32, dtypes.int32, (i64,), 1, True, True, (False,), 1, 1000, False),
    index_spec("get", f32, f32, (i64, i64, i32), 4, True, False, (False, True, False), 100, 7, False),
    index_spec("put", dtypes.float64, dtypes.float64, (i64, i64, i64, i64), 5, False, False, (True, True, False, False),
               100, 7, True),
    index_spec("put", dtypes.bool_, dtypes.bool_, (i64,), 1, True, True, (False,), 10, 10, False),
  ]


SPECS = _specs()
