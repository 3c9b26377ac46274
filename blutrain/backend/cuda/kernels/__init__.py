"""The Triton kernel library of the CUDA backend, one module per family.

Each module defines `KERNELS: dict[str, Callable]` (op name -> host wrapper with the CPU kernel's calling convention:
`kernel(*arrays, **attrs) -> CudaArray`, a new contiguous array from `memory.empty`) and `SPECS`, a list of
`(jit_fn, signature, constexprs, options)`: the variants CI compiles for sm_90 without a GPU. Host wrappers build
their variant with the same spec helpers, so what CI compiles is what runs.

Shared here: the dtype names of signatures, the layout helpers (broadcast strides, dim collapsing), the compile
cache in front of `launch.compile`, and the device functions that several families call: offsets of up to 5 strided
dims (`strided`, `axis_offsets`, with their host-side arguments `axis_args`), NaN-propagating extremes and IEEE sqrt.
Helpers of one family that others use are public in that family's module (`elementwise.launch`, `creation.fill`,
`reduce.reduce`, `norm.row_stats`).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import math
import pkgutil
import struct
from typing import Any

import triton
import triton.language as tl

from blutrain import dtypes
from blutrain.backend.cuda import launch, memory
from blutrain.backend.cuda.array import CudaArray
from blutrain.dtypes import DType
from blutrain.shapes import memory_order, strides_in_order

# element types in Triton signatures and as compile-time constants
TY = {dtypes.bool_: "i1", dtypes.uint8: "u8", dtypes.int8: "i8", dtypes.int16: "i16", dtypes.int32: "i32", dtypes.int64: "i64", dtypes.float16: "fp16", dtypes.bfloat16: "bf16",
      dtypes.float32: "fp32", dtypes.float64: "fp64"}
TL = {dtypes.bool_: tl.int1, dtypes.uint8: tl.uint8, dtypes.int8: tl.int8, dtypes.int16: tl.int16, dtypes.int32: tl.int32, dtypes.int64: tl.int64, dtypes.float16: tl.float16,
      dtypes.bfloat16: tl.bfloat16, dtypes.float32: tl.float32, dtypes.float64: tl.float64}
HALF = (dtypes.float16, dtypes.bfloat16)
MAX_DIMS = 6        # dims a strided kernel addresses after collapsing; more are looped over on the host
INT32_MAX = 2**31 - 1


def ptr(dtype: DType) -> str: return "*" + TY[dtype]


def aligned(arrays, numbers=()) -> bool:
  """Whether every array starts on 16 bytes and every number (a size or stride in elements) is a multiple of 16: what
  a variant's ":16" signature promises Triton, which then loads and stores 16-byte vectors."""
  return all(a.ptr % 16 == 0 for a in arrays) and all(n % 16 == 0 for n in numbers)


def divisible(signature: dict[str, str], names) -> dict[str, str]:
  """The signature with the named parameters marked ":16" (see `aligned`)."""
  return {k: t + ":16" if k in names else t for k, t in signature.items()}


class _Kernel:
  """`Spec.kernel`: the variant's `launch.Kernel`, compiled (or read from the disk cache) on first use and then kept
  on the Spec, where it shadows this descriptor: later lookups are a plain attribute's. Inside `compiling_ahead` a
  variant not compiled yet is handed to a thread instead, and what this returns launches nothing (and is not kept).
  The host wrappers that launch `s.kernel` themselves (the elementwise plans, the reductions' passes, fill: kernels
  safe on any data) so launch a variant compiled before for real in a dry run, on its scratch memory; `run`
  launches nothing there."""

  def __get__(self, s, owner=None):
    if s is None: return self
    key = _compile_args(s)
    if _ahead is not None:
      _defer(key)
      return _not_launched
    k = s.__dict__["kernel"] = _compiled(*key)
    return k


def _not_launched(grid, *args, stream=None) -> None: return None


class Spec(tuple):
  """One compiled variant: (fn, signature, constexprs, options). Its `kernel` is compiled once and kept on it
  (`_Kernel`), so the specs that host wrappers cache launch with no lookup at all."""

  @property
  def constexprs(self) -> dict[str, Any]:
    """The compile-time constants of the variant (block sizes a host wrapper sizes its grid by)."""
    return self[2]

  kernel = _Kernel()


def spec(fn, signature: dict[str, str], constexprs: dict[str, Any], num_warps: int = 4, num_stages: int = 1) -> Spec:
  """One compiled variant; the signature lists every parameter, constexprs as "constexpr"."""
  options = {"num_warps": num_warps, "num_stages": num_stages}
  return Spec((fn, {**signature, **{k: "constexpr" for k in constexprs}}, constexprs, options))


@functools.lru_cache(maxsize=None)
def _compiled(fn, signature: tuple, constexprs: tuple, num_warps: int, num_stages: int) -> launch.Kernel:
  return launch.compile(fn, dict(signature), dict(constexprs), num_warps=num_warps, num_stages=num_stages)


_ahead: tuple | None = None  # while `compiling_ahead`: (the threads, {each variant's compile arguments: its future})


def _compile_args(s: Spec) -> tuple:
  fn, signature, constexprs, options = s
  return fn, tuple(signature.items()), tuple(constexprs.items()), options["num_warps"], options["num_stages"]


def run(s: Spec, grid: tuple[int, ...], *args, stream=None) -> None:
  """Launch a variant on `stream` (default: the current one; compiled once per process, and cached on disk by
  `launch`); while `compiling_ahead`, compile it on a thread instead (if it is not compiled yet) and launch nothing:
  a dry run's data (indices among it) is scratch."""
  if _ahead is None: return s.kernel(grid, *args, stream=stream)
  if "kernel" not in s.__dict__: _defer(_compile_args(s))


def _defer(key: tuple) -> None:
  """Hand a variant's compile (`_compile_args`) to `compiling_ahead`'s threads, once."""
  pool, futures = _ahead
  if key not in futures: futures[key] = pool.submit(_compiled, *key)


def dry() -> bool:
  """Whether a dry run is compiling ahead (`compiling_ahead`): nothing it makes is worth caching."""
  return _ahead is not None


@contextlib.contextmanager
def compiling_ahead(workers: int):
  """A dry run's kernels compiled side by side: within the block each variant not compiled yet is handed to one of
  `workers` threads (`Spec.kernel`) and launches nothing (Triton's compile releases the GIL for most of its work: 60 variants
  took 72.6 s one after another and 38.6 s on 4 threads of a 2-core machine, the same cubins); leaving the block waits
  for them (a failed compile raises here). Yields the dict of the variants handed over. What the block runs besides
  Triton kernels (cuBLASLt, copies) runs for real."""
  global _ahead
  from concurrent.futures import ThreadPoolExecutor
  futures: dict = {}
  with ThreadPoolExecutor(workers, thread_name_prefix="blutrain-compile") as pool:
    _ahead = (pool, futures)
    try: yield futures
    finally: _ahead = None
  for future in futures.values(): future.result()


empty = memory.empty  # a new contiguous array from the caching allocator (device None: the current one)


def empty_ordered(shape, dtype: DType, device: int | None, order: tuple[int, ...] | None,
                  stream=None) -> CudaArray:
  """A new dense array of `shape` whose dims lie in memory in `order` (outermost first, `shapes.memory_order`; None:
  contiguous)."""
  if order is None: return empty(shape, dtype, device, stream)
  buf = empty((math.prod(shape),), dtype, device, stream)
  return view(buf, shape, strides_in_order(tuple(shape), tuple(order)))


def empty_like(a: CudaArray, dtype: DType | None = None, shape=None) -> CudaArray:
  """A new array in a's dense layout (channels-last stays channels-last; contiguous when a is not dense), of a's
  shape or another one of as many dims laid out in a's order (a convolution's output)."""
  return empty_ordered(a.shape if shape is None else tuple(shape), dtype or a.dtype, a.device,
                       memory_order(a.shape, a.strides))


def empty_suggested(a: CudaArray, dtype: DType, shape) -> CudaArray:
  """A new array of `shape`, channels-last (dims (0, 2, ..., 1)) when a is laid out so, else contiguous: PyTorch's
  suggested memory format, for results that take only those two (a convolution's weight gradient: cuDNN's wgrad
  wrote other dense orders wrong on the H200)."""
  order = (0, *range(2, a.ndim), 1)
  return empty_ordered(tuple(shape), dtype, a.device, order if memory_order(a.shape, a.strides) == order else None)


def view(a: CudaArray, shape, strides, offset: int = 0, dtype: DType | None = None) -> CudaArray:
  """Another view of a's memory (offset in elements)."""
  return CudaArray(a.ptr + offset * a.dtype.itemsize, tuple(shape), tuple(strides), dtype or a.dtype, a.device, a.owner)


@functools.lru_cache(maxsize=4096)
def broadcast_shape(*shapes: tuple[int, ...]) -> tuple[int, ...]:
  ndim = max(len(s) for s in shapes)
  return tuple(max((s[i - ndim + len(s)] for s in shapes if i - ndim + len(s) >= 0), default=1) for i in range(ndim))


def broadcast_strides(a: CudaArray, shape) -> tuple[int, ...]:
  """a's strides viewed at the broadcast `shape`: 0 along new and grown dims."""
  lead = len(shape) - a.ndim
  return (0,) * lead + tuple(0 if n == 1 and s != 1 else st for n, s, st in zip(a.shape, shape[lead:], a.strides))


def collapse(shape, *strides) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
  """The fewest dims (at least one) that address the same elements for every operand: size-1 dims are dropped
  and a dim merges into its outer neighbour when each operand's outer stride is its stride times its size."""
  dims: list[tuple[int, list[int]]] = []
  for i, n in enumerate(shape):
    if n == 1: continue
    st = [s[i] for s in strides]
    if dims and all(p == c * n for p, c in zip(dims[-1][1], st)): dims[-1] = (dims[-1][0] * n, st)
    else: dims.append((n, st))
  if not dims: return (1,), [(0,) for _ in strides]
  return tuple(n for n, _ in dims), [tuple(st[k] for _, st in dims) for k in range(len(strides))]


def in_memory_order(shape, out_strides, *strides) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
  """shape and every operand's strides with the dims permuted into the memory order of a dense output (`out_strides`,
  `shapes.memory_order`; unchanged when it is contiguous or not dense): a channels-last output then collapses as a
  contiguous one does, and a kernel walking its flat index in row-major order writes it in memory order."""
  order = memory_order(tuple(shape), tuple(out_strides))
  if order is None: return tuple(shape), [tuple(out_strides), *map(tuple, strides)]
  return tuple(shape[d] for d in order), [tuple(st[d] for d in order) for st in (out_strides, *strides)]


def max_offset(shape, strides) -> int:
  return sum((n - 1) * abs(s) for n, s in zip(shape, strides))


def needs_i64(shape, *strides) -> bool:
  """Whether flat indices or element offsets may pass int32, with a margin for index arithmetic past the end (the
  start of the last block plus its size)."""
  limit = INT32_MAX - (1 << 20)
  return math.prod(shape) > limit or any(max_offset(shape, s) > limit for s in strides)


def f64_bits(x: float) -> int:
  """A float64 as the int64 of its bits: kernels take it as an i64 and bitcast, so no precision is lost."""
  return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def pad(values, n: int, fill: int) -> list[int]:
  """Left-pad to n entries (kernels address up to n dims, innermost last)."""
  values = list(values)
  return [fill] * (n - len(values)) + values


@triton.jit
def strided(index, size1, size2, size3, size4, stride0, stride1, stride2, stride3, stride4, DIMS: tl.constexpr):
  """Element offsets of flat indices over up to 5 dims (sizes size0..size4, innermost last; the outermost size is
  not needed) with strides stride0..stride4; the DIMS innermost dims are used (none: offset 0)."""
  if DIMS == 0:
    off = index * 0
  elif DIMS == 1:
    off = index * stride4
  else:
    off = (index % size4) * stride4
    index = index // size4
    if DIMS == 2:
      off += index * stride3
    else:
      off += (index % size3) * stride3
      index = index // size3
      if DIMS == 3:
        off += index * stride2
      else:
        off += (index % size2) * stride2
        index = index // size2
        if DIMS == 4:
          off += index * stride1
        else:
          off += (index % size1) * stride1
          index = index // size1
          off += index * stride0
  return off


@triton.jit
def axis_offsets(index, size1, size2, size3, size4, stride0, stride1, stride2, stride3, stride4, DIMS: tl.constexpr,
                 UNIT: tl.constexpr):
  """`strided` offsets along one axis of a kernel's problem; a single unit-stride dim (UNIT) is the identity, which
  tells Triton the axis is contiguous."""
  if UNIT and DIMS == 1:
    off = index
  else:
    off = strided(index, size1, size2, size3, size4, stride0, stride1, stride2, stride3, stride4, DIMS)
  return off


def axis_params(axis: str, *arrays: str) -> list[str]:
  """The names of the scalars addressing `axis` of a kernel's problem in some arrays, in the order `axis_args` gives
  them: the sizes of the axis's 4 inner dims ("m_size1".."m_size4"), then each array's 5 strides along it
  ("x_m_stride0".."x_m_stride4")."""
  return [f"{axis}_size{i}" for i in range(1, 5)] + [f"{a}_{axis}_stride{i}" for a in arrays for i in range(5)]


def axis_args(shape, *strides) -> list[int]:
  """The scalars addressing one axis of up to 5 collapsed dims for `strided`: the inner sizes, then each array's
  strides, left-padded (see `axis_params`)."""
  return pad(shape, 5, 1)[1:] + [s for st in strides for s in pad(st, 5, 0)]


@triton.jit
def max_nan(a, b):
  """The larger of a and b, NaN when either is (as numpy's maximum)."""
  return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def min_nan(a, b):
  """The smaller of a and b, NaN when either is (as numpy's minimum)."""
  return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def sqrt_rn(x):
  """IEEE square root: tl.sqrt is approximate in float32, tl.sqrt_rn takes float32 only; float64's is exact."""
  if x.dtype == tl.float32:
    r = tl.sqrt_rn(x)
  else:
    r = tl.sqrt(x)
  return r


def specs() -> list[Spec]:
  """Every variant that the modules of the kernel library list for CI's compile check."""
  pkg = importlib.import_module(__name__)
  return [s for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name)
          for s in getattr(importlib.import_module(f"{__name__}.{info.name}"), "SPECS", [])]
