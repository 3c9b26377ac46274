"""Data types and PyTorch's type-promotion rules."""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


class DTypeError(RuntimeError, TypeError):
  """A dtype an op cannot take: a RuntimeError, as PyTorch raises, and a TypeError, as blutrain raised before."""


class UnsupportedDType(NotImplementedError, DTypeError):
  """An op that has no meaning for a dtype (abs of bools, gelu of integers): NotImplementedError, as PyTorch raises."""


@dataclass(frozen=True, eq=False)
class DType:
  """A tensor element type. Instances are singletons: compare with `is` or `==`."""
  name: str
  np: np.dtype
  itemsize: int
  category: int  # 0 bool, 1 integer, 2 floating: promotion orders categories first

  @property
  def is_floating_point(self) -> bool: return self.category == 2

  def __repr__(self) -> str: return f"blutrain.{self.name}"
  def __reduce__(self): return (to_dtype, (self.name,))


bool_ = DType("bool", np.dtype(np.bool_), 1, 0)
uint8 = DType("uint8", np.dtype(np.uint8), 1, 1)
int8 = DType("int8", np.dtype(np.int8), 1, 1)
int16 = DType("int16", np.dtype(np.int16), 2, 1)
int32 = DType("int32", np.dtype(np.int32), 4, 1)
int64 = DType("int64", np.dtype(np.int64), 8, 1)
float16 = DType("float16", np.dtype(np.float16), 2, 2)
bfloat16 = DType("bfloat16", np.dtype(ml_dtypes.bfloat16), 2, 2)
float32 = DType("float32", np.dtype(np.float32), 4, 2)
float64 = DType("float64", np.dtype(np.float64), 8, 2)  # NOTE: for references and numpy interop, not training

all_dtypes = (bool_, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64)
_by_name = {d.name: d for d in all_dtypes} | {"bool_": bool_, "half": float16, "float": float32, "long": int64,
                                              "int": int32, "short": int16, "double": float64, "bf16": bfloat16, "fp16": float16,
                                              "fp32": float32}
_by_np = {d.np: d for d in all_dtypes}
default_float = float32


def to_dtype(x) -> DType:
  """Accept a DType, its name ('float32', 'bf16'), a numpy dtype, or the Python types bool/int/float."""
  if isinstance(x, DType): return x
  if x is bool: return bool_
  if x is int: return int64
  if x is float: return default_float
  if isinstance(x, str) and x in _by_name: return _by_name[x]
  try:
    return _by_np[np.dtype(x)]
  except (TypeError, KeyError):
    raise TypeError(f"unsupported dtype {x!r}; expected one of {', '.join(d.name for d in all_dtypes)}") from None


def is_dtype_name(name: str) -> bool:
  """Whether `to_dtype` takes this string ('float32', 'bf16', ...)."""
  return name in _by_name


def promote_types(a: DType, b: DType) -> DType:
  """The smallest dtype both convert to, as torch.promote_types: float16 with bfloat16 gives float32."""
  if a is b: return a
  if a.category != b.category: return a if a.category > b.category else b
  if {a, b} == {float16, bfloat16}: return float32
  if {a, b} == {uint8, int8}: return int16  # the one unsigned type: its values and int8's need the next signed width
  if uint8 in (a, b) and a.itemsize == b.itemsize: return a if a is not uint8 else b
  return a if a.itemsize >= b.itemsize else b


def scalar_dtype(x) -> DType:
  if isinstance(x, bool): return bool_
  if isinstance(x, int): return int64
  if isinstance(x, float): return default_float
  raise TypeError(f"expected a Python number, got {type(x).__name__}")


def result_type(*args) -> DType:
  """Promote tensors and Python numbers as PyTorch does: dimensioned tensors, then 0-d tensors, then
  Python numbers, where a lower tier only matters when it is of a higher category (int tensor * 2.5 -> float)."""
  tiers: list[DType | None] = [None, None, None]
  for x in args:
    if hasattr(x, "dtype") and hasattr(x, "shape"): tier, dt = (0 if len(x.shape) else 1), x.dtype
    else: tier, dt = 2, scalar_dtype(x)
    tiers[tier] = dt if tiers[tier] is None else promote_types(tiers[tier], dt)
  out = None
  for dt in tiers:
    if dt is None: continue
    if out is None: out = dt
    elif dt.category > out.category: out = dt
  return out
