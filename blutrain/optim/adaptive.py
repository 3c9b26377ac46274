"""RMSprop and Adagrad: per-coordinate steps scaled by a running (RMSprop) or total (Adagrad) sum of squared
gradients."""
from __future__ import annotations

from typing import Any

from blutrain import dtypes, ops
from blutrain.optim.optimizer import Optimizer, ParamsT
from blutrain.tensor import Tensor


class RMSprop(Optimizer):
  """RMSprop, as `torch.optim.RMSprop`: with g = grad + weight_decay * p (negated first when `maximize`),

    v = alpha * v + (1 - alpha) * g^2
    centered: m = lerp(m, g, 1 - alpha), avg = sqrt(v - m^2) + eps;  otherwise avg = sqrt(v) + eps
    momentum > 0: b = momentum * b + g / avg, p = p - lr * b;  otherwise p = p - lr * g / avg

  State per parameter: `step` (0-d float64), `square_avg`, and `momentum_buffer` (momentum > 0), `grad_avg`
  (centered).

  Args:
    params: parameters or parameter groups.
    lr: learning rate.
    alpha: smoothing constant of the squared-gradient average.
    eps: added to the denominator.
    weight_decay: L2 penalty added to the gradient.
    momentum: momentum factor.
    centered: normalize by the variance estimate (the squared average minus the squared mean gradient).
    maximize: ascend instead of descend.
    foreach: accepted for PyTorch compatibility.
  """

  def __init__(self, params: ParamsT, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8,
               weight_decay: float = 0, momentum: float = 0, centered: bool = False, capturable: bool = False,
               foreach: bool | None = None, maximize: bool = False, differentiable: bool = False) -> None:
    if lr < 0.0: raise ValueError(f"Invalid learning rate: {lr}")
    if eps < 0.0: raise ValueError(f"Invalid epsilon value: {eps}")
    if momentum < 0.0: raise ValueError(f"Invalid momentum value: {momentum}")
    if weight_decay < 0.0: raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if alpha < 0.0: raise ValueError(f"Invalid alpha value: {alpha}")
    super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                  centered=centered, capturable=capturable, foreach=foreach, maximize=maximize,
                                  differentiable=differentiable))

  def _update(self, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
    alpha, momentum = group["alpha"], group["momentum"]
    if not state:
      state["step"] = ops.zeros((), dtype=dtypes.float64, device=p.device)
      state["square_avg"] = ops.zeros_like(p)
      if momentum > 0: state["momentum_buffer"] = ops.zeros_like(p)
      if group["centered"]: state["grad_avg"] = ops.zeros_like(p)
    state["step"].add_(1)
    if group["maximize"]: grad = -grad
    if group["weight_decay"] != 0: grad = grad.add(p, alpha=group["weight_decay"])
    square_avg = state["square_avg"].mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
    if group["centered"]:
      grad_avg = state["grad_avg"].lerp_(grad, 1 - alpha)
      avg = (square_avg - grad_avg * grad_avg).sqrt_()
    else:
      avg = square_avg.sqrt()
    avg = avg.add_(group["eps"])
    lr = ops.dynamic_scalar(lambda: group["lr"], p.device)
    if momentum > 0:
      buf = state["momentum_buffer"].mul_(momentum).addcdiv_(grad, avg)
      p.add_(buf, alpha=-lr)
    else:
      p.addcdiv_(grad, avg, value=-lr)


class Adagrad(Optimizer):
  """Adagrad, as `torch.optim.Adagrad`: with g = grad + weight_decay * p (negated first when `maximize`) at step t,

    s = s + g^2;  p = p - lr / (1 + (t - 1) * lr_decay) * g / (sqrt(s) + eps)

  State per parameter, made at construction as PyTorch's: `step` (0-d float64) and `sum` (initial_accumulator_value).

  Args:
    params: parameters or parameter groups.
    lr: learning rate.
    lr_decay: learning-rate decay per step.
    weight_decay: L2 penalty added to the gradient.
    initial_accumulator_value: the starting value of the sum of squares.
    eps: added to the denominator.
    maximize: ascend instead of descend.
    foreach, fused: accepted for PyTorch compatibility.
  """

  def __init__(self, params: ParamsT, lr: float = 1e-2, lr_decay: float = 0, weight_decay: float = 0,
               initial_accumulator_value: float = 0, eps: float = 1e-10, foreach: bool | None = None, *,
               maximize: bool = False, differentiable: bool = False, fused: bool | None = None) -> None:
    if lr < 0.0: raise ValueError(f"Invalid learning rate: {lr}")
    if lr_decay < 0.0: raise ValueError(f"Invalid lr_decay value: {lr_decay}")
    if weight_decay < 0.0: raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if initial_accumulator_value < 0.0:
      raise ValueError(f"Invalid initial_accumulator_value value: {initial_accumulator_value}")
    if eps < 0.0: raise ValueError(f"Invalid epsilon value: {eps}")
    super().__init__(params, dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                                  initial_accumulator_value=initial_accumulator_value, foreach=foreach,
                                  maximize=maximize, differentiable=differentiable, fused=fused))
    for group in self.param_groups:
      for p in group["params"]:
        self.state[p] = {"step": ops.zeros((), dtype=dtypes.float64, device=p.device),
                         "sum": ops.full_like(p, group["initial_accumulator_value"])}

  def _update(self, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
    step = state["step"].add_(1)
    if group["maximize"]: grad = -grad
    if group["weight_decay"] != 0: grad = grad.add(p, alpha=group["weight_decay"])
    clr = ops.dynamic_scalar(lambda: group["lr"], p.device) / (1 + (step - 1) * group["lr_decay"])
    std = state["sum"].addcmul_(grad, grad, value=1).sqrt().add_(group["eps"])
    p.addcdiv_(grad, std, value=-clr)
