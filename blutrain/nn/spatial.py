"""Convolution, pooling and batch/group normalization over the spatial dims of (N, C, *spatial) inputs, as composites
of the op library (`nn.functional` re-exports them under PyTorch's names).

Convolution is the op library's `conv` primitive (its gradients `conv_grad_input` and `conv_grad_weight`, and
conv_transpose is `conv_grad_input`): the backends' kernels are implicit GEMMs, so no (N, C, K, *out) column buffer
is built. Here are PyTorch's argument forms and messages ('same' padding, unbatched inputs, bias). Pooling takes one
strided slice of the padded input per kernel offset, stacked into (N, C, K, *out), and reduces them. Batch norm is
the op library's `batch_norm_stats` (which also moves the running statistics) and `batch_norm` primitives (one
`batch_norm_backward`); a cumulative average (momentum None) updates them here.
"""
from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from blutrain import ops
from blutrain.autograd.tape import capture_suspended
from blutrain.tensor import Tensor


@functools.lru_cache(maxsize=256)
def _cached_constant(data: bytes, np_dtype: str, shape: tuple, dtype, device) -> Tensor:
  with capture_suspended():  # made for real even when a compiled call first needs it (its copy to the GPU included)
    return ops.tensor(np.frombuffer(data, np_dtype).reshape(shape), dtype=dtype, device=device)


def constant(array: np.ndarray, dtype=None, device=None) -> Tensor:
  """A tensor of host-computed values that depend only on shapes (gather indices, averaging weights), kept alive
  in a cache: a compiled graph reads such a tensor as an input by reference, so it must outlive the capture."""
  array = np.ascontiguousarray(array)
  return _cached_constant(array.tobytes(), array.dtype.str, array.shape, dtype, device)


def _tuple(v, n: int, name: str) -> tuple[int, ...]:
  t = tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else (int(v),) * n
  if len(t) != n: raise RuntimeError(f"expected {name} to be a single integer value or a list of {n} values, got {v!r}")
  return t


def _batched(fn: str, x: Tensor, nd: int) -> tuple[Tensor, bool]:
  """x as (N, C, *spatial), and whether a batch dim was added (an unbatched (C, *spatial) input, as PyTorch allows)."""
  if x.ndim == nd + 1: return x.unsqueeze(0), True
  if x.ndim == nd + 2: return x, False
  raise RuntimeError(f"Expected {nd + 1}D (unbatched) or {nd + 2}D (batched) input to {fn}, but got input of size: "
                     f"{list(x.shape)}")


def _windows(x: Tensor, kernel, stride, dilation, out) -> Tensor:
  """(N, C, *spatial) -> (N, C, prod(kernel), *out): the input under each kernel offset, one strided slice each."""
  cols = []
  for offs in itertools.product(*(range(k) for k in kernel)):
    key = tuple(slice(o * d, o * d + s * (n - 1) + 1, s) for o, d, s, n in zip(offs, dilation, stride, out))
    cols.append(x[(slice(None), slice(None)) + key])
  return ops.stack(cols, 2)


def _out_size(n: int, k: int, s: int, d: int, fn: str, padded, kernel) -> int:
  span = d * (k - 1) + 1
  if n < span:
    raise RuntimeError(f"{fn}: calculated padded input size per channel: ({' x '.join(map(str, padded))}). Kernel size: "
                       f"({' x '.join(map(str, kernel))}). Kernel size can't be greater than actual input size")
  return (n - span) // s + 1


# *** convolution ***

def _conv(fn: str, nd: int, input: Tensor, weight: Tensor, bias: Tensor | None, stride, padding, dilation,
          groups: int) -> Tensor:
  x, unbatched = _batched(fn, input, nd)
  stride, dilation = _tuple(stride, nd, "stride"), _tuple(dilation, nd, "dilation")
  if weight.ndim != nd + 2:
    raise RuntimeError(f"{fn}: expected a {nd + 2}D weight (out_channels, in_channels / groups, *kernel), got "
                       f"{list(weight.shape)}")
  out_c, in_per_group, kernel = weight.shape[0], weight.shape[1], tuple(weight.shape[2:])
  if groups < 1 or out_c % groups:
    raise RuntimeError(f"Given groups={groups}, expected weight to be divisible by {groups} at dimension 0, but got "
                       f"weight of size {list(weight.shape)} instead")
  if x.shape[1] != in_per_group * groups:
    raise RuntimeError(f"Given groups={groups}, weight of size {list(weight.shape)}, expected input{list(x.shape)} to "
                       f"have {in_per_group * groups} channels, but got {x.shape[1]} channels instead")
  if isinstance(padding, str):
    if padding not in ("same", "valid"):
      raise RuntimeError(f"Invalid padding string: {padding!r} (expected 'valid' or 'same')")
    if padding == "same" and any(s != 1 for s in stride):
      raise RuntimeError("padding='same' is not supported for strided convolutions")
    total = [d * (k - 1) if padding == "same" else 0 for d, k in zip(dilation, kernel)]
    pads = [(t // 2, t - t // 2) for t in total]  # PyTorch puts the odd one on the right
  else:
    pads = [(p, p) for p in _tuple(padding, nd, "padding")]
  if any(hi != lo for lo, hi in pads): x = _pad(x, [(0, hi - lo) for lo, hi in pads])  # 'same', an odd total
  padded = [n + 2 * lo for n, (lo, _) in zip(x.shape[2:], pads)]
  for n, k, d in zip(padded, kernel, dilation): _out_size(n, k, 1, d, fn, padded, kernel)
  y = ops.conv(x, weight, stride, [lo for lo, _ in pads], dilation, groups)
  if bias is not None: y = y + bias.reshape((out_c,) + (1,) * nd).to(y.dtype)  # autocast lowers the bias with the op
  return y.squeeze(0) if unbatched else y


def _pad(x: Tensor, pads, value: float = 0.0) -> Tensor:
  """Pad (before, after) each spatial dim with `value`; negative amounts crop."""
  out = x
  for i, (lo, hi) in enumerate(pads):
    dim = 2 + i
    if lo < 0 or hi < 0:
      out = out.narrow(dim, max(-lo, 0), out.shape[dim] - max(-lo, 0) - max(-hi, 0))
      lo, hi = max(lo, 0), max(hi, 0)
    fill = lambda m: ops.full(out.shape[:dim] + (m,) + out.shape[dim + 1:], value, dtype=out.dtype, device=out.device)
    if lo or hi: out = ops.cat(([fill(lo)] if lo else []) + [out] + ([fill(hi)] if hi else []), dim)
  return out


def conv1d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1) -> Tensor:
  """1-D convolution (cross-correlation) of (N, C_in, L) with weight (C_out, C_in / groups, k); padding an int, a
  tuple, "valid" or "same"."""
  return _conv("conv1d", 1, input, weight, bias, stride, padding, dilation, groups)


def conv2d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1) -> Tensor:
  """2-D convolution (cross-correlation) of (N, C_in, H, W) with weight (C_out, C_in / groups, kh, kw); padding an
  int, a pair, "valid" or "same".

  Example:
    >>> F.conv2d(bt.randn(8, 3, 32, 32), bt.randn(16, 3, 3, 3), padding="same").shape
    (8, 16, 32, 32)
  """
  return _conv("conv2d", 2, input, weight, bias, stride, padding, dilation, groups)


def conv3d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1) -> Tensor:
  """3-D convolution (cross-correlation) of (N, C_in, D, H, W) with weight (C_out, C_in / groups, kd, kh, kw);
  padding an int, a triple, "valid" or "same"."""
  return _conv("conv3d", 3, input, weight, bias, stride, padding, dilation, groups)


def _conv_transpose(fn: str, nd: int, input: Tensor, weight: Tensor, bias: Tensor | None, stride, padding,
                    output_padding, groups: int, dilation) -> Tensor:
  x, unbatched = _batched(fn, input, nd)
  stride, dilation = _tuple(stride, nd, "stride"), _tuple(dilation, nd, "dilation")
  padding, output_padding = _tuple(padding, nd, "padding"), _tuple(output_padding, nd, "output_padding")
  if weight.ndim != nd + 2 or x.shape[1] != weight.shape[0] or weight.shape[0] % groups:
    raise RuntimeError(f"{fn}: given groups={groups}, expected weight (in_channels, out_channels / groups, *kernel) with "
                       f"in_channels = {x.shape[1]} divisible by groups, got weight of size {list(weight.shape)} for "
                       f"input of size {list(x.shape)}")
  for op_, s, d in zip(output_padding, stride, dilation):
    if op_ >= max(s, d):
      raise RuntimeError(f"{fn}: output padding must be smaller than either stride or dilation, but got "
                         f"output_padding={output_padding}, stride={stride}, dilation={dilation}")
  kernel, out_c = weight.shape[2:], weight.shape[1] * groups
  shape = [(n - 1) * s - 2 * p + d * (k - 1) + op_ + 1 for n, s, p, d, k, op_ in zip(x.shape[2:], stride, padding,
                                                                                      dilation, kernel, output_padding)]
  if any(o < 1 for o in shape):
    raise RuntimeError(f"{fn}: given input size {list(x.shape)}, weight {list(weight.shape)}, stride {stride}, padding "
                       f"{padding} and dilation {dilation}, the calculated output size {shape} is too small")
  # output_padding >= stride (PyTorch allows it below the dilation): a convolution of the output would give
  # output_padding // stride positions more than x has; the transposed convolution reads them as zeros
  extra = [ops.nn.conv_out_size(o, k, s, p, d) - n for o, k, s, p, d, n in zip(shape, kernel, stride, padding, dilation,
                                                                                x.shape[2:])]
  if any(extra): x = _pad(x, [(0, e) for e in extra])
  y = ops.conv_transpose(x, weight, (x.shape[0], out_c, *shape), stride, padding, dilation, groups)
  if bias is not None: y = y + bias.reshape((out_c,) + (1,) * nd).to(y.dtype)  # autocast lowers the bias with the op
  return y.squeeze(0) if unbatched else y


def conv_transpose1d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, output_padding=0,
                     groups: int = 1, dilation=1) -> Tensor:
  """1-D transposed convolution of (N, C_in, L) with weight (C_in, C_out / groups, k): the gradient of conv1d."""
  return _conv_transpose("conv_transpose1d", 1, input, weight, bias, stride, padding, output_padding, groups, dilation)


def conv_transpose2d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, output_padding=0,
                     groups: int = 1, dilation=1) -> Tensor:
  """2-D transposed convolution of (N, C_in, H, W) with weight (C_in, C_out / groups, kh, kw): the gradient of
  conv2d with respect to its input, so an upsampling layer."""
  return _conv_transpose("conv_transpose2d", 2, input, weight, bias, stride, padding, output_padding, groups, dilation)


def conv_transpose3d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, output_padding=0,
                     groups: int = 1, dilation=1) -> Tensor:
  """3-D transposed convolution of (N, C_in, D, H, W) with weight (C_in, C_out / groups, kd, kh, kw): the gradient
  of conv3d with respect to its input."""
  return _conv_transpose("conv_transpose3d", 3, input, weight, bias, stride, padding, output_padding, groups, dilation)


# *** pooling ***

def _pool_geometry(fn: str, x: Tensor, kernel_size, stride, padding, dilation, ceil_mode: bool, nd: int):
  kernel = _tuple(kernel_size, nd, "kernel_size")
  stride = kernel if stride is None or (isinstance(stride, (tuple, list)) and not stride) else _tuple(stride, nd, "stride")
  padding, dilation = _tuple(padding, nd, "padding"), _tuple(dilation, nd, "dilation")
  for p, k, d in zip(padding, kernel, dilation):
    if p > (d * (k - 1) + 1) // 2:
      raise RuntimeError(f"{fn}: pad should be at most half of effective kernel size, but got pad={p}, kernel_size={k} "
                         f"and dilation={d}")
  out = []
  for n, k, s, p, d in zip(x.shape[2:], kernel, stride, padding, dilation):
    span = d * (k - 1) + 1
    o = (n + 2 * p - span + ((s - 1) if ceil_mode else 0)) // s + 1
    if ceil_mode and (o - 1) * s >= n + p: o -= 1  # the last window must start inside the input or the left padding
    if o <= 0:
      raise RuntimeError(f"{fn}: given input size {list(x.shape[1:])}, calculated output size is too small "
                         f"(kernel {kernel}, stride {stride}, padding {padding}, dilation {dilation})")
    out.append(o)
  # pad each dim so every window lies inside: p before, and enough after for the last window
  pads = [(p, (o - 1) * s + d * (k - 1) + 1 - n - p) for n, k, s, p, d, o in zip(x.shape[2:], kernel, stride, padding,
                                                                                   dilation, out)]
  return kernel, stride, padding, dilation, out, pads


def _max_pool(fn: str, nd: int, input: Tensor, kernel_size, stride, padding, dilation, ceil_mode: bool,
              return_indices: bool):
  x, unbatched = _batched(fn, input, nd)
  kernel, stride, padding, dilation, out, pads = _pool_geometry(fn, x, kernel_size, stride, padding, dilation,
                                                                 ceil_mode, nd)
  if nd == 2:  # one kernel finds each window's maximum, one reads the values there; the gradient sums back to them
    idx = ops.nn.max_pool2d_indices(x, kernel, stride, padding, dilation, out)
    y = ops.nn.max_pool2d_values(x, idx, kernel, stride, padding, dilation)
    if unbatched: y, idx = y.squeeze(0), idx.squeeze(0)
    return (y, idx) if return_indices else y
  lowest = -math.inf if x.dtype.is_floating_point else int(np.iinfo(x.dtype.np).min)
  cols = _windows(_pad(x, pads, lowest), kernel, stride, dilation, out)  # (N, C, K, *out)
  y = cols.amax(2)
  if not return_indices: return y.squeeze(0) if unbatched else y
  # the flat input position of each window element; argmax picks the first maximum, as PyTorch's kernel
  grids = np.meshgrid(*(np.arange(o) * s - p for o, s, p in zip(out, stride, padding)), indexing="ij")
  pos = np.stack([sum((g + o * d) * math.prod(x.shape[3 + i:]) for i, (g, o, d) in enumerate(zip(grids, offs, dilation)))
                  for offs in itertools.product(*(range(k) for k in kernel))])
  idx = constant(pos, device=x.device).expand(x.shape[0], x.shape[1], *pos.shape)
  indices = idx.gather(2, cols.argmax(2, keepdim=True)).squeeze(2)
  return (y.squeeze(0), indices.squeeze(0)) if unbatched else (y, indices)


def max_pool1d(input: Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
               return_indices: bool = False):
  """The maximum of each window of (N, C, L); with return_indices, also each maximum's position in L."""
  return _max_pool("max_pool1d", 1, input, kernel_size, stride, padding, dilation, ceil_mode, return_indices)


def max_pool2d(input: Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
               return_indices: bool = False):
  """The maximum of each window of (N, C, H, W) (padding counts as -inf); with return_indices, also each maximum's
  flat position in H * W."""
  return _max_pool("max_pool2d", 2, input, kernel_size, stride, padding, dilation, ceil_mode, return_indices)


def _avg_pool(fn: str, nd: int, input: Tensor, kernel_size, stride, padding, ceil_mode: bool, count_include_pad: bool,
              divisor_override: int | None) -> Tensor:
  x, unbatched = _batched(fn, input, nd)
  kernel, stride, padding, _, out, pads = _pool_geometry(fn, x, kernel_size, stride, padding, 1, ceil_mode, nd)
  total = _windows(_pad(x, pads), kernel, stride, (1,) * nd, out).sum(2)
  if divisor_override:
    y = total / divisor_override
  else:  # PyTorch's divisor: the window clipped to the padded input, or to the input without count_include_pad
    sizes = []
    for n, k, s, p, o in zip(x.shape[2:], kernel, stride, padding, out):
      start = np.arange(o) * s - p
      end = np.minimum(start + k, n + p)
      sizes.append(end - start if count_include_pad else np.minimum(end, n) - np.maximum(start, 0))
    divisor = sizes[0]
    for sz in sizes[1:]: divisor = np.multiply.outer(divisor, sz)
    y = total / constant(divisor.astype(np.float64), dtype=x.dtype, device=x.device)
  return y.squeeze(0) if unbatched else y


def avg_pool1d(input: Tensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True) -> Tensor:
  """The mean of each window of (N, C, L)."""
  return _avg_pool("avg_pool1d", 1, input, kernel_size, stride, padding, ceil_mode, count_include_pad, None)


def avg_pool2d(input: Tensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override: int | None = None) -> Tensor:
  """The mean of each window of (N, C, H, W); zero padding counts in the divisor unless count_include_pad=False."""
  return _avg_pool("avg_pool2d", 2, input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


def _adaptive_matrix(n: int, o: int, dtype, device) -> Tensor:
  """(o, n): row i averages input positions floor(i n / o) .. ceil((i + 1) n / o) - 1, PyTorch's adaptive windows."""
  m = np.zeros((o, n))
  for i in range(o):
    lo, hi = (i * n) // o, -(-((i + 1) * n) // o)
    m[i, lo:hi] = 1.0 / (hi - lo)
  return constant(m, dtype=dtype, device=device)


def adaptive_avg_pool1d(input: Tensor, output_size) -> Tensor:
  """(N, C, L) -> (N, C, output_size): the mean of each of output_size nearly equal windows."""
  x, unbatched = _batched("adaptive_avg_pool1d", input, 1)
  (o,) = _tuple(output_size, 1, "output_size")
  y = ops.matmul(x, _adaptive_matrix(x.shape[2], o, x.dtype, x.device).mT)
  return y.squeeze(0) if unbatched else y


def adaptive_avg_pool2d(input: Tensor, output_size) -> Tensor:
  """(N, C, H, W) -> (N, C, *output_size) (None keeps that dim): the mean over nearly equal windows. Windows that
  tile the input (a global pool among them) are one mean over a view; others are two matmuls with averaging
  matrices."""
  x, unbatched = _batched("adaptive_avg_pool2d", input, 2)
  sizes = output_size if isinstance(output_size, (tuple, list)) else (output_size, output_size)
  (n, c, h, w), (oh, ow) = x.shape, (d if o is None else int(o) for d, o in zip(x.shape[2:], sizes))
  if h == 0 or w == 0:
    raise RuntimeError(f"adaptive_avg_pool2d: expected input to have non-zero size for non-batch dimensions, but "
                       f"input has sizes {list(x.shape)}")
  if oh and ow and h % oh == 0 and w % ow == 0:
    y = x.reshape(n, c, oh, h // oh, ow, w // ow).mean((3, 5)).to(x.dtype)  # autocast sums in float32
  else:
    y = ops.matmul(ops.matmul(_adaptive_matrix(h, oh, x.dtype, x.device), x),
                   _adaptive_matrix(w, ow, x.dtype, x.device).mT)
  return y.squeeze(0) if unbatched else y


# *** normalization ***

def batch_norm(input: Tensor, running_mean: Tensor | None, running_var: Tensor | None, weight: Tensor | None = None,
               bias: Tensor | None = None, training: bool = False, momentum: float | Tensor = 0.1,
               eps: float = 1e-5) -> Tensor:
  """(x - mean) / sqrt(var + eps) * weight + bias per channel (dim 1) of (N, C, *).

  In training, mean and var are the batch's (var biased), and the running statistics, when given, move toward them
  in place: r = (1 - momentum) r + momentum * stat, with the unbiased variance. Otherwise the running statistics
  normalize. `momentum` may be a 0-d tensor (BatchNorm's cumulative average, 1 / batches seen)."""
  return batch_norm_counting(input, running_mean, running_var, weight, bias, training, momentum, eps)


def batch_norm_counting(input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                        weight: Tensor | None = None, bias: Tensor | None = None, training: bool = False,
                        momentum: float | Tensor = 0.1, eps: float = 1e-5, batches: Tensor | None = None) -> Tensor:
  """`batch_norm`, and with `batches` (BatchNorm's num_batches_tracked, a float momentum) one more batch counted by
  the running statistics' kernel, when they move."""
  if input.ndim < 2: raise ValueError(f"batch_norm: expected an input (N, C, *), got shape {tuple(input.shape)}")
  c = input.shape[1]
  for name, t in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)):
    if t is not None and tuple(t.shape) != (c,):
      raise RuntimeError(f"batch_norm: {name} should contain {c} elements not {t.numel()}")
  if training:
    count = input.numel() // c if c else 0
    if count <= 1:
      raise ValueError(f"Expected more than 1 value per channel when training, got input size {list(input.shape)}")
    tracked = running_mean is not None and running_var is not None
    if tracked and not isinstance(momentum, Tensor):  # the statistics' kernel moves them, and counts the batch
      mean, var = ops.nn.batch_norm_stats(input, running_mean, running_var, batches, momentum)
    else:
      mean, var = ops.nn.batch_norm_stats(input)
      with ops.no_grad():
        if tracked:  # a cumulative average: the factor is a tensor
          m = momentum.to(running_mean.dtype)
          running_mean.mul_(1 - m).add_(mean.to(running_mean.dtype) * m)
          running_var.mul_(1 - m).add_(var.to(running_var.dtype) * (m * count / (count - 1)))
        elif batches is not None: batches.add_(1)
  else:
    if running_mean is None or running_var is None:
      raise RuntimeError("batch_norm: running_mean and running_var must be given when training=False")
    mean, var = running_mean, running_var
  return ops.nn.batch_norm(input, mean, var, weight, bias, eps, training)


def group_norm(input: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
  """Normalize each of num_groups channel groups of (N, C, *) over its channels and spatial positions, then scale
  and shift per channel."""
  if input.ndim < 2: raise RuntimeError(f"group_norm: expected an input (N, C, *), got shape {tuple(input.shape)}")
  n, c = input.shape[:2]
  if num_groups <= 0 or c % num_groups:
    raise RuntimeError(f"Expected number of channels in input to be divisible by num_groups, but got input of shape "
                       f"{list(input.shape)} and num_groups={num_groups}")
  g = input.reshape(n, num_groups, -1)
  mean = g.mean(-1, keepdim=True)
  var = ((g - mean) * (g - mean)).mean(-1, keepdim=True)
  out = ((g - mean) * ops.rsqrt(var + eps)).reshape(input.shape)
  shape = (1, c) + (1,) * (input.ndim - 2)
  if weight is not None: out = out * weight.reshape(shape)
  return out + bias.reshape(shape) if bias is not None else out
