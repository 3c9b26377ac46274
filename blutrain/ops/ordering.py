"""Ordering and sampling built on it: the `argsort` primitive, and sort, topk, kthvalue, randperm and multinomial over
it (values are gathered at the sorted positions, so gradients flow to the elements chosen, as PyTorch's)."""
from __future__ import annotations

import math

from blutrain import dtypes
from blutrain.autograd.tape import hooks
from blutrain.ops.core import op
from blutrain.ops.elementwise import log, where
from blutrain.ops.creation import arange
from blutrain.ops.movement import cat, narrow
from blutrain.ops.nn import gather
from blutrain.ops.random import Generator, rand, randint
from blutrain.ops.reduce import cumsum, sum, values_indices
from blutrain.shapes import BoundsError, ShapeError, dim_alias, normalize_dim
from blutrain.tensor import Tensor

# the int64 positions that order x along dim: stable (ties keep their order), nan above +inf, as PyTorch's sort
argsort_op = op("argsort", lambda x, dim, descending: (x.shape, dtypes.int64), differentiable=False, inputs="x",
                attrs="dim:int descending:bool")


def _argsort(x: Tensor, dim: int, descending: bool, name: str) -> Tensor:
  if x.dtype is dtypes.bool_: x = x.to(dtypes.int32)
  d = normalize_dim(dim, x.ndim, name)
  if not x.ndim: return argsort_op(x.reshape(1), dim=0, descending=descending).reshape(())
  return argsort_op(x, dim=d, descending=descending)


@dim_alias
def argsort(x: Tensor, dim: int = -1, descending: bool = False, *, stable: bool = False) -> Tensor:
  """The positions that sort x along dim (always stable: equal values keep their order)."""
  return _argsort(x, dim, descending, "argsort")


@dim_alias
def sort(x: Tensor, dim: int = -1, descending: bool = False, *, stable: bool = False):
  """(values, indices) of x sorted along dim; nan sorts above +inf, as in PyTorch."""
  idx = _argsort(x, dim, descending, "sort")
  return values_indices(_take(x, dim, idx), idx)


def _take(x: Tensor, dim: int, idx: Tensor) -> Tensor:
  return gather(x, dim, idx) if x.ndim else gather(x.reshape(1), 0, idx.reshape(1)).reshape(())


def msort(x: Tensor) -> Tensor:
  """x sorted along its first dim."""
  return sort(x, 0).values


@dim_alias
def topk(x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
  """(values, indices) of the k largest (smallest when not `largest`) entries along dim, in order."""
  d = normalize_dim(dim, x.ndim, "topk")
  n = x.shape[d] if x.ndim else 1
  if not 0 <= k <= n: raise BoundsError(f"topk: k={k} is out of range for dimension {dim} of size {n} (shape {x.shape})")
  idx = _argsort(x, d, largest, "topk")
  if x.ndim: idx = narrow(idx, d, 0, k)
  return values_indices(_take(x, d, idx), idx)


@dim_alias
def kthvalue(x: Tensor, k: int, dim: int = -1, keepdim: bool = False):
  """(values, indices) of the k-th smallest entry (k from 1) along dim."""
  d = normalize_dim(dim, x.ndim, "kthvalue")
  n = x.shape[d] if x.ndim else 1
  if not 1 <= k <= n: raise BoundsError(f"kthvalue: k={k} is out of range for dimension {dim} of size {n} (shape {x.shape})")
  if not x.ndim: return kthvalue(x.reshape(1), k, 0)
  idx = narrow(_argsort(x, d, False, "kthvalue"), d, k - 1, 1)
  values = _take(x, d, idx)
  return values_indices(values, idx) if keepdim else values_indices(values.squeeze(d), idx.squeeze(d))


@dim_alias
def cummax(x: Tensor, dim: int):
  """(values, indices) of the running maximum along dim: nan counts as the largest, ties take the latest index
  (PyTorch's)."""
  return _running_extreme(x, dim, "cummax", True)


@dim_alias
def cummin(x: Tensor, dim: int):
  """(values, indices) of the running minimum along dim."""
  return _running_extreme(x, dim, "cummin", False)


def _running_extreme(x: Tensor, dim: int, name: str, largest: bool):
  """Positions by a log2(n)-step scan (Hillis-Steele) over (value, index) pairs, values gathered at them (so the
  gradient reaches the entries chosen)."""
  d = normalize_dim(dim, x.ndim, name)
  if not x.ndim:
    v, i = _running_extreme(x.reshape(1), 0, name, largest)
    return values_indices(v.reshape(()), i.reshape(()))
  n = x.shape[d]
  v = x.detach()
  i = arange(n, device=x.device).reshape(tuple(n if k == d else 1 for k in range(x.ndim))).expand(x.shape)
  k = 1
  while k < n:  # element j combines the window ending at j - k (earlier, `left`) with its own
    lv, li, rv, ri = narrow(v, d, 0, n - k), narrow(i, d, 0, n - k), narrow(v, d, k, n - k), narrow(i, d, k, n - k)
    left = (rv == rv) & ((lv != lv) | ((lv > rv) if largest else (lv < rv)))
    v, i = cat([narrow(v, d, 0, k), where(left, lv, rv)], d), cat([narrow(i, d, 0, k), where(left, li, ri)], d)
    k *= 2
  return values_indices(gather(x, d, i), i)


def randperm(n: int, *, generator: Generator | None = None, dtype=None, device=None,
             requires_grad: bool = False) -> Tensor:
  """A random permutation of 0..n-1 (the order of n uniform draws from the generator)."""
  if n < 0: raise ShapeError(f"randperm: n must be non-negative, got {n}")
  keys = randint(0, 2**62, (n,), device=device, generator=generator)  # distinct with overwhelming probability
  out = argsort_op(keys, dim=0, descending=False)
  return out.to(dtypes.to_dtype(dtype)) if dtype is not None else out


def multinomial(input: Tensor, num_samples: int, replacement: bool = False, *,
                generator: Generator | None = None) -> Tensor:
  """num_samples category indices per row of `input` (1-D or 2-D, non-negative weights, not necessarily normalized),
  drawn from the generator: with replacement by inverting the cumulative weights at uniform draws, without by the
  smallest Exp(1) / weight keys (a weighted sample without replacement, in the order drawn)."""
  if input.ndim not in (1, 2): raise ShapeError(f"multinomial: expected a 1-D or 2-D tensor of weights, got shape {input.shape}")
  if not input.dtype.is_floating_point:
    raise dtypes.DTypeError(f"multinomial: expected floating point weights, got {input.dtype.name}")
  n = input.shape[-1]
  if n == 0: raise ShapeError("multinomial: the weights have no categories")
  if num_samples <= 0 or (not replacement and num_samples > n):
    raise ShapeError(f"multinomial: cannot draw {num_samples} samples from {n} categories "
                     f"{'with' if replacement else 'without'} replacement")
  w = input.detach() if input.ndim == 2 else input.detach().reshape(1, n)
  rows = w.shape[0]
  if hooks.trace is None:  # a check of values: eager code affords it, a captured graph does not read them
    bad = ((w < 0) | (w != w) | (w == math.inf)).any(1) | (sum(w, 1) <= 0)
    if bool(bad.any()):
      raise ShapeError("multinomial: weights must be finite, non-negative and have a positive sum in every row")
  if replacement:
    cdf = cumsum(w.to(dtypes.float64), 1)
    u = rand(rows, num_samples, device=w.device, generator=generator).to(dtypes.float64) * narrow(cdf, 1, n - 1, 1)
    # the first category whose cumulative weight exceeds u; never one of weight 0
    out = sum((cdf.unsqueeze(1) <= u.unsqueeze(2)).to(dtypes.int64), 2).clamp(max=n - 1)
  else:
    e = -log(rand(rows, n, device=w.device, generator=generator).to(dtypes.float64))
    keys = where(w > 0, e / w.to(dtypes.float64), math.inf)
    out = narrow(argsort_op(keys, dim=1, descending=False), 1, 0, num_samples)
  return out if input.ndim == 2 else out.reshape(num_samples)

