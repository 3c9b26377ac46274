"""Host code generation: an optimized nova module becomes the Python source of one readable function that calls a
backend's kernels, one line per op, for the CPU (numpy arrays) or the GPU (CudaArrays, kernel by kernel).

Primitives call the target backend's kernel (`kernels[name](*arrays, **attrs)`), as eager mode does; a multi-result
op's kernel returns a tuple, unpacked on its line. On the CPU each result is cast to the op's result dtype, as eager
mode does in `blutrain.backend.cpu.wrap` (kernels compute halves in float32 and may return other integer widths); CUDA
kernels return the op's dtype. Views, which have no kernel because eager mode makes them by striding, are the numpy
equivalents on the CPU (reshape, transpose, broadcast_to, basic slicing) and on the GPU the op's own layout rule
applied to the CudaArray (`cuda_view`). A value is deleted after its last use so that peak memory follows liveness.
On the GPU a collective runs on a side stream (`with overlapped() as eN:`), overlapping the ops after it, and the
step's stream waits for it (`join(eN)`) right before the first op that reads its result (`memory.joins`); its input
is deleted only after the join.
For example, on the CPU:

  def step(a0, a1):
    v2 = np.asarray(kernels["matmul"](a0, a1), float32)
    del a0
    v3 = v2.transpose((1, 0))
    del v2
    return (v3,)
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

import numpy as np
from xdsl.dialects.builtin import ModuleOp
from xdsl.dialects.func import ReturnOp
from xdsl.ir import SSAValue

from blutrain import dtypes
from blutrain.dtypes import DType
from blutrain.nova.dialect import (DTYPES, CrossEntropyBackwardOp, CrossEntropyBackwardWithStatsOp,
                                   CrossEntropyWithGradOp, ElementwiseOp, ExpandOp, FusedOp, GemmOp, LayoutOp,
                                   MultiResultOp, NovaOp, PermuteOp, RandomOp, ViewOp, aval)
from blutrain.nova.graph import dtype_name, literal
from blutrain.nova.ir import function
from blutrain.nova.loader import load  # noqa: F401  (generate and load are this module's pair)
from blutrain.nova.memory import MemoryPlan, joins
from blutrain.nova.passes.fuse_gemm import gemm_choice
from blutrain.nova.synth import Body, plan
from blutrain.shapes import contiguous_strides


def _slice(index) -> str:
  if not index: return "..."  # a 0-d array stays an array (x[()] would give a numpy scalar)
  return ", ".join(f"{a}:{b}" if c == 1 else f"{a}:{b}:{c}" for a, b, c in index)


def _view(op: LayoutOp, x: str, target: str) -> str:
  """A layout op as its numpy equivalent on the CPU (eager mode makes these views by striding, without a kernel), as
  `cuda_view` of the op on the GPU."""
  a = op.attrs()
  if target == "cuda": return f'view({x}, "{op.opname}", {literal(a)})'
  if isinstance(op, ViewOp): return f"{x}.reshape({literal(a['shape'])})"
  if isinstance(op, PermuteOp): return f"{x}.transpose({literal(a['dims'])})"
  if isinstance(op, ExpandOp): return f"np.broadcast_to({x}, {literal(a['shape'])})"
  return f"{x}[{_slice(a['index'])}]"


def _call(op: NovaOp, args: list[str], out: str | None, target: str, path: str | None = None) -> str:
  """The call of the op's kernel (writing into `out` when given); a random op's seed and absolute offset come from its
  generator state: read on the host on the CPU, by the kernel from device memory on the GPU (so that a CUDA graph
  replays with the generator's new offset); a gemm on the GPU is given its `path`."""
  a = op.attrs()
  if isinstance(op, RandomOp):
    rng = args[-1]
    kw = [f"{k}={literal(v)}" for k, v in a.items() if k != "offset"]
    if target == "cuda": kw += [f"state={rng}", f"offset={a['offset']}"]
    else: kw += [f"seed=int({rng}[0])", f"offset=int({rng}[1])" + (f" + {a['offset']}" if a["offset"] else "")]
    return f'kernels["{op.opname}"]({", ".join(args[:-1] + kw)})'
  kw = [f"{k}={literal(v)}" for k, v in a.items()] + ([f"out={out}"] if out else [])
  if path: kw.append(f"path={path!r}")
  return f'kernels["{op.opname}"]({", ".join(args + kw)})'


def _out(op: NovaOp, names: dict, in_place: dict, kernels: dict) -> str | None:
  """The `out=` argument that makes an op write its results into the inputs they update, where the memory plan puts
  them there (`memory.updated_in_place`) and the target's kernel writes into `out` arrays (its `writes_out`)."""
  if not in_place or not getattr(kernels.get(op.opname), "writes_out", False): return None
  if isinstance(op, (ElementwiseOp, CrossEntropyBackwardOp, CrossEntropyBackwardWithStatsOp, CrossEntropyWithGradOp)):
    u = in_place.get(op.results[-1])  # (the gradient, the cross-entropy's last result)
    return None if u is None else names[u]
  if hasattr(op, "updated_operands"):  # None where a result is always a new value (batch_norm_stats' statistics)
    updated = [None if j is None else op.operands[j] for j in op.updated_operands()]
    placed = [in_place.get(r) for r in op.results]  # None where the plan gives the result a buffer of its own
    if any(placed) and all(p is None or p is u for p, u in zip(placed, updated)):
      return f"({', '.join('None' if p is None else names[p] for p in placed)},)"
  return None


def _lines(op: NovaOp, args: list[str], outs: list[str | None], out_dtypes: list[DType | None], target: str,
           out: str | None) -> list[str]:
  """The lines computing one op into the names `outs` (None for an absent result), on the CPU each result cast to its
  dtype. A multi-result op's kernel returns a tuple: it is unpacked (`_` for an absent result), then cast."""
  if isinstance(op, LayoutOp): return [f"  {outs[0]} = {_view(op, args[0], target)}"]
  choice = gemm_choice(op) if target == "cuda" and isinstance(op, GemmOp) else None
  call = _call(op, args, out, target, choice and choice.path)
  if choice: call += f"  # {choice}"  # the configurator's prediction (`fuse_gemm.gemm_choice`)
  if not isinstance(op, MultiResultOp):
    if target == "cuda": return [f"  {outs[0]} = {call}"]
    return [f"  {outs[0]} = np.asarray({call}, {dtype_name(out_dtypes[0])})"]
  targets = ", ".join(o or "_" for o in outs) + ("," if len(outs) == 1 else "")
  if target == "cuda": return [f"  {targets} = {call}"]
  present = [(o, d) for o, d in zip(outs, out_dtypes) if o]
  casts = ", ".join(f"np.asarray({o}, {dtype_name(d)})" for o, d in present)
  return [f"  {targets} = {call}", f"  {', '.join(o for o, _ in present)} = {casts}"]


def _fused(op: FusedOp, names: dict, target: str, bodies: dict, used: set, in_place: dict) -> list[str]:
  """The lines of a fused group: on the GPU one call of its synthesized kernel (`synth.fused`, the body a
  module-level literal; results the plan puts in an operand's buffer are written there, `out=`), on the CPU its
  body's ops one by one with the numpy kernels, as eager mode runs them."""
  out = [in_place.get(r) for r in op.results]
  for r in op.results: names[r] = f"v{len(names)}"
  outs = ", ".join(names[r] for r in op.results) + ("," if len(op.results) == 1 else "")
  if target == "cuda":
    body = body_of(op)
    b = bodies.setdefault(body, f"B{len(bodies)}")
    shape = literal(aval(op.results[0].type).shape)
    targets = ", ".join("None" if u is None else names[u] for u in out) + ("," if len(out) == 1 else "")
    kw = f", out=({targets})" if any(out) else ""
    return [f"  {outs} = fused({b}, {shape}, {', '.join(names[v] for v in op.operands)}{kw})"]
  block = op.body.block
  names.update(zip(block.args, (names[v] for v in op.operands)))
  *members, end = block.ops
  names.update((v, names[r]) for r, v in zip(op.results, end.operands))
  lines, temps = [], []
  for m in members:
    if m.result not in names:
      names[m.result] = f"v{len(names)}"
      temps.append(names[m.result])
    d = DTYPES[m.result.type.element_type]
    used.add(d)
    lines += _lines(m, [names[v] for v in m.graph_inputs()], [names[m.result]], [d], target, None)
  if temps: lines.append(f"  del {', '.join(temps)}")
  return lines


TARGETS = ("cpu", "cuda")


def generate(module: ModuleOp, name: str = "step", target: str = "cpu",
             in_place: dict[SSAValue, SSAValue] | None = None, plan: MemoryPlan | None = None) -> str:
  """Python source of `def <name>(a0, a1, ...)` computing the module's function's results (a tuple of arrays) from
  arrays of the target backend (numpy arrays, or CudaArrays and host scalars), one per argument in order. Results may
  share memory with arguments (a result may be an argument itself): `in_place` (`memory.updated_in_place`) names the
  updates of arguments that are written into the arguments' own memory, and the elementwise results written into an
  operand's buffer (`memory.reused_in_place`). On the GPU, with the module's memory `plan`,
  each op that makes planned buffers first announces their offsets (`graphs.expect`), which a pool with an arena
  serves them at, and the function carries the arena's size (`<name>.arena_bytes`)."""
  if target not in TARGETS: raise ValueError(f"codegen: no target {target!r}; the targets are {TARGETS}")
  kernels = importlib.import_module(f"blutrain.backend.{target}").kernels
  block = function(module).body.block
  names: dict[SSAValue, str] = {v: f"a{i}" for i, v in enumerate(block.args)}
  *ops, ret = block.ops
  if not isinstance(ret, ReturnOp): raise ValueError(f"codegen: the function ends in {ret.name}, not func.return")
  joined = joins([*ops, ret])
  last: dict[SSAValue, int] = {}
  for i, op in enumerate(ops):
    if not isinstance(op, NovaOp): raise ValueError(f"codegen: unexpected op {op.name} in a nova function")
    for v in op.operands: last[v] = max(last.get(v, i), joined.get(i, i))
  overlap = joined if target == "cuda" else {}
  dying: dict[int, list[SSAValue]] = {}
  for v, i in last.items(): dying.setdefault(i, []).append(v)
  keep = set(ret.arguments)
  used: set[DType] = set()
  slots: dict[int, list[tuple[int, int]]] = {}
  for b in plan.buffers if plan is not None and target == "cuda" else ():
    slots.setdefault(b.allocated_at, []).append((b.offset, b.nbytes))
  lines = [f"def {name}({', '.join(names.values())}):"]
  bodies: dict = {}  # a fused op's body (synth.Body) -> its name in the generated module, shared by identical groups
  for i, op in enumerate(ops):
    lines += [f"  join(e{c})" for c, j in overlap.items() if j == i]
    body = [f"  expect({', '.join(f'({o}, {n})' for o, n in slots[i])})"] if slots.get(i) else []
    if isinstance(op, FusedOp): body += _fused(op, names, target, bodies, used, in_place or {})
    else:
      args = ["None" if v is None else names[v] for v in op.graph_inputs()]
      results = op.graph_outputs()
      out_dtypes = [None if r is None else DTYPES[r.type.element_type] for r in results]
      used.update(d for d in out_dtypes if d is not None)
      for r in results:
        if r is not None: names[r] = f"v{len(names)}"
      out = _out(op, names, in_place or {}, kernels)
      body += _lines(op, args, [None if r is None else names[r] for r in results], out_dtypes, target, out)
    if slots.get(i): body.append("  expect()")  # what the op did not take is not the next op's
    lines += [f"  with overlapped() as e{i}:", *("  " + b for b in body)] if i in overlap else body
    dead = dict.fromkeys(names[v] for v in dying.get(i, ()) if v not in keep)
    dead.update((names[r], None) for r in op.results if r not in last and r not in keep)
    if dead: lines.append(f"  del {', '.join(dead)}")
  lines += [f"  join(e{c})" for c, j in overlap.items() if j == len(ops)]
  outs = ", ".join(names[v] for v in ret.arguments)
  lines.append(f"  return ({outs}{',' if len(ret.arguments) == 1 else ''})")
  if slots: lines.append(f"{name}.arena_bytes = {plan.arena}")
  header = [f'"""Generated by blutrain.nova.codegen for the {target}."""', "import numpy as np",
            "from blutrain import dtypes", f"from blutrain.backend.{target} import kernels"]
  if target == "cuda":
    header += ["from blutrain.backend.cuda.graphs import expect, join, overlapped",
               "from blutrain.nova.loader import cuda_view as view"]
    if bodies: header += ["from blutrain.nova.synth import Body, fused", "",
                          *(f"{n} = {b.literal()}" for b, n in bodies.items())]
    header += ["", ""]
  else: header += ["", *(f"{dtype_name(d)} = dtypes.{dtype_name(d)}.np" for d in dtypes.all_dtypes if d in used), "", ""]
  return "\n".join(header + lines) + "\n"


# *** fused groups as data ***

def body_of(op: FusedOp) -> Body:
  """The body of a fused op as data."""
  block = op.body.block
  ref = {a: i for i, a in enumerate(block.args)}
  ops = []
  *members, end = block.ops
  for m in members:
    attrs = tuple(sorted(m.attrs().items()))
    ops.append((m.opname, tuple(ref[v] for v in m.operands), attrs, DTYPES[m.result.type.element_type]))
    ref[m.result] = len(ref)
  return Body(tuple(aval(a.type).dtype for a in block.args), tuple(ops), tuple(ref[v] for v in end.operands))


def specs(module) -> list:
  """The compiled variants (`kernels.Spec`) the fused ops of an optimized module use when their inputs are
  contiguous arrays, each distinct one once: what CI compiles without a GPU."""
  found = {}
  for op in function(module).body.block.ops:
    if not isinstance(op, FusedOp): continue
    shape = aval(op.outs[0].type).shape
    layouts = [(a.shape, contiguous_strides(a.shape), a.dtype, 0) for a in (aval(v.type) for v in op.xs)]
    s = plan(body_of(op), shape, layouts)[0]
    if s is not None: found.setdefault((s[0], tuple(s[1].items()), tuple(s[2].items()), tuple(s[3].items())), s)
  return list(found.values())
