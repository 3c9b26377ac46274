"""Pointwise fusion: maximal groups of elementwise ops over one output shape become one `nova.fused` op each, whose
body holds the group (the GPU runs it as one synthesized kernel, `blutrain/nova/synth.py`).

Before (a bias, GELU and a residual, the bias sum also read by the backward):

  %3 = nova.add %0, %1 : (tensor<8x32xf32>, tensor<32xf32>) -> tensor<8x32xf32>
  %4 = nova.gelu %3 {approximate = "tanh"} : (tensor<8x32xf32>) -> tensor<8x32xf32>
  %5 = nova.add %4, %2 : (tensor<8x32xf32>, tensor<8x32xf32>) -> tensor<8x32xf32>
  func.return %3, %5 : tensor<8x32xf32>, tensor<8x32xf32>

After:

  %3, %4 = nova.fused %0, %1, %2 : (...) -> (tensor<8x32xf32>, tensor<8x32xf32>) {
  ^bb0(%5: tensor<8x32xf32>, %6: tensor<32xf32>, %7: tensor<8x32xf32>):
    %8 = nova.add %5, %6 : (tensor<8x32xf32>, tensor<32xf32>) -> tensor<8x32xf32>
    %9 = nova.gelu %8 {approximate = "tanh"} : (tensor<8x32xf32>) -> tensor<8x32xf32>
    %10 = nova.add %9, %7 : (tensor<8x32xf32>, tensor<8x32xf32>) -> tensor<8x32xf32>
    nova.yield %8, %10 : tensor<8x32xf32>, tensor<8x32xf32>
  }

Rules:
- Members are `ElementwiseOp`s (unary, binary with broadcasting, compare, where, cast, copy, gelu, gelu_backward)
  whose results all have the group's shape; an operand of another shape (a bias) is an input that broadcasts.
  Reductions, views (a broadcast `expand` included: its result is a strided view the kernel reads by strides),
  random draws, multi-result ops and other passes' fused ops are never members, so nothing crosses them.
- A value used outside the group (or returned) is one of the fused op's results; the others live in registers.
- Splats (`nova.full`) read by members are copied into the body as constants: the one recompute, free (a literal
  in the kernel instead of a load); a splat left without readers goes.
- Groups grow in program order and stand where their last member stood: an op joins the groups of the members it
  reads (merging them) only if no op outside them read one of their values before it, so every input of a group
  is made before it and every reader comes after (no cycle through another op or group). Otherwise it starts a
  group of its own.
- A group reads at most MAX_INPUTS tensors and holds at most MAX_MEMBERS ops; an op that would take a group past
  either starts a group of its own. Triton's compile time grows faster than linearly in a kernel's size (an LSTM's
  weight gradient summed over 256 steps in one kernel of 256 inputs took 28 s to compile), while splitting a long
  chain costs one more write and read of its partial result per MAX_INPUTS inputs it reads.
- A group of one elementwise op stays as it is.
"""
from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, Operation, Region, SSAValue

from blutrain.nova.dialect import ElementwiseOp, FullOp, FusedOp, YieldOp
from blutrain.nova.ir import function
from blutrain.nova.passes.base import NovaPass

MAX_INPUTS, MAX_MEMBERS = 16, 64


class _Group:
  """Members in program order, all of one result shape, and the tensors they read from outside the group."""
  __slots__ = ("ops", "shape", "inputs")

  def __init__(self, op: ElementwiseOp):
    self.ops, self.shape, self.inputs = [op], op.result.type.get_shape(), _outside_reads([op], {op})


def _outside_reads(ops, members) -> set[SSAValue]:
  return {v for m in ops for v in m.operands if v.owner not in members and not isinstance(v.owner, FullOp)}


def _merged_inputs(groups: list[_Group], op: Operation) -> set[SSAValue] | None:
  """The inputs of `groups` and `op` as one group, or None when that group would pass MAX_INPUTS or MAX_MEMBERS."""
  if sum(len(g.ops) for g in groups) + 1 > MAX_MEMBERS: return None
  members = {op, *(m for g in groups for m in g.ops)}
  inputs = {v for g in groups for v in g.inputs if v.owner not in members} | _outside_reads([op], members)
  return inputs if len(inputs) <= MAX_INPUTS else None


def _read_early(groups: list[_Group], op: Operation, block: Block, pos: dict[Operation, int]) -> bool:
  """Whether an op outside `groups` and `op` reads a value of theirs before `op` does (a read inside another op's
  region counts at that op)."""
  inside = {m for g in groups for m in g.ops} | {op}
  p = pos[op]
  return any(u.operation not in inside and pos[block.find_ancestor_op_in_block(u.operation)] < p
             for g in groups for m in g.ops for u in m.result.uses)


def fuse(module: ModuleOp) -> int:
  """Fuse the module's pointwise groups (the rules in the module docstring); returns how many fused ops it made."""
  block = function(module).body.block
  ops = list(block.ops)
  pos = {op: i for i, op in enumerate(ops)}
  group_of: dict[Operation, _Group] = {}
  groups: list[_Group] = []
  for op in ops:
    if not isinstance(op, ElementwiseOp): continue
    shape = op.result.type.get_shape()
    near = list(dict.fromkeys(g for v in op.operands if (g := group_of.get(v.owner)) is not None and g.shape == shape))
    fits = next(((gs, inputs) for gs in ([near] if len(near) > 1 else []) + [[g] for g in near]
                 if not _read_early(gs, op, block, pos) and (inputs := _merged_inputs(gs, op)) is not None), None)
    if fits is None:
      group = _Group(op)
      groups.append(group)
    else:
      (group, *others), inputs = fits
      for g in others:
        group.ops += g.ops
        for m in g.ops: group_of[m] = group
        groups.remove(g)
      group.ops, group.inputs = sorted(group.ops + [op], key=pos.__getitem__), inputs
    group_of[op] = group
  made = 0
  for g in groups:
    if len(g.ops) > 1:
      _build(block, g)
      made += 1
  return made


def _build(block: Block, g: _Group) -> FusedOp:
  """Replace a group's members by one fused op before the last of them (the members' inputs are made before it,
  their readers come after it)."""
  members = set(g.ops)
  inputs: dict[SSAValue, None] = {}
  for m in g.ops:
    inputs.update((v, None) for v in m.operands if v.owner not in members and not isinstance(v.owner, FullOp))
  body = Block(arg_types=[v.type for v in inputs])
  env: dict[SSAValue, SSAValue] = dict(zip(inputs, body.args))
  for m in g.ops:
    for v in m.operands:
      if v not in env:  # a splat: copied into the body as a constant
        splat = v.owner.clone()
        body.add_op(splat)
        env[v] = splat.result
    clone = m.clone(value_mapper=env)
    body.add_op(clone)
    env[m.result] = clone.result
  outs = [m.result for m in g.ops if any(u.operation not in members for u in m.result.uses)]
  body.add_op(YieldOp.create(operands=[env[v] for v in outs]))
  fused = FusedOp.create(operands=list(inputs), result_types=[v.type for v in outs], regions=[Region(body)])
  block.insert_op_before(fused, g.ops[-1])
  for old, new in zip(outs, fused.results): old.replace_all_uses_with(new)
  splats = {v.owner for m in g.ops for v in m.operands if isinstance(v.owner, FullOp)}
  for m in reversed(g.ops): block.erase_op(m)
  for s in splats:
    if s.result.first_use is None: block.erase_op(s)
  return fused


@dataclass(frozen=True)
class FusePointwisePass(NovaPass):
  """Fuse maximal groups of elementwise ops into `nova.fused` ops (see the module docstring)."""
  name = "fuse-pointwise"

  def run(self, module: ModuleOp) -> bool: return fuse(module) > 0
