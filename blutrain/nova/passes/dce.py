"""Dead code elimination: drop ops whose result nothing uses."""
from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects.builtin import ModuleOp

from blutrain.nova.dialect import NovaOp
from blutrain.nova.ir import function
from blutrain.nova.passes.base import NovaPass


@dataclass(frozen=True)
class DCEPass(NovaPass):
  """Erase unused nova ops in one reverse walk: a use by a later dead op is gone before its operand is visited, so
  whole dead chains go at once. Like MLIR's trivially-dead elimination, restricted to the single block of a nova
  function (every nova op is Pure, see the dialect's note on random ops)."""
  name = "dce"

  def run(self, module: ModuleOp) -> bool:
    block = function(module).body.block
    changed = False
    for op in reversed(list(block.ops)):
      if isinstance(op, NovaOp) and op.result.first_use is None:
        block.erase_op(op)
        changed = True
    return changed
