"""The op registry and `apply`, the one door every primitive goes through.

A primitive is an `Op`: a name, a rule from input tensors to the output's shape and dtype, a VJP written
with other ops (one gradient per input, None where there is none), and, for view ops, a layout rule
that makes the output share the input's storage. Kernels live in the backends, keyed by the op name.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from blutrain import backend
from blutrain.dtypes import DType
from blutrain.shapes import Shape
from blutrain.profiler import active as profiling, op_timer, record_function
from blutrain.tensor import Tensor


@dataclass(frozen=True)
class Attr:
  """One attribute of an op's signature: its name, its kind (int, bool, float, num, str, dtype, ints, index, device)
  and whether it may be left out (`tf32:bool?`)."""
  name: str
  kind: str
  optional: bool = False


def parse_signature(inputs: str, attrs: str) -> tuple[tuple[str, ...], tuple[Attr, ...]]:
  """`inputs` lists tensor operands in order (`x`, `?w` optional, `*xs` variadic); `attrs` lists `name:kind`, with a
  trailing `?` when the attribute may be absent."""
  return tuple(inputs.split()), tuple(Attr(k, v.rstrip("?"), v.endswith("?"))
                                      for k, v in (a.split(":") for a in attrs.split()))


@dataclass(eq=False)
class Op:
  """A primitive: its name (the same in the registry, the backends' kernel tables and Nova's dialect), its signature
  (`inputs`, `attrs`: what Nova's dialect op declares and a test holds it to), the shape/dtype rule, the VJP and, for
  view ops, the layout rule."""
  name: str
  rule: Callable[..., tuple[Shape, DType]]
  vjp: Callable[..., tuple] | None = None   # (g, out, *inputs, **attrs) -> one gradient per input
  view: Callable[..., tuple] | None = None  # (x, **attrs) -> (shape, strides, offset) sharing x's storage
  saves: tuple[int, ...] | None = None       # inputs the VJP reads (None: all); the rest reach it as Avals
  saves_output: bool = False                 # the VJP reads `out`; otherwise it gets None
  differentiable: bool = True                # False: outputs never require grad (comparisons, argmax)
  inputs: tuple[str, ...] = ()               # operand names: `x`, `?w` optional, `*xs` variadic
  attrs: tuple[Attr, ...] = ()

  def __call__(self, *inputs, **attrs) -> Tensor: return apply(self, *inputs, **attrs)
  def __repr__(self) -> str: return f"Op({self.name})"


registry: dict[str, Op] = {}


def op(name: str, rule, vjp=None, *, inputs: str, attrs: str = "", **kw) -> Op:
  """Declare a primitive with its signature; its name is unique across the library, the backends and Nova's dialect."""
  assert name not in registry, f"op {name} declared twice"
  registry[name] = o = Op(name, rule, vjp, **kw, **dict(zip(("inputs", "attrs"), parse_signature(inputs, attrs))))
  return o


# *** grad mode ***

class _GradMode(threading.local):
  enabled = True


grad_mode = _GradMode()


def is_grad_enabled() -> bool: return grad_mode.enabled


class _Capture(threading.local):
  trace = None  # the active Nova capture (blutrain.nova.capture.Trace), or None: ops run eagerly


capture = _Capture()


class _Autocast(threading.local):
  cast = None  # under blutrain.amp.autocast: (op name, inputs) -> inputs cast by its policy table; None: off


autocast_state = _Autocast()


def autocast_inputs(name: str, *inputs):
  """`inputs` of op `name` cast as the active autocast's policy says (unchanged outside autocast); composites that
  PyTorch's autocast lists (linear, attention) call it, `apply` does for every primitive."""
  return inputs if autocast_state.cast is None else autocast_state.cast(name, inputs)


class autocast_suspended:
  """Run without autocast: VJPs do, so the backward runs in the forward's dtypes, as PyTorch's does."""
  def __enter__(self): self.prev, autocast_state.cast = autocast_state.cast, None
  def __exit__(self, *exc): autocast_state.cast = self.prev


class set_grad_enabled:
  """Context manager (and decorator) that turns gradient recording on or off, as torch.set_grad_enabled."""
  def __init__(self, mode: bool): self.mode, self.prev = bool(mode), []
  def __enter__(self): self.prev.append(grad_mode.enabled); grad_mode.enabled = self.mode
  def __exit__(self, *exc): grad_mode.enabled = self.prev.pop()

  def __call__(self, fn):
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **k):
      with set_grad_enabled(self.mode): return fn(*a, **k)
    return wrapper


class no_grad(set_grad_enabled):
  """Disable gradient recording inside the block: `with bt.no_grad(): ...` or `@bt.no_grad()`."""
  def __init__(self): super().__init__(False)


class enable_grad(set_grad_enabled):
  """Enable gradient recording inside the block, even under `no_grad`."""
  def __init__(self): super().__init__(True)


# *** apply ***

class Aval:
  """What a VJP may know of an input it does not save: shape, dtype, device (never changed once made)."""
  __slots__ = ("shape", "dtype", "device")

  def __init__(self, shape: Shape, dtype: DType, device: Any): self.shape, self.dtype, self.device = shape, dtype, device
  def __repr__(self) -> str: return f"Aval(shape={self.shape}, dtype={self.dtype!r}, device={self.device})"
  @property
  def ndim(self) -> int: return len(self.shape)


@dataclass(eq=False, slots=True)
class Node:
  """One tape entry. `parents` are the gradient edges (a Node, a leaf Tensor that requires grad, or None);
  `saved` holds only the inputs the VJP reads (the others as Avals) and `out`, detached so the tape
  holds no cycle, when the VJP reads the output. `versions` catch in-place changes to what was saved."""
  op: Op
  attrs: dict[str, Any]
  parents: tuple
  saved: tuple | None
  versions: tuple
  out: Tensor | None
  retained: Any = None  # weakref to the output when retain_grad() asked for its .grad
  hooks: list | None = None
  freed: bool = False


def _device_of(op_: Op, inputs) -> tuple[Any, bool]:
  """The device the op runs on, and whether CPU scalars ride along with tensors of another device."""
  dev = None
  for t in inputs:
    if t is None: continue
    d = t._storage.device
    if dev is None: dev = d
    elif d is not dev and d != dev: return _scalars_device(op_, inputs), True
  return dev, False


def is_cpu_scalar(t: Tensor) -> bool:
  """A 0-d CPU tensor that needs no gradient: it may join tensors of another device in an op whose kernel there takes
  it by value (`host_scalars`), as PyTorch's CPU scalars do; Python numbers become such tensors (`ops.scalar`)."""
  return not t.shape and t._storage.device.type == "cpu" and not t.requires_grad


def _scalars_device(op_: Op, inputs):
  """The one device of the inputs other than CPU scalars; several are an error."""
  dev = None
  for t in inputs:
    if t is None or is_cpu_scalar(t): continue
    d = t._storage.device
    if dev is None: dev = d
    elif d is not dev and d != dev: _device_error(op_, inputs)
  if dev is None: _device_error(op_, inputs)
  return dev


def _device_error(op_: Op, inputs):
  desc = ", ".join(f"{tuple(t.shape)} {t.dtype.name} on {t.device}" for t in inputs if t is not None)
  raise RuntimeError(f"{op_.name}: expected all tensors on one device, got {desc}. Move them with .to(device).")


def _record(op_: Op, inputs, attrs, out: Tensor) -> None:
  """Make out the result of a tape node of op_ on inputs (at least one requires grad)."""
  keep, parents, saved, versions = op_.saves, [], [], []
  for i, t in enumerate(inputs):
    if t is None: parents.append(None); saved.append(None); continue
    parents.append((t if t._node is None else t._node) if t.requires_grad else None)
    if keep is None or i in keep: saved.append(t); versions.append((t, t._storage.version))
    else: saved.append(Aval(t.shape, t.dtype, t._storage.device))
  saved_out = None
  if op_.saves_output:
    saved_out = out.detach()
    versions.append((saved_out, saved_out._storage.version))
  out.requires_grad = True
  out._node = Node(op_, attrs, tuple(parents), tuple(saved), tuple(versions), saved_out)


def apply(op_: Op, *inputs: Tensor | None, into: Tensor | None = None, device=None, rng=None, **attrs) -> Tensor:
  """Run a primitive: check devices, infer the output by the op's rule, run the backend kernel (or make a
  view), and record a tape node when gradients are needed. Under a Nova capture the op is recorded into the
  graph instead of run. `rng` names the generator a random op draws from (capture makes its state an input).

  `into` (in-place ops pass their tensor) may receive the result instead of a new tensor: when the backend's kernel
  writes into an `out=` array (its `writes_out`), no node is needed and `can_write_into` allows it, the result is
  stored in into's memory (cast to its dtype), its version is bumped and `into` is returned. Otherwise a new tensor
  is returned, which the caller writes (`ops.inplace`)."""
  if autocast_state.cast is not None: inputs = autocast_state.cast(op_.name, inputs)
  grad = grad_mode.enabled
  if grad:
    for t in inputs:
      if t is not None and t._base is not None and t._base._node is not t._base_node: refresh_view(t)
  dev, scalars = _device_of(op_, inputs)
  dev = dev or device
  shape, dtype = op_.rule(*inputs, **attrs)
  record = False
  if grad and op_.vjp is not None and op_.differentiable:
    for t in inputs:
      if t is not None and t.requires_grad: record = True; break
  if scalars and (capture.trace is not None or op_.view is not None): _device_error(op_, inputs)
  if capture.trace is not None:
    out = capture.trace.emit(op_, inputs, attrs, shape, dtype, dev, rng)
  elif op_.view is not None:
    x = inputs[0]
    vshape, strides, offset = op_.view(x, **attrs)
    out = Tensor._make(x._storage, vshape, strides, offset, dtype)
    out._base = base = x if x._base is None else x._base
    out._base_node = base._node
  else:
    kernel = backend.get(dev).kernels.get(op_.name)
    if kernel is None: raise NotImplementedError(f"{op_.name}: no kernel on the {dev.type} backend")
    if scalars and not getattr(kernel, "host_scalars", False): _device_error(op_, inputs)
    arrays = [None if t is None else t._array() for t in inputs]
    if (into is not None and not record and getattr(kernel, "writes_out", False)
        and can_write_into(into, shape, dtype, dev, inputs)):
      if profiling.session is None: kernel(*arrays, out=into._array(), **attrs)
      else:
        with op_timer(op_.name, dev, inputs): kernel(*arrays, out=into._array(), **attrs)
      into._storage.version += 1
      return into
    if profiling.session is None: result = kernel(*arrays, **attrs)
    else:
      with op_timer(op_.name, dev, inputs): result = kernel(*arrays, **attrs)
    out = Tensor._wrap(result, dev, dtype)
    assert out.shape == shape, f"{op_.name}: {dev.type} kernel returned shape {out.shape}, the rule says {shape}"
  if record: _record(op_, inputs, attrs, out)
  return out


def can_cast(src: DType, dst: DType) -> bool:
  """Whether an in-place op may store a `src` result in a `dst` tensor, as PyTorch's canCast: no float into an
  integer, nothing but bool into bool; narrower types of one kind are fine (int64 into int32 wraps around)."""
  return src.category <= dst.category


def can_write_into(out: Tensor, shape: Shape, dtype: DType, dev, inputs) -> bool:
  """Whether a result of (shape, dtype) on `dev` may go straight into out's memory as the kernel computes it: the
  same shape and device, a dtype that casts to out's, no element of out stored twice (a broadcast out), and every
  input in out's storage reading exactly the element it is written to or none that is written. Otherwise
  (`x[1:].add_(x[:-1])`) the result goes to a new tensor first, as if all were read before any write."""
  device = out._storage.device
  if out.shape != shape or not can_cast(dtype, out.dtype) or (device is not dev and device != dev): return False
  if 0 in out._strides and any(n > 1 and st == 0 for n, st in zip(out.shape, out._strides)): return False
  for t in inputs:
    if t is not None and t._storage is out._storage and not _aligned(t, out):
      (lo, hi), (out_lo, out_hi) = _span(t), _span(out)
      if lo < out_hi and out_lo < hi: return False
  return True


def _aligned(t: Tensor, out: Tensor) -> bool:
  """t addresses the same element as out at every index."""
  return (t.shape == out.shape and t._offset == out._offset and t.dtype is out.dtype
          and all(n == 1 or a == b for n, a, b in zip(out.shape, t._strides, out._strides)))


def _span(t: Tensor) -> tuple[int, int]:
  """The storage elements [lo, hi) that t may touch (empty when t has none)."""
  if 0 in t.shape: return t._offset, t._offset
  lo = t._offset + sum(st * (n - 1) for n, st in zip(t.shape, t._strides) if st < 0)
  return lo, t._offset + 1 + sum(st * (n - 1) for n, st in zip(t.shape, t._strides) if st > 0)


def refresh_view(t: Tensor) -> None:
  """A view whose root was changed in place since the view's node was made reads the root anew: its node
  becomes an index of the root's current graph (PyTorch regenerates such a view's grad_fn likewise)."""
  from blutrain.ops.movement import index_op, view_positions
  base = t._base
  fresh = index_op(base.reshape(-1), view_positions(t, base), positions=(0,))
  t._node, t.requires_grad, t._base_node = fresh._node, fresh.requires_grad, base._node


def write(x: Tensor, new: Tensor) -> None:
  """The last step of an in-place op that did not write itself: store `new` (of x's shape, in x's dtype or one that
  casts to it) into x's memory, bump its version."""
  if capture.trace is not None: capture.trace.write(x, new)
  elif profiling.session is None: backend.get(x.device).copy_into(x._array(), new._array())
  else:
    with record_function("copy_into", x.device): backend.get(x.device).copy_into(x._array(), new._array())
  x._storage.version += 1


def dynamic_scalar(value: Callable[[], float], device) -> float | Tensor:
  """A number that may change between calls of a compiled function without changing its graph, such as a
  scheduled learning rate: eagerly `value()`, under capture a 0-d float64 input read by `value()` at each call
  (float64, like a Python number: with a float32 tensor it gives float32)."""
  return value() if capture.trace is None else capture.trace.scalar_input(value, device)


