"""The op registry and `apply`, the one door every primitive goes through.

A primitive is an `Op`: a name, a signature, a rule from input tensors to the output's shape and dtype, a VJP
written with other ops (one gradient per input, None where there is none; a VJP that takes `needs` computes only
the gradients of the inputs that require one), and, for view ops, a layout rule that
makes the output share the input's storage. Kernels live in the backends, keyed by the op name. `apply` reads the
modes of `blutrain.autograd.tape` (grad mode, and the capture, autocast and profiler hooks that higher layers fill).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from blutrain import backend, dtypes
from blutrain.autograd.tape import grad_mode, hooks, record as tape_record
from blutrain.device import cpu
from blutrain.dtypes import DType
from blutrain.shapes import Shape
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
  vjp_needs: bool = False                    # the VJP takes `needs` (which inputs need a gradient) and returns None
                                             # for the others, so backward never runs a costly kernel for nothing
  view: Callable[..., tuple] | None = None  # (x, **attrs) -> (shape, strides, offset) sharing x's storage
  saves: tuple[int, ...] | None = None       # inputs the VJP reads (None: all); the rest reach it as Avals
  saves_output: bool = False                 # the VJP reads `out`; otherwise it gets None
  differentiable: bool = True                # False: outputs never require grad (comparisons, argmax)
  multi: bool = False                        # several outputs: the rule returns a list of (shape, dtype) (None for an
                                             # absent optional one), the kernel a tuple of arrays, apply a tuple of
                                             # tensors (no VJP yet)
  transfer: bool = False                     # the output lives on the device of the `target` attribute (to_device)
  inputs: tuple[str, ...] = ()               # operand names: `x`, `?w` optional, `*xs` variadic
  attrs: tuple[Attr, ...] = ()
  kernels: dict[str, Callable] = field(default_factory=dict, repr=False)  # device type -> kernel, filled by apply

  def __repr__(self) -> str: return f"Op({self.name})"


registry: dict[str, Op] = {}


def op(name: str, rule, vjp=None, *, inputs: str, attrs: str = "", **kw) -> Op:
  """Declare a primitive with its signature; its name is unique across the library, the backends and Nova's dialect."""
  assert name not in registry, f"op {name} declared twice"
  assert not (kw.get("multi") and vjp), f"op {name}: multi-output primitives have no VJP"
  registry[name] = o = Op(name, rule, vjp, **kw, **dict(zip(("inputs", "attrs"), parse_signature(inputs, attrs))))
  o.vjp_needs = vjp is not None and "needs" in inspect.signature(vjp).parameters
  return o


# *** apply ***

def _device_of(op_: Op, inputs) -> tuple[Any, bool]:
  """The device the op runs on, and whether CPU scalars ride along with tensors of another device."""
  if len(inputs) == 1 and inputs[0] is not None: return inputs[0]._storage.device, False
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


def _kernel(op_: Op, device) -> Callable:
  """The backend's kernel for op_ on device's type (cached on the op); NotImplementedError naming both if none."""
  k = backend.get(device).kernels.get(op_.name)
  if k is None: raise NotImplementedError(f"{op_.name}: no kernel on the {device.type} backend")
  op_.kernels[device.type] = k
  return k


def _profiled(op_: Op, kernel: Callable, device, inputs, arrays: list, attrs: dict):
  with hooks.profile(op_.name, device, inputs): return kernel(*arrays, **attrs)


def apply(op_: Op, *inputs: Tensor | None, into=None, device=None, rng=None, **attrs):
  """Run a primitive: check devices, infer the output by the op's rule, run the backend kernel (or make a
  view), and record a tape node when gradients are needed. Under a Nova capture the op is recorded into the
  graph instead of run. `rng` names the generator a random op draws from (capture makes its state an input).
  An op with several outputs (`Op.multi`) returns a tuple of tensors.

  `into` (in-place ops pass their tensor, or a sequence of tensors for a multi-output op) may receive the result
  instead of a new tensor: when the backend's kernel writes into an `out=` array (its `writes_out`), no node is
  needed and `can_write_into` allows it, the result is stored in into's memory (cast to its dtype), its version is
  bumped and `into` is returned. Otherwise new tensors are returned, which the caller writes (`ops.inplace`). A
  multi-output op's `into` has one entry per present output, None for one that is always new (its kernel's `out`
  holds None there): the result is then a tuple of into's tensors and new ones."""
  h = hooks
  if h.autocast is not None: inputs = h.autocast(op_.name, inputs)
  record = False
  if grad_mode.enabled:  # one pass: stale views read their root anew, then whether any input needs the tape
    differentiable = op_.vjp is not None and op_.differentiable
    for t in inputs:
      if t is None: continue
      if t._base is not None and t._base._node is not t._base_node: refresh_view(t)
      if differentiable and t.requires_grad: record = True
  dev, scalars = _device_of(op_, inputs)
  dev = dev or device
  avals = op_.rule(*inputs, **attrs)
  if scalars and (h.trace is not None or op_.view is not None): _device_error(op_, inputs)
  if h.trace is not None:
    out = h.trace.emit(op_, inputs, attrs, avals, dev, rng)
  elif op_.view is not None:
    x = inputs[0]
    vshape, strides, offset = op_.view(x, **attrs)
    out = Tensor._make(x._storage, vshape, strides, offset, avals[1])
    out._base = base = x if x._base is None else x._base
    out._base_node = base._node
  else:
    kernel = op_.kernels.get(dev.type) or _kernel(op_, dev)
    if scalars and not getattr(kernel, "host_scalars", False): _device_error(op_, inputs)
    arrays = [None if t is None else t._array() for t in inputs]
    in_place = (into is not None and not record and getattr(kernel, "writes_out", False)
                and _fits(into, avals, dev, inputs, op_))
    if in_place: attrs["out"] = _out_arrays(into, op_)
    result = kernel(*arrays, **attrs) if h.profile is None else _profiled(op_, kernel, dev, inputs, arrays, attrs)
    if in_place:
      if not op_.multi:
        into._storage.version += 1
        return into
      partial = False
      for t in into:
        if t is None: partial = True
        else: t._storage.version += 1
      if not partial: return into
      present = [(r, a) for r, a in zip(result, avals) if a is not None]  # as into: None where made new
      return tuple(Tensor._wrap(r, dev, a[1]) if t is None else t for t, (r, a) in zip(into, present))
    out_dev = attrs["target"] if op_.transfer else dev
    if op_.multi:  # an absent optional output is None in the rule's list and the kernel's tuple
      return tuple(None if r is None else Tensor._wrap(r, out_dev, a[1]) for r, a in zip(result, avals))
    out = Tensor._wrap(result, out_dev, avals[1])
    assert out.shape == avals[0], f"{op_.name}: {dev.type} kernel returned shape {out.shape}, the rule says {avals[0]}"
  if record: tape_record(op_, inputs, attrs if rng is None else {**attrs, "rng": rng}, out)  # a random VJP redraws
  return out


Op.__call__ = apply  # an op is called as `add_op(x, y)`, straight into apply


def _fits(into, avals, dev, inputs, op_: Op) -> bool:
  """Whether `into` may take the result as the kernel writes it (`can_write_into`; each output of a multi-output op
  that it produces, in order)."""
  if not op_.multi: return can_write_into(into, avals[0], avals[1], dev, inputs)
  avals = [a for a in avals if a is not None]
  if len(into) != len(avals): return False
  sharing: dict[int, list] = {}  # NOTE: a multi-tensor op has hundreds of outputs: check each against its own storage's
  for t in inputs:
    if t is not None: sharing.setdefault(id(t._storage), []).append(t)
  for t, (s, d) in zip(into, avals):
    if t is None: continue
    users = sharing.get(id(t._storage), ())
    if len(users) == 1 and users[0] is t and t.dtype is d and t.shape == s and (t._storage.device is dev) and \
       0 not in t._strides: continue  # an input updated in place, element for element (can_write_into's answer)
    if not can_write_into(t, s, d, dev, users): return False
  return True


def _out_arrays(into, op_: Op):
  return [None if t is None else t._array() for t in into] if op_.multi else into._array()


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
  for t in inputs:  # out itself (`x.add_(1)` when nothing records) reads each element where it is written
    if t is not None and t is not out and t._storage is out._storage and not _aligned(t, out):
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


def view_positions(x: Tensor, base: Tensor) -> Tensor:
  """The flat index in `base` of each element of `x`, a view of base's storage (from their layouts, not values)."""
  def storage_index(t: Tensor) -> np.ndarray:
    idx = np.full(t.shape, t._offset, dtype=np.int64)
    for d, (n, s) in enumerate(zip(t.shape, t._strides)):
      idx += (np.arange(n, dtype=np.int64) * s).reshape((n,) + (1,) * (t.ndim - d - 1))
    return idx
  at, of_base = storage_index(x), storage_index(base).reshape(-1)
  flat = np.zeros(max(at.max(initial=0), of_base.max(initial=0)) + 1, dtype=np.int64)
  flat[of_base] = np.arange(of_base.size)
  return Tensor._wrap(np.ascontiguousarray(flat[at]), cpu, dtypes.int64).to(base.device)


def refresh_view(t: Tensor) -> None:
  """A view whose root was changed in place since the view's node was made reads the root anew: its node
  becomes an index of the root's current graph (PyTorch regenerates such a view's grad_fn likewise)."""
  base = t._base
  fresh = registry["index"](base.reshape(-1), view_positions(t, base), positions=(0,))
  t._node, t.requires_grad, t._base_node = fresh._node, fresh.requires_grad, base._node


def write(x: Tensor, new: Tensor) -> None:
  """The last step of an in-place op that did not write itself: store `new` (of x's shape, in x's dtype or one that
  casts to it) into x's memory, bump its version."""
  if hooks.trace is not None: hooks.trace.write(x, new)
  elif hooks.profile is None: backend.get(x.device).copy_into(x._array(), new._array())
  else:
    with hooks.profile("copy_into", x.device, (new,)): backend.get(x.device).copy_into(x._array(), new._array())
  x._storage.version += 1


def dynamic_scalar(value: Callable[[], float], device) -> float | Tensor:
  """A number that may change between calls of a compiled function without changing its graph, such as a
  scheduled learning rate: eagerly `value()`, under capture a 0-d float64 input read by `value()` at each call
  (float64, like a Python number: with a float32 tensor it gives float32)."""
  return value() if hooks.trace is None else hooks.trace.scalar_input(value, device)


def autocast_inputs(name: str, *inputs):
  """`inputs` of op `name` cast as the active autocast's policy says (unchanged outside autocast); composites that
  PyTorch's autocast lists (linear, attention) call it, `apply` does for every primitive."""
  return inputs if hooks.autocast is None else hooks.autocast(name, inputs)


