"""blutrain: a deep-learning training framework with PyTorch's surface and a whole-graph compiler, Nova."""
import importlib
import importlib.abc
import importlib.util
import sys

from blutrain.dtypes import (DType as dtype, bool_ as bool, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64,
                             promote_types, result_type)
from blutrain.device import Device as device
from blutrain.shapes import memory_format, contiguous_format, preserve_format, channels_last, channels_last_3d
from blutrain.tensor import Tensor
from blutrain.ops import (no_grad, enable_grad, set_grad_enabled, is_grad_enabled, full, zeros, ones, empty, full_like,
                          zeros_like, ones_like, empty_like, arange, linspace, eye, tensor, as_tensor, from_numpy,
                          from_dlpack, Generator, manual_seed, rand, randn, randint, rand_like, randn_like, exp, log,
                          sqrt, rsqrt, abs, sin, cos, tanh, sigmoid, relu, erf, sign, floor, add, sub, mul, div, pow,
                          maximum, minimum, eq, ne, lt, le, gt, ge, logical_and, logical_or, logical_not, where, clamp,
                          clip, masked_fill, lerp, sum, mean, var, std, amax, amin, argmax, argmin, max, min, logsumexp,
                          cumsum, all, any, reshape, permute, transpose, squeeze, unsqueeze, flatten, narrow, split,
                          chunk, unbind, cat, stack, nonzero, matmul, softmax, log_softmax, gather, scatter_add,
                          index_select, tril, triu, isnan, isfinite)
from blutrain.ops import default_generator
from blutrain.ops import (allclose, argsort, bernoulli, bmm, cumprod, diag, diagonal, einsum, equal, flip, inference_mode,
                          isclose, kthvalue, mm, msort, multinomial, normal, outer, prod, randperm, roll, sort, topk, Size,
                          acos, acosh, asin, asinh, atan, atan2, atanh, ceil, copysign, cosh, exp2, expm1, floor_divide,
                          fmod, isinf, log1p, log2, log10, logaddexp, remainder, round, sinh, tan, trunc, bitwise_and,
                          bitwise_or, bitwise_xor, bitwise_not, bitwise_left_shift, bitwise_right_shift, logcumsumexp,
                          masked_select, repeat_interleave, cummax, cummin, scatter_reduce, scatter, norm)
from blutrain import autograd
from blutrain.amp import autocast
from blutrain.backends import set_float32_matmul_precision, get_float32_matmul_precision

half, float, long, int, short, double, bool_ = float16, float32, int64, int32, int16, float64, bool

__version__ = "0.1.0"


class _Reexports(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Modules at PyTorch's import paths for library modules that stand above the process groups, made on first import
  from the module's public names: `blutrain.distributed.optim` (torch.distributed.optim) re-exports
  blutrain.optim.zero."""
  paths = {"blutrain.distributed.optim": "blutrain.optim.zero"}

  def find_spec(self, name, path=None, target=None):
    return importlib.util.spec_from_loader(name, self) if name in self.paths else None

  def exec_module(self, module) -> None:
    source = importlib.import_module(self.paths[module.__name__])
    module.__all__ = list(source.__all__)
    module.__dict__.update({n: getattr(source, n) for n in source.__all__})


sys.meta_path.insert(0, _Reexports())


def __getattr__(name: str):
  # submodules that pull in more (nn, optim, models, data) load on first use
  if name == "compile": return importlib.import_module("blutrain.nova.jit").compile
  if name in ("save", "load"): return getattr(importlib.import_module("blutrain.serialization"), name)
  if name in ("nn", "optim", "models", "data", "cuda", "amp", "utils", "nova", "profiler", "backends"):
    return importlib.import_module(f"blutrain.{name}")
  raise AttributeError(f"module 'blutrain' has no attribute {name!r}")
