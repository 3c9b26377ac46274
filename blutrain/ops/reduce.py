"""Reductions over dims (sum, amax, amin, argmax, argmin, cumsum) and their composites."""
from __future__ import annotations

import builtins
import math
from collections import namedtuple

from blutrain import dtypes
from blutrain.autograd.tape import grad_mode
from blutrain.ops.core import autocast_inputs, op
from blutrain.ops.creation import ones_like, zeros
from blutrain.ops.elementwise import exp, isfinite, isnan, log, maximum, minimum, sqrt, where
from blutrain.dtypes import DTypeError
from blutrain.shapes import BoundsError, ShapeError, dim_alias, normalize_dim, normalize_dims
from blutrain.tensor import Tensor

values_indices = namedtuple("values_indices", ["values", "indices"])


def _reduced_shape(shape, dims, keepdim):
  return tuple(1 if i in dims else n for i, n in enumerate(shape)) if keepdim else \
         tuple(n for i, n in enumerate(shape) if i not in dims)


def _reduce_rule(x, dims, keepdim, dtype=None):
  return _reduced_shape(x.shape, dims, keepdim), dtype or x.dtype


def _restore(g: Tensor, x, dims, keepdim) -> Tensor:
  """A reduced gradient reshaped to keepdim form, ready to broadcast against x."""
  return g if keepdim else g.reshape(_reduced_shape(x.shape, dims, True))


sum_op = op("sum", _reduce_rule, lambda g, out, x, dims, keepdim, dtype=None: (
  _restore(g, x, dims, keepdim).expand(x.shape).to(x.dtype),), saves=(),
    inputs="x", attrs="dims:ints keepdim:bool dtype:dtype?")


def _extreme_vjp(g, out, x, dims, keepdim):
  """The gradient is shared evenly among the positions that reached the extreme, as torch.amax does."""
  hit = (x == _restore(out, x, dims, keepdim)).to(g.dtype)
  return (hit * (_restore(g, x, dims, keepdim) / hit.sum(dims, keepdim=True)),)


amax_op = op("amax", _reduce_rule, _extreme_vjp, saves_output=True, inputs="x", attrs="dims:ints keepdim:bool")
amin_op = op("amin", _reduce_rule, _extreme_vjp, saves_output=True, inputs="x", attrs="dims:ints keepdim:bool")
argmax_op = op("argmax", lambda x, dim, keepdim: (_reduced_shape(x.shape, (dim,), keepdim), dtypes.int64), differentiable=False,
               inputs="x", attrs="dim:int keepdim:bool")
argmin_op = op("argmin", lambda x, dim, keepdim: (_reduced_shape(x.shape, (dim,), keepdim), dtypes.int64), differentiable=False,
               inputs="x", attrs="dim:int keepdim:bool")
cumsum_op = op("cumsum", lambda x, dim, reverse=False: (x.shape, x.dtype),
               lambda g, out, x, dim, reverse=False: (cumsum_op(g, dim=dim, reverse=not reverse),), saves=(),
                 inputs="x", attrs="dim:int reverse:bool?")



def _cumprod_vjp(g, out, x, dim):
  """PyTorch's, exact at zeros: before the first zero along dim, sum_{j>=i} g_j out_j / x_i; at the first zero, the
  same sum over the products that leave it out; after it, 0."""
  zero = x == 0
  seen = cumsum(zero, dim)
  before, first = seen == 0, zero & (seen == 1)
  at_first = cumsum_op(g * cumprod_op(where(first, 1.0, x), dim=dim), dim=dim, reverse=True)
  return (where(before, cumsum_op(g * out, dim=dim, reverse=True) / where(before, x, 1.0),
                where(first, at_first, 0.0)),)


cumprod_op = op("cumprod", lambda x, dim: (x.shape, x.dtype), _cumprod_vjp, saves_output=True, inputs="x",
                attrs="dim:int")


@dim_alias
def sum(x: Tensor, dim=None, keepdim: bool = False, *, dtype=None) -> Tensor:
  """Sum over `dim` (an int, a tuple, or None for all). Integer and bool inputs sum in int64, as in PyTorch."""
  if dtype is None: x, = autocast_inputs("sum", x)  # autocast may pick float32 for the result, as PyTorch's does
  dims = normalize_dims(dim, x.ndim, "sum")
  out_dtype = dtypes.to_dtype(dtype) if dtype is not None else (x.dtype if x.dtype.is_floating_point else dtypes.int64)
  return sum_op(x, dims=dims, keepdim=keepdim, dtype=out_dtype)


@dim_alias
def mean(x: Tensor, dim=None, keepdim: bool = False, *, dtype=None) -> Tensor:
  """Arithmetic mean over `dim`."""
  if not dtypes.to_dtype(dtype or x.dtype).is_floating_point:
    raise RuntimeError(f"mean: expected a floating point tensor or dtype, got {x.dtype.name}; use x.float().mean()")
  dims = normalize_dims(dim, x.ndim, "mean")
  n = math.prod(x.shape[d] for d in dims)
  return sum(x, dims, keepdim, dtype=dtype) / n if n else sum(x, dims, keepdim, dtype=dtype) * float("nan")


@dim_alias
def var(x: Tensor, dim=None, keepdim: bool = False, *, correction: int = 1, unbiased: bool | None = None) -> Tensor:
  """Variance over `dim` with Bessel's `correction` (1 by default, as torch.var)."""
  if unbiased is not None: correction = int(unbiased)
  dims = normalize_dims(dim, x.ndim, "var")
  n = math.prod(x.shape[d] for d in dims)
  centered = x - mean(x.detach(), dims, keepdim=True)  # the mean's own gradient is 0 (inf - inf = nan at infinities)
  squares = sum(centered * centered, dims, keepdim)
  return squares / builtins.max(n - correction, 0)  # inf (nan where all equal) when correction >= n, as PyTorch


@dim_alias
def std(x: Tensor, dim=None, keepdim: bool = False, *, correction: int = 1, unbiased: bool | None = None) -> Tensor:
  """Standard deviation: sqrt(var)."""
  return sqrt(var(x, dim, keepdim, correction=correction, unbiased=unbiased))


@dim_alias
def amax(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
  """Maximum over `dim` (gradient split evenly among ties)."""
  _nonempty(x, dim, "amax")
  return amax_op(x, dims=normalize_dims(dim, x.ndim, "amax"), keepdim=keepdim)


@dim_alias
def amin(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
  """Minimum over `dim`."""
  _nonempty(x, dim, "amin")
  return amin_op(x, dims=normalize_dims(dim, x.ndim, "amin"), keepdim=keepdim)


def _nonempty(x: Tensor, dim, name: str) -> None:
  if dim is None and x.numel() == 0:  # PyTorch raises RuntimeError (amax) or IndexError (argmax): both
    raise BoundsError(f"{name}: cannot reduce a tensor of shape {x.shape} with no elements; name a dim to reduce")
  dims = normalize_dims(dim, x.ndim, name)
  if 0 in (x.shape[d] for d in dims):
    raise IndexError(f"{name}: cannot reduce over an empty dimension of a tensor of shape {x.shape}")


@dim_alias
def argmax(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
  """Index of the maximum along `dim` (of the flattened tensor when dim is None)."""
  _nonempty(x, dim, "argmax")
  if dim is None: return argmax_op(x.reshape(-1), dim=0, keepdim=False).reshape((1,) * x.ndim if keepdim else ())
  d = normalize_dim(dim, x.ndim, "argmax")
  return argmax_op(x, dim=d, keepdim=keepdim) if x.ndim else argmax_op(x.reshape(1), dim=0, keepdim=False)


@dim_alias
def argmin(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
  """Index of the minimum along `dim`."""
  _nonempty(x, dim, "argmin")
  if dim is None: return argmin_op(x.reshape(-1), dim=0, keepdim=False).reshape((1,) * x.ndim if keepdim else ())
  d = normalize_dim(dim, x.ndim, "argmin")
  return argmin_op(x, dim=d, keepdim=keepdim) if x.ndim else argmin_op(x.reshape(1), dim=0, keepdim=False)


@dim_alias
def max(x: Tensor, dim=None, keepdim: bool = False):
  """`x.max()` is the largest value; `x.max(dim)` gives (values, indices); `x.max(other)` is maximum."""
  if isinstance(dim, Tensor): return maximum(x, dim)
  if dim is None: return _whole(x, amax, -math.inf) if x.numel() else amax(x)
  return _select(x, argmax(x, dim, keepdim=True), dim, keepdim)


@dim_alias
def min(x: Tensor, dim=None, keepdim: bool = False):
  """`x.min()`, `x.min(dim)` -> (values, indices), or `x.min(other)`."""
  if isinstance(dim, Tensor): return minimum(x, dim)
  if dim is None: return _whole(x, amin, math.inf) if x.numel() else amin(x)
  return _select(x, argmin(x, dim, keepdim=True), dim, keepdim)


def _whole(x: Tensor, extreme, fill: float) -> Tensor:
  """`x.max()`/`x.min()` (extreme: amax/amin, fill: its identity): where x holds a nan the gradient is shared among
  the nans, as PyTorch's (amax's would be nan everywhere); the extreme is taken without them so its VJP stays finite."""
  if not (x.dtype.is_floating_point and x.requires_grad and grad_mode.enabled): return extreme(x)  # the same value
  nans = isnan(x)
  count = sum(nans.to(x.dtype))
  among_nans = sum(where(nans, x, 0.0)) / maximum(count, ones_like(count))
  return where(count > 0, among_nans, extreme(where(nans, fill, x)))


def _select(x: Tensor, idx: Tensor, dim: int, keepdim: bool):
  """(values, indices) of max/min along dim; values are gathered so that, as in PyTorch, the gradient goes
  to the returned index only (amax/amin share it among ties)."""
  if not x.ndim: return values_indices(x.reshape(1).gather(0, idx.reshape(1)).reshape(()), idx)
  values = x.gather(dim, idx)
  return values_indices(values, idx) if keepdim else values_indices(values.squeeze(dim), idx.squeeze(dim))


@dim_alias
def logsumexp(x: Tensor, dim, keepdim: bool = False) -> Tensor:
  """log(sum(exp(x))) over dim, computed stably around the maximum."""
  dims = normalize_dims(dim, x.ndim, "logsumexp")
  if x.ndim == 0: return logsumexp(x.reshape(1), 0)
  if x.numel() == 0:  # the empty sum gives log(0) = -inf, as torch's
    m = zeros(_reduced_shape(x.shape, dims, True), dtype=x.dtype, device=x.device)
  else:
    m = amax(x.detach(), dims, keepdim=True)
    m = where(isfinite(m), m, 0.0)
  out = log(sum(exp(x - m), dims, keepdim=True)) + m
  return out if keepdim else out.squeeze(dims)


@dim_alias
def cumsum(x: Tensor, dim: int, *, dtype=None) -> Tensor:
  """Running sum along dim."""
  if dtype is not None: x = x.to(dtype)
  elif not x.dtype.is_floating_point: x = x.to(dtypes.int64)
  d = normalize_dim(dim, x.ndim, "cumsum")
  return cumsum_op(x, dim=d) if x.ndim else cumsum_op(x.reshape(1), dim=0).reshape(())


@dim_alias
def cumprod(x: Tensor, dim: int, *, dtype=None) -> Tensor:
  """Running product along dim (integers and bools in int64, as PyTorch)."""
  if dtype is not None: x = x.to(dtype)
  elif not x.dtype.is_floating_point: x = x.to(dtypes.int64)
  d = normalize_dim(dim, x.ndim, "cumprod")
  return cumprod_op(x, dim=d) if x.ndim else cumprod_op(x.reshape(1), dim=0).reshape(())


@dim_alias
def prod(x: Tensor, dim: int | None = None, keepdim: bool = False, *, dtype=None) -> Tensor:
  """Product over one dim, or of every element when dim is None (1 for none); the last running product, so the
  gradient is cumprod's, exact at zeros."""
  if dtype is not None: x = x.to(dtype)
  elif not x.dtype.is_floating_point: x = x.to(dtypes.int64)
  if dim is None:
    if not x.numel(): return sum(x) + 1
    flat = x.reshape(-1)
    if x.requires_grad and grad_mode.enabled:  # two zeros or more: a zero gradient everywhere, as PyTorch's
      flat = where(sum(flat == 0) >= 2, flat.detach(), flat)
    return cumprod(flat, 0).narrow(0, x.numel() - 1, 1).reshape(())
  d = normalize_dim(dim, x.ndim, "prod")
  if not x.ndim: return cumprod(x, 0)
  n = x.shape[d]
  out = cumprod(x, d).narrow(d, n - 1, 1) if n else sum(x, d, keepdim=True) + 1
  return out if keepdim else out.squeeze(d)


@dim_alias
def logcumsumexp(x: Tensor, dim: int) -> Tensor:
  """log(cumsum(exp(x))) along dim, computed around the largest value of each slice."""
  if not x.dtype.is_floating_point:
    raise dtypes.UnsupportedDType(f"logcumsumexp: expected a floating point tensor, got {x.dtype.name} (as PyTorch)")
  if not x.ndim: return logcumsumexp(x.reshape(1), dim).reshape(())
  d = normalize_dim(dim, x.ndim, "logcumsumexp")
  if x.numel() == 0: return x * 1
  m = amax(x.detach(), d, keepdim=True)
  m = where(isfinite(m), m, 0.0)
  return log(cumsum(exp(x - m), d)) + m


@dim_alias
def norm(x: Tensor, p="fro", dim=None, keepdim: bool = False, dtype=None) -> Tensor:
  """The vector p-norm over dim (all entries by default): (sum |x|^p)^(1/p); p "fro" is 2, inf the largest |x|,
  -inf the smallest, 0 the count of nonzeros. As PyTorch's, the gradient where the norm is zero is 0."""
  if dtype is not None: x = x.to(dtype)
  if not x.dtype.is_floating_point:
    raise DTypeError(f"norm: expected a floating point tensor, got {x.dtype.name}; cast it, or pass dtype=")
  if p == "fro": p = 2
  if isinstance(p, str): raise ShapeError(f"norm: p={p!r} is not a vector norm; use 'fro' or a number")
  a = x.abs()
  if p == math.inf: return amax(a, dim, keepdim)
  if p == -math.inf: return amin(a, dim, keepdim)
  if p == 0: return sum((x != 0).to(x.dtype), dim, keepdim)
  if p == 1: return sum(a, dim, keepdim)
  total = sum(a * a if p == 2 else a ** p, dim, keepdim)
  zero = total == 0
  safe = where(zero, 1.0, total)  # no 0 ** -0.5 in the gradient
  return where(zero, 0.0, sqrt(safe) if p == 2 else safe ** (1.0 / p))


@dim_alias
def all(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
  """True where every element along dim is nonzero."""
  return sum((x == 0).to(dtypes.int64), dim, keepdim) == 0


@dim_alias
def any(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
  """True where some element along dim is nonzero."""
  return sum((x != 0).to(dtypes.int64), dim, keepdim) > 0


def sum_to(x: Tensor, shape) -> Tensor:
  """Sum a broadcast tensor back to `shape` (the VJP of broadcasting)."""
  shape = tuple(shape)
  lead = x.ndim - len(shape)
  dims = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1 and x.shape[lead + i] != 1)
  out = sum_op(x, dims=dims, keepdim=True, dtype=x.dtype) if dims else x
  return out.reshape(shape) if out.shape != shape else out
