"""In-place writes: the view and version bookkeeping that lets `x.add_(y)`, `x[i] = v` and `x.copy_(y)` keep autograd
right (PyTorch's semantics: saved tensors carry versions, a view's root goes through the write)."""
from __future__ import annotations

from blutrain.autograd.tape import grad_mode, hooks, no_grad
from blutrain.ops.core import can_cast, refresh_view, view_positions, write
from blutrain.ops.creation import arange, as_tensor_like
from blutrain.ops.elementwise import copy
from blutrain.ops.movement import getitem, index_put_op, index_shape, parse_key, put
from blutrain.shapes import ShapeError
from blutrain.tensor import Tensor


def inplace(x: Tensor, fn, *args, **kwargs) -> Tensor:
  """Compute `fn(old, *args, into=x, **kwargs)` and store the result into x's storage, bumping its version.

  fn may hand `into` to the primitive that makes its result (`apply`), which writes into x's memory itself when
  nothing needs the tape and no input overlaps x otherwise than element for element, and then returns x; any other
  result is written here. The tape then sees x as the result of fn; a later backward that needs the overwritten
  values finds the version changed and says so, as PyTorch's autograd does. When x is a view, its root tensor's
  graph goes through the write too (PyTorch's CopySlices), and other views of the root read it anew when next used."""
  recording, base = grad_mode.enabled, x._base
  if recording and x.requires_grad and x.is_leaf:
    raise RuntimeError(f"a leaf tensor that requires grad (shape {x.shape}) is being used in an in-place operation; "
                       "wrap the update in `with bt.no_grad():` or use an out-of-place op")
  if recording and base is not None and base.requires_grad and base.is_leaf:
    raise RuntimeError(f"a view of a leaf tensor that requires grad (shape {base.shape}) is being used in an in-place "
                       "operation; wrap the update in `with bt.no_grad():` or use an out-of-place op")
  if recording and base is not None and base._node is not x._base_node: refresh_view(x)
  if recording and base is None and x._node is not None and x._node.op.view is not None:
    raise RuntimeError(f"in-place op on a view ({x._node.op.name}) of a tensor that requires grad inside bt.compile; "
                       "use an out-of-place op (e.g. `x = x.masked_fill(...)`)")
  if recording and (x.requires_grad or _any_requires_grad(args) or _any_requires_grad(kwargs.values())):
    old = Tensor._make(x._storage, x.shape, x._strides, x._offset, x.dtype)
    old.requires_grad, old._node = x.requires_grad, x._node
  else:
    old = x  # no node will save it: x itself is the input, read before the write
  new = fn(old, *args, into=x, **kwargs)
  if new is x: return x
  if new.dtype is not x.dtype:
    if not can_cast(new.dtype, x.dtype):
      raise RuntimeError(f"in-place op: result type {new.dtype.name} can't be cast to the tensor's dtype {x.dtype.name}")
    if (recording and new.requires_grad) or hooks.trace is not None: new = new.to(x.dtype)  # else the write casts
  if new.shape != x.shape:
    try: new = new.expand(x.shape)
    except ValueError: raise RuntimeError(f"in-place op: result of shape {new.shape} does not fit the tensor's shape {x.shape}") from None
  if recording and new.requires_grad:
    if new._node is not None and new._node.op.view is not None:
      new = copy(new)  # x now holds its own values, not a view of new's input
    # nodes that fn recorded may have saved `old` (mul_ saves it), which aliases x's memory: before the write,
    # `old` gets a copy of its values at the version they saved, as PyTorch keeps the original for such VJPs
    snap = copy(old.detach())
    snap._storage.version = x._storage.version
    old._storage, old._strides, old._offset, old._view = snap._storage, snap._strides, snap._offset, snap._view
    if base is not None:
      root = Tensor._make(base._storage, base.shape, base._strides, base._offset, base.dtype)
      root.requires_grad, root._node = base.requires_grad, base._node
      new_root = put(root, view_positions(x, base), new)
  write(x, new.detach())
  if recording and new.requires_grad:
    x.requires_grad, x._node = True, new._node
    if base is not None: base.requires_grad, base._node, x._base_node = True, new_root._node, new_root._node
  return x


def setitem(x: Tensor, key, value) -> None:
  """x[key] = value, in place. When x or value requires grad, x's graph continues through the write: the
  gradient reaches value at the written positions and x's history elsewhere."""
  value = as_tensor_like(value, x)
  if grad_mode.enabled and (x.requires_grad or value.requires_grad):
    with no_grad():
      pos = getitem(arange(x.numel(), device=x.device).reshape(x.shape), key)
    inplace(x, lambda old, into: put(old, pos, _broadcast_value(value, pos.shape).to(x.dtype)))
    return
  with no_grad():
    y, adv = parse_key(x, key)
    if not adv:
      inplace(y, lambda old, into: _broadcast_value(value, old.shape).to(x.dtype))
      return
    idx, positions = tuple(t for _, t in adv), tuple(p for p, _ in adv)
    region = index_shape(y.shape, [t.shape for t in idx], positions)
    inplace(y, lambda old, into: index_put_op(old, _broadcast_value(value, region).to(x.dtype), *idx, positions=positions))


def _any_requires_grad(values) -> bool:
  for v in values:
    if isinstance(v, Tensor) and v.requires_grad: return True
  return False


def _broadcast_value(value: Tensor, shape) -> Tensor:
  """value broadcast to the indexed region's shape; leading size-1 dims of value may be dropped, as in PyTorch."""
  while value.ndim > len(shape) and value.shape[0] == 1: value = value.squeeze(0)
  try:
    return value.expand(shape)
  except ValueError:
    raise ShapeError(f"setitem: a value of shape {tuple(value.shape)} cannot be assigned to an indexed region of "
                     f"shape {tuple(shape)}") from None
