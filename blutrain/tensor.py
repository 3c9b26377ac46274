"""Tensor: a strided view of a storage, with dtype, device and autograd state.

All math goes through the primitives of `blutrain.ops`; this class only holds layout and state and gives
ops their PyTorch method names.
"""
from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np

from blutrain import backend, dtypes
from blutrain.device import Device, to_device
from blutrain.dtypes import DType
from blutrain.shapes import is_contiguous, normalize_dim


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
               "_retains_grad", "_hooks", "_view", "_base", "_base_node", "__weakref__")
  __array_priority__ = 1000  # numpy scalars on the left defer to our operators

  # *** construction ***

  @classmethod
  def _make(cls, storage: Storage, shape, strides, offset: int, dtype: DType) -> Tensor:
    t = object.__new__(cls)
    t._storage, t.shape, t._strides, t._offset, t.dtype = storage, tuple(shape), tuple(strides), offset, dtype
    t.requires_grad, t.grad, t._node, t._retains_grad, t._hooks, t._view = False, None, None, False, None, None
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
  def is_contiguous(self) -> bool: return is_contiguous(self.shape, self._strides)
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

  def __dlpack__(self, stream: Any = None, **kw) -> Any:
    return backend.get(self.device).dlpack(self._array(), stream=stream, **kw)

  def __dlpack_device__(self) -> tuple[int, int]:
    return (1, 0) if self.device.type == "cpu" else (2, self.device.index or 0)

  def __repr__(self) -> str:
    if self.numel() == 0: body = "[]" if self.ndim == 1 else f"[], size={self.shape}"
    else:
      arr = self.detach().float().numpy() if self.dtype in (dtypes.bfloat16,) else self.detach().numpy()
      body = np.array2string(arr, separator=", ", precision=4, threshold=200, edgeitems=3, prefix="tensor(")
    extra = []
    if self.device.type != "cpu": extra.append(f"device='{self.device}'")
    if self.dtype not in (dtypes.float32, dtypes.int64, dtypes.bool_) or (self.numel() == 0 and self.dtype is not dtypes.float32):
      extra.append(f"dtype={self.dtype!r}")
    if self._node is not None: extra.append(f"grad_fn=<{self._node.op.name}>")
    elif self.requires_grad: extra.append("requires_grad=True")
    return "tensor(" + ", ".join([body] + extra) + ")"

  # *** autograd ***

  def backward(self, gradient: Tensor | None = None, retain_graph: bool = False) -> None:
    """Accumulate d(self)/d(leaf) into every leaf's `.grad`; a non-scalar needs `gradient`."""
    from blutrain.autograd import backward
    backward([self], [gradient], retain_graph=retain_graph)

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

  # *** conversion ***

  def to(self, *args, **kwargs) -> Tensor:
    """`t.to(device)`, `t.to(dtype)`, `t.to(device, dtype)` or `t.to(other)`; returns self when nothing changes."""
    if not kwargs and len(args) == 1 and type(args[0]) is DType:  # the common t.to(dtype), as autocast casts
      return self if args[0] is self.dtype else ops.cast(self, args[0])
    device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    kwargs.pop("non_blocking", None); kwargs.pop("copy", None)
    if kwargs: raise TypeError(f"to(): unexpected arguments {sorted(kwargs)}")
    for a in args:
      if isinstance(a, Tensor): device, dtype = a.device, a.dtype
      elif isinstance(a, (Device,)) or (isinstance(a, str) and a.split(":")[0] in ("cpu", "cuda")): device = a
      else: dtype = a
    out = self
    if dtype is not None and dtypes.to_dtype(dtype) is not self.dtype: out = ops.cast(out, dtypes.to_dtype(dtype))
    if device is not None and to_device(device) != self.device: out = ops.to_device(out, to_device(device))
    return out

  def cpu(self) -> Tensor: return self.to("cpu")
  def cuda(self, device: int | None = None) -> Tensor: return self.to(f"cuda:{device or 0}")
  def float(self) -> Tensor: return self.to(dtypes.float32)
  def double(self) -> Tensor: return self.to(dtypes.float64)
  def half(self) -> Tensor: return self.to(dtypes.float16)
  def bfloat16(self) -> Tensor: return self.to(dtypes.bfloat16)
  def long(self) -> Tensor: return self.to(dtypes.int64)
  def int(self) -> Tensor: return self.to(dtypes.int32)
  def bool(self) -> Tensor: return self.to(dtypes.bool_)
  def type_as(self, other: Tensor) -> Tensor: return self.to(other.dtype)
  def clone(self) -> Tensor: return ops.copy(self)
  def contiguous(self) -> Tensor: return self if self.is_contiguous() else ops.copy(self)

  # *** views ***

  def view(self, *shape) -> Tensor: return ops.view(self, _shape_args(shape))
  def reshape(self, *shape) -> Tensor: return ops.reshape(self, _shape_args(shape))
  def view_as(self, other: Tensor) -> Tensor: return self.view(other.shape)
  def reshape_as(self, other: Tensor) -> Tensor: return self.reshape(other.shape)
  def permute(self, *dims) -> Tensor: return ops.permute(self, _shape_args(dims))
  def transpose(self, dim0: int, dim1: int) -> Tensor: return ops.transpose(self, dim0, dim1)
  def t(self) -> Tensor:
    if self.ndim > 2: raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, got shape {self.shape}")
    return self.T
  def expand(self, *shape) -> Tensor: return ops.expand(self, _shape_args(shape))
  def expand_as(self, other: Tensor) -> Tensor: return self.expand(other.shape)
  def broadcast_to(self, shape) -> Tensor: return ops.expand(self, tuple(shape))
  def squeeze(self, dim=None) -> Tensor: return ops.squeeze(self, dim)
  def unsqueeze(self, dim: int) -> Tensor: return ops.unsqueeze(self, dim)
  def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Tensor: return ops.flatten(self, start_dim, end_dim)
  def unflatten(self, dim: int, sizes) -> Tensor: return ops.unflatten(self, dim, tuple(sizes))
  def narrow(self, dim: int, start: int, length: int) -> Tensor: return ops.narrow(self, dim, start, length)
  def split(self, split_size, dim: int = 0) -> tuple[Tensor, ...]: return ops.split(self, split_size, dim)
  def chunk(self, chunks: int, dim: int = 0) -> tuple[Tensor, ...]: return ops.chunk(self, chunks, dim)
  def unbind(self, dim: int = 0) -> tuple[Tensor, ...]: return ops.unbind(self, dim)
  def where(self, condition, other) -> Tensor: return ops.where(condition, self, other)
  def __getitem__(self, key) -> Tensor: return ops.getitem(self, key)
  def __setitem__(self, key, value) -> None: ops.setitem(self, key, value)

  # *** in-place ***

  def copy_(self, src) -> Tensor: return ops.inplace(self, _copy_source, src)
  def zero_(self) -> Tensor: return self.fill_(0)
  def fill_(self, value) -> Tensor:
    return ops.inplace(self, lambda old, into: ops.full(old.shape, value, dtype=old.dtype, device=old.device, into=into))
  def add_(self, other, alpha=1) -> Tensor: return ops.inplace(self, ops.add, other, alpha=alpha)
  def sub_(self, other, alpha=1) -> Tensor: return ops.inplace(self, ops.sub, other, alpha=alpha)
  def mul_(self, other) -> Tensor: return ops.inplace(self, ops.mul, other)
  def div_(self, other) -> Tensor: return ops.inplace(self, ops.div, other)
  def pow_(self, other) -> Tensor: return ops.inplace(self, ops.pow, other)
  def neg_(self) -> Tensor: return ops.inplace(self, ops.neg)
  def exp_(self) -> Tensor: return ops.inplace(self, ops.exp)
  def sqrt_(self) -> Tensor: return ops.inplace(self, ops.sqrt)
  def relu_(self) -> Tensor: return ops.inplace(self, ops.relu)
  def clamp_(self, min=None, max=None) -> Tensor: return ops.inplace(self, ops.clamp, min, max)
  def masked_fill_(self, mask, value) -> Tensor: return ops.inplace(self, ops.masked_fill, mask, value)
  def lerp_(self, end, weight) -> Tensor: return ops.inplace(self, ops.lerp, end, weight)
  def addcmul_(self, t1, t2, value=1) -> Tensor:
    return ops.inplace(self, lambda old, into: ops.add(old, value * t1 * t2, into=into))
  def addcdiv_(self, t1, t2, value=1) -> Tensor:
    return ops.inplace(self, lambda old, into: ops.add(old, value * t1 / t2, into=into))
  def uniform_(self, a: float = 0.0, b: float = 1.0, generator=None) -> Tensor:
    return ops.inplace(self, lambda old, into: ops.add(
      ops.rand(self.shape, dtype=self.dtype, device=self.device, generator=generator) * (b - a), a, into=into))
  def normal_(self, mean: float = 0.0, std: float = 1.0, generator=None) -> Tensor:
    return ops.inplace(self, lambda old, into: ops.add(
      ops.randn(self.shape, dtype=self.dtype, device=self.device, generator=generator) * std, mean, into=into))
  def __iadd__(self, other): return self.add_(other)
  def __isub__(self, other): return self.sub_(other)
  def __imul__(self, other): return self.mul_(other)
  def __itruediv__(self, other): return self.div_(other)

  # *** operators ***

  def __neg__(self): return ops.neg(self)
  def __add__(self, other): return ops.add(self, other)
  def __radd__(self, other): return ops.add(other, self)
  def __sub__(self, other): return ops.sub(self, other)
  def __rsub__(self, other): return ops.sub(other, self)
  def __mul__(self, other): return ops.mul(self, other)
  def __rmul__(self, other): return ops.mul(other, self)
  def __truediv__(self, other): return ops.div(self, other)
  def __rtruediv__(self, other): return ops.div(other, self)
  def __pow__(self, other): return ops.pow(self, other)
  def __rpow__(self, other): return ops.pow(other, self)
  def __matmul__(self, other): return ops.matmul(self, other)
  def __rmatmul__(self, other): return ops.matmul(other, self)
  def __abs__(self): return ops.abs(self)
  def __eq__(self, other): return ops.eq(self, other)  # type: ignore[override]
  def __ne__(self, other): return ops.ne(self, other)  # type: ignore[override]
  def __lt__(self, other): return ops.lt(self, other)
  def __le__(self, other): return ops.le(self, other)
  def __gt__(self, other): return ops.gt(self, other)
  def __ge__(self, other): return ops.ge(self, other)
  def __invert__(self): return ops.logical_not(_bool_operand("~", self))
  def __and__(self, other): return ops.logical_and(_bool_operand("&", self), _bool_operand("&", other))
  def __rand__(self, other): return ops.logical_and(_bool_operand("&", other), _bool_operand("&", self))
  def __or__(self, other): return ops.logical_or(_bool_operand("|", self), _bool_operand("|", other))
  def __ror__(self, other): return ops.logical_or(_bool_operand("|", other), _bool_operand("|", self))
  def __xor__(self, other): return ops.logical_xor(_bool_operand("^", self), _bool_operand("^", other))
  def __rxor__(self, other): return ops.logical_xor(_bool_operand("^", other), _bool_operand("^", self))


class _HookHandle:
  def __init__(self, hooks: list, hook): self.hooks, self.hook = hooks, hook
  def remove(self) -> None:
    if self.hook in self.hooks: self.hooks.remove(self.hook)


def _copy_source(old: Tensor, src, into: Tensor) -> Tensor:
  """copy_'s new values: src as a tensor on the destination's device (for `x.copy_(x)` the alias `old`, so that the
  write and its version bump still happen)."""
  return old if src is into else ops.as_tensor_like(src, old).to(old.device)


def _bool_operand(op: str, x):
  """&, |, ^ and ~ are PyTorch's bitwise ops; blutrain has them for bools only, where they are the logical ones."""
  dt = x.dtype if isinstance(x, Tensor) else dtypes.scalar_dtype(x)
  if dt is not dtypes.bool_:
    raise TypeError(f"{op}: supported on bool tensors only, got {dt.name} (integer bitwise ops are not implemented); "
                    "compare first (x != 0) or use logical_and/logical_or/logical_xor/logical_not")
  return x


def _shape_args(shape: tuple) -> tuple[int, ...]:
  """Accept both `f(2, 3)` and `f((2, 3))`, as PyTorch does."""
  if len(shape) == 1 and isinstance(shape[0], (tuple, list)): shape = tuple(shape[0])
  return tuple(int(s) for s in shape)


# methods forwarded to the op library under their own names (the math lives there)
_FORWARDED = """exp log sqrt rsqrt abs sin cos tanh sigmoid relu erf neg sign square reciprocal floor
  add sub mul div pow maximum minimum eq ne lt le gt ge logical_not logical_and logical_or logical_xor clamp clip
  masked_fill lerp sum mean max min amax amin argmax argmin var std logsumexp cumsum all any matmul
  softmax log_softmax tril triu gather scatter_add index_select repeat isnan isfinite""".split()

from blutrain import ops  # noqa: E402  (ops are built on Tensor)

def _method(fn):
  """An op as a method; primitives (`Op` objects, not functions) need the wrapper to receive `self`."""
  return fn if isinstance(fn, type(_method)) else lambda self, *args, **kwargs: fn(self, *args, **kwargs)


for _name in _FORWARDED:
  setattr(Tensor, _name, _method(getattr(ops, _name)))
