"""The tape and the modes ops run under.

A tape entry is a `Node`, micrograd's way: the op, its attributes, the gradient edges to its inputs and only the
values its VJP reads. `record` makes a tensor the output of a node; `blutrain.autograd.engine` walks the nodes back.

Ops run under modes kept here, one per thread: grad mode (`no_grad`), and three slots that higher layers fill and
`ops.apply` reads (a lower layer exposes the slot, the higher one fills it, as JAX's transforms do):
  hooks.trace      Nova's capture: ops are recorded into a graph instead of run (blutrain.nova.capture.Trace)
  hooks.autocast   amp's cast: (op name, inputs) -> the inputs cast by its policy (blutrain.amp)
  hooks.profile    the profiler's timer: (op name, device, inputs) -> a context manager around the kernel
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable

from blutrain.dtypes import DType
from blutrain.shapes import Shape
from blutrain.tensor import Tensor


# *** modes ***

class _GradMode(threading.local):
  enabled = True


grad_mode = _GradMode()


def is_grad_enabled() -> bool:
  """Whether ops record the tape in this thread (`bt.no_grad` turns it off)."""
  return grad_mode.enabled


class set_grad_enabled:
  """Context manager (and decorator) that turns gradient recording on or off, as torch.set_grad_enabled."""
  def __init__(self, mode: bool): self.mode, self.prev = bool(mode), []
  def __enter__(self): self.prev.append(grad_mode.enabled); grad_mode.enabled = self.mode
  def __exit__(self, *exc): grad_mode.enabled = self.prev.pop()

  def __call__(self, fn: Callable) -> Callable:
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


class inference_mode(set_grad_enabled):
  """`with bt.inference_mode():` or `@bt.inference_mode()`: no gradient recording (`mode=False`: recording on), as
  torch.inference_mode; tensors made inside are ordinary tensors (blutrain has no inference tensors)."""
  def __init__(self, mode: bool = True): super().__init__(not mode)


class _Hooks(threading.local):
  trace: Any = None                                  # Nova's capture in progress, or None: ops run
  autocast: Callable[[str, tuple], tuple] | None = None
  profile: Callable[..., Any] | None = None


hooks = _Hooks()


class autocast_suspended:
  """Run without autocast: VJPs do, so the backward runs in the forward's dtypes, as PyTorch's does."""
  def __enter__(self): self.prev, hooks.autocast = hooks.autocast, None
  def __exit__(self, *exc): hooks.autocast = self.prev


class capture_suspended:
  """Run ops for real during a Nova capture: a constant made from host data and kept across calls (`nn.spatial.
  constant`) must be a concrete tensor, which the graph then reads by reference."""
  def __enter__(self): self.prev, hooks.trace = hooks.trace, None
  def __exit__(self, *exc): hooks.trace = self.prev


# *** the tape ***

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
  op: Any  # blutrain.ops.core.Op: name, vjp, saves
  attrs: dict[str, Any]
  parents: tuple
  saved: tuple | None
  versions: tuple
  out: Tensor | None
  retained: Any = None  # weakref to the output when retain_grad() asked for its .grad
  hooks: list | None = None
  freed: bool = False


def record(op: Any, inputs, attrs: dict, out: Tensor) -> None:
  """Make `out` the result of a tape node of `op` on `inputs` (at least one requires grad)."""
  keep, parents, saved, versions = op.saves, [], [], []
  for i, t in enumerate(inputs):
    if t is None: parents.append(None); saved.append(None); continue
    parents.append((t if t._node is None else t._node) if t.requires_grad else None)
    if keep is None or i in keep: saved.append(t); versions.append((t, t._storage.version))
    else: saved.append(Aval(t.shape, t.dtype, t._storage.device))
  saved_out = None
  if op.saves_output:
    saved_out = out.detach()
    versions.append((saved_out, saved_out._storage.version))
  out.requires_grad = True
  out._node = Node(op, attrs, tuple(parents), tuple(saved), tuple(versions), saved_out)
