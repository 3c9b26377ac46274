"""Tensors made from sizes and values, from host data, and copies to another device."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from blutrain import backend, dtypes
from blutrain.autograd.tape import hooks
from blutrain.device import Device, to_device as parse_device
from blutrain.dtypes import DType
from blutrain.ops.core import op
from blutrain.shapes import Shape, ShapeError, memory_format, memory_order, preserve_format
from blutrain.tensor import Storage, Tensor


def shape_from(size: Sequence, keyword=None) -> Shape:
  """A shape from `f(2, 3)`, `f((2, 3))` or `f(size=(2, 3))` (`keyword`) arguments: ints, none negative (TypeError,
  ValueError naming them)."""
  if keyword is not None:
    if size: raise TypeError(f"expected the size either as arguments or as size=, got both: {size} and {keyword}")
    size = (keyword,)
  if len(size) == 1 and isinstance(size[0], (tuple, list)): size = tuple(size[0])
  try: shape = tuple(int(s) for s in size)
  except (TypeError, ValueError): raise TypeError(f"expected a size made of ints, got {size!r}") from None
  if any(s < 0 for s in shape): raise ShapeError(f"negative dimension in shape {shape}")
  return shape


def _creation_rule(*, shape, dtype, **_): return shape, dtype


# *** constants ***

full_op = op("full", _creation_rule, inputs="", attrs="shape:ints value:num dtype:dtype")
arange_op = op("arange", _creation_rule, inputs="", attrs="start:num step:num shape:ints dtype:dtype")
empty_op = op("empty", _creation_rule, inputs="", attrs="shape:ints dtype:dtype")


def full(size: Sequence[int], fill_value, *, dtype=None, device=None, requires_grad: bool = False,
         into: Tensor | None = None) -> Tensor:
  """A tensor of `size` filled with `fill_value`; the dtype follows the value (bool, int64, float32) by default.
  `into` may receive the values in place of a new tensor (`Tensor.fill_` passes its own, see `ops.core.apply`)."""
  dt = dtypes.to_dtype(dtype) if dtype is not None else dtypes.scalar_dtype(fill_value)
  t = full_op(device=parse_device(device), shape=shape_from((size,) if isinstance(size, int) else tuple(size)),
              value=fill_value, dtype=dt, into=into)
  return t.requires_grad_(requires_grad) if requires_grad else t


_CPU = parse_device("cpu")
_scalars: dict[tuple, Tensor] = {}


def scalar_operand(value: bool | int | float, dtype: DType, device: Device) -> Tensor:
  """A Python number as an op's 0-d operand in `dtype`: eagerly a read-only CPU tensor, cached by value, which kernels
  on any device take by value (`ops.core.is_cpu_scalar`: no allocation, fill or copy on the device); under a Nova
  capture a constant on `device`."""
  if hooks.trace is not None: return full((), value, dtype=dtype, device=device)
  key = (value.__class__, value, dtype, value == 0 and math.copysign(1.0, value))  # 0.0 and -0.0 compare equal
  t = _scalars.get(key)
  if t is None:
    if len(_scalars) >= 4096: _scalars.clear()  # numbers that change every step (learning rates) come and go
    t = full((), value, dtype=dtype, device=_CPU)
    t._storage.data.flags.writeable = t._array().flags.writeable = False  # shared: an in-place write must fail
    _scalars[key] = t
  return t


def zeros(*shape, size=None, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  """A tensor of zeros, `bt.zeros(2, 3)` or `bt.zeros((2, 3))`."""
  return full(shape_from(shape, size), 0, dtype=dtype or dtypes.default_float, device=device, requires_grad=requires_grad)


def ones(*shape, size=None, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  """A tensor of ones."""
  return full(shape_from(shape, size), 1, dtype=dtype or dtypes.default_float, device=device, requires_grad=requires_grad)


def empty(*shape, size=None, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  """A new tensor whose values are undefined (whatever its memory held): no kernel writes it, so write it before
  reading it, as with `torch.empty`."""
  t = empty_op(device=parse_device(device), shape=shape_from(shape, size),
               dtype=dtypes.to_dtype(dtype) if dtype is not None else dtypes.default_float)
  return t.requires_grad_(requires_grad) if requires_grad else t


def laid_out_like(x: Tensor, memory_format: memory_format, make) -> Tensor:
  """make(shape), a new tensor of x's shape, laid out in memory as x when x is dense (`preserve_format`, PyTorch's
  default for `*_like`: a channels-last x gives a channels-last result), else row-major; or in `memory_format`. It is
  made with its dims in memory order (values written in memory order) and viewed back."""
  order = memory_order(x.shape, x.stride()) if memory_format is preserve_format else memory_format.order(x.ndim)
  if order is None: return make(x.shape)
  return make([x.shape[d] for d in order]).permute(tuple(order.index(d) for d in range(x.ndim)))


def full_like(x: Tensor, fill_value, *, dtype=None, device=None, requires_grad: bool = False,
              memory_format: memory_format = preserve_format) -> Tensor:
  """A tensor of x's shape filled with `fill_value`, in x's dense layout (`laid_out_like`)."""
  t = laid_out_like(x, memory_format, lambda shape: full(shape, fill_value, dtype=dtype or x.dtype,
                                                         device=device or x.device))
  return t.requires_grad_(requires_grad) if requires_grad else t


def zeros_like(x: Tensor, *, dtype=None, device=None, requires_grad: bool = False,
               memory_format: memory_format = preserve_format) -> Tensor:
  return full_like(x, 0, dtype=dtype, device=device, requires_grad=requires_grad, memory_format=memory_format)


def ones_like(x: Tensor, *, dtype=None, device=None, requires_grad: bool = False,
              memory_format: memory_format = preserve_format) -> Tensor:
  return full_like(x, 1, dtype=dtype, device=device, requires_grad=requires_grad, memory_format=memory_format)


def empty_like(x: Tensor, *, dtype=None, device=None, requires_grad: bool = False,
               memory_format: memory_format = preserve_format) -> Tensor:
  """An `empty` tensor of x's shape, in x's dense layout (`laid_out_like`)."""
  t = laid_out_like(x, memory_format, lambda shape: empty(shape, dtype=dtype or x.dtype, device=device or x.device))
  return t.requires_grad_(requires_grad) if requires_grad else t


def arange(start, end=None, step=1, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  """Values from `start` to `end` (exclusive) by `step`: `bt.arange(5)`, `bt.arange(1, 2, 0.25)`."""
  if end is None: start, end = 0, start
  if step == 0: raise ShapeError("arange: step must be nonzero")
  if (end - start) * step < 0:
    raise ShapeError(f"arange: the range from {start} to {end} is inconsistent with the sign of step {step}")
  n = max(0, math.ceil((end - start) / step))
  dt = dtypes.to_dtype(dtype) if dtype is not None else dtypes.result_type(start, end, step)
  t = arange_op(device=parse_device(device), start=start, step=step, shape=(n,), dtype=dt)
  return t.requires_grad_(requires_grad) if requires_grad else t


def linspace(start: float, end: float, steps: int, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  """`steps` evenly spaced values from `start` to `end`, both included."""
  if steps < 0: raise ShapeError(f"linspace: the number of steps must be non-negative, got {steps}")
  dt = dtypes.to_dtype(dtype or dtypes.default_float)
  if dt is dtypes.bool_: raise NotImplementedError("linspace: bool is not supported (as in PyTorch); use a number dtype")
  step = (end - start) / (steps - 1) if steps > 1 else 0.0
  i = arange(steps, dtype=dtypes.float64 if dt is dtypes.float64 else dtypes.float32, device=device)
  # the first half counts up from start and the second down from end, so both ends are exact (as torch's kernel)
  t = (i * step + start).where(i < max(steps // 2, 1), end - (steps - 1 - i) * step).to(dt)
  return t.requires_grad_(requires_grad) if requires_grad else t


def eye(n: int, m: int | None = None, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  """The identity matrix, n x m."""
  if n < 0 or (m is not None and m < 0): raise ShapeError(f"eye: sizes must be non-negative, got n={n}, m={m}")
  rows, cols = arange(n, device=device), arange(n if m is None else m, device=device)
  t = (rows.unsqueeze(1) == cols.unsqueeze(0)).to(dtype or dtypes.default_float)
  return t.requires_grad_(requires_grad) if requires_grad else t


# *** host data ***

def tensor(data: Any, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  """A new tensor copied from data: nested lists, numbers, numpy arrays or tensors."""
  if isinstance(data, Tensor):
    t = data.detach().to(device or data.device, dtype or data.dtype).clone()
  else:
    try: arr = np.asarray(data)
    except ValueError: raise ValueError("tensor: nested sequences of unequal lengths; every row needs the same shape") from None
    if dtype is not None: arr = arr.astype(dtypes.to_dtype(dtype).np)
    elif arr.dtype == np.float64 and not isinstance(data, (np.ndarray, np.generic)):
      arr = arr.astype(np.float32)  # Python floats default to float32; numpy's float64 stays, as in PyTorch
    t = from_numpy(np.array(arr, copy=True, order="C")).to(parse_device(device))
  return t.requires_grad_(requires_grad) if requires_grad else t


def as_tensor(data: Any, dtype=None, device=None) -> Tensor:
  """Like `tensor` but without a copy when `data` already is a tensor of that dtype and device."""
  if isinstance(data, Tensor): return data.to(device or data.device, dtype or data.dtype)
  return tensor(data, dtype=dtype, device=device)


def from_numpy(array: np.ndarray) -> Tensor:
  """A CPU tensor sharing memory with a numpy array, with the array's strides."""
  if not isinstance(array, np.ndarray): raise TypeError(f"from_numpy: expected np.ndarray, got {type(array).__name__}")
  return _host_tensor(array, "from_numpy")


def _host_tensor(array: np.ndarray, name: str) -> Tensor:
  """A CPU tensor over a host array's memory. A strided array keeps its layout, as PyTorch shares any layout."""
  dt = dtypes.to_dtype(array.dtype)
  if array.flags.c_contiguous or array.size == 0: return Tensor._wrap(array, parse_device("cpu"), dt)
  item = array.itemsize
  if any(s < 0 or s % item for s in array.strides):
    raise ValueError(f"{name}: arrays with negative or unaligned strides {array.strides} are not supported; "
                     "pass a copy (np.ascontiguousarray)")
  strides = tuple(s // item for s in array.strides)
  span = 1 + sum((n - 1) * s for n, s in zip(array.shape, strides))  # from the first element to the last
  flat = np.lib.stride_tricks.as_strided(array, shape=(span,), strides=(item,))
  return Tensor._make(Storage(flat, parse_device("cpu")), array.shape, strides, 0, dt)


def from_dlpack(ext: Any) -> Tensor:
  """A tensor sharing memory with any DLPack producer (numpy, PyTorch, JAX, CuPy)."""
  dev_type, index = ext.__dlpack_device__()
  device = parse_device("cpu") if int(dev_type) == 1 else Device("cuda", int(index))
  array = backend.get(device).from_dlpack(ext)
  if device.type == "cpu": return _host_tensor(array, "from_dlpack")
  return Tensor._wrap(array, device, dtypes.to_dtype(array.dtype))


def as_tensor_like(x, like: Tensor) -> Tensor:
  """A Python number or array as a tensor of `like`'s dtype and device; a tensor passes through."""
  if isinstance(x, Tensor): return x
  if isinstance(x, (bool, int, float)): return full((), x, dtype=like.dtype, device=like.device)
  return tensor(x, dtype=like.dtype, device=like.device)


# *** device transfer ***

def _transfer_rule(x, target): return x.shape, x.dtype


# the source backend's kernel makes the copy on the target device (through host memory)
to_device_op = op("to_device", _transfer_rule, lambda g, out, x, target: (to_device(g, x.device),), saves=(),
                  transfer=True, inputs="x", attrs="target:device")


def to_device(x: Tensor, device: Device) -> Tensor:
  """A copy on another device; differentiable (the gradient goes back to the source device)."""
  return to_device_op(x, target=device)
