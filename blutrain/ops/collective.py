"""Collective primitives: all_reduce, reduce_scatter and all_gather over the ranks of a process group, as functional
ops (each returns a new tensor; its input is left alone), so that Nova captures them like any other op.

`group` is the id under which `blutrain.distributed` registered the group's communicator (`backend.collective`), and
`size` its number of ranks, which the shape rules of reduce_scatter and all_gather need. reduce_scatter and
all_gather split and join along dim 0, rank r holding the r-th block. The VJPs are those of the functions of all the
ranks' inputs with the ranks' losses summed: all_reduce(sum) is its own transpose, reduce_scatter's is all_gather and
the other way round; avg divides by the group's size on the way back as on the way forward. MAX, MIN and PRODUCT
have no derivative here.

Eagerly a collective op runs synchronously (on the GPU, on the current stream); `blutrain.distributed`'s in-place,
async_op API is the eager path the wrappers take outside a capture.
"""
from __future__ import annotations

from blutrain.ops.core import op
from blutrain.shapes import ShapeError
from blutrain.tensor import Tensor

REDUCE_OPS = ("sum", "avg", "product", "max", "min")  # ReduceOp's values


def _check(name: str, x, reduce_op: str | None, size: int) -> None:
  if reduce_op is not None and reduce_op not in REDUCE_OPS:
    raise ValueError(f"{name}: unknown reduce op {reduce_op!r}; expected one of {REDUCE_OPS}")
  if reduce_op == "avg" and not x.dtype.is_floating_point:
    raise TypeError(f"{name}: the avg reduction needs a floating-point tensor, got {x.dtype.name}")
  if size < 1: raise ValueError(f"{name}: a group has at least one rank, got size {size}")


def _linear(name: str, reduce_op: str) -> None:
  if reduce_op not in ("sum", "avg"):
    raise RuntimeError(f"{name} with reduce_op {reduce_op!r} has no derivative (only sum and avg do): reduce a "
                       "detached tensor")


def _all_reduce_rule(x, reduce_op, group, size):
  _check("all_reduce", x, reduce_op, size)
  return x.shape, x.dtype


def _all_reduce_vjp(g, out, x, reduce_op, group, size):
  _linear("all_reduce", reduce_op)
  return (all_reduce_op(g, reduce_op=reduce_op, group=group, size=size),)


all_reduce_op = op("all_reduce", _all_reduce_rule, _all_reduce_vjp, saves=(), inputs="x",
                   attrs="reduce_op:str group:int size:int")


def _reduce_scatter_rule(x, reduce_op, group, size):
  _check("reduce_scatter", x, reduce_op, size)
  if x.ndim == 0 or x.shape[0] % size:
    raise ShapeError(f"reduce_scatter: dim 0 of the input {tuple(x.shape)} must split into {size} equal blocks, one "
                     "per rank; pad it to a multiple of the group size")
  return (x.shape[0] // size, *x.shape[1:]), x.dtype


def _reduce_scatter_vjp(g, out, x, reduce_op, group, size):
  _linear("reduce_scatter", reduce_op)
  full = all_gather_op(g, group=group, size=size)
  return (full / size if reduce_op == "avg" else full,)


reduce_scatter_op = op("reduce_scatter", _reduce_scatter_rule, _reduce_scatter_vjp, saves=(), inputs="x",
                       attrs="reduce_op:str group:int size:int")


def _all_gather_rule(x, group, size):
  _check("all_gather", x, None, size)
  if x.ndim == 0:
    raise ShapeError("all_gather: the input must have a dim 0 to join the ranks' blocks along; got a 0-d tensor")
  return (x.shape[0] * size, *x.shape[1:]), x.dtype


def _all_gather_vjp(g, out, x, group, size):
  return (reduce_scatter_op(g, reduce_op="sum", group=group, size=size),)


all_gather_op = op("all_gather", _all_gather_rule, _all_gather_vjp, saves=(), inputs="x", attrs="group:int size:int")


def all_reduce(x: Tensor, reduce_op: str, group: int, size: int) -> Tensor:
  """A new tensor: `x` reduced with `reduce_op` ("sum", "avg", "product", "max", "min") over the `size` ranks of the
  group registered as `group` (`blutrain.distributed.get_group(g).gid`)."""
  return all_reduce_op(x, reduce_op=reduce_op, group=int(group), size=int(size))


def reduce_scatter(x: Tensor, reduce_op: str, group: int, size: int) -> Tensor:
  """This rank's block of `x` reduced over the ranks: x's dim 0 cut into `size` blocks, rank r receiving the r-th."""
  return reduce_scatter_op(x, reduce_op=reduce_op, group=int(group), size=int(size))


def all_gather(x: Tensor, group: int, size: int) -> Tensor:
  """Every rank's `x`, in rank order, joined along dim 0."""
  return all_gather_op(x, group=int(group), size=int(size))
