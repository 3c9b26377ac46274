"""Common subexpression elimination: one op per distinct (name, operands, properties)."""
from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects.builtin import FloatAttr, ModuleOp
from xdsl.ir import Attribute

from blutrain.nova.dialect import NovaOp
from blutrain.nova.ir import function
from blutrain.nova.passes.base import NovaPass


def _prop_key(a: Attribute):
  """Properties compare as attributes, except floats, which compare by bit pattern: FloatAttr(0.0) equals
  FloatAttr(-0.0), and merging those two splats would change the sign of a zero (1 / -0.0 is -inf)."""
  return ("float", a.value.data.hex()) if isinstance(a, FloatAttr) else a


@dataclass(frozen=True)
class CSEPass(NovaPass):
  """Replace an op by an earlier identical one (each of its results by the earlier op's result of the same index), in
  one forward walk. As MLIR's CSE on one block of Pure ops, with the one difference that float properties compare by
  bit pattern (`_prop_key`). The result types are not part of the key: the shape rule makes them a function of the
  rest."""
  name = "cse"

  def run(self, module: ModuleOp) -> bool:
    block = function(module).body.block
    seen: dict[tuple, NovaOp] = {}
    changed = False
    for op in list(block.ops):
      if not isinstance(op, NovaOp): continue
      props = tuple((k, _prop_key(a)) for k, a in sorted(op.properties.items()))
      key = (op.name, tuple(op.operands), props)
      if (first := seen.setdefault(key, op)) is not op:
        for result, kept in zip(op.results, first.results, strict=True): result.replace_all_uses_with(kept)
        block.erase_op(op)
        changed = True
    return changed
