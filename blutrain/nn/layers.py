"""Layers: Linear, Embedding, LayerNorm, RMSNorm, Dropout and the activations.

A layer owns its parameters and their initialization (`reset_parameters`); its `forward` is one call to
`nn.functional`, where the math is.
"""
from __future__ import annotations

from typing import Callable

from blutrain import ops
from blutrain.nn import functional as F, init
from blutrain.nn.module import Module, Parameter
from blutrain.tensor import Tensor


class Identity(Module):
  """Returns its input unchanged; extra constructor arguments are ignored, as in PyTorch."""

  def __init__(self, *args, **kwargs) -> None: super().__init__()
  def forward(self, input: Tensor) -> Tensor: return input


class Linear(Module):
  """y = x W^T + b.

  Args:
    in_features: size of each input sample.
    out_features: size of each output sample.
    bias: if False, no additive bias (registered as None).

  Shape: input (*, in_features), output (*, out_features).

  Attributes:
    weight: (out_features, in_features), from U(-1/sqrt(in_features), 1/sqrt(in_features)).
    bias: (out_features,), from the same distribution.

  Example:
    >>> m = nn.Linear(20, 30)
    >>> m(bt.randn(128, 20)).shape
    (128, 30)
  """
  in_features: int
  out_features: int
  weight: Parameter

  def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None) -> None:
    super().__init__()
    self.in_features, self.out_features = in_features, out_features
    self.weight = Parameter(ops.empty(out_features, in_features, device=device, dtype=dtype))
    if bias: self.bias = Parameter(ops.empty(out_features, device=device, dtype=dtype))
    else: self.register_parameter("bias", None)
    self.reset_parameters()

  def reset_parameters(self) -> None: init.layer_default_(self.weight, self.bias)

  def forward(self, input: Tensor) -> Tensor: return F.linear(input, self.weight, self.bias)

  def extra_repr(self) -> str:
    return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
  """A lookup table: row i of `weight` is the vector of index i.

  Args:
    num_embeddings: size of the table.
    embedding_dim: size of each vector.
    padding_idx: if given, that row starts at zero and receives no gradient.

  Shape: input (*) integer indices, output (*, embedding_dim).

  Attributes:
    weight: (num_embeddings, embedding_dim), from N(0, 1).
  """
  num_embeddings: int
  embedding_dim: int
  padding_idx: int | None
  weight: Parameter

  def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, device=None,
               dtype=None) -> None:
    super().__init__()
    if padding_idx is not None:
      if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(f"Embedding: padding_idx {padding_idx} must be within num_embeddings ({num_embeddings})")
      padding_idx %= num_embeddings
    self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
    self.weight = Parameter(ops.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
    self.reset_parameters()

  def reset_parameters(self) -> None:
    init.normal_(self.weight)
    if self.padding_idx is not None:
      with ops.no_grad(): self.weight[self.padding_idx] = 0.0

  def forward(self, input: Tensor) -> Tensor: return F.embedding(input, self.weight, self.padding_idx)

  def extra_repr(self) -> str:
    s = f"{self.num_embeddings}, {self.embedding_dim}"
    return s + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else "")


def _shape(normalized_shape) -> tuple[int, ...]:
  return (int(normalized_shape),) if isinstance(normalized_shape, int) else tuple(normalized_shape)


class LayerNorm(Module):
  """y = (x - E[x]) / sqrt(Var[x] + eps) * weight + bias over the trailing `normalized_shape` dims.

  Args:
    normalized_shape: the trailing shape to normalize over (an int for the last dim).
    eps: added to the variance.
    elementwise_affine: learn `weight` (ones) and, with `bias=True`, `bias` (zeros).

  Shape: input (*, *normalized_shape), output the same.
  """
  normalized_shape: tuple[int, ...]
  eps: float
  elementwise_affine: bool

  def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
               device=None, dtype=None) -> None:
    super().__init__()
    self.normalized_shape, self.eps, self.elementwise_affine = _shape(normalized_shape), eps, elementwise_affine
    if elementwise_affine:
      self.weight = Parameter(ops.empty(self.normalized_shape, device=device, dtype=dtype))
      if bias: self.bias = Parameter(ops.empty(self.normalized_shape, device=device, dtype=dtype))
      else: self.register_parameter("bias", None)
    else:
      self.register_parameter("weight", None)
      self.register_parameter("bias", None)
    self.reset_parameters()

  def reset_parameters(self) -> None:
    if self.weight is not None: init.ones_(self.weight)
    if self.bias is not None: init.zeros_(self.bias)

  def forward(self, input: Tensor) -> Tensor:
    return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

  def extra_repr(self) -> str:
    return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"bias={self.bias is not None}")


class RMSNorm(Module):
  """y = x / sqrt(mean(x^2) + eps) * weight over the trailing `normalized_shape` dims.

  Args:
    normalized_shape: the trailing shape to normalize over.
    eps: added to the mean square; None means the input dtype's machine epsilon, as in PyTorch.
    elementwise_affine: learn `weight` (ones).
  """
  normalized_shape: tuple[int, ...]
  eps: float | None
  elementwise_affine: bool

  def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True, device=None,
               dtype=None) -> None:
    super().__init__()
    self.normalized_shape, self.eps, self.elementwise_affine = _shape(normalized_shape), eps, elementwise_affine
    if elementwise_affine: self.weight = Parameter(ops.empty(self.normalized_shape, device=device, dtype=dtype))
    else: self.register_parameter("weight", None)
    self.reset_parameters()

  def reset_parameters(self) -> None:
    if self.weight is not None: init.ones_(self.weight)

  def forward(self, input: Tensor) -> Tensor: return F.rms_norm(input, self.normalized_shape, self.weight, self.eps)

  def extra_repr(self) -> str:
    return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class Dropout(Module):
  """In training, zero each element with probability p and scale the rest by 1/(1-p); identity in eval mode.

  `inplace` is accepted for PyTorch compatibility; the output is always a new tensor.
  """
  p: float

  def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
    super().__init__()
    if not 0.0 <= p <= 1.0: raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    self.p, self.inplace = p, inplace

  def forward(self, input: Tensor) -> Tensor: return F.dropout(input, self.p, self.training)
  def extra_repr(self) -> str: return f"p={self.p}, inplace={self.inplace}"


class GELU(Module):
  """GELU(x) = x * Phi(x), or its tanh approximation with approximate='tanh'."""

  def __init__(self, approximate: str = "none") -> None:
    super().__init__()
    self.approximate = approximate

  def forward(self, input: Tensor) -> Tensor: return F.gelu(input, approximate=self.approximate)
  def extra_repr(self) -> str: return f"approximate={self.approximate!r}"


class SiLU(Module):
  """SiLU(x) = x * sigmoid(x)."""
  def forward(self, input: Tensor) -> Tensor: return F.silu(input)


class ReLU(Module):
  """ReLU(x) = max(0, x)."""
  def forward(self, input: Tensor) -> Tensor: return F.relu(input)


class Tanh(Module):
  """Tanh(x) = tanh(x)."""
  def forward(self, input: Tensor) -> Tensor: return F.tanh(input)


class Sigmoid(Module):
  """Sigmoid(x) = 1 / (1 + exp(-x))."""
  def forward(self, input: Tensor) -> Tensor: return F.sigmoid(input)


class Softmax(Module):
  """Softmax(x)_i = exp(x_i) / sum_j exp(x_j) along `dim`."""

  def __init__(self, dim: int | None = None) -> None:
    super().__init__()
    self.dim = dim

  def forward(self, input: Tensor) -> Tensor: return F.softmax(input, _implicit_dim(self, input))
  def extra_repr(self) -> str: return f"dim={self.dim}"


class LogSoftmax(Softmax):
  """LogSoftmax(x) = x - logsumexp(x) along `dim`."""
  def forward(self, input: Tensor) -> Tensor: return F.log_softmax(input, _implicit_dim(self, input))


class Softmin(Softmax):
  """Softmin(x) = Softmax(-x) along `dim`."""
  def forward(self, input: Tensor) -> Tensor: return F.softmin(input, _implicit_dim(self, input))


def _implicit_dim(m: Softmax, input: Tensor) -> int:
  """PyTorch's legacy choice when `dim` is None: dim 0 for 0-, 1- and 3-d inputs, else dim 1."""
  if m.dim is not None: return m.dim
  return 0 if input.ndim in (0, 1, 3) else 1


class _Activation(Module):
  """An activation with keyword options: `forward` calls the subclass's `fn(input, **options)`."""
  fn: Callable[..., Tensor]

  def __init__(self, **options) -> None:
    super().__init__()
    self._options = options
    for k, v in options.items(): setattr(self, k, v)

  def forward(self, input: Tensor) -> Tensor: return type(self).fn(input, **{k: getattr(self, k) for k in self._options})
  def extra_repr(self) -> str: return ", ".join(f"{k}={getattr(self, k)}" for k in self._options if k != "inplace")


class LeakyReLU(_Activation):
  """LeakyReLU(x) = x for x > 0, negative_slope * x otherwise."""
  fn = staticmethod(F.leaky_relu)
  def __init__(self, negative_slope: float = 0.01, inplace: bool = False) -> None:
    super().__init__(negative_slope=negative_slope, inplace=inplace)


class ELU(_Activation):
  """ELU(x) = x for x > 0, alpha * (exp(x) - 1) otherwise."""
  fn = staticmethod(F.elu)
  def __init__(self, alpha: float = 1.0, inplace: bool = False) -> None: super().__init__(alpha=alpha, inplace=inplace)


class CELU(_Activation):
  """CELU(x) = max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""
  fn = staticmethod(F.celu)
  def __init__(self, alpha: float = 1.0, inplace: bool = False) -> None: super().__init__(alpha=alpha, inplace=inplace)


class SELU(_Activation):
  """SELU(x) = scale * ELU(x, alpha) with the self-normalizing constants."""
  fn = staticmethod(F.selu)
  def __init__(self, inplace: bool = False) -> None: super().__init__(inplace=inplace)


class Hardtanh(_Activation):
  """Hardtanh(x) = x clamped to [min_val, max_val]."""
  fn = staticmethod(F.hardtanh)
  def __init__(self, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False) -> None:
    super().__init__(min_val=min_val, max_val=max_val, inplace=inplace)


class ReLU6(_Activation):
  """ReLU6(x) = min(max(0, x), 6)."""
  fn = staticmethod(F.relu6)
  def __init__(self, inplace: bool = False) -> None: super().__init__(inplace=inplace)


class Hardsigmoid(_Activation):
  """Hardsigmoid(x) = clamp(x / 6 + 1/2, 0, 1)."""
  fn = staticmethod(F.hardsigmoid)
  def __init__(self, inplace: bool = False) -> None: super().__init__(inplace=inplace)


class Hardswish(_Activation):
  """Hardswish(x) = x * Hardsigmoid(x)."""
  fn = staticmethod(F.hardswish)
  def __init__(self, inplace: bool = False) -> None: super().__init__(inplace=inplace)


class Mish(_Activation):
  """Mish(x) = x * tanh(softplus(x))."""
  fn = staticmethod(F.mish)
  def __init__(self, inplace: bool = False) -> None: super().__init__(inplace=inplace)


class Softplus(_Activation):
  """Softplus(x) = log(1 + exp(beta * x)) / beta, x where beta * x > threshold."""
  fn = staticmethod(F.softplus)
  def __init__(self, beta: float = 1.0, threshold: float = 20.0) -> None: super().__init__(beta=beta, threshold=threshold)


class Softsign(_Activation):
  """Softsign(x) = x / (1 + |x|)."""
  fn = staticmethod(F.softsign)


class LogSigmoid(_Activation):
  """LogSigmoid(x) = log(1 / (1 + exp(-x)))."""
  fn = staticmethod(F.logsigmoid)


class Flatten(Module):
  """Flattens dims start_dim..end_dim into one. Shape: (N, *dims) -> (N, prod(dims)) by default."""

  def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
    super().__init__()
    self.start_dim, self.end_dim = start_dim, end_dim

  def forward(self, input: Tensor) -> Tensor: return input.flatten(self.start_dim, self.end_dim)
  def extra_repr(self) -> str: return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


class Unflatten(Module):
  """Splits dim `dim` into `unflattened_size`. Shape: (*, prod(sizes), *) -> (*, *sizes, *)."""

  def __init__(self, dim: int, unflattened_size) -> None:
    super().__init__()
    if not isinstance(unflattened_size, (tuple, list)) or not all(isinstance(s, int) for s in unflattened_size):
      raise TypeError(f"unflattened_size must be a tuple of ints, but found type {type(unflattened_size).__name__}")
    self.dim, self.unflattened_size = dim, tuple(unflattened_size)

  def forward(self, input: Tensor) -> Tensor: return input.unflatten(self.dim, self.unflattened_size)
  def extra_repr(self) -> str: return f"dim={self.dim}, unflattened_size={self.unflattened_size}"
