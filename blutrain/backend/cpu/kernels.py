"""NumPy kernels, one per primitive of `blutrain.ops`, keyed by op name.

Kernels take numpy arrays (strided views, possibly broadcast) and the op's attributes and return a new array;
the caller casts it to the dtype the op's rule gives. float16 and bfloat16 inputs are computed in float32.
"""
from __future__ import annotations

import functools
import itertools
import math

import ml_dtypes
import numpy as np

from blutrain import dtypes
from blutrain.backend import collective
from blutrain.shapes import BoundsError, memory_order

_HALF = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


# *** elementwise ***

def _erf(x: np.ndarray) -> np.ndarray:
  """erf: exact (math.erf) in float64; in float32 Abramowitz & Stegun 7.1.26 (abs. error < 1.5e-7, below
  float32's resolution near 1), evaluated in place to spare temporaries."""
  if x.dtype == np.float64: return np.vectorize(math.erf, otypes=[np.float64])(x)
  if x.ndim == 0: return _erf(x.reshape(1)).reshape(())
  a = np.abs(x)
  t = a * np.float32(0.3275911)
  t += 1
  np.reciprocal(t, out=t)
  poly = t * np.float32(1.061405429)
  for c in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
    poly += np.float32(c)
    poly *= t
  np.square(a, out=a)
  np.negative(a, out=a)
  np.exp(a, out=a)
  poly *= a
  np.subtract(1, poly, out=poly)
  return np.copysign(poly, x, out=poly)


_SQRT_2_PI = math.sqrt(2.0 / math.pi)


def _gelu_tanh_gate(x):
  """0.5 (1 + tanh(u)) written as sigmoid(2u), which keeps its precision where tanh(u) rounds to -1 (exp's overflow
  for very negative x gives the right limit, 0; x*x*x, as numpy's float32 power is ~40x slower)."""
  with np.errstate(over="ignore"):
    return (1.0 / (1.0 + np.exp(-2.0 * _SQRT_2_PI * (x + 0.044715 * x * x * x)))).astype(x.dtype, copy=False)


def _gelu(x, approximate):
  if approximate == "tanh": return x * _gelu_tanh_gate(x)
  return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _relu_backward(g, y):
  return np.where(y <= 0, np.zeros((), g.dtype), g)


def _gelu_backward(g, x, approximate):
  if approximate == "tanh":
    s = _gelu_tanh_gate(x)  # 1 - tanh(u)^2 = 4 s (1 - s)
    return g * (s + 2.0 * x * s * (1.0 - s) * _SQRT_2_PI * (1.0 + 3 * 0.044715 * x * x))
  cdf = 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))
  return g * (cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi))


def _sigmoid(x): return 0.5 * (1.0 + np.tanh(0.5 * x))


def _cumsum(x, dim, reverse=False):
  return np.flip(np.cumsum(np.flip(x, dim), dim), dim) if reverse else np.cumsum(x, dim)


# *** indexing ***

def _check_bounds(op: str, idx: np.ndarray, size: int, dim: int) -> None:
  """IndexError (BoundsError, a RuntimeError too, for gather and scatter_add, as PyTorch) naming the first bad index."""
  if idx.size and (idx.min() < -size or idx.max() >= size):
    bad = idx[(idx < -size) | (idx >= size)].flat[0]
    raise (BoundsError if op in ("gather", "scatter_add", "scatter_reduce") else IndexError)(f"{op}: index {bad} is out of bounds for dimension {dim} with size {size}")


def _key(x, idx, positions):
  key = [slice(None)] * x.ndim
  for p, i in zip(positions, idx):
    _check_bounds("index", i, x.shape[p], p)
    key[p] = i
  return tuple(key)


def _index_backward(g, *idx, shape, positions):
  out = np.zeros(shape, g.dtype)
  np.add.at(out, _key(out, idx, positions), g)
  return out


def _index_put(x, v, *idx, positions):
  out = np.array(x, copy=True)
  out[_key(out, idx, positions)] = v
  return out


def _slice_backward(g, shape, index):
  out = np.zeros(shape, g.dtype)
  out[tuple(slice(*i) for i in index)] = g
  return out


def _along(index: np.ndarray, dim: int) -> tuple:
  """Full index tuple for gather/scatter: index along dim, the positions elsewhere."""
  key = list(np.indices(index.shape, sparse=True))
  key[dim] = index
  return tuple(key)


def _gather(x, index, dim):
  _check_bounds("gather", index, x.shape[dim], dim)
  return x[_along(index, dim)]


def _scatter_add(x, index, src, dim):
  _check_bounds("scatter_add", index, x.shape[dim], dim)
  out = np.array(x, copy=True)
  np.add.at(out, _along(index, dim), src[tuple(slice(0, n) for n in index.shape)])
  return out


_SCATTER_UFUNCS = {"sum": np.add, "mean": np.add, "prod": np.multiply, "amax": np.maximum, "amin": np.minimum}


def _scatter_reduce(x, index, src, dim, reduce, include_self):
  _check_bounds("scatter_reduce", index, x.shape[dim], dim)
  key, out = _along(index, dim), np.array(x, copy=True)
  if not include_self:  # the reduction's identity where src lands
    lo, hi = (-np.inf, np.inf) if x.dtype.kind == "f" else (False, True) if x.dtype.kind == "b" else \
      (np.iinfo(x.dtype).min, np.iinfo(x.dtype).max)
    out[key] = {"sum": 0, "mean": 0, "prod": 1, "amax": lo, "amin": hi}[reduce]
  _SCATTER_UFUNCS[reduce].at(out, key, src[tuple(slice(0, n) for n in index.shape)])
  if reduce != "mean": return out
  count = np.full(x.shape, int(include_self), np.int64)
  np.add.at(count, key, 1)
  count = np.maximum(count, 1)
  return (out / count).astype(x.dtype) if x.dtype.kind == "f" else out // count.astype(out.dtype)


def _embedding(weight, idx):
  _check_bounds("embedding", idx, weight.shape[0], 0)
  return weight[idx]


def _embedding_backward(g, idx, num):
  out = np.zeros((num, g.shape[-1]), g.dtype)
  np.add.at(out, idx.reshape(-1), g.reshape(-1, g.shape[-1]))
  return out


# *** normalization and losses ***

def _softmax(x, dim):
  e = np.exp(x - np.max(x, axis=dim, keepdims=True))
  return e / np.sum(e, axis=dim, keepdims=True)


def _log_softmax(x, dim):
  shifted = x - np.max(x, axis=dim, keepdims=True)
  return shifted - np.log(np.sum(np.exp(shifted), axis=dim, keepdims=True))


def _layer_norm(x, w, b, n, eps, dtype=None):
  axes = tuple(range(x.ndim - n, x.ndim))
  mu = x.mean(axis=axes, keepdims=True)
  xc = x - mu
  out = xc / np.sqrt((xc * xc).mean(axis=axes, keepdims=True) + eps)
  if w is not None: out = out * w
  if b is not None: out = out + b
  return out


def _add_layer_norm(x, y, w, b, n, eps, dtype=None):
  h = (x + y).astype(x.dtype, copy=False)
  return h, _layer_norm(h, w, b, n, eps)


def _layer_norm_backward(g, x, w, residual=None, *, n, eps, has_bias, cast=None, bias_grad=False):
  axes, batch = tuple(range(x.ndim - n, x.ndim)), tuple(range(x.ndim - n))
  xc = x - x.mean(axis=axes, keepdims=True)
  rstd = 1 / np.sqrt((xc * xc).mean(axis=axes, keepdims=True) + eps)
  xhat = xc * rstd
  gw = g if w is None else g * w
  dx = rstd * (gw - gw.mean(axis=axes, keepdims=True) - xhat * (gw * xhat).mean(axis=axes, keepdims=True))
  if residual is not None: dx = residual + dx.astype(x.dtype, copy=False)
  dw = None if w is None else (g * xhat).sum(axis=batch).astype(x.dtype, copy=False)
  dx = dx.astype(x.dtype, copy=False)
  dxc = None if cast is None else dx.astype(cast.np)
  acc = np.float64 if x.dtype == np.float64 else np.float32
  sums = (dx if dxc is None else dxc).astype(acc).sum(axis=batch) if bias_grad else None
  return dx, dw, g.sum(axis=batch).astype(x.dtype, copy=False) if has_bias else None, dxc, sums


def _channel_axes(x):
  """The axes batch norm reduces over (all but 1), and the shape that broadcasts a (C,) vector against x."""
  return (0,) + tuple(range(2, x.ndim)), (1, x.shape[1]) + (1,) * (x.ndim - 2)


def _batch_norm_stats(x, running_mean=None, running_var=None, batches=None, *, momentum=None):
  """The statistics (in float64, kept in float32 or float64 as the op's rule says) and, given running statistics,
  their update in float32 math (float64 when the running or the batch statistics are float64), as the CUDA kernel's,
  and the batch count plus one."""
  axes, shape = _channel_axes(x)
  stats = np.float64 if x.dtype == np.float64 else np.float32
  x = x.astype(np.float64)
  mean = x.mean(axis=axes)
  xc = x - mean.reshape(shape)
  mean, var = mean.astype(stats), (xc * xc).mean(axis=axes).astype(stats)
  if running_mean is None: return mean, var, None, None, None
  acc = np.float64 if np.float64 in (running_mean.dtype, stats) else np.float32
  count = x.size // x.shape[1]
  m = acc(momentum)
  new_mean = (acc(1) - m) * running_mean.astype(acc) + m * mean.astype(acc)
  new_var = (acc(1) - m) * running_var.astype(acc) + m * (var.astype(acc) * acc(count / (count - 1)))
  return mean, var, new_mean, new_var, None if batches is None else batches + 1


def _batch_norm_terms(x, mean, var, eps):
  """(x - mean) / sqrt(var + eps) and 1 / sqrt(var + eps) (broadcasting against x), in float64."""
  _, shape = _channel_axes(x)
  invstd = 1 / np.sqrt(var.astype(np.float64).reshape(shape) + eps)
  return (x.astype(np.float64) - mean.reshape(shape)) * invstd, invstd


def _batch_norm(x, mean, var, w, b, residual=None, *, eps, training, relu=False):
  """In float64, or with Nova's epilogue (`residual`, `relu`) as the separate ops compute it: the normalized value
  rounded to x's dtype, the residual added in float32 (halves) or x's dtype, relu of that."""
  _, shape = _channel_axes(x)
  mean, var, w, b = (None if a is None else a.astype(np.float64) for a in (mean, var, w, b))
  with np.errstate(all="ignore"):  # IEEE results (inf, nan) without numpy's warnings, as the other kernels
    y, _ = _batch_norm_terms(x, mean, var, eps)
    if w is not None: y = y * w.reshape(shape)
    if b is not None: y = y + b.reshape(shape)
    if residual is None and not relu: return y
    wide = np.float32 if x.dtype in _HALF else x.dtype
    y = y.astype(x.dtype)
    if residual is not None: y = (y.astype(wide) + residual.astype(wide)).astype(x.dtype)
    return np.maximum(y.astype(wide), 0).astype(x.dtype) if relu else y


def _batch_norm_backward(g, x, mean, var, w, relu_out=None, *, eps, training, input_grad, weight_grad, bias_grad):
  axes, shape = _channel_axes(x)
  xhat, invstd = _batch_norm_terms(x, mean, var, eps)
  g = g.astype(np.float64) if relu_out is None else np.where(relu_out <= 0, 0.0, g.astype(np.float64))
  dw, db = (g * xhat).sum(axis=axes), g.sum(axis=axes)
  dx = None
  if input_grad:
    if training: g = g - (db.reshape(shape) + xhat * dw.reshape(shape)) / (x.size // x.shape[1])
    dx = g * invstd if w is None else g * (invstd * w.reshape(shape))
  return dx, dw if weight_grad else None, db if bias_grad else None


def _valid_targets(op, target, ignore_index, num_classes):
  valid = target != ignore_index
  bad = target[valid & ((target < 0) | (target >= num_classes))]
  if bad.size:
    raise IndexError(f"{op}: target {bad.flat[0]} is out of bounds for {num_classes} classes "
                     f"(expected 0 <= target < {num_classes}, or ignore_index={ignore_index})")
  return valid, np.where(valid, target, 0)


def _cross_entropy(logits, target, ignore_index, dtype=None):
  return _cross_entropy_with_stats(logits, target, ignore_index, dtype)[0]


def _cross_entropy_with_stats(logits, target, ignore_index, dtype=None):
  """The losses and the row statistics (max, sum of exp(x - max)) in the logits' own arithmetic, as the backward's
  softmax computes them, stored in the statistics dtype (exactly: it is at least as wide)."""
  valid, t = _valid_targets("cross_entropy", target, ignore_index, logits.shape[1])
  m = np.max(logits, axis=1, keepdims=True)
  s = np.sum(np.exp(logits - m), axis=1, keepdims=True)
  loss = np.where(valid, (m + np.log(s))[:, 0] - logits[np.arange(len(t)), t], 0.0)
  stats = np.float64 if logits.dtype == np.float64 else np.float32
  return loss, m[:, 0].astype(stats), s[:, 0].astype(stats)


def _cross_entropy_backward(g, logits, target, ignore_index):
  valid, t = _valid_targets("cross_entropy", target, ignore_index, logits.shape[1])
  p = _softmax(logits, 1)
  p[np.arange(len(t)), t] -= 1.0
  return p * (g * valid)[:, None]


def _cross_entropy_backward_with_stats(g, logits, target, row_max, sum_exp, ignore_index):
  valid, t = _valid_targets("cross_entropy", target, ignore_index, logits.shape[1])
  p = np.exp(logits - row_max.astype(logits.dtype)[:, None]) / sum_exp.astype(logits.dtype)[:, None]
  p[np.arange(len(t)), t] -= 1.0
  return p * (g * valid)[:, None]


def _cross_entropy_with_grad(g, logits, target, ignore_index, dtype=None):
  loss, row_max, sum_exp = _cross_entropy_with_stats(logits, target, ignore_index, dtype)
  return loss, _cross_entropy_backward_with_stats(g, logits, target, row_max, sum_exp, ignore_index)


def _rows(logits):
  """Half and float32 logits as float32 (statistics dtype), float64 as they are."""
  return logits.astype(np.float64 if logits.dtype == np.float64 else np.float32, copy=False)


def _local_targets(target, start, num_classes):
  """(rows whose target is in [start, start + num_classes), the local index there, 0 elsewhere)."""
  t = target - start
  mine = (t >= 0) & (t < num_classes)
  return mine, np.where(mine, t, 0)


def _cross_entropy_stats(logits, target, start):
  x = _rows(logits)
  m = x.max(axis=1)
  mine, t = _local_targets(target, start, x.shape[1])
  return m, np.exp(x - m[:, None]).sum(axis=1), np.where(mine, x[np.arange(len(t)), t], 0).astype(x.dtype)


def _cross_entropy_lse_backward(g, logits, target, lse, start, ignore_index):
  x = _rows(logits)
  p = np.exp(x - lse[:, None])
  mine, t = _local_targets(target, start, x.shape[1])
  p[np.nonzero(mine)[0], t[mine]] -= 1
  return p * np.where(target == ignore_index, 0, g).astype(x.dtype)[:, None]


def _lstm_gates(gi, gh):
  i, f, g, o = np.split(gi + gh, 4, axis=1)
  return _sigmoid(i), _sigmoid(f), np.tanh(g), _sigmoid(o)


def _max_pool2d_indices(x, kernel, stride, padding, dilation, out_size):
  """Each window's maximum's flat position in H * W, as PyTorch's kernels pick it: the first of equal maxima, the
  last NaN (a NaN replaces any maximum); padding never."""
  N, C, H, W = x.shape
  best = idx = seen = None
  for i, j in itertools.product(range(kernel[0]), range(kernel[1])):
    rows = np.arange(out_size[0]) * stride[0] - padding[0] + i * dilation[0]
    cols = np.arange(out_size[1]) * stride[1] - padding[1] + j * dilation[1]
    inside = np.broadcast_to(((rows >= 0) & (rows < H))[:, None] & ((cols >= 0) & (cols < W))[None, :],
                             (N, C, *out_size))
    v = x[:, :, np.clip(rows, 0, H - 1)][:, :, :, np.clip(cols, 0, W - 1)]
    pos = np.broadcast_to(rows[:, None] * W + cols[None, :], v.shape)
    if best is None:
      best, idx, seen = v, pos, inside
      continue
    take = inside & (~seen | (v > best) | (v != v))
    best, idx, seen = np.where(take, v, best), np.where(take, pos, idx), seen | take
  return np.ascontiguousarray(idx, dtype=np.int64)


def _max_pool2d_values(x, idx, **geometry):
  N, C = x.shape[:2]
  return np.take_along_axis(x.reshape(N, C, -1), idx.reshape(N, C, -1), 2).reshape(idx.shape)


def _max_pool2d_with_indices(x, kernel, stride, padding, dilation, out_size):
  idx = _max_pool2d_indices(x, kernel, stride, padding, dilation, out_size)
  return _max_pool2d_values(x, idx), idx


def _max_pool2d_backward(g, idx, size, **geometry):
  """g summed at each input position over the windows whose maximum it is."""
  N, C = g.shape[:2]
  dx = np.zeros((N, C, size[0] * size[1]), np.float64)
  n, c = np.indices((N, C))
  np.add.at(dx, (n[:, :, None], c[:, :, None], idx.reshape(N, C, -1)), g.reshape(N, C, -1))
  return dx.reshape(N, C, *size)


def _lstm_cell(gi, gh, c):
  i, f, g, o = _lstm_gates(gi, gh)
  c2 = f * c + i * g
  return np.concatenate([o * np.tanh(c2), c2], axis=1)


def _lstm_cell_backward(grad, gi, gh, c, out):
  H = c.shape[1]
  i, f, g, o = _lstm_gates(gi, gh)
  dh, tc = grad[:, :H], np.tanh(out[:, H:])
  dc = grad[:, H:] + dh * o * (1 - tc * tc)
  return np.concatenate([dc * g * i * (1 - i), dc * c * f * (1 - f), dc * i * (1 - g * g), dh * tc * o * (1 - o),
                         dc * f], axis=1)


def _as(x, dtype):
  """x rounded to dtype as a kernel's result is stored, read back in float32 (float64 stays)."""
  return x.astype(dtype).astype(np.float32) if dtype in _HALF else x


def _recurrent(h, w, b):
  """h W^T + b as a recurrent layer's linear computes it in w's dtype: the matmul rounded, then the bias added and
  rounded."""
  f = _as(h.astype(w.dtype, copy=False), w.dtype)
  gh = _as(_matmul(f, w.astype(f.dtype).T), w.dtype)
  return gh if b is None else _as(gh + _as(b, b.dtype), w.dtype)


def _steps(L: int, reverse: bool) -> list[int]:
  return list(range(L - 1, -1, -1) if reverse else range(L))


def _lstm_sequence(gi, h0, c0, w_hh, b_hh, *, reverse, tf32=False):
  """lstm_cell's steps with their recurrent matmuls, every intermediate rounded as the per-step ops round it."""
  L, N, G = gi.shape
  dtype = np.promote_types(np.promote_types(gi.dtype, w_hh.dtype), c0.dtype)
  out = np.empty((L, N, G // 2), dtype)
  h, c = h0, c0
  for t in _steps(L, reverse):
    out[t] = _lstm_cell(_as(gi[t], gi.dtype), _recurrent(h, w_hh, b_hh), _as(c, c.dtype))
    h, c = out[t, :, :G // 4], out[t, :, G // 4:]
  return out


def _lstm_sequence_backward(g, gi, h0, c0, w_hh, b_hh, out, *, reverse, states, weights, tf32=False):
  """Back through the steps: the cell's gradient, then the gates' gradient (rounded to w_hh's dtype, as the
  matmul's backward reads it) times w_hh for the previous h; d w_hh and d b_hh from all steps' gates at the end."""
  L, N, G = gi.shape
  H, steps = G // 4, _steps(L, reverse)
  f = np.float64 if np.float64 in (g.dtype, out.dtype) else np.float32
  w = w_hh.astype(f)
  prev = {t: steps[i - 1] for i, t in enumerate(steps) if i}
  h_prev = np.stack([out[prev[t], :, :H] if t in prev else h0 for t in range(L)]) if L else np.empty((0, N, H))
  dgates = np.empty((L, N, G), f)  # rounded to w_hh's dtype
  dgi = np.empty((L, N, G), f)
  dh, dc = np.zeros((N, H), f), np.zeros((N, H), f)
  for i in range(L - 1, -1, -1):
    t = steps[i]
    c = _as(out[prev[t], :, H:], out.dtype) if t in prev else _as(c0, c0.dtype)
    grad = g[t].astype(f) + np.concatenate([dh, dc], axis=1)
    d = _as(_lstm_cell_backward(grad, _as(gi[t], gi.dtype), _recurrent(h_prev[t], w_hh, b_hh), c,
                                _as(out[t], out.dtype)), out.dtype)
    dgi[t], dgates[t], dc = d[:, :G], _as(d[:, :G], w_hh.dtype), d[:, G:]
    if i or states: dh = _as(dgates[t] @ w, w_hh.dtype)
  dw = db = None
  if weights:
    dw = dgates.reshape(-1, G).T @ _as(h_prev.astype(w_hh.dtype), w_hh.dtype).reshape(-1, H)
    db = None if b_hh is None else dgates.sum((0, 1))
  return dgi, dh if states else None, dc if states else None, dw, db


def _gru_gates(gi, gh):
  (ir, iz, in_), (hr, hz, hn) = np.split(gi, 3, axis=1), np.split(gh, 3, axis=1)
  r = _sigmoid(ir + hr)
  return r, _sigmoid(iz + hz), np.tanh(in_ + r * hn), hn


def _gru_cell(gi, gh, h):
  _, z, n, _ = _gru_gates(gi, gh)
  return (1 - z) * n + z * h


def _gru_cell_backward(grad, gi, gh, h):
  r, z, n, hn = _gru_gates(gi, gh)
  dn = grad * (1 - z) * (1 - n * n)
  dr, dz = dn * hn * r * (1 - r), grad * (h - n) * z * (1 - z)
  return np.concatenate([dr, dz, dn, dr, dz, dn * r, grad * z], axis=1)


def _gru_sequence(gi, h0, w_hh, b_hh, *, reverse, tf32=False):
  """gru_cell's steps with their recurrent matmuls, every intermediate rounded as the per-step ops round it."""
  L, N, G = gi.shape
  out = np.empty((L, N, G // 3), np.promote_types(np.promote_types(gi.dtype, w_hh.dtype), h0.dtype))
  h = h0
  for t in _steps(L, reverse):
    out[t] = _gru_cell(_as(gi[t], gi.dtype), _recurrent(h, w_hh, b_hh), _as(h, h.dtype))
    h = out[t]
  return out


def _gru_sequence_backward(g, gi, h0, w_hh, b_hh, out, *, reverse, states, weights, tf32=False):
  """Back through the steps: gru_cell's gradient ([d gi, d gh, d h]), then d gh (rounded to w_hh's dtype) times w_hh
  added to d h for the previous h; d w_hh and d b_hh from all steps' d gh at the end."""
  L, N, G = gi.shape
  H, steps = G // 3, _steps(L, reverse)
  f = np.float64 if np.float64 in (g.dtype, out.dtype) else np.float32
  w = w_hh.astype(f)
  prev = {t: steps[i - 1] for i, t in enumerate(steps) if i}
  h_prev = np.stack([out[prev[t]] if t in prev else h0 for t in range(L)]) if L else np.empty((0, N, H))
  dgh, dgi = np.empty((L, N, G), f), np.empty((L, N, G), f)
  dh = np.zeros((N, H), f)
  for i in range(L - 1, -1, -1):
    t = steps[i]
    h = _as(out[prev[t]], out.dtype) if t in prev else _as(h0, h0.dtype)
    d = _as(_gru_cell_backward(g[t].astype(f) + dh, _as(gi[t], gi.dtype), _recurrent(h_prev[t], w_hh, b_hh), h),
            out.dtype)
    dgi[t], dgh[t], dh = d[:, :G], _as(d[:, G:2 * G], w_hh.dtype), d[:, 2 * G:]
    if i or states: dh = dh + _as(dgh[t] @ w, w_hh.dtype)
  dw = db = None
  if weights:
    dw = dgh.reshape(-1, G).T @ _as(h_prev.astype(w_hh.dtype), w_hh.dtype).reshape(-1, H)
    db = None if b_hh is None else dgh.sum((0, 1))
  return dgi, dh if states else None, dw, db


# *** random ***

def _rng(seed, offset) -> np.random.Generator:
  """Philox keyed by the seed, advanced past `offset` draws (each draw has a 256-bit block of its own)."""
  return np.random.Generator(np.random.Philox(key=seed).advance(offset))


def _argsort(x, dim, descending):
  """Stable; nan above +inf (numpy's order). Descending sorts the reversed array and reverses back, so that equal
  values still keep their order."""
  if not descending: return np.argsort(x, axis=dim, kind="stable")
  n = x.shape[dim]
  return n - 1 - np.flip(np.argsort(np.flip(x, dim), axis=dim, kind="stable"), dim)


def _int_division(name: str, fn):
  """An integer division or remainder that raises at a zero divisor, as PyTorch's (numpy gives 0)."""
  def kernel(x, y, **kw):
    if x.dtype.kind in "iu" and (np.asarray(y) == 0).any():
      raise RuntimeError(f"{name}: integer division by zero; divide floating point tensors to get inf/nan instead")
    return fn(x, y, **kw)
  return kernel


def _shift(fn, x, y, negative_fill: int):
  """x shifted by y; by a negative amount or past the width 0 (negative x shifted right: -1), as PyTorch."""
  bits = 8 * x.dtype.itemsize
  inside = (y >= 0) & (y < bits)
  return np.where(inside, fn(x, np.where(inside, y, 0)), np.where(x < 0, negative_fill, 0)).astype(x.dtype)


def _pow(x, y):
  """Integers to negative powers truncate toward zero as C does (1, -1 or 0), as PyTorch's for tensor exponents and
  the CUDA kernel's (`pow` refuses a negative Python number, as PyTorch)."""
  if x.dtype.kind in "iu" and y.dtype.kind in "iu" and (y < 0).any():
    neg = y < 0
    return np.where(neg, np.where(x == 1, 1, np.where(x == -1, np.where(y & 1, -1, 1), 0)), np.power(x, np.where(neg, 0, y)))
  return np.power(x, y)


# *** attention ***

def _attention_weights(q, k, causal, scale):
  scores = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
  if causal: scores = np.where(np.tri(q.shape[-2], k.shape[-2], dtype=bool), scores, -np.inf)
  return _softmax(scores, -1)


def _flash_attention(q, k, v, causal, scale, tf32=False): return np.matmul(_attention_weights(q, k, causal, scale), v)


def _flash_attention_backward(g, q, k, v, out, causal, scale, tf32=False):
  """(dq, dk, dv), as the flash kernels compute them: P recomputed, rowsum(dP * P) = rowsum(g * out)."""
  p = _attention_weights(q, k, causal, scale)
  ds = p * (np.matmul(g, np.swapaxes(v, -1, -2)) - np.sum(g * out, axis=-1, keepdims=True)) * scale
  dq, dk, dv = np.matmul(ds, k), np.matmul(np.swapaxes(ds, -1, -2), q), np.matmul(np.swapaxes(p, -1, -2), g)
  return dq, dk, dv


def _flash_attention_transposed(q, k, v, causal, scale, tf32=False):
  return np.ascontiguousarray(np.swapaxes(_flash_attention(q, k, v, causal, scale), 1, 2))


def _flash_attention_backward_packed(g, q, k, v, out, causal, scale, tf32=False):
  return np.ascontiguousarray(np.stack(_flash_attention_backward(g, q, k, v, out, causal, scale), 1)
                              .transpose(0, 3, 1, 2, 4))


def _flash_attention_lse(q, k, v, causal, scale, tf32=False):
  """Attention and the logsumexp of the scaled scores, packed (..., L, E + 1), in float32 (float64 for float64)."""
  acc = np.float64 if q.dtype == np.float64 else np.float32
  q, k, v = (a.astype(acc, copy=False) for a in (q, k, v))
  scores = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
  if causal: scores = np.where(np.tri(q.shape[-2], k.shape[-2], dtype=bool), scores, -np.inf)
  top = np.max(scores, axis=-1, keepdims=True)
  e = np.exp(scores - top)
  total = np.sum(e, axis=-1, keepdims=True)
  return np.concatenate([np.matmul(e / total, v), top + np.log(total)], -1)


def _flash_attention_lse_backward(g, glse, q, k, v, out, causal, scale, tf32=False):
  """(dq, dk, dv) of flash_attention_lse: dS = P * (dP - rowsum(g * out) + dlse), in float32 at least."""
  acc = np.float64 if q.dtype == np.float64 else np.float32
  dt = q.dtype
  g, glse, q, k, v, out = (a.astype(acc, copy=False) for a in (g, glse, q, k, v, out))
  p = _attention_weights(q, k, causal, scale)
  delta = np.sum(g * out, axis=-1, keepdims=True) - glse[..., None]
  ds = p * (np.matmul(g, np.swapaxes(v, -1, -2)) - delta) * scale
  grads = np.matmul(ds, k), np.matmul(np.swapaxes(ds, -1, -2), q), np.matmul(np.swapaxes(p, -1, -2), g)
  return tuple(a.astype(dt) for a in grads)


# *** convolution: im2col as one strided view of the padded input, contracted by tensordot per group ***

def _conv_windows(x, kernel, stride, padding, dilation, out):
  """(N, C, *spatial) -> a (N, C, *out, *kernel) view of x zero-padded by `padding` before each spatial dim (and
  after, as far as the windows reach): the input under every kernel offset of every output position."""
  reach = [(o - 1) * s + d * (k - 1) + 1 for o, s, d, k in zip(out, stride, dilation, kernel)]
  xp = np.pad(x, [(0, 0), (0, 0)] + [(p, max(r - n - p, 0)) for p, r, n in zip(padding, reach, x.shape[2:])])
  st = xp.strides[2:]
  return np.lib.stride_tricks.as_strided(xp, xp.shape[:2] + tuple(out) + tuple(kernel), xp.strides[:2] + tuple(
    a * s for a, s in zip(st, stride)) + tuple(a * d for a, d in zip(st, dilation)), writeable=False)


def _conv(x, w, stride, padding, dilation, groups, tf32=False):
  nd, (og, cg) = x.ndim - 2, (w.shape[0] // groups, w.shape[1])
  out = [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in zip(x.shape[2:], w.shape[2:], stride, padding,
                                                                            dilation)]
  cols = _conv_windows(x, w.shape[2:], stride, padding, dilation, out)
  axes = ([1] + list(range(2 + nd, 2 + 2 * nd)), list(range(1, 2 + nd)))
  y = np.concatenate([np.tensordot(cols[:, i * cg:(i + 1) * cg], w[i * og:(i + 1) * og], axes)
                      for i in range(groups)], axis=-1)  # (N, *out, C_out)
  return np.moveaxis(y, -1, 1)


def _conv_grad_input(g, w, shape, stride, padding, dilation, groups, tf32=False):
  nd, (og, cg), kernel, out = g.ndim - 2, (w.shape[0] // groups, w.shape[1]), w.shape[2:], g.shape[2:]
  reach = [(o - 1) * s + d * (k - 1) + 1 for o, s, d, k in zip(out, stride, dilation, kernel)]
  dx = np.zeros(tuple(shape[:2]) + tuple(max(n + 2 * p, r) for n, p, r in zip(shape[2:], padding, reach)),
                np.result_type(g, w))
  for i in range(groups):
    cols = np.tensordot(g[:, i * og:(i + 1) * og], w[i * og:(i + 1) * og], ([1], [0]))  # (N, *out, C/g, *kernel)
    cols = np.moveaxis(cols, 1 + nd, 1)
    for offs in np.ndindex(*kernel):
      key = tuple(slice(o * d, o * d + s * (m - 1) + 1, s) for o, d, s, m in zip(offs, dilation, stride, out))
      dx[(slice(None), slice(i * cg, (i + 1) * cg)) + key] += cols[(Ellipsis,) + offs]
  return dx[(slice(None), slice(None)) + tuple(slice(p, p + n) for p, n in zip(padding, shape[2:]))]


def _conv_grad_weight(g, x, shape, stride, padding, dilation, groups, tf32=False):
  nd, og, cg = g.ndim - 2, shape[0] // groups, shape[1]
  cols = _conv_windows(x, shape[2:], stride, padding, dilation, g.shape[2:])
  axes = [0] + list(range(2, 2 + nd))
  return np.concatenate([np.tensordot(g[:, i * og:(i + 1) * og], cols[:, i * cg:(i + 1) * cg], (axes, axes))
                         for i in range(groups)], axis=0)


def _matmul(a, b, tf32=False):
  """a @ b; `tf32` asks for TF32 tensor cores, which the CPU has not: its float32 matmuls stay float32."""
  if a.dtype.kind in "iub": a, b = a.astype(np.int64), b.astype(np.int64)
  if b.ndim == 2 and a.ndim > 2:  # NOTE: one GEMM over the folded batch; numpy loops per matrix otherwise (4x slower)
    return (a.reshape(math.prod(a.shape[:-1]), a.shape[-1]) @ b).reshape(a.shape[:-1] + b.shape[-1:])
  return np.matmul(a, b)


kernels = {
  # creation and random
  "arange": lambda *, start, step, shape, dtype: (start + step * np.arange(shape[0], dtype=np.float64)
                                                  if dtype.is_floating_point else start + step * np.arange(shape[0])),
  "rand": lambda *, shape, dtype, seed, offset: _rng(seed, offset).random(shape, dtype=np.float32),
  "randn": lambda *, shape, dtype, seed, offset: _rng(seed, offset).standard_normal(shape, dtype=np.float32),
  "randint": lambda *, shape, dtype, seed, offset, low, high: _rng(seed, offset).integers(low, high, shape),
  "bernoulli": lambda *, shape, dtype, seed, offset, p: _rng(seed, offset).random(shape, dtype=np.float32) < p,
  "dropout": lambda x, *, p, seed, offset: np.where(_rng(seed, offset).random(x.shape, dtype=np.float32) < 1.0 - p, x,
                                                    0) * x.dtype.type(1.0 / (1.0 - p)),
  # unary
  "neg": np.negative, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
  "rsqrt": lambda x: 1.0 / np.sqrt(x), "abs": np.abs, "sin": np.sin, "cos": np.cos, "tanh": np.tanh,
  "sigmoid": _sigmoid, "relu": lambda x: np.maximum(x, 0), "erf": _erf, "floor": np.floor,
  "sign": lambda x: (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype),
  "tan": np.tan, "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan, "sinh": np.sinh, "cosh": np.cosh,
  "asinh": np.arcsinh, "acosh": np.arccosh, "atanh": np.arctanh, "exp2": np.exp2, "log2": np.log2, "log10": np.log10,
  "log1p": np.log1p, "expm1": np.expm1, "ceil": np.ceil, "trunc": np.trunc, "round": np.rint,
  "gelu": _gelu, "gelu_backward": _gelu_backward, "relu_backward": _relu_backward,
  "logical_not": np.logical_not, "cast": lambda x, dtype: x.astype(dtype.np),
  "cast_many": lambda *xs, dtype: tuple(x.astype(dtype.np) for x in xs),
  "copy": lambda x: np.array(x, copy=True, order="C"),
  # binary
  "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "pow": _pow,
  "atan2": np.arctan2, "copysign": np.copysign, "fmod": _int_division("fmod", np.fmod),
  "remainder": _int_division("remainder", np.remainder), "floor_divide": _int_division("floor_divide", np.floor_divide),
  "maximum": np.maximum, "minimum": np.minimum, "eq": np.equal, "ne": np.not_equal, "lt": np.less,
  "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "logical_and": np.logical_and,
  "logical_or": np.logical_or, "logical_xor": np.logical_xor, "where": np.where,
  "bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor, "bitwise_not": np.invert,
  "bitwise_left_shift": lambda x, y: _shift(np.left_shift, x, y, 0),
  "bitwise_right_shift": lambda x, y: _shift(np.right_shift, x, y, -1),
  # reductions
  "sum": lambda x, dims, keepdim, dtype: np.sum(x, axis=dims, keepdims=keepdim),
  "amax": lambda x, dims, keepdim: np.max(x, axis=dims, keepdims=keepdim),
  "amin": lambda x, dims, keepdim: np.min(x, axis=dims, keepdims=keepdim),
  "argmax": lambda x, dim, keepdim: np.argmax(x, axis=dim, keepdims=keepdim),
  "argmin": lambda x, dim, keepdim: np.argmin(x, axis=dim, keepdims=keepdim),
  "cumsum": _cumsum, "cumprod": lambda x, dim: np.cumprod(x, dim), "argsort": _argsort,
  "max_pool2d_indices": _max_pool2d_indices, "max_pool2d_values": _max_pool2d_values,
  "max_pool2d_with_indices": _max_pool2d_with_indices,
  "max_pool2d_backward": _max_pool2d_backward,
  # movement and indexing
  "slice_backward": _slice_backward, "cat": lambda *xs, dim: np.concatenate(xs, axis=dim),
  "index": lambda x, *idx, positions: x[_key(x, idx, positions)], "index_backward": _index_backward,
  "index_put": _index_put, "gather": _gather, "scatter_add": _scatter_add, "scatter_reduce": _scatter_reduce, "embedding": _embedding,
  "embedding_backward": _embedding_backward,
  # linear algebra, normalization, losses
  "matmul": _matmul, "conv": _conv, "conv_grad_input": _conv_grad_input, "conv_grad_weight": _conv_grad_weight,
  "softmax": _softmax, "log_softmax": _log_softmax, "layer_norm": _layer_norm, "add_layer_norm": _add_layer_norm,
  "layer_norm_backward": _layer_norm_backward, "batch_norm_stats": _batch_norm_stats,
  "batch_norm_backward": _batch_norm_backward,
  "cross_entropy": _cross_entropy, "cross_entropy_backward": _cross_entropy_backward,
  "cross_entropy_with_stats": _cross_entropy_with_stats,
  "cross_entropy_backward_with_stats": _cross_entropy_backward_with_stats,
  "cross_entropy_with_grad": _cross_entropy_with_grad,
  "cross_entropy_stats": _cross_entropy_stats, "cross_entropy_lse_backward": _cross_entropy_lse_backward,
  "flash_attention": _flash_attention, "flash_attention_backward": _flash_attention_backward,
  "flash_attention_backward_packed": _flash_attention_backward_packed,
  "flash_attention_transposed": _flash_attention_transposed,
  "flash_attention_lse": _flash_attention_lse, "flash_attention_lse_backward": _flash_attention_lse_backward,
  "lstm_cell": _lstm_cell, "lstm_cell_backward": _lstm_cell_backward,
  "gru_cell": _gru_cell, "gru_cell_backward": _gru_cell_backward,
}


def _upcast_halves(fn):
  """Half inputs computed in float32; IEEE results (inf, nan) without numpy's warnings, as PyTorch gives them."""
  @functools.wraps(fn)
  def kernel(*arrays, **attrs):
    with np.errstate(all="ignore"):
      return fn(*(a.astype(np.float32) if a is not None and a.dtype in _HALF else a for a in arrays), **attrs)
  return kernel


def _in_first_layout(result, arrays):
  """result laid out as the first operand of its shape when that one is dense, as PyTorch's elementwise kernels (and
  the CUDA backend's) choose; numpy's own choice differs only when the operands' layouts do (it then picks row-major)."""
  if not isinstance(result, np.ndarray) or result.ndim < 2: return result
  first = next((a for a in arrays if isinstance(a, np.ndarray) and a.shape == result.shape), None)
  if first is None or (first.flags.c_contiguous and result.flags.c_contiguous): return result
  order = tuple(range(first.ndim)) if first.flags.c_contiguous else \
    memory_order(first.shape, tuple(st // first.itemsize for st in first.strides))
  if order is None or memory_order(result.shape, tuple(st // result.itemsize for st in result.strides)) == order:
    return result  # the first operand has gaps, or the result is laid out as it already
  out = np.empty([result.shape[d] for d in order], result.dtype).transpose(np.argsort(order))
  out[...] = result
  return out


def _writing(fn):
  """The kernel also stores its result into `out=` (a view of any layout; cast to out's dtype as astype does) through
  the ufunc's own `out` (numpy buffers inputs that overlap it), and says so with `writes_out`. A new result takes the
  first operand's layout (`_in_first_layout`)."""
  def kernel(*arrays, out=None, **attrs):
    if out is None: return _in_first_layout(fn(*arrays, **attrs), arrays)
    fn(*arrays, out=out, casting="unsafe", **attrs)
    return out
  kernel.writes_out = True
  return functools.update_wrapper(kernel, fn)


def _fill(*, shape, value, dtype, out=None):
  if out is None: return np.full(shape, value, dtype.np)
  np.copyto(out, np.full((), value, dtype.np), casting="unsafe")
  return out


def _empty(*, shape, dtype, out=None):
  return np.empty(shape, dtype.np) if out is None else out


def _where(c, x, y, out=None):
  if out is None: return np.where(c, x, y)
  np.copyto(out, np.where(c, x, y), casting="unsafe")
  return out


_fill.writes_out = _empty.writes_out = _where.writes_out = True
_UFUNCS = ("neg exp log sqrt abs sin cos tanh floor logical_not add sub mul div maximum minimum eq ne lt le gt ge "
           "logical_and logical_or logical_xor tan asin acos atan sinh cosh asinh acosh atanh exp2 log2 log10 log1p "
           "expm1 ceil trunc round atan2 copysign fmod remainder floor_divide bitwise_and bitwise_or bitwise_xor "
           "bitwise_not").split()
kernels = {name: _writing(_upcast_halves(fn)) if name in _UFUNCS else _upcast_halves(fn) for name, fn in kernels.items()}
kernels["full"], kernels["empty"], kernels["where"] = _fill, _empty, _where
# NOTE: the recurrent loops and batch_norm take their inputs in their own dtypes: they round each step's values (the
# norm's before its epilogue) as the ops they stand for would store them
kernels |= {"batch_norm": _batch_norm, "lstm_sequence": _lstm_sequence, "lstm_sequence_backward": _lstm_sequence_backward,
            "gru_sequence": _gru_sequence, "gru_sequence_backward": _gru_sequence_backward}


# *** multi-tensor kernels (the optimizer's update, gradient norms and scaling) ***

def _store(out, i: int, value: np.ndarray, like: np.ndarray) -> np.ndarray:
  """value in like's dtype, written into out[i] when given (`out=`: the op's in-place form; None where a result is
  new) or returned new."""
  if out is None or out[i] is None: return value.astype(like.dtype)
  np.copyto(out[i], value, casting="unsafe")
  return out[i]


def _adamw(*xs, n, beta1, beta2, eps, weight_decay, clip=None, out=None):
  """AdamW over n tensors: xs = params, grads, exp_avgs, exp_avg_sqs, steps (n each), lr (and with `clip` a factor each
  gradient is scaled by as `_scale` scales it). The float32 operations and their order are the CUDA kernel's
  (blutrain/backend/cuda/kernels/optim.py) and PyTorch's; steps are float64."""
  f32, lr = np.float32, float(xs[5 * n])
  params, grads, exp_avgs, exp_avg_sqs, steps = (xs[k * n:(k + 1) * n] for k in range(5))
  results: list[list] = [[], [], [], []]
  for i, (p0, g0, m0, v0, s0) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
    step = s0 + 1.0
    bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    if clip: g0 = (g0.astype(f32) * xs[-1].astype(f32)).astype(g0.dtype)  # as _scale stores it
    p, g, m, v = (a.astype(f32) for a in (p0, g0, m0, v0))
    if weight_decay != 0: p = p * f32(1 - lr * weight_decay)
    m = m + f32(1 - beta1) * (g - m)
    v = v * f32(beta2) + (f32(1 - beta2) * g) * g
    p = p + (f32(-lr / bc1) * m) / (np.sqrt(v) / f32(np.sqrt(bc2)) + f32(eps))
    for k, (new, like) in enumerate(((p, p0), (m, m0), (v, v0), (np.asarray(step), s0))):
      results[k].append(_store(out, k * n + i, new, like))
  return tuple(r for rs in results for r in rs)


def _sgd(*xs, n, momentum, dampening, weight_decay, nesterov, maximize, is_first_step, clip=None, out=None):
  """SGD over n tensors: xs = params, grads, momentum buffers (n each, none when momentum is 0), lr (and with `clip`
  a factor each gradient is scaled by as `_scale` scales it). The float32 operations, their order and the buffer's
  rounding to its dtype are those of the per-parameter update (blutrain/optim/sgd.py) and of the CUDA kernel."""
  f32, k = np.float32, 3 if momentum != 0 else 2
  lr, params, grads, bufs = float(xs[k * n]), xs[:n], xs[n:2 * n], xs[2 * n:k * n]
  new_params, new_bufs = [], []
  for i, (p0, g0) in enumerate(zip(params, grads)):
    if clip: g0 = (g0.astype(f32) * xs[-1].astype(f32)).astype(g0.dtype)  # as _scale stores it
    p, g = p0.astype(f32), g0.astype(f32)
    if maximize: g = -g
    if weight_decay != 0: g = g + p * f32(weight_decay)
    if momentum != 0:
      b0 = bufs[i]
      b = g if is_first_step else b0.astype(f32) * f32(momentum)
      if not is_first_step: b = b + g if dampening == 0 else b + g * f32(1 - dampening)
      new_bufs.append(b := _store(out, n + i, b, b0))
      b = b.astype(f32)  # the update reads the buffer as stored
      g = g + b * f32(momentum) if nesterov else b
    new_params.append(_store(out, i, p + g * f32(-lr), p0))
  return (*new_params, *new_bufs)


def _sum_squares(*xs):
  """The float32 sum of the squares of every element of every tensor."""
  return np.asarray(sum((np.sum(np.square(x, dtype=np.float32), dtype=np.float32) for x in xs), np.float32(0)))


def _scale(*xs, out=None):
  """xs[:-1] each times the 0-d xs[-1], in their own dtypes."""
  s = xs[-1].astype(np.float32)
  return tuple(_store(out, i, x.astype(np.float32) * s, x) for i, x in enumerate(xs[:-1]))


_adamw.writes_out = _sgd.writes_out = _scale.writes_out = True


def _gemm(a, b, *xs, epilogue, dtype, tf32=False):
  """Nova's fused GEMM (`ops.linalg.gemm_op`): the kernels of the ops it replaces, one after another, each result
  rounded to that op's dtype, so a compiled step equals eager mode exactly; a final "bias_grad" also returns the
  float32 (float64) sums of the output over all its dims but the last."""
  t, xs, steps = a.dtype, iter(xs), epilogue.split(",") if epilogue else []
  sums = steps[-1:] == ["bias_grad"]
  y = kernels["matmul"](a, b, tf32=tf32).astype(t)
  saved = []
  for step in steps[:-1] if sums else steps:
    if step == "save": saved.append(y)
    elif step == "bias": y = kernels["add"](y, next(xs)).astype(t)
    elif step.startswith("gelu_backward"):
      y = kernels["gelu_backward"](y, next(xs), approximate="tanh" if step.endswith("tanh") else "none")
    elif step.startswith("gelu"): y = kernels["gelu"](y, approximate="tanh" if step.endswith("tanh") else "none").astype(t)
    else: y = kernels["add"](y, next(xs))
  y = y.astype(dtype.np)
  if not sums: return (y, *saved)
  return (y, *saved, y.astype(np.float64 if y.dtype == np.float64 else np.float32).sum(tuple(range(y.ndim - 1))))


def _linear(x, weight, bias=None, tf32=False):
  """x @ weight^T + bias (`ops.nn.linear_op`) rounded as the matmul and the add it stands for, each to x's dtype, so
  eager mode equals a compiled step, which captures those two ops."""
  y = kernels["matmul"](x, weight.T, tf32=tf32).astype(x.dtype)
  return y if bias is None else kernels["add"](y, bias).astype(x.dtype)


def _linear_backward(g, x, weight, *, bias, input_grad, weight_grad, tf32=False):
  """linear's gradients (`ops.nn.linear_backward_op`): dx as the matmul kernel, dW and db as `weight_grad`, db alone
  as the sum of g's rows in float32, each rounded to its output's dtype."""
  g2 = g.reshape(-1, g.shape[-1])
  dx = kernels["matmul"](g, weight, tf32=tf32) if input_grad else None
  if weight_grad:
    dw, *db = _weight_grad(g2.T, x.reshape(-1, x.shape[-1]), dtype=dtypes.to_dtype(weight.dtype), bias_grad=bias,
                           tf32=tf32)
    return dx, dw, db[0] if db else None
  return dx, None, g2.astype(np.float64 if g2.dtype == np.float64 else np.float32).sum(0) if bias else None


def _weight_grad(a, b, *, dtype, bias_grad, tf32=False):
  """Nova's weight-gradient GEMM (`ops.linalg.weight_grad_op`): a @ b accumulated in float32 (float64 for float64)
  and stored in `dtype`, and with `bias_grad` the sums of a's rows, as the GPU's GEMM and its epilogue compute them."""
  acc = np.float64 if a.dtype == np.float64 else np.float32
  a32 = a.astype(acc)
  y = kernels["matmul"](a32, b.astype(acc), tf32=tf32).astype(dtype.np)
  return (y, np.sum(a32, axis=-1, dtype=acc).astype(dtype.np)) if bias_grad else (y,)


kernels |= {"adamw": _adamw, "sgd": _sgd, "sum_squares": _sum_squares, "scale": _scale, "gemm": _gemm,
            "linear": _linear, "linear_backward": _linear_backward, "weight_grad": _weight_grad}
kernels |= collective.KERNELS  # the process group's own calls (backend/collective.py)
