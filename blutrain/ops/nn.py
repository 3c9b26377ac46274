"""Neural-network primitives (softmax, layer/batch norm, embedding, gather/scatter, cross_entropy) and composites."""
from __future__ import annotations

import functools
import math

from blutrain import backends, dtypes
from blutrain.autograd.tape import Aval, hooks
from blutrain.ops.core import autocast_inputs, op, write
from blutrain.ops.creation import arange, full, ones, zeros
from blutrain.ops.elementwise import exp, floating, rsqrt, where
from blutrain.ops.linalg import matmul
from blutrain.ops.movement import put
from blutrain.ops.random import dropout
from blutrain.dtypes import DTypeError
from blutrain.shapes import ShapeError, normalize_dim
from blutrain.tensor import Tensor


def _same_dim(x, dim): return x.shape, x.dtype


# *** softmax ***

softmax_op = op("softmax", _same_dim, lambda g, out, x, dim: (out * (g - (g * out).sum(dim, keepdim=True)),),
                saves=(), saves_output=True, inputs="x", attrs="dim:int")
log_softmax_op = op("log_softmax", _same_dim, lambda g, out, x, dim: (g - exp(out) * g.sum(dim, keepdim=True),),
                    saves=(), saves_output=True, inputs="x", attrs="dim:int")


def softmax(x: Tensor, dim: int, dtype=None) -> Tensor:
  """exp(x) / sum(exp(x)) along dim, computed stably."""
  x = x.to(dtype) if dtype is not None else floating(x)
  d = normalize_dim(dim, x.ndim, "softmax")
  return softmax_op(x, dim=d) if x.ndim else softmax_op(x.reshape(1), dim=0).reshape(())


def log_softmax(x: Tensor, dim: int, dtype=None) -> Tensor:
  """x - logsumexp(x) along dim."""
  x = x.to(dtype) if dtype is not None else floating(x)
  d = normalize_dim(dim, x.ndim, "log_softmax")
  return log_softmax_op(x, dim=d) if x.ndim else log_softmax_op(x.reshape(1), dim=0).reshape(())


# *** normalization ***

def _layer_norm_rule(x, w, b, n, eps, dtype=None):
  for name, p in (("weight", w), ("bias", b)):
    if p is not None and p.shape != x.shape[x.ndim - n:]:
      raise ShapeError(f"layer_norm: {name} of shape {p.shape} does not match normalized shape {x.shape[x.ndim - n:]}")
  return x.shape, dtype or x.dtype


def _layer_norm_vjp(g, out, x, w, b, n, eps, dtype=None):
  dx, dw, db, _, _ = layer_norm_backward_op(g, x, w, None, n=n, eps=eps, has_bias=b is not None)
  return dx, dw if w is None else dw.to(w.dtype), db if b is None else db.to(b.dtype)


def _layer_norm_backward_rule(g, x, w, residual=None, *, n, eps, has_bias, cast=None, bias_grad=False):
  if residual is not None and residual.shape != x.shape:
    raise ShapeError(f"layer_norm_backward: residual gradient of shape {residual.shape} does not match input {x.shape}")
  if cast is not None and not (cast.is_floating_point and x.dtype.is_floating_point):
    raise DTypeError(f"layer_norm_backward: dx of {x.dtype.name} cast to {cast.name}: expected floating dtypes")
  params = x.shape[x.ndim - n:], x.dtype
  sums = x.shape[x.ndim - n:], dtypes.float64 if x.dtype is dtypes.float64 else dtypes.float32
  return [(x.shape, x.dtype), params if w is not None else None, params if has_bias else None,
          (x.shape, cast) if cast is not None else None, sums if bias_grad else None]


# dx = rstd (gw - mean(gw) - xhat mean(gw xhat)) with gw = g w, dw = sum(g xhat), db = sum(g) over the leading dims,
# xhat = (x - mean) rstd. One kernel computes all: the outputs are dx, dw (None without a weight) and db (None unless
# has_bias), all in x's dtype, dx cast to `cast` (None without), and with `bias_grad` the sums of dx as stored (its
# `cast` copy when there is one) over the leading dims, in float32 (float64 for float64 x). With a `residual` gradient
# (x's shape, read as float32) dx is residual + dx. Nova folds the residual stream's gradient accumulation into the
# kernel, autocast's cast of that gradient for the next matmul (passes/fuse_norms.py), and the bias gradient of the
# linear layer that gradient flows into (passes/fuse_gemm.py).
layer_norm_backward_op = op("layer_norm_backward", _layer_norm_backward_rule, multi=True,
                            inputs="g x ?weight ?residual",
                            attrs="n:int eps:float has_bias:bool cast:dtype? bias_grad:bool?")
# The output comes in `dtype` (absent: x's); the kernels compute in float32, so Nova folds autocast's cast of the
# output down for the next matmul into the op (passes/fuse_casts.py).
layer_norm_op = op("layer_norm", _layer_norm_rule, _layer_norm_vjp, saves=(0, 1),
                   inputs="x ?weight ?bias", attrs="n:int eps:float dtype:dtype?")


def _add_layer_norm_rule(x, y, w, b, n, eps, dtype=None):
  if x.shape != y.shape: raise ShapeError(f"add_layer_norm: y of shape {y.shape} does not match x of shape {x.shape}")
  if x.dtype is not dtypes.float32 or y.dtype not in (dtypes.float32, dtypes.bfloat16, dtypes.float16):
    raise DTypeError(f"add_layer_norm: expected a float32 x and a float32, bfloat16 or float16 y, got {x.dtype.name} "
                     f"and {y.dtype.name}")
  return [(x.shape, x.dtype), _layer_norm_rule(x, w, b, n, eps, dtype)]


# (h, layer_norm(h)) with h = x + y in float32 (y may be a half, read as float32), in one kernel: Nova fuses a
# residual add with the norm that reads it when both are used later (passes/fuse_norms.py). It has no VJP: the pass
# makes it after autodiff.
add_layer_norm_op = op("add_layer_norm", _add_layer_norm_rule, multi=True, inputs="x y ?weight ?bias",
                       attrs="n:int eps:float dtype:dtype?")


def layer_norm(x: Tensor, normalized_shape, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
  """(x - mean) / sqrt(var + eps) * weight + bias over the trailing `normalized_shape` dims."""
  shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
  if tuple(x.shape[x.ndim - len(shape):]) != shape:
    raise ShapeError(f"layer_norm: normalized_shape {shape} does not match the trailing dims of input {x.shape}")
  return layer_norm_op(x, weight, bias, n=len(shape), eps=float(eps))


def _stats_dtype(x) -> dtypes.DType:
  """The dtype per-channel statistics are kept in: float64 for float64 inputs, else float32."""
  return dtypes.float64 if x.dtype is dtypes.float64 else dtypes.float32


def _channels(name: str, x) -> tuple[int]:
  if x.ndim < 2 or not x.dtype.is_floating_point:
    raise ShapeError(f"{name}: expected a floating input (N, C, *), got shape {x.shape} of {x.dtype.name}")
  return (x.shape[1],)


def _batch_norm_rule(x, mean, var, w, b, residual=None, *, eps, training, relu=False):
  c = _channels("batch_norm", x)
  for name, t in (("mean", mean), ("var", var), ("weight", w), ("bias", b)):
    if t is not None and (t.shape != c or not t.dtype.is_floating_point):
      raise ShapeError(f"batch_norm: {name} should be a floating tensor of {c[0]} elements (the channels of input "
                       f"{x.shape}), got shape {t.shape} of {t.dtype.name}")
  if residual is not None and (residual.shape, residual.dtype) != (x.shape, x.dtype):
    raise ShapeError(f"batch_norm: the residual {residual.dtype.name}{list(residual.shape)} should have the input's "
                     f"shape and dtype, {x.dtype.name}{list(x.shape)}")
  return x.shape, x.dtype


def _batch_norm_vjp(g, out, x, mean, var, w, b, residual=None, *, eps, training, relu=False, needs=(True,) * 5):
  if residual is not None or relu:
    raise RuntimeError("batch_norm: the residual and relu epilogue is made by Nova after autodiff and has no VJP")
  if not (needs[0] or needs[3] or needs[4]): return (None,) * 5  # the statistics get no gradient
  dx, dw, db = batch_norm_backward_op(g, x, mean, var, w, eps=eps, training=training, input_grad=needs[0],
                                      weight_grad=needs[3], bias_grad=needs[4])
  return dx, None, None, dw, db


def _batch_norm_stats_rule(x, running_mean=None, running_var=None, batches=None, *, momentum=None):
  stats = (_channels("batch_norm_stats", x), _stats_dtype(x))
  if running_mean is None and running_var is None and batches is None and momentum is None:
    return [stats, stats, None, None, None]
  c, count = stats[0], math.prod(x.shape) // x.shape[1] if x.shape[1] else 0
  if running_mean is None or running_var is None or momentum is None or count < 2 or \
     not running_mean.shape == running_var.shape == c or \
     not (running_mean.dtype.is_floating_point and running_var.dtype.is_floating_point):
    raise ShapeError(f"batch_norm_stats: expected floating running statistics of shape {c}, a momentum and more than "
                     f"one value per channel, got {_described(running_mean)}, {_described(running_var)}, momentum "
                     f"{momentum} over {count} values")
  if batches is not None and (batches.shape != () or batches.dtype is not dtypes.int64):
    raise ShapeError(f"batch_norm_stats: the batch count should be a 0-d int64 tensor, got {_described(batches)}")
  return [stats, stats, (c, running_mean.dtype), (c, running_var.dtype),
          ((), dtypes.int64) if batches is not None else None]


def _described(t) -> str:
  return "none" if t is None else f"{t.dtype.name}{list(t.shape)}"


def _batch_norm_backward_rule(g, x, mean, var, w, relu_out=None, *, eps, training, input_grad, weight_grad,
                              bias_grad):
  _batch_norm_rule(x, mean, var, w, None, eps=eps, training=training)
  if g.shape != x.shape: raise ShapeError(f"batch_norm_backward: gradient of shape {g.shape} for input {x.shape}")
  if relu_out is not None and relu_out.shape != x.shape:
    raise ShapeError(f"batch_norm_backward: relu output of shape {relu_out.shape} for input {x.shape}")
  c = (x.shape[1],), _stats_dtype(x)
  return [(x.shape, x.dtype) if input_grad else None, c if weight_grad else None, c if bias_grad else None]


# Per-channel statistics of x (N, C, *) over all dims but 1: the mean and the biased variance, float32 (float64 for
# float64 x; halves read as float32). Not differentiable: batch_norm's VJP in training form accounts for them. Given
# running statistics (C,) (and BatchNorm's 0-d int64 num_batches_tracked), the op also returns them moved toward the
# batch's, as PyTorch's native_batch_norm moves them: r = (1 - momentum) r + momentum s, with the unbiased variance
# (var * count / (count - 1), count = x.numel() / C), and the batch count plus one: new values, or in place through
# `into` (`batch_norm_stats` below), written by the kernel that merges the statistics.
batch_norm_stats_op = op("batch_norm_stats", _batch_norm_stats_rule, multi=True,
                         inputs="x ?running_mean ?running_var ?batches", attrs="momentum:float?")
# (x - mean) / sqrt(var + eps) * weight + bias per channel (dim 1) of x (N, C, *), in float32 math for halves, the
# output in x's dtype; mean, var, weight and bias (C,) of any floating dtype. `training` says that mean and var are
# x's batch statistics (batch_norm_stats), so the gradient flows through them; otherwise they are given constants
# (running statistics). The backward is one op: dx (x's dtype), dweight = sum(g xhat) and dbias = sum(g) (float32),
# each computed only when asked for; mean and var get no gradient, as in PyTorch. With `relu_out`, the output of a
# ReLU after the norm, g is that ReLU's output gradient (0 where relu_out <= 0): Nova folds relu's backward into it.
batch_norm_backward_op = op("batch_norm_backward", _batch_norm_backward_rule, multi=True,
                            inputs="g x mean var ?weight ?relu_out",
                            attrs="eps:float training:bool input_grad:bool weight_grad:bool bias_grad:bool")
# Nova folds the ReLU after a norm, and the residual add before that ReLU, into the op (passes/fuse_norms.py):
# relu(batch_norm(x) + residual), the residual of x's shape and dtype added to the normalized value as stored.
batch_norm_op = op("batch_norm", _batch_norm_rule, _batch_norm_vjp, saves=(0, 1, 2, 3),
                   inputs="x mean var ?weight ?bias ?residual", attrs="eps:float training:bool relu:bool?")


def batch_norm_stats(x: Tensor, running_mean: Tensor | None = None, running_var: Tensor | None = None,
                     batches: Tensor | None = None, momentum: float | None = None) -> tuple[Tensor, Tensor]:
  """The mean and biased variance of each channel (dim 1) of x (N, C, *), float32 (float64 for float64 x). Given
  the running statistics (both) and a float `momentum`, they move toward the batch's in place (with the unbiased
  variance), and `batches` (a 0-d int64 count), when given, counts one more batch."""
  if running_mean is None and running_var is None: return batch_norm_stats_op(x)[:2]
  into = [None, None, running_mean, running_var] + ([batches] if batches is not None else [])
  new = batch_norm_stats_op(x, running_mean, running_var, batches, into=into,
                            momentum=None if momentum is None else float(momentum))
  for t, v in zip(into[2:], new[2:]):
    if v is not t: write(t, v)
  return new[0], new[1]


def batch_norm(x: Tensor, mean: Tensor, var: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5, training: bool = False) -> Tensor:
  """(x - mean) / sqrt(var + eps) * weight + bias per channel (dim 1) of x (N, C, *), with statistics (C,) that are
  x's own (`training`: from `batch_norm_stats(x)`, and the gradient flows through them) or given constants."""
  return batch_norm_op(x, mean, var, weight, bias, eps=float(eps), training=bool(training))


def rms_norm(x: Tensor, normalized_shape, weight: Tensor | None = None, eps: float | None = None) -> Tensor:
  """x / sqrt(mean(x^2) + eps) * weight over the trailing dims (eps defaults to the dtype's epsilon)."""
  shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
  if tuple(x.shape[x.ndim - len(shape):]) != shape:
    raise ShapeError(f"rms_norm: normalized_shape {shape} does not match the trailing dims of input {x.shape}")
  if weight is not None and tuple(weight.shape) != shape:
    raise ShapeError(f"rms_norm: weight of shape {tuple(weight.shape)} does not match normalized shape {shape}")
  dims = tuple(range(x.ndim - len(shape), x.ndim))
  eps = eps if eps is not None else float(__import__("numpy").finfo(x.dtype.np).eps)
  out = x * rsqrt((x * x).mean(dims, keepdim=True) + eps)
  return out * weight if weight is not None else out


# *** gather, scatter, embedding ***

def _gather_rule(x, dim, index):
  if index.ndim != x.ndim: raise ShapeError(f"gather: index has {index.ndim} dims, input {x.ndim}")
  return index.shape, x.dtype


def _scatter_add_rule(x, index, src, dim):
  if not (index.ndim == src.ndim == x.ndim): raise ShapeError(f"scatter_add: input, index and src need the same number of dims, got {x.shape}, {index.shape}, {src.shape}")
  return x.shape, x.dtype


scatter_add_op = op("scatter_add", _scatter_add_rule, lambda g, out, x, index, src, dim: (
  g, None, gather_op(g, index, dim=dim) if index.shape == src.shape else None), saves=(1,),
    inputs="x index src", attrs="dim:int")
gather_op = op("gather", lambda x, index, dim: _gather_rule(x, dim, index), lambda g, out, x, index, dim: (
  scatter_add_op(zeros(x.shape, dtype=g.dtype, device=g.device), index, g, dim=dim), None), saves=(1,),
    inputs="x index", attrs="dim:int")


def _check_index(name: str, index: Tensor) -> None:
  if not isinstance(index, Tensor) or index.dtype.category != 1:
    raise DTypeError(f"{name}: index must be an integer tensor, got {getattr(index, 'dtype', type(index).__name__)}")


def gather(x: Tensor, dim: int, index: Tensor) -> Tensor:
  """out[i][j] = x[index[i][j]][j] for dim=0 (and likewise along any dim)."""
  _check_index("gather", index)
  return gather_op(x, index, dim=normalize_dim(dim, x.ndim, "gather"))


def scatter_add(x: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
  """x with src added at the positions index names along dim."""
  _check_index("scatter_add", index)
  return scatter_add_op(x, index, src.to(x.dtype), dim=normalize_dim(dim, x.ndim, "scatter_add"))


SCATTER_REDUCTIONS = ("sum", "prod", "mean", "amax", "amin")


def _scatter_check(name: str, x, index, src, dim: int) -> None:
  """PyTorch's shape rule of the scatters: one rank; index no larger than src, nor than x off dim."""
  if not index.ndim == src.ndim == x.ndim:
    raise ShapeError(f"{name}: input, index and src need the same number of dims, got {x.shape}, {index.shape}, "
                     f"{src.shape}")
  if any(i > s or (d != dim and i > n) for d, (i, s, n) in enumerate(zip(index.shape, src.shape, x.shape))):
    raise ShapeError(f"{name}: index {index.shape} must be no larger than src {src.shape}, and no larger than "
                     f"input {x.shape} apart from dimension {dim}")


def _scatter_reduce_rule(x, index, src, dim, reduce, include_self):
  _scatter_check("scatter_reduce", x, index, src, dim)
  return x.shape, x.dtype


def _scatter_reduce_vjp(g, out, x, index, src, dim, reduce, include_self):
  """PyTorch's gradients (scatter_reduce_backward): amax and amin split g evenly among the values equal to the result
  (self counted whenever it equals the result, as PyTorch counts it); prod divides the result by the factor, except
  where a factor is src's only zero at its position; without include_self, self gets no gradient where src lands."""
  scatter = lambda t, s: scatter_add_op(t, index, s, dim=dim)
  at_index = lambda t: gather_op(t, index, dim=dim)
  hits = None if reduce != "mean" and include_self else \
    scatter(zeros(x.shape, dtype=x.dtype, device=x.device), ones(src.shape, dtype=x.dtype, device=x.device))
  if reduce == "sum": gx, gs = g, at_index(g)
  elif reduce == "mean":
    n = hits + float(include_self)
    gx = g / where(n == 0, 1.0, n)
    gs = at_index(gx)
  elif reduce == "prod":
    nonzero_x = where(x == 0, 1.0, x)
    gx = g * scatter_reduce_op(nonzero_x, index, src, dim=dim, reduce=reduce, include_self=include_self) / nonzero_x
    src_zero = src == 0
    zeros_at = at_index(scatter(zeros(x.shape, dtype=x.dtype, device=x.device), src_zero.to(x.dtype)))
    only_zero = src_zero & (zeros_at == 1)
    others = scatter_reduce_op(x, index, where(only_zero, 1.0, src), dim=dim, reduce=reduce, include_self=include_self)
    gs = where(only_zero, at_index(g * others), at_index(g * out) / where(src_zero, 1.0, src))
  else:
    x_is, src_is = (x == out).to(x.dtype), (src == at_index(out)).to(x.dtype)
    share = g / scatter(x_is, src_is)
    gx, gs = x_is * share, src_is * at_index(share)
  return (gx if include_self else where(hits > 0, 0.0, gx)), None, gs


# x with src reduced into it at the positions index names along dim; src has index's shape (the public function cuts
# a larger src down to it, so the gradients need no padding)
scatter_reduce_op = op("scatter_reduce", _scatter_reduce_rule, _scatter_reduce_vjp, saves=(0, 1, 2), saves_output=True,
                       inputs="x index src", attrs="dim:int reduce:str include_self:bool")


def _scatter_source(name: str, x: Tensor, index: Tensor, src) -> Tensor:
  """src checked against x's dtype (a number becomes a tensor of index's shape)."""
  _check_index(name, index)
  if not isinstance(src, Tensor): return full(index.shape, src, dtype=x.dtype, device=x.device)
  if src.dtype is not x.dtype:
    raise DTypeError(f"{name}: src must be a tensor of the input's dtype {x.dtype.name}, got {src.dtype.name}")
  return src


def scatter(x: Tensor, dim: int, index: Tensor, src=None, *, value=None, reduce: str | None = None) -> Tensor:
  """x with src (a tensor, or the number `value`) written at the positions index names along dim:
  out[index[i][j]][j] = src[i][j] for dim=0. Where index repeats a position one of the values lands (which one
  PyTorch leaves undefined); reduce "add" or "multiply" combines them instead (scatter_add, scatter_reduce's prod).

  >>> bt.zeros(2, 3).scatter(0, bt.tensor([[1, 0, 1]]), 5.0)
  tensor([[0., 5., 0.],
          [5., 0., 5.]])"""
  if (src is None) == (value is None): raise TypeError("scatter: expected one of src (a tensor or number) and value")
  src = _scatter_source("scatter", x, index, value if src is None else src)
  if reduce is not None:
    if reduce not in ("add", "multiply"):
      raise ShapeError(f"scatter: reduce must be 'add' or 'multiply', got {reduce!r} (scatter_reduce has the others)")
    return scatter_reduce(x, dim, index, src, "sum" if reduce == "add" else "prod")
  d = normalize_dim(dim, x.ndim, "scatter")
  _scatter_check("scatter", x, index, src, d)
  if not x.ndim: return scatter(x.reshape(1), 0, index.reshape(1), src.reshape(1)).reshape(())
  positions = gather_op(arange(x.numel(), device=x.device).reshape(x.shape), index, dim=d)
  return put(x, positions, src[tuple(slice(0, n) for n in index.shape)])


def scatter_reduce(x: Tensor, dim: int, index: Tensor, src: Tensor, reduce: str, *, include_self: bool = True) -> Tensor:
  """x with src reduced at the positions index names along dim: `reduce` is sum, prod, mean, amax or amin, over the
  values scattered to a position and x's own value there unless include_self is False (positions nothing is
  scattered to keep x's value). mean divides by the count of those values (floor division for integers).

  >>> bt.tensor([1., 2., 3.]).scatter_reduce(0, bt.tensor([0, 0, 2]), bt.tensor([5., 6., 7.]), "amax")
  tensor([6., 2., 7.])"""
  if reduce not in SCATTER_REDUCTIONS:
    raise ShapeError(f"scatter_reduce: reduce must be one of {', '.join(SCATTER_REDUCTIONS)}, got {reduce!r}")
  if not isinstance(src, Tensor): raise TypeError(f"scatter_reduce: src must be a tensor, got {type(src).__name__}")
  src = _scatter_source("scatter_reduce", x, index, src)
  d = normalize_dim(dim, x.ndim, "scatter_reduce")
  _scatter_check("scatter_reduce", x, index, src, d)
  if not x.ndim:
    return scatter_reduce(x.reshape(1), 0, index.reshape(1), src.reshape(1), reduce, include_self=include_self).reshape(())
  if src.shape != index.shape: src = src[tuple(slice(0, n) for n in index.shape)]
  return scatter_reduce_op(x, index, src, dim=d, reduce=reduce, include_self=bool(include_self))


def index_select(x: Tensor, dim: int, index: Tensor) -> Tensor:
  """The entries of dim listed in the 1-D `index`."""
  _check_index("index_select", index)
  d = normalize_dim(dim, x.ndim, "index_select")
  return x[(slice(None),) * d + (index.reshape(-1),)]


def _embedding_rule(weight, idx):
  if weight.ndim != 2: raise ShapeError(f"embedding: weight must be 2-D, got shape {weight.shape}")
  return idx.shape + (weight.shape[1],), weight.dtype


embedding_backward_op = op("embedding_backward", lambda g, idx, num: ((num, g.shape[-1]), g.dtype),
                        inputs="g idx", attrs="num:int")
embedding_op = op("embedding", _embedding_rule, lambda g, out, weight, idx: (
  embedding_backward_op(g, idx, num=weight.shape[0]), None), saves=(1,), inputs="weight idx")


def embedding(input: Tensor, weight: Tensor) -> Tensor:
  """Rows of `weight` picked by the integer tensor `input`: shape input.shape + (dim,)."""
  _check_index("embedding", input)
  return embedding_op(weight, input)


def one_hot(x: Tensor, num_classes: int = -1) -> Tensor:
  """int64 one-hot encoding along a new last dim."""
  _check_index("one_hot", x)
  if num_classes < 0: num_classes = int(x.max().item()) + 1
  return (x.unsqueeze(-1) == arange(num_classes, device=x.device)).to(dtypes.int64)


# *** convolution ***

def conv_out_size(n: int, k: int, stride: int, padding: int, dilation: int) -> int:
  """Output length of a convolution along one dim: floor((n + 2 padding - dilation (k - 1) - 1) / stride) + 1."""
  return (n + 2 * padding - dilation * (k - 1) - 1) // stride + 1


def _conv_check(name, x, w, stride, padding, dilation, groups):
  _checked(name, tuple(x.shape), tuple(w.shape), x.dtype, w.dtype, tuple(stride), tuple(padding), tuple(dilation),
           groups)


@functools.lru_cache(maxsize=4096)
def _checked(name: str, x: tuple, w: tuple, x_dtype, w_dtype, stride: tuple, padding: tuple, dilation: tuple,
             groups: int) -> None:
  """`_conv_check` of one problem, remembered once it passed (a training step asks the same ones every step)."""
  nd = len(x) - 2
  if nd < 1 or len(w) != len(x) or not len(stride) == len(padding) == len(dilation) == nd:
    raise ShapeError(f"{name}: expected input (N, C, *spatial) and weight (C_out, C_in / groups, *kernel) of the same "
                     f"rank with {nd} strides, paddings and dilations, got input {x}, weight {w}, "
                     f"stride {stride}, padding {padding}, dilation {dilation}")
  if groups < 1 or w[0] % groups or x[1] != w[1] * groups:
    raise ShapeError(f"{name}: given groups={groups}, weight of size {list(w)} needs out channels divisible by "
                     f"groups and an input of {w[1] * groups} channels, got input of size {list(x)}")
  if any(s < 1 for s in stride) or any(d < 1 for d in dilation) or any(p < 0 for p in padding):
    raise ShapeError(f"{name}: strides and dilations must be positive and paddings non-negative, got stride {stride}, "
                     f"padding {padding}, dilation {dilation}")
  if x_dtype is not w_dtype:
    raise DTypeError(f"{name}: input type ({x_dtype.name}) and weight type ({w_dtype.name}) should be the same")


def _conv_rule(x, weight, stride, padding, dilation, groups, tf32=False):
  _conv_check("conv", x, weight, stride, padding, dilation, groups)
  return _conv_shape(tuple(x.shape), tuple(weight.shape), tuple(stride), tuple(padding), tuple(dilation)), x.dtype


@functools.lru_cache(maxsize=4096)
def _conv_shape(x: tuple, w: tuple, stride: tuple, padding: tuple, dilation: tuple) -> tuple[int, ...]:
  out = tuple(conv_out_size(*a) for a in zip(x[2:], w[2:], stride, padding, dilation))
  if any(o < 1 for o in out):
    raise ShapeError(f"conv: input of size {list(x)} padded by {list(padding)} is smaller than the dilated kernel "
                     f"of weight {list(w)} (dilation {list(dilation)}): calculated output size {list(out)}")
  return (x[0], w[0]) + out


def _conv_vjp(g, out, x, weight, stride, padding, dilation, groups, tf32=False, needs=(True, True)):
  kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, tf32=tf32)
  return (conv_grad_input_op(g, weight, shape=x.shape, **kw) if needs[0] else None,
          conv_grad_weight_op(g, x, shape=weight.shape, **kw) if needs[1] else None)


def _conv_grad_check(name: str, g, x, weight, stride, padding, dilation, groups) -> None:
  """That g is the output gradient of the convolution of x with weight (x or weight the one the op's `shape` gives)."""
  _conv_check(name, x, weight, stride, padding, dilation, groups)
  if tuple(g.shape) != _conv_rule(x, weight, stride, padding, dilation, groups)[0]:
    raise ShapeError(f"{name}: gradient of size {list(g.shape)} is not the output of a convolution of input "
                     f"{list(x.shape)} with weight {list(weight.shape)} (stride {list(stride)}, padding "
                     f"{list(padding)}, dilation {list(dilation)})")


def _conv_grad_input_rule(g, weight, shape, stride, padding, dilation, groups, tf32=False):
  _conv_grad_check("conv_grad_input", g, Aval(tuple(shape), g.dtype, None), weight, stride, padding, dilation, groups)
  return tuple(shape), g.dtype


def _conv_grad_weight_rule(g, x, shape, stride, padding, dilation, groups, tf32=False):
  _conv_grad_check("conv_grad_weight", g, x, Aval(tuple(shape), x.dtype, None), stride, padding, dilation, groups)
  return tuple(shape), g.dtype


# Both gradients are linear in each operand, so their VJPs are the three ops again (double backward):
# dx = conv_grad_input(g, w) gives d/dg = conv(gg, w), d/dw = conv_grad_weight(g, gg); dw = conv_grad_weight(g, x)
# gives d/dg = conv(x, gw), d/dx = conv_grad_input(g, gw).
def _conv_grad_input_vjp(gg, out, g, weight, shape, needs=(True, True), **kw):
  return (conv_op(gg, weight, **kw) if needs[0] else None,
          conv_grad_weight_op(g, gg, shape=weight.shape, **kw) if needs[1] else None)


def _conv_grad_weight_vjp(gw, out, g, x, shape, needs=(True, True), **kw):
  return conv_op(x, gw, **kw) if needs[0] else None, conv_grad_input_op(g, gw, shape=x.shape, **kw) if needs[1] else None


_CONV_ATTRS = "stride:ints padding:ints dilation:ints groups:int tf32:bool?"
# Cross-correlation of x (N, C, *spatial) with weight (C_out, C / groups, *kernel), zero padding `padding` on both
# sides of each spatial dim; the bias is an add outside the op. The gradients are primitives of their own:
# conv_grad_input is the transposed convolution (what conv_transpose runs) of g, for an input of size `shape`, and
# conv_grad_weight correlates g with x for a weight of size `shape`.
conv_op = op("conv", _conv_rule, _conv_vjp, inputs="x weight", attrs=_CONV_ATTRS)
conv_grad_input_op = op("conv_grad_input", _conv_grad_input_rule, _conv_grad_input_vjp, saves=(0, 1),
                        inputs="g weight", attrs="shape:ints " + _CONV_ATTRS)
conv_grad_weight_op = op("conv_grad_weight", _conv_grad_weight_rule, _conv_grad_weight_vjp, saves=(0, 1),
                         inputs="g x", attrs="shape:ints " + _CONV_ATTRS)


def conv(x: Tensor, weight: Tensor, stride, padding, dilation, groups: int = 1) -> Tensor:
  """The convolution primitive over (N, C, *spatial) with per-dim stride, symmetric padding and dilation tuples;
  float32 multiplies in TF32 when `bt.backends` allows it, as matmul."""
  x, weight = autocast_inputs("conv", x, weight)
  return conv_op(x, weight, stride=tuple(stride), padding=tuple(padding), dilation=tuple(dilation), groups=int(groups),
                 tf32=x.dtype is dtypes.float32 and backends.allow_tf32())


def _max_pool2d_indices_rule(x, kernel, stride, padding, dilation, out_size):
  if x.ndim != 4 or len(out_size) != 2:
    raise ShapeError(f"max_pool2d_indices: expected an input (N, C, H, W) and a 2-d output size, got {x.shape} and "
                     f"{out_size}")
  return (x.shape[0], x.shape[1], *out_size), dtypes.int64


# Each window's first maximum (NaN above every number, padding never) as its flat position in H * W, PyTorch's
# max_pool2d indices: max_pool2d gathers its values there, and its gradient scatters back to them.
max_pool2d_indices_op = op("max_pool2d_indices", _max_pool2d_indices_rule, differentiable=False, inputs="x",
                           attrs="kernel:ints stride:ints padding:ints dilation:ints out_size:ints")


def _max_pool2d_with_indices_rule(x, **geometry):
  shape, _ = _max_pool2d_indices_rule(x, **geometry)
  return [(shape, x.dtype), (shape, dtypes.int64)]


# (max_pool2d_values, max_pool2d_indices) in one pass over x: Nova makes it of the two ops (passes/fuse_norms.py)
max_pool2d_with_indices_op = op("max_pool2d_with_indices", _max_pool2d_with_indices_rule, multi=True, inputs="x",
                                attrs="kernel:ints stride:ints padding:ints dilation:ints out_size:ints")


def max_pool2d_indices(x: Tensor, kernel, stride, padding, dilation, out_size) -> Tensor:
  """The int64 flat position in H * W of each window's maximum of x (N, C, H, W) (see `max_pool2d_indices_op`)."""
  return max_pool2d_indices_op(x, kernel=tuple(kernel), stride=tuple(stride), padding=tuple(padding),
                               dilation=tuple(dilation), out_size=tuple(out_size))


_POOL = "kernel:ints stride:ints padding:ints dilation:ints"


def _max_pool2d_values_rule(x, idx, kernel, stride, padding, dilation):
  if x.ndim != 4 or idx.ndim != 4 or tuple(idx.shape[:2]) != tuple(x.shape[:2]) or idx.dtype is not dtypes.int64:
    raise ShapeError(f"max_pool2d_values: expected an input (N, C, H, W) and int64 indices (N, C, OH, OW), got "
                     f"{x.shape} and {idx.shape} {idx.dtype.name}")
  return idx.shape, x.dtype


def _max_pool2d_backward_rule(g, idx, size, kernel, stride, padding, dilation):
  if g.shape != idx.shape or len(size) != 2:
    raise ShapeError(f"max_pool2d_backward: expected a gradient of the indices' shape {idx.shape} and a 2-d input "
                     f"size, got {g.shape} and {size}")
  return (*g.shape[:2], *size), g.dtype


# max_pool2d's values (x at the window search's indices) and its gradient, each the other's VJP: the gradient sums,
# at each input position, g of the windows whose maximum it is (no atomics, no zero-filled buffer to scatter into)
max_pool2d_values_op = op("max_pool2d_values", _max_pool2d_values_rule,
                          lambda g, out, x, idx, kernel, stride, padding, dilation: (max_pool2d_backward_op(
                            g, idx, size=tuple(x.shape[2:]), kernel=kernel, stride=stride, padding=padding,
                            dilation=dilation), None), saves=(1,), inputs="x idx", attrs=_POOL)
max_pool2d_backward_op = op("max_pool2d_backward", _max_pool2d_backward_rule,
                            lambda gg, out, g, idx, size, kernel, stride, padding, dilation: (max_pool2d_values_op(
                              gg, idx, kernel=kernel, stride=stride, padding=padding, dilation=dilation), None),
                            saves=(1,), inputs="g idx", attrs="size:ints " + _POOL)


def max_pool2d_values(x: Tensor, idx: Tensor, kernel, stride, padding, dilation) -> Tensor:
  """x (N, C, H, W) at `max_pool2d_indices`' positions idx, for windows of that geometry (which its gradient needs)."""
  return max_pool2d_values_op(x, idx, kernel=tuple(kernel), stride=tuple(stride), padding=tuple(padding),
                              dilation=tuple(dilation))


def conv_transpose(x: Tensor, weight: Tensor, shape, stride, padding, dilation, groups: int = 1) -> Tensor:
  """The transposed convolution of x (N, C_in, *spatial) with weight (C_in, C_out / groups, *kernel) to an output
  of size `shape`: conv's gradient with respect to its input."""
  x, weight = autocast_inputs("conv_grad_input", x, weight)
  return conv_grad_input_op(x, weight, shape=tuple(shape), stride=tuple(stride), padding=tuple(padding),
                            dilation=tuple(dilation), groups=int(groups),
                            tf32=x.dtype is dtypes.float32 and backends.allow_tf32())


# *** recurrent cells ***

def _cell_dtype(name: str, gates: int, state: str, gi, gh, s):
  """The result dtype of a recurrent cell (the inputs' promoted one) after checking its gates (N, gates * H) and its
  state s (N, H)."""
  if gi.ndim != 2 or gh.shape != gi.shape or gi.shape[1] % gates or s.shape != (gi.shape[0], gi.shape[1] // gates):
    raise ShapeError(f"{name}: expected input and hidden gates (N, {gates}H) and a {state} (N, H), got "
                     f"{list(gi.shape)}, {list(gh.shape)} and {list(s.shape)}")
  if not all(t.dtype.is_floating_point for t in (gi, gh, s)):
    raise DTypeError(f"{name}: expected floating tensors, got {gi.dtype.name}, {gh.dtype.name} and {s.dtype.name}")
  return dtypes.promote_types(dtypes.promote_types(gi.dtype, gh.dtype), s.dtype)


def _lstm_cell_rule(gi, gh, c):
  dtype = _cell_dtype("lstm_cell", 4, "cell state", gi, gh, c)
  return (gi.shape[0], 2 * c.shape[1]), dtype


def _lstm_cell_vjp(g, out, gi, gh, c):
  d = lstm_cell_backward_op(g, gi, gh, c, out)
  H = c.shape[1]
  return d[:, :4 * H], d[:, :4 * H], d[:, 4 * H:]


# One step of an LSTM after its matmuls: with gates a = gi + gh split as (i, f, g, o) along dim 1,
# c' = sigmoid(f) c + sigmoid(i) tanh(g) and h' = sigmoid(o) tanh(c'), returned side by side as (N, 2H) = [h', c']
# (nn.LSTM takes views of the halves), in float32 math for half inputs. Its backward takes the gradient of [h', c'],
# the inputs and [h', c'], and returns [d gates, d c] (N, 5H): the gates' gradient serves gi and gh alike.
lstm_cell_backward_op = op("lstm_cell_backward", lambda g, gi, gh, c, out: ((gi.shape[0], 5 * c.shape[1]), out.dtype),
                           inputs="g gi gh c out")
lstm_cell_op = op("lstm_cell", _lstm_cell_rule, _lstm_cell_vjp, inputs="gi gh c", saves_output=True)


def _gru_cell_rule(gi, gh, h):
  return h.shape, _cell_dtype("gru_cell", 3, "hidden state", gi, gh, h)


def _gru_cell_vjp(g, out, gi, gh, h):
  d = gru_cell_backward_op(g, gi, gh, h)
  H = h.shape[1]
  return d[:, :3 * H], d[:, 3 * H:6 * H], d[:, 6 * H:]


# One step of a GRU after its matmuls: with gi, gh split as (r, z, n) along dim 1, r = sigmoid(gi_r + gh_r),
# z = sigmoid(gi_z + gh_z), n = tanh(gi_n + r gh_n) and h' = (1 - z) n + z h, in float32 math for half inputs. Its
# backward returns [d gi, d gh, d h] (N, 7H) side by side (d gh differs from d gi in the n block, which r scales).
gru_cell_backward_op = op("gru_cell_backward", lambda g, gi, gh, h: ((gi.shape[0], 7 * h.shape[1]), g.dtype),
                          inputs="g gi gh h")
gru_cell_op = op("gru_cell", _gru_cell_rule, _gru_cell_vjp, inputs="gi gh h")


def gru_cell(gi: Tensor, gh: Tensor, h: Tensor) -> Tensor:
  """One GRU step after its matmuls (gate pre-activations gi and gh (N, 3H), hidden state h (N, H)): h'."""
  return gru_cell_op(gi, gh, h)


def _sequence_dtype(name: str, gates: int, gi, states: dict, w_hh, b_hh):
  """The states' dtype of a recurrent time loop (its cell's rule on one step) after checking the input gates gi
  (L, N, gates H), the initial `states` {name: (N, H)} (h0 first, the cell's own state last), w_hh (gates H, H) and
  b_hh (gates H,) of w_hh's dtype."""
  L, N, G = gi.shape if gi.ndim == 3 else (0, 0, 0)
  H, h0, s = G // gates, list(states.values())[0], list(states.values())[-1]
  if (gi.ndim != 3 or G % gates or any(t.shape != (N, H) for t in states.values()) or w_hh.shape != (G, H)
      or (b_hh is not None and b_hh.shape != (G,))):
    raise ShapeError(f"{name}: expected input gates (L, N, {gates}H), {' and '.join(states)} (N, H), "
                     f"w_hh ({gates}H, H) and b_hh ({gates}H,), got {', '.join(str(list(t.shape)) for t in (gi, *states.values(), w_hh))} "
                     f"and {None if b_hh is None else list(b_hh.shape)}")
  if (not h0.dtype.is_floating_point or not w_hh.dtype.is_floating_point
      or (b_hh is not None and b_hh.dtype is not w_hh.dtype)):
    raise DTypeError(f"{name}: expected a floating h0 and w_hh, and b_hh of w_hh's dtype, got {h0.dtype.name}, "
                     f"{w_hh.dtype.name} and {None if b_hh is None else b_hh.dtype.name}")
  step = Aval((N, G), gi.dtype, None)  # one step's gates
  return _cell_dtype(name, gates, "cell state" if gates == 4 else "hidden state", step, Aval((N, G), w_hh.dtype, None),
                     s)


def _lstm_sequence_rule(gi, h0, c0, w_hh, b_hh, reverse, tf32=False):
  dtype = _sequence_dtype("lstm_sequence", 4, gi, {"h0": h0, "c0": c0}, w_hh, b_hh)
  return gi.shape[:2] + (2 * c0.shape[1],), dtype


def _lstm_sequence_vjp(g, out, gi, h0, c0, w_hh, b_hh, reverse, tf32=False, needs=(True,) * 5):
  return lstm_sequence_backward_op(g, gi, h0, c0, w_hh, b_hh, out, reverse=reverse, tf32=tf32,
                                   states=needs[1] or needs[2], weights=needs[3] or needs[4])


def _lstm_sequence_backward_rule(g, gi, h0, c0, w_hh, b_hh, out, reverse, states, weights, tf32=False):
  if g.shape != out.shape:
    raise ShapeError(f"lstm_sequence_backward: gradient of shape {g.shape} for an output of shape {out.shape}")
  state = lambda t: (t.shape, t.dtype) if states else None
  return [(gi.shape, gi.dtype), state(h0), state(c0), (w_hh.shape, w_hh.dtype) if weights else None,
          (b_hh.shape, b_hh.dtype) if weights and b_hh is not None else None]


# An LSTM's whole time loop after the input projection gi = x W_ih^T + b_ih (L, N, 4H): from h0, c0, step by step
# (from t = L - 1 down with `reverse`) gh = h W_hh^T + b_hh, then lstm_cell's math, returning every step's [h, c] side
# by side as (L, N, 2H) in time order (nn.LSTM takes views of the halves). The recurrent matmul runs in w_hh's dtype
# (h cast to it, float32 accumulation, rounded as linear rounds it), the cell in float32 with states stored in the
# dtype lstm_cell gives, so the result equals the per-step ops exactly. Its backward (one op) walks back through
# time with the cell's gradient and one matmul of the gates' gradient per step; it recomputes every step's gh by one
# matmul of all the h's before the loop (off the sequential path, and 4H fewer values kept per step), and ends with
# one matmul for d w_hh: it returns (d gi, d h0, d c0, d w_hh, d b_hh), without the states' (`states`) or the
# weights' (`weights`) when they need none.
lstm_sequence_backward_op = op("lstm_sequence_backward", _lstm_sequence_backward_rule, multi=True,
                               inputs="g gi h0 c0 w_hh ?b_hh out",
                               attrs="reverse:bool states:bool weights:bool tf32:bool?")
lstm_sequence_op = op("lstm_sequence", _lstm_sequence_rule, _lstm_sequence_vjp, inputs="gi h0 c0 w_hh ?b_hh",
                      attrs="reverse:bool tf32:bool?", saves_output=True)


def lstm_sequence(gi: Tensor, h0: Tensor, c0: Tensor, w_hh: Tensor, b_hh: Tensor | None = None,
                  reverse: bool = False) -> tuple[Tensor, Tensor]:
  """One direction of an LSTM layer after its input projection: gi (L, N, 4H) = x W_ih^T + b_ih for every step,
  initial states h0 and c0 (N, H), recurrent weight w_hh (4H, H) and bias b_hh (4H,) (autocast runs the recurrent
  matmul as it runs linear). Steps t = 0 .. L - 1 (L - 1 .. 0 when `reverse`) with gates gi[t] + h W_hh^T + b_hh as
  `lstm_cell`. Returns every step's h (L, N, H) in time order and the last step's c (N, H), views of one result."""
  w_hh, b_hh = autocast_inputs("linear", w_hh, b_hh)
  out = lstm_sequence_op(gi, h0, c0, w_hh, b_hh, reverse=bool(reverse),
                         tf32=w_hh.dtype is dtypes.float32 and backends.allow_tf32())
  H = c0.shape[-1]
  return out[:, :, :H], out[0 if reverse else -1, :, H:]


def _gru_sequence_rule(gi, h0, w_hh, b_hh, reverse, tf32=False):
  dtype = _sequence_dtype("gru_sequence", 3, gi, {"h0": h0}, w_hh, b_hh)
  return gi.shape[:2] + h0.shape[1:], dtype


def _gru_sequence_vjp(g, out, gi, h0, w_hh, b_hh, reverse, tf32=False, needs=(True,) * 4):
  return gru_sequence_backward_op(g, gi, h0, w_hh, b_hh, out, reverse=reverse, tf32=tf32, states=needs[1],
                                  weights=needs[2] or needs[3])


def _gru_sequence_backward_rule(g, gi, h0, w_hh, b_hh, out, reverse, states, weights, tf32=False):
  if g.shape != out.shape:
    raise ShapeError(f"gru_sequence_backward: gradient of shape {g.shape} for an output of shape {out.shape}")
  return [(gi.shape, gi.dtype), (h0.shape, h0.dtype) if states else None, (w_hh.shape, w_hh.dtype) if weights else None,
          (b_hh.shape, b_hh.dtype) if weights and b_hh is not None else None]


# A GRU direction's whole time loop, as lstm_sequence's: from gi (L, N, 3H) and h0, per step gh = h W_hh^T + b_hh and
# gru_cell's math, every step's h (L, N, H) in time order, equal to the per-step ops. Its backward is one op: gh for all
# steps by one matmul, then per step back gru_cell's backward ([d gi, d gh, d h]) and one matmul of d gh for the
# previous h, one matmul for d w_hh at the end; (d gi, d h0, d w_hh, d b_hh), without d h0 (`states`) or the weights'.
gru_sequence_backward_op = op("gru_sequence_backward", _gru_sequence_backward_rule, multi=True,
                              inputs="g gi h0 w_hh ?b_hh out", attrs="reverse:bool states:bool weights:bool tf32:bool?")
gru_sequence_op = op("gru_sequence", _gru_sequence_rule, _gru_sequence_vjp, inputs="gi h0 w_hh ?b_hh",
                     attrs="reverse:bool tf32:bool?", saves_output=True)


def gru_sequence(gi: Tensor, h0: Tensor, w_hh: Tensor, b_hh: Tensor | None = None, reverse: bool = False) -> Tensor:
  """One direction of a GRU layer after its input projection: gi (L, N, 3H) = x W_ih^T + b_ih, initial state h0
  (N, H), recurrent weight w_hh (3H, H) and bias b_hh (3H,) (autocast runs the recurrent matmul as it runs linear).
  Steps as `gru_cell` with gh = h W_hh^T + b_hh, from the last step when `reverse`. Returns every step's h
  (L, N, H) in time order."""
  w_hh, b_hh = autocast_inputs("linear", w_hh, b_hh)
  return gru_sequence_op(gi, h0, w_hh, b_hh, reverse=bool(reverse),
                         tf32=w_hh.dtype is dtypes.float32 and backends.allow_tf32())


def lstm_cell(gi: Tensor, gh: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
  """One LSTM step after its matmuls (gate pre-activations gi and gh (N, 4H), cell state c (N, H)): (h', c'), views
  of one (N, 2H) result."""
  out = lstm_cell_op(gi, gh, c)
  H = c.shape[-1]
  return out[:, :H], out[:, H:]


# *** losses ***

def _cross_entropy_rule(logits, target, ignore_index, dtype=None):
  if logits.ndim != 2 or target.shape != logits.shape[:1]:
    raise ValueError(f"cross_entropy: expected logits (N, C) and target (N,), got {logits.shape} and {target.shape}")
  return target.shape, dtype or logits.dtype


# The losses come in `dtype` (absent: the logits'); kernels compute half logits in float32, so Nova folds autocast's
# cast of the logits up into the op (passes/fuse_casts.py) by asking for float32 losses of the half logits.
cross_entropy_backward_op = op("cross_entropy_backward", lambda g, logits, target, ignore_index: (logits.shape, logits.dtype),
                            inputs="g logits target", attrs="ignore_index:int")
cross_entropy_op = op("cross_entropy", _cross_entropy_rule, lambda g, out, logits, target, ignore_index, dtype=None: (
  cross_entropy_backward_op(g, logits, target, ignore_index=ignore_index), None),
    inputs="logits target", attrs="ignore_index:int dtype:dtype?")


def _stats_rule(logits):
  return (logits.shape[0],), dtypes.float64 if logits.dtype is dtypes.float64 else dtypes.float32


def _cross_entropy_backward_with_stats_rule(g, logits, target, row_max, sum_exp, ignore_index):
  if row_max.shape != sum_exp.shape or row_max.shape != logits.shape[:1]:
    raise ShapeError(f"cross_entropy_backward_with_stats: expected row statistics of shape {logits.shape[:1]}, got "
                     f"{row_max.shape} and {sum_exp.shape}")
  return logits.shape, logits.dtype


# The same loss and gradient with the forward's row statistics kept for the backward, which then reads the logits once
# (Nova pairs them, passes/fuse_norms.py): the max of each row and the sum of exp(x - max), float32 (float64 for
# float64 logits), computed as the backward would have: the same gradient (on the GPU to float32's rounding, as the
# forward's kernel may add a row's terms in another order).
cross_entropy_with_stats_op = op("cross_entropy_with_stats", lambda logits, target, ignore_index, dtype=None: [
  _cross_entropy_rule(logits, target, ignore_index, dtype), _stats_rule(logits), _stats_rule(logits)], multi=True,
  inputs="logits target", attrs="ignore_index:int dtype:dtype?")
cross_entropy_backward_with_stats_op = op("cross_entropy_backward_with_stats", _cross_entropy_backward_with_stats_rule,
                                          inputs="g logits target row_max sum_exp", attrs="ignore_index:int")
# The loss and the logits' gradient in one op, when the gradient's g is known before the loss (Nova moves what computes
# it ahead, passes/fuse_norms.py): one kernel computes each row's statistics, stores its loss, then reads the row
# again for its gradient. The same values as the pair above.
cross_entropy_with_grad_op = op("cross_entropy_with_grad", lambda g, logits, target, ignore_index, dtype=None: [
  _cross_entropy_rule(logits, target, ignore_index, dtype), (logits.shape, logits.dtype)], multi=True,
  inputs="g logits target", attrs="ignore_index:int dtype:dtype?")


def _rows_rule(name, logits, target):
  if logits.ndim != 2 or target.shape != logits.shape[:1]:
    raise ValueError(f"{name}: expected logits (N, C) and target (N,), got {logits.shape} and {target.shape}")
  if not logits.dtype.is_floating_point or target.dtype.category != 1:
    raise DTypeError(f"{name}: expected floating logits and integer targets, got {logits.dtype.name} and "
                     f"{target.dtype.name}")
  return (logits.shape[0],), dtypes.float64 if logits.dtype is dtypes.float64 else dtypes.float32


def _cross_entropy_lse_backward_rule(g, logits, target, lse, start, ignore_index):
  row = _rows_rule("cross_entropy_lse_backward", logits, target)[0]
  if g.shape != row or lse.shape != row:
    raise ValueError(f"cross_entropy_lse_backward: expected g and lse of shape {row}, got {g.shape} and {lse.shape}")
  return logits.shape, logits.dtype


# The pieces of a cross-entropy whose classes are split over ranks (vocabulary parallelism), each one pass over this
# rank's logits (N, C), classes [start, start + C) of the whole: the stats are, per row, the max, the sum of
# exp(x - max) and the target's logit (0 where the target is not in this rank's range), in float32 (float64 for
# float64 logits; half logits are read as they are), so that the ranks combine them into the whole row's logsumexp
# (lse) and target logit. The gradient of the loss lse - x[target] is g (softmax - onehot(target)) with
# softmax = exp(x - lse), written in the logits' dtype; 0 where target is ignore_index.
cross_entropy_stats_op = op("cross_entropy_stats", lambda logits, target, start: [
  _rows_rule("cross_entropy_stats", logits, target)] * 3, multi=True, inputs="logits target", attrs="start:int")
cross_entropy_lse_backward_op = op("cross_entropy_lse_backward", _cross_entropy_lse_backward_rule,
                                   inputs="g logits target lse", attrs="start:int ignore_index:int")


def cross_entropy(input: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
  """Softmax cross-entropy of logits `input` (N, C) or (N, C, d...) against class indices `target`;
  targets equal to ignore_index count neither in the loss nor in the mean."""
  _check_index("cross_entropy", target)
  if reduction not in ("mean", "sum", "none"): raise ValueError(f"cross_entropy: unknown reduction {reduction!r}")
  if input.ndim == 0: raise ValueError("cross_entropy: expected logits of shape (C,), (N, C) or (N, C, d...), got a 0-d tensor")
  lead = input.shape[:1] + input.shape[2:] if input.ndim > 1 else ()
  if tuple(target.shape) != lead:
    raise ValueError(f"cross_entropy: target of shape {tuple(target.shape)} does not match logits of shape "
                     f"{tuple(input.shape)}; expected a target of shape {lead}")
  if input.ndim > 2: input = input.permute(0, *range(2, input.ndim), 1)  # (N, C, d...) -> (N, d..., C)
  input, target = input.reshape(-1, input.shape[-1]), target.reshape(-1)
  losses = cross_entropy_op(floating(input), target, ignore_index=ignore_index)
  if reduction == "none": return losses.reshape(lead)
  if reduction == "sum": return losses.sum()
  return losses.sum() / (target != ignore_index).sum().to(losses.dtype)


def nll_loss(input: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
  """Negative log-likelihood of log-probabilities `input` (N, C) at class indices `target`."""
  valid = target != ignore_index
  picked = -gather(input, 1, where(valid, target, 0).unsqueeze(1)).squeeze(1) * valid.to(input.dtype)
  if reduction == "none": return picked
  if reduction == "sum": return picked.sum()
  return picked.sum() / valid.sum().to(input.dtype)


def mse_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
  """Mean squared error."""
  sq = (input - target) * (input - target)
  return sq.mean() if reduction == "mean" else sq.sum() if reduction == "sum" else sq


# *** masks, attention ***

def _band(x: Tensor, diagonal: int, lower: bool) -> Tensor:
  if x.ndim < 2: raise ShapeError(f"{'tril' if lower else 'triu'}: expected at least 2 dims, got shape {x.shape}")
  rows = arange(x.shape[-2], device=x.device).unsqueeze(1)
  cols = arange(x.shape[-1], device=x.device).unsqueeze(0)
  keep = (cols - rows <= diagonal) if lower else (cols - rows >= diagonal)
  return where(keep, x, zeros((), dtype=x.dtype, device=x.device))


def tril(x: Tensor, diagonal: int = 0) -> Tensor:
  """The lower triangle (entries with col - row <= diagonal); the rest zero."""
  return _band(x, diagonal, lower=True)


def triu(x: Tensor, diagonal: int = 0) -> Tensor:
  """The upper triangle (entries with col - row >= diagonal); the rest zero."""
  return _band(x, diagonal, lower=False)


def _linear_rule(x, weight, bias=None, tf32=False):
  n, k = weight.shape if weight.ndim == 2 else (None, None)
  if x.ndim < 2 or k != x.shape[-1] or bias is not None and bias.shape != (n,):
    raise ShapeError(f"linear: expected x (..., K), weight (N, K) and bias (N,), got {tuple(x.shape)}, "
                     f"{tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}")
  if not x.dtype is weight.dtype is (weight.dtype if bias is None else bias.dtype) or not x.dtype.is_floating_point:
    raise DTypeError(f"linear: expected x, weight and bias of one floating dtype, got {x.dtype.name}, "
                     f"{weight.dtype.name} and {None if bias is None else bias.dtype.name}")
  return x.shape[:-1] + (n,), x.dtype


def _linear_vjp(g, out, x, weight, bias=None, tf32=False, needs=(True, True, True)):
  bias_grad = len(needs) > 2 and needs[2]  # `needs` has no place for an absent bias
  return linear_backward_op(g, x, weight, bias=bias_grad, input_grad=needs[0], weight_grad=needs[1],
                            tf32=tf32)[:len(needs)]


def _linear_backward_rule(g, x, weight, *, bias, input_grad, weight_grad, tf32=False):
  n = weight.shape[0]
  if tuple(g.shape) != tuple(x.shape[:-1]) + (n,):
    raise ShapeError(f"linear_backward: a gradient of shape {tuple(x.shape[:-1]) + (n,)} for x {tuple(x.shape)} and "
                     f"weight {tuple(weight.shape)}, got {tuple(g.shape)}")
  return [(x.shape, x.dtype) if input_grad else None, (weight.shape, weight.dtype) if weight_grad else None,
          ((n,), weight.dtype) if bias else None]


# linear's gradients, as asked: dx = g W, dW = g^T x (in the weight's dtype from the float32 accumulator) and the bias
# gradient, the column sums of g, from dW's GEMM when both are asked (cuBLASLt's BGRADB epilogue); the kernels view
# g and x as matrices themselves, so a linear layer's backward is one op on the tape's walk, not five
linear_backward_op = op("linear_backward", _linear_backward_rule, multi=True, inputs="g x weight",
                        attrs="bias:bool input_grad:bool weight_grad:bool tf32:bool?")


# x @ weight^T + bias as one op in eager mode: on CUDA one GEMM whose epilogue adds the bias to the float32
# accumulator (rounding halves once, as PyTorch's addmm and Nova's fused GEMM), on the CPU rounded as the matmul and
# add it stands for. A capture records those two ops, which Nova fuses itself (passes/fuse_gemm.py).
linear_op = op("linear", _linear_rule, _linear_vjp, saves=(0, 1), inputs="x weight ?bias", attrs="tf32:bool?")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
  """x @ weight.T + bias, as nn.Linear."""
  x, weight, bias = autocast_inputs("linear", x, weight, bias)
  if hooks.trace is None and x.ndim >= 2 and weight.ndim == 2 and x.dtype.is_floating_point:
    return linear_op(x, weight, bias, tf32=x.dtype is dtypes.float32 and backends.allow_tf32())
  out = matmul(x, weight.mT)
  return out + bias if bias is not None else out


def _check_attention(name: str, q, k, v) -> None:
  if q.ndim < 2 or k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
    raise ShapeError(f"{name}: expected q (..., L, E) and k, v (..., S, E) with the same batch dims, got "
                     f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}")
  if not q.dtype is k.dtype is v.dtype:
    raise DTypeError(f"{name}: q, k, v must share one dtype, got {q.dtype.name}, {k.dtype.name}, {v.dtype.name}")


def _flash_attention_rule(q, k, v, causal, scale, tf32=False):
  _check_attention("flash_attention", q, k, v)
  return q.shape, q.dtype


def _flash_attention_vjp(g, out, q, k, v, causal, scale, tf32=False):
  return flash_attention_backward_op(g, q, k, v, out, causal=causal, scale=scale, tf32=tf32)


# softmax(q k^T * scale [causal]) v without the (L, S) weights in memory; the backward computes dq, dk and dv
# together, recomputing the weights
flash_attention_backward_op = op("flash_attention_backward", lambda g, q, k, v, out, causal, scale, tf32=False: [
  (q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype)], multi=True,
                                 inputs="g q k v out", attrs="causal:bool scale:float tf32:bool?")
flash_attention_op = op("flash_attention", _flash_attention_rule, _flash_attention_vjp, saves_output=True,
                     inputs="q k v", attrs="causal:bool scale:float tf32:bool?")


def _flash_attention_transposed_rule(q, k, v, causal, scale, tf32=False):
  _check_attention("flash_attention_transposed", q, k, v)
  if q.ndim != 4: raise ShapeError(f"flash_attention_transposed: expected q of shape (B, H, L, E), got {tuple(q.shape)}")
  B, H, L, E = q.shape
  return (B, L, H, E), q.dtype


def _flash_attention_transposed_vjp(g, out, q, k, v, causal, scale, tf32=False):
  g, out = g.permute(0, 2, 1, 3), out.permute(0, 2, 1, 3)
  if _split_from_one_projection(q, k, v):
    packed = flash_attention_backward_packed_op(g, q, k, v, out, causal=causal, scale=scale, tf32=tf32)
    return tuple(t.permute(0, 2, 1, 3) for t in packed.unbind(2))
  return flash_attention_backward_op(g, q, k, v, out, causal=causal, scale=scale, tf32=tf32)


def _split_from_one_projection(q, k, v) -> bool:
  """Whether q, k, v (B, H, L, E) are the three column blocks of one (B, L, 3 H E) tensor, side by side (a self-
  attention's `qkv.split(C, dim=2)`): their gradients are then written as one (B, L, 3, H, E) tensor, whose blocks
  the split's and the heads' views take back without a copy."""
  B, H, L, E = q.shape
  return (q._storage is k._storage is v._storage and q.shape == k.shape == v.shape
          and q._strides == k._strides == v._strides == (L * 3 * H * E, E, 3 * H * E, 1)
          and k._offset - q._offset == v._offset - k._offset == H * E)


# flash_attention's output with its heads after its positions, (B, L, H, E) contiguous: what a transformer's
# `y.transpose(1, 2).contiguous()` makes of it, written so by the kernel. Eager scaled_dot_product_attention returns
# it (as the (B, H, L, E) view) for queries laid out so, as PyTorch's attention keeps q's layout; Nova's fuse-norms
# folds the copy of a captured flash_attention into it
flash_attention_transposed_op = op("flash_attention_transposed", _flash_attention_transposed_rule,
                                   _flash_attention_transposed_vjp, saves_output=True,
                                   inputs="q k v", attrs="causal:bool scale:float tf32:bool?")


def _flash_attention_backward_packed_rule(g, q, k, v, out, causal, scale, tf32=False):
  if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
    raise ShapeError(f"flash_attention_backward_packed: expected q, k, v of one shape (B, H, L, E), got "
                     f"{tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}")
  B, H, L, E = q.shape
  return (B, L, 3, H, E), q.dtype


# flash_attention_backward's dq, dk and dv of a self-attention, packed along dim 2 of one (B, L, 3, H, E) tensor: the
# gradient of the projection that q, k and v were split from, as the kernels write it (Nova's fuse-gemm makes it
# where autograd would concatenate them)
flash_attention_backward_packed_op = op("flash_attention_backward_packed", _flash_attention_backward_packed_rule,
                                        inputs="g q k v out", attrs="causal:bool scale:float tf32:bool?")
_FLASH_DTYPES = (dtypes.float16, dtypes.bfloat16, dtypes.float32)


def _flash_attention_lse_rule(q, k, v, causal, scale, tf32=False):
  _check_attention("flash_attention_lse", q, k, v)
  if not q.dtype.is_floating_point:
    raise DTypeError(f"flash_attention_lse: expected floating q, k, v, got {q.dtype.name}")
  return q.shape[:-1] + (q.shape[-1] + 1,), dtypes.float64 if q.dtype is dtypes.float64 else dtypes.float32


def _flash_attention_lse_vjp(g, out, q, k, v, causal, scale, tf32=False):
  e = q.shape[-1]
  return flash_attention_lse_backward_op(g[..., :e].to(q.dtype), g[..., e].contiguous(), q, k, v,
                                         out[..., :e].to(q.dtype), causal=causal, scale=scale, tf32=tf32)


# flash attention that also returns each query's logsumexp of its scaled scores, packed as one more column of the
# output (..., L, E + 1) in float32 (float64 for float64 inputs): the attention output in [..., :E], the logsumexp in
# [..., E] (a primitive has one output and one VJP). Partial attentions over key blocks merge by it (ring attention);
# the VJP's dlse adds P * dlse to dS, i.e. rowsum(dO * O) - dlse in place of rowsum(dO * O)
flash_attention_lse_backward_op = op(
  "flash_attention_lse_backward", lambda g, glse, q, k, v, out, causal, scale, tf32=False: [
    (q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype)], multi=True,
  inputs="g glse q k v out", attrs="causal:bool scale:float tf32:bool?")
flash_attention_lse_op = op("flash_attention_lse", _flash_attention_lse_rule, _flash_attention_lse_vjp,
                            saves_output=True, inputs="q k v", attrs="causal:bool scale:float tf32:bool?")


def flash_attention_lse(query: Tensor, key: Tensor, value: Tensor, is_causal: bool = False,
                        scale: float | None = None) -> tuple[Tensor, Tensor]:
  """Attention of queries (..., L, E) to keys and values (..., S, E) of one batch shape and dtype, and each query's
  logsumexp of its scaled (and masked) scores: (out (..., L, E), lse (..., L)), both float32 (float64 for float64
  inputs), without the (L, S) weights in memory. Both are differentiable: attention over the union of key blocks is
  sum_j exp(lse_j - logsumexp_j lse_j) out_j (as ring attention merges them)."""
  scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
  packed = flash_attention_lse_op(query, key, value, causal=bool(is_causal), scale=float(scale),
                                  tf32=query.dtype is dtypes.float32 and backends.allow_tf32())
  e = packed.shape[-1] - 1
  return packed[..., :e], packed[..., e]


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> Tensor:
  """softmax(q k^T * scale + mask) v over (..., L, E) queries and (..., S, E) keys.

  `attn_mask` is bool (True takes part) or float (added to the scores); `is_causal` masks keys after each
  query (top-left aligned, as PyTorch). Dropout applies to the attention weights. `enable_gqa`: keys and values
  of fewer heads (dim -3) than the queries, each shared by a group of query heads."""
  if enable_gqa and query.ndim >= 3 and key.shape[-3] != query.shape[-3]:
    hq, hk = query.shape[-3], key.shape[-3]
    if hk == 0 or hq % hk or value.shape[-3] != hk:
      raise ShapeError(f"scaled_dot_product_attention: {hq} query heads cannot be grouped over {hk} key and "
                       f"{value.shape[-3]} value heads (enable_gqa needs a divisor)")
    key, value = key.repeat_interleave(hq // hk, -3), value.repeat_interleave(hq // hk, -3)
  if query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]:
    raise ShapeError(f"scaled_dot_product_attention: incompatible shapes q {query.shape}, k {key.shape}, v {value.shape}")
  if is_causal and attn_mask is not None: raise ShapeError("scaled_dot_product_attention: pass either attn_mask or is_causal")
  query, key, value = autocast_inputs("scaled_dot_product_attention", query, key, value)
  scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
  # NOTE: float64 (a reference dtype) and heads over 256 wide (past what a kernel keeps on chip) stay composite
  if (attn_mask is None and dropout_p == 0.0 and query.dtype in _FLASH_DTYPES and query.dtype is key.dtype is value.dtype
      and key.shape == value.shape and query.shape[:-2] == key.shape[:-2] and query.shape[-1] <= 256
      and query.shape[-2] > 0 and key.shape[-2] > 0):
    attrs = dict(causal=bool(is_causal), scale=float(scale),
                 tf32=query.dtype is dtypes.float32 and backends.allow_tf32())
    # heads inside positions: keep that layout. NOTE: not under a capture, whose values have no layout: Nova's
    # fuse-norms picks the transposed kernel from the graph (the copy after the attention)
    if query.ndim == 4 and query._strides[1] < query._strides[2] and hooks.trace is None:
      return flash_attention_transposed_op(query, key, value, **attrs).permute(0, 2, 1, 3)
    return flash_attention_op(query, key, value, **attrs)
  scores = matmul(query, key.mT) * scale
  if is_causal:
    L, S = query.shape[-2], key.shape[-2]
    attn_mask = tril(ones(L, S, dtype=dtypes.bool_, device=query.device))
  if attn_mask is not None:
    scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype is dtypes.bool_ else scores + attn_mask
  weights = softmax(scores, -1)
  if dropout_p > 0.0: weights = dropout(weights, dropout_p)
  return matmul(weights, value)
