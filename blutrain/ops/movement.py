"""Movement: views that share storage (view, permute, expand, slice), cat, and indexing."""
from __future__ import annotations

import functools
import math

import numpy as np

from blutrain import dtypes
from blutrain.ops.core import op
from blutrain.ops.creation import arange, from_numpy, full, tensor
from blutrain.ops.elementwise import copy, operands, where
from blutrain.ops.reduce import sum_to
from blutrain.shapes import (BoundsError, ShapeError, broadcast_shapes, contiguous_strides, dim_alias, normalize_dim,
                             normalize_dims)
from blutrain.tensor import Tensor


# *** views ***

def _infer_shape(x, shape, name: str) -> tuple[int, ...]:
  numel, shape = math.prod(x.shape), tuple(shape)
  if shape.count(-1) > 1: raise ShapeError(f"{name}: only one dimension can be -1, got {shape}")
  if -1 in shape:
    rest = math.prod(n for n in shape if n != -1)
    if rest == 0 or numel % rest:
      raise ShapeError(f"{name}: shape {shape} is invalid for input of shape {tuple(x.shape)} ({numel} elements)")
    shape = tuple(numel // rest if n == -1 else n for n in shape)
  if math.prod(shape) != numel:
    raise ShapeError(f"{name}: shape {shape} is invalid for input of shape {tuple(x.shape)} ({numel} elements)")
  return shape


@functools.lru_cache(maxsize=4096)  # twice per view op, in every step: cached per layout
def view_strides(old_shape, old_strides, new_shape) -> tuple[int, ...] | None:
  """Strides that let `new_shape` view the same memory as (old_shape, old_strides), or None when the view
  needs a copy. PyTorch's rule (computeStride), so strides match its own: the old dims fall into chunks that
  are contiguous within themselves (size-1 dims never break one); consecutive new dims must cover each chunk."""
  if not old_shape: return (1,) * len(new_shape)
  if math.prod(old_shape) == 0:
    return tuple(old_strides) if tuple(old_shape) == tuple(new_shape) else contiguous_strides(new_shape)
  out = [0] * len(new_shape)
  view_d, chunk_stride, chunk_numel, view_numel = len(new_shape) - 1, old_strides[-1], 1, 1
  for d in range(len(old_shape) - 1, -1, -1):
    chunk_numel *= old_shape[d]
    if d == 0 or (old_shape[d - 1] != 1 and old_strides[d - 1] != chunk_numel * chunk_stride):  # a chunk ends
      while view_d >= 0 and (view_numel < chunk_numel or new_shape[view_d] == 1):
        out[view_d] = view_numel * chunk_stride
        view_numel *= new_shape[view_d]
        view_d -= 1
      if view_numel != chunk_numel: return None
      if d > 0: chunk_stride, chunk_numel, view_numel = old_strides[d - 1], 1, 1
  return tuple(out) if view_d == -1 else None


def _view_rule(x, shape): return shape, x.dtype


def _view_layout(x, shape):
  return shape, view_strides(x.shape, x._strides, shape), x._offset


view_op = op("view", _view_rule, lambda g, out, x, shape: (g.reshape(x.shape),), view=_view_layout, saves=(),
             inputs="x", attrs="shape:ints")


def view(x: Tensor, shape) -> Tensor:
  """A view of x with a new shape; fails when the layout needs a copy (then use reshape)."""
  shape = _infer_shape(x, shape, "view")
  strides = view_strides(x.shape, x._strides, shape)
  if strides is None:
    raise RuntimeError(f"view: shape {shape} is not compatible with input of shape {x.shape} and strides {x._strides}; "
                       "use .reshape(...) instead")
  return x if (shape, strides) == (x.shape, x._strides) else view_op(x, shape=shape)


def reshape(x: Tensor, shape) -> Tensor:
  """x with a new shape: a view when the layout allows, else a copy."""
  shape = _infer_shape(x, shape, "reshape")
  strides = view_strides(x.shape, x._strides, shape)
  if strides is None: x = copy(x)
  elif (shape, strides) == (x.shape, x._strides): return x
  return view_op(x, shape=shape)


# every transpose of a step (the matmul VJPs' .mT) is one of a few layouts: the permuted shape and strides are cached

@functools.lru_cache(maxsize=4096)
def _permuted_shape(shape, dims) -> tuple[int, ...]:
  """The shape permuted by dims; ShapeError when dims is not a permutation of shape's dims."""
  if sorted(dims) != list(range(len(shape))):
    raise ShapeError(f"permute: {dims} is not a permutation of the {len(shape)} dimensions of a tensor of shape {shape}")
  return tuple(shape[d] for d in dims)


@functools.lru_cache(maxsize=4096)
def _permuted_strides(strides, dims) -> tuple[int, ...]: return tuple(strides[d] for d in dims)


def _permute_rule(x, dims): return _permuted_shape(x.shape, tuple(dims)), x.dtype


def _permute_vjp(g, out, x, dims):
  inverse = [0] * len(dims)
  for i, d in enumerate(dims): inverse[d] = i
  return (permute_op(g, dims=tuple(inverse)),)


permute_op = op("permute", _permute_rule, _permute_vjp, saves=(),
                view=lambda x, dims: (_permuted_shape(x.shape, tuple(dims)), _permuted_strides(x._strides, tuple(dims)),
                                      x._offset),
                  inputs="x", attrs="dims:ints")


def permute(x: Tensor, dims) -> Tensor:
  """A view with the dims reordered."""
  dims = tuple(normalize_dim(d, x.ndim, "permute") for d in dims)
  return x if dims == tuple(range(x.ndim)) else permute_op(x, dims=dims)


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
  """A view with two dims swapped."""
  n = x.ndim
  a, b = normalize_dim(dim0, n, "transpose"), normalize_dim(dim1, n, "transpose")
  return x if a == b else permute_op(x, dims=_swapped(n, a, b))  # not the identity: permute's checks are done


@functools.lru_cache(maxsize=256)
def _swapped(ndim: int, a: int, b: int) -> tuple[int, ...]:
  """The dims of ndim in order, with a and b swapped."""
  dims = list(range(ndim))
  dims[a], dims[b] = dims[b], dims[a]
  return tuple(dims)


def _expand_rule(x, shape):
  lead = len(shape) - x.ndim
  if lead < 0 or any(n != s and n != 1 for n, s in zip(x.shape, shape[lead:])):
    raise ShapeError(f"expand: cannot expand shape {x.shape} to {shape} (only size-1 dims can grow)")
  return shape, x.dtype


def _expand_layout(x, shape):
  lead = len(shape) - x.ndim
  strides = (0,) * lead + tuple(0 if n == 1 and s != 1 else st for n, s, st in zip(x.shape, shape[lead:], x._strides))
  return shape, strides, x._offset


expand_op = op("expand", _expand_rule, lambda g, out, x, shape: (sum_to(g, x.shape),), view=_expand_layout, saves=(),
               inputs="x", attrs="shape:ints")


def expand(x: Tensor, shape) -> Tensor:
  """A broadcast view (stride 0 along grown dims); -1 keeps a size."""
  shape = tuple(shape)
  lead = len(shape) - x.ndim
  if -1 in shape[:max(lead, 0)]:
    raise ShapeError(f"expand: -1 (keep the size) is not allowed in a new leading dim: {x.shape} to {shape}")
  shape = tuple(x.shape[i - lead] if n == -1 and i >= lead else n for i, n in enumerate(shape))
  return x if shape == x.shape else expand_op(x, shape=shape)


@functools.lru_cache(maxsize=4096)  # a step slices a few layouts many times (a projection's split, every step)
def _slice_shape(index: tuple) -> tuple[int, ...]:
  return tuple(max(0, -(-(stop - start) // step)) for start, stop, step in index)


@functools.lru_cache(maxsize=4096)
def _slice_strides(strides: tuple, index: tuple) -> tuple[tuple[int, ...], int]:
  """The view's strides and the offset it adds."""
  return (tuple(st * step for st, (_, _, step) in zip(strides, index)),
          sum(st * start for st, (start, _, _) in zip(strides, index) if start))


def _slice_rule(x, index): return _slice_shape(index), x.dtype


def _slice_layout(x, index):
  strides, offset = _slice_strides(x._strides, index)
  return _slice_shape(index), strides, x._offset + offset


slice_backward_op = op("slice_backward", lambda g, shape, index: (shape, g.dtype),
                    lambda g2, out, g, shape, index: (slice_op(g2, index=index),), saves=(),
                      inputs="g", attrs="shape:ints index:index")
slice_op = op("slice", _slice_rule, lambda g, out, x, index: (slice_backward_op(g, shape=x.shape, index=index),),
              view=_slice_layout, saves=(), inputs="x", attrs="index:index")


def narrow(x: Tensor, dim: int, start: int, length: int) -> Tensor:
  """A view of `length` entries of dim from `start`."""
  d = normalize_dim(dim, x.ndim, "narrow")
  if start < 0: start += x.shape[d]
  if not (0 <= start and start + length <= x.shape[d] and length >= 0):
    raise BoundsError(f"narrow: start {start} + length {length} exceeds dimension {dim} of size {x.shape[d]}")
  index = tuple((start, start + length, 1) if i == d else (0, n, 1) for i, n in enumerate(x.shape))
  return slice_op(x, index=index)


def squeeze(x: Tensor, dim=None) -> Tensor:
  """Drop size-1 dims (all, or those named in dim)."""
  dims = normalize_dims(dim, x.ndim, "squeeze")
  return reshape(x, tuple(n for i, n in enumerate(x.shape) if not (i in dims and n == 1)))


def unsqueeze(x: Tensor, dim: int) -> Tensor:
  """Insert a size-1 dim at `dim`."""
  d = normalize_dim(dim, x.ndim + 1, "unsqueeze")
  return view_op(x, shape=x.shape[:d] + (1,) + x.shape[d:])


def flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
  """Merge dims start_dim..end_dim into one."""
  if x.ndim == 0: return reshape(x, (1,))
  s, e = normalize_dim(start_dim, x.ndim, "flatten"), normalize_dim(end_dim, x.ndim, "flatten")
  if s > e: raise ShapeError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim} (shape {x.shape})")
  return reshape(x, x.shape[:s] + (math.prod(x.shape[s:e + 1]),) + x.shape[e + 1:])


def unflatten(x: Tensor, dim: int, sizes: tuple) -> Tensor:
  """Split dim into `sizes` (one may be -1)."""
  d = normalize_dim(dim, x.ndim, "unflatten")
  return reshape(x, x.shape[:d] + tuple(sizes) + x.shape[d + 1:])


def split(x: Tensor, split_size, dim: int = 0) -> tuple[Tensor, ...]:
  """Views of consecutive pieces along dim: each of `split_size`, or of the listed sizes."""
  d = normalize_dim(dim, x.ndim, "split")
  n = x.shape[d]
  if isinstance(split_size, int) and split_size <= 0: raise ShapeError(f"split: split_size must be positive, got {split_size}")
  sizes = [split_size] * (n // split_size) + ([n % split_size] if n % split_size else []) if isinstance(split_size, int) \
          else list(split_size)
  if sum(sizes) != n: raise ShapeError(f"split: sizes {sizes} do not add up to dimension {dim} of size {n}")
  starts = [sum(sizes[:i]) for i in range(len(sizes))]
  return tuple(narrow(x, d, s, k) for s, k in zip(starts, sizes))


def chunk(x: Tensor, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
  """`chunks` nearly equal views along dim (the last may be smaller)."""
  n = x.shape[normalize_dim(dim, x.ndim, "chunk")]
  if chunks <= 0: raise ShapeError(f"chunk: the number of chunks must be positive, got {chunks}")
  return split(x, max(1, -(-n // chunks)), dim)


def unbind(x: Tensor, dim: int = 0) -> tuple[Tensor, ...]:
  """The slices along dim, with dim removed."""
  d = normalize_dim(dim, x.ndim, "unbind")
  return tuple(squeeze(s, d) for s in split(x, 1, d))


def repeat(x: Tensor, *sizes) -> Tensor:
  """Tile x: `x.repeat(2, 1)` repeats along dim 0 twice."""
  sizes = tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) else sizes
  if len(sizes) < x.ndim: raise ShapeError(f"repeat: {len(sizes)} sizes for a tensor with {x.ndim} dims")
  x = reshape(x, (1,) * (len(sizes) - x.ndim) + x.shape)
  grown = expand(reshape(x, tuple(v for n in x.shape for v in (1, n))), tuple(v for r, n in zip(sizes, x.shape) for v in (r, n)))
  return reshape(grown, tuple(r * n for r, n in zip(sizes, x.shape)))


# *** cat ***

def _cat_rule(*xs, dim):
  first = xs[0]
  for x in xs[1:]:
    if x.ndim != first.ndim or any(a != b for i, (a, b) in enumerate(zip(x.shape, first.shape)) if i != dim):
      raise ShapeError(f"cat: shapes {[tuple(t.shape) for t in xs]} differ outside dimension {dim}")
  return first.shape[:dim] + (sum(x.shape[dim] for x in xs),) + first.shape[dim + 1:], first.dtype


def _cat_vjp(g, out, *xs, dim):
  starts = [0]
  for x in xs: starts.append(starts[-1] + x.shape[dim])
  return tuple(narrow(g, dim, s, x.shape[dim]) for s, x in zip(starts, xs))


cat_op = op("cat", _cat_rule, _cat_vjp, saves=(), inputs="*xs", attrs="dim:int")


@dim_alias
def cat(tensors, dim: int = 0) -> Tensor:
  """Concatenate along an existing dim."""
  tensors = [t for t in tensors]
  if not tensors: raise ValueError("cat: expected a non-empty list of tensors")
  tensors = operands("cat", *tensors)
  return cat_op(*tensors, dim=normalize_dim(dim, tensors[0].ndim, "cat"))


@dim_alias
def stack(tensors, dim: int = 0) -> Tensor:
  """Join along a new dim."""
  tensors = list(tensors)
  if not tensors: raise ShapeError("stack: expected a non-empty list of tensors")
  shapes = {tuple(t.shape) for t in tensors}
  if len(shapes) > 1: raise ShapeError(f"stack: expects tensors of equal shape, got {sorted(shapes)}")
  d = normalize_dim(dim, tensors[0].ndim + 1, "stack")
  return cat([unsqueeze(t, d) for t in tensors], d)


# *** advanced indexing ***

def index_shape(shape, idx_shapes, positions):
  """NumPy's rule: broadcast index shapes replace the indexed dims, in place when those are adjacent,
  else at the front."""
  b = broadcast_shapes(*idx_shapes, op="index")
  rest = [n for i, n in enumerate(shape) if i not in positions]
  if list(positions) == list(range(positions[0], positions[0] + len(positions))):
    p = positions[0]
    return tuple(rest[:p]) + b + tuple(rest[p:])
  return b + tuple(rest)


def _index_rule(x, *idx, positions):
  for t in idx:
    if t.dtype.category != 1: raise TypeError(f"index: tensors used as indices must be integer, got {t.dtype.name}")
  return index_shape(x.shape, [t.shape for t in idx], positions), x.dtype


index_backward_op = op("index_backward", lambda g, *idx, shape, positions: (shape, g.dtype),
                    lambda g2, out, g, *idx, shape, positions: (index_op(g2, *idx, positions=positions),) + (None,) * len(idx),
                    saves=None, inputs="g *idx", attrs="shape:ints positions:ints")
index_op = op("index", _index_rule, lambda g, out, x, *idx, positions: (
  index_backward_op(g, *idx, shape=x.shape, positions=positions),) + (None,) * len(idx), saves=None,
    inputs="x *idx", attrs="positions:ints")
index_put_op = op("index_put", lambda x, v, *idx, positions: (x.shape, x.dtype), differentiable=False,
               inputs="x v *idx", attrs="positions:ints")


def parse_key(x: Tensor, key):
  """Split an index into the basic part, applied as one slice view plus a reshape, and the tensor indices
  that remain: returns (view, [(dim in view, index tensor)])."""
  key = key if isinstance(key, tuple) else (key,)
  # a list or a tuple inside the key is a sequence of indices, as in PyTorch (`x[((0, 1),)]` is `x[[0, 1]]`)
  key = tuple(tensor(k, dtype=dtypes.int64, device=x.device) if isinstance(k, (list, tuple)) else k for k in key)
  used = sum(k.ndim if isinstance(k, Tensor) and k.dtype is dtypes.bool_ else 0 if k is None or k is Ellipsis else 1 for k in key)
  if used > x.ndim: raise IndexError(f"too many indices for a tensor of dimension {x.ndim} (got {used})")
  if sum(k is Ellipsis for k in key) > 1: raise IndexError("an index can only have a single ellipsis ('...')")
  i = next((i for i, k in enumerate(key) if k is Ellipsis), len(key))
  key = key[:i] + (slice(None),) * (x.ndim - used) + key[i + 1:]
  index, out_shape, adv, d = [(0, n, 1) for n in x.shape], [], [], 0
  for k in key:
    if k is None: out_shape.append(1)
    elif isinstance(k, Tensor) and k.dtype is dtypes.bool_ and k.ndim == 0:  # a new dim of size 1 (True) or 0
      adv.append((len(out_shape), nonzero(k.reshape(1), as_tuple=True)[0]))
      out_shape.append(1)
    elif isinstance(k, Tensor) and k.dtype is dtypes.bool_:
      if k.shape != x.shape[d:d + k.ndim]:
        raise IndexError(f"boolean mask of shape {k.shape} does not match the indexed shape {x.shape[d:d + k.ndim]}")
      for nz in nonzero(k, as_tuple=True):
        adv.append((len(out_shape), nz))
        out_shape.append(x.shape[d])
        d += 1
    elif isinstance(k, Tensor):
      adv.append((len(out_shape), k))
      out_shape.append(x.shape[d])
      d += 1
    elif isinstance(k, slice):
      start, stop, step = k.indices(x.shape[d])
      if step <= 0: raise ValueError(f"slice step must be positive, got {k.step}")
      index[d] = (start, max(start, stop), step)
      out_shape.append(max(0, -(-(stop - start) // step)))
      d += 1
    elif isinstance(k, int) and not isinstance(k, bool):
      n = x.shape[d]
      if not -n <= k < n: raise IndexError(f"index {k} is out of bounds for dimension {d} with size {n}")
      index[d] = (k % n, k % n + 1, 1)
      d += 1
    else:
      raise TypeError(f"unsupported index of type {type(k).__name__}: use ints, slices, None, ..., or integer/bool tensors")
  y = x if all(i == (0, n, 1) for i, n in zip(index, x.shape)) else slice_op(x, index=tuple(index))
  return (y if y.shape == tuple(out_shape) else reshape(y, tuple(out_shape))), adv


def getitem(x: Tensor, key) -> Tensor:
  """x[key] with PyTorch's semantics: basic indices give views, tensor indices gather."""
  y, adv = parse_key(x, key)
  if not adv: return y
  return index_op(y, *(t for _, t in adv), positions=tuple(p for p, _ in adv))


def put(x: Tensor, pos: Tensor, value: Tensor) -> Tensor:
  """x with value written at the flat positions pos (same shape as value), differentiable in x and value.
  Where pos repeats, the last write wins, as in the eager write (PyTorch leaves that case undefined)."""
  if pos.numel() == 0: return x
  pos, n = pos.reshape(-1), x.numel()
  src = index_put_op(full((n,), -1, dtype=dtypes.int64, device=x.device),
                  arange(pos.numel(), device=x.device), pos, positions=(0,))  # which value lands where
  picked = value.reshape(-1).gather(0, where(src >= 0, src, 0))
  return where((src >= 0).reshape(x.shape), picked.reshape(x.shape), x)


def unfold(x: Tensor, dimension: int, size: int, step: int) -> Tensor:
  """The slices of length `size` along `dimension`, `step` apart, in a new last dim: dimension's n becomes
  (n - size) // step + 1. One gather, so a copy where PyTorch's is a view (writes to it do not reach x)."""
  d = normalize_dim(dimension, x.ndim, "unfold")
  n = x.shape[d] if x.ndim else 1
  if not 0 <= size <= n or step < 1:
    raise ShapeError(f"unfold: size {size} must be in [0, {n}] (dimension {dimension} of input {tuple(x.shape)}) and "
                     f"step {step} positive")
  windows = (arange((n - size) // step + 1, device=x.device) * step).unsqueeze(1) + arange(size, device=x.device)
  if not x.ndim: return x.reshape(1)[windows.reshape(-1)]
  out = getitem(x, (slice(None),) * d + (windows,))
  return permute(out, tuple(i for i in range(out.ndim) if i != d + 1) + (d + 1,))


def nonzero(x: Tensor, *, as_tuple: bool = False):
  """Indices of the nonzero entries: (count, ndim), or a tuple of ndim index vectors. The count depends on the
  data, so this reads the values back to the host and cannot be compiled."""
  idx = from_numpy(np.argwhere(x.detach().numpy()).astype(np.int64)).to(x.device)
  return tuple(idx[:, i] for i in range(x.ndim)) if as_tuple else idx


# *** reordering composites ***

def flip(x: Tensor, dims) -> Tensor:
  """x with the entries along each of `dims` in reverse order (a copy, as PyTorch's)."""
  dims = (dims,) if isinstance(dims, int) else tuple(dims)
  for d in (normalize_dims(dims, x.ndim, "flip") if dims else ()):
    x = x[(slice(None),) * d + (arange(x.shape[d] - 1, -1, -1, device=x.device),)]
  return copy(x) if not dims or not x.ndim else x


def roll(x: Tensor, shifts, dims=None) -> Tensor:
  """x with its entries moved `shifts` places along `dims`, those past the end coming round to the start (over the
  flattened tensor when dims is None)."""
  if dims is None:
    if not isinstance(shifts, int) and len(shifts) != 1:
      raise ShapeError(f"roll: without dims, shifts must be one number, got {shifts}")
    return roll(x.reshape(-1), shifts if isinstance(shifts, int) else shifts[0], 0).reshape(x.shape)
  shifts, dims = ((shifts,), (dims,)) if isinstance(dims, int) else (tuple(shifts), tuple(dims))
  if len(shifts) != len(dims): raise ShapeError(f"roll: {len(shifts)} shifts for {len(dims)} dims")
  out = x if x.ndim else x.reshape(1)
  for s, d in zip(shifts, dims):
    d = normalize_dim(d, x.ndim, "roll")
    n = out.shape[d]
    if n and s % n: out = cat([narrow(out, d, n - s % n, s % n), narrow(out, d, 0, n - s % n)], d)
  return copy(out) if out is x else out.reshape(x.shape)


def diagonal(x: Tensor, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Tensor:
  """The entries x[..., i, i + offset] of dims (dim1, dim2), on a new last dim (a copy, not a view as in PyTorch)."""
  return _diagonal(x, offset, dim1, dim2)


def _diagonal(x: Tensor, offset: int, dim1: int, dim2: int) -> Tensor:
  d1, d2 = normalize_dim(dim1, x.ndim, "diagonal"), normalize_dim(dim2, x.ndim, "diagonal")
  if d1 == d2: raise ShapeError(f"diagonal: dim1 and dim2 name the same dim {dim1} of a tensor of shape {x.shape}")
  rest = [d for d in range(x.ndim) if d not in (d1, d2)]
  x = permute(x, (*rest, d1, d2))
  r, c = x.shape[-2], x.shape[-1]
  n = max(0, min(r, c - offset) if offset >= 0 else min(r + offset, c))
  i = arange(n, device=x.device)
  rows, cols = (i, i + offset) if offset >= 0 else (i - offset, i)
  return x[(Ellipsis, rows, cols)]


def diag(x: Tensor, diagonal: int = 0) -> Tensor:
  """A 1-D x as the `diagonal`-th diagonal of a square matrix of zeros; of a 2-D x, that diagonal."""
  if x.ndim == 2: return _diagonal(x, diagonal, 0, 1)
  if x.ndim != 1: raise ShapeError(f"diag: expected a 1-D or 2-D tensor, got shape {x.shape}")
  n, k = x.shape[0], diagonal
  m = n + abs(k)
  if n == 0: return full((m, m), 0, dtype=x.dtype, device=x.device)
  i, j = arange(m, device=x.device).reshape(m, 1), arange(m, device=x.device).reshape(1, m)
  source = (i if k >= 0 else j).expand(m, m).clamp(0, n - 1)  # the entry of x each position would hold
  return where(j - i == k, x[source], 0)


def repeat_interleave(x: Tensor, repeats, dim: int | None = None, *, output_size: int | None = None) -> Tensor:
  """Each entry along dim repeated `repeats` times in place (`[a, b]` -> `[a, a, b, b]`; over the flattened tensor
  when dim is None); `repeats` may be a tensor of one count per entry (read on the host)."""
  if dim is None: x, dim = x.reshape(-1), 0
  d = normalize_dim(dim, x.ndim, "repeat_interleave")
  n = x.shape[d] if x.ndim else 1
  if isinstance(repeats, Tensor) and repeats.numel() != 1:
    counts = repeats.tolist()
    if len(counts) != n or any(c < 0 for c in counts):
      raise ShapeError(f"repeat_interleave: {len(counts)} counts for dimension {dim} of size {n}; each must be >= 0")
    return x[(slice(None),) * d + (tensor(np.repeat(np.arange(n), counts), device=x.device),)]
  r = int(repeats.item()) if isinstance(repeats, Tensor) else int(repeats)
  if r < 0: raise ShapeError(f"repeat_interleave: repeats must be non-negative, got {r}")
  if not x.ndim: x = x.reshape(1)
  shape = x.shape
  return expand(x.unsqueeze(d + 1), shape[:d + 1] + (r,) + shape[d + 1:]).reshape(shape[:d] + (n * r,) + shape[d + 1:])


def masked_select(x: Tensor, mask: Tensor) -> Tensor:
  """The entries of x where mask (broadcast with x) is True, as a 1-D tensor."""
  shape = broadcast_shapes(x.shape, mask.shape, op="masked_select")
  return expand(x, shape)[expand(mask, shape)] if shape else x.reshape(1)[mask.reshape(1)]
