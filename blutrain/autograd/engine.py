"""Reverse-mode autodiff over the tape that `ops.apply` records: toposort, reverse walk, accumulate.

The walk computes with tensor methods (`+`, `.to`, `.clone`), which the op library attaches to Tensor from above,
and calls each node's VJP, which the op library wrote with its own ops: this module imports no op.
"""
from __future__ import annotations

import weakref
from typing import Callable, Sequence

from blutrain.autograd.tape import Node, autocast_suspended, hooks, no_grad
from blutrain.shapes import is_dense
from blutrain.tensor import Tensor

# the op library's multi-tensor cast (`ops.elementwise.cast_each`), which `ops.methods.attach` fills: the casts of
# leaves' gradients back to their dtype (autocast's parameters) wait for the walk's end and run as one op
cast_each: Callable | None = None


def _toposort(roots: Sequence[Node]) -> list[Node]:
  order, seen = [], set()
  for root in roots:
    stack = [(root, False)]
    while stack:
      node, expanded = stack.pop()
      if expanded: order.append(node); continue
      if id(node) in seen: continue
      seen.add(id(node))
      stack.append((node, True))
      # the first input is expanded first, so a weight's short branch (its transpose) runs right after its consumer
      stack.extend((p, False) for p in reversed(node.parents) if isinstance(p, Node) and id(p) not in seen)
  return order


def _check_saved(node: Node) -> None:
  if node.freed:
    raise RuntimeError(f"trying to backward through the graph a second time (at {node.op.name}); its saved values were "
                       "freed by the first backward. Pass retain_graph=True to the first backward.")
  for t, version in node.versions:
    if t._storage.version != version:
      raise RuntimeError(f"one of the tensors needed for gradient computation has been modified by an in-place "
                         f"operation: a tensor of shape {tuple(t.shape)} ({t.dtype.name}) saved by {node.op.name} is at "
                         f"version {t._storage.version}; expected version {version}. Use an out-of-place op instead.")


def _run_hooks(hooks, g: Tensor) -> Tensor:
  for hook in hooks or ():
    new = hook(g)
    if new is not None: g = new
  return g


def _accumulate(grads: dict, key: int, g: Tensor, owned: set[int] | None = None, fresh: bool = False) -> None:
  """grads[key] += g out of place; `owned` collects the ids of sums and of `fresh` gradients (memory this backward
  made and nothing else holds), which later slices of the same input may add into in place. An id leaves `owned`
  when its tensor leaves the store (`_take`), so a new tensor that Python places at a freed one's address is never
  taken for it."""
  prev = grads.get(key)
  grads[key] = total = g if prev is None else prev + g
  if owned is None: return
  if prev is not None: owned.discard(id(prev))
  if fresh or total is not g: owned.add(id(total))


def _grad_layout(g: Tensor, leaf: Tensor) -> bool:
  """Whether g may be a leaf's .grad as it is: contiguous, or dense in the leaf's own strides (a channels-last leaf
  keeps a channels-last gradient, as PyTorch's gradient layout contract has it); else it is cloned contiguous."""
  return g.is_contiguous() or (is_dense(g.shape, g._strides) and
                               all(a == b for n, a, b in zip(g.shape, g._strides, leaf._strides) if n != 1))


def _take(grads: dict, key: int, owned: set[int]):
  """Remove and return grads[key] (None if absent), forgetting that the backward owns it."""
  g = grads.pop(key, None)
  if g is not None: owned.discard(id(g))
  return g


def _add_into_slice(node: Node, g: Tensor, store: dict, owned: set[int]) -> bool:
  """For a slice node: add g into its input's gradient in place when that gradient is a buffer this backward owns,
  so the q, k, v slices of one projection fill one buffer instead of each making a zero-padded copy that adds sum."""
  acc = store.get(id(node.parents[0]))
  if acc is None or id(acc) not in owned or hooks.trace is not None: return False  # Nova fuses its own
  node.op(acc, **node.attrs).add_(g)  # the same slice of the gradient buffer
  return True


def _cast_deferred(leaf_grads: dict, leaves: dict, deferred: set) -> None:
  """Cast the gradients that wait for it (`deferred` ids) to their leaves' dtypes, one multi-tensor op per device and
  dtype: the same conversions as one `.to` each."""
  groups: dict[tuple, list[int]] = {}
  for key in deferred: groups.setdefault((leaves[key].device, leaves[key].dtype), []).append(key)
  for (_, dtype), keys in groups.items():
    for key, g in zip(keys, cast_each([leaf_grads[k] for k in keys], dtype)): leaf_grads[key] = g
  deferred.clear()


def _walk(roots: list[Node], root_grads: dict, retain_graph: bool, capture=frozenset(), ready=None):
  """Propagate gradients from the roots through every VJP. Returns the gradients reaching leaves (by id),
  the leaves themselves, and the total gradients of the nodes whose ids are in `capture`. With `ready`, a leaf's
  gradient is handed to `ready(leaf, g)` (and left out of the result) as soon as the last node that feeds it has run,
  so DDP can start reducing it while the rest of the backward runs; a leaf without hooks whose gradient waits for its
  cast (`_visit`) is handed over at the end, after the one cast of them all."""
  if hooks.trace is not None: hooks.trace.ran_backward = True  # the graph differentiates itself
  node_grads, leaf_grads, leaves, captured, owned = dict(root_grads), {}, {}, {}, set()
  deferred: set[int] | None = set() if cast_each is not None and hooks.trace is None else None
  order, pending, waiting = list(reversed(_toposort(roots))), {}, []
  if ready is not None:
    for node in order:
      for p in node.parents:
        if isinstance(p, Tensor): pending[id(p)] = pending.get(id(p), 0) + 1
  for node in order:
    try:
      _visit(node, node_grads, leaf_grads, leaves, captured, owned, retain_graph, capture, deferred)
    finally:
      for p in node.parents if ready is not None else ():
        if isinstance(p, Tensor):
          pending[id(p)] -= 1
          if not pending[id(p)] and id(p) in leaf_grads:
            if deferred and id(p) in deferred and not (p._hooks or p._post_hooks): waiting.append(p)
            else:
              _settle(leaf_grads, deferred, p)
              ready(leaves.pop(id(p)), _take(leaf_grads, id(p), owned))
  if deferred: _cast_deferred(leaf_grads, leaves, deferred)
  for p in waiting: ready(leaves.pop(id(p)), _take(leaf_grads, id(p), owned))
  return leaf_grads, leaves, captured


def _settle(leaf_grads: dict, deferred: set | None, leaf: Tensor) -> None:
  """Cast leaf's gradient now if it waits for its cast (another gradient is to be added to it, or a hook reads it)."""
  if deferred and id(leaf) in deferred:
    deferred.discard(id(leaf))
    leaf_grads[id(leaf)] = leaf_grads[id(leaf)].to(leaf.dtype)


def _free(node: Node) -> None:
  """Drop what a node kept for its VJP once the VJP has run (a second backward through it then raises)."""
  node.saved, node.out, node.versions, node.freed = None, None, (), True


def _visit(node: Node, node_grads: dict, leaf_grads: dict, leaves: dict, captured: dict, owned: set,
           retain_graph: bool, capture, deferred: set | None = None) -> None:
  """Run one node of the reverse walk: its hooks, its VJP, and the accumulation of its inputs' gradients. The first
  gradient of a leaf through a cast (autocast's parameter casts) is kept uncast, its id in `deferred`: `_walk` casts
  them all at once."""
  g = _take(node_grads, id(node), owned)
  if g is None: return
  if node.hooks: g = _run_hooks(node.hooks, g)
  if capture and id(node) in capture: captured[id(node)] = g
  if node.retained is not None and (t := node.retained()) is not None:
    t.grad = g.detach() if t.grad is None else t.grad + g
  _check_saved(node)
  is_slice = node.op.name == "slice" and node.parents[0] is not None
  if is_slice and _add_into_slice(node, g, node_grads if isinstance(node.parents[0], Node) else leaf_grads, owned):
    if not retain_graph: _free(node)
    return
  leaf = node.parents[0] if node.op.name == "cast" else None
  if deferred is not None and isinstance(leaf, Tensor) and id(leaf) not in leaf_grads:
    leaf_grads[id(leaf)], leaves[id(leaf)] = g, leaf  # the cast VJP, g.to(leaf.dtype), waits
    deferred.add(id(leaf))
    if not retain_graph: _free(node)
    return
  attrs = {**node.attrs, "needs": tuple(p is not None for p in node.parents)} if node.op.vjp_needs else node.attrs
  in_grads = node.op.vjp(g, node.out, *node.saved, **attrs)
  if len(in_grads) != len(node.parents):
    raise RuntimeError(f"VJP of {node.op.name} returned {len(in_grads)} gradients for {len(node.parents)} inputs")
  for parent, ig, inp in zip(node.parents, in_grads, node.saved):
    if parent is None or ig is None: continue
    if ig.shape != inp.shape:  # Size and Aval shapes compare as tuples
      raise RuntimeError(f"VJP of {node.op.name}: gradient of shape {ig.shape} for an input of shape {tuple(inp.shape)}")
    if ig.dtype is not inp.dtype: ig = ig.to(inp.dtype)
    if isinstance(parent, Node): _accumulate(node_grads, id(parent), ig, owned, is_slice)
    else:
      _settle(leaf_grads, deferred, parent)
      _accumulate(leaf_grads, id(parent), ig, owned, is_slice)
      leaves[id(parent)] = parent
  if not retain_graph: _free(node)


def _seed(outputs, grad_outputs, op_name: str):
  """Root nodes and their incoming gradients (ones for scalar outputs)."""
  roots, root_grads = [], {}
  for t, g in zip(outputs, grad_outputs):
    if not t.requires_grad or t._node is None:
      raise RuntimeError(f"{op_name}: a tensor of shape {t.shape} does not require grad or has no grad_fn: nothing to differentiate")
    if g is None:
      if t.numel() != 1: raise RuntimeError(f"{op_name}: grad can be implicitly created only for scalar outputs, got shape {t.shape}; pass a gradient")
      g = t.new_ones(t.shape)
    elif g.shape != t.shape:
      raise RuntimeError(f"{op_name}: gradient of shape {g.shape} does not match the tensor's shape {t.shape}")
    if t._node not in roots: roots.append(t._node)
    _accumulate(root_grads, id(t._node), g)
  return roots, root_grads


def backward(tensors: Sequence[Tensor], grad_tensors: Sequence[Tensor | None] | None = None,
             retain_graph: bool = False) -> None:
  """Accumulate the gradients of `tensors` (weighted by `grad_tensors`) into the `.grad` of every leaf."""
  tensors = list(tensors)
  grad_tensors = list(grad_tensors) if grad_tensors is not None else [None] * len(tensors)
  with no_grad(), autocast_suspended():
    direct = [(t, g if g is not None else t.new_ones(t.shape)) for t, g in zip(tensors, grad_tensors)
              if t.requires_grad and t._node is None]
    graphed = [(t, g) for t, g in zip(tensors, grad_tensors) if not (t.requires_grad and t._node is None)]
    roots, root_grads = _seed([t for t, _ in graphed], [g for _, g in graphed], "backward")
    # the storages handed to leaves so far, while alive: a post-accumulate-grad hook may free one (ZeRO-2 does), and a
    # set of ids would then take a new storage at the freed one's address for it and copy that gradient for nothing
    fresh: weakref.WeakSet = weakref.WeakSet()
    seeded = {id(t) for t, _ in direct}

    def store(leaf: Tensor, g: Tensor) -> None:
      g = _run_hooks(leaf._hooks, g).detach()
      if leaf.grad is not None: leaf.grad.add_(g)
      else:
        if not _grad_layout(g, leaf) or g._offset or g._storage in fresh: g = g.clone()  # own, dense memory
        fresh.add(g._storage)
        leaf.grad = g
      for hook in leaf._post_hooks or (): hook(leaf)

    ready = lambda leaf, g: store(leaf, g) if id(leaf) not in seeded else _accumulate(held, id(leaf), g)
    held: dict = {}
    leaf_grads, leaves, _ = _walk(roots, root_grads, retain_graph, ready=ready)
    for key, g in held.items(): _accumulate(leaf_grads, key, g)
    for t, g in direct:
      _accumulate(leaf_grads, id(t), g)
      leaves[id(t)] = t
    for key, g in leaf_grads.items(): store(leaves[key], g)


def grad(outputs, inputs, grad_outputs=None, retain_graph: bool | None = None, allow_unused: bool = False) -> tuple:
  """The gradients of `outputs` with respect to `inputs`, returned rather than accumulated into `.grad`."""
  outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
  inputs = [inputs] if isinstance(inputs, Tensor) else list(inputs)
  grad_outputs = [grad_outputs] if isinstance(grad_outputs, Tensor) else list(grad_outputs or [None] * len(outputs))
  with no_grad(), autocast_suspended():
    roots, root_grads = _seed(outputs, grad_outputs, "grad")
    leaf_grads, _, captured = _walk(roots, root_grads, bool(retain_graph),
                                    capture={id(t._node) for t in inputs if t._node is not None})
  result = []
  for i, t in enumerate(inputs):
    g = leaf_grads.get(id(t)) if t._node is None else captured.get(id(t._node))
    if g is None and not allow_unused:
      raise RuntimeError(f"grad: input {i} of shape {t.shape} is not reached from the outputs; pass allow_unused=True")
    result.append(g)
  return tuple(result)
