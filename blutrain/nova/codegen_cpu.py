"""CPU code generation: an optimized nova module becomes the Python source of one readable numpy function.

Each op is one line. Primitives call the CPU backend's kernel (`kernels[name](*arrays, **attrs)`) and cast its
result to the op's result dtype, as eager mode does in `blutrain.backend.cpu.wrap` (kernels compute halves in float32
and may return other integer widths); a multi-result op's kernel returns a tuple, unpacked on its line and cast on the
next. Views, which have no kernel because eager mode makes them by striding, are the numpy equivalents (reshape,
transpose, broadcast_to, basic slicing). A value is deleted after its last use so that peak memory follows liveness.
For example:

  def step(a0, a1):
    v2 = np.asarray(kernels["matmul"](a0, a1), float32)
    del a0
    v3 = v2.transpose((1, 0))
    del v2
    return (v3,)
"""
from __future__ import annotations

import hashlib
import linecache
from typing import Any, Callable

import numpy as np
from xdsl.dialects.builtin import ModuleOp
from xdsl.dialects.func import ReturnOp
from xdsl.ir import SSAValue

from blutrain import dtypes
from blutrain.dtypes import DType
from blutrain.nova.dialect import (DTYPES, ExpandOp, LayoutOp, MultiResultOp, NovaOp, PermuteOp, RandomOp,
                                   ViewOp)
from blutrain.nova.graph import dtype_name, literal
from blutrain.nova.ir import function


def _slice(index) -> str:
  if not index: return "..."  # a 0-d array stays an array (x[()] would give a numpy scalar)
  return ", ".join(f"{a}:{b}" if c == 1 else f"{a}:{b}:{c}" for a, b, c in index)


def _view(op: LayoutOp, x: str) -> str:
  """A layout op as its numpy equivalent (eager mode makes these views by striding, without a kernel)."""
  a = op.attrs()
  if isinstance(op, ViewOp): return f"{x}.reshape({literal(a['shape'])})"
  if isinstance(op, PermuteOp): return f"{x}.transpose({literal(a['dims'])})"
  if isinstance(op, ExpandOp): return f"np.broadcast_to({x}, {literal(a['shape'])})"
  return f"{x}[{_slice(a['index'])}]"


def _call(op: NovaOp, args: list[str]) -> str:
  """The call of the op's CPU kernel; a random op's seed and absolute offset come from its generator state."""
  a = op.attrs()
  if isinstance(op, RandomOp):
    rng = args[0]
    kw = [f"{k}={literal(v)}" for k, v in a.items() if k != "offset"]
    kw += [f"seed=int({rng}[0])", f"offset=int({rng}[1])" + (f" + {a['offset']}" if a["offset"] else "")]
    return f'kernels["{op.opname}"]({", ".join(kw)})'
  return f'kernels["{op.opname}"]({", ".join(args + [f"{k}={literal(v)}" for k, v in a.items()])})'


def _lines(op: NovaOp, args: list[str], outs: list[str | None], out_dtypes: list[DType | None]) -> list[str]:
  """The lines computing one op into the names `outs` (None for an absent result), each result cast to its dtype.
  A multi-result op's kernel returns a tuple: it is unpacked (`_` for an absent result), then cast."""
  if isinstance(op, LayoutOp): return [f"  {outs[0]} = {_view(op, args[0])}"]
  if not isinstance(op, MultiResultOp):
    return [f"  {outs[0]} = np.asarray({_call(op, args)}, {dtype_name(out_dtypes[0])})"]
  targets = ", ".join(o or "_" for o in outs) + ("," if len(outs) == 1 else "")
  present = [(o, d) for o, d in zip(outs, out_dtypes) if o]
  casts = ", ".join(f"np.asarray({o}, {dtype_name(d)})" for o, d in present)
  return [f"  {targets} = {_call(op, args)}", f"  {', '.join(o for o, _ in present)} = {casts}"]


def generate(module: ModuleOp, name: str = "step") -> str:
  """Python source of `def <name>(a0, a1, ...)` computing the module's function's results (a tuple of numpy arrays)
  from numpy arrays, one per argument in order. Results may share memory with arguments (a result may be an argument
  itself)."""
  block = function(module).body.block
  names: dict[SSAValue, str] = {v: f"a{i}" for i, v in enumerate(block.args)}
  *ops, ret = block.ops
  if not isinstance(ret, ReturnOp): raise ValueError(f"codegen: the function ends in {ret.name}, not func.return")
  last: dict[SSAValue, int] = {}
  for i, op in enumerate(ops):
    if not isinstance(op, NovaOp): raise ValueError(f"codegen: unexpected op {op.name} in a nova function")
    for v in op.operands: last[v] = i
  keep = set(ret.arguments)
  used: set[DType] = set()
  lines = [f"def {name}({', '.join(names.values())}):"]
  for i, op in enumerate(ops):
    args = ["None" if v is None else names[v] for v in op.graph_inputs()]
    results = op.graph_outputs()
    out_dtypes = [None if r is None else DTYPES[r.type.element_type] for r in results]
    used.update(d for d in out_dtypes if d is not None)
    for r in results:
      if r is not None: names[r] = f"v{len(names)}"
    lines += _lines(op, args, [None if r is None else names[r] for r in results], out_dtypes)
    dead = dict.fromkeys(names[v] for v in op.operands if last[v] == i and v not in keep)
    dead.update((names[r], None) for r in op.results if r not in last and r not in keep)
    if dead: lines.append(f"  del {', '.join(dead)}")
  outs = ", ".join(names[v] for v in ret.arguments)
  lines.append(f"  return ({outs}{',' if len(ret.arguments) == 1 else ''})")
  header = ['"""Generated by blutrain.nova.codegen_cpu."""', "import numpy as np", "from blutrain import dtypes",
            "from blutrain.backend.cpu import kernels", "",
            *(f"{dtype_name(d)} = dtypes.{dtype_name(d)}.np" for d in dtypes.all_dtypes if d in used), "", ""]
  return "\n".join(header + lines) + "\n"


def load(source: str, name: str = "step") -> Callable[..., tuple[np.ndarray, ...]]:
  """Execute generated source (it imports numpy, dtypes and the kernels itself) and return its function. The source
  is registered with `linecache`, so tracebacks through the compiled step show the generated lines."""
  filename = f"<nova-cpu {hashlib.blake2b(source.encode(), digest_size=6).hexdigest()}>"
  linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
  namespace: dict[str, Any] = {}
  exec(compile(source, filename, "exec"), namespace)
  return namespace[name]
