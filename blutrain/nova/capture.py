"""Capture: run a Python function on symbolic tensors through the op library and record one Graph.

While a Trace is active, `ops.apply` hands every primitive to `Trace.emit`, which appends an equation and
returns a tensor whose storage is `Traced` (no values). Forward ops, the VJPs that `backward()` runs and the
optimizer's update all arrive this way, so the graph holds the whole step. Concrete tensors that the function
reads (parameters, gradients, optimizer state) become graph inputs; in-place writes into them (`ops.write`)
become outputs that the runtime copies back; gradients assigned to `.grad` become outputs too, and so do tensors the
function creates and keeps (an optimizer's first state, a lazily made buffer: `Trace.finish`'s `created`), which the
runtime then gives the values computed.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from blutrain import dtypes
from blutrain.nova.graph import Equation, Graph, Value
from blutrain.shapes import contiguous_strides
from blutrain.tensor import Storage, Tensor, Traced


# *** where the runtime finds each input (and each write-back target) at a call ***

@dataclass(frozen=True)
class Arg:
  """The i-th tensor among the call's flattened arguments."""
  index: int
  def tensor(self, args: list) -> Tensor: return args[self.index]
  def storage_of(self, args: list) -> Storage: return args[self.index]._storage


@dataclass(frozen=True)
class Ref:
  """Memory that lives across calls (a parameter, optimizer state): its storage and the layout read. Any
  tensor object viewing it that way (the parameter, a `.detach()` of it) reads the same values."""
  storage: weakref.ref
  layout: tuple

  def tensor(self, args: list) -> Tensor: return Tensor._make(self.storage_of(args), *self.layout)

  def storage_of(self, args: list) -> Storage:
    storage = self.storage()
    if storage is None: raise StaleGraph("memory the compiled graph reads was freed")
    return storage


@dataclass(frozen=True)
class GradOf:
  """The current `.grad` of a parameter (a new tensor object each step when grads are set to None)."""
  param: weakref.ref
  def tensor(self, args: list) -> Tensor:
    p = self.param()
    if p is None or p.grad is None: raise StaleGraph("a gradient the compiled graph reads is gone")
    return p.grad
  def storage_of(self, args: list) -> Storage: return self.tensor(args)._storage


@dataclass(frozen=True)
class Scalar:
  """A dynamic scalar (`ops.dynamic_scalar`), read by calling `value` at each call."""
  value: Callable[[], float]
  def array(self, args: list) -> np.ndarray: return np.asarray(self.value(), np.float64)


@dataclass(frozen=True)
class Rng:
  """A generator's (seed, offset) at the start of a call."""
  generator: Any
  def array(self, args: list) -> np.ndarray: return np.array([self.generator.seed, self.generator.offset], np.int64)


class StaleGraph(RuntimeError):
  """The objects a compiled graph was captured against changed; the runtime recaptures."""


def _layout(t: Tensor) -> tuple:
  return (id(t._storage), t.shape, t._strides, t._offset, t.dtype)


class Trace:
  """One capture in progress. `grad_owner` maps id(p.grad) -> p for parameters whose gradients exist."""

  def __init__(self, device, grad_owner: dict[int, Tensor] | None = None):
    self.graph = Graph(device=device)
    self.sources: list = []                      # one per graph input
    self.writes: dict[tuple, tuple] = {}         # layout -> (source, final value) of concrete tensors written
    self.leaves: dict[int, Tensor] = {}          # concrete tensors that require grad, read by the graph
    self.rng: dict[int, list] = {}               # id(generator) -> [generator, input value, first offset]
    self._current: dict[tuple, Value] = {}       # layout of a concrete tensor -> its value now
    self._source_of: dict[tuple, Any] = {}
    self._written: dict[int, tuple] = {}         # id(storage) -> the one layout written through
    self._grad_owner = grad_owner or {}
    self._ids = itertools.count()
    self.ran_backward = False                    # set by autograd: the step differentiates inside the graph

  # *** values ***

  def _new(self, shape, dtype) -> Value:
    return Value(next(self._ids), tuple(shape), dtype)

  def _input(self, shape, dtype, source) -> Value:
    v = self._new(shape, dtype)
    self.graph.inputs.append(v)
    self.sources.append(source)
    return v

  def _traced(self, v: Value, device) -> Tensor:
    return Tensor._make(Storage(Traced(v), device), v.shape, contiguous_strides(v.shape), 0, v.dtype)

  def bind_arg(self, index: int, t: Tensor) -> None:
    """Make argument `index` of the call a graph input."""
    key = _layout(t)
    if key not in self._current:
      self._source_of[key] = Arg(index)
      self._current[key] = self._input(t.shape, t.dtype, Arg(index))

  def value(self, t: Tensor) -> Value:
    """The graph value a tensor stands for; a concrete tensor read for the first time becomes an input."""
    data = t._storage.data
    if type(data) is Traced:
      if data.stale:
        raise RuntimeError(f"bt.compile: a tensor of shape {tuple(t.shape)} computed inside the compiled function is "
                           "read after one of its views was updated in place, which is not supported; build the "
                           "result out of place (e.g. with cat or where), or update the whole tensor")
      return data.value
    key = _layout(t)
    written = self._written.get(key[0])
    if written is not None and written != key:
      raise RuntimeError(f"bt.compile: a tensor of shape {tuple(t.shape)} is read through a different view of memory "
                         "that the compiled function updated in place; read it through the view that was updated")
    v = self._current.get(key)
    if v is None:
      owner = self._grad_owner.get(id(t))
      source = GradOf(weakref.ref(owner)) if owner is not None else \
               Ref(weakref.ref(t._storage), (t.shape, t._strides, t._offset, t.dtype))
      self._source_of[key] = source
      v = self._current[key] = self._input(t.shape, t.dtype, source)
      if t.requires_grad and t._node is None: self.leaves[id(t)] = t
    return v

  def scalar_input(self, value: Callable[[], float], device) -> Tensor:
    return self._traced(self._input((), dtypes.float64, Scalar(value)), device)

  # *** the hooks ops call ***

  def emit(self, op, inputs, attrs, avals, device, rng) -> Tensor | tuple[Tensor | None, ...]:
    """Record `op` applied to `inputs` as one equation and return its traced result: a tensor, or for a multi-output
    op (`avals` a list of (shape, dtype), None for an absent result) a tuple with one tensor per result."""
    if op.name == "to_device":
      raise RuntimeError("bt.compile: .to(device) inside a compiled function is not supported; move tensors before the call")
    ins = [None if t is None else self.value(t) for t in inputs]
    if rng is not None:
      attrs = dict(attrs)
      attrs.pop("seed")
      state = self.rng.get(id(rng))
      if state is None:
        state = self.rng[id(rng)] = [rng, self._input((2,), dtypes.int64, Rng(rng)), attrs["offset"]]
      attrs["offset"] -= state[2]
      ins = [*ins, state[1]]  # a random op's last operand is its generator's state, after its tensors (dropout's x)
    outs = [None if a is None else self._new(*a) for a in (avals if op.multi else [avals])]
    self.graph.equations.append(Equation(op.name, ins, dict(attrs), outs))
    if op.multi: return tuple(None if v is None else self._traced(v, device) for v in outs)
    t = self._traced(outs[0], device)
    if op.view is not None:
      # a view has the layout its rule gives, as eagerly (and at run time), so that `.contiguous()` and `reshape` record
      # the copies they make in the graph, where the memory plan places them
      _, strides, offset = op.view(inputs[0], **attrs)
      if strides is not None: t._strides, t._offset = tuple(strides), offset
      if type(inputs[0]._storage.data) is Traced:  # in the graph a view is a new value
        inputs[0]._storage.data.viewed, t._storage.data.view_of = True, inputs[0]._storage.data
    return t

  def write(self, x: Tensor, new: Tensor) -> None:
    """An in-place op's result: rebind a traced tensor, or record a write-back into a concrete one."""
    v = self.value(new)
    data = x._storage.data
    if type(data) is Traced:
      base = data.view_of
      while base is not None:  # the update reaches the view only: reading its bases later would miss it
        base.stale, base = True, base.view_of
      if data.viewed:
        raise RuntimeError(f"bt.compile: in-place update of a tensor of shape {tuple(x.shape)} whose views are still in "
                           "use; update it before taking views, or use an out-of-place op")
      x._storage.data = Traced(v)
      x._strides, x._offset = new._strides, new._offset  # it now stands for new's value, laid out as new is
      return
    key = _layout(x)
    written = self._written.setdefault(key[0], key)
    if written != key:
      raise RuntimeError(f"bt.compile: two different views of one tensor (shape {tuple(x.shape)}) are updated in "
                         "place; update the whole tensor, or one view only")
    if key not in self._source_of: self.value(x)
    self._current[key] = v
    self.writes[key] = (self._source_of[key], v)

  # *** the end of a capture ***

  def finish(self, returned: list[Tensor], created: list[Tensor] = ()) -> list[tuple]:
    """Set the graph's outputs and say what the runtime does with each: ("return", i), ("new", tensor): a traced
    tensor in `created` to be given real storage holding its value, ("write", source), ("grad", param ref). Also
    rewinds each generator to where the call started, as the replay draws again."""
    spec = []
    for i, t in enumerate(returned):
      self.graph.outputs.append(self.value(t))
      spec.append(("return", i))
    for t in created:
      self.graph.outputs.append(self.value(t))
      spec.append(("new", t))
    for source, v in self.writes.values():
      self.graph.outputs.append(v)
      spec.append(("write", source))
    for leaf in self.leaves.values():
      if leaf.grad is not None and type(leaf.grad._storage.data) is Traced:
        self.graph.outputs.append(leaf.grad._storage.data.value)
        spec.append(("grad", weakref.ref(leaf)))
    self.rng_advance = []
    for gen, _, first in self.rng.values():
      self.rng_advance.append((gen, gen.offset - first))
      gen.offset = first
    return spec
