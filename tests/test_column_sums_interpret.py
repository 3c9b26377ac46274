"""The CUDA GELU backward with its column sums (fuse-bias-grads' kernel for an MLP's first bias gradient) without a
GPU: Triton's interpreter (TRITON_INTERPRET=1, in a subprocess, since it must be set before Triton is imported) runs
it and the partial sums' kernel as the host wrapper launches them, on torch CPU tensors (test-only): dx against the
CPU backend's float64 kernel, the sums against float64 sums of dx as stored, for several column blocks and runs of
rows (the last ones partial), exact and tanh GELU."""
import numpy as np
import pytest

from tests.helpers import patch_interpreter_loop_bounds, run_under_triton_interpreter

triton = pytest.importorskip("triton")

M, N = 45, 40


def _check(tanh: bool, block_n: int, rows: int) -> None:
  import torch
  from blutrain import dtypes
  from blutrain.backend.cpu.kernels import kernels as cpu
  from blutrain.backend.cuda import kernels  # noqa: F401  (the package first: its modules import each other)
  from blutrain.backend.cuda.kernels import reduce
  from blutrain.configurator import column_sums_schedule, partial_sums_schedule
  from blutrain.shapes import cdiv
  rng = np.random.default_rng(rows)
  g, x = (torch.tensor(rng.standard_normal((M, N)) * 2, dtype=torch.float32) for _ in range(2))
  s = column_sums_schedule(M, N, 132)._replace(block_m=4, block_n=block_n, warps=4, rows=rows, stages=1)
  spec = reduce.gelu_backward_sums_spec(dtypes.float32, dtypes.float32, dtypes.float32, tanh, False, False, s)
  runs = cdiv(M, rows)
  dx, parts, sums = torch.empty(M, N), torch.full((runs, N), float("nan")), torch.empty(N)
  spec[0][(cdiv(N, block_n), runs)](dx, parts, g, x, M, N, rows, **spec.constexprs)
  blocks = partial_sums_schedule(runs, N, 132)
  p = reduce.partial_sums_spec(dtypes.float32, blocks)
  p[0][(cdiv(N, blocks[1]),)](sums, parts, runs, N, **p.constexprs)
  want = cpu["gelu_backward"](g.double().numpy(), x.double().numpy(), approximate="tanh" if tanh else "none")
  case = (tanh, block_n, rows)
  assert np.allclose(dx.double().numpy(), want, rtol=1e-5, atol=1e-5), case
  assert np.allclose(sums.double().numpy(), dx.double().numpy().sum(0), rtol=1e-5, atol=1e-4), case


def main() -> None:
  patch_interpreter_loop_bounds()
  for tanh, block_n, rows in ((False, 16, 8), (True, 64, 12), (False, 8, 45)):
    _check(tanh, block_n, rows)
  print("ok")


def test_gelu_backward_with_column_sums_under_the_interpreter():
  run_under_triton_interpreter("tests.test_column_sums_interpret")


if __name__ == "__main__":
  main()
