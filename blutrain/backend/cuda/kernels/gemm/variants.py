"""The variants of synthesized GEMMs that CI compiles for sm_90 without a GPU (tests/test_cuda_kernels_compile.py)."""
from __future__ import annotations

from blutrain import dtypes
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import Spec, broadcast_shape
from blutrain.backend.cuda.kernels.gemm.operand_copy import copy_spec
from blutrain.backend.cuda.kernels.gemm.plan import plan
from blutrain.backend.cuda.kernels.matrix import transposed
from blutrain.shapes import contiguous_strides


def specs() -> list[Spec]:
  """What CI compiles: the kernels planned for layouts that reach every structure the host picks (persistent TMA
  and pointer kernels, split-K and its reduction, the K-major copy, the swapped orientation, batches, misaligned and
  int64-indexed operands, K = 0) in every precision, and each epilogue op; planned without a GPU (fake addresses)."""
  f32, bf16, f16 = dtypes.float32, dtypes.bfloat16, dtypes.float16

  def arr(shape, dtype, mode="n"):
    """A matrix (batch) at a fake 512-aligned address: "n" row-major, "t" stored transposed, "odd" rows padded by 1."""
    shape = tuple(shape)
    if mode == "t": return transposed(arr(shape[:-2] + shape[-2:][::-1], dtype))
    if mode == "odd":
      st = contiguous_strides(shape[:-1] + (shape[-1] + 1,))
      return CudaArray(1 << 20, shape, st, dtype, 0, None)
    return CudaArray(1 << 20, shape, contiguous_strides(shape), dtype, 0, None)

  def launches(a, b, prec="", epilogue=(), bias=None, aux=(), out_dtype=None):
    shape = broadcast_shape(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    p = plan(a, b, arr(shape, out_dtype or a.dtype), bias, tuple(aux), tuple(epilogue), prec)
    copied = [copy_spec(a if op == "a" else transposed(b), prec == "tf32") for op in p.copy]
    return copied + [sp for sp, _, _ in p.launches]

  T, M = 16384, 768
  out = []
  for dt, prec in ((bf16, ""), (f32, "tf32")):
    out += launches(arr((T, M), dt), arr((M, 2304), dt, "t"), prec)                  # y = x W^T
    out += launches(arr((T, 2304), dt), arr((2304, M), dt), prec)                    # dx = dy W
    out += launches(arr((3072, T), dt, "t"), arr((T, M), dt), prec)                  # dW = dy^T x: split-K
    out += launches(arr((2304, T), dt, "t"), arr((T, M), dt), prec)
    out += launches(arr((1024, 1024), dt), arr((1024, 1024), dt), prec)              # squares: TF32 swaps, rounds B
    out += launches(arr((8, 128, 4096), dt), arr((8, 4096, 64), dt), prec)           # batched split-K
    out += launches(arr((2, 12, 64, 64), dt, "t"), arr((2, 12, 64, 128), dt), prec)  # batched, both MN-major
    out += launches(arr((200, 1000), dt, "odd"), arr((1000, 300), dt, "odd"), prec)  # misaligned
  out += launches(arr((T, M), f32), arr((M, 2304), f32, "t"), "tf32x3")
  out += launches(arr((4, 33, 65), f32), arr((4, 65, 17), f32, "t"), "tf32x3")
  out += launches(arr((T, M), bf16), arr((M, 3072), bf16), out_dtype=f32)
  out += launches(arr((T, M), f16), arr((M, 3072), f16, "t"), "", ("bias", "gelu_tanh"), arr((3072,), f16))
  out += launches(arr((T, 3072), bf16), arr((3072, M), bf16, "t"), "", ("scale", "bias", "gelu", "residual"),
                  arr((M,), f32), [CudaArray(1 << 20, (T, M), (0, 1), bf16, 0, None)])
  out += launches(arr((T, M), bf16), arr((M, 3072), bf16), "", ("gelu_backward_tanh",), None, [arr((T, 3072), bf16)])
  out += launches(arr((2048, 2048), f32), arr((2048, 2048), f32), "tf32", ("bias", "gelu"), arr((2048,), f32))
  out += launches(arr((3, 100, 96), f16, "odd"), arr((96, 80), f16), "", ("residual", "gelu_backward"), None,
                  [arr((3, 100, 80), f16, "t"), arr((3, 100, 80), f32)])
  out += launches(arr((T, M), bf16), arr((M, 3072), bf16, "t"), "", ("round", "bias", "round", "save", "gelu"),  # Nova's
                  arr((3072,), bf16), [arr((T, 3072), bf16)])                                        # fused MLP
  out += launches(arr((T, 3072), bf16), arr((3072, M), bf16, "t"), "", ("round", "bias", "round", "residual"),
                  arr((M,), bf16), [arr((T, M), f32)], f32)
  out += launches(arr((3, 100, 96), f16, "odd"), arr((96, 80), f16), "", ("round", "save", "gelu_tanh"), None,
                  [arr((3, 100, 80), f16, "t")])                                                     # saved, by pointers
  out += launches(arr((65536, M), bf16), arr((M, 50304), bf16, "t"))                 # int64 offsets
  out += launches(arr((64, 0), f32), arr((0, 64), f32), "tf32", ("bias",), arr((64,), f32))  # K = 0
  return out
