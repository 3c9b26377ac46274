"""Backend choices, as `torch.backends`, and the internal precision of float32 matmuls. A leaf: these are settings,
read by the op library when it builds an op: the float32 precision then travels as the op's `tf32` attribute, which a
kernel, a cache key and a compiled graph all see. `matmul` picks among CUDA kernels of the same math and is read by
the CUDA backend; Nova's guard holds both.

`bt.backends.matmul` picks who runs float32, bfloat16 and float16 matmuls on CUDA: "cublas" (cuBLASLt, the default)
or "triton" (GEMM kernels synthesized per problem and scheduled by the Analytic Configurator:
blutrain/backend/cuda/kernels/gemm/). float64 matmuls always run on cuBLASLt. The environment variable
BLUTRAIN_MATMUL sets the starting value.

`bt.backends.conv` picks who runs convolutions and their gradients on CUDA: "cudnn" (cuDNN's graph API, the default
where nvidia-cudnn-frontend and libcudnn load: bfloat16, float16, and float32 under TF32) or "triton" (the
implicit-GEMM kernels of blutrain/backend/cuda/kernels/conv.py, which also take every case cuDNN is not given).
BLUTRAIN_CONV sets the starting value.

  bt.backends.matmul = "triton"
  bt.backends.conv = "triton"
  bt.set_float32_matmul_precision("high")   # TF32 tensor cores for float32 matmuls and attention on CUDA
"""
from __future__ import annotations

import os
import sys
import types

MATMUL = ("cublas", "triton")
CONV = ("cudnn", "triton")
PRECISIONS = ("highest", "high", "medium")


def _checked(name: str, value: str, choices: tuple[str, ...]) -> str:
  if value not in choices:
    raise ValueError(f"bt.backends.{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
  return value


class _Backends(types.ModuleType):
  """The module with checked `matmul` and `conv` attributes."""

  @property
  def matmul(self) -> str: return self.__dict__["_matmul"]

  @matmul.setter
  def matmul(self, value: str) -> None: self.__dict__["_matmul"] = _checked("matmul", value, MATMUL)

  @property
  def conv(self) -> str: return self.__dict__["_conv"]

  @conv.setter
  def conv(self, value: str) -> None: self.__dict__["_conv"] = _checked("conv", value, CONV)


_matmul = _checked("matmul", os.environ.get("BLUTRAIN_MATMUL", "cublas"), MATMUL)
_conv = _checked("conv", os.environ.get("BLUTRAIN_CONV", "cudnn"), CONV)
_float32_matmul_precision = "highest"


def set_float32_matmul_precision(precision: str) -> None:
  """Internal precision of float32 matmuls and attention on CUDA, as `torch.set_float32_matmul_precision`.

  "highest" computes in float32; "high" lets cuBLASLt and flash attention use TF32 tensor cores (10 mantissa bits,
  float32 range and accumulation). "medium" means TF32 too, as in PyTorch's CUDA backend. CPU matmuls stay float32.
  The setting applies to ops built after the call: a matmul carries it as its `tf32` attribute.
  """
  if precision not in PRECISIONS:
    raise ValueError(f"set_float32_matmul_precision: expected one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
  sys.modules[__name__].__dict__["_float32_matmul_precision"] = precision


def get_float32_matmul_precision() -> str:
  """The precision set by `set_float32_matmul_precision` ("highest" by default)."""
  return sys.modules[__name__].__dict__["_float32_matmul_precision"]


def allow_tf32() -> bool:
  """Whether float32 matmuls built now may use TF32 tensor cores (the precision is not "highest")."""
  return sys.modules[__name__].__dict__["_float32_matmul_precision"] != "highest"


sys.modules[__name__].__class__ = _Backends
