"""Structural hashes of graphs: equal for graphs that compute the same thing, whatever their value names.

A value's hash covers what makes it: an input is its position and type; an equation's output is its op name, its
attributes, its type and the hashes of its inputs, in order; each result of a multi-output op covers the types of all
the op's results and its own index among them. So renaming values, reordering independent equations
or binding other tensors to the inputs keeps every hash; swapping the operands of `sub`, changing an attribute or a
dtype changes it. Hashes are hex digests of BLAKE2b (never Python's `hash`, which differs between processes), and
`FORMAT_VERSION` enters every graph key so that a change of this scheme invalidates caches on disk.

The disk cache of generated code is also keyed by `source_digest()`, a digest of the package's own source: generated
code calls kernels by name with the attributes of the day, so another version of blutrain (an upgrade, another
checkout sharing the cache directory) must not load it.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Iterable, Sequence

from blutrain.nova.graph import Equation, Graph, Value, literal

# 3: updates in place, a cuda target; 4: remat; 5: planned offsets; 6: gelu out=; 7: slots withdrawn;
# 8: overlapped collectives, fused gemms, norms and pointwise groups
FORMAT_VERSION = 8


def _digest(text: str) -> str: return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@functools.cache
def source_digest() -> str:
  """A short digest of every Python file of the blutrain package (their paths and bytes), computed once."""
  root = Path(__file__).resolve().parents[1]
  h = hashlib.blake2b(digest_size=8)
  for f in sorted(root.rglob("*.py")):
    h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
  return h.hexdigest()


def _type(v: Value) -> str: return f"{v.dtype.name}{list(v.shape)}"


def _input_hash(position: int, v: Value) -> str: return _digest(f"input {position} {_type(v)}")


def _propagate(equations: Iterable[Equation], hashes: dict[Value, str]) -> dict[Value, str]:
  """Extend `hashes` to every equation whose inputs all have a hash (in program order, so one sweep suffices)."""
  for eq in equations:
    try:
      args = ",".join("-" if v is None else hashes[v] for v in eq.inputs)
    except KeyError:
      continue
    attrs = ",".join(f"{k}={literal(eq.attrs[k])}" for k in sorted(eq.attrs))
    if len(eq.outs) == 1:
      hashes[eq.outs[0]] = _digest(f"{eq.op}|{attrs}|{_type(eq.outs[0])}|{args}")
      continue
    made = f"{eq.op}|{attrs}|{';'.join('-' if v is None else _type(v) for v in eq.outs)}|{args}"
    hashes.update((v, _digest(f"{made}#{i}")) for i, v in enumerate(eq.outs) if v is not None)
  return hashes


def value_hashes(graph: Graph) -> dict[Value, str]:
  """The structural hash of every input and equation output of `graph`."""
  return _propagate(graph.equations, {v: _input_hash(i, v) for i, v in enumerate(graph.inputs)})


def graph_key(graph: Graph) -> str:
  """The key of a whole graph: the input types in order (the calling convention) and the output hashes in order."""
  hashes = value_hashes(graph)
  missing = [v for v in graph.outputs if v not in hashes]
  if missing: raise ValueError(f"graph_key: outputs {missing} are neither inputs nor computed from them")
  signature = " ".join(_type(v) for v in graph.inputs)
  return _digest(f"nova v{FORMAT_VERSION}|{signature}|" + ",".join(hashes[v] for v in graph.outputs))


def subgraph_hash(graph: Graph, outputs: Sequence[Value], inputs: Sequence[Value]) -> str:
  """The hash of the subgraph that computes `outputs` from `inputs`, each input hashed by its position in `inputs`.

  Two transformer blocks of one model hash equal when given their own block input and parameters in the same
  order. Raises ValueError when an output depends on a graph input that is not among `inputs`.

  Args:
    graph: the graph holding the subgraph.
    outputs: the values the subgraph computes, in order.
    inputs: its boundary values (graph inputs or values computed outside it), in order.
  """
  hashes = _propagate(graph.equations, {v: _input_hash(i, v) for i, v in enumerate(inputs)})
  for out in outputs:
    if out not in hashes: raise ValueError(f"subgraph_hash: {out!r} {_missing(graph, out, hashes)}")
  return _digest(f"nova-subgraph v{FORMAT_VERSION}|" + ",".join(hashes[v] for v in outputs))


def _missing(graph: Graph, out: Value, hashes: dict[Value, str]) -> str:
  """Say which value outside the subgraph `out` depends on (for the error message)."""
  producer = {v: eq for eq in graph.equations for v in eq.outs if v is not None}
  stack = [out]
  while stack:
    v = stack.pop()
    if v in hashes: continue
    if v not in producer: return f"depends on {v!r}, which is neither among the inputs nor computed from them"
    stack.extend(u for u in producer[v].inputs if u is not None)
  return "cannot be hashed"
