"""Multi-tensor primitives: one op over a whole list of tensors, for the optimizer's update and gradient clipping.

Each has several outputs and updates its tensors in place eagerly (`apply`'s `into`, one launch on CUDA for the whole
list); under Nova's capture it is one graph op whose results are written back. They have no VJP: they run under
`no_grad`, after backward.
"""
from __future__ import annotations

from typing import Sequence

from blutrain import dtypes
from blutrain.ops.core import op, write
from blutrain.ops.creation import scalar_operand
from blutrain.tensor import Tensor

_FLOATS = (dtypes.float32, dtypes.bfloat16, dtypes.float16)


def _dense_floats(name: str, xs: Sequence) -> None:
  dev = xs[0].device if xs else None
  for x in xs:  # tensors or, under a capture, Avals
    d = x.device
    if x.dtype not in _FLOATS or d is not dev and d != dev:
      raise TypeError(f"{name}: expected float32, bfloat16 or float16 tensors on one device, got {x.dtype.name} on "
                      f"{x.device} (first: {xs[0].dtype.name} on {xs[0].device})")


def _adamw_rule(*xs, n, beta1, beta2, eps, weight_decay, clip=None):
  params, grads, exp_avgs, exp_avg_sqs, steps = (xs[k * n:(k + 1) * n] for k in range(5))
  if len(xs) != 5 * n + 1 + bool(clip):
    raise ValueError(f"adamw: expected 5 * {n} tensors, the learning rate{' and the clip factor' if clip else ''}, "
                     f"got {len(xs)}")
  if clip: _scale_rule(*grads, xs[-1])
  _dense_floats("adamw", [*params, *grads])
  for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
    if not (p.shape == g.shape == m.shape == v.shape) or not (p.dtype is m.dtype is v.dtype) or \
       s.shape != () or s.dtype is not dtypes.float64:
      raise ValueError(f"adamw: a parameter {p.dtype.name}{list(p.shape)} needs a gradient of its shape, moments of its "
                       f"shape and dtype and a float64 0-d step; got {g.dtype.name}{list(g.shape)}, "
                       f"{m.dtype.name}{list(m.shape)}, {v.dtype.name}{list(v.shape)}, step {s.dtype.name}{list(s.shape)}")
  return [(t.shape, t.dtype) for t in (*params, *exp_avgs, *exp_avg_sqs, *steps)]


# With `clip` a last operand, a 0-d float32 factor, scales each gradient as it is read (rounded to the gradient's dtype,
# as `scale` stores it): Nova folds clip_grad_norm_'s scale into the update when the scaled gradients are read by
# nothing else (passes/fuse_norms.py).
adamw_op = op("adamw", _adamw_rule, multi=True, inputs="*xs",
              attrs="n:int beta1:float beta2:float eps:float weight_decay:float clip:bool?")


def adamw_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
           exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor], lr: float | Tensor, *, beta1: float, beta2: float,
           eps: float, weight_decay: float) -> None:
  """AdamW's step on every parameter at once, in place (PyTorch's update, decoupled weight decay):

    step += 1;  p *= 1 - lr * weight_decay
    m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g^2
    p += -lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)

  `lr` is a number or a 0-d float64 tensor (Nova makes a scheduled learning rate one)."""
  if not params: return
  lr_t = lr if isinstance(lr, Tensor) else scalar_operand(float(lr), dtypes.float64, params[0].device)
  into = [*params, *exp_avgs, *exp_avg_sqs, *steps]
  new = adamw_op(*params, *grads, *exp_avgs, *exp_avg_sqs, *steps, lr_t, into=into, n=len(params), beta1=float(beta1),
                 beta2=float(beta2), eps=float(eps), weight_decay=float(weight_decay))
  if new is not into:
    for t, v in zip(into, new): write(t, v)


def _sgd_rule(*xs, n, momentum, dampening, weight_decay, nesterov, maximize, is_first_step, clip=None):
  k = 3 if momentum != 0 else 2
  if len(xs) != k * n + 1 + bool(clip):
    raise ValueError(f"sgd: expected {k} * {n} tensors (params, grads{', momentum buffers' if k == 3 else ''}), the "
                     f"learning rate{' and the clip factor' if clip else ''}, got {len(xs)}")
  if clip: _scale_rule(*xs[n:2 * n], xs[-1])
  params, grads, bufs = xs[:n], xs[n:2 * n], xs[2 * n:k * n]
  _dense_floats("sgd", [*params, *grads])
  for p, g, b in zip(params, grads, bufs or params):
    if not p.shape == g.shape == b.shape or b.dtype is not p.dtype:
      raise ValueError(f"sgd: a parameter {p.dtype.name}{list(p.shape)} needs a gradient of its shape and a momentum "
                       f"buffer of its shape and dtype; got {g.dtype.name}{list(g.shape)}, "
                       f"{b.dtype.name}{list(b.shape)}")
  lr = xs[k * n]
  if lr.shape != () or lr.dtype is not dtypes.float64:
    raise ValueError(f"sgd: the learning rate must be a 0-d float64 tensor, got {lr.dtype.name}{list(lr.shape)}")
  return [(t.shape, t.dtype) for t in (*params, *bufs)]


# `clip` as adamw's: a last 0-d float32 operand that scales each gradient as it is read (passes/fuse_norms.py).
sgd_op = op("sgd", _sgd_rule, multi=True, inputs="*xs",
            attrs="n:int momentum:float dampening:float weight_decay:float nesterov:bool maximize:bool "
                  "is_first_step:bool clip:bool?")


def sgd_(params: Sequence[Tensor], grads: Sequence[Tensor], momentum_buffers: Sequence[Tensor], lr: float | Tensor, *,
         momentum: float, dampening: float, weight_decay: float, nesterov: bool, maximize: bool,
         is_first_step: bool = False) -> None:
  """SGD's step on every parameter at once, in place (PyTorch's update, `optim.SGD` documents it): with
  g = grad (negated when `maximize`) + weight_decay * p,

    b = g (is_first_step) or momentum * b + (1 - dampening) * g;  g = g + momentum * b (nesterov) or b
    p += -lr * g

  the buffers only when momentum != 0 (pass none otherwise); with `is_first_step` their values are not read (PyTorch
  starts the buffer as a copy of g). `lr` is a number or a 0-d tensor (Nova makes a scheduled learning rate a float64
  one; another floating dtype is widened to it, exactly)."""
  if not params: return
  bufs = list(momentum_buffers) if momentum != 0 else []
  if momentum != 0 and len(bufs) != len(params):
    raise ValueError(f"sgd_: momentum {momentum} needs a buffer per parameter, got {len(bufs)} for {len(params)}")
  if isinstance(lr, Tensor): lr_t = lr if lr.dtype is dtypes.float64 else lr.double()
  else: lr_t = scalar_operand(float(lr), dtypes.float64, params[0].device)
  into = [*params, *bufs]
  new = sgd_op(*params, *grads, *bufs, lr_t, into=into, n=len(params), momentum=float(momentum),
               dampening=float(dampening), weight_decay=float(weight_decay), nesterov=bool(nesterov),
               maximize=bool(maximize), is_first_step=bool(is_first_step))
  if new is not into:
    for t, v in zip(into, new): write(t, v)


def _sum_squares_rule(*xs):
  _dense_floats("sum_squares", xs)
  return (), dtypes.float32


sum_squares_op = op("sum_squares", _sum_squares_rule, inputs="*xs")


def sum_squares(xs: Sequence[Tensor]) -> Tensor:
  """The float32 sum of the squares of every element of every tensor (the squared 2-norm of all together)."""
  return sum_squares_op(*xs)


def _scale_rule(*xs):
  _dense_floats("scale", xs[:-1])
  if xs[-1].shape != () or xs[-1].dtype is not dtypes.float32:
    raise ValueError(f"scale: the factor must be a 0-d float32 tensor, got {xs[-1].dtype.name}{list(xs[-1].shape)}")
  return [(x.shape, x.dtype) for x in xs[:-1]]


scale_op = op("scale", _scale_rule, multi=True, inputs="*xs")


def scale_(xs: Sequence[Tensor], factor: Tensor) -> None:
  """xs[i] *= factor (a 0-d tensor) for every tensor, in place, in their own dtypes."""
  if not xs: return
  into = list(xs)
  new = scale_op(*into, factor, into=into)
  if new is not into:
    for t, v in zip(into, new): write(t, v)
