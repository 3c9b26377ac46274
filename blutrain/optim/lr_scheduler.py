"""Learning-rate schedules, as `torch.optim.lr_scheduler`.

Each scheduler computes the lr in closed form from the step count and the groups' initial lrs, so a schedule
is a pure function of one integer (a resumed run gets the same values). Unlike PyTorch's chainable forms,
two schedulers stepping one optimizer do not compose: the last one to step sets the lr. Compose with
SequentialLR, or with one LambdaLR.
"""
from __future__ import annotations

import bisect
import math
import types
from typing import Any, Callable, Sequence

from blutrain.optim.optimizer import Optimizer


class LRScheduler:
  """Base class: on each `step()`, `last_epoch` advances and every group's "lr" becomes `get_lr()`.

  Args:
    optimizer: the optimizer whose groups' "lr" is set; each group's "initial_lr" is recorded as its base.
    last_epoch: the index of the last step taken; -1 starts a new schedule (resuming needs "initial_lr").
  """
  optimizer: Optimizer
  base_lrs: list[float]
  last_epoch: int

  def __init__(self, optimizer: Optimizer, last_epoch: int = -1) -> None:
    if not isinstance(optimizer, Optimizer): raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
    self.optimizer = optimizer
    for i, group in enumerate(optimizer.param_groups):
      if last_epoch == -1: group.setdefault("initial_lr", group["lr"])
      elif "initial_lr" not in group:
        raise KeyError(f"param 'initial_lr' is not specified in param_groups[{i}] when resuming an optimizer")
    self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    self.last_epoch = last_epoch
    self.step()

  def get_lr(self) -> list[float]:
    """The lr of each group at step `last_epoch`."""
    raise NotImplementedError(f"{type(self).__name__} does not define get_lr")

  def get_last_lr(self) -> list[float]:
    """The lrs the last `step()` set."""
    return self._last_lr

  def step(self, epoch: int | None = None) -> None:
    """Advance one step (or jump to `epoch`) and set every group's lr."""
    self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
    for group, lr in zip(self.optimizer.param_groups, self.get_lr()): group["lr"] = lr
    self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

  def state_dict(self) -> dict[str, Any]:
    """Everything but the optimizer."""
    return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

  def load_state_dict(self, state_dict: dict[str, Any]) -> None:
    self.__dict__.update(state_dict)


class LambdaLR(LRScheduler):
  """lr = initial_lr * lr_lambda(step), one function for all groups or a list with one per group.

  state_dict keeps the attributes of callable objects; plain functions and lambdas are not saved (as PyTorch).
  """

  def __init__(self, optimizer: Optimizer, lr_lambda: Callable[[int], float] | Sequence[Callable[[int], float]],
               last_epoch: int = -1) -> None:
    n = len(optimizer.param_groups)
    self.lr_lambdas = list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) else [lr_lambda] * n
    if len(self.lr_lambdas) != n: raise ValueError(f"Expected {n} lr_lambdas, but got {len(self.lr_lambdas)}")
    super().__init__(optimizer, last_epoch)

  def get_lr(self) -> list[float]:
    return [base * fn(self.last_epoch) for base, fn in zip(self.base_lrs, self.lr_lambdas)]

  def state_dict(self) -> dict[str, Any]:
    state = {k: v for k, v in super().state_dict().items() if k != "lr_lambdas"}
    state["lr_lambdas"] = [None if isinstance(fn, types.FunctionType) else dict(fn.__dict__) for fn in self.lr_lambdas]
    return state

  def load_state_dict(self, state_dict: dict[str, Any]) -> None:
    state = dict(state_dict)
    lambdas = state.pop("lr_lambdas")
    super().load_state_dict(state)
    for fn, saved in zip(self.lr_lambdas, lambdas):
      if saved is not None: fn.__dict__.update(saved)


class StepLR(LRScheduler):
  """lr = initial_lr * gamma ** (step // step_size)."""

  def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1) -> None:
    self.step_size, self.gamma = step_size, gamma
    super().__init__(optimizer, last_epoch)

  def get_lr(self) -> list[float]:
    return [base * self.gamma ** (self.last_epoch // self.step_size) for base in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
  """lr = eta_min + (initial_lr - eta_min) * (1 + cos(pi * step / T_max)) / 2 (past T_max the cosine goes on)."""

  def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1) -> None:
    self.T_max, self.eta_min = T_max, eta_min
    super().__init__(optimizer, last_epoch)

  def get_lr(self) -> list[float]:
    c = (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2
    return [self.eta_min + (base - self.eta_min) * c for base in self.base_lrs]


class LinearLR(LRScheduler):
  """lr = initial_lr * factor, factor going linearly from start_factor to end_factor over total_iters steps."""

  def __init__(self, optimizer: Optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
               total_iters: int = 5, last_epoch: int = -1) -> None:
    if not 0 < start_factor <= 1:
      raise ValueError("Starting multiplicative factor expected to be greater than 0 and less or equal to 1, "
                       f"got {start_factor}")
    if not 0 <= end_factor <= 1:
      raise ValueError(f"Ending multiplicative factor expected to be between 0 and 1, got {end_factor}")
    self.start_factor, self.end_factor, self.total_iters = start_factor, end_factor, total_iters
    super().__init__(optimizer, last_epoch)

  def get_lr(self) -> list[float]:
    progress = min(self.total_iters, self.last_epoch) / self.total_iters
    factor = self.start_factor + (self.end_factor - self.start_factor) * progress
    return [base * factor for base in self.base_lrs]


class SequentialLR(LRScheduler):
  """Run `schedulers` one after another: scheduler i takes over at step milestones[i-1], counting from 0 again.

  Example:
    >>> warmup = LinearLR(opt, start_factor=0.01, total_iters=100)
    >>> decay = CosineAnnealingLR(opt, T_max=900)
    >>> sched = SequentialLR(opt, [warmup, decay], milestones=[100])
  """

  def __init__(self, optimizer: Optimizer, schedulers: Sequence[LRScheduler], milestones: Sequence[int],
               last_epoch: int = -1) -> None:
    if not schedulers: raise ValueError("SequentialLR expects at least one scheduler")
    if len(milestones) != len(schedulers) - 1:
      raise ValueError(f"Sequential Schedulers expects number of schedulers provided to be one more than the number of "
                       f"milestone points, but got number of schedulers {len(schedulers)} and the number of milestones "
                       f"to be equal to {len(milestones)}")
    for i, s in enumerate(schedulers):
      if s.optimizer is not optimizer:
        raise ValueError(f"Sequential Schedulers expects all schedulers to belong to the same optimizer, but got "
                         f"scheduler {type(s).__name__} at index {i} with a different one")
    self._schedulers, self._milestones = list(schedulers), list(milestones)
    super().__init__(optimizer, last_epoch)

  def get_lr(self) -> list[float]:
    i = bisect.bisect_right(self._milestones, self.last_epoch)
    active = self._schedulers[i]
    active.last_epoch = self.last_epoch - (self._milestones[i - 1] if i else 0)
    return active.get_lr()

  def state_dict(self) -> dict[str, Any]:
    state = super().state_dict()
    state["_schedulers"] = [s.state_dict() for s in self._schedulers]
    return state

  def load_state_dict(self, state_dict: dict[str, Any]) -> None:
    state = dict(state_dict)
    for s, saved in zip(self._schedulers, state.pop("_schedulers")): s.load_state_dict(saved)
    super().load_state_dict(state)


class _WarmupCosine:
  """The multiplier of `warmup_cosine`; an object rather than a closure, so that LambdaLR's state_dict keeps it."""

  def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> None:
    self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio

  def __call__(self, step: int) -> float:
    if step < self.warmup_steps: return (step + 1) / self.warmup_steps
    if step >= self.total_steps: return self.min_lr_ratio
    progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
    return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1,
                  last_epoch: int = -1) -> LambdaLR:
  """Linear warmup, then cosine decay: the usual GPT schedule, as a LambdaLR.

  The factor on each group's initial lr is (step + 1) / warmup_steps for step < warmup_steps (so the first step
  already trains), then min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * progress)) / 2 with progress going from
  0 at warmup_steps to 1 at total_steps, and min_lr_ratio from then on.

  Example:
    >>> sched = warmup_cosine(opt, warmup_steps=700, total_steps=600_000)   # then sched.step() after opt.step()
  """
  if warmup_steps < 0 or total_steps < warmup_steps:
    raise ValueError(f"warmup_cosine: expected 0 <= warmup_steps <= total_steps, got {warmup_steps} and {total_steps}")
  if not 0.0 <= min_lr_ratio <= 1.0: raise ValueError(f"warmup_cosine: min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
  return LambdaLR(optimizer, _WarmupCosine(warmup_steps, total_steps, min_lr_ratio), last_epoch)
