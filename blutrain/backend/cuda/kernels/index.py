"""Indexing: embedding and its backward, gather, scatter_add, index (numpy advanced indexing), index_backward,
index_put and slice_backward.

One Triton kernel serves them all. Each walks the positions of an index space O (tiled as rows of outer dims by
columns of the innermost dim, as elementwise's `_tiled`) and addresses a `target` at
  target_positional_offset(o) + sum_k wrap(index_k[o]) * target_stride_k,
where up to 4 index tensors (broadcast over O) pick positions along some target dims. MODE "get" reads the target
into `values` (index, gather, embedding), "add" adds values into it atomically (index_backward, scatter_add,
embedding_backward), "put" stores values into it (index_put; repeated positions keep one of the values).

Negative indices wrap as in numpy. An index out of range reads 0 and writes nothing, instead of raising as the CPU
backend does: checking would make the host wait for the GPU.

Atomic adds accumulate in float32 for half types (int32 for bool) and are cast once at the end, so results match the
CPU's float32 accumulation up to the order of additions, which atomics do not fix: sums over repeated indices can
differ between runs in the last bits of float32.
"""
from __future__ import annotations

import functools
import math

import triton
import triton.language as tl

from blutrain import dtypes
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import (HALF, MAX_DIMS, broadcast_shape, broadcast_strides, cdiv, collapse,
                                           contiguous_strides, empty, needs_i64, pad, ptr, run, spec,
                                           strided, view)
from blutrain.backend.cuda.kernels.copy import cast, copy
from blutrain.backend.cuda.kernels.creation import fill
from blutrain.backend.cuda.kernels.elementwise import launch
from blutrain.dtypes import DType
from blutrain.configurator import index_schedule

MAX_INDICES = 4


@triton.jit
def _tile(rows, cols, Z1, Z2, Z3, Z4, T0, T1, T2, T3, T4, TC, ND: tl.constexpr, UNIT: tl.constexpr):
  if UNIT:
    inner = cols
  else:
    inner = cols * TC
  return strided(rows, Z1, Z2, Z3, Z4, T0, T1, T2, T3, T4, ND)[:, None] + inner[None, :]


@triton.jit
def _term(p, rows, cols, mask, Z1, Z2, Z3, Z4, I0, I1, I2, I3, I4, IC, XS, XN, ND: tl.constexpr, ROW: tl.constexpr):
  """(offset along the indexed dim, in range) for one index tensor; ROW: constant along columns, loaded per row."""
  if ROW:  # rows are clamped in range, so this load needs no mask
    i = tl.load(p + strided(rows, Z1, Z2, Z3, Z4, I0, I1, I2, I3, I4, ND))[:, None]
  else:
    i = tl.load(p + _tile(rows, cols, Z1, Z2, Z3, Z4, I0, I1, I2, I3, I4, IC, ND, False), mask=mask)
  i = i.to(tl.int64)
  i = tl.where(i < 0, i + XN, i)
  return i * XS, (i >= 0) & (i < XN)


@triton.jit
def _index_kernel(target, values, i0, i1, i2, i3, n_rows, n_cols, n_col_blocks, Z1, Z2, Z3, Z4,
                  V0, V1, V2, V3, V4, VC, T0, T1, T2, T3, T4, TC,
                  A0, A1, A2, A3, A4, AC, B0, B1, B2, B3, B4, BC, C0, C1, C2, C3, C4, CC, D0, D1, D2, D3, D4, DC,
                  XS0, XS1, XS2, XS3, XN0, XN1, XN2, XN3,
                  MODE: tl.constexpr, K: tl.constexpr, ND: tl.constexpr, UV: tl.constexpr, UT: tl.constexpr,
                  R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, IDX64: tl.constexpr):
  pid = tl.program_id(0)
  if IDX64:
    pid = pid.to(tl.int64)
  rows = (pid // n_col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
  cols = (pid % n_col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
  mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
  rows = tl.minimum(rows, n_rows - 1)  # masked rows read row n_rows - 1, so per-row loads need no mask
  t_off = _tile(rows, cols, Z1, Z2, Z3, Z4, T0, T1, T2, T3, T4, TC, ND, UT).to(tl.int64)
  d, ok = _term(i0, rows, cols, mask, Z1, Z2, Z3, Z4, A0, A1, A2, A3, A4, AC, XS0, XN0, ND, R0)
  t_off += d
  valid = mask & ok
  if K > 1:
    d, ok = _term(i1, rows, cols, mask, Z1, Z2, Z3, Z4, B0, B1, B2, B3, B4, BC, XS1, XN1, ND, R1)
    t_off += d
    valid = valid & ok
  if K > 2:
    d, ok = _term(i2, rows, cols, mask, Z1, Z2, Z3, Z4, C0, C1, C2, C3, C4, CC, XS2, XN2, ND, R2)
    t_off += d
    valid = valid & ok
  if K > 3:
    d, ok = _term(i3, rows, cols, mask, Z1, Z2, Z3, Z4, D0, D1, D2, D3, D4, DC, XS3, XN3, ND, R3)
    t_off += d
    valid = valid & ok
  v_ptr = values + _tile(rows, cols, Z1, Z2, Z3, Z4, V0, V1, V2, V3, V4, VC, ND, UV)
  if MODE == "get":
    tl.store(v_ptr, tl.load(target + t_off, mask=valid, other=0).to(values.dtype.element_ty), mask=mask)
  elif MODE == "add":
    tl.atomic_add(target + t_off, tl.load(v_ptr, mask=mask).to(target.dtype.element_ty), mask=valid, sem="relaxed")
  else:
    tl.store(target + t_off, tl.load(v_ptr, mask=mask).to(target.dtype.element_ty), mask=valid)


_ARGS = ["n_rows", "n_cols", "n_col_blocks", "Z1", "Z2", "Z3", "Z4"] + [f"{o}{i}" for o in "VTABCD" for i in "01234C"] + \
        [f"XS{k}" for k in range(4)] + [f"XN{k}" for k in range(4)]


@functools.lru_cache(maxsize=4096)
def index_spec(mode: str, target: DType, values: DType, idx: tuple[DType, ...], nd: int, uv: bool, ut: bool,
               rows: tuple[bool, ...], n_rows: int, n_cols: int, i64: bool):
  br, bc, warps = index_schedule(n_rows, n_cols)
  it = "i64" if i64 else "i32"
  sig = {"target": ptr(target), "values": ptr(values), **{f"i{k}": ptr(idx[min(k, len(idx) - 1)]) for k in range(4)},
         **{k: it for k in _ARGS}}
  sig.update({f"XS{k}": "i64" for k in range(4)} | {f"XN{k}": "i64" for k in range(4)})
  r = list(rows) + [False] * (4 - len(rows))
  return spec(_index_kernel, sig, dict(MODE=mode, K=len(idx), ND=nd, UV=uv, UT=ut, R0=r[0], R1=r[1], R2=r[2], R3=r[3],
                                       BLOCK_R=br, BLOCK_C=bc, IDX64=i64), num_warps=warps)


def _run(mode: str, target: CudaArray, values: CudaArray, shape, vst, tst, idx: list[tuple[CudaArray, tuple]], xs, xn):
  """Launch over the index space `shape`: values and the target's positional part walk it with strides vst and tst,
  index tensor k with its strides over it, adding wrap(index) * xs[k] (xn[k] the size of that target dim)."""
  if math.prod(shape) == 0: return
  if len(idx) > MAX_INDICES:
    raise NotImplementedError(f"index: at most {MAX_INDICES} index tensors on the cuda backend, got {len(idx)}")
  cshape, (cv, ct, *ci) = collapse(shape, vst, tst, *(s for _, s in idx))
  if len(cshape) > MAX_DIMS:  # loop over the outermost dim on the host
    for i in range(cshape[0]):
      _run(mode, view(target, target.shape, target.strides, i * ct[0]),
           view(values, values.shape, values.strides, i * cv[0]), cshape[1:], cv[1:], ct[1:],
           [(view(a, a.shape, a.strides, i * s[0]), s[1:]) for (a, _), s in zip(idx, ci)], xs, xn)
    return
  n_rows, n_cols = math.prod(cshape[:-1]), cshape[-1]
  i64 = needs_i64(cshape, cv, ct, *ci) or needs_i64(target.shape, target.strides)
  s = index_spec(mode, target.dtype, values.dtype, tuple(a.dtype for a, _ in idx), len(cshape) - 1, cv[-1] == 1,
                 ct[-1] == 1, tuple(st[-1] == 0 for st in ci), n_rows, n_cols, i64)
  col_blocks = cdiv(n_cols, s[2]["BLOCK_C"])
  ptrs = [a.ptr for a, _ in idx] + [idx[-1][0].ptr] * (4 - len(idx))
  strides = [pad(st, 6, 0) for st in [cv, ct] + ci + [ci[-1]] * (4 - len(idx))]
  run(s, (cdiv(n_rows, s[2]["BLOCK_R"]) * col_blocks,), target.ptr, values.ptr, *ptrs, n_rows, n_cols, col_blocks,
      *pad(cshape[:-1], 5, 1)[1:], *(x for st in strides for x in st), *xs, *[0] * (4 - len(xs)), *xn, *[1] * (4 - len(xn)))


def _atomic_dtype(dtype: DType) -> DType:
  """The dtype atomic adds accumulate in."""
  return dtypes.float32 if dtype in HALF else dtypes.int32 if dtype is dtypes.bool_ else dtype


def _zeros(shape, dtype: DType, device: int) -> CudaArray: return fill(empty(shape, dtype, device), 0)


def _done(acc: CudaArray, dtype: DType) -> CudaArray: return acc if acc.dtype is dtype else cast(acc, dtype)


def _contiguous_zero(shape, dim: int) -> tuple[int, ...]:
  st = list(contiguous_strides(shape))
  st[dim] = 0
  return tuple(st)


def embedding(weight: CudaArray, idx: CudaArray) -> CudaArray:
  out = empty(idx.shape + weight.shape[1:], weight.dtype, weight.device)
  _run("get", weight, out, out.shape, out.strides, (0,) * idx.ndim + (weight.strides[1],),
       [(idx, idx.strides + (0,))], [weight.strides[0]], [weight.shape[0]])
  return out


def embedding_backward(g: CudaArray, idx: CudaArray, num: int) -> CudaArray:
  acc = _zeros((num, g.shape[-1]), _atomic_dtype(g.dtype), g.device)
  _run("add", acc, g, g.shape, g.strides, (0,) * idx.ndim + (1,), [(idx, broadcast_strides(idx, g.shape[:-1]) + (0,))],
       [g.shape[-1]], [num])
  return _done(acc, g.dtype)


def gather(x: CudaArray, index: CudaArray, dim: int) -> CudaArray:
  out = empty(index.shape, x.dtype, x.device)
  tst = tuple(0 if d == dim else s for d, s in enumerate(x.strides))
  _run("get", x, out, out.shape, out.strides, tst, [(index, index.strides)], [x.strides[dim]], [x.shape[dim]])
  return out


def scatter_add(x: CudaArray, index: CudaArray, src: CudaArray, dim: int) -> CudaArray:
  acc = cast(x, _atomic_dtype(x.dtype))
  _run("add", acc, src, index.shape, src.strides, _contiguous_zero(acc.shape, dim), [(index, index.strides)],
       [acc.strides[dim]], [x.shape[dim]])
  return _done(acc, x.dtype)


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
  _run("get", x, out, out_shape, out.strides, tst, terms, xs, xn)
  return out


def index_backward(g: CudaArray, *idx: CudaArray, shape, positions) -> CudaArray:
  acc = _zeros(shape, _atomic_dtype(g.dtype), g.device)
  out_shape, tst, terms, xs, xn = _index_args(acc.shape, acc.strides, idx, positions)
  _run("add", acc, g, out_shape, broadcast_strides(g, out_shape), tst, terms, xs, xn)
  return _done(acc, g.dtype)


def index_put(x: CudaArray, v: CudaArray, *idx: CudaArray, positions) -> CudaArray:
  out = copy(x)
  out_shape, tst, terms, xs, xn = _index_args(out.shape, out.strides, idx, positions)
  _run("put", out, v, out_shape, broadcast_strides(v, out_shape), tst, terms, xs, xn)
  return out


def slice_backward(g: CudaArray, shape, index) -> CudaArray:
  """Zeros of `shape` with g written at the slices (start, stop, step) per dim."""
  out = _zeros(shape, g.dtype, g.device)
  launch("copy", view(out, g.shape, [s * step for s, (_, _, step) in zip(out.strides, index)],
                      sum(s * start for s, (start, _, _) in zip(out.strides, index))), g)
  return out


KERNELS = {"embedding": embedding, "embedding_backward": embedding_backward, "gather": gather, "scatter_add": scatter_add,
           "index": index, "index_backward": index_backward, "index_put": index_put, "slice_backward": slice_backward}


def _specs() -> list:
  f32, bf16, i64, i32 = dtypes.float32, dtypes.bfloat16, dtypes.int64, dtypes.int32
  return [
    index_spec("get", f32, f32, (i64,), 2, True, True, (True,), 16384, 768, False),       # embedding
    index_spec("add", f32, bf16, (i64,), 2, True, True, (True,), 16384, 768, False),      # embedding_backward
    index_spec("get", bf16, bf16, (i32,), 3, True, False, (False,), 1000, 16, False),     # gather
    index_spec("add", f32, f32, (i64,), 1, False, False, (False,), 1, 1000, True),        # scatter_add
    index_spec("add", dtypes.int32, dtypes.int32, (i64,), 1, True, True, (False,), 1, 1000, False),
    index_spec("get", f32, f32, (i64, i64, i32), 4, True, False, (False, True, False), 100, 7, False),
    index_spec("put", dtypes.float64, dtypes.float64, (i64, i64, i64, i64), 5, False, False, (True, True, False, False),
               100, 7, True),
    index_spec("put", dtypes.bool_, dtypes.bool_, (i64,), 1, True, True, (False,), 10, 10, False),
  ]


SPECS = _specs()
