"""Shape arithmetic every layer shares: contiguous strides, broadcasting, dimension wrapping, block counts."""
from __future__ import annotations

import functools
import math
from typing import Sequence

Shape = tuple[int, ...]


class Size(tuple):
  """A tensor's shape, as torch.Size: a tuple of ints (equal to and hashing as the plain tuple), with `numel()`.
  Its slices and sums are plain tuples (NOTE: indexing stays the tuple's C code; shapes are read in every op).
  `str()` is the tuple's, so messages read `(2, 3)`; `repr()` is `bt.Size([2, 3])`."""
  __slots__ = ()

  def numel(self) -> int: return math.prod(self)
  def __repr__(self) -> str: return f"bt.Size({list(self)})"
  def __str__(self) -> str: return tuple.__repr__(self)


def contiguous_strides(shape: Sequence[int]) -> Shape:
  """Row-major strides in elements; a size-0 dim counts as 1, as PyTorch's do."""
  return _contiguous_strides(shape if shape.__class__ is tuple else tuple(shape))


@functools.lru_cache(maxsize=4096)  # asked for by every new array and layout check of a step, for a few shapes
def _contiguous_strides(shape: Shape) -> Shape:
  strides, acc = [], 1
  for n in reversed(shape):
    strides.append(acc)
    acc *= max(n, 1)
  return tuple(reversed(strides))


@functools.lru_cache(maxsize=4096)  # asked for by .contiguous() and layout checks in every step
def is_contiguous(shape: Shape, strides: Shape) -> bool:
  """Whether (shape, strides) address memory row-major without gaps (size-1 dims may have any stride)."""
  return math.prod(shape) == 0 or all(st == cs for n, st, cs in zip(shape, strides, contiguous_strides(shape)) if n != 1)


@functools.lru_cache(maxsize=4096)  # asked for each new array an op makes on the GPU
def memory_order(shape: Shape, strides: Shape) -> tuple[int, ...] | None:
  """The dims of a dense layout from outermost to innermost in memory (channels-last (N, C, H, W): (0, 2, 3, 1)), or
  None when the layout is contiguous or not dense (gaps, overlaps, broadcasts): the order a new array takes to follow
  its input, as PyTorch's outputs keep their inputs' memory format."""
  if is_contiguous(shape, strides) or not is_dense(shape, strides): return None
  return tuple(sorted(range(len(shape)), key=lambda d: -strides[d]))  # stable: size-1 dims keep their place


class memory_format:
  """How a tensor's dims lie in memory, as torch.memory_format: `bt.contiguous_format` (row-major),
  `bt.channels_last` ((N, C, H, W) stored (N, H, W, C)), `bt.channels_last_3d` ((N, C, D, H, W) stored
  (N, D, H, W, C)), `bt.preserve_format` (whatever the input has)."""
  __slots__ = ("name", "ndim")

  def __init__(self, name: str, ndim: int = 0):
    self.name, self.ndim = name, ndim

  def order(self, ndim: int) -> tuple[int, ...] | None:
    """The memory order (`memory_order`) of a tensor of `ndim` dims in this format; None for row-major."""
    if not self.ndim: return None
    if ndim != self.ndim:
      dims = "N, C, H, W" if self.ndim == 4 else "N, C, D, H, W"
      raise RuntimeError(f"{self.name} needs a tensor of {self.ndim} dims ({dims}), got {ndim}")
    return (0, *range(2, ndim), 1)

  def __repr__(self) -> str: return f"blutrain.{self.name}"


contiguous_format, preserve_format = memory_format("contiguous_format"), memory_format("preserve_format")
channels_last, channels_last_3d = memory_format("channels_last", 4), memory_format("channels_last_3d", 5)


def same_layout(shape: Sequence[int], strides: Sequence[int], other: Sequence[int]) -> bool:
  """Whether two arrays of `shape` lay their elements out alike (size-1 dims may have any stride): a kernel walking
  one's memory flat meets the other's same elements."""
  return tuple(strides) == tuple(other) or all(a == b for n, a, b in zip(shape, strides, other) if n != 1)


def in_format(shape: Sequence[int], strides: Sequence[int], fmt: memory_format) -> bool:
  """Whether (shape, strides) is dense in format `fmt` (size-1 dims may have any stride; preserve_format: always)."""
  if fmt is preserve_format: return True
  want = strides_in_order(shape, fmt.order(len(shape)))
  return math.prod(shape) == 0 or all(a == b for n, a, b in zip(shape, strides, want) if n != 1)


def is_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
  """Whether (shape, strides) is a permutation of a contiguous layout: its elements fill a span of as many once."""
  return _dense_permutation(tuple(shape), tuple(strides))


@functools.lru_cache(maxsize=4096)  # asked per parameter and gradient by every optimizer step and clipping
def _dense_permutation(shape: Shape, strides: Shape) -> bool:
  expected = 1
  for st, n in sorted((st, n) for n, st in zip(shape, strides) if n != 1):
    if st != expected: return False
    expected *= n
  return True


@functools.lru_cache(maxsize=4096)
def strides_in_order(shape: Shape, order: tuple[int, ...] | None) -> Shape:
  """Dense strides of `shape` with its dims laid out in `order` (outermost first; None: row-major)."""
  if order is None: return contiguous_strides(shape)
  strides, acc = [0] * len(shape), 1
  for d in reversed(order):
    strides[d] = acc
    acc *= max(shape[d], 1)
  return tuple(strides)


def broadcast_shapes(*shapes: Shape, op: str = "broadcast") -> Shape:
  """NumPy/PyTorch broadcasting; the error names the op and both shapes."""
  first = shapes[0]
  if len(shapes) == 2:  # a binary op, the common case: no generator
    second = shapes[1]
    if second == first or not second: return tuple(first)
    if not first: return tuple(second)
  elif all(s == first or not s for s in shapes[1:]): return tuple(first)  # equal shapes, or scalars after the first
  out = [1] * max(len(s) for s in shapes)
  for s in shapes:
    for i, n in enumerate(s, len(out) - len(s)):
      if n != 1 and out[i] != n:
        if out[i] != 1: _broadcast_error(shapes, op)
        out[i] = n
  return tuple(out)


class ShapeError(RuntimeError, ValueError):
  """A shape or argument value an op cannot take: a RuntimeError, as PyTorch raises, and a ValueError, as blutrain
  raised before, so callers catching either still do."""


class BoundsError(RuntimeError, IndexError):
  """An index past a dimension's end where PyTorch raises RuntimeError (gather, scatter_add, narrow); an IndexError
  too, as blutrain raised before."""


def _broadcast_error(shapes, op: str):
  """Raise the error naming the first dimension whose sizes differ."""
  for i in range(-max(len(s) for s in shapes), 0):
    sizes = {s[i] for s in shapes if len(s) >= -i} - {1}
    if len(sizes) > 1:
      raise ShapeError(f"{op}: shapes {' and '.join(str(tuple(s)) for s in shapes)} cannot broadcast "
                       f"(sizes {sorted(sizes)} in dimension {i})")


def normalize_dim(dim: int, ndim: int, op: str) -> int:
  """`dim` in [0, ndim) (a 0-d tensor has one dim to name, 0 or -1); IndexError naming the op otherwise."""
  n = max(ndim, 1)
  if not -n <= dim < n:
    raise IndexError(f"{op}: dimension {dim} out of range for a tensor with {ndim} dimensions (expected [{-n}, {n - 1}])")
  return dim % n


def normalize_dims(dim, ndim: int, op: str) -> Shape:
  """None or () -> all dims (as PyTorch's reductions); an int or a sequence -> sorted, unique, non-negative dims."""
  if isinstance(dim, int):  # the common `x.sum(-1)`: no set to sort (a 0-d tensor's dim is checked, then dropped)
    d = normalize_dim(dim, ndim, op)
    return (d,) if ndim else ()
  dims = tuple(dim) if dim is not None else ()
  if not dims: return tuple(range(ndim))
  out = tuple(sorted({normalize_dim(d, ndim, op) for d in dims}))
  if len(out) != len(dims): raise ShapeError(f"{op}: dimension repeated in {dims}")
  return out if ndim else ()  # a 0-d tensor's dim 0 (or -1) is the tensor itself: nothing to reduce or squeeze


def dim_alias(fn):
  """Let a function of `dim` take numpy's name `axis=` for it too, as PyTorch's do."""
  @functools.wraps(fn)
  def aliased(*args, axis=None, **kw):
    if axis is not None:
      if "dim" in kw: raise TypeError(f"{fn.__name__}: got both dim= and its alias axis=")
      kw["dim"] = axis
    return fn(*args, **kw)
  return aliased


def cdiv(a: int, b: int) -> int: return -(-a // b)
def next_pow2(n: int) -> int: return 1 << max(0, n - 1).bit_length()  # NOTE: triton's own helpers are slow jit wrappers
