"""`nn.functional` (imported as F): the op library's functions under `torch.nn.functional`'s names.

The math lives in `blutrain.ops`; this module re-exports it and, where PyTorch's signature differs from the
op's, adds a thin wrapper that keeps PyTorch's argument order.
"""
from __future__ import annotations

from blutrain import ops
from blutrain.ops import (dropout, gelu, layer_norm, linear, log_softmax, one_hot, relu, rms_norm,
                          scaled_dot_product_attention, sigmoid, silu, softmax, tanh)
from blutrain.tensor import Tensor

__all__ = ["linear", "gelu", "silu", "relu", "tanh", "sigmoid", "softmax", "log_softmax", "layer_norm", "rms_norm",
           "embedding", "dropout", "cross_entropy", "nll_loss", "mse_loss", "one_hot", "scaled_dot_product_attention",
           "pad"]


def embedding(input: Tensor, weight: Tensor, padding_idx: int | None = None) -> Tensor:
  """Rows of `weight` (num_embeddings, embedding_dim) picked by the integer tensor `input`.

  Positions whose index equals `padding_idx` pass no gradient to that row, as in PyTorch.
  Shape: input (*), output (*, embedding_dim).
  """
  out = ops.embedding(input, weight)
  if padding_idx is None: return out
  if padding_idx < 0: padding_idx += weight.shape[0]
  return ops.where((input == padding_idx).unsqueeze(-1), out.detach(), out)


def cross_entropy(input: Tensor, target: Tensor, *, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
  """Softmax cross-entropy of logits (N, C) or (N, C, d...) against class indices; see `ops.cross_entropy`.

  Options after `target` are keyword-only, so a call written for PyTorch's `(input, target, weight)` fails
  loudly instead of reading `weight` as another option (class weights and label smoothing are not supported).
  """
  return ops.cross_entropy(input, target, ignore_index=ignore_index, reduction=reduction)


def nll_loss(input: Tensor, target: Tensor, *, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
  """Negative log-likelihood of log-probabilities (N, C) at class indices (N,); options keyword-only."""
  return ops.nll_loss(input, target, ignore_index=ignore_index, reduction=reduction)


def mse_loss(input: Tensor, target: Tensor, *, reduction: str = "mean") -> Tensor:
  """Mean squared error: mean((input - target)^2); options keyword-only."""
  return ops.mse_loss(input, target, reduction=reduction)


def pad(input: Tensor, pad: tuple[int, ...], mode: str = "constant", value: float | None = None) -> Tensor:
  """Pad the last len(pad)//2 dims with `value`: pad = (last_left, last_right, 2nd_last_left, ...).

  Negative amounts crop. Only mode="constant" is supported.
  """
  if mode != "constant": raise NotImplementedError(f"pad: mode {mode!r} is not supported, only 'constant'")
  if len(pad) % 2 or len(pad) // 2 > input.ndim:
    raise ValueError(f"pad: expected an even number of pad sizes, at most 2 per dim, got {tuple(pad)} for shape {input.shape}")
  out = input
  for i in range(len(pad) // 2):
    dim, before, after = input.ndim - 1 - i, pad[2 * i], pad[2 * i + 1]
    cut_lo, cut_hi = max(-before, 0), max(-after, 0)
    if cut_lo or cut_hi: out = out.narrow(dim, cut_lo, out.shape[dim] - cut_lo - cut_hi)
    fill = [ops.full(out.shape[:dim] + (n,) + out.shape[dim + 1:], 0 if value is None else value, dtype=out.dtype,
                     device=out.device) for n in (before, after) if n > 0]
    if fill: out = ops.cat(fill[:1] + [out] + fill[1:] if before > 0 else [out] + fill, dim)
  return out
