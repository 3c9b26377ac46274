"""`nn.utils`: gradient clipping."""
from __future__ import annotations

from typing import Iterable

from blutrain import dtypes, ops, shapes
from blutrain.ops import no_grad
from blutrain.tensor import Tensor


def _vector_norm(x: Tensor, norm_type: float) -> Tensor:
  """The p-norm of all of x's entries, accumulated in float32 at least (a bfloat16 sum of squares loses the total)."""
  return ops.norm(x if x.dtype is dtypes.float64 else x.float(), norm_type)


def _grads(parameters: Tensor | Iterable[Tensor]) -> list[Tensor]:
  params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
  return [p.grad for p in params if p.grad is not None]


def clip_grad_norm_(parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:
  """Scale the gradients so that their joint norm is at most max_norm: g *= min(1, max_norm / (total + 1e-6)).

  The norm is over all gradients together, as if concatenated into one vector. The scale is applied as a tensor
  (no host sync), so gradients are always multiplied, by 1 when under the limit. `foreach` is accepted for
  PyTorch compatibility; the result is the same either way.

  Args:
    parameters: a tensor or an iterable of tensors whose `.grad` is clipped (those without one are skipped).
    max_norm: the largest allowed norm.
    norm_type: p of the p-norm; `math.inf` for the largest absolute value.
    error_if_nonfinite: raise RuntimeError when the total norm is nan or inf (this one check syncs with the host).

  Returns:
    The total norm of the gradients before clipping, a float32 (float64 for float64 gradients) 0-d tensor.
  """
  grads, norm_type = _grads(parameters), float(norm_type)
  if not grads: return ops.zeros(())
  device = grads[0].device
  fused = norm_type == 2 and _multi_tensor(grads)
  if fused:
    total = ops.sum_squares(grads).sqrt()
  else:
    norms = [_vector_norm(g, norm_type).to(device) for g in grads]
    total = _vector_norm(ops.stack([n.to(norms[0].dtype) for n in norms]), norm_type)
  if error_if_nonfinite and not ops.isfinite(total).item():
    raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
                       "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                       "`error_if_nonfinite=False`")
  scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
  if fused:
    with no_grad(): ops.scale_(grads, scale)
    return total
  with no_grad():
    for g in grads: g.mul_(scale.to(g.device).to(g.dtype))
  return total


def _multi_tensor(grads: list[Tensor]) -> bool:
  """Whether the multi-tensor ops (`ops.sum_squares`, `ops.scale_`) take the gradients: dense (any memory order)
  float32/16 on one device."""
  d = grads[0].device
  return all(g.device == d and g.dtype in (dtypes.float32, dtypes.bfloat16, dtypes.float16)
             and shapes.is_dense(g.shape, g.stride()) for g in grads)


def clip_grad_value_(parameters: Tensor | Iterable[Tensor], clip_value: float, foreach: bool | None = None) -> None:
  """Clamp every gradient entry to [-clip_value, clip_value] in place."""
  with no_grad():
    for g in _grads(parameters): g.clamp_(-float(clip_value), float(clip_value))
