"""Nova: blutrain's whole-graph compiler. `bt.compile(fn)` (alias `bt.nova.jit`) captures a whole training step
into the `nova` MLIR dialect, optimizes it and runs it; see docs/nova.md."""
from blutrain.nova.jit import Compiled, compile
from blutrain.tensor import GraphBreakError

jit = compile

__all__ = ["compile", "jit", "Compiled", "GraphBreakError"]
