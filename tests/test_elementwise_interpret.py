"""The CUDA elementwise kernels' ops without a GPU: Triton's interpreter (TRITON_INTERPRET=1, in a subprocess, since it
must be set before Triton is imported) runs `elementwise._apply`, the body every eager elementwise kernel and every
fused kernel Nova synthesizes calls, on torch CPU tensors (test-only) as the kernels load them (halves computed in
float32, stored back in their dtype), against the CPU backend's kernel: relu's gradient at zeros of both signs, NaNs
and infinities."""
import numpy as np
import pytest

from tests.helpers import run_under_triton_interpreter

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from blutrain.backend.cuda.kernels.elementwise import _apply, _compute  # noqa: E402

CASES = ("relu_backward", "gelu_backward")


@triton.jit
def _apply_kernel(out, a, b, n, OP: tl.constexpr, BLOCK: tl.constexpr):
  i = tl.arange(0, BLOCK)
  ok = i < n
  x = _compute(tl.load(a + i, mask=ok), OP)
  y = _compute(tl.load(b + i, mask=ok), OP)
  tl.store(out + i, _apply(x, y, x, OP).to(out.dtype.element_ty), mask=ok)


def _check(op: str, dtype: str) -> None:
  import torch
  from blutrain.backend.cpu.kernels import kernels as cpu
  rng = np.random.default_rng(len(op))
  g, y = rng.standard_normal(64), rng.standard_normal(64)
  y[:6] = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-30]
  ta, tb = (torch.tensor(v).to(getattr(torch, dtype)) for v in (g, y))
  out = torch.empty_like(ta)
  _apply_kernel[(1,)](out, ta, tb, 64, OP=op, BLOCK=64)
  attrs = {"approximate": "none"} if op == "gelu_backward" else {}
  want = np.asarray(cpu[op](ta.float().numpy(), tb.float().numpy(), **attrs), np.float32)
  got = out.float().numpy()
  tol = 0.0 if op == "relu_backward" else 1e-6 if dtype == "float32" else 1e-2
  assert np.allclose(got, torch.tensor(want).to(ta.dtype).float().numpy(), rtol=tol, atol=tol, equal_nan=True), \
    (op, dtype, got[:8], want[:8])


def main() -> None:
  for op in CASES:
    for dtype in ("float32", "bfloat16"): _check(op, dtype)
  print("ok")


def test_elementwise_ops_under_the_interpreter():
  run_under_triton_interpreter("tests.test_elementwise_interpret")


if __name__ == "__main__":
  main()
