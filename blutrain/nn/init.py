"""`nn.init`: in-place parameter initializers with PyTorch's names, arguments and scaling rules.

Each fills its tensor under no_grad through the tensor's own in-place methods and returns it.
"""
from __future__ import annotations

import math

from blutrain.ops import Generator, no_grad, randn
from blutrain.tensor import Tensor


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
  """The recommended gain for a nonlinearity: 1 (linear, sigmoid), 5/3 (tanh), sqrt(2) (relu),
  sqrt(2 / (1 + slope^2)) (leaky_relu, slope `param`, 0.01 by default), 3/4 (selu)."""
  if nonlinearity in ("linear", "identity", "sigmoid") or nonlinearity.startswith("conv"): return 1.0
  if nonlinearity == "tanh": return 5.0 / 3
  if nonlinearity == "relu": return math.sqrt(2.0)
  if nonlinearity == "leaky_relu":
    if param is None: slope = 0.01
    elif isinstance(param, (int, float)) and not isinstance(param, bool): slope = param
    else: raise ValueError(f"calculate_gain: negative_slope {param!r} is not a valid number")
    return math.sqrt(2.0 / (1 + slope ** 2))
  if nonlinearity == "selu": return 3.0 / 4
  raise ValueError(f"calculate_gain: unsupported nonlinearity {nonlinearity!r}")


def _calculate_fan_in_and_fan_out(tensor: Tensor) -> tuple[int, int]:
  """(fan_in, fan_out) = (size(1), size(0)) times the receptive field (the product of the dims after the second)."""
  if tensor.ndim < 2:
    raise ValueError(f"Fan in and fan out can not be computed for tensor with fewer than 2 dimensions (shape {tensor.shape})")
  receptive = math.prod(tensor.shape[2:])
  return tensor.shape[1] * receptive, tensor.shape[0] * receptive


def _fan(tensor: Tensor, mode: str) -> int:
  if mode not in ("fan_in", "fan_out"): raise ValueError(f"mode {mode!r} not supported, please use one of fan_in, fan_out")
  fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
  return fan_in if mode == "fan_in" else fan_out


def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0, generator: Generator | None = None) -> Tensor:
  """Fill with samples of U(a, b)."""
  with no_grad(): return tensor.uniform_(a, b, generator=generator)


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, generator: Generator | None = None) -> Tensor:
  """Fill with samples of N(mean, std^2)."""
  with no_grad(): return tensor.normal_(mean, std, generator=generator)


def constant_(tensor: Tensor, val: float) -> Tensor:
  """Fill with `val`."""
  with no_grad(): return tensor.fill_(val)


def zeros_(tensor: Tensor) -> Tensor: return constant_(tensor, 0.0)
def ones_(tensor: Tensor) -> Tensor: return constant_(tensor, 1.0)


def trunc_normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0,
                  generator: Generator | None = None) -> Tensor:
  """Fill with N(mean, std^2) samples restricted to [a, b], redrawing those outside until none is left."""
  if not a < b: raise ValueError(f"trunc_normal_: expected a < b, got a={a}, b={b}")
  with no_grad():
    tensor.normal_(mean, std, generator=generator)
    outside = (tensor < a) | (tensor > b)
    while outside.any().item():
      redraw = randn(tensor.shape, dtype=tensor.dtype, device=tensor.device, generator=generator) * std + mean
      tensor.copy_(tensor.where(~outside, redraw))
      outside = (tensor < a) | (tensor > b)
  return tensor


def xavier_uniform_(tensor: Tensor, gain: float = 1.0, generator: Generator | None = None) -> Tensor:
  """Glorot: U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out))."""
  fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
  a = math.sqrt(3.0) * gain * math.sqrt(2.0 / float(fan_in + fan_out))
  return uniform_(tensor, -a, a, generator)


def xavier_normal_(tensor: Tensor, gain: float = 1.0, generator: Generator | None = None) -> Tensor:
  """Glorot: N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out))."""
  fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
  return normal_(tensor, 0.0, gain * math.sqrt(2.0 / float(fan_in + fan_out)), generator)


def kaiming_uniform_(tensor: Tensor, a: float = 0, mode: str = "fan_in", nonlinearity: str = "leaky_relu",
                     generator: Generator | None = None) -> Tensor:
  """He: U(-bound, bound) with bound = gain * sqrt(3 / fan), gain = calculate_gain(nonlinearity, a)."""
  if 0 in tensor.shape: return tensor
  bound = math.sqrt(3.0) * calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode))
  return uniform_(tensor, -bound, bound, generator)


def kaiming_normal_(tensor: Tensor, a: float = 0, mode: str = "fan_in", nonlinearity: str = "leaky_relu",
                    generator: Generator | None = None) -> Tensor:
  """He: N(0, std^2) with std = gain / sqrt(fan), gain = calculate_gain(nonlinearity, a)."""
  if 0 in tensor.shape: return tensor
  return normal_(tensor, 0.0, calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode)), generator)


def layer_default_(weight: Tensor, bias: Tensor | None = None) -> None:
  """PyTorch's default initialization of linear and convolution layers: kaiming_uniform_ with a=sqrt(5), which gives
  U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and the bias uniform within the same bound (its long-standing default, see
  https://github.com/pytorch/pytorch/issues/57109)."""
  kaiming_uniform_(weight, a=math.sqrt(5))
  if bias is not None:
    fan_in, _ = _calculate_fan_in_and_fan_out(weight)
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    uniform_(bias, -bound, bound)
