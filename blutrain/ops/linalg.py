"""Matrix multiplication: batched, broadcasting, with PyTorch's 1-D rules."""
from __future__ import annotations

import math

from blutrain import backends, dtypes
from blutrain.ops.core import op
from blutrain.ops.reduce import sum_to
from blutrain.dtypes import DTypeError
from blutrain.shapes import ShapeError, broadcast_shapes
from blutrain.tensor import Tensor


def _matmul_rule(a, b, tf32=False):
  if a.shape[-1] != b.shape[-2]:
    raise ShapeError(f"matmul: cannot contract {tuple(a.shape)} with {tuple(b.shape)}: {a.shape[-1]} != {b.shape[-2]} "
                     f"({a.dtype.name}, {b.dtype.name}, {a.device})")
  batch = broadcast_shapes(a.shape[:-2], b.shape[:-2], op=f"matmul of {tuple(a.shape)} and {tuple(b.shape)}, batch dims")
  return batch + (a.shape[-2], b.shape[-1]), a.dtype


def _matmul_vjp(g, out, a, b, tf32=False):
  if b.ndim == 2 and a.ndim > 2:  # a weight shared by the batch: fold the batch into one contraction
    rows = math.prod(a.shape[:-1])
    a2, g2 = a.reshape(rows, a.shape[-1]), g.reshape(rows, g.shape[-1])
    # b stored transposed (nn.Linear's weight.mT): compute db in that layout, so the weight's grad comes out dense
    db = matmul_op(g2.mT, a2, tf32=tf32).mT if b.stride()[-2] == 1 and b.shape[-1] > 1 else matmul_op(a2.mT, g2, tf32=tf32)
  else:
    db = sum_to(matmul_op(a.mT, g, tf32=tf32), b.shape)
  return sum_to(matmul_op(g, b.mT, tf32=tf32), a.shape), db


matmul_op = op("matmul", _matmul_rule, _matmul_vjp, inputs="a b", attrs="tf32:bool?")


def matmul(a: Tensor, b: Tensor) -> Tensor:
  """a @ b. 1-D operands are promoted to a row (left) or a column (right) and that dim removed after;
  leading dims broadcast as batch dims. float32 operands may use TF32 on CUDA, as `bt.set_float32_matmul_precision`
  says when the op is built (its `tf32` attribute)."""
  if not isinstance(a, Tensor) or not isinstance(b, Tensor):
    raise TypeError(f"matmul: expected two tensors, got {type(a).__name__} and {type(b).__name__}")
  if a.ndim == 0 or b.ndim == 0: raise ShapeError(f"matmul: both arguments need at least 1 dimension, got {a.shape} and {b.shape}")
  if a.dtype is not b.dtype:
    raise DTypeError(f"matmul: expected both operands of one dtype, got {a.dtype.name} and {b.dtype.name} "
                    f"(shapes {tuple(a.shape)}, {tuple(b.shape)}); convert one with .to(dtype)")
  if a.dtype is dtypes.bool_: raise TypeError("matmul: bool operands are not supported")
  a2 = a.unsqueeze(0) if a.ndim == 1 else a
  b2 = b.unsqueeze(-1) if b.ndim == 1 else b
  out = matmul_op(a2, b2, tf32=a.dtype is dtypes.float32 and backends.allow_tf32())
  if b.ndim == 1: out = out.squeeze(-1)
  if a.ndim == 1: out = out.squeeze(-2 if b.ndim > 1 else -1)
  return out
