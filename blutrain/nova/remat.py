"""Rematerialization: activations the backward reads are recomputed there instead of kept, when that lowers the
planned peak at a price the cost model accepts.

A training step's memory peaks where the forward ends and the backward begins: every activation the backward reads
is alive there. For a value v alive across the peak position t (made before t, not read at t, read again after t),
recomputing it right before its first read after t (position b) ends its lifetime at its last read before t. The
recomputation clones v's op, and the ops of its operands that are not alive at b anyway, back to values that are:
graph inputs (parameters, the batch, the generator state), values read at or after b, and views of those. Every
read of v, or of a view of v, from b on reads the clone.

The cost model: a candidate saves `bytes(v)` at the peak and costs `flops` (the cloned ops' FLOPs, `op_flops`),
`moved` (the bytes they read and write) and `seconds`, the sum of the clones' predicted times
(`configurator.kernel_seconds`: the roofline of their FLOPs and bytes, and a launch each; the ops recomputed are
memory-bound, so bytes price them, not FLOPs). Candidates are tried in order of bytes saved per second, and one is
kept when the planned live peak (or, at a tie, the number of positions at the peak) goes down:

  default          only O(elements) ops (elementwise, views, creation, random draws, layer_norm, batch_norm, softmax),
                   while the seconds added stay within `DEFAULT_TIME_SHARE` of the step's predicted time (the same
                   model summed over its ops);
  memory_budget    then any single-result op, without a FLOPs cap, until inputs + live peak, then inputs + arena, fit
                   the budget, or no candidate is left (the report then says by how much the step stays above it).

Random ops are recomputable because a draw is a function of (generator state, offset, shape, dtype): the clone reads
the same `rng` input and draws the same numbers (see the dialect's note on random ops). A gemm whose epilogue ends in a
GELU of a saved pre-activation (fuse-gemm's "save,gelu") is not cloned but its output recomputed as the GELU of the
saved value, which the backward keeps anyway: the same value, as the gemm rounded its pre-activation before the GELU.
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import BlockArgument, Operation, SSAValue

from blutrain import configurator
from blutrain.nova.dialect import (BatchNormOp, CollectiveOp, CreationOp, ElementwiseOp, FlashAttentionBackwardOp,
                                   FlashAttentionLseBackwardOp, FlashAttentionLseOp, FlashAttentionOp, GeluOp, GemmOp,
                                   GruSequenceBackwardOp, GruSequenceOp, LayerNormOp, LayoutOp, LogSoftmaxOp,
                                   LstmSequenceBackwardOp, LstmSequenceOp, MatmulOp, NovaOp, RandomOp, SingleResultOp,
                                   SoftmaxOp, aval)
from blutrain.nova.ir import function
from blutrain.nova.memory import live_bytes, nbytes, plan

DEFAULT_TIME_SHARE = 0.01  # the default recomputes at most this share of the step's predicted time
MAX_DEPTH = 8  # ops one recomputation may clone in a chain, so a candidate never recomputes half the forward
SEQUENCES = (LstmSequenceOp, LstmSequenceBackwardOp, GruSequenceOp, GruSequenceBackwardOp)
CHEAP = (ElementwiseOp, LayoutOp, CreationOp, RandomOp, LayerNormOp, BatchNormOp, SoftmaxOp, LogSoftmaxOp)
# FLOPs per output element of the elementwise and normalization ops that cost more than one
PER_ELEMENT = {"exp": 4, "log": 4, "sqrt": 2, "rsqrt": 2, "sin": 4, "cos": 4, "tanh": 4, "sigmoid": 4, "erf": 4,
               "pow": 4, "gelu": 8, "gelu_backward": 12, "layer_norm": 8, "layer_norm_backward": 12, "batch_norm": 8,
               "batch_norm_backward": 12, "softmax": 5, "log_softmax": 5, "cross_entropy": 5,
               "cross_entropy_backward": 5, "adamw": 12, "sgd": 4}


def _numel(v: SSAValue) -> int: return math.prod(aval(v.type).shape)


def op_flops(op: Operation) -> int:
  """An estimate of the FLOPs of one nova op: 2 per multiply-add of a matmul (a recurrent sequence's ones too),
  4 per q-k-v triple of attention (2.5 times that for its backward), `PER_ELEMENT` (default 1) per output element of
  the others, none for views."""
  if isinstance(op, LayoutOp) or not isinstance(op, NovaOp): return 0
  if isinstance(op, (MatmulOp, GemmOp)): return 2 * _numel(op.results[0]) * aval(op.operands[0].type).shape[-1]
  if isinstance(op, (FlashAttentionOp, FlashAttentionBackwardOp, FlashAttentionLseOp, FlashAttentionLseBackwardOp)):
    q, k = aval(op.q.type).shape, aval(op.k.type).shape
    work = 4 * math.prod(q) * k[-2]
    return work if isinstance(op, (FlashAttentionOp, FlashAttentionLseOp)) else 5 * work // 2
  if isinstance(op, SEQUENCES):  # a recurrent matmul per step (backward: three)
    L, N, G = aval(op.gi.type).shape
    return (2 if isinstance(op, (LstmSequenceOp, GruSequenceOp)) else 6) * L * N * G * aval(op.h0.type).shape[-1]
  return PER_ELEMENT.get(op.opname, 1) * sum(_numel(r) for r in op.results if r is not None)


def op_moved(op: Operation) -> int:
  """The bytes one nova op reads and writes (none for views)."""
  if isinstance(op, LayoutOp) or not isinstance(op, NovaOp): return 0
  return sum(nbytes(x) for x in (*op.operands, *op.results) if x is not None)


def op_seconds(op: Operation) -> float:
  """The predicted time of one nova op's kernel (`configurator.kernel_seconds`; none for views)."""
  if isinstance(op, LayoutOp) or not isinstance(op, NovaOp): return 0.0
  return configurator.kernel_seconds(op_flops(op), op_moved(op))


# *** the report ***

@dataclass
class Recomputed:
  """One decision: the value recomputed (its name in the IR after the pass, shape, dtype), the ops cloned to do it
  (outermost first), the bytes its early death frees, and the FLOPs, bytes and predicted seconds the clones add."""
  value: str
  shape: tuple[int, ...]
  dtype: str
  ops: list[str]
  nbytes: int
  flops: int
  moved: int
  seconds: float


@dataclass
class RematReport:
  """What `rematerialize` did. Peaks are live peaks of the arena (`memory.plan`'s lower bound) before and after;
  `inputs_bytes` the graph inputs, which stay where they are; `budget` the bytes asked for (None: default only) and
  `over_budget` how far inputs + arena stay above it (0 when it fits)."""
  saved: list[tuple[str, tuple[int, ...], str, str]] = field(default_factory=list)  # (name, shape, dtype, op)
  recomputed: list[Recomputed] = field(default_factory=list)
  peak_before: int = 0
  peak_after: int = 0
  arena_after: int = 0
  inputs_bytes: int = 0
  flops_added: int = 0
  step_flops: int = 0
  seconds_added: float = 0.0  # predicted, as the step's
  step_seconds: float = 0.0
  budget: int | None = None
  over_budget: int = 0
  seconds: float = 0.0

  def info(self) -> dict:
    """The summary `bt.compile(...).info["remat"]` holds."""
    return {"saved": [s[0] for s in self.saved], "recomputed": [r.value for r in self.recomputed],
            "bytes_saved": self.peak_before - self.peak_after, "flops_added": self.flops_added,
            "flops_share": self.flops_added / max(self.step_flops, 1), "seconds_added": self.seconds_added,
            "time_share": self.seconds_added / max(self.step_seconds, 1e-12), "live_peak_before": self.peak_before,
            "live_peak_after": self.peak_after, "inputs_bytes": self.inputs_bytes, "budget": self.budget,
            "over_budget": self.over_budget, "seconds": self.seconds}

  def report(self) -> str:
    """The report as text (the dump directory's remat.txt)."""
    share = self.flops_added / max(self.step_flops, 1)
    lines = [f"live peak {self.peak_before} -> {self.peak_after} bytes (saved {self.peak_before - self.peak_after}); "
             f"arena {self.arena_after}; inputs {self.inputs_bytes}; FLOPs added {self.flops_added} of "
             f"{self.step_flops} ({100 * share:.2f}%); predicted time added {self.seconds_added * 1e6:.1f} us of "
             f"{self.step_seconds * 1e6:.1f} ({100 * self.seconds_added / max(self.step_seconds, 1e-12):.2f}%)"]
    if self.budget is not None:
      lines.append(f"budget {self.budget} bytes: " + ("fits" if not self.over_budget else
                                                        f"{self.over_budget} bytes above it"))
    lines.append(f"recomputed ({len(self.recomputed)}):")
    lines += [f"  {r.value} {r.dtype}{list(r.shape)} = {' < '.join(r.ops)}  frees {r.nbytes} bytes, {r.flops} FLOPs, "
              f"{r.moved} bytes moved, {r.seconds * 1e6:.1f} us" for r in self.recomputed]
    lines.append(f"kept across the peak ({len(self.saved)}):")
    lines += [f"  {name} {dtype}{list(shape)} = {op}" for name, shape, dtype, op in self.saved]
    return "\n".join(lines) + "\n"


# *** liveness of values ***

class _Schedule:
  """The function's ops in order, where each value is made and read (a read of a view is a read of its source), and
  the live bytes of the planned buffers at each position."""

  def __init__(self, module: ModuleOp, written: dict[int, int] | None):
    self.block = function(module).body.block
    self.ops = list(self.block.ops)
    self.pos = {op: i for i, op in enumerate(self.ops)}
    self.root: dict[SSAValue, SSAValue] = {}
    self.reads: dict[SSAValue, list[int]] = {}
    for i, op in enumerate(self.ops):
      for v in op.operands: self.reads.setdefault(self.root.get(v, v), []).append(i)
      if isinstance(op, LayoutOp): self.root[op.result] = self.root.get(op.x, op.x)
    self.live = live_bytes(module, written)
    self.peak = max(self.live, default=0)
    self.at_peak = sum(1 for x in self.live if x == self.peak)
    self.templates: list[Operation] = []  # GELUs standing for gemm outputs in recipes, outside the block

  def key(self) -> tuple[int, int]: return self.peak, self.at_peak

  def last(self, v: SSAValue) -> int:
    reads = self.reads.get(self.root.get(v, v))
    return reads[-1] if reads else -1  # reads are in program order

  def made(self, v: SSAValue) -> int:
    return -1 if isinstance(v, BlockArgument) else self.pos[v.owner]


# *** one recomputation ***

@dataclass
class _Plan:
  value: SSAValue
  b: int  # the position of its first read after the peak
  chain: list[Operation]  # the ops to clone, operands first
  flops: int
  moved: int
  seconds: float
  a: int = -1  # the position of its last read before the peak (where it now dies)
  clone: SSAValue | None = None
  stands_for: dict[Operation, SSAValue] = field(default_factory=dict)  # a template op -> the gemm output it remakes

  def transient(self) -> int:
    """Bytes of the clones other than v's own, alive around b only."""
    return sum(nbytes(op.result) for op in self.chain[:-1] if not isinstance(op, LayoutOp))


def _recipe(s: _Schedule, v: SSAValue, b: int, cheap: bool) -> _Plan | None:
  """How to recompute v before position b from values alive there, or None when it cannot (or, with `cheap`, not
  with O(elements) ops alone, or not within MAX_DEPTH ops)."""
  chain: list[Operation] = []
  seen: set[Operation] = set()
  stands_for: dict[Operation, SSAValue] = {}

  def gelu_of_saved(x: SSAValue, op: GemmOp) -> bool:
    """x, a gemm's output GELU(saved pre-activation), remade by a GELU of the saved value when that is alive at b."""
    steps = op.attrs()["epilogue"].split(",")
    if x is not op.results[0] or steps[-2:] not in (["save", "gelu"], ["save", "gelu_tanh"]) or \
       len(chain) >= MAX_DEPTH or not need(op.results[-1], False):
      return False
    t = GeluOp.make([op.results[-1]], {"approximate": "tanh" if steps[-1] == "gelu_tanh" else "none"}, [x.type])
    s.templates.append(t)
    stands_for[t] = x
    seen.add(op)
    chain.append(t)
    return True

  def need(x: SSAValue, top: bool) -> bool:
    if not top and (isinstance(x, BlockArgument) or s.last(x) >= b): return True
    op = x.owner
    if op in seen: return True
    if isinstance(op, GemmOp): return gelu_of_saved(x, op)
    if not isinstance(op, SingleResultOp) or isinstance(op, CollectiveOp) or (cheap and not isinstance(op, CHEAP)) \
       or len(chain) >= MAX_DEPTH:
      return False
    seen.add(op)
    if not all(need(o, False) for o in op.operands): return False
    chain.append(op)
    return True

  if not need(v, True): return None
  costs = [(op_flops(op), op_moved(op)) for op in chain if not isinstance(op, LayoutOp)]
  seconds = sum(configurator.kernel_seconds(f, m) for f, m in costs)
  return _Plan(v, b, chain, sum(f for f, _ in costs), sum(m for _, m in costs), seconds, stands_for=stands_for)


def _across(s: _Schedule, t: int):
  """(value, reads) of the values an op makes before t, not read at t and read again after t, not by the return."""
  ret = len(s.ops) - 1
  for v, reads in s.reads.items():
    if isinstance(v, BlockArgument) or isinstance(v.owner, LayoutOp) or s.made(v) >= t: continue
    if t not in reads and t < reads[-1] and ret not in reads: yield v, reads


def _candidates(s: _Schedule, cheap: bool) -> list[_Plan]:
  """Recipes for the values alive across the first position at the peak, best (bytes per second) first."""
  t = s.live.index(s.peak)
  plans = []
  for v, reads in _across(s, t):
    b = next(i for i in reads if i > t)
    if (p := _recipe(s, v, b, cheap)) is not None:
      p.a = max((i for i in reads if i < t), default=s.made(v))
      plans.append(p)
  return sorted(plans, key=lambda p: (-nbytes(p.value) / max(p.seconds, 1e-12), p.moved))


def _apply(s: _Schedule, p: _Plan) -> tuple[list, list]:
  """Clone p's chain before position b and point every read of v (or of a view of v) from b on at the clones.
  Returns what `_undo` needs."""
  at = s.ops[p.b]
  mapping: dict[SSAValue, SSAValue] = {}
  clones = []
  for op in p.chain:
    c = op.clone(value_mapper=mapping)
    s.block.insert_op_before(c, at)
    mapping[p.stands_for.get(op, op.result)] = c.result
    clones.append(c)
  changed = []

  def remap(x: SSAValue) -> SSAValue | None:
    """x as read from b on: its clone, a clone of the views between it and v, or None when v is not under it."""
    if x in mapping: return mapping[x]
    if isinstance(x, BlockArgument) or not isinstance(x.owner, LayoutOp) or s.root.get(x) is not p.value \
        or s.made(x) >= p.b: return None  # a view made from b on reads the clones itself
    src = remap(x.owner.x)
    c = x.owner.clone(value_mapper={x.owner.x: src})
    s.block.insert_op_before(c, at)
    clones.append(c)
    mapping[x] = c.result
    return c.result

  p.clone = mapping[p.value]
  for op in dict.fromkeys(s.ops[i] for i in s.reads[p.value] if i >= p.b):  # the ops from b on reading v or its views
    for i, x in enumerate(op.operands):
      if (y := remap(x)) is not None:
        changed.append((op, i, x))
        op.operands = [*op.operands[:i], y, *op.operands[i + 1:]]
  return clones, changed


def _undo(s: _Schedule, record: tuple) -> None:
  clones, changed = record
  for op, i, x in reversed(changed): op.operands = [*op.operands[:i], x, *op.operands[i + 1:]]
  for c in reversed(clones): s.block.erase_op(c)


def _names(module: ModuleOp) -> dict[SSAValue, str]:
  """The names the printer gives the function's values (%0, %1, ...: block arguments, then results in order)."""
  block = function(module).body.block
  values = [*block.args, *(r for op in block.ops for r in op.results)]
  return {v: f"%{i}" for i, v in enumerate(values)}


def _mib(n: int) -> str: return f"{n / 2**20:.2f} MiB"


def _drop_dead(module: ModuleOp) -> int:
  """Erase the nova ops nothing reads; returns how many went."""
  block, dropped = function(module).body.block, 0
  for op in reversed(list(block.ops)):
    if isinstance(op, NovaOp) and all(r.first_use is None for r in op.results):
      block.erase_op(op)
      dropped += 1
  return dropped


# *** the pass ***

def rematerialize(module: ModuleOp, budget: int | None = None, written: dict[int, int] | None = None) -> RematReport:
  """Recompute activations in the backward, in place on `module` (see the module docstring for the cost model).

  Args:
    module: an optimized nova module of a whole step (forward, backward, optimizer).
    budget: bytes the step may take in all (its inputs plus the arena); None for the default, cheap recomputation.
    written: output position -> input position of the step's in-place updates, as `memory.plan` takes it.
  """
  t0 = time.perf_counter()
  block = function(module).body.block
  report = RematReport(budget=budget, step_flops=sum(op_flops(op) for op in block.ops),
                       step_seconds=sum(op_seconds(op) for op in block.ops),
                       inputs_bytes=sum(nbytes(a) for a in block.args))
  s = _Schedule(module, written)
  report.peak_before = s.peak
  plans: list[_Plan] = []

  def improve(s: _Schedule, cheap: bool, target: int | None) -> _Schedule:
    """Rounds of decisions until the live peak is at most `target` (None: as low as it goes) or a round gains
    nothing. A round takes the candidates at the peak in order and keeps each that lowers the peak (or the number of
    positions at it) of the live bytes as it estimates them: the value no longer alive between its last read before
    the peak and b, the clones of its operands alive at b. Then one replan checks the round; a round that made the
    plan worse is undone whole. A candidate that reads a value recomputed in the same round, or is read by its clones,
    waits for the next."""
    while target is None or s.peak > target:
      live = np.array(s.live, dtype=np.int64)
      records, kept, touched, added = [], [], set(), report.seconds_added
      for p in _candidates(s, cheap):
        if target is not None and live.max() <= target: break
        if cheap and added + p.seconds > DEFAULT_TIME_SHARE * report.step_seconds: continue
        reads = {s.root.get(o, o) for op in p.chain for o in op.operands}
        if p.value in touched or reads & touched: continue
        new = live.copy()
        new[p.a + 1:p.b] -= nbytes(p.value)
        new[p.b] += p.transient()
        if (new.max(), int((new == new.max()).sum())) < (live.max(), int((live == live.max()).sum())):
          records.append(_apply(s, p))
          kept.append(p)
          added += p.seconds
          touched |= reads | {p.value}
          live = new
      for t in s.templates: t.erase(safe_erase=False)  # cloned where kept; they must not stay users of their operands
      s.templates.clear()
      if not kept: return s
      after = _Schedule(module, written)
      if after.key() >= s.key():
        for record in reversed(records): _undo(s, record)
        return s
      plans.extend(kept)
      report.seconds_added = added
      report.flops_added += sum(p.flops for p in kept)
      s = after
    return s

  s = improve(s, True, None)
  if budget is not None:
    target = budget - report.inputs_bytes
    while True:
      s = improve(s, False, target)
      arena = plan(module, written).arena
      if report.inputs_bytes + arena <= budget or s.peak > target: break
      target = budget - report.inputs_bytes - (arena - s.peak)  # below s.peak: the arena's excess comes off it too
  if _drop_dead(module): s = _Schedule(module, written)  # else s, the last round's (or the one it undid), holds
  report.peak_after = s.peak
  report.arena_after = plan(module, written).arena
  if budget is not None:
    report.over_budget = max(0, report.inputs_bytes + report.arena_after - budget)
    if report.over_budget:  # once per compilation: a compiled step replays without coming here again
      warnings.warn(f"bt.compile: the step's planned memory ({_mib(report.inputs_bytes)} of inputs and a "
                    f"{_mib(report.arena_after)} arena) stays {_mib(report.over_budget)} above its memory budget of "
                    f"{_mib(budget)} after recomputing every activation it can; raise the budget or lower the batch "
                    "size", stacklevel=2)
  names = _names(module)
  for p in plans:
    a = aval(p.value.type)
    value = f"{names.get(p.value, '(dropped)')} -> {names.get(p.clone, '(dropped)')}"
    report.recomputed.append(Recomputed(value, a.shape, a.dtype.name,
                                        [op.opname for op in reversed(p.chain)], nbytes(p.value), p.flops, p.moved,
                                        p.seconds))
  for v, _ in _across(s, s.live.index(s.peak)):
    a = aval(v.type)
    report.saved.append((names[v], a.shape, a.dtype.name, v.owner.opname))
  report.seconds = time.perf_counter() - t0
  return report
