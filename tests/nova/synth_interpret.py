"""Run by test_fuse_pointwise.py with TRITON_INTERPRET=1 (set before Triton is imported, so every JIT function is
interpreted): synthesized kernels of fused groups run on torch CPU tensors (flat, broadcast, transposed and 0-d
inputs, and a host scalar by value; float32, bfloat16 and bool) and their outputs are compared with the group evaluated eagerly in float64.
The interpreter has no libdevice, so the bodies use ops whose formulas are triton.language's own (add, mul, where,
gelu, gelu_backward, div, maximum, casts, comparisons)."""
import numpy as np
import torch

from blutrain import dtypes
from blutrain.nova import codegen, ir, synth
from blutrain.nova.dialect import FusedOp
from blutrain.shapes import strides_in_order
from blutrain.nova.passes.fuse_pointwise import fuse
from tests.nova.graphs import Builder, evaluate

TORCH = {dtypes.float32: torch.float32, dtypes.bfloat16: torch.bfloat16, dtypes.float64: torch.float64,
         dtypes.bool_: torch.bool}


def bias_gelu_residual(b, dt):
  x, bias, r = b.input((6, 40), dt), b.input((40,), dt), b.input((6, 40), dt)
  h = b("add", x, bias)
  return [h, b("add", b("gelu", h, approximate="tanh"), r)]


def masked_scale(b, dt):
  x, w, s = b.input((5, 24), dt), b.input((5, 1), dt), b.input((), dt)
  pos = b("gt", x, b.full((), 0.0, dt))
  y = b("where", pos, b("mul", x, w), b("div", b("neg", x), s))
  return [pos, b("maximum", b("cast", y, dtype=dtypes.float32), b.full((), -0.5)) if dt is not dtypes.float64 else
          b("maximum", y, b.full((), -0.5, dt))]


def gelu_grad(b, dt):
  g, x, c = b.input((3, 7, 9), dt), b.input((3, 7, 9), dt), b.input((9,), dt)
  d = b("gelu_backward", g, x, approximate="none")
  return [b("sub", b("mul", d, b.full((), 0.25, dt)), c)]


# (case, inputs passed transposed, inputs passed by value as host scalars), by position
CASES = [(bias_gelu_residual, (), ()), (masked_scale, (), (2,)), (masked_scale, (0,), ()), (gelu_grad, (0,), ())]


def run(case, dt, transposed, by_value):
  b = Builder()
  outs = case(b, dt)
  graph = b.output(*outs)
  module = ir.to_module(graph)
  assert fuse(module) == 1, case.__name__
  op = next(o for o in ir.function(module).body.block.ops if isinstance(o, FusedOp))
  rng = np.random.default_rng(1)
  arrays = [rng.standard_normal(v.shape).astype(np.float64) for v in graph.inputs]
  tensors = []
  for i, (v, a) in enumerate(zip(graph.inputs, arrays)):
    t = torch.tensor(a).to(TORCH[v.dtype])
    if i in transposed: t = t.transpose(-1, -2).contiguous().transpose(-1, -2)  # the same values, column-major
    tensors.append(t)
  body = codegen.body_of(op)
  shape = tuple(op.outs[0].type.get_shape())
  layouts = [None if i in by_value else (tuple(t.shape), tuple(t.stride()), v.dtype, t.data_ptr() % 16)
             for i, (t, v) in enumerate(zip(tensors, graph.inputs))]
  tensors = [t.float().item() if i in by_value else t for i, t in enumerate(tensors)]
  s, grid, scalars, order = synth.plan(body, shape, layouts)  # the outputs follow the first input of their shape
  results = [torch.empty_strided(shape, strides_in_order(shape, order), dtype=TORCH[body.dtype(r)])
             for r in body.outputs]
  s[0][grid](*results, *tensors, *scalars, BLOCK=s[2]["BLOCK"])
  b64 = Builder()
  want = evaluate(b64.output(*case(b64, dtypes.float64)), arrays)
  for got, w, v in zip(results, want, outs):
    got = got.to(torch.float64).numpy()
    tol = 2e-2 if dtypes.bfloat16 in (v.dtype, dt) else 1e-5
    np.testing.assert_allclose(got, w.astype(np.float64), rtol=tol, atol=tol, err_msg=f"{case.__name__} {dt.name}")
  return s


if __name__ == "__main__":
  n = 0
  for case, transposed, by_value in CASES:
    for dt in (dtypes.float32, dtypes.bfloat16):
      run(case, dt, transposed, by_value)
      n += 1
  print(f"checked {n} kernels")
