"""Tensor: a strided view of a storage, with dtype, device and autograd state.

This class holds layout and state only. Its math methods (`+`, `.sum()`, `.view()`, `.add_()`, ...) are attached from
above by the op library (blutrain/ops/methods.py) and `.backward()` by autograd, as JAX attaches its array methods:
this module imports neither.
"""
from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np

from blutrain import backend, dtypes, shapes
from blutrain.device import Device
from blutrain.dtypes import DType
from blutrain.shapes import Size, is_contiguous, normalize_dim


class Storage:
  """A flat buffer on one device. All views of it share its version counter, which in-place ops bump."""
  __slots__ = ("data", "device", "version", "__weakref__")

  def __init__(self, data: Any, device: Device):
    self.data, self.device, self.version = data, device, 0


class Traced:
  """The storage of a tensor under Nova's capture: no values, only its place in the graph being built."""
  __slots__ = ("value", "viewed", "view_of", "stale")

  def __init__(self, value: Any):
    # viewed: a view was taken of it; view_of: the Traced it is a view of; stale: a view of it was updated in place
    self.value, self.viewed, self.view_of, self.stale = value, False, None, False


class GraphBreakError(RuntimeError):
  """Raised when code under `bt.compile` needs a tensor's values in Python (.item(), .numpy(), `if t > 0:`,
  printing): the graph cannot depend on them."""

  def __init__(self, t: Tensor):
    super().__init__(
      f"graph break: the values of a {t.dtype.name} tensor of shape {tuple(t.shape)} were read in Python (.item(), "
      ".tolist(), .numpy(), printing or Python control flow on a tensor) inside a function compiled with bt.compile, or "
      "a tensor made inside it was kept and used after it. Move the read out of the compiled function (return the "
      "tensor and read it after the call), or use tensor ops (bt.where) instead of Python branches.")


class Tensor:
  """An n-dimensional array with autograd, as `torch.Tensor`. Create one with `bt.tensor`, `bt.zeros`, ..."""
  __slots__ = ("_storage", "shape", "_strides", "_offset", "dtype", "requires_grad", "grad", "_node",
               "_retains_grad", "_hooks", "_post_hooks", "_view", "_base", "_base_node", "__weakref__")
  __array_priority__ = 1000  # numpy scalars on the left defer to our operators

  # *** construction ***

  @classmethod
  def _make(cls, storage: Storage, shape, strides, offset: int, dtype: DType) -> Tensor:
    t = object.__new__(cls)
    # most callers pass another tensor's Size and strides tuple (detach, views, the backends' layouts): no copy then
    if shape.__class__ is not Size: shape = Size(shape)
    if strides.__class__ is not tuple: strides = tuple(strides)
    t._storage, t.shape, t._strides, t._offset, t.dtype = storage, shape, strides, offset, dtype
    t.requires_grad, t.grad, t._node, t._retains_grad, t._hooks, t._view = False, None, None, False, None, None
    t._post_hooks = None
    t._base = t._base_node = None  # a view's root tensor, and the root's node when the view's own node was made
    return t

  @classmethod
  def _wrap(cls, array: Any, device: Device, dtype: DType) -> Tensor:
    data, shape, strides, offset, view = backend.get(device).wrap(array, dtype)
    t = cls._make(Storage(data, device), shape, strides, offset, dtype)
    t._view = view
    return t

  def _array(self) -> Any:
    """The backend's array for this view (a numpy strided view on the CPU), which kernels take. Layout never
    changes after creation, so it is made once."""
    if self._view is None:
      if type(self._storage.data) is Traced: raise GraphBreakError(self)
      self._view = backend.get(self.device).view(self._storage.data, self.shape, self._strides, self._offset, self.dtype)
    return self._view

  # *** properties ***

  @property
  def device(self) -> Device: return self._storage.device
  @property
  def ndim(self) -> int: return len(self.shape)
  def dim(self) -> int: return len(self.shape)
  def size(self, dim: int | None = None):
    return self.shape if dim is None else self.shape[normalize_dim(dim, self.ndim, "size")]
  def numel(self) -> int: return math.prod(self.shape)
  def nelement(self) -> int: return self.numel()
  def element_size(self) -> int: return self.dtype.itemsize
  def stride(self, dim: int | None = None):
    return self._strides if dim is None else self._strides[normalize_dim(dim, self.ndim, "stride")]
  def storage_offset(self) -> int: return self._offset
  def is_contiguous(self, memory_format: shapes.memory_format = shapes.contiguous_format) -> bool:
    """Whether the tensor is dense in `memory_format` (row-major by default; `bt.channels_last`...)."""
    if memory_format is shapes.contiguous_format: return is_contiguous(self.shape, self._strides)
    return shapes.in_format(self.shape, self._strides, memory_format)
  def is_floating_point(self) -> bool: return self.dtype.is_floating_point
  @property
  def is_leaf(self) -> bool: return self._node is None
  @property
  def grad_fn(self): return self._node
  @property
  def is_cuda(self) -> bool: return self.device.type == "cuda"
  @property
  def data(self) -> Tensor: return self.detach()
  @data.setter
  def data(self, other: Tensor) -> None:
    self._storage, self.shape, self._strides, self._offset, self.dtype, self._view = (
      other._storage, other.shape, other._strides, other._offset, other.dtype, other._view)
    self._base = self._base_node = None
  @property
  def T(self) -> Tensor: return self.permute(*reversed(range(self.ndim)))
  @property
  def mT(self) -> Tensor: return self.transpose(-2, -1)

  # *** host interop ***

  def numpy(self) -> np.ndarray:
    """A numpy array of the values; on the CPU it shares memory with a contiguous tensor, as torch's does."""
    if self.requires_grad:
      raise RuntimeError("Can't call numpy() on a tensor that requires grad. Use tensor.detach().numpy() instead.")
    return backend.get(self.device).to_numpy(self._array())

  def item(self) -> bool | int | float:
    if self.numel() != 1:
      raise RuntimeError(f"item(): a tensor with {self.numel()} elements (shape {self.shape}) cannot be converted to a Python number")
    return self.detach().numpy().reshape(()).item()

  def tolist(self) -> Any: return self.detach().numpy().tolist()
  def __float__(self) -> float: return float(self.item())
  def __int__(self) -> int: return int(self.item())
  def __index__(self) -> int:
    if self.dtype.category != 1: raise TypeError(f"only integer tensors can be used as an index, got {self.dtype.name}")
    return int(self.item())
  def __bool__(self) -> bool:
    if self.numel() != 1:
      raise RuntimeError(f"Boolean value of a tensor with {self.numel()} elements is ambiguous; use .any() or .all()")
    return bool(self.item())
  def __len__(self) -> int:
    if not self.shape: raise TypeError("len() of a 0-d tensor")
    return self.shape[0]
  def __iter__(self) -> Iterator[Tensor]:
    if not self.shape: raise TypeError("iteration over a 0-d tensor")
    return (self[i] for i in range(self.shape[0]))
  def __hash__(self) -> int: return id(self)

  def data_ptr(self) -> int:
    """The address of the tensor's first element (its storage's plus its offset), 0 when it has none, as
    `torch.Tensor.data_ptr`: tensors sharing memory compare by it."""
    return 0 if 0 in self.shape else backend.get(self.device).data_ptr(self._array())

  def __dlpack__(self, stream: Any = None, **kw) -> Any:
    return backend.get(self.device).dlpack(self._array(), stream=stream, **kw)

  def __dlpack_device__(self) -> tuple[int, int]:
    return (1, 0) if self.device.type == "cpu" else (2, self.device.index or 0)

  def __repr__(self) -> str:
    if self.numel() == 0: body = "[]" if self.ndim == 1 else f"[], size={self.shape}"
    else:
      arr = backend.get(self.device).to_numpy(self._array())
      if self.dtype is dtypes.bfloat16: arr = arr.astype(np.float32)
      body = np.array2string(arr, separator=", ", precision=4, threshold=200, edgeitems=3, prefix="tensor(")
    extra = []
    if self.device.type != "cpu": extra.append(f"device='{self.device}'")
    if self.dtype not in (dtypes.float32, dtypes.int64, dtypes.bool_) or (self.numel() == 0 and self.dtype is not dtypes.float32):
      extra.append(f"dtype={self.dtype!r}")
    if self._node is not None: extra.append(f"grad_fn=<{self._node.op.name}>")
    elif self.requires_grad: extra.append("requires_grad=True")
    return "tensor(" + ", ".join([body] + extra) + ")"

  # *** autograd ***

  def detach(self) -> Tensor:
    """A tensor sharing this one's storage, cut from the graph."""
    return Tensor._make(self._storage, self.shape, self._strides, self._offset, self.dtype)

  def detach_(self) -> Tensor:
    self._node, self.requires_grad = None, False
    return self

  def requires_grad_(self, requires_grad: bool = True) -> Tensor:
    if not self.is_leaf and not requires_grad:
      raise RuntimeError("requires_grad_(False): only a leaf tensor's flag can be cleared; use detach() instead")
    if requires_grad and not self.dtype.is_floating_point:
      raise RuntimeError(f"only floating point tensors can require gradients, got {self.dtype.name}")
    self.requires_grad = requires_grad
    return self

  def retain_grad(self) -> None:
    """Keep `.grad` on this non-leaf tensor after backward."""
    if not self.requires_grad: raise RuntimeError("retain_grad() on a tensor that does not require grad")
    if self._node is not None:
      import weakref
      self._node.retained = weakref.ref(self)
    self._retains_grad = True

  def register_hook(self, hook) -> Any:
    """Call `hook(grad)` when this tensor's gradient is computed; a returned tensor replaces the gradient."""
    if not self.requires_grad: raise RuntimeError("register_hook() on a tensor that does not require grad")
    if self._node is None:
      self._hooks = hooks = self._hooks or []
    else:
      self._node.hooks = hooks = self._node.hooks or []
    hooks.append(hook)
    return _HookHandle(hooks, hook)

  def register_post_accumulate_grad_hook(self, hook) -> Any:
    """Call `hook(tensor)` on this leaf right after backward has accumulated its gradient into `.grad` (as soon as
    the gradient is complete, while the rest of the backward still runs), as PyTorch's hook of that name."""
    if not self.requires_grad or self._node is not None:
      raise RuntimeError("register_post_accumulate_grad_hook() needs a leaf tensor that requires grad")
    self._post_hooks = hooks = self._post_hooks or []
    hooks.append(hook)
    return _HookHandle(hooks, hook)


class _HookHandle:
  def __init__(self, hooks: list, hook): self.hooks, self.hook = hooks, hook
  def remove(self) -> None:
    if self.hook in self.hooks: self.hooks.remove(self.hook)
