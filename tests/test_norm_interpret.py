"""The CUDA layer-norm backward kernel without a GPU: Triton's interpreter (TRITON_INTERPRET=1, in a subprocess, since
it must be set before Triton is imported) runs the kernel and its partial sums' kernel as the host wrapper launches
them, on torch CPU tensors (test-only), against the CPU backend's kernel in float64: a bf16 gradient, float32 rows,
dx's bf16 copy (which must be dx as stored, rounded) and that copy's column sums (a bias gradient: fuse-bias-grads),
row tiles of 1 and 4 rows, several tiles per program and a last program with fewer rows, rows in one tile and in
several. (The residual gradient's add is PTX the interpreter cannot run: tests/cuda covers it.)"""
import numpy as np
import pytest

from tests.helpers import patch_interpreter_loop_bounds, run_under_triton_interpreter

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

M, N, EPS = 37, 48, 1e-5


@triton.jit
def _rounded(out, a, n, BLOCK: tl.constexpr):
  """out = a converted to out's dtype as a kernel converts it (the interpreter truncates to bf16, a GPU rounds to
  nearest even: the copy must match whichever conversion the kernel's own store makes)."""
  i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  tl.store(out + i, tl.load(a + i, mask=i < n).to(out.dtype.element_ty), mask=i < n)


def _check(block_m: int, warps: int, tiles: int, stages: int, block_n: int) -> None:
  import torch
  from blutrain import dtypes
  from blutrain.backend.cpu.kernels import kernels as cpu
  from blutrain.backend.cuda.kernels import norm
  from blutrain.configurator import norm_backward_schedule, partial_sums_schedule
  from blutrain.shapes import cdiv
  rng = np.random.default_rng(block_m + tiles)
  g = torch.tensor(rng.standard_normal((M, N))).to(torch.bfloat16)
  x = torch.tensor(rng.standard_normal((M, N)) * 2 + 1, dtype=torch.float32)
  w = torch.tensor(rng.standard_normal(N), dtype=torch.float32)
  s = norm_backward_schedule(M, N, 132)._replace(block_m=block_m, warps=warps, rows=block_m * tiles, stages=stages,
                                                 block_n=block_n, one_pass=block_n >= N)
  spec = norm.layer_norm_backward_spec(dtypes.float32, dtypes.bfloat16, dtypes.float32, True, M, N, False, None,
                                       False, s, dtypes.bfloat16, True)
  programs = cdiv(M, s.rows)
  dx, dxc = torch.empty(M, N), torch.empty(M, N, dtype=torch.bfloat16)
  parts = torch.empty(3, programs, N)
  spec[0][(programs,)](dx, dxc, parts[0], parts[1], parts[2], g, x, w, x, M, N, EPS, s.rows, **spec.constexprs)
  dw, db, sums = torch.empty(N), torch.empty(N), torch.empty(N)
  blocks = partial_sums_schedule(programs, N, 132)
  p = norm.param_grads_spec(dtypes.float32, dtypes.float32, dtypes.float32, True, blocks)
  p[0][(cdiv(N, p.constexprs["BLOCK_N"]),)](dw, db, sums, parts, programs, N, **p.constexprs)
  want = cpu["layer_norm_backward"](g.double().numpy(), x.double().numpy(), w.double().numpy(), n=1, eps=EPS,
                                    has_bias=True)
  case = (block_m, warps, tiles, stages)
  for name, got, ref in (("dx", dx, want[0]), ("dw", dw, want[1]), ("db", db, want[2])):
    assert np.allclose(got.double().numpy(), ref, rtol=1e-5, atol=1e-4), (name, case)
  rounded = torch.empty(M, N, dtype=torch.bfloat16)
  _rounded[(cdiv(M * N, 1024),)](rounded, dx, M * N, BLOCK=1024)
  assert torch.equal(dxc, rounded), ("dx's bf16 copy is not dx converted", case)
  assert np.allclose(sums.double().numpy(), dxc.double().numpy().sum(axis=0), rtol=1e-5, atol=1e-4), case


def main() -> None:
  patch_interpreter_loop_bounds()
  for block_m, warps, tiles, stages, block_n in ((1, 1, 7, 1, 64), (4, 4, 3, 3, 64), (4, 2, 1, 2, 64),
                                                 (4, 4, 3, 1, 16)):
    _check(block_m, warps, tiles, stages, block_n)
  print("ok")


def test_layer_norm_backward_under_the_interpreter():
  run_under_triton_interpreter("tests.test_norm_interpret")


if __name__ == "__main__":
  main()
