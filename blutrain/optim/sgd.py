"""Stochastic gradient descent with momentum, dampening, Nesterov momentum and weight decay."""
from __future__ import annotations

from typing import Any

from blutrain import ops
from blutrain.optim.optimizer import Optimizer, ParamsT, multi_tensor_ready
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
    foreach, fused: unless either is False, a group of dense floating parameters is updated by one multi-tensor op
      (`ops.sgd_`: one kernel launch for the whole group on CUDA; the same float32 operations, in the same order, as
      the per-parameter update below, which stays the reference and runs otherwise: with strided parameters or
      buffers, float64 or integer parameters, or parameters on several devices). The op keeps the momentum buffers
      in the parameter's dtype.
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

  def _step_group(self, group: dict[str, Any]) -> None:
    if group["foreach"] is False or group["fused"] is False: return super()._step_group(group)
    params = [p for p in group["params"] if p.grad is not None]
    grads, momentum = [p.grad for p in params], group["momentum"]
    states = [self.state[p] for p in params]
    bufs = [s.get("momentum_buffer") for s in states] if momentum != 0 else [None] * len(params)
    if not multi_tensor_ready(params, grads, bufs): return super()._step_group(group)
    lr = ops.dynamic_scalar(lambda: group["lr"], params[0].device)
    kw = {k: group[k] for k in ("momentum", "dampening", "weight_decay", "nesterov", "maximize")}
    if momentum == 0: return ops.sgd_(params, grads, [], lr, **kw)
    new = [i for i, b in enumerate(bufs) if b is None]
    if not new: return ops.sgd_(params, grads, bufs, lr, **kw, is_first_step=False)
    # the parameters with a buffer, then those stepped for the first time
    for first, todo in ((False, [i for i, b in enumerate(bufs) if b is not None]), (True, new)):
      if not todo: continue
      if first:  # PyTorch's first buffer is a copy of the gradient: the op writes it, reading nothing here
        for i in todo: states[i]["momentum_buffer"] = ops.zeros_like(params[i])
      ops.sgd_([params[i] for i in todo], [grads[i] for i in todo], [states[i]["momentum_buffer"] for i in todo], lr,
               **kw, is_first_step=first)

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
