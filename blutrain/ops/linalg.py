"""Matrix multiplication: batched, broadcasting, with PyTorch's 1-D rules."""
from __future__ import annotations

import math

from blutrain import backends, dtypes
from blutrain.ops import creation
from blutrain.ops.core import autocast_inputs, op
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


def _matmul_vjp(g, out, a, b, tf32=False, needs=(True, True)):
  da = sum_to(matmul_op(g, b.mT, tf32=tf32), a.shape) if needs[0] else None
  if not needs[1]: return da, None
  if b.ndim == 2 and a.ndim > 2:  # a weight shared by the batch: fold the batch into one contraction
    rows = math.prod(a.shape[:-1])
    a2, g2 = a.reshape(rows, a.shape[-1]), g.reshape(rows, g.shape[-1])
    # b stored transposed (nn.Linear's weight.mT): compute db in that layout, so the weight's grad comes out dense
    db = matmul_op(g2.mT, a2, tf32=tf32).mT if b.stride()[-2] == 1 and b.shape[-1] > 1 else matmul_op(a2.mT, g2, tf32=tf32)
  else:
    db = sum_to(matmul_op(a.mT, g, tf32=tf32), b.shape)
  return da, db


matmul_op = op("matmul", _matmul_rule, _matmul_vjp, inputs="a b", attrs="tf32:bool?")


# A GEMM with its epilogue, made only by Nova's fuse-gemm pass (nova/passes/fuse_gemm.py) out of a matmul and the ops
# that follow it, never by user code: it computes exactly what those ops computed, rounding where they rounded.
GEMM_STEPS = ("bias", "gelu", "gelu_tanh", "save", "residual", "gelu_backward", "gelu_backward_tanh", "bias_grad")
GEMM_TENSORS = ("bias", "residual", "gelu_backward", "gelu_backward_tanh")  # steps reading a tensor, one each


def gemm_steps(epilogue: str) -> tuple[str, ...]:
  """The steps of a gemm's `epilogue` attribute ("bias,save,gelu" -> ("bias", "save", "gelu"))."""
  return tuple(epilogue.split(",")) if epilogue else ()


def _gemm_rule(a, b, *xs, epilogue, dtype, tf32=False):
  """gemm(a, b, *xs): y = a @ b in a's dtype, then the steps in order, each rounding to a's dtype as the op it
  replaces did: "bias" (+ xs[i] of shape (N,)), "gelu"/"gelu_tanh", "save" (y becomes the second output, in a's
  dtype; once, not last),
  and last "residual" (+ xs[i] of y's shape) or "gelu_backward"/"_tanh" (y * gelu'(xs[i]), xs[i] of y's shape), which
  round to `dtype`, the output's; after all of them "bias_grad" (made by fuse-bias-grads, on the GPU) also sums the
  output as stored over all dims but the last, in float32 (float64 for float64). Outputs: the result, then the saved
  value if any, then the sums."""
  shape, t = _matmul_rule(a, b)
  steps = gemm_steps(epilogue)
  if bad := [s for s in steps if s not in GEMM_STEPS]:
    raise ShapeError(f"gemm: unknown epilogue steps {bad}; expected some of {GEMM_STEPS}")
  readers = [s for s in steps if s in GEMM_TENSORS]
  if len(readers) != len(xs):
    raise ShapeError(f"gemm: epilogue {epilogue!r} reads {len(readers)} tensors, got {len(xs)}")
  for s, x in zip(readers, xs):
    want = (shape[-1],) if s == "bias" else shape
    if tuple(x.shape) != want or not x.dtype.is_floating_point:
      raise ShapeError(f"gemm: the {s} step reads a floating tensor of shape {want}, got {x.dtype.name}{list(x.shape)}")
  if steps.count("save") > 1 or steps[-1:] == ("save",):
    raise ShapeError(f"gemm: an epilogue saves at most one value, before a step that follows it; got {epilogue!r}")
  sums = steps[-1:] == ("bias_grad",)
  if "bias_grad" in steps[:-1]: raise ShapeError(f"gemm: bias_grad may only end an epilogue, got {epilogue!r}")
  steps = steps[:-1] if sums else steps
  if any(s in ("residual", "gelu_backward", "gelu_backward_tanh") for s in steps[:-1]):
    raise ShapeError(f"gemm: residual and gelu_backward may only end an epilogue, got {epilogue!r}")
  if dtype is not t and (not steps or steps[-1] not in ("residual", "gelu_backward", "gelu_backward_tanh")):
    raise ShapeError(f"gemm: only a final residual or gelu_backward step may change the dtype ({t.name} -> {dtype.name})")
  acc = dtypes.float64 if dtype is dtypes.float64 else dtypes.float32
  return [(shape, dtype)] + [(shape, t)] * steps.count("save") + [(shape[-1:], acc)] * sums


gemm_op = op("gemm", _gemm_rule, multi=True, inputs="a b *xs", attrs="epilogue:str dtype:dtype tf32:bool?")


def _weight_grad_rule(a, b, *, dtype, bias_grad, tf32=False):
  """weight_grad(a, b): a @ b of two matrices stored in `dtype` straight from the float32 accumulator, and with
  `bias_grad` the sums of a's rows over K (shape (M,)) in `dtype` too."""
  if a.ndim != 2 or b.ndim != 2:
    raise ShapeError(f"weight_grad: expected two matrices, got {tuple(a.shape)} and {tuple(b.shape)}")
  shape, t = _matmul_rule(a, b)
  if not t.is_floating_point or not dtype.is_floating_point or dtype.itemsize < t.itemsize:
    raise DTypeError(f"weight_grad: stores {t.name} products as the same or a wider float dtype, got {dtype.name}")
  return [(shape, dtype)] + ([(shape[:1], dtype)] if bias_grad else [])


# A linear layer's weight gradient as the GPU computes it best, made only by Nova on the GPU (fuse-gemm's
# WeightGradientPattern): dW = g^T x written in float32 under autocast (one rounding to the half dtype fewer than
# eager mode's matmul and widening cast), with the bias gradient, the column sums of g, in the same GEMM (cuBLASLt's
# BGRAD epilogue) instead of a reduction that reads g again.
weight_grad_op = op("weight_grad", _weight_grad_rule, multi=True, inputs="a b",
                    attrs="dtype:dtype bias_grad:bool tf32:bool?")


def matmul(a: Tensor, b: Tensor) -> Tensor:
  """a @ b. 1-D operands are promoted to a row (left) or a column (right) and that dim removed after;
  leading dims broadcast as batch dims. float32 operands may use TF32 on CUDA, as `bt.set_float32_matmul_precision`
  says when the op is built (its `tf32` attribute)."""
  if not isinstance(a, Tensor) or not isinstance(b, Tensor):
    raise TypeError(f"matmul: expected two tensors, got {type(a).__name__} and {type(b).__name__}")
  if a.ndim == 0 or b.ndim == 0: raise ShapeError(f"matmul: both arguments need at least 1 dimension, got {a.shape} and {b.shape}")
  a, b = autocast_inputs("matmul", a, b)  # before the dtype check: autocast casts mixed operands to one dtype
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


def mm(a: Tensor, b: Tensor) -> Tensor:
  """The matrix product of two 2-D tensors."""
  if getattr(a, "ndim", None) != 2 or getattr(b, "ndim", None) != 2:
    raise ShapeError(f"mm: expected two 2-D tensors, got shapes {getattr(a, 'shape', a)} and {getattr(b, 'shape', b)}")
  return matmul(a, b)


def bmm(a: Tensor, b: Tensor) -> Tensor:
  """Batched matrix products of two 3-D tensors with the same batch size (no broadcasting, as PyTorch's)."""
  if getattr(a, "ndim", None) != 3 or getattr(b, "ndim", None) != 3 or a.shape[0] != b.shape[0]:
    raise ShapeError(f"bmm: expected 3-D tensors of one batch size, got shapes {getattr(a, 'shape', a)} and "
                     f"{getattr(b, 'shape', b)}")
  return matmul(a, b)


def outer(a: Tensor, b: Tensor) -> Tensor:
  """The outer product of two 1-D tensors: out[i, j] = a[i] * b[j]."""
  if a.ndim != 1 or b.ndim != 1: raise ShapeError(f"outer: expected two 1-D tensors, got shapes {a.shape} and {b.shape}")
  return a.reshape(-1, 1) * b.reshape(1, -1)


def einsum(equation: str, *operands: Tensor) -> Tensor:
  """Einstein summation, as torch.einsum (`"bij,bjk->bik"`, implicit output, `...`): each repeated index within an
  operand is a diagonal, indices of no later use are summed, and operands are contracted left to right by matmul over
  their shared indices."""
  if len(operands) == 1 and isinstance(operands[0], (list, tuple)): operands = tuple(operands[0])
  eq = equation.replace(" ", "")
  lhs, arrow, rhs = eq.partition("->")
  terms = lhs.split(",")
  if len(terms) != len(operands):
    raise ShapeError(f"einsum: {equation!r} names {len(terms)} operands, got {len(operands)}")
  spare = iter(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq)
  n_ell = max((x.ndim - len(t) + 3 for t, x in zip(terms, operands) if "..." in t), default=0)
  ell = "".join(next(spare) for _ in range(n_ell))
  terms = [t.replace("...", ell[n_ell - (x.ndim - len(t) + 3):]) for t, x in zip(terms, operands)]
  if not arrow: rhs = ell + "".join(sorted(c for c in set("".join(terms)) - set(ell) if "".join(terms).count(c) == 1))
  rhs = rhs.replace("...", ell)
  xs = []
  for t, x in zip(terms, operands):
    if not t.isalpha() and t or len(t) != x.ndim:
      raise ShapeError(f"einsum: subscripts {t!r} do not fit an operand of shape {tuple(x.shape)} in {equation!r}")
    xs.append(_distinct(x, t))
  (x, t), rest = xs[0], xs[1:]
  for i, (y, u) in enumerate(rest):
    later = set(rhs).union(*(set(v) for _, v in rest[i + 1:]))
    x, t = _contract(x, t, y, u, later)
  x, t = _sum_out(x, t, set(rhs))
  if sorted(t) != sorted(rhs): raise ShapeError(f"einsum: output subscripts {rhs!r} name indices of no operand")
  return x.permute(*(t.index(c) for c in rhs))


def _distinct(x: Tensor, t: str) -> tuple[Tensor, str]:
  """x with each index of t once: a repeated index takes the diagonal of its two dims (moved to the front)."""
  while len(set(t)) != len(t):
    c = next(c for c in t if t.count(c) > 1)
    p, q = t.index(c), t.index(c, t.index(c) + 1)
    rest = [d for d in range(x.ndim) if d not in (p, q)]
    x = x.permute(p, q, *rest)
    i = creation.arange(min(x.shape[0], x.shape[1]), device=x.device)
    x, t = x[i, i], c + "".join(t[d] for d in rest)
  return x, t


def _sum_out(x: Tensor, t: str, keep: set) -> tuple[Tensor, str]:
  gone = tuple(i for i, c in enumerate(t) if c not in keep)
  return (x.sum(gone), "".join(c for c in t if c in keep)) if gone else (x, t)


def _contract(x: Tensor, t: str, y: Tensor, u: str, later: set) -> tuple[Tensor, str]:
  """x (indices t) times y (indices u), summed over the shared indices not in `later`: one batched matmul."""
  x, t = _sum_out(x, t, later | set(u))
  y, u = _sum_out(y, u, later | set(t))
  batch = [c for c in t if c in u and c in later]
  inner = [c for c in t if c in u and c not in later]
  left, right = [c for c in t if c not in u], [c for c in u if c not in t]
  size = {**dict(zip(u, y.shape)), **{c: n for c, n in zip(t, x.shape) if n != 1}}
  a = x.permute(*(t.index(c) for c in batch + left + inner))
  b = y.permute(*(u.index(c) for c in batch + inner + right))
  nb = len(batch)
  a = a.reshape(*a.shape[:nb], math.prod(size[c] for c in left), math.prod(size[c] for c in inner))
  b = b.reshape(*b.shape[:nb], math.prod(size[c] for c in inner), math.prod(size[c] for c in right))
  out = matmul(a, b)
  return out.reshape(*out.shape[:nb], *(size[c] for c in left + right)), "".join(batch + left + right)
