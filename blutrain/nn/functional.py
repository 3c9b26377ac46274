"""`nn.functional` (imported as F): the op library's functions under `torch.nn.functional`'s names.

The math lives in `blutrain.ops`; this module re-exports it, keeps PyTorch's argument order where the op's differs,
and writes the functions PyTorch has and the op library does not (activations, losses, padding, interpolation) as
composites of ops, with no VJP of their own; convolution, pooling and batch/group norm come from `nn/spatial.py`.
`inplace=True` is accepted where PyTorch takes it and returns a new tensor, as `nn.Dropout` does.
"""
from __future__ import annotations

import math

import numpy as np

from blutrain import dtypes, ops
from blutrain.nn.spatial import (adaptive_avg_pool1d, adaptive_avg_pool2d, avg_pool1d, avg_pool2d, batch_norm, constant,
                                 conv1d, conv2d, conv3d, conv_transpose1d, conv_transpose2d, conv_transpose3d, group_norm,
                                 max_pool1d, max_pool2d)
from blutrain.ops import (dropout, gelu, layer_norm, linear, log_softmax, one_hot, relu, rms_norm,
                          scaled_dot_product_attention, sigmoid, silu, softmax, tanh)
from blutrain.tensor import Tensor

__all__ = ["linear", "gelu", "silu", "relu", "tanh", "sigmoid", "softmax", "log_softmax", "softmin", "layer_norm",
           "rms_norm", "embedding", "dropout", "one_hot", "scaled_dot_product_attention", "pad", "interpolate",
           "normalize", "cosine_similarity", "elu", "selu", "celu", "relu6", "hardsigmoid", "hardtanh", "hardswish",
           "mish", "softplus", "softsign", "logsigmoid", "leaky_relu", "cross_entropy", "nll_loss", "mse_loss",
           "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
           "kl_div", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "max_pool1d", "max_pool2d", "avg_pool1d",
           "avg_pool2d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "batch_norm", "group_norm"]


def embedding(input: Tensor, weight: Tensor, padding_idx: int | None = None) -> Tensor:
  """Rows of `weight` (num_embeddings, embedding_dim) picked by the integer tensor `input`.

  Positions whose index equals `padding_idx` pass no gradient to that row, as in PyTorch.
  Shape: input (*), output (*, embedding_dim).
  """
  out = ops.embedding(input, weight)
  if padding_idx is None: return out
  if padding_idx < 0: padding_idx += weight.shape[0]
  return ops.where((input == padding_idx).unsqueeze(-1), out.detach(), out)


# *** activations ***

def _log1p(x: Tensor) -> Tensor:
  """log(1 + x), accurate for small x (Goldberg's correction of log(u) by x / (u - 1), u = fl(1 + x)).
  TODO: ops.log1p once the op library has it (one kernel instead of five)."""
  u = 1 + x
  d = u - 1
  return ops.where(d == 0, x, ops.log(u) * x / ops.where(d == 0, 1.0, d))


def _softplus0(x: Tensor) -> Tensor: return ops.maximum(x, 0.0) + _log1p(ops.exp(-ops.abs(x)))  # log(1 + e^x)


def softmin(input: Tensor, dim: int, dtype=None) -> Tensor:
  """softmax(-input) along dim."""
  return softmax(-(input if dtype is None else input.to(dtype)), dim)


def elu(input: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:
  """x for x > 0, alpha * (exp(x) - 1) otherwise."""
  return ops.where(input > 0, input, alpha * (ops.exp(ops.minimum(input, 0.0)) - 1))


_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def selu(input: Tensor, inplace: bool = False) -> Tensor:
  """scale * elu(x, alpha) with the self-normalizing constants of Klambauer et al. (2017)."""
  return _SELU_SCALE * elu(input, _SELU_ALPHA)


def celu(input: Tensor, alpha: float = 1.0, inplace: bool = False) -> Tensor:
  """max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""
  if alpha == 0: raise RuntimeError("ZeroDivisionError: celu: alpha must not be 0")
  return ops.where(input > 0, input, alpha * (ops.exp(ops.minimum(input, 0.0) / alpha) - 1))


def hardtanh(input: Tensor, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False) -> Tensor:
  """x clamped to [min_val, max_val]; the gradient passes strictly inside, as PyTorch's."""
  if min_val > max_val: raise ValueError(f"hardtanh: min_val ({min_val}) cannot be greater than max_val ({max_val})")
  inside = (input > min_val) & (input < max_val)
  return ops.where(inside, input, ops.clamp(input, min_val, max_val).detach())


def relu6(input: Tensor, inplace: bool = False) -> Tensor:
  """min(max(0, x), 6)."""
  return hardtanh(input, 0.0, 6.0)


def hardsigmoid(input: Tensor, inplace: bool = False) -> Tensor:
  """0 for x <= -3, 1 for x >= 3, x / 6 + 1/2 between."""
  return hardtanh(input / 6 + 0.5, 0.0, 1.0)


def hardswish(input: Tensor, inplace: bool = False) -> Tensor:
  """x * hardsigmoid(x) (Howard et al., MobileNetV3)."""
  return input * hardsigmoid(input)


def leaky_relu(input: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
  """x for x > 0, negative_slope * x otherwise."""
  return ops.where(input > 0, input, input * negative_slope)


def softplus(input: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
  """log(1 + exp(beta * x)) / beta, and x itself where beta * x > threshold."""
  z = input * beta
  return ops.where(z > threshold, input, _softplus0(ops.minimum(z, threshold)) / beta)


def softsign(input: Tensor) -> Tensor:
  """x / (1 + |x|)."""
  return input / (1 + ops.abs(input))


def logsigmoid(input: Tensor) -> Tensor:
  """log(sigmoid(x)) = min(x, 0) - log(1 + exp(-|x|)), computed without overflow."""
  return ops.minimum(input, 0.0) - _log1p(ops.exp(-ops.abs(input)))


def mish(input: Tensor, inplace: bool = False) -> Tensor:
  """x * tanh(softplus(x)) (Misra, 2019)."""
  return input * ops.tanh(softplus(input))


# *** losses ***

def _reduction(size_average: bool | None, reduce: bool | None, reduction: str) -> str:
  """PyTorch's legacy size_average/reduce flags, when given, override `reduction`."""
  if size_average is None and reduce is None: return reduction
  if reduce is False: return "none"
  return "sum" if size_average is False else "mean"


def _reduce(loss: Tensor, reduction: str) -> Tensor:
  if reduction == "mean": return loss.mean()
  if reduction == "sum": return loss.sum()
  if reduction == "none": return loss
  raise ValueError(f"{reduction} is not a valid value for reduction")


def _same_size(name: str, input: Tensor, target: Tensor) -> None:
  if tuple(input.shape) != tuple(target.shape):
    raise ValueError(f"{name}: using a target size ({tuple(target.shape)}) that is different to the input size "
                     f"({tuple(input.shape)}); please ensure they have the same size")


def _class_dim_last(input: Tensor, target: Tensor, name: str) -> tuple[Tensor, Tensor, tuple[int, ...]]:
  """input (N, C, d...) or (C,) and target (N, d...) or () as (M, C) and (M,), and the shape of per-item losses."""
  if input.ndim == 0: raise ValueError(f"{name}: expected input of shape (C,), (N, C) or (N, C, d...), got a 0-d tensor")
  lead = tuple(input.shape[:1] + input.shape[2:]) if input.ndim > 1 else ()
  if tuple(target.shape) != lead:
    raise RuntimeError(f"{name}: target of shape {tuple(target.shape)} does not match input of shape "
                       f"{tuple(input.shape)}; expected a target of shape {lead}")
  if input.ndim > 2: input = input.permute(0, *range(2, input.ndim), 1)
  return input.reshape(-1, input.shape[-1]), target.reshape(-1), lead


def _class_weight(weight: Tensor | None, classes: int, name: str) -> None:
  if weight is not None and tuple(weight.shape) != (classes,):
    raise RuntimeError(f"{name}: weight tensor should be defined either for all {classes} classes or no classes but "
                       f"got weight tensor of shape: {tuple(weight.shape)}")


def _item_weights(t: Tensor, valid: Tensor, weight: Tensor | None, dtype) -> Tensor:
  """Each item's weight in a class-weighted loss: weight[t] (1 without weights), 0 where the target is ignored."""
  if weight is None: return valid.to(dtype)
  return ops.where(valid, weight.to(dtype)[ops.where(valid, t, 0)], 0.0)


def nll_loss(input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: bool | None = None,
             ignore_index: int = -100, reduce: bool | None = None, reduction: str = "mean") -> Tensor:
  """Negative log-likelihood: -weight[t] * input[t] per item, of log-probabilities (N, C) or (N, C, d...) at class
  indices (N,) or (N, d...); the mean divides by the summed weights of the targets that are not ignore_index."""
  reduction = _reduction(size_average, reduce, reduction)
  logp, t, lead = _class_dim_last(input, target, "nll_loss")
  _class_weight(weight, logp.shape[1], "nll_loss")
  valid = t != ignore_index
  safe, w = ops.where(valid, t, 0), _item_weights(t, valid, weight, logp.dtype)
  losses = -logp.gather(1, safe.unsqueeze(1)).squeeze(1) * w
  if reduction == "none": return losses.reshape(lead)
  if reduction == "mean": return losses.sum() / w.sum()
  return _reduce(losses, reduction)


def cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: bool | None = None,
                  ignore_index: int = -100, reduce: bool | None = None, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Tensor:
  """Softmax cross-entropy of logits (N, C), (C,) or (N, C, d...) against class indices, or against class
  probabilities of the input's shape.

  Args:
    weight: a weight per class (C,); a weighted mean divides by the summed weights of the targets.
    ignore_index: a target index that counts neither in the loss nor in the mean (index targets only).
    label_smoothing: mix the target with the uniform distribution: (1 - s) * target + s / C.

  Without weight and label smoothing, index targets go through the op library's fused `cross_entropy`.
  """
  reduction = _reduction(size_average, reduce, reduction)
  if not 0.0 <= label_smoothing <= 1.0:
    raise ValueError(f"cross_entropy: label_smoothing must be between 0.0 and 1.0, got {label_smoothing}")
  if reduction not in ("mean", "sum", "none"): raise ValueError(f"{reduction} is not a valid value for reduction")
  if target.dtype.is_floating_point:  # class probabilities
    _same_size("cross_entropy", input, target)
    cdim = 1 if input.ndim > 1 else 0
    classes = input.shape[cdim]
    _class_weight(weight, classes, "cross_entropy")
    logp = log_softmax(input, cdim)
    if label_smoothing > 0: target = target * (1 - label_smoothing) + label_smoothing / classes
    w = 1.0 if weight is None else weight.reshape((classes,) + (1,) * (input.ndim - cdim - 1))
    losses = -(logp * target * w).sum(cdim)
    return _reduce(losses, reduction)  # the mean is over items, not weighted
  if weight is None and label_smoothing == 0:
    return ops.cross_entropy(input, target, ignore_index=ignore_index, reduction=reduction)
  logits, t, lead = _class_dim_last(input, target, "cross_entropy")
  classes = logits.shape[1]
  _class_weight(weight, classes, "cross_entropy")
  logp = log_softmax(logits, 1)
  nll = nll_loss(logp, t, weight, ignore_index=ignore_index, reduction=reduction)
  if label_smoothing == 0: return nll if reduction != "none" else nll.reshape(lead)
  valid = t != ignore_index
  smooth = ops.where(valid, -(logp if weight is None else logp * weight.to(logp.dtype)).sum(1), 0.0)
  if reduction == "mean": smooth = smooth.sum() / _item_weights(t, valid, weight, logp.dtype).sum()  # as nll's mean
  else: smooth = _reduce(smooth, reduction)
  out = (1 - label_smoothing) * nll + smooth * (label_smoothing / classes)
  return out.reshape(lead) if reduction == "none" else out


def mse_loss(input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
             reduction: str = "mean") -> Tensor:
  """Mean squared error: (input - target)^2, reduced; input and target broadcast."""
  d = input - target
  return _reduce(d * d, _reduction(size_average, reduce, reduction))


def l1_loss(input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
            reduction: str = "mean") -> Tensor:
  """Mean absolute error: |input - target|, reduced."""
  return _reduce(ops.abs(input - target), _reduction(size_average, reduce, reduction))


def smooth_l1_loss(input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
                   reduction: str = "mean", beta: float = 1.0) -> Tensor:
  """0.5 d^2 / beta where d = |input - target| < beta, d - 0.5 beta elsewhere (the L1 loss when beta is 0)."""
  if beta < 0: raise RuntimeError(f"smooth_l1_loss does not support negative values for beta, got {beta}")
  d = ops.abs(input - target)
  loss = d if beta == 0 else ops.where(d < beta, 0.5 * d * d / beta, d - 0.5 * beta)
  return _reduce(loss, _reduction(size_average, reduce, reduction))


def huber_loss(input: Tensor, target: Tensor, reduction: str = "mean", delta: float = 1.0,
               weight: Tensor | None = None) -> Tensor:
  """0.5 d^2 where d = |input - target| < delta, delta (d - 0.5 delta) elsewhere."""
  if delta <= 0: raise RuntimeError(f"huber_loss does not support non-positive values for delta, got {delta}")
  d = ops.abs(input - target)
  loss = ops.where(d < delta, 0.5 * d * d, delta * (d - 0.5 * delta))
  return _reduce(loss if weight is None else loss * weight, reduction)


def binary_cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: bool | None = None,
                         reduce: bool | None = None, reduction: str = "mean") -> Tensor:
  """-(t log(p) + (1 - t) log(1 - p)) of probabilities p, each log clamped to >= -100 as PyTorch's.

  The inputs are not checked to lie in [0, 1] (that would read them back to the host)."""
  _same_size("binary_cross_entropy", input, target)
  log_p, log_q = ops.clamp(ops.log(input), min=-100.0), ops.clamp(ops.log(1 - input), min=-100.0)
  loss = -(target * log_p + (1 - target) * log_q)
  return _reduce(loss if weight is None else loss * weight, _reduction(size_average, reduce, reduction))


def binary_cross_entropy_with_logits(input: Tensor, target: Tensor, weight: Tensor | None = None,
                                     size_average: bool | None = None, reduce: bool | None = None,
                                     reduction: str = "mean", pos_weight: Tensor | None = None) -> Tensor:
  """binary_cross_entropy(sigmoid(x), t) computed stably: (1 - t) x + (1 + (pos_weight - 1) t) log(1 + e^-x),
  where pos_weight (broadcast along the last, class dim) weighs the positive term."""
  if tuple(input.shape) != tuple(target.shape):
    raise ValueError(f"Target size ({tuple(target.shape)}) must be the same as input size ({tuple(input.shape)})")
  log_sig_neg = _softplus0(-input)  # log(1 + e^-x) = -log(sigmoid(x))
  loss = (1 - target) * input + (log_sig_neg if pos_weight is None else (1 + (pos_weight - 1) * target) * log_sig_neg)
  return _reduce(loss if weight is None else loss * weight, _reduction(size_average, reduce, reduction))


def kl_div(input: Tensor, target: Tensor, size_average: bool | None = None, reduce: bool | None = None,
           reduction: str = "mean", log_target: bool = False) -> Tensor:
  """KL(target || exp(input)) pointwise: target (log(target) - input), 0 where target is 0; with log_target,
  exp(target) (target - input). reduction "batchmean" divides the sum by the batch size (input.shape[0])."""
  reduction = _reduction(size_average, reduce, reduction)
  if log_target: loss = ops.exp(target) * (target - input)
  else:
    pos = target > 0
    loss = ops.where(pos, target * (ops.log(ops.where(pos, target, 1.0)) - input), 0.0 * input)
  if reduction == "batchmean": return loss.sum() / (input.shape[0] if input.ndim else 1)
  return _reduce(loss, reduction)


# *** distances and normalization ***

def normalize(input: Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12, out: Tensor | None = None) -> Tensor:
  """input / max(||input||_p, eps) along dim."""
  if out is not None: raise TypeError("normalize: out= is not supported; use the returned tensor")
  return input / ops.clamp(ops.norm(input, p, dim, keepdim=True), min=eps)


def cosine_similarity(x1: Tensor, x2: Tensor, dim: int = 1, eps: float = 1e-8) -> Tensor:
  """sum(x1 / max(||x1||, eps) * x2 / max(||x2||, eps)) along dim, after broadcasting x1 and x2."""
  shape = ops.broadcast_shapes(x1.shape, x2.shape)
  x1, x2 = x1.expand(shape), x2.expand(shape)
  return ((x1 / ops.clamp(ops.norm(x1, 2, dim, keepdim=True), min=eps)) *
          (x2 / ops.clamp(ops.norm(x2, 2, dim, keepdim=True), min=eps))).sum(dim)


# *** padding and resampling ***

def _pad_index(n: int, before: int, after: int, mode: str) -> np.ndarray:
  """The source index of each output position of one dim of size n padded by `mode`."""
  i = np.arange(-before, n + after)
  if mode == "reflect":
    period = 2 * (n - 1)
    i = np.abs(i) % period if period else np.zeros_like(i)
    return np.where(i >= n, period - i, i)
  if mode == "replicate": return np.clip(i, 0, n - 1)
  return i % n  # circular


def pad(input: Tensor, pad: tuple[int, ...], mode: str = "constant", value: float | None = None) -> Tensor:
  """Pad the last len(pad)//2 dims: pad = (last_left, last_right, 2nd_last_left, ...); negative amounts crop.

  Modes: "constant" (with `value`, 0 by default), "reflect" (mirror without repeating the edge), "replicate" (repeat
  the edge), "circular" (wrap around).
  """
  if len(pad) % 2 or len(pad) // 2 > input.ndim:
    raise ValueError(f"pad: expected an even number of pad sizes, at most 2 per dim, got {tuple(pad)} for shape "
                     f"{tuple(input.shape)}")
  if mode not in ("constant", "reflect", "replicate", "circular"):
    raise NotImplementedError(f"pad: mode {mode!r} is not supported; use 'constant', 'reflect', 'replicate' or 'circular'")
  if mode != "constant" and value:
    raise ValueError(f"pad: padding mode {mode!r} doesn't take in value argument")
  out = input
  for i in range(len(pad) // 2):
    dim, before, after = input.ndim - 1 - i, pad[2 * i], pad[2 * i + 1]
    cut_lo, cut_hi = max(-before, 0), max(-after, 0)
    if cut_lo or cut_hi: out = out.narrow(dim, cut_lo, out.shape[dim] - cut_lo - cut_hi)
    before, after = max(before, 0), max(after, 0)
    if mode != "constant":
      n = out.shape[dim]
      if mode == "reflect" and (before >= n or after >= n):
        raise RuntimeError(f"pad: padding size should be less than the corresponding input dimension, but got padding "
                           f"({before}, {after}) at dimension {dim} of input {tuple(input.shape)}")
      if mode == "circular" and (before > n or after > n):
        raise RuntimeError(f"pad: padding value ({before}, {after}) is greater than the input dimension {n} at "
                           f"dimension {dim} of input {tuple(input.shape)}")
      if n == 0 and before + after > 0:
        raise RuntimeError(f"pad: cannot pad an empty dimension {dim} of input {tuple(input.shape)} in mode {mode!r}")
      idx = constant(_pad_index(n, before, after, mode), dtype=dtypes.int64, device=input.device)
      if before or after: out = ops.index_select(out, dim, idx)
      continue
    fill = [ops.full(out.shape[:dim] + (n,) + out.shape[dim + 1:], 0 if value is None else value, dtype=out.dtype,
                     device=out.device) for n in (before, after) if n > 0]
    if fill: out = ops.cat(fill[:1] + [out] + fill[1:] if before > 0 else [out] + fill, dim)
  return out


def _linear_weights(n_in: int, n_out: int, scale: float | None, align_corners: bool):
  """For each output position: the two source indices and the weight of the second (PyTorch's source positions)."""
  j = np.arange(n_out, dtype=np.float64)
  if align_corners: src = j * ((n_in - 1) / (n_out - 1) if n_out > 1 else 0.0)
  else: src = np.maximum((j + 0.5) * (scale if scale is not None else n_in / n_out) - 0.5, 0.0)
  i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
  return i0, np.minimum(i0 + 1, n_in - 1), src - i0


def _cubic_weights(n_in: int, n_out: int, scale: float | None, align_corners: bool):
  """For each output position: the four source indices floor(src) - 1 .. + 2 (clamped to the input) and their
  weights, PyTorch's cubic convolution (A = -0.75) at its unclamped source positions."""
  j = np.arange(n_out, dtype=np.float64)
  if align_corners: src = j * ((n_in - 1) / (n_out - 1) if n_out > 1 else 0.0)
  else: src = (j + 0.5) * (scale if scale is not None else n_in / n_out) - 0.5
  i0, A = np.floor(src).astype(np.int64), -0.75
  t = src - i0
  near = lambda x: ((A + 2) * x - (A + 3)) * x * x + 1          # |x| <= 1
  far = lambda x: ((A * x - 5 * A) * x + 8 * A) * x - 4 * A     # 1 < |x| < 2
  weights = [far(t + 1), near(t), near(1 - t), far(2 - t)]
  return [(np.clip(i0 + k - 1, 0, n_in - 1), w) for k, w in enumerate(weights)]


def interpolate(input: Tensor, size=None, scale_factor=None, mode: str = "nearest", align_corners: bool | None = None,
                recompute_scale_factor: bool | None = None, antialias: bool = False) -> Tensor:
  """Resample the spatial dims (all after (N, C)) to `size` or by `scale_factor`.

  Modes: "nearest" (source index floor(j * in / out)), "linear" (3-D input), "bilinear" and "bicubic" (4-D input),
  with `align_corners` as PyTorch's. Separable: each spatial dim is resampled in turn by index_select and a lerp (a
  weighted sum of four neighbours for bicubic, which may overshoot the input's range, as PyTorch's does).
  """
  spatial = input.ndim - 2
  if spatial < 1:
    raise ValueError(f"interpolate: expected an input with at least 3 dims (N, C, ...), got {tuple(input.shape)}")
  if antialias: raise NotImplementedError("interpolate: antialias=True is not supported")
  if mode not in ("nearest", "linear", "bilinear", "bicubic"):
    raise NotImplementedError(f"interpolate: mode {mode!r} is not supported; use 'nearest', 'linear', 'bilinear' or "
                              f"'bicubic'")
  if mode == "nearest" and align_corners is not None:
    raise ValueError("align_corners option can only be set with the interpolating modes: "
                     "linear | bilinear | bicubic | trilinear")
  need = {"linear": 1, "bilinear": 2, "bicubic": 2}.get(mode)
  if need is not None and spatial != need:
    raise NotImplementedError(f"Got {input.ndim}D input, but {mode} mode needs {need + 2}D input")
  if (size is None) == (scale_factor is None):
    raise ValueError("only one of size or scale_factor should be defined" if size is not None
                     else "either size or scale_factor should be defined")
  as_list = lambda v: list(v) if isinstance(v, (tuple, list)) else [v] * spatial
  if size is not None:
    sizes, scales = [int(s) for s in as_list(size)], [None] * spatial
    if len(sizes) != spatial:
      raise ValueError(f"Input and output must have the same number of spatial dimensions, but got input with spatial "
                       f"dimensions of {list(input.shape[2:])} and output size of {sizes}")
  else:
    factors = [float(f) for f in as_list(scale_factor)]
    sizes = [int(math.floor(n * f)) for n, f in zip(input.shape[2:], factors)]
    scales = [None if recompute_scale_factor else 1.0 / f for f in factors]
  out = input
  for k, (n_out, scale) in enumerate(zip(sizes, scales)):
    dim, n_in = 2 + k, input.shape[2 + k]
    if mode == "nearest":
      s = np.float32(scale if scale is not None else n_in / n_out)
      src = np.minimum(np.floor(np.arange(n_out, dtype=np.float32) * s).astype(np.int64), n_in - 1)
      out = ops.index_select(out, dim, constant(src, device=input.device))
      continue
    shape = (-1,) + (1,) * (input.ndim - dim - 1)
    if mode == "bicubic":
      terms = [ops.index_select(out, dim, constant(i, device=input.device)) *
               constant(w.reshape(shape), dtype=input.dtype, device=input.device)
               for i, w in _cubic_weights(n_in, n_out, scale, bool(align_corners))]
      out = terms[0] + terms[1] + terms[2] + terms[3]
      continue
    i0, i1, lam = _linear_weights(n_in, n_out, scale, bool(align_corners))
    w = constant(lam.reshape(shape), dtype=input.dtype, device=input.device)
    a = ops.index_select(out, dim, constant(i0, device=input.device))
    b = ops.index_select(out, dim, constant(i1, device=input.device))
    out = a + (b - a) * w
  return out
