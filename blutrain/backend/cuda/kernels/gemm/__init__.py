"""Synthesized GEMMs, the path of `bt.backends.matmul = "triton"`: `C = epilogue(A @ B)` as Triton source generated
per problem structure, scheduled by the Analytic Configurator (blutrain/configurator.py) with no autotuning, and
compiled and launched through `launch`.

- source.py: what a kernel is (`Structure`), its generated Triton source, its compiled variants;
- operand_copy.py: the K-major (TF32-rounded) copy of an operand that the configurator may ask for;
- plan.py: from operand layouts to the schedule, structure and launches (cached per layout), and queueing them;
- variants.py: the variants CI compiles without a GPU;
- here: `gemm`, the host entry, which checks its arguments, copies operands that no kernel reads and caches calls.
"""
from __future__ import annotations

from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import broadcast_shape, broadcast_strides, empty
from blutrain.backend.cuda.kernels.copy import copy
from blutrain.backend.cuda.kernels.gemm.plan import Plan, layout_key, plan, precision_of
from blutrain.backend.cuda.kernels.gemm.source import EPILOGUE, TENSOR_OPERANDS
from blutrain.backend.cuda.kernels.gemm.variants import specs
from blutrain.backend.cuda.kernels.matrix import blas_operand, unit_axis
from blutrain.dtypes import DType, bfloat16, float16, float32

DTYPES = (float32, bfloat16, float16)


def _check(a: CudaArray, b: CudaArray, epilogue: tuple[str, ...], bias, residual, gelu_input, saved, out,
           out_dtype) -> None:
  if a.dtype not in DTYPES or b.dtype is not a.dtype or a.device != b.device:
    raise TypeError(f"gemm: operands must share a dtype among {[d.name for d in DTYPES]} and a device, got "
                    f"{a.dtype.name} on cuda:{a.device} and {b.dtype.name} on cuda:{b.device}")
  if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
    raise ValueError(f"gemm: cannot contract {a.shape} with {b.shape} ({a.dtype.name}, cuda:{a.device})")
  bad = [op for op in epilogue if op not in EPILOGUE]
  if bad: raise ValueError(f"gemm: unknown epilogue ops {bad}; expected some of {EPILOGUE}")
  for what, x, ops in (("bias", bias, ("bias",)), ("residual", residual, ("residual",)),
                       ("gelu_input", gelu_input, ("gelu_backward", "gelu_backward_tanh")), ("saved", saved, ("save",))):
    listed = sum(op in ops for op in epilogue)
    if listed > 1 or (x is None) != (listed == 0):
      raise ValueError(f"gemm: {what} must be given exactly when the epilogue lists one of {ops} once; epilogue "
                       f"{epilogue}, {what} {'absent' if x is None else 'given'}")
    if x is not None and (x.device != a.device or not x.dtype.is_floating_point):
      raise TypeError(f"gemm: {what} must be a floating tensor on cuda:{a.device}, got {x.dtype.name} on cuda:{x.device}")
  shape = broadcast_shape(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
  if bias is not None and bias.shape != (b.shape[-1],):
    raise ValueError(f"gemm: bias of shape {bias.shape} for an output with {b.shape[-1]} columns")
  for what, x in (("residual", residual), ("gelu_input", gelu_input)):
    if x is not None and broadcast_shape(x.shape, shape) != shape:
      raise ValueError(f"gemm: {what} of shape {x.shape} does not broadcast to the output's {shape}")
  if saved is not None and saved.shape != shape:
    raise ValueError(f"gemm: saved of shape {saved.shape}; expected the output's {shape}")
  if out is not None and (out.shape != shape or out.dtype is not (out_dtype or a.dtype) or out.device != a.device):
    raise ValueError(f"gemm: out is {out.shape} {out.dtype.name} on cuda:{out.device}; expected {shape} "
                     f"{(out_dtype or a.dtype).name} on cuda:{a.device}")


_calls: dict[tuple, tuple[Plan, tuple[int, ...], DType]] = {}  # a call's layouts -> plan, output shape and dtype


def gemm(a: CudaArray, b: CudaArray, *, out: CudaArray | None = None, epilogue: tuple[str, ...] = (),
         bias: CudaArray | None = None, residual: CudaArray | None = None, gelu_input: CudaArray | None = None,
         saved: CudaArray | None = None, alpha: float = 1.0, precision: str | None = None,
         out_dtype: DType | None = None) -> CudaArray:
  """C = epilogue(a @ b) over broadcast batch dims, by a synthesized Triton kernel scheduled by the configurator.

  Args:
    a, b: (*, M, K) and (*, K, N) float32, bfloat16 or float16; each matrix needs a unit stride in one of its last
      two dims (others are copied); batch dims broadcast (stride 0 is fine).
    out: where to write C (any strides; one with no unit stride in its last two dims gets a copy).
    epilogue: ops applied in order to the float32 accumulator, from EPILOGUE: "scale" (times alpha), "bias" (+ a
      vector of N), "gelu"/"gelu_tanh", "residual" (+ a tensor broadcasting to C), "gelu_backward"/"_tanh" (times
      gelu'(gelu_input)), "round" (to a's dtype and back), "save" (the value so far written into `saved`, an array
      of C's shape, in its dtype); then the cast to the output dtype.
    precision: float32 operands only: "tf32" or "tf32x3" (default "tf32x3", float32-level error).
    out_dtype: the output dtype (default a's).
  """
  epilogue = tuple(epilogue)
  prec = precision_of(a.dtype, precision)
  key = (layout_key(a), layout_key(b), layout_key(out), layout_key(bias), layout_key(residual), layout_key(gelu_input),
         layout_key(saved), epilogue, prec, out_dtype, a.device)
  tensors = {"residual": residual, "gelu_backward": gelu_input, "gelu_backward_tanh": gelu_input, "save": saved}
  hit = _calls.get(key)
  if hit is not None:  # a layout seen before, with nothing to copy: straight to the launches
    p, shape, dtype = hit
    if out is None: out = empty(shape, dtype, a.device)
    p.launch(a, b, out, bias, [tensors[op].ptr for op in epilogue if op in TENSOR_OPERANDS], alpha)
    return out
  _check(a, b, epilogue, bias, residual, gelu_input, saved, out, out_dtype)
  shape = broadcast_shape(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
  target = out
  if out is None or not unit_axis(out)[0]: out = empty(shape, out_dtype or a.dtype, a.device)
  if out.size:
    a2, b2 = blas_operand(a), blas_operand(b)
    bias2 = copy(bias) if bias is not None and bias.strides != (1,) else bias
    aux = tuple(tensors[op] for op in epilogue if op in TENSOR_OPERANDS)
    aux = tuple(CudaArray(x.ptr, shape, broadcast_strides(x, shape), x.dtype, x.device, x.owner) for x in aux)
    p = plan(a2, b2, out, bias2, aux, epilogue, prec)
    if a2 is a and b2 is b and bias2 is bias and target in (None, out): _calls[key] = (p, shape, out.dtype)
    p.launch(a2, b2, out, bias2, [x.ptr for x in aux], alpha)
  if target is not None and target is not out:
    copy(out, out=target)
    return target
  return out


def __getattr__(name: str):
  if name == "SPECS": return specs()  # planned when CI asks, not at every import (about 0.7 s)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
