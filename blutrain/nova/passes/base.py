"""What every nova pass shares: `run(module) -> bool` (did the IR change?) and greedy pattern application."""
from __future__ import annotations

import inspect
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, get_args

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import PatternRewriter, PatternRewriteWalker, RewritePattern
from xdsl.pattern_rewriter import op_type_rewrite_pattern as _xdsl_op_type_rewrite_pattern

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
    return PatternRewriteWalker(_ByOpType(list(self.PATTERNS)), apply_recursively=True).rewrite_module(module)


def op_type_rewrite_pattern(func: Callable) -> Callable:
  """xDSL's decorator of the name (the pattern fires on ops of the type its `op` argument is annotated with), which
  also records that type (`op_types`) for `_ByOpType`."""
  impl = _xdsl_op_type_rewrite_pattern(func)
  hint = list(inspect.signature(func, eval_str=True).parameters.values())[-2].annotation
  impl.op_types = get_args(hint) or (hint,)
  return impl


@dataclass(eq=False)
class _ByOpType(RewritePattern):
  """The patterns in order, the first that acts on an op winning (xDSL's `GreedyRewritePatternApplier` without its
  dce), each tried only on the op types it fires on. NOTE: trying every pattern on every op cost a call and an
  isinstance of an ABC per pattern and op, a quarter of the time of the pattern passes on a long graph."""
  patterns: list[RewritePattern]
  by_type: dict[type, list[RewritePattern]] = field(default_factory=dict)

  def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
    if (patterns := self.by_type.get(type(op))) is None:
      patterns = self.by_type[type(op)] = [p for p in self.patterns if issubclass(
        type(op), getattr(type(p).match_and_rewrite, "op_types", (Operation,)))]
    for p in patterns:
      p.match_and_rewrite(op, rewriter)
      if rewriter.has_done_action: return


_NOT_FULL = object()


def splat(v: SSAValue) -> Any:
  """The fill value when `v` is made by `nova.full`, else a sentinel that equals nothing."""
  owner = v.owner
  return decode(owner.properties["value"]) if isinstance(owner, FullOp) else _NOT_FULL
