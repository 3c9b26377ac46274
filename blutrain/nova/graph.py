"""The captured graph: what capture produces and the IR builder consumes.

A Graph is a list of equations in program order over SSA values. Each equation applies one primitive of
`blutrain.ops` (its name is the op's registry key) to input values with the op's attributes, and defines one value,
or several for a multi-output primitive (`Op.multi`: adamw, scale). Inputs are the step's arguments plus every tensor
read from outside (parameters, gradients, optimizer state, dynamic scalars such as the learning rate); outputs are
returned tensors and the new values of the tensors updated in place, which the runtime writes back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from blutrain import dtypes
from blutrain.dtypes import DType


def dtype_name(d: DType) -> str:
  """The attribute name of a dtype in `blutrain.dtypes` (bool is `bool_`)."""
  return "bool_" if d is dtypes.bool_ else d.name


def literal(v: Any) -> str:
  """An attribute value as the Python source that evaluates to it (DTypes as `dtypes.<name>`, non-finite floats
  spelled out, numpy scalars as the numbers they hold). Distinct values have distinct text (1, 1.0 and True; 0.0 and
  -0.0: `repr` of a float round-trips exactly), so it is also the text that hashes and caches key attributes by."""
  if isinstance(v, np.generic): v = v.item()
  if isinstance(v, DType): return f"dtypes.{dtype_name(v)}"
  if isinstance(v, float) and not math.isfinite(v): return f"float('{v}')"
  if isinstance(v, (tuple, list)): return "(" + ", ".join(map(literal, v)) + ("," if len(v) == 1 else "") + ")"
  return repr(v)


@dataclass(eq=False)
class Value:
  """An SSA value: a tensor of static shape and dtype. `id` orders values within one graph."""
  id: int
  shape: tuple[int, ...]
  dtype: DType

  def __repr__(self) -> str: return f"%{self.id}:{self.dtype.name}{list(self.shape)}"


@dataclass(eq=False)
class Equation:
  """`*outs = op(*inputs, **attrs)`. An input is None where the op takes an optional tensor (layer_norm's bias).
  `outs` holds one value, or one per result of a multi-output op, None where an optional result is absent.

  Attribute values are ints, floats, bools, strings, None, DTypes, or (nested) tuples of those."""
  op: str
  inputs: list[Value | None]
  attrs: dict[str, Any]
  outs: list[Value | None]


@dataclass(eq=False)
class Graph:
  """A whole captured function: `outputs = f(*inputs)`, single device, value semantics throughout."""
  inputs: list[Value] = field(default_factory=list)
  equations: list[Equation] = field(default_factory=list)
  outputs: list[Value] = field(default_factory=list)
  device: Any = None

  def __str__(self) -> str:
    lines = [f"graph({', '.join(map(repr, self.inputs))}):"]
    for eq in self.equations:
      args = ", ".join("None" if v is None else f"%{v.id}" for v in eq.inputs)
      attrs = "".join(f", {k}={v!r}" for k, v in eq.attrs.items())
      outs = ", ".join("None" if v is None else repr(v) for v in eq.outs)
      lines.append(f"  {outs} = {eq.op}({args}{attrs})")
    lines.append(f"  return {', '.join(f'%{v.id}' for v in self.outputs)}")
    return "\n".join(lines)
