"""Adam and AdamW."""
from __future__ import annotations

from typing import Any

from blutrain import dtypes, ops
from blutrain.optim.optimizer import Optimizer, ParamsT, multi_tensor_ready
from blutrain.tensor import Tensor


class Adam(Optimizer):
  """Adam, as `torch.optim.Adam`, with PyTorch's update at step t (g negated first when `maximize`):

    p = p * (1 - lr * weight_decay) (decoupled) or g = g + weight_decay * p (otherwise)
    m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g^2;  (amsgrad: v_max = max(v_max, v), used for v)
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

  State per parameter: `step` (a 0-d float64 tensor, as PyTorch's), `exp_avg`, `exp_avg_sq` and, with amsgrad,
  `max_exp_avg_sq`, in the parameter's dtype.

  Args:
    params: parameters or parameter groups.
    lr: learning rate.
    betas: decay rates of the first and second moment averages.
    eps: added to the denominator.
    weight_decay: L2 penalty (added to the gradient) or, with `decoupled_weight_decay`, AdamW's decay.
    amsgrad: use the maximum of past second moments.
    maximize: ascend instead of descend.
    foreach: accepted for PyTorch compatibility.
    fused: unless False, a group of dense floating parameters is updated by one multi-tensor op (`ops.adamw_`: one
      kernel launch for the whole group on CUDA; the same float32 operations, in the same order, as the
      per-parameter update below, which stays the reference and runs otherwise: with amsgrad or maximize, Adam's
      coupled weight decay, or strided parameters).
    decoupled_weight_decay: decay the parameter directly (AdamW) instead of adding to the gradient.
  """

  def __init__(self, params: ParamsT, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 0, amsgrad: bool = False, *, foreach: bool | None = None, maximize: bool = False,
               fused: bool | None = None, decoupled_weight_decay: bool = False) -> None:
    if lr < 0.0: raise ValueError(f"Invalid learning rate: {lr}")
    if eps < 0.0: raise ValueError(f"Invalid epsilon value: {eps}")
    for i, beta in enumerate(betas):
      if not 0.0 <= beta < 1.0: raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
    if weight_decay < 0.0: raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if fused and foreach: raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                  maximize=maximize, foreach=foreach, fused=fused,
                                  decoupled_weight_decay=decoupled_weight_decay))

  @staticmethod
  def _init_state(p: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
    if state: return
    state["step"] = ops.zeros((), dtype=dtypes.float64, device=p.device)
    state["exp_avg"], state["exp_avg_sq"] = ops.zeros_like(p), ops.zeros_like(p)
    if group["amsgrad"]: state["max_exp_avg_sq"] = ops.zeros_like(p)

  def _step_group(self, group: dict[str, Any]) -> None:
    if not self._fusable(group): return super()._step_group(group)
    params = [p for p in group["params"] if p.grad is not None]
    states = [self.state[p] for p in params]
    for p, state in zip(params, states):
      if not state: self._init_state(p, state, group)
    grads, exp_avgs = [p.grad for p in params], [s["exp_avg"] for s in states]
    exp_avg_sqs = [s["exp_avg_sq"] for s in states]
    if not multi_tensor_ready(params, grads, exp_avgs, exp_avg_sqs): return super()._step_group(group)
    (beta1, beta2), device = group["betas"], params[0].device
    ops.adamw_(params, grads, exp_avgs, exp_avg_sqs, [s["step"] for s in states],
               ops.dynamic_scalar(lambda: group["lr"], device), beta1=beta1, beta2=beta2, eps=group["eps"],
               weight_decay=group["weight_decay"])

  @staticmethod
  def _fusable(group: dict[str, Any]) -> bool:
    """Whether `ops.adamw_` can update the group, as far as its hyperparameters tell: AdamW's update (the parameters
    and gradients are checked by `multi_tensor_ready`)."""
    return (group["fused"] is not False and not group["amsgrad"] and not group["maximize"]
            and (group["decoupled_weight_decay"] or group["weight_decay"] == 0))

  def _update(self, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
    (beta1, beta2), weight_decay = group["betas"], group["weight_decay"]
    lr = ops.dynamic_scalar(lambda: group["lr"], p.device)
    self._init_state(p, state, group)
    if group["maximize"]: grad = -grad
    step = state["step"].add_(1)
    if weight_decay != 0:
      if group["decoupled_weight_decay"]: p.mul_(1 - lr * weight_decay)
      else: grad = grad.add(p, alpha=weight_decay)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    if group["amsgrad"]:
      exp_avg_sq = state["max_exp_avg_sq"].copy_(ops.maximum(state["max_exp_avg_sq"], exp_avg_sq))
    # NOTE: bias corrections from a float64 step tensor: as exact as PyTorch's Python floats, and a graph input
    # (not a constant) when the step is compiled
    bias_correction1, bias_correction2 = 1 - beta1 ** step, 1 - beta2 ** step
    denom = (exp_avg_sq.sqrt() / bias_correction2.sqrt()).add_(group["eps"])
    p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


class AdamW(Adam):
  """AdamW, as `torch.optim.AdamW`: Adam with decoupled weight decay, p = p * (1 - lr * weight_decay) before the
  Adam step (the decay skips the moment estimates). Arguments as Adam's; weight_decay defaults to 1e-2.

  Example:
    >>> opt = optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
  """

  def __init__(self, params: ParamsT, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
               foreach: bool | None = None, fused: bool | None = None) -> None:
    super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize, fused=fused,
                     decoupled_weight_decay=True)
