"""The CUDA cross-entropy kernels without a GPU: Triton's interpreter (TRITON_INTERPRET=1, in a subprocess, since it
must be set before Triton is imported) runs the forward that keeps each row's statistics and the backward that reads
them, on torch CPU tensors (test-only): the backward from the statistics is the backward that computes them itself, to
the bit, also written over its logits, and so is the one kernel of cross_entropy_with_grad (with the forward's losses,
to the bit); all equal the CPU backend's float64 kernels, with an ignored row, a target out
of range (a row of NaN) and class counts that are no multiple of the tile, in one tile and in two."""
import numpy as np
import pytest

from tests.helpers import patch_interpreter_loop_bounds, run_under_triton_interpreter

triton = pytest.importorskip("triton")

IGNORE = -100


def _check(dtype_name: str, N: int, C: int) -> None:
  import torch
  from blutrain import dtypes
  from blutrain.backend.cpu.kernels import kernels as cpu
  from blutrain.backend.cuda.kernels import loss
  from blutrain.shapes import cdiv
  dtype, tdtype = getattr(dtypes, dtype_name), getattr(torch, dtype_name)
  rng = np.random.default_rng(0)
  logits = torch.tensor(rng.standard_normal((N, C)) * 3).to(tdtype)
  target = torch.tensor(rng.integers(0, C, N))
  target[3], target[5] = IGNORE, C + 2
  g = torch.tensor(rng.standard_normal(N), dtype=torch.float32)

  def forward(stats: bool):
    s = loss.ce_spec(False, dtype, dtypes.int64, True, N, C, False, dtypes.float32, False, stats)
    out, row_max, sum_exp = torch.empty(N), torch.empty(N), torch.empty(N)
    s[0][(cdiv(N, s.constexprs["BLOCK_M"]),)](out, logits, target, row_max, sum_exp, N, C, C, 1, 1, IGNORE,
                                              **s.constexprs)
    return out, row_max, sum_exp

  def backward(stats, out, source, losses=None):
    s = loss.ce_spec(True, dtype, dtypes.int64, True, N, C, False, dtypes.float32, False, stats is not None,
                     None if losses is None else dtypes.float32)
    row_max, sum_exp = stats or (g, g)
    s[0][(cdiv(N, s.constexprs["BLOCK_M"]),)](out, out if losses is None else losses, g, source, target, row_max,
                                              sum_exp, N, C, C, 1, 1, 1, IGNORE, **s.constexprs)

  plain, kept = forward(False), forward(True)
  assert torch.equal(plain[0].nan_to_num(7.0), kept[0].nan_to_num(7.0)), dtype_name
  recomputed = torch.empty(N, C, dtype=tdtype)
  backward(None, recomputed, logits)
  from_stats = logits.clone()  # written over its logits, as the memory plan places it
  backward(kept[1:], from_stats, from_stats)
  assert torch.equal(recomputed.nan_to_num(7.0), from_stats.nan_to_num(7.0)), dtype_name
  assert from_stats[5].isnan().all() and not from_stats[np.r_[0:5, 6:N]].isnan().any(), dtype_name
  with_grad, losses = logits.clone(), torch.empty(N)  # cross_entropy_with_grad: the loss and the gradient, in place
  backward(None, with_grad, with_grad, losses)
  assert torch.equal(with_grad.nan_to_num(7.0), recomputed.nan_to_num(7.0)), dtype_name
  assert torch.equal(losses.nan_to_num(7.0), kept[0].nan_to_num(7.0)), dtype_name

  valid = np.r_[0:5, 6:N]  # the CPU kernel raises on the row out of range
  x, t = logits.double().numpy()[valid], target.numpy()[valid]
  want_loss, want_max, want_sum = cpu["cross_entropy_with_stats"](x, t, ignore_index=IGNORE)
  want_grad = cpu["cross_entropy_backward"](g.double().numpy()[valid], x, t, ignore_index=IGNORE)
  tol = dict(rtol=1e-5, atol=1e-5) if dtype_name == "float32" else dict(rtol=2e-2, atol=2e-2)
  assert np.allclose(kept[0].numpy()[valid], want_loss, **tol), dtype_name
  assert np.allclose(kept[1].numpy()[valid], want_max, rtol=1e-6) and np.allclose(kept[2].numpy()[valid], want_sum,
                                                                                    rtol=1e-5), dtype_name
  assert np.allclose(from_stats.double().numpy()[valid], want_grad, **tol), dtype_name


def main() -> None:
  patch_interpreter_loop_bounds()
  for name in ("float32", "bfloat16"):
    for N, C in ((37, 300), (8, 4200)):  # one tile, and two of 4096 (the online statistics' rescales; a masked tail)
      _check(name, N, C)
  print("ok")


def test_cross_entropy_with_kept_statistics_under_the_interpreter():
  run_under_triton_interpreter("tests.test_loss_interpret")


if __name__ == "__main__":
  main()
