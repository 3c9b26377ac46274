"""Loss modules: each holds its options (and class weights as buffers) and calls its `nn.functional` loss."""
from __future__ import annotations

from blutrain.nn import functional as F
from blutrain.nn.module import Module
from blutrain.tensor import Tensor


class _Loss(Module):
  """A loss with PyTorch's `reduction` ("mean", "sum" or "none"); the legacy size_average/reduce flags override it."""
  reduction: str

  def __init__(self, size_average: bool | None = None, reduce: bool | None = None, reduction: str = "mean") -> None:
    super().__init__()
    self.reduction = F._reduction(size_average, reduce, reduction)


class _WeightedLoss(_Loss):
  """A loss with a weight per class, kept as a buffer (so it follows `.to()` and appears in the state dict)."""

  def __init__(self, weight: Tensor | None = None, size_average: bool | None = None, reduce: bool | None = None,
               reduction: str = "mean") -> None:
    super().__init__(size_average, reduce, reduction)
    self.register_buffer("weight", weight)


class L1Loss(_Loss):
  """Mean absolute error |input - target|, reduced."""
  def forward(self, input: Tensor, target: Tensor) -> Tensor: return F.l1_loss(input, target, reduction=self.reduction)


class MSELoss(_Loss):
  """Mean squared error (input - target)^2, reduced."""
  def forward(self, input: Tensor, target: Tensor) -> Tensor: return F.mse_loss(input, target, reduction=self.reduction)


class SmoothL1Loss(_Loss):
  """0.5 d^2 / beta for d = |input - target| < beta, d - 0.5 beta elsewhere."""

  def __init__(self, size_average=None, reduce=None, reduction: str = "mean", beta: float = 1.0) -> None:
    super().__init__(size_average, reduce, reduction)
    self.beta = beta

  def forward(self, input: Tensor, target: Tensor) -> Tensor:
    return F.smooth_l1_loss(input, target, reduction=self.reduction, beta=self.beta)


class HuberLoss(_Loss):
  """0.5 d^2 for d = |input - target| < delta, delta (d - 0.5 delta) elsewhere."""

  def __init__(self, reduction: str = "mean", delta: float = 1.0) -> None:
    super().__init__(reduction=reduction)
    self.delta = delta

  def forward(self, input: Tensor, target: Tensor) -> Tensor:
    return F.huber_loss(input, target, reduction=self.reduction, delta=self.delta)


class NLLLoss(_WeightedLoss):
  """Negative log-likelihood of log-probabilities (N, C) or (N, C, d...) at class indices."""

  def __init__(self, weight: Tensor | None = None, size_average=None, ignore_index: int = -100, reduce=None,
               reduction: str = "mean") -> None:
    super().__init__(weight, size_average, reduce, reduction)
    self.ignore_index = ignore_index

  def forward(self, input: Tensor, target: Tensor) -> Tensor:
    return F.nll_loss(input, target, self.weight, ignore_index=self.ignore_index, reduction=self.reduction)


class CrossEntropyLoss(_WeightedLoss):
  """Softmax cross-entropy of logits against class indices or probabilities (see `F.cross_entropy`).

  Args:
    weight: a weight per class (C,).
    ignore_index: a target index that counts neither in the loss nor in the mean.
    reduction: "mean", "sum" or "none".
    label_smoothing: mix the targets with the uniform distribution by this amount.

  Shape: input (C,), (N, C) or (N, C, d...); target (), (N,) or (N, d...) of indices, or the input's shape of
  probabilities; output a scalar, or the target's shape with reduction="none".
  """

  def __init__(self, weight: Tensor | None = None, size_average=None, ignore_index: int = -100, reduce=None,
               reduction: str = "mean", label_smoothing: float = 0.0) -> None:
    super().__init__(weight, size_average, reduce, reduction)
    self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

  def forward(self, input: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(input, target, self.weight, ignore_index=self.ignore_index, reduction=self.reduction,
                           label_smoothing=self.label_smoothing)


class BCELoss(_WeightedLoss):
  """Binary cross-entropy of probabilities: -(t log p + (1 - t) log(1 - p)), each log clamped to >= -100."""

  def forward(self, input: Tensor, target: Tensor) -> Tensor:
    return F.binary_cross_entropy(input, target, self.weight, reduction=self.reduction)


class BCEWithLogitsLoss(_Loss):
  """Binary cross-entropy of logits, computed stably; `pos_weight` (per class, broadcast along the last dim)
  weighs the positive term."""

  def __init__(self, weight: Tensor | None = None, size_average=None, reduce=None, reduction: str = "mean",
               pos_weight: Tensor | None = None) -> None:
    super().__init__(size_average, reduce, reduction)
    self.register_buffer("weight", weight)
    self.register_buffer("pos_weight", pos_weight)

  def forward(self, input: Tensor, target: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(input, target, self.weight, reduction=self.reduction,
                                              pos_weight=self.pos_weight)


class KLDivLoss(_Loss):
  """KL divergence of log-probabilities `input` from `target` (probabilities, or log-probabilities with log_target);
  reduction "batchmean" gives the mathematical KL divergence per batch item."""

  def __init__(self, size_average=None, reduce=None, reduction: str = "mean", log_target: bool = False) -> None:
    super().__init__(size_average, reduce, reduction)
    self.log_target = log_target

  def forward(self, input: Tensor, target: Tensor) -> Tensor:
    return F.kl_div(input, target, reduction=self.reduction, log_target=self.log_target)
