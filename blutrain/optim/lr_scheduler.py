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


class OneCycleLR(LRScheduler):
  """The 1cycle policy (Smith & Topsoe, 2017), as PyTorch's: the lr rises from max_lr / div_factor to max_lr over
  the first pct_start of total_steps, then anneals to initial_lr / final_div_factor (with three_phase, back to the
  initial lr first); momentum (SGD's momentum or Adam's beta1) cycles the other way, between max_momentum and
  base_momentum. Step it after every batch.

  Under `bt.compile`, a cycled momentum is an optimizer hyperparameter the guard checks, so each step recompiles;
  pass cycle_momentum=False to a compiled step.
  """

  def __init__(self, optimizer: Optimizer, max_lr: float | Sequence[float], total_steps: int | None = None,
               epochs: int | None = None, steps_per_epoch: int | None = None, pct_start: float = 0.3,
               anneal_strategy: str = "cos", cycle_momentum: bool = True, base_momentum: float | Sequence[float] = 0.85,
               max_momentum: float | Sequence[float] = 0.95, div_factor: float = 25.0, final_div_factor: float = 1e4,
               three_phase: bool = False, last_epoch: int = -1) -> None:
    if not isinstance(optimizer, Optimizer): raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
    if total_steps is None:
      if epochs is None or steps_per_epoch is None:
        raise ValueError("You must define either total_steps OR (epochs AND steps_per_epoch)")
      if epochs <= 0 or not isinstance(epochs, int): raise ValueError(f"Expected positive integer epochs, but got {epochs}")
      if steps_per_epoch <= 0 or not isinstance(steps_per_epoch, int):
        raise ValueError(f"Expected positive integer steps_per_epoch, but got {steps_per_epoch}")
      total_steps = epochs * steps_per_epoch
    elif total_steps <= 0 or not isinstance(total_steps, int):
      raise ValueError(f"Expected positive integer total_steps, but got {total_steps}")
    if not 0 <= pct_start <= 1 or not isinstance(pct_start, float):
      raise ValueError(f"Expected float between 0 and 1 pct_start, but got {pct_start}")
    if anneal_strategy not in ("cos", "linear"):
      raise ValueError(f"anneal_strategy must be one of 'cos' or 'linear', instead got {anneal_strategy}")
    self.total_steps, self.anneal_strategy, self.cycle_momentum = total_steps, anneal_strategy, cycle_momentum
    up = float(pct_start * total_steps) - 1
    self._schedule_phases = [
      dict(end_step=up, start_lr="initial_lr", end_lr="max_lr", start_momentum="max_momentum", end_momentum="base_momentum"),
      dict(end_step=float(2 * pct_start * total_steps) - 2, start_lr="max_lr", end_lr="initial_lr",
           start_momentum="base_momentum", end_momentum="max_momentum"),
      dict(end_step=total_steps - 1, start_lr="initial_lr", end_lr="min_lr", start_momentum="max_momentum",
           end_momentum="max_momentum")] if three_phase else [
      dict(end_step=up, start_lr="initial_lr", end_lr="max_lr", start_momentum="max_momentum", end_momentum="base_momentum"),
      dict(end_step=total_steps - 1, start_lr="max_lr", end_lr="min_lr", start_momentum="base_momentum",
           end_momentum="max_momentum")]
    groups = optimizer.param_groups
    if last_epoch == -1:
      for group, lr in zip(groups, _per_group(optimizer, "max_lr", max_lr)):
        group["initial_lr"], group["max_lr"], group["min_lr"] = lr / div_factor, lr, lr / div_factor / final_div_factor
    if cycle_momentum:
      if "momentum" not in optimizer.defaults and "betas" not in optimizer.defaults:
        raise ValueError("optimizer must support momentum or beta1 with `cycle_momentum` option enabled")
      self.use_beta1 = "betas" in optimizer.defaults
      for group, m_lo, m_hi in zip(groups, _per_group(optimizer, "base_momentum", base_momentum),
                                   _per_group(optimizer, "max_momentum", max_momentum)):
        if last_epoch == -1:
          if self.use_beta1: group["betas"] = (m_hi, *group["betas"][1:])
          else: group["momentum"] = m_hi
          group["max_momentum"], group["base_momentum"] = m_hi, m_lo
    super().__init__(optimizer, last_epoch)

  def _anneal(self, start: float, end: float, pct: float) -> float:
    if self.anneal_strategy == "linear": return (end - start) * pct + start
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)

  def get_lr(self) -> list[float]:
    step = self.last_epoch
    if step > self.total_steps:
      raise ValueError(f"Tried to step {step} times. The specified number of total steps is {self.total_steps}")
    lrs = []
    for group in self.optimizer.param_groups:
      start = 0.0
      for i, phase in enumerate(self._schedule_phases):
        if step <= phase["end_step"] or i == len(self._schedule_phases) - 1:
          pct = (step - start) / (phase["end_step"] - start)
          lrs.append(self._anneal(group[phase["start_lr"]], group[phase["end_lr"]], pct))
          if self.cycle_momentum:
            m = self._anneal(group[phase["start_momentum"]], group[phase["end_momentum"]], pct)
            if self.use_beta1: group["betas"] = (m, *group["betas"][1:])
            else: group["momentum"] = m
          break
        start = phase["end_step"]
    return lrs


def _per_group(optimizer: Optimizer, name: str, value: float | Sequence[float]) -> list[float]:
  """One value per parameter group: a scalar repeated, or a list with one entry per group."""
  n = len(optimizer.param_groups)
  if isinstance(value, (list, tuple)):
    if len(value) != n: raise ValueError(f"expected {n} values for {name}, got {len(value)}")
    return list(value)
  return [value] * n


class ReduceLROnPlateau(LRScheduler):
  """Multiply the lr by `factor` when a metric has stopped improving for `patience` steps, as PyTorch's.

  `step(metric)` takes the metric (a loss in mode "min", an accuracy in mode "max"). An improvement is beyond
  `threshold`, relative (best * (1 -+ threshold)) or absolute (best -+ threshold); after a reduction, `cooldown`
  steps pass before bad steps count again; no lr goes below its `min_lr`, and changes smaller than `eps` are skipped.
  Unlike the closed-form schedules, the lr here depends on the metrics seen, so its state (best, counters) is in
  state_dict.
  """

  def __init__(self, optimizer: Optimizer, mode: str = "min", factor: float = 0.1, patience: int = 10,
               threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0,
               min_lr: float | Sequence[float] = 0, eps: float = 1e-8) -> None:
    if factor >= 1.0: raise ValueError("Factor should be < 1.0.")
    if not isinstance(optimizer, Optimizer): raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
    if mode not in ("min", "max"): raise ValueError(f"mode {mode} is unknown!")
    if threshold_mode not in ("rel", "abs"): raise ValueError(f"threshold mode {threshold_mode} is unknown!")
    self.optimizer, self.factor, self.patience, self.cooldown, self.eps = optimizer, factor, patience, cooldown, eps
    self.min_lrs = _per_group(optimizer, "min_lrs", min_lr)
    self.mode, self.threshold, self.threshold_mode = mode, threshold, threshold_mode
    self.best, self.num_bad_epochs, self.cooldown_counter = math.inf if mode == "min" else -math.inf, 0, 0
    self.last_epoch = 0
    self._last_lr = [group["lr"] for group in optimizer.param_groups]

  def is_better(self, a: float, best: float) -> bool:
    if self.mode == "min":
      return a < best * (1.0 - self.threshold) if self.threshold_mode == "rel" else a < best - self.threshold
    return a > best * (self.threshold + 1.0) if self.threshold_mode == "rel" else a > best + self.threshold

  def step(self, metrics: float, epoch: int | None = None) -> None:
    """Record one value of the metric; reduce the lrs if it has not improved for more than `patience` steps."""
    current = float(metrics)
    self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
    if self.is_better(current, self.best): self.best, self.num_bad_epochs = current, 0
    else: self.num_bad_epochs += 1
    if self.cooldown_counter > 0:
      self.cooldown_counter -= 1
      self.num_bad_epochs = 0
    if self.num_bad_epochs > self.patience:
      for group, min_lr in zip(self.optimizer.param_groups, self.min_lrs):
        old = float(group["lr"])
        new = max(old * self.factor, min_lr)
        if old - new > self.eps: group["lr"] = new
      self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
    self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


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
