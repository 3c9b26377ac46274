"""Tensor's methods and operators, attached to the class from above (as JAX's array_methods): `tensor.py` holds layout
and state and imports no op; the op library gives each op its PyTorch method name here.

Methods are written as the body of `TensorMethods` (read it as part of `Tensor`), then copied onto `Tensor` by
`attach()`, which `blutrain.ops` calls once at import. Ops that are methods under their own name are listed in
`FORWARDED` instead of written out.
"""
from __future__ import annotations

from types import FunctionType

from blutrain import dtypes, shapes
from blutrain.autograd import engine
from blutrain.device import Device, to_device
from blutrain.dtypes import DType
from blutrain.ops import creation, elementwise, linalg, movement, nn, ordering, random, reduce
from blutrain.ops.inplace import inplace, setitem
from blutrain.tensor import Tensor


class TensorMethods:
  """The methods `attach()` copies onto Tensor (`self` is a Tensor)."""

  def new_full(self, size, fill_value, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    """A tensor of `size` filled with `fill_value`, of this tensor's dtype and device unless given."""
    return creation.full(tuple(size), fill_value, dtype=dtype or self.dtype, device=device or self.device,
                         requires_grad=requires_grad)

  def new_zeros(self, *size, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    return self.new_full(_shape_args(size), 0, dtype=dtype, device=device, requires_grad=requires_grad)

  def new_ones(self, *size, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    return self.new_full(_shape_args(size), 1, dtype=dtype, device=device, requires_grad=requires_grad)

  def new_empty(self, *size, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    return self.new_zeros(*size, dtype=dtype, device=device, requires_grad=requires_grad)

  def sum_to_size(self, *size) -> Tensor:
    """The sum of this tensor down to a shape it broadcasts from, as PyTorch's."""
    return reduce.sum_to(self, _shape_args(size))

  def new_tensor(self, data, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    return creation.tensor(data, dtype=dtype or self.dtype, device=device or self.device, requires_grad=requires_grad)

  # *** conversion ***

  def to(self, *args, **kwargs) -> Tensor:
    """`t.to(device)`, `t.to(dtype)`, `t.to(device, dtype)` or `t.to(other)`; returns self when nothing changes."""
    if not kwargs and len(args) == 1 and type(args[0]) is DType:  # the common t.to(dtype), as autocast casts
      return self if args[0] is self.dtype else elementwise.cast(self, args[0])
    device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    fmt = kwargs.pop("memory_format", shapes.preserve_format)
    kwargs.pop("non_blocking", None); kwargs.pop("copy", None)
    if kwargs: raise TypeError(f"to(): unexpected arguments {sorted(kwargs)}")
    for a in args:
      if isinstance(a, Tensor): device, dtype = a.device, a.dtype
      elif isinstance(a, (Device,)) or (isinstance(a, str) and a.split(":")[0] in ("cpu", "cuda")): device = a
      elif isinstance(a, str) and not dtypes.is_dtype_name(a):
        raise RuntimeError(f"to(): {a!r} is neither a device ('cpu', 'cuda', 'cuda:N') nor a dtype name")
      else: dtype = a
    out = self
    if dtype is not None and dtypes.to_dtype(dtype) is not self.dtype:
      out = elementwise.cast(out, dtypes.to_dtype(dtype))
    if device is not None and to_device(device) != self.device: out = creation.to_device(out, to_device(device))
    return out if fmt is shapes.preserve_format else out.contiguous(memory_format=fmt)

  def cpu(self) -> Tensor: return self.to("cpu")
  def cuda(self, device: int | None = None) -> Tensor: return self.to(f"cuda:{device or 0}")
  def float(self) -> Tensor: return self.to(dtypes.float32)
  def double(self) -> Tensor: return self.to(dtypes.float64)
  def half(self) -> Tensor: return self.to(dtypes.float16)
  def bfloat16(self) -> Tensor: return self.to(dtypes.bfloat16)
  def long(self) -> Tensor: return self.to(dtypes.int64)
  def short(self) -> Tensor: return self.to(dtypes.int16)
  def char(self) -> Tensor: return self.to(dtypes.int8)
  def byte(self) -> Tensor: return self.to(dtypes.uint8)
  def int(self) -> Tensor: return self.to(dtypes.int32)
  def bool(self) -> Tensor: return self.to(dtypes.bool_)
  def type_as(self, other: Tensor) -> Tensor: return self.to(other.dtype)

  def type(self, dtype=None):
    """The type name (`'blutrain.FloatTensor'`) without an argument, else this tensor converted to `dtype` (a dtype or
    a name such as 'torch.LongTensor')."""
    if dtype is None: return f"blutrain.{'cuda.' if self.device.type == 'cuda' else ''}{_TYPE_NAMES[self.dtype]}Tensor"
    if isinstance(dtype, str) and dtype.endswith("Tensor"):
      name = dtype.rsplit(".", 1)[-1].removesuffix("Tensor")
      dtype = next((d for d, n in _TYPE_NAMES.items() if n == name), None)
      if dtype is None: raise TypeError(f"type(): unknown tensor type {name!r}")
    return self.to(dtype)
  def clone(self) -> Tensor: return elementwise.copy(self)
  def contiguous(self, memory_format: shapes.memory_format = shapes.contiguous_format) -> Tensor:
    """This tensor if it is dense in `memory_format`, else such a copy (`bt.channels_last`: (N, C, H, W) stored
    (N, H, W, C), still indexed (N, C, H, W))."""
    if self.is_contiguous(memory_format): return self
    order = memory_format.order(self.ndim)
    if order is None: return elementwise.copy(self)
    back = tuple(order.index(d) for d in range(self.ndim))
    return movement.permute(elementwise.copy(movement.permute(self, order)), back)

  # *** views ***

  def view(self, *shape) -> Tensor: return movement.view(self, _shape_args(shape))
  def reshape(self, *shape) -> Tensor: return movement.reshape(self, _shape_args(shape))
  def view_as(self, other: Tensor) -> Tensor: return self.view(other.shape)
  def reshape_as(self, other: Tensor) -> Tensor: return self.reshape(other.shape)
  def permute(self, *dims) -> Tensor: return movement.permute(self, _shape_args(dims))
  def transpose(self, dim0: int, dim1: int) -> Tensor: return movement.transpose(self, dim0, dim1)
  def t(self) -> Tensor:
    if self.ndim > 2: raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, got shape {self.shape}")
    return self.T
  def expand(self, *shape) -> Tensor: return movement.expand(self, _shape_args(shape))
  def expand_as(self, other: Tensor) -> Tensor: return self.expand(other.shape)
  def broadcast_to(self, shape) -> Tensor: return movement.expand(self, tuple(shape))
  def squeeze(self, dim=None) -> Tensor: return movement.squeeze(self, dim)
  def unsqueeze(self, dim: int) -> Tensor: return movement.unsqueeze(self, dim)
  def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Tensor: return movement.flatten(self, start_dim, end_dim)
  def unflatten(self, dim: int, sizes) -> Tensor: return movement.unflatten(self, dim, tuple(sizes))
  def narrow(self, dim: int, start: int, length: int) -> Tensor: return movement.narrow(self, dim, start, length)
  def split(self, split_size, dim: int = 0) -> tuple[Tensor, ...]: return movement.split(self, split_size, dim)
  def chunk(self, chunks: int, dim: int = 0) -> tuple[Tensor, ...]: return movement.chunk(self, chunks, dim)
  def unbind(self, dim: int = 0) -> tuple[Tensor, ...]: return movement.unbind(self, dim)
  def where(self, condition, other) -> Tensor: return elementwise.where(condition, self, other)
  def __getitem__(self, key) -> Tensor: return movement.getitem(self, key)
  def __setitem__(self, key, value) -> None: setitem(self, key, value)

  # *** in-place ***

  def copy_(self, src) -> Tensor: return inplace(self, _copy_source, src)
  def zero_(self) -> Tensor: return self.fill_(0)
  def fill_(self, value) -> Tensor:
    return inplace(self, lambda old, into: creation.full(old.shape, value, dtype=old.dtype, device=old.device, into=into))
  def add_(self, other, alpha=1) -> Tensor: return inplace(self, elementwise.add, other, alpha=alpha)
  def sub_(self, other, alpha=1) -> Tensor: return inplace(self, elementwise.sub, other, alpha=alpha)
  def mul_(self, other) -> Tensor: return inplace(self, elementwise.mul, other)
  def div_(self, other) -> Tensor: return inplace(self, elementwise.div, other)
  def pow_(self, other) -> Tensor: return inplace(self, elementwise.pow, other)
  def neg_(self) -> Tensor: return inplace(self, elementwise.neg)
  def exp_(self) -> Tensor: return inplace(self, elementwise.exp)
  def sqrt_(self) -> Tensor: return inplace(self, elementwise.sqrt)
  def relu_(self) -> Tensor: return inplace(self, elementwise.relu)
  def clamp_(self, min=None, max=None) -> Tensor: return inplace(self, elementwise.clamp, min, max)
  def masked_fill_(self, mask, value) -> Tensor: return inplace(self, elementwise.masked_fill, mask, value)
  def lerp_(self, end, weight) -> Tensor: return inplace(self, elementwise.lerp, end, weight)
  def scatter_(self, dim, index, src=None, *, value=None, reduce=None) -> Tensor:
    return inplace(self, lambda old, into: nn.scatter(old, dim, index, src, value=value, reduce=reduce))
  def scatter_add_(self, dim, index, src) -> Tensor:
    return inplace(self, lambda old, into: nn.scatter_add(old, dim, index, src))
  def scatter_reduce_(self, dim, index, src, reduce, *, include_self=True) -> Tensor:
    return inplace(self, lambda old, into: nn.scatter_reduce(old, dim, index, src, reduce, include_self=include_self))
  def addcmul_(self, t1, t2, value=1) -> Tensor:
    return inplace(self, lambda old, into: elementwise.add(old, value * t1 * t2, into=into))
  def addcdiv_(self, t1, t2, value=1) -> Tensor:
    return inplace(self, lambda old, into: elementwise.add(old, value * t1 / t2, into=into))
  def uniform_(self, a: float = 0.0, b: float = 1.0, generator=None) -> Tensor:
    return inplace(self, lambda old, into: elementwise.add(
      random.rand(self.shape, dtype=self.dtype, device=self.device, generator=generator) * (b - a), a, into=into))
  def normal_(self, mean: float = 0.0, std: float = 1.0, generator=None) -> Tensor:
    return inplace(self, lambda old, into: elementwise.add(
      random.randn(self.shape, dtype=self.dtype, device=self.device, generator=generator) * std, mean, into=into))
  def __iadd__(self, other): return self.add_(other)
  def __isub__(self, other): return self.sub_(other)
  def __imul__(self, other): return self.mul_(other)
  def __itruediv__(self, other): return self.div_(other)

  # *** operators ***

  def __neg__(self): return elementwise.neg(self)
  # NOTE: two tensors of one dtype go straight to the primitive (no promotion to work out): the hottest eager path
  def __add__(self, other):
    if isinstance(other, Tensor) and other.dtype is self.dtype: return elementwise.add_op(self, other)
    return elementwise.add(self, other)
  def __radd__(self, other): return elementwise.add(other, self)
  def __sub__(self, other):
    if isinstance(other, Tensor) and other.dtype is self.dtype: return elementwise.sub_op(self, other)
    return elementwise.sub(self, other)
  def __rsub__(self, other): return elementwise.sub(other, self)
  def __mul__(self, other):
    if isinstance(other, Tensor) and other.dtype is self.dtype: return elementwise.mul_op(self, other)
    return elementwise.mul(self, other)
  def __rmul__(self, other): return elementwise.mul(other, self)
  def __truediv__(self, other): return elementwise.div(self, other)
  def __rtruediv__(self, other): return elementwise.div(other, self)
  def __pow__(self, other): return elementwise.pow(self, other)
  def __rpow__(self, other): return elementwise.pow(other, self)
  def __floordiv__(self, other): return elementwise.floor_divide(self, other)
  def __rfloordiv__(self, other): return elementwise.floor_divide(other, self)
  def __mod__(self, other): return elementwise.remainder(self, other)
  def __rmod__(self, other): return elementwise.remainder(other, self)
  def __matmul__(self, other): return linalg.matmul(self, other)
  def __rmatmul__(self, other): return linalg.matmul(other, self)
  def __abs__(self): return elementwise.abs(self)
  def __eq__(self, other): return elementwise.eq(self, other)  # type: ignore[override]
  def __ne__(self, other): return elementwise.ne(self, other)  # type: ignore[override]
  def __lt__(self, other): return elementwise.lt(self, other)
  def __le__(self, other): return elementwise.le(self, other)
  def __gt__(self, other): return elementwise.gt(self, other)
  def __ge__(self, other): return elementwise.ge(self, other)
  def __invert__(self): return elementwise.logical_not(self) if self.dtype is dtypes.bool_ else elementwise.bitwise_not(self)
  def __and__(self, other): return _bitwise("and", self, other)
  def __rand__(self, other): return _bitwise("and", other, self)
  def __or__(self, other): return _bitwise("or", self, other)
  def __ror__(self, other): return _bitwise("or", other, self)
  def __xor__(self, other): return _bitwise("xor", self, other)
  def __rxor__(self, other): return _bitwise("xor", other, self)
  def __lshift__(self, other): return elementwise.bitwise_left_shift(self, other)
  def __rlshift__(self, other): return elementwise.bitwise_left_shift(other, self)
  def __rshift__(self, other): return elementwise.bitwise_right_shift(self, other)
  def __rrshift__(self, other): return elementwise.bitwise_right_shift(other, self)


_TYPE_NAMES = {dtypes.bool_: "Bool", dtypes.uint8: "Byte", dtypes.int8: "Char", dtypes.int16: "Short", dtypes.int32: "Int", dtypes.int64: "Long", dtypes.float16: "Half",
               dtypes.bfloat16: "BFloat16", dtypes.float32: "Float", dtypes.float64: "Double"}


def _copy_source(old: Tensor, src, into: Tensor) -> Tensor:
  """copy_'s new values: src as a tensor on the destination's device (for `x.copy_(x)` the alias `old`, so that the
  write and its version bump still happen)."""
  return old if src is into else creation.as_tensor_like(src, old).to(old.device)


def _bitwise(kind: str, x, y) -> Tensor:
  """&, |, ^: logical on two bools (the common mask case), bitwise on integers, as PyTorch's."""
  both_bool = all((t.dtype if isinstance(t, Tensor) else dtypes.scalar_dtype(t)) is dtypes.bool_ for t in (x, y))
  return getattr(elementwise, f"logical_{kind}" if both_bool else f"bitwise_{kind}")(x, y)


def _shape_args(shape: tuple) -> tuple[int, ...]:
  """Accept both `f(2, 3)` and `f((2, 3))`, as PyTorch does."""
  if len(shape) == 1 and isinstance(shape[0], (tuple, list)): shape = tuple(shape[0])
  return tuple(int(s) for s in shape)


# methods forwarded to the op library under their own names (the math lives there)
FORWARDED = """exp log sqrt rsqrt abs sin cos tanh sigmoid relu erf neg sign square reciprocal floor
  add sub mul div pow maximum minimum eq ne lt le gt ge logical_not logical_and logical_or logical_xor clamp clip
  masked_fill lerp sum mean max min amax amin argmax argmin var std logsumexp cumsum all any matmul
  softmax log_softmax tril triu gather scatter scatter_add scatter_reduce index_select repeat isnan isfinite
  bernoulli sort argsort msort topk kthvalue multinomial cumprod prod flip roll diag diagonal outer mm bmm isclose allclose
  equal tan asin acos atan atan2 sinh cosh asinh acosh atanh exp2 log2 log10 log1p expm1 ceil trunc round copysign fmod
  remainder floor_divide logaddexp isinf bitwise_and bitwise_or bitwise_xor bitwise_not bitwise_left_shift
  bitwise_right_shift logcumsumexp masked_select repeat_interleave cummax cummin norm unfold nonzero""".split()


def _op_named(name: str):
  """The public function of an op (a plain function: as a class attribute it binds `self`, the tensor)."""
  return next(getattr(m, name) for m in (elementwise, reduce, movement, linalg, nn, ordering, random) if hasattr(m, name))


def attach() -> None:
  """Give Tensor its methods: TensorMethods' body and the FORWARDED ops; and the autograd engine its multi-tensor
  cast (the leaves' gradients cast back as one op)."""
  for name, fn in vars(TensorMethods).items():
    if isinstance(fn, FunctionType): setattr(Tensor, name, fn)
  for name in FORWARDED: setattr(Tensor, name, _op_named(name))
  engine.cast_each = elementwise.cast_each
