"""Flat buckets, the unit that DistributedDataParallel and ZeroRedundancyOptimizer reduce: several tensors' values in
one vector, and tensors over such a vector's memory shaped as those tensors.

These run for every parameter of every step, on the eager step's critical path on the host, so in eager mode the
tensors are made directly over the memory (a layout, as a view op makes it, without the op's dispatch); under
bt.compile they are the view ops, which the capture records. They are for tensors outside autograd
(gradients, or anything under no_grad): a view made directly records no tape node.
"""
from __future__ import annotations

from blutrain import ops
from blutrain.autograd.tape import hooks
from blutrain.shapes import contiguous_strides
from blutrain.tensor import Storage, Tensor


def _view(x: Tensor, shape: tuple, offset: int) -> Tensor:
  """A contiguous view of x's storage, as a view op makes it."""
  v = Tensor._make(x._storage, shape, contiguous_strides(shape), offset, x.dtype)
  v._base = base = x if x._base is None else x._base
  v._base_node = base._node
  return v


def flat(t: Tensor) -> Tensor:
  """t's elements as a 1-D tensor: a view when t is contiguous, else a copy."""
  if hooks.trace is not None or not t.is_contiguous(): return t.reshape(-1)
  return _view(t, (t.numel(),), t._offset)


def flatten(tensors: list[Tensor | None], like: list[Tensor], length: int) -> Tensor:
  """The tensors' values in one new zero-padded vector of `length` elements (None: zeros of its `like`'s size): one
  cat, whose backend copies each tensor into place."""
  zeros = lambda n: ops.zeros(n, dtype=like[0].dtype, device=like[0].device)
  parts = [flat(t) if t is not None else zeros(ref.numel()) for t, ref in zip(tensors, like)]
  pad = length - sum(ref.numel() for ref in like)
  return ops.cat(parts + [zeros(pad)] if pad else parts)


def unflatten(vector: Tensor, like: list[Tensor], offsets: list[int]) -> list[Tensor]:
  """Tensors over the contiguous 1-D `vector`'s memory shaped as `like`'s, each starting at its offset (they must not
  overlap). In eager mode each is a tensor of its own over that memory, as the backends' results carved from one
  block are (its own storage and version counter), not a view of `vector`: then an in-place multi-tensor op on all of
  them (clipping's scale_) has no aliasing among them to check. So `vector` itself must not be used after."""
  if hooks.trace is not None: return [vector[o:o + t.numel()].view(t.shape) for t, o in zip(like, offsets)]
  data, device, base = vector._storage.data, vector.device, vector._offset
  return [Tensor._make(Storage(data, device), t.shape, t._strides if t.is_contiguous() else contiguous_strides(t.shape),
                       base + o, vector.dtype) for t, o in zip(like, offsets)]
