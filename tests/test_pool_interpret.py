"""The CUDA kernels of max_pool2d (`max_pool2d_indices`, also storing the maxima as `max_pool2d_with_indices`,
`max_pool2d_values`, `max_pool2d_backward`) without a GPU: Triton's interpreter (TRITON_INTERPRET=1, in a
subprocess, since it must be set before Triton is imported) runs the kernel as its host wrapper launches it, on
torch CPU tensors (test-only), against the CPU backend's kernel and PyTorch's own indices: padding, dilation, strides,
ceil_mode windows, channels-last input (written channels-last; with unit channel strides the vector variants), ties,
NaNs, integers."""
import numpy as np

from tests.helpers import patch_interpreter_loop_bounds, run_under_triton_interpreter

CASES = [  # (x shape, kernel, stride, padding, dilation, ceil_mode)
  ((2, 3, 7, 6), (2, 2), (2, 2), (0, 0), (1, 1), False),
  ((2, 3, 9, 8), (3, 3), (2, 2), (1, 1), (1, 1), False),  # ResNet's stem pool
  ((1, 2, 7, 6), (3, 2), (2, 1), (1, 0), (1, 1), True),
  ((1, 2, 8, 7), (2, 2), (1, 2), (1, 1), (2, 2), False),
  ((2, 48, 9, 8), (3, 3), (2, 2), (1, 1), (1, 1), False),  # channels-last: masked columns, several row tiles, vectors
]


def _run_case(shape, kernel, stride, padding, dilation, ceil_mode, dtype: str, channels_last: bool,
              with_values: bool) -> None:
  import torch
  from blutrain.backend.cpu.kernels import kernels as cpu
  from blutrain.backend.cuda.kernels import pool
  from blutrain.shapes import cdiv
  from blutrain import dtypes
  rng = np.random.default_rng(sum(shape))
  a = rng.integers(-3, 3, shape) if dtype == "int64" else rng.standard_normal(shape).round(1)  # rounding: ties
  if dtype != "int64": a.flat[rng.integers(0, a.size, 3)] = np.nan
  x = torch.tensor(a, dtype=getattr(torch, dtype))
  if channels_last: x = x.contiguous(memory_format=torch.channels_last)
  want_y, want = torch.nn.functional.max_pool2d(x.double(), kernel, stride, padding, dilation, ceil_mode,
                                                return_indices=True)
  out_size = tuple(want.shape[2:])
  out = torch.empty(want.shape, dtype=torch.int64)  # the kernel walks it as a flat array in its memory order
  if channels_last: out = out.contiguous(memory_format=torch.channels_last)
  rows, cols = pool.tiles(tuple(out.shape), channels_last)
  vectors = channels_last and shape[1] % 16 == 0  # the variant with unit channel strides (the interpreter's values)
  like = lambda t: t.contiguous(memory_format=torch.channels_last) if channels_last else t  # the kernels' layout
  found = like(torch.empty(want.shape, dtype=x.dtype))
  s = pool.max_pool2d_indices_spec(getattr(dtypes, dtype), rows, cols, False, channels_last, vectors, with_values)
  s[0][pool.grid(s, rows, cols)](out, found, x, rows, cols, shape[1], *out_size, *shape[2:], *kernel, *stride,
                                 *padding, *dilation, *x.stride(), **s.constexprs)
  host = cpu["max_pool2d_indices"](x.double().numpy(), kernel=kernel, stride=stride, padding=padding, dilation=dilation,
                                   out_size=out_size)
  case = (shape, kernel, stride, padding, dilation, ceil_mode, dtype, channels_last, with_values)
  assert np.array_equal(out.numpy(), want.numpy()), f"kernel against PyTorch: {case}"
  assert np.array_equal(host, want.numpy()), f"CPU kernel against PyTorch: {case}"
  if with_values:
    assert np.array_equal(found.double().numpy(), want_y.numpy(), equal_nan=True), f"maxima: {case}"
    return
  n, dt = out.numel(), getattr(dtypes, dtype)
  values = like(torch.empty(want.shape, dtype=x.dtype))
  v = pool.max_pool2d_values_spec(dt, n, False, channels_last)
  v[0][(cdiv(n, v.constexprs["BLOCK"]),)](values, x, out, n, *out.shape[1:], shape[3], *x.stride(), **v.constexprs)
  assert np.array_equal(values.double().numpy(), want_y.numpy(), equal_nan=True), f"values: {case}"
  if dtype == "int64": return
  g = like(torch.tensor(rng.standard_normal(want.shape)).to(x.dtype))
  xr = x.double().requires_grad_()
  torch.nn.functional.max_pool2d(xr, kernel, stride, padding, dilation, ceil_mode).backward(g.double())
  dx = like(torch.empty(shape, dtype=x.dtype))
  rows, cols = pool.tiles(shape, channels_last)
  b = pool.max_pool2d_backward_spec(dt, rows, cols, False, channels_last, vectors)
  b[0][pool.grid(b, rows, cols)](dx, g, out, rows, cols, shape[1], *shape[2:], *out_size,
                                 *map(pool.windows_per_position, kernel, stride, dilation), *stride, *padding,
                                 *g.stride(), *out.stride(), **b.constexprs)
  tol = 2e-3 if dtype == "float16" else 1e-6  # sums of up to 4 windows' gradients, rounded once
  assert np.allclose(dx.double().numpy(), xr.grad.numpy(), rtol=tol, atol=tol), f"gradient: {case}"


def main() -> None:
  patch_interpreter_loop_bounds()
  for case in CASES:
    for dtype in ("float32", "float16", "int64"):  # (the interpreter holds bfloat16 as raw bits: it cannot compare them)
      for channels_last in (False, True):
        for with_values in (False, True):
          _run_case(*case, dtype, channels_last, with_values)
  print("ok")


def test_max_pool2d_indices_under_triton_interpreter():
  run_under_triton_interpreter("tests.test_pool_interpret")


if __name__ == "__main__":
  main()
