"""Optimizer: parameter groups, per-parameter state, and state_dict in PyTorch's format."""
from __future__ import annotations

import copy
import warnings
from collections import defaultdict
from typing import Any, Callable, Iterable

from blutrain import dtypes, ops, shapes
from blutrain.ops import enable_grad, no_grad
from blutrain.tensor import Tensor

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]


class Optimizer:
  """Base class of optimizers, as `torch.optim.Optimizer`.

  `param_groups` is a list of dicts, each with "params" (a list of tensors) and its hyperparameters (those the
  group leaves out come from `defaults`); `state[p]` is a dict of the per-parameter state (step, moments).
  A subclass implements `_update`, the update of one parameter; `step` runs it under no_grad for every
  parameter that has a gradient, group by group through `_step_group`, which a subclass may override to update a
  whole group at once (the multi-tensor ops `ops.adamw_`, `ops.sgd_`).

  Args:
    params: an iterable of tensors, or of dicts defining parameter groups.
    defaults: default hyperparameters for the groups.
  """
  defaults: dict[str, Any]
  param_groups: list[dict[str, Any]]
  state: defaultdict

  def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
    if isinstance(params, Tensor):
      raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
                      f"a Tensor of shape {params.shape}")
    self.defaults, self.state, self.param_groups = defaults, defaultdict(dict), []
    groups = list(params)
    if not groups: raise ValueError("optimizer got an empty parameter list")
    for group in groups if isinstance(groups[0], dict) else [{"params": groups}]: self.add_param_group(group)

  def add_param_group(self, param_group: dict[str, Any]) -> None:
    """Add a group of parameters with its own hyperparameters (e.g. no weight decay for biases)."""
    if not isinstance(param_group, dict): raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
    params = param_group["params"]
    if isinstance(params, set):
      raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering of tensors "
                      "in sets will change between runs. Please use a list instead.")
    params = param_group["params"] = [params] if isinstance(params, Tensor) else list(params)
    for p in params:
      if not isinstance(p, Tensor):
        raise TypeError(f"optimizer can only optimize Tensors, but one of the params is {type(p).__name__}")
      if not p.is_leaf:
        raise ValueError(f"can't optimize a non-leaf Tensor (shape {p.shape}, produced by {p.grad_fn.op.name})")
    if len({id(p) for p in params}) != len(params):
      warnings.warn("optimizer contains a parameter group with duplicate parameters; in future, this will cause an "
                    "error", stacklevel=3)
    for name, default in self.defaults.items(): param_group.setdefault(name, default)
    taken = {id(p) for g in self.param_groups for p in g["params"]}
    if any(id(p) in taken for p in params): raise ValueError("some parameters appear in more than one parameter group")
    self.param_groups.append(param_group)

  def zero_grad(self, set_to_none: bool = True) -> None:
    """Clear the gradients of all optimized parameters (to None, or to zeros when `set_to_none=False`)."""
    for group in self.param_groups:
      for p in group["params"]:
        if p.grad is None: continue
        if set_to_none: p.grad = None
        else: p.grad.zero_()

  @no_grad()
  def step(self, closure: Callable[[], Any] | None = None) -> Any:
    """Update every parameter that has a gradient; `closure` re-evaluates the model and returns the loss."""
    loss = None
    if closure is not None:
      with enable_grad(): loss = closure()
    for group in self.param_groups: self._step_group(group)
    return loss

  def _step_group(self, group: dict[str, Any]) -> None:
    """Update the parameters of one group that have a gradient, one `_update` each."""
    for p in group["params"]:
      if p.grad is not None: self._update(p, p.grad, self.state[p], group)

  def _update(self, p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
    """Update p in place from its gradient, its state (filled on the first call) and its group's hyperparameters."""
    raise NotImplementedError(f"{type(self).__name__} does not define _update")

  # *** state_dict ***

  def state_dict(self) -> dict[str, Any]:
    """{'state': {index: {...}}, 'param_groups': [{..., 'params': [indices]}]}, as PyTorch's: parameters are
    numbered in group order, and the state holds the live tensors (save it, or copy it, before stepping on)."""
    index: dict[int, int] = {}
    groups = []
    for g in self.param_groups:
      for p in g["params"]: index.setdefault(id(p), len(index))
      groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]})
    return {"state": {index[id(p)]: s for p, s in self.state.items() if s and id(p) in index}, "param_groups": groups}

  def load_state_dict(self, state_dict: dict[str, Any]) -> None:
    """Restore hyperparameters and state saved by `state_dict`, matching parameters by position. State tensors
    are copied (a floating one to its parameter's dtype and device), so the source can be reused."""
    groups, saved = self.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved):
      raise ValueError(f"loaded state dict has a different number of parameter groups: {len(saved)} in the state dict, "
                       f"{len(groups)} in the optimizer")
    for i, (g, s) in enumerate(zip(groups, saved)):
      if len(g["params"]) != len(s["params"]):
        raise ValueError(f"loaded state dict contains a parameter group that doesn't match the size of optimizer's "
                         f"group: group {i} has {len(s['params'])} parameters in the state dict, {len(g['params'])} "
                         "in the optimizer")
    by_index = {i: p for g, s in zip(groups, saved) for i, p in zip(s["params"], g["params"])}
    state = defaultdict(dict)
    for i, values in state_dict["state"].items():
      if i not in by_index: raise KeyError(f"optimizer state for parameter {i}, which no parameter group lists")
      p = by_index[i]
      state[p] = {key: _load_value(p, key, v) for key, v in values.items()}
    self.state = state
    self.param_groups = [{**copy.deepcopy({k: v for k, v in s.items() if k != "params"}), "params": g["params"]}
                         for g, s in zip(groups, saved)]

  def __repr__(self) -> str:
    lines = [f"{type(self).__name__} ("]
    for i, group in enumerate(self.param_groups):
      lines.append(f"Parameter Group {i}")
      lines += [f"    {k}: {group[k]}" for k in sorted(group) if k != "params"]
    return "\n".join(lines) + "\n)"


MULTI_TENSOR_DTYPES = (dtypes.float32, dtypes.bfloat16, dtypes.float16)


def multi_tensor_ready(params: list[Tensor], grads: list[Tensor], *states: list[Tensor | None]) -> bool:
  """Whether a multi-tensor update (`ops.adamw_`, `ops.sgd_`) can take these parameters with their gradients and
  states: dense float32/16 parameters (contiguous, channels-last, any order without gaps) on one device, with
  float32/16 gradients of their shapes (in any layout: one unlike its parameter's is read through a copy in the
  parameter's) and, in each list of `states`, a state of its parameter's shape, dtype and layout (what the updates
  walk) or None (not made yet)."""
  if not params: return False
  dev = params[0].device
  for p, g in zip(params, grads, strict=True):
    shape, d = p.shape, p.device
    if not (p.dtype in MULTI_TENSOR_DTYPES and g.dtype in MULTI_TENSOR_DTYPES and g.shape == shape
            and (d is dev or d == dev) and shapes.is_dense(shape, p.stride())): return False
  for ss in states:  # a list at a time (unpacking all of them per parameter costs more)
    for p, s in zip(params, ss, strict=True):
      if s is None: continue
      shape, strides, st = p.shape, p.stride(), s.stride()
      if not (s.shape == shape and s.dtype is p.dtype and (st == strides or shapes.same_layout(shape, strides, st))):
        return False
  return True


def _load_value(p: Tensor, key: str, value: Any) -> Any:
  """A loaded state entry: `step` as a 0-d float64 tensor on p's device (PyTorch saves a float32 one), other
  tensors copied onto p's device (and to p's dtype when p is floating point), anything else as is."""
  if key == "step": return ops.tensor(float(value), dtype=dtypes.float64, device=p.device)
  if not isinstance(value, Tensor): return copy.deepcopy(value)
  value = value.to(p.device, p.dtype) if p.is_floating_point() else value.to(p.device)
  return value.detach().clone()
