"""Dead code elimination: drop ops whose results nothing uses."""
from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects.builtin import ModuleOp

from blutrain.nova.dialect import NovaOp
from blutrain.nova.ir import function
from blutrain.nova.passes.base import NovaPass


@dataclass(frozen=True)
class DCEPass(NovaPass):
  """Erase nova ops none of whose results is used, in one reverse walk: a use by a later dead op is gone before its
  operand is visited, so whole dead chains go at once. Like MLIR's trivially-dead elimination, restricted to the
  single block of a nova function (every nova op is Pure, see the dialect's note on random ops). An op with several
  results stays whole while any of them is used."""
  name = "dce"

  def run(self, module: ModuleOp) -> bool:
    block = function(module).body.block
    changed = False
    for op in reversed(list(block.ops)):
      if isinstance(op, NovaOp) and all(r.first_use is None for r in op.results):
        block.erase_op(op)
        changed = True
    return changed
