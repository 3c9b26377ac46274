"""Static memory planning: one arena for every intermediate of a step, offsets chosen from liveness.

Every value an op makes gets a lifetime, from the op that makes it to the last op that reads it (a value the step
returns lives to the end). Layout ops (view, permute, expand, slice) make views: they take no memory and stretch
their source's lifetime to their own last use. An elementwise op that reads an input for the last time writes into
its buffer, in place, and so does the cross-entropy backward into its logits (it reads a row whole before writing
it): a language model's largest tensor and its gradient share one buffer. Graph inputs (parameters, gradients, optimizer state, the batch) live where they already are
and take no arena memory either, nor do their new values where the step updates them element by element (the
optimizer's update writes parameters and moments where they live).

Offsets come from the "greedy by size" rule: the largest buffers are placed first, each at the lowest offset that
overlaps no placed buffer whose lifetime meets its own, choosing among the gaps the one that fits best. The plan
reports its arena size beside the lower bound no plan can beat, the most bytes live at one time.

A `cat` along its leading dim whose every operand (or the value a `view` of it reshapes) is made by a single-result op
and read for the last time by the cat computes its operands where its result will hold them: their buffers become
parts of the cat's, whose lifetime starts with the first of them, and the cat's kernel copies nothing (it skips an
input already in place). This is how the gradients of a data-parallel bucket are written straight into the bucket.

A collective runs on a stream of its own on the GPU, overlapping the ops after it until the first op that reads its
result (its join, `joins`): its input stays live until then, since the collective may still be reading it.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Attribute, SSAValue

from blutrain.nova.dialect import (CatOp, CollectiveOp, CrossEntropyBackwardOp, CrossEntropyBackwardWithStatsOp,
                                   CrossEntropyWithGradOp, ElementwiseOp, FusedOp, LayoutOp, NovaOp, ScaleOp, ViewOp,
                                   aval)
from blutrain.nova.ir import function

ALIGN = 512  # bytes: the CUDA caching allocator's rounding, and what vectorized kernels want


@dataclass(frozen=True)
class Buffer:
  """One planned allocation: the op that makes it, its bytes (aligned), its lifetime [first, last] in op positions
  and its offset in the arena. `made` is the position of the op that allocates it when that is not `first` (a cat's
  buffer lives from its first part on); a part of a cat's buffer names it and its byte offset there in `inside`."""
  name: str
  op: str
  nbytes: int
  first: int
  last: int
  offset: int = -1
  made: int = -1
  inside: tuple[str, int] | None = None

  @property
  def allocated_at(self) -> int:
    """The position of the op whose result takes this memory."""
    return self.first if self.made < 0 else self.made

  def meets(self, other: Buffer) -> bool:
    """Whether the two lifetimes share an op position (then they may not share memory)."""
    return self.first <= other.last and other.first <= self.last


@dataclass
class MemoryPlan:
  """Offsets of every intermediate in one arena. `arena` is the bytes to allocate; `lower_bound` the most bytes
  live at one op position, which no plan goes below."""
  buffers: list[Buffer] = field(default_factory=list)
  arena: int = 0
  lower_bound: int = 0

  def report(self) -> str:
    """The plan as text: a summary, then one line per buffer by offset."""
    lines = [f"arena {self.arena} bytes for {len(self.buffers)} buffers; live peak {self.lower_bound} bytes "
             f"({self.arena / max(self.lower_bound, 1):.3f}x)"]
    lines += [f"{b.offset:>12} {b.nbytes:>12} [{b.first}, {b.last}] {b.name} = {b.op}"
              + (f" (part of {b.inside[0]})" if b.inside else "")
              for b in sorted(self.buffers, key=lambda b: (b.offset, b.inside is not None, b.first))]
    return "\n".join(lines) + "\n"


_nbytes: dict[Attribute, int] = {}


def nbytes(v: SSAValue) -> int:
  """The bytes of a value's buffer, rounded up to ALIGN (cached by type, as `aval` is)."""
  if (n := _nbytes.get(v.type)) is None:
    a = aval(v.type)
    n = _nbytes[v.type] = -(-max(math.prod(a.shape) * a.dtype.itemsize, 1) // ALIGN) * ALIGN
  return n


def joins(ops: list) -> dict[int, int]:
  """The position of every collective among `ops` (a function's ops, its return last) -> the position of the first
  op that reads its result, a view of it included: where the stream that runs the collective joins the step's."""
  source: dict[SSAValue, int] = {}  # a collective's result, or a view of one -> the collective's position
  found: dict[int, int] = {}
  start = next((i for i, op in enumerate(ops) if isinstance(op, CollectiveOp)), len(ops))  # most steps have none
  for i, op in enumerate(ops[start:], start):
    for v in op.operands:
      c = source.get(v)
      if c is not None and c not in found and not isinstance(op, LayoutOp): found[c] = i
    if isinstance(op, LayoutOp) and op.x in source: source[op.result] = source[op.x]
    if isinstance(op, CollectiveOp): source[op.result] = i
  return {c: found.get(c, len(ops) - 1) for c in sorted(set(source.values()))}


def _liveness(ops: list) -> tuple[dict[SSAValue, tuple[int, str]], dict[SSAValue, int]]:
  """Where each op result is made (position, op name), and the last position that reads each value, a view's reads
  counting as reads of the value whose memory it views and a collective's read lasting until its join."""
  source: dict[SSAValue, SSAValue] = {}  # a view's value -> the value whose memory it reads
  made: dict[SSAValue, tuple[int, str]] = {}
  last: dict[SSAValue, int] = {}
  joined = joins(ops)
  for i, op in enumerate(ops):
    until = joined.get(i, i)
    for v in op.operands:
      v = source.get(v, v)
      last[v] = max(last.get(v, until), until)
    if isinstance(op, LayoutOp):
      source[op.result] = source.get(op.x, op.x)
    elif isinstance(op, NovaOp):
      for r in op.results: made[r] = (i, op.opname)
  return made, last


def lifetimes(module: ModuleOp, written: dict[int, int] | None = None) -> list[Buffer]:
  """The buffer of every value an op of the module's function makes. Views fold into their sources; an elementwise
  op whose input (not a view, not a graph input, of the same bytes) is read for the last time by it writes into that
  input's buffer, in place, as the kernels may when each element is read before it is written. The function's return
  is its last op, so a returned value lives to the end. `written` maps an output's position to the input position
  whose new value it is (an in-place update the runtime writes back): when the op making it reads that input for
  the last time and works element by element, the output takes the input's own memory and no arena buffer."""
  _, made, reused, spans = _spans(module, written)
  ops_of: dict[SSAValue, list[str]] = {v: [name] for v, (_, name) in made.items()}
  roots: dict[SSAValue, SSAValue] = {}
  for r, u in reused.items():  # in program order, so u's root already holds the ops before r
    roots[r] = root = roots.get(u, u)
    ops_of[root].append(ops_of.pop(r)[0])
  name = lambda v: f"op {made[v][0]} result {v.index}"  # noqa: E731
  return [Buffer(name(v), " > ".join(ops_of[v]), nbytes(v), first, last, made=at,
                 inside=None if part is None else (name(part[0]), part[1]))
          for v, first, last, at, part in spans]


def live_bytes(module: ModuleOp, written: dict[int, int] | None = None) -> list[int]:
  """The bytes of the buffers `lifetimes` plans that are alive at each op position (a part of a cat's buffer counts
  in the cat's): the lower bound of `plan`, position by position."""
  n, _, _, spans = _spans(module, written)
  events = [0] * (n + 1)
  for v, first, last, _, part in spans:
    if part is None:
      n = nbytes(v)
      events[first] += n
      events[last + 1] -= n
  return list(itertools.accumulate(events[:-1]))


def _spans(module: ModuleOp, written: dict[int, int] | None) -> tuple[int, dict, dict, list]:
  """What `lifetimes` builds its buffers from: the number of ops, `_liveness`'s `made`, `_reused`, and per planned
  buffer (its value, first and last position, the position that allocates it or -1, (the cat's result, the byte
  offset there) for a part of a cat's buffer, else None)."""
  block = function(module).body.block
  ops = list(block.ops)
  made, last = _liveness(ops)
  reused = _reused(ops, made, last)
  in_place_inputs = _written_in_place(block.args, ops, written or {}, made, last)
  parts = _concatenated(ops, made, last, reused, in_place_inputs)
  starts: dict[SSAValue, int] = {}
  for v, (cat, _) in parts.items(): starts[cat] = min(starts.get(cat, made[cat][0]), made[v][0])
  spans = [(v, starts.get(v, first), last.get(v, first), first if v in starts else -1, parts.get(v))
           for v, (first, _) in made.items() if v not in reused and v not in in_place_inputs]
  return len(ops), made, reused, spans


def _reused(ops: list, made: dict, last: dict) -> dict[SSAValue, SSAValue]:
  """The results written into the buffer of an operand they read for the last time (see `lifetimes`), each with that
  operand (for the cross-entropy backward, the value its logits view whole), in program order; extends the buffer's
  lifetime (`last` of its root) to theirs. A fused op's results each take a different operand (its kernel loads a
  block of every input before it stores any)."""
  reused: dict[SSAValue, SSAValue] = {}
  roots: dict[SSAValue, SSAValue] = {}  # a reused result -> the value whose buffer it takes (at the chain's start)
  for i, op in enumerate(ops):
    results = op.results
    if isinstance(op, (CrossEntropyBackwardOp, CrossEntropyBackwardWithStatsOp, CrossEntropyWithGradOp)):
      x = op.operands[1]
      candidates = [x.owner.x if isinstance(x.owner, ViewOp) else x]
      results = op.results[-1:]  # the gradient; cross_entropy_with_grad's loss is stored before the rows are read again
    elif isinstance(op, (ElementwiseOp, FusedOp)): candidates = list(op.operands)
    else: continue
    taken: set[SSAValue] = set()  # a fused op's results take distinct buffers
    for r in results:
      for u in candidates:
        root = roots.get(u, u)
        if last.get(root) == i and root not in taken and u in made and nbytes(u) == nbytes(r):
          reused[r], roots[r], last[root] = u, root, max(last[root], last.get(r, i))
          taken.add(root)
          break
  return reused


def _concatenated(ops: list, made: dict, last: dict, reused: dict, skip: dict) -> dict[SSAValue, tuple[SSAValue, int]]:
  """The buffers that become parts of a cat's (see the module docstring): operand -> (the cat's result, its byte
  offset there). An operand qualifies when it, or the value a `view` of it reshapes, is made by an op with one result
  (whose one planned slot cannot be taken by another result), is of the cat's dtype, starts and ends on ALIGN bytes,
  is read for the last time by the cat, and is neither written into another value's buffer nor an update of a graph
  input; the cat copies the operands that do not qualify."""
  parts: dict[SSAValue, tuple[SSAValue, int]] = {}
  for i, op in enumerate(ops):
    if not isinstance(op, CatOp) or any(d != 1 for d in aval(op.result.type).shape[:op.attrs()["dim"]]): continue
    offset, dtype = 0, aval(op.result.type).dtype
    for x in op.operands:
      v = x.owner.x if isinstance(x.owner, ViewOp) else x
      a = aval(v.type)
      exact = math.prod(a.shape) * a.dtype.itemsize
      if v in made and v not in reused and v not in skip and v not in parts and len(v.owner.results) == 1 \
         and a.dtype == dtype and offset % ALIGN == exact % ALIGN == 0 and last.get(v) == i:
        parts[v] = (op.result, offset)
      offset += exact
  return parts


def reused_in_place(module: ModuleOp) -> dict[SSAValue, SSAValue]:
  """The results the plan puts in the buffer of an operand they read for the last time, each with the operand of
  their own type that holds it (the value, or the cross-entropy backward's view of its logits): code generation
  writes them there (`out=`), so the plan's reuse happens. Results whose operand differs in dtype or shape (the same
  bytes) keep a buffer of their own at run time."""
  ops = list(function(module).body.block.ops)
  made, last = _liveness(ops)
  found = {}
  for r, u in _reused(ops, made, last).items():
    operand = u if u in r.owner.operands else r.owner.operands[1]  # the cross-entropy backward's view of u
    if operand.type == r.type: found[r] = operand
  return found


def _written_in_place(args, ops: list, written: dict[int, int], made: dict, last: dict) -> dict[SSAValue, SSAValue]:
  """The outputs that update an input in its own memory (see `lifetimes`), each with that input."""
  ret, found = ops[-1], {}
  for k, j in written.items():
    r, u = ret.operands[k], args[j]
    if r not in made: continue
    op = ops[made[r][0]]
    if (isinstance(op, (ElementwiseOp, ScaleOp, FusedOp)) or hasattr(op, "updated_operands")) and u in op.operands \
       and last.get(u) == made[r][0] and (not isinstance(op, FusedOp) or u.type == r.type):
      found[r] = u
  return found


def updated_in_place(module: ModuleOp, written: dict[int, int] | None = None) -> dict[SSAValue, SSAValue]:
  """The step's updates of its inputs that the plan puts in the inputs' own memory: new value -> the input (block
  argument) whose memory it takes. Code generation writes them there (`out=`), so no write-back copies them."""
  block = function(module).body.block
  ops = list(block.ops)
  return _written_in_place(block.args, ops, written or {}, *_liveness(ops))


def _best_fit(lo: np.ndarray, hi: np.ndarray, size: int) -> int:
  """The start of the smallest gap of at least `size` bytes between the taken byte ranges [lo, hi) (the lowest such
  gap at a tie), or the end of the last range when none fits."""
  order = np.lexsort((hi, lo))
  lo, hi = lo[order], hi[order]
  cursor = np.maximum.accumulate(np.concatenate(([0], hi)))  # cursor[i]: the end of the taken bytes before range i
  gaps = lo - cursor[:-1]
  fits = np.flatnonzero(gaps >= size)
  return int(cursor[-1] if not len(fits) else cursor[fits[np.argmin(gaps[fits])]])


def plan(module: ModuleOp, written: dict[int, int] | None = None) -> MemoryPlan:
  """Place every buffer of the module's function in one arena (see the module docstring and `lifetimes`)."""
  buffers = lifetimes(module, written)
  order = sorted((b for b in buffers if b.inside is None), key=lambda b: (-b.nbytes, b.first))
  first, last, lo, hi = (np.empty(len(order), np.int64) for _ in range(4))  # the placed buffers, as columns
  placed: list[Buffer] = []
  for n, b in enumerate(order):  # NOTE: each overlap test is one vectorized pass over the placed buffers
    meets = (first[:n] <= b.last) & (b.first <= last[:n])
    offset = _best_fit(lo[:n][meets], hi[:n][meets], b.nbytes)
    first[n], last[n], lo[n], hi[n] = b.first, b.last, offset, offset + b.nbytes
    placed.append(Buffer(b.name, b.op, b.nbytes, b.first, b.last, offset, b.made))
  hosts = {p.name: p.offset for p in placed}
  parts = [Buffer(b.name, b.op, b.nbytes, b.first, b.last, hosts[b.inside[0]] + b.inside[1], b.made, b.inside)
           for b in buffers if b.inside is not None]
  arena = max((p.offset + p.nbytes for p in placed), default=0)
  events: dict[int, int] = {}
  for p in placed:
    events[p.first] = events.get(p.first, 0) + p.nbytes
    events[p.last + 1] = events.get(p.last + 1, 0) - p.nbytes
  live = peak = 0
  for t in sorted(events):
    live += events[t]
    peak = max(peak, live)
  return MemoryPlan(placed + parts, arena, peak)
