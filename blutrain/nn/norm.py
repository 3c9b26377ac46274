"""Batch and group normalization layers: BatchNorm1d, BatchNorm2d, BatchNorm3d (running statistics) and GroupNorm."""
from __future__ import annotations

from blutrain import dtypes, ops
from blutrain.nn import functional as F, init
from blutrain.nn.module import Module, Parameter
from blutrain.nn.spatial import batch_norm_counting
from blutrain.tensor import Tensor


def _affine_params(m: Module, n: int, affine: bool, bias: bool, device, dtype) -> None:
  """weight (n,) when affine, bias (n,) when affine and bias; the others registered as None."""
  m.register_parameter("weight", Parameter(ops.empty(n, device=device, dtype=dtype)) if affine else None)
  m.register_parameter("bias", Parameter(ops.empty(n, device=device, dtype=dtype)) if affine and bias else None)


class _BatchNorm(Module):
  """y = (x - E[x]) / sqrt(Var[x] + eps) * weight + bias per channel, as `torch.nn.BatchNorm*d`.

  In training the batch's statistics normalize and the running ones move toward them by `momentum` (None: a
  cumulative average over `num_batches_tracked`); in eval mode the running statistics normalize.

  Args:
    num_features: C of the (N, C, *) input.
    eps: added to the variance.
    momentum: the running statistics' update factor, or None for the cumulative average.
    affine: learn weight (ones) and, with `bias` (keyword-only, True), bias (zeros).
    track_running_stats: keep running_mean (zeros), running_var (ones) and num_batches_tracked buffers; without
      them the batch's statistics normalize in eval mode too.
  """
  _dims: tuple[int, ...]

  def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
               track_running_stats: bool = True, device=None, dtype=None, *, bias: bool = True) -> None:
    super().__init__()
    self.num_features, self.eps, self.momentum = num_features, eps, momentum
    self.affine, self.track_running_stats = affine, track_running_stats
    _affine_params(self, num_features, affine, bias, device, dtype)
    if track_running_stats:
      self.register_buffer("running_mean", ops.zeros(num_features, device=device, dtype=dtype))
      self.register_buffer("running_var", ops.ones(num_features, device=device, dtype=dtype))
      self.register_buffer("num_batches_tracked", ops.zeros((), dtype=dtypes.int64, device=device))
    else:
      for name in ("running_mean", "running_var", "num_batches_tracked"): self.register_buffer(name, None)
    self.reset_parameters()

  def reset_running_stats(self) -> None:
    if self.track_running_stats:
      with ops.no_grad():
        self.running_mean.zero_(); self.running_var.fill_(1.0); self.num_batches_tracked.zero_()

  def reset_parameters(self) -> None:
    self.reset_running_stats()
    if self.weight is not None: init.ones_(self.weight)
    if self.bias is not None: init.zeros_(self.bias)

  def forward(self, input: Tensor) -> Tensor:
    if input.ndim not in self._dims:
      raise ValueError(f"expected {' or '.join(f'{d}D' for d in self._dims)} input (got {input.ndim}D input)")
    factor, batches = (0.0 if self.momentum is None else self.momentum), None
    if self.training and self.track_running_stats:
      if self.momentum is None:  # the factor reads the count: it moves first
        with ops.no_grad(): self.num_batches_tracked.add_(1)
        factor = 1.0 / self.num_batches_tracked.to(dtypes.float64)
      else: batches = self.num_batches_tracked  # counted by the running statistics' kernel
    use_batch = self.training or self.running_mean is None
    track = not self.training or self.track_running_stats
    return batch_norm_counting(input, self.running_mean if track else None, self.running_var if track else None,
                               self.weight, self.bias, use_batch, factor, self.eps, batches)

  def extra_repr(self) -> str:
    return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"bias={self.bias is not None}, track_running_stats={self.track_running_stats}")


class BatchNorm1d(_BatchNorm):
  """Batch normalization of (N, C) or (N, C, L) inputs (see _BatchNorm)."""
  _dims = (2, 3)


class BatchNorm2d(_BatchNorm):
  """Batch normalization of (N, C, H, W) inputs (see _BatchNorm).

  Example:
    >>> bn = nn.BatchNorm2d(16)
    >>> bn(bt.randn(8, 16, 4, 4)).shape    # then bn.eval() normalizes with the running statistics
    (8, 16, 4, 4)
  """
  _dims = (4,)


class BatchNorm3d(_BatchNorm):
  """Batch normalization of (N, C, D, H, W) inputs (see _BatchNorm)."""
  _dims = (5,)


class GroupNorm(Module):
  """y = (x - E[x]) / sqrt(Var[x] + eps) * weight + bias, the statistics over each of num_groups groups of channels
  (and all spatial positions) of (N, C, *); weight and bias per channel (ones and zeros)."""

  def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True, device=None,
               dtype=None, *, bias: bool = True) -> None:
    super().__init__()
    if num_channels % num_groups: raise ValueError("num_channels must be divisible by num_groups")
    self.num_groups, self.num_channels, self.eps, self.affine = num_groups, num_channels, eps, affine
    _affine_params(self, num_channels, affine, bias, device, dtype)
    if self.weight is not None: init.ones_(self.weight)
    if self.bias is not None: init.zeros_(self.bias)

  def forward(self, input: Tensor) -> Tensor: return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)
  def extra_repr(self) -> str:
    return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}, bias={self.bias is not None}"
