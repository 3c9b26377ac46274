"""Graph -> xDSL module: `to_module` builds the `nova` IR of a captured graph; `print_module` and `parse_module`
convert it to and from MLIR syntax.

A graph becomes one `func.func @step` whose block arguments are the graph's inputs, one nova op per equation in
program order (an equation's outputs are the op's results, in order), and a `func.return` of the outputs:

  func.func @step(%0 : tensor<4x8xf32>, %1 : tensor<8xf32>) -> tensor<4x8xf32> {
    %2 = nova.add %0, %1 : (tensor<4x8xf32>, tensor<8xf32>) -> tensor<4x8xf32>
    func.return %2 : tensor<4x8xf32>
  }
"""
from __future__ import annotations

from io import StringIO

from xdsl.context import Context
from xdsl.dialects.builtin import Builtin, ModuleOp
from xdsl.dialects.func import Func, FuncOp, ReturnOp
from xdsl.ir import Block, Region, SSAValue
from xdsl.parser import Parser
from xdsl.printer import Printer

from blutrain.nova.dialect import OP_CLASSES, Nova, tensor_type
from blutrain.nova.graph import Graph, Value


def context() -> Context:
  """An xDSL context with the builtin, func and nova dialects loaded."""
  ctx = Context()
  for d in (Builtin, Func, Nova): ctx.load_dialect(d)
  return ctx


def to_module(graph: Graph, name: str = "step") -> ModuleOp:
  """The nova IR of `graph`: a module holding one function `name`. Raises on ops nova cannot hold."""
  types: dict[tuple, object] = {}

  def ty(v: Value):
    key = (v.shape, v.dtype)
    if (t := types.get(key)) is None: t = types[key] = tensor_type(v.shape, v.dtype)
    return t

  block = Block(arg_types=[ty(v) for v in graph.inputs])
  env: dict[Value, SSAValue] = dict(zip(graph.inputs, block.args))
  ops = []
  for eq in graph.equations:
    cls = OP_CLASSES.get(eq.op)
    if cls is None:
      if eq.op == "to_device":
        raise ValueError(f"nova: to_device in a captured graph ({eq.outs[0]!r}); a compiled function runs on one "
                         "device, so move tensors before calling it or outside the compiled function")
      raise ValueError(f"nova: no nova op for {eq.op!r} ({eq.outs}); every primitive of blutrain.ops needs an op class "
                       "in blutrain.nova.dialect")
    try:
      args = [None if v is None else env[v] for v in eq.inputs]
    except KeyError:
      missing = next(v for v in eq.inputs if v is not None and v not in env)
      raise ValueError(f"nova: {eq.op} reads {missing!r}, which is neither a graph input nor defined before it") \
        from None
    op = cls.make(args, eq.attrs, [None if v is None else ty(v) for v in eq.outs])
    env.update((v, r) for v, r in zip(eq.outs, op.graph_outputs()) if v is not None)
    ops.append(op)
  ops.append(ReturnOp(*(env[v] for v in graph.outputs)))
  block.add_ops(ops)
  func = FuncOp(name, ([ty(v) for v in graph.inputs], [ty(v) for v in graph.outputs]), Region(block))
  return ModuleOp([func])


def function(module: ModuleOp) -> FuncOp:
  """The module's one function."""
  funcs = [op for op in module.ops if isinstance(op, FuncOp)]
  if len(funcs) != 1: raise ValueError(f"nova: expected a module with one func.func, got {len(funcs)}")
  return funcs[0]


def print_module(module: ModuleOp) -> str:
  """The module in MLIR syntax."""
  out = StringIO()
  Printer(stream=out).print_op(module)
  return out.getvalue() + "\n"


def parse_module(text: str) -> ModuleOp:
  """Parse a module in MLIR syntax (as `print_module` writes it) and verify it."""
  module = Parser(context(), text).parse_module()
  module.verify()
  return module
