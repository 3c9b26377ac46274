"""Stochastic gradient descent with momentum, dampening, Nesterov momentum and weight decay."""
from __future__ import annotations

from typing import Any

from blutrain import ops
from blutrain.optim.optimizer import Optimizer, ParamsT
from blutrain.tensor import Tensor


class SGD(Optimizer):
  """SGD, as `torch.optim.SGD`: with g = grad + weight_decay * p (negated first when `maximize`),

    b = g (first step), b = momentum * b + (1 - dampening) * g (later steps)
    g = g + momentum * b (nesterov) or b (otherwise), when momentum != 0
    p = p - lr * g

  Args:
    params: parameters or parameter groups.
    lr: learning rate.
    momentum: momentum factor (0 disables the buffer).
    dampening: dampening of the momentum's gradient term.
    weight_decay: L2 penalty added to the gradient.
    nesterov: use Nesterov momentum (needs momentum > 0 and dampening 0).
    maximize: ascend instead of descend.
    foreach, fused: accepted for PyTorch compatibility; every setting runs the same per-parameter update.
  """

  def __init__(self, params: ParamsT, lr: float = 1e-3, momentum: float = 0, dampening: float = 0,
               weight_decay: float = 0, nesterov: bool = False, *, maximize: bool = False, foreach: bool | None = None,
               fused: bool | None = None) -> None:
    if lr < 0.0: raise ValueError(f"Invalid learning rate: {lr}")
    if momentum < 0.0: raise ValueError(f"Invalid momentum value: {momentum}")
    if weight_decay < 0.0: raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if nesterov and (momentum <= 0 or dampening != 0):
      raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    if fused and foreach: raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                  nesterov=nesterov, maximize=maximize, foreach=foreach, fused=fused))

  def _update(self, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
    momentum, weight_decay = group["momentum"], group["weight_decay"]
    if group["maximize"]: grad = -grad
    if weight_decay != 0: grad = grad.add(p, alpha=weight_decay)
    if momentum != 0:
      buf = state.get("momentum_buffer")
      if buf is None: buf = state["momentum_buffer"] = grad.clone()
      else: buf.mul_(momentum).add_(grad, alpha=1 - group["dampening"])
      grad = grad.add(buf, alpha=momentum) if group["nesterov"] else buf
    p.add_(grad, alpha=-ops.dynamic_scalar(lambda: group["lr"], p.device))
