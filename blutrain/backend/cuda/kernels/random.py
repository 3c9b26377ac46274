"""Random numbers from Philox 4x32-10 (Triton's tl.rand/tl.randn/tl.randint4x), keyed by the generator's seed; element i
of a draw uses counter offset + i, so a draw of n numbers takes the counters the generator reserved for it.

The same (seed, offset) gives the same numbers on the CUDA backend, run after run and whatever the launch schedule,
but not the numbers of the CPU backend: numpy's Philox is the 4x64 variant with its own counter layout, and matching
it bit for bit would cost a 64-bit multiply per round on the GPU. Streams are equal in distribution, not in value.

A draw takes its seed and offset as arguments, or with `state` (an int64[2] device array holding the generator's
seed and base offset) reads them from device memory and adds `offset` to the base: a CUDA graph that draws random
numbers then replays with new ones once the state's memory is given the generator's new offset.

rand is uniform on [0, 1) in float32 (31 random bits), then converted to the dtype, as the CPU backend converts its
float32 draw; randn is Box-Muller over two uniforms; randint reduces 64 random bits modulo (high - low); bernoulli is
rand < p; dropout keeps an element where bernoulli's draw of a mask of its shape (probability 1 - p) would be True.
"""
from __future__ import annotations

import functools
import triton
import triton.language as tl

from blutrain import dtypes
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import empty, ptr, run, spec
from blutrain.backend.cuda.kernels.copy import copy
from blutrain.configurator import flat_schedule
from blutrain.dtypes import DType
from blutrain.shapes import cdiv


@triton.jit
def _draws(seed, offset, state, STATE: tl.constexpr, BLOCK: tl.constexpr):
  """This program's element indices, and the seed and counters of their draws: from the arguments, or with STATE
  from the generator state in memory, its base offset added."""
  i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
  if STATE:
    seed = tl.load(state)
    offset = tl.load(state + 1) + offset
  return i, seed, offset + i


@triton.jit
def _random_kernel(out, n, seed, offset, state, low, span, p, OP: tl.constexpr, STATE: tl.constexpr,
                   BLOCK: tl.constexpr):
  i, seed, counter = _draws(seed, offset, state, STATE, BLOCK)
  if OP == "rand":
    v = tl.rand(seed, counter)
  elif OP == "randn":
    v = tl.randn(seed, counter)
  elif OP == "bernoulli":
    v = tl.rand(seed, counter) < p
  else:
    r0, r1, _, _ = tl.randint4x(seed, counter)
    bits = (r1.to(tl.uint64) << 32) | r0.to(tl.uint64)
    v = low + (bits % span.to(tl.uint64)).to(tl.int64)
  tl.store(out + i, v.to(out.dtype.element_ty), mask=i < n)


@triton.jit
def _dropout_kernel(out, x, n, seed, offset, state, keep, scale, ACC: tl.constexpr, STATE: tl.constexpr,
                    BLOCK: tl.constexpr):
  i, seed, counter = _draws(seed, offset, state, STATE, BLOCK)
  v = tl.load(x + i, mask=i < n)
  y = tl.where(tl.rand(seed, counter) < keep, v.to(ACC) * scale, 0.0)
  tl.store(out + i, y.to(out.dtype.element_ty), mask=i < n)


@functools.lru_cache(maxsize=4096)
def random_spec(op: str, dtype: DType, n: int, state: bool = False):
  block, warps = flat_schedule(n, 4)
  sig = {"out": ptr(dtype), "n": "i64", "seed": "i64", "offset": "i64", "state": ptr(dtypes.int64), "low": "i64",
         "span": "i64", "p": "fp32"}
  return spec(_random_kernel, sig, dict(OP=op, STATE=state, BLOCK=block), num_warps=warps)


@functools.lru_cache(maxsize=4096)
def dropout_spec(dtype: DType, n: int, state: bool = False):
  block, warps = flat_schedule(n, dtype.itemsize)
  f64 = dtype is dtypes.float64
  sig = {"out": ptr(dtype), "x": ptr(dtype), "n": "i64", "seed": "i64", "offset": "i64", "state": ptr(dtypes.int64),
         "keep": "fp32", "scale": "fp64" if f64 else "fp32"}
  return spec(_dropout_kernel, sig, dict(ACC=tl.float64 if f64 else tl.float32, STATE=state, BLOCK=block),
              num_warps=warps)


def dropout(x: CudaArray, *, p: float, seed: int = 0, offset: int, state: CudaArray | None = None) -> CudaArray:
  """x with the elements whose draw is not below 1 - p zeroed and the rest scaled by 1 / (1 - p) (element i, in
  row-major order, draws at counter offset + i, as bernoulli's draw of a mask of x's shape does), contiguous."""
  x = x if x.is_contiguous() else copy(x)
  out = empty(x.shape, x.dtype, x.device)
  if out.size == 0: return out
  s = dropout_spec(x.dtype, out.size, state is not None)
  run(s, (cdiv(out.size, s.constexprs["BLOCK"]),), out.ptr, x.ptr, out.size, _signed64(seed), _signed64(offset),
      0 if state is None else state.ptr, 1.0 - float(p), 1.0 / (1.0 - float(p)))
  return out


def _signed64(x: int) -> int: return (int(x) + 2**63) % 2**64 - 2**63


def _draw(op: str, shape, dtype: DType, seed: int = 0, offset: int = 0, low: int = 0, high: int = 1, p: float = 0.0,
          state: CudaArray | None = None) -> CudaArray:
  if state is not None and (state.dtype is not dtypes.int64 or state.shape != (2,)):
    raise ValueError(f"{op}: the generator state must be an int64 array of (seed, offset), got {state.dtype.name} "
                     f"of shape {state.shape}")
  out = empty(shape, dtype, None)
  if out.size == 0: return out
  s = random_spec(op, dtype, out.size, state is not None)
  run(s, (cdiv(out.size, s.constexprs["BLOCK"]),), out.ptr, out.size, _signed64(seed), _signed64(offset),
      0 if state is None else state.ptr, low, _signed64(high - low), float(p))
  return out


KERNELS = {
  "rand": lambda *, shape, dtype, seed=0, offset, state=None: _draw("rand", shape, dtype, seed, offset, state=state),
  "randn": lambda *, shape, dtype, seed=0, offset, state=None: _draw("randn", shape, dtype, seed, offset, state=state),
  "randint": lambda *, shape, dtype, seed=0, offset, low, high, state=None: _draw("randint", shape, dtype, seed, offset,
                                                                                 low, high, state=state),
  "bernoulli": lambda *, shape, dtype, seed=0, offset, p, state=None: _draw("bernoulli", shape, dtype, seed, offset, p=p,
                                                                            state=state),
  "dropout": dropout,
}

SPECS = [random_spec(op, dt, 1 << 20) for op, dt in (("rand", dtypes.float32), ("rand", dtypes.bfloat16),
                                                     ("randn", dtypes.float32), ("randn", dtypes.float64),
                                                     ("randint", dtypes.int64), ("randint", dtypes.int32),
                                                     ("bernoulli", dtypes.bool_))] + [
         random_spec("bernoulli", dtypes.bool_, 1 << 20, True), random_spec("rand", dtypes.float32, 1 << 20, True)] + [
         dropout_spec(dt, 1 << 20, state) for dt in (dtypes.float32, dtypes.bfloat16, dtypes.float64)
         for state in (False, True)]
