"""The CUDA flash-attention kernels' output strides without a GPU: Triton's interpreter (TRITON_INTERPRET=1, in a
subprocess, since it must be set before Triton is imported) runs them as the host wrappers launch them, on torch CPU
tensors (test-only). The forward writes its output (B, H, L, D) or transposed (B, L, H, D)
(flash_attention_transposed's strides); the dq and dk/dv kernels write three (B, H, L, D) arrays or dq, dk, dv in
their places of one (B, L, 3, H, D) array (flash_attention_backward_packed's): the same values in their places, equal
to the CPU backend's float64 kernels."""
import numpy as np
import pytest

from tests.helpers import patch_interpreter_loop_bounds, run_under_triton_interpreter

triton = pytest.importorskip("triton")

B, H, L, D, SCALE = 2, 3, 40, 16, 0.25


def _gradients(q, k, v, o, g, packed: bool):
  import torch
  from blutrain import dtypes
  from blutrain.backend.cuda.kernels import attention as att
  from blutrain.shapes import cdiv
  contiguous = (H * L * D, L * D, D)
  if packed:
    buf = torch.zeros(B, L, 3, H, D)
    dq, dk, dv = (buf[:, :, i].permute(0, 2, 1, 3) for i in range(3))  # (B, H, L, D) views into their places
    sd = (L * 3 * H * D, D, 3 * H * D)
  else:
    dq, dk, dv = (torch.zeros(B, H, L, D) for _ in range(3))
    sd = contiguous
  lse, delta = torch.zeros(B * H * L), torch.zeros(B * H * L)
  prec = att._precision(dtypes.float32, False)
  s = att.attention_spec("dq", dtypes.float32, D, True, prec, False, have_lse=False)
  s[0][(cdiv(L, s.constexprs["BLOCK_M"]), H, B)](q, k, v, o, g, dq, lse, delta, delta, SCALE * att._LOG2E, SCALE, L, L,
                                                 D, *contiguous * 5, *sd, **s.constexprs)
  s = att.attention_spec("dkdv", dtypes.float32, D, True, prec, False)
  s[0][(cdiv(L, s.constexprs["BLOCK_N"]), H, B)](q, k, v, g, dk, dv, lse, delta, SCALE * att._LOG2E, SCALE, L, L, D,
                                                 *contiguous * 4, *sd, **s.constexprs)
  return buf if packed else torch.stack([dq, dk, dv], 1).permute(0, 3, 1, 2, 4)


def _forward(q, k, v, transposed: bool):
  import torch
  from blutrain import dtypes
  from blutrain.backend.cuda.kernels import attention as att
  from blutrain.shapes import cdiv
  contiguous = (H * L * D, L * D, D)
  out = torch.zeros(B, L, H, D) if transposed else torch.zeros(B, H, L, D)
  so = (L * H * D, D, H * D) if transposed else contiguous
  s = att.attention_spec("fwd", dtypes.float32, D, True, att._precision(dtypes.float32, False), False)
  s[0][(cdiv(L, s.constexprs["BLOCK_M"]), H, B)](q, k, v, out, torch.zeros(B * H * L), SCALE * att._LOG2E, L, L, D,
                                                 *contiguous * 3, *so, **s.constexprs)
  return out.transpose(1, 2) if transposed else out


def main() -> None:
  import torch
  from blutrain.backend.cpu.kernels import kernels as cpu
  patch_interpreter_loop_bounds()
  rng = np.random.default_rng(0)
  q, k, v, g = (rng.standard_normal((B, H, L, D)) for _ in range(4))
  o = cpu["flash_attention"](q, k, v, causal=True, scale=SCALE)
  want = cpu["flash_attention_backward_packed"](g, q, k, v, o, causal=True, scale=SCALE)
  args = [torch.tensor(a, dtype=torch.float32) for a in (q, k, v, o, g)]
  plain, transposed = _forward(*args[:3], transposed=False), _forward(*args[:3], transposed=True)
  assert torch.equal(plain, transposed), "the transposed output's strides moved values"
  assert np.allclose(plain.double().numpy(), o, rtol=1e-4, atol=1e-5)
  plain, packed = _gradients(*args, packed=False), _gradients(*args, packed=True)
  assert torch.equal(plain, packed), "the packed strides moved values"
  assert np.allclose(packed.double().numpy(), want, rtol=1e-4, atol=1e-5), np.abs(packed.double().numpy() - want).max()
  print("ok")


def test_packed_attention_gradients_under_the_interpreter():
  run_under_triton_interpreter("tests.test_attention_interpret")


if __name__ == "__main__":
  main()
