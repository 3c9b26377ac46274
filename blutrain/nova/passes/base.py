"""What every nova pass shares: `run(module) -> bool` (did the IR change?) and greedy pattern application."""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import SSAValue
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import GreedyRewritePatternApplier, PatternRewriteWalker, RewritePattern

from blutrain.nova.dialect import FullOp, decode


@dataclass(frozen=True)
class NovaPass(ModulePass):
  """A named pass over a nova module. `run` does the work and says whether anything changed (the pipeline's
  fixed point needs that); `apply` is xDSL's entry point."""
  name: ClassVar[str]

  def apply(self, ctx: Context, op: ModuleOp) -> None: self.run(op)

  @abstractmethod
  def run(self, module: ModuleOp) -> bool: ...


@dataclass(frozen=True)
class PatternPass(NovaPass):
  """Apply `PATTERNS` greedily with one worklist walk: an op that changes queues its users again, so chains
  (permute of permute of permute) collapse in one pass without revisiting the whole module per match. Dead ops
  are left to dce, so each pass does one thing and its dump shows only that."""
  PATTERNS: ClassVar[tuple[RewritePattern, ...]] = ()

  def run(self, module: ModuleOp) -> bool:
    applier = GreedyRewritePatternApplier(list(self.PATTERNS), dce_enabled=False)
    return PatternRewriteWalker(applier, apply_recursively=True).rewrite_module(module)


_NOT_FULL = object()


def splat(v: SSAValue) -> Any:
  """The fill value when `v` is made by `nova.full`, else a sentinel that equals nothing."""
  owner = v.owner
  return decode(owner.properties["value"]) if isinstance(owner, FullOp) else _NOT_FULL
