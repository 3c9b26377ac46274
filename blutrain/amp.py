"""Mixed precision: `autocast`, PyTorch's per-op cast policy (the internal precision of float32 matmuls is a setting of
`blutrain.backends`).

Autocast is one table, `POLICY`: per device type, op name -> `LOWER` (float32 inputs are cast to the autocast
dtype: matmul, linear, convolution, attention) or `FP32` (float16/bfloat16 inputs are cast up: softmax, norms, losses, sums,
exp/log on CUDA). Ops not in the table run in their inputs' dtypes (batch_norm among them, as in PyTorch: its kernels
read halves in float32 and keep float32 statistics). The table follows PyTorch's lists
(aten/src/ATen/autocast_mode.cpp), which differ by device: on the CPU only matmuls and attention go down and only
the losses go up. `ops.apply` consults it (through `hooks.autocast`) for every primitive, and the few composites PyTorch lists (linear,
scaled_dot_product_attention) and `sum` (whose result dtype is an attribute) consult it by name; VJPs run outside
autocast, in the dtypes the forward used, so gradients of float32 parameters arrive in float32.
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable

from blutrain import dtypes
from blutrain.dtypes import DType
from blutrain.autograd.tape import grad_mode, hooks
from blutrain.tensor import Tensor

__all__ = ["autocast", "is_autocast_enabled", "get_autocast_dtype", "POLICY"]

# *** autocast ***

LOWER, FP32 = "lower", "fp32"
_MATMULS = dict.fromkeys(("matmul", "linear", "conv", "conv_grad_input", "flash_attention", "flash_attention_lse",
                           "flash_attention_transposed", "scaled_dot_product_attention"),
                         LOWER)
POLICY: dict[str, dict[str, str]] = {
  "cuda": {**_MATMULS, **dict.fromkeys(("exp", "log", "rsqrt", "pow", "sum", "cumsum", "cumprod", "softmax", "log_softmax",
                                        "tan", "asin", "acos", "sinh", "cosh", "exp2", "expm1", "log2", "log10", "log1p",
                                        "layer_norm", "cross_entropy"), FP32)},
  "cpu": {**_MATMULS, "cross_entropy": FP32},
}
_HALVES = (dtypes.float16, dtypes.bfloat16)
_LISTED = frozenset(name for table in POLICY.values() for name in table)  # NOTE: POLICY is fixed at import


class _State(threading.local):
  def __init__(self):
    self.dtype: dict[str, DType | None] = {}   # device type -> the active autocast dtype (None: off)
    self.cache_enabled = True
    self.cache: dict[tuple, tuple[Tensor, int, Tensor]] = {}  # casts of parameters, reused inside the outermost context
    self.cast: dict[tuple, weakref.ref] = {}   # the cache's keys of this outermost context -> their parameters
    self.last: dict[tuple, weakref.ref] = {}   # those of the previous outermost context, until its first cast here
    self.depth = 0


_state = _State()


def is_autocast_enabled(device_type: str = "cuda") -> bool:
  """Whether autocast is on for `device_type` in this thread."""
  return _state.dtype.get(device_type) is not None


def get_autocast_dtype(device_type: str = "cuda") -> DType | None:
  """The dtype autocast casts to on `device_type`, or None outside autocast."""
  return _state.dtype.get(device_type)


def state() -> tuple:
  """What autocast does in this thread now, as a hashable value: ((device type, dtype), ...) for the device types it
  casts on, and whether parameter casts are cached. Nova's guard holds it: a step captured under autocast must not
  replay outside it."""
  return tuple(sorted((k, d.name) for k, d in _state.dtype.items() if d is not None)), _state.cache_enabled


def _lower(t: Tensor, dtype: DType) -> Tensor:
  """t in dtype; a parameter's cast is made once per outermost autocast context (and per grad mode and version).
  The first cast of a context also casts, in the same multi-tensor op, the parameters that the previous outermost
  context cast (with this dtype and grad mode, on t's device): a training step's weights, each cast again in each
  step, in one launch instead of one each."""
  if not (_state.cache_enabled and t.is_leaf and t.requires_grad and hooks.trace is None): return t.to(dtype)
  key = (id(t), dtype, grad_mode.enabled)
  if _state.last: _cast_last(key, t)
  hit = _state.cache.get(key)
  if hit is None or hit[0] is not t or hit[1] != t._storage.version:
    hit = _state.cache[key] = (t, t._storage.version, t.to(dtype))
    _state.cast[key] = weakref.ref(t)
  return hit[2]


def _cast_last(key: tuple, t: Tensor) -> None:
  """Cast the parameters of the previous context's casts that match key's dtype and grad mode and t's device, and
  t, at once (`ops.elementwise.cast_each`) into the cache."""
  from blutrain.ops.elementwise import cast_each
  last, _state.last = _state.last, {}
  params = {id(t): t}
  for k, ref in last.items():
    p = ref()
    if (p is not None and k[1:] == key[1:] and p.is_leaf and p.requires_grad and p._storage.device == t._storage.device
        and p.dtype is not key[1]): params[id(p)] = p
  if len(params) < 2: return
  for p, out in zip(params.values(), cast_each(list(params.values()), key[1])):
    k = (id(p), *key[1:])
    _state.cache[k], _state.cast[k] = (p, p._storage.version, out), weakref.ref(p)


def _cast(name: str, inputs: tuple) -> tuple:
  """The inputs of op `name` as the policy table says (the `hooks.autocast` slot that `ops.apply` calls under autocast)."""
  if name not in _LISTED: return inputs  # most ops: nothing to look at
  kind = None
  for t in inputs:  # the first tensor's device type; CPU scalars (numbers) go with other devices' tensors
    if isinstance(t, Tensor):
      kind = t._storage.device.type
      if kind != "cpu" or t.shape: break
  if kind is None: return inputs
  target = _state.dtype.get(kind)
  rule = POLICY.get(kind, {}).get(name) if target is not None else None
  if rule is None: return inputs
  if rule == FP32:
    return tuple(t.to(dtypes.float32) if isinstance(t, Tensor) and t.dtype in _HALVES else t for t in inputs)
  return tuple(_lower(t, target) if isinstance(t, Tensor) and t.dtype.is_floating_point and t.dtype is not target
               and t.dtype is not dtypes.float64 and t.device.type == kind else t for t in inputs)


class autocast:
  """Context manager (and decorator) running matmuls and attention in a lower-precision dtype and precision-sensitive
  ops in float32, as `torch.autocast`.

  Args:
    device_type: "cuda" or "cpu"; only tensors on that device type are cast.
    dtype: bfloat16 (default, on both device types: float16 would need gradient scaling) or float16.
    enabled: False turns autocast off for the block (for this device type), also inside an enabled one.
    cache_enabled: reuse the cast of a parameter within the outermost context (tied weights cast once).

  Example::

    with bt.autocast("cuda", dtype=bt.bfloat16):
      loss = model(x, y)   # linear layers and attention in bfloat16, layer norms and the loss in float32
    loss.backward()        # gradients of float32 parameters are float32
  """

  def __init__(self, device_type: str = "cuda", dtype: DType | None = None, enabled: bool = True,
               cache_enabled: bool = True):
    if device_type not in POLICY:
      raise ValueError(f"autocast: device_type must be one of {sorted(POLICY)}, got {device_type!r}")
    dtype = dtypes.bfloat16 if dtype is None else dtypes.to_dtype(dtype)
    if dtype not in _HALVES:
      raise ValueError(f"autocast: dtype must be bfloat16 or float16, got {dtype.name}")
    self.device_type, self.fast_dtype, self.enabled, self.cache_enabled = device_type, dtype, bool(enabled), bool(cache_enabled)
    self._saved: list[tuple] = []

  def __enter__(self) -> autocast:
    s = _state
    self._saved.append((s.dtype.get(self.device_type), s.cache_enabled, hooks.autocast))
    s.dtype[self.device_type] = self.fast_dtype if self.enabled else None
    s.cache_enabled = s.cache_enabled and self.cache_enabled
    s.depth += 1
    hooks.autocast = _cast if any(d is not None for d in s.dtype.values()) else None
    return self

  def __exit__(self, *exc) -> None:
    s = _state
    s.dtype[self.device_type], s.cache_enabled, hooks.autocast = self._saved.pop()
    s.depth -= 1
    if s.depth == 0: s.cache, s.cast, s.last = {}, {}, s.cast

  def __call__(self, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any):
      with autocast(self.device_type, self.fast_dtype, self.enabled, self.cache_enabled): return fn(*args, **kwargs)
    return wrapper
