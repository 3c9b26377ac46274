"""Tensor creation, the counter-based random generator, device transfer and in-place writes."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from blutrain import backend, dtypes, ops
from blutrain.device import Device, to_device as parse_device
from blutrain.dtypes import DType
from blutrain.ops.core import Shape, _record, can_cast, capture, grad_mode, op, write
from blutrain.tensor import Storage, Tensor


def _shape(size: Sequence) -> Shape:
  if len(size) == 1 and isinstance(size[0], (tuple, list)): size = tuple(size[0])
  try: shape = tuple(int(s) for s in size)
  except (TypeError, ValueError): raise TypeError(f"expected a size made of ints, got {size!r}") from None
  if any(s < 0 for s in shape): raise ValueError(f"negative dimension in shape {shape}")
  return shape


def _creation_rule(*, shape, dtype, **_): return shape, dtype


# *** constants ***

full_op = op("full", _creation_rule, inputs="", attrs="shape:ints value:num dtype:dtype")
arange_op = op("arange", _creation_rule, inputs="", attrs="start:num step:num shape:ints dtype:dtype")


def full(size: Sequence[int], fill_value, *, dtype=None, device=None, requires_grad: bool = False,
         into: Tensor | None = None) -> Tensor:
  """A tensor of `size` filled with `fill_value`; the dtype follows the value (bool, int64, float32) by default.
  `into` may receive the values in place of a new tensor (`Tensor.fill_` passes its own, see `ops.core.apply`)."""
  dt = dtypes.to_dtype(dtype) if dtype is not None else dtypes.scalar_dtype(fill_value)
  t = full_op(device=parse_device(device), shape=_shape((size,) if isinstance(size, int) else tuple(size)),
              value=fill_value, dtype=dt, into=into)
  return t.requires_grad_(requires_grad) if requires_grad else t


_CPU = parse_device("cpu")
_scalars: dict[tuple, Tensor] = {}


def scalar_operand(value: bool | int | float, dtype: DType, device: Device) -> Tensor:
  """A Python number as an op's 0-d operand in `dtype`: eagerly a read-only CPU tensor, cached by value, which kernels
  on any device take by value (`ops.core.is_cpu_scalar`: no allocation, fill or copy on the device); under a Nova
  capture a constant on `device`."""
  if capture.trace is not None: return full((), value, dtype=dtype, device=device)
  key = (value.__class__, value, dtype, value == 0 and math.copysign(1.0, value))  # 0.0 and -0.0 compare equal
  t = _scalars.get(key)
  if t is None:
    if len(_scalars) >= 4096: _scalars.clear()  # numbers that change every step (learning rates) come and go
    t = full((), value, dtype=dtype, device=_CPU)
    t._storage.data.flags.writeable = t._array().flags.writeable = False  # shared: an in-place write must fail
    _scalars[key] = t
  return t


def zeros(*size, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  """A tensor of zeros, `bt.zeros(2, 3)` or `bt.zeros((2, 3))`."""
  return full(_shape(size), 0, dtype=dtype or dtypes.default_float, device=device, requires_grad=requires_grad)


def ones(*size, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  """A tensor of ones."""
  return full(_shape(size), 1, dtype=dtype or dtypes.default_float, device=device, requires_grad=requires_grad)


def empty(*size, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  """A tensor whose values are not to be relied on (zeros here)."""
  return zeros(*size, dtype=dtype, device=device, requires_grad=requires_grad)


def full_like(x: Tensor, fill_value, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  return full(x.shape, fill_value, dtype=dtype or x.dtype, device=device or x.device, requires_grad=requires_grad)


def zeros_like(x: Tensor, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  return full_like(x, 0, dtype=dtype, device=device, requires_grad=requires_grad)


def ones_like(x: Tensor, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  return full_like(x, 1, dtype=dtype, device=device, requires_grad=requires_grad)


def empty_like(x: Tensor, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  return zeros_like(x, dtype=dtype, device=device, requires_grad=requires_grad)


def arange(start, end=None, step=1, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  """Values from `start` to `end` (exclusive) by `step`: `bt.arange(5)`, `bt.arange(1, 2, 0.25)`."""
  if end is None: start, end = 0, start
  if step == 0: raise ValueError("arange: step must be nonzero")
  if (end - start) * step < 0:
    raise ValueError(f"arange: the range from {start} to {end} is inconsistent with the sign of step {step}")
  n = max(0, math.ceil((end - start) / step))
  dt = dtypes.to_dtype(dtype) if dtype is not None else dtypes.result_type(start, end, step)
  t = arange_op(device=parse_device(device), start=start, step=step, shape=(n,), dtype=dt)
  return t.requires_grad_(requires_grad) if requires_grad else t


def linspace(start: float, end: float, steps: int, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  """`steps` evenly spaced values from `start` to `end`, both included."""
  if steps < 0: raise ValueError(f"linspace: the number of steps must be non-negative, got {steps}")
  dt = dtypes.to_dtype(dtype or dtypes.default_float)
  step = (end - start) / (steps - 1) if steps > 1 else 0.0
  i = arange(steps, dtype=dtypes.float64 if dt is dtypes.float64 else dtypes.float32, device=device)
  # the first half counts up from start and the second down from end, so both ends are exact (as torch's kernel)
  t = ops.where(i < max(steps // 2, 1), i * step + start, end - (steps - 1 - i) * step).to(dt)
  return t.requires_grad_(requires_grad) if requires_grad else t


def eye(n: int, m: int | None = None, *, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
  """The identity matrix, n x m."""
  if n < 0 or (m is not None and m < 0): raise ValueError(f"eye: sizes must be non-negative, got n={n}, m={m}")
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

def to_device(x: Tensor, device: Device) -> Tensor:
  """Copy to another device through host memory; differentiable (the gradient goes back to the source device)."""
  host = x.detach().numpy()  # the source backend's host copy (on the CPU, a view of the storage)
  data = host if device.type == "cpu" else backend.get(device).from_numpy(host, device.index)
  out = Tensor._wrap(data, device, x.dtype)
  if grad_mode.enabled and x.requires_grad: _record(to_device_op, (x,), {"device": device}, out)
  return out


to_device_op = op("to_device", lambda x, device: (x.shape, x.dtype), lambda g, out, x, device: (to_device(g, x.device),),
                  saves=(), inputs="x", attrs="device:device")


# *** random numbers ***

class Generator:
  """A counter-based (Philox) random generator, as PyTorch's CUDA one: a seed and an offset that every draw
  advances. The same (seed, offset) gives the same numbers on every backend and under Nova's capture."""

  def __init__(self, device=None):
    self.device = parse_device(device)
    self.seed, self.offset = 67280421310721, 0

  def manual_seed(self, seed: int) -> Generator:
    self.seed, self.offset = int(seed) & (2**64 - 1), 0
    return self

  def initial_seed(self) -> int: return self.seed
  def get_state(self) -> Tensor: return tensor([self.seed, self.offset], dtype=dtypes.int64)
  def set_state(self, state: Tensor) -> None: self.seed, self.offset = (int(v) for v in state.tolist())

  def _take(self, n: int) -> tuple[int, int]:
    """Reserve n numbers: return (seed, offset) for the draw and advance past it."""
    seed, offset = self.seed, self.offset
    self.offset += n
    return seed, offset


default_generator = Generator()


def manual_seed(seed: int) -> Generator:
  """Seed the default generator (and so every random op without an explicit generator)."""
  return default_generator.manual_seed(seed)


def _random_rule(*, shape, dtype, **_): return shape, dtype


rand_op = op("rand", _random_rule, inputs="", attrs="shape:ints dtype:dtype seed:int offset:int")  # uniform [0, 1)
randn_op = op("randn", _random_rule, inputs="", attrs="shape:ints dtype:dtype seed:int offset:int")  # standard normal
randint_op = op("randint", _random_rule, inputs="", attrs="shape:ints dtype:dtype low:int high:int seed:int offset:int")
bernoulli_op = op("bernoulli", _random_rule, inputs="", attrs="shape:ints dtype:dtype p:float seed:int offset:int")


def _draw(op_, shape, dtype, device, generator, **attrs) -> Tensor:
  gen = generator or default_generator
  seed, offset = gen._take(math.prod(shape))
  return op_(device=parse_device(device), rng=gen, shape=shape, dtype=dtype, seed=seed, offset=offset, **attrs)


def rand(*size, dtype=None, device=None, generator: Generator | None = None, requires_grad: bool = False) -> Tensor:
  """Uniform samples on [0, 1)."""
  t = _draw(rand_op, _shape(size), dtypes.to_dtype(dtype or dtypes.default_float), device, generator)
  return t.requires_grad_(requires_grad) if requires_grad else t


def randn(*size, dtype=None, device=None, generator: Generator | None = None, requires_grad: bool = False) -> Tensor:
  """Standard normal samples."""
  t = _draw(randn_op, _shape(size), dtypes.to_dtype(dtype or dtypes.default_float), device, generator)
  return t.requires_grad_(requires_grad) if requires_grad else t


def randint(low: int, high: int | None = None, size=(), *, dtype=None, device=None,
            generator: Generator | None = None) -> Tensor:
  """Integers uniform on [low, high): `bt.randint(10, (3,))` or `bt.randint(2, 10, (3,))`."""
  if isinstance(high, (tuple, list)): high, size = None, high  # randint(high, size), as torch.randint
  if high is None: low, high = 0, low
  if high <= low: raise ValueError(f"randint: empty range [{low}, {high})")
  return _draw(randint_op, _shape((size,) if isinstance(size, int) else tuple(size)),
               dtypes.to_dtype(dtype or dtypes.int64), device, generator, low=int(low), high=int(high))


def bernoulli_mask(shape, p: float, *, device=None, generator: Generator | None = None) -> Tensor:
  """A bool tensor whose entries are True with probability p."""
  return _draw(bernoulli_op, tuple(shape), dtypes.bool_, device, generator, p=float(p))


def rand_like(x: Tensor, *, dtype=None, generator=None) -> Tensor:
  return rand(x.shape, dtype=dtype or x.dtype, device=x.device, generator=generator)


def randn_like(x: Tensor, *, dtype=None, generator=None) -> Tensor:
  return randn(x.shape, dtype=dtype or x.dtype, device=x.device, generator=generator)


# *** in-place writes ***

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
  if recording and base is not None and base._node is not x._base_node: ops.core.refresh_view(x)
  if recording and base is None and x._node is not None and x._node.op.view is not None:
    raise RuntimeError(f"in-place op on a view ({x._node.op.name}) of a tensor that requires grad inside bt.compile; "
                       "use an out-of-place op (e.g. `x = x.masked_fill(...)`)")
  old = Tensor._make(x._storage, x.shape, x._strides, x._offset, x.dtype)
  old.requires_grad, old._node = x.requires_grad, x._node
  new = fn(old, *args, into=x, **kwargs)
  if new is x: return x
  if new.dtype is not x.dtype:
    if not can_cast(new.dtype, x.dtype):
      raise RuntimeError(f"in-place op: result type {new.dtype.name} can't be cast to the tensor's dtype {x.dtype.name}")
    if (recording and new.requires_grad) or capture.trace is not None: new = new.to(x.dtype)  # else the write casts
  if new.shape != x.shape:
    try: new = new.expand(x.shape)
    except ValueError: raise RuntimeError(f"in-place op: result of shape {new.shape} does not fit the tensor's shape {x.shape}") from None
  if recording and new.requires_grad:
    if new._node is not None and new._node.op.view is not None:
      new = ops.copy(new)  # x now holds its own values, not a view of new's input
    # nodes that fn recorded may have saved `old` (mul_ saves it), which aliases x's memory: before the write,
    # `old` gets a copy of its values at the version they saved, as PyTorch keeps the original for such VJPs
    snap = ops.copy(old.detach())
    snap._storage.version = x._storage.version
    old._storage, old._strides, old._offset, old._view = snap._storage, snap._strides, snap._offset, snap._view
    if base is not None:
      root = Tensor._make(base._storage, base.shape, base._strides, base._offset, base.dtype)
      root.requires_grad, root._node = base.requires_grad, base._node
      new_root = ops.movement._put(root, ops.movement.view_positions(x, base), new)
  write(x, new.detach())
  if recording and new.requires_grad:
    x.requires_grad, x._node = True, new._node
    if base is not None: base.requires_grad, base._node, x._base_node = True, new_root._node, new_root._node
  return x

