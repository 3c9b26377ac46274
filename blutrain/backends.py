"""Backend choices, as `torch.backends`: `bt.backends.matmul` picks who runs float32, bfloat16 and float16 matmuls on
CUDA: "cublas" (cuBLASLt, the default) or "nova" (GEMM kernels synthesized per problem and scheduled by Nova's
Analytic Configurator: blutrain/backend/cuda/kernels/gemm.py). float64 matmuls always run on cuBLASLt. The
environment variable BLUTRAIN_MATMUL sets the starting value.

  bt.backends.matmul = "nova"
"""
from __future__ import annotations

import os
import sys
import types

MATMUL = ("cublas", "nova")


def _checked(value: str) -> str:
  if value not in MATMUL:
    raise ValueError(f"bt.backends.matmul: expected one of {', '.join(map(repr, MATMUL))}, got {value!r}")
  return value


class _Backends(types.ModuleType):
  """The module with a checked `matmul` attribute."""

  @property
  def matmul(self) -> str: return self.__dict__["_matmul"]

  @matmul.setter
  def matmul(self, value: str) -> None: self.__dict__["_matmul"] = _checked(value)


_matmul = _checked(os.environ.get("BLUTRAIN_MATMUL", "cublas"))
sys.modules[__name__].__class__ = _Backends
