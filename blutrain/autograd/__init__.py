"""Autograd: the tape (`tape`: nodes, grad mode, the hooks ops run under) and the reverse walk over it (`engine`).

It sits between the tensor and the op library: ops record nodes, the engine calls their VJPs. `Tensor.backward` is
attached here, from above the tensor.
"""
from blutrain.autograd.engine import backward, grad
from blutrain.autograd.tape import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from blutrain.tensor import Tensor

__all__ = ["backward", "grad", "no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled"]


def _backward(self: Tensor, gradient: Tensor | None = None, retain_graph: bool = False) -> None:
  """Accumulate d(self)/d(leaf) into every leaf's `.grad`; a non-scalar needs `gradient`."""
  backward([self], [gradient], retain_graph=retain_graph)


Tensor.backward = _backward
