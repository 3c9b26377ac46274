"""The CUDA LSTM and GRU cell kernels' values without a GPU: Triton's interpreter (TRITON_INTERPRET=1, in a subprocess, since it
must be set before Triton is imported) runs the forward and backward kernels, launched as `rnn._launch` does, on torch
CPU tensors (test-only) whose rows are slices of wider ones, against the CPU backend's float64 kernels."""
import numpy as np
import triton
import triton.language as tl

from tests.helpers import run_under_triton_interpreter


def _run_case(cell: str, N: int, H: int, dtype: str) -> None:
  """One cell's forward and backward kernels (cell "lstm" or "gru") against the CPU kernels, on gates of `dtype` and
  a float32 state, every operand a row slice of a wider tensor."""
  import torch
  from blutrain import dtypes
  from blutrain.backend.cpu.kernels import kernels as cpu
  from blutrain.backend.cuda.kernels import rnn
  from blutrain.shapes import cdiv
  gates, outs, d_width = (4, 2, 5) if cell == "lstm" else (3, 1, 7)
  rng = np.random.default_rng(N * H)
  gi64, gh64, grad64 = (rng.standard_normal((N, k * H)) for k in (gates, gates, outs))
  state64 = rng.standard_normal((N, H))
  low = (lambda a: torch.tensor(a, dtype=torch.float64).to(torch.bfloat16)) if dtype == "bf16" else \
    (lambda a: torch.tensor(a, dtype=torch.float32))
  wide = lambda a: torch.cat([a, a], 1)[:, :a.shape[1]]  # rows of a wider tensor: row stride twice the row
  gi, gh = wide(low(gi64)), wide(low(gh64))
  state, grad = wide(torch.tensor(state64, dtype=torch.float32)), torch.tensor(grad64, dtype=torch.float32)
  exact = [t.double().numpy() for t in (gi, gh, state)]  # what the kernels read, rounded as they read it
  ty = {torch.float32: dtypes.float32, torch.bfloat16: dtypes.bfloat16}

  def launch(kind, out, *inputs):
    s = rnn.cell_spec(kind, ty[out.dtype], tuple(ty[a.dtype] for a in inputs), N * H, False)
    s[0][(cdiv(N * H, s.constexprs["BLOCK"]),)](out, *inputs, N * H, H, *(a.stride(0) for a in inputs), out.stride(0),
                                                **s.constexprs)
    return out

  out = launch(cell, torch.empty((N, outs * H), dtype=torch.float32), gi, gh, state)
  want = cpu[f"{cell}_cell"](*exact)
  assert np.abs(out.double().numpy() - want).max() < 1e-5, f"{cell}_cell ({dtype}, N={N}, H={H})"
  saved = (out,) if cell == "lstm" else ()  # the LSTM's backward reads c' from the forward's output
  d = launch(f"{cell}_backward", torch.empty((N, d_width * H), dtype=torch.float32), grad, gi, gh, state, *saved)
  want = cpu[f"{cell}_cell_backward"](grad64, *exact, *(t.double().numpy() for t in saved))
  err = np.abs(d.double().numpy() - want).max() / np.abs(want).max()
  assert err < 1e-5, f"{cell}_cell_backward ({dtype}, N={N}, H={H}): relative error {err:.2e}"

  # the time loops' step kernels: h' also in the GEMM's dtype; the later step's gradients added in the kernel and the
  # gates' (GRU: gh's) gradient also in the GEMM's dtype
  hb = wide(torch.empty((N, H), dtype=gi.dtype))
  stepped = launch(f"{cell}_step", torch.empty((N, outs * H), dtype=torch.float32), gi, gh, state, hb)
  # (the interpreter rounds float32 to bf16 toward zero, the GPU to nearest: one bf16 ulp apart at most)
  same = lambda a, b: torch.allclose(a.float(), b.to(a.dtype).float(), rtol=2 ** -7, atol=0)
  assert torch.equal(stepped, out) and same(hb, out[:, :H]), f"{cell}_step ({dtype}, N={N}, H={H})"
  carry = [wide(low(rng.standard_normal((N, H)))), wide(torch.tensor(rng.standard_normal((N, H)), dtype=torch.float32))]
  d = torch.empty((N, d_width * H), dtype=torch.float32)
  columns = slice(0, 4 * H) if cell == "lstm" else slice(3 * H, 6 * H)
  # the loops pass d's own columns when the GEMM takes d's dtype, which the kernel then leaves as they are
  dg = d[:, columns] if gi.dtype == torch.float32 else torch.empty((N, columns.stop - columns.start), dtype=gi.dtype)
  launch(f"{cell}_step_backward", d, grad, *carry, gi, gh, state, *saved, dg)
  h_in, extra = carry[0].double().numpy(), carry[1].double().numpy()
  total = np.concatenate([grad64[:, :H] + h_in, grad64[:, H:] + extra], 1) if cell == "lstm" else grad64 + h_in + extra
  want = cpu[f"{cell}_cell_backward"](total, *exact, *(t.double().numpy() for t in saved))
  err = np.abs(d.double().numpy() - want).max() / np.abs(want).max()
  assert err < 1e-5, f"{cell}_step_backward ({dtype}, N={N}, H={H}): relative error {err:.2e}"
  assert same(dg, d[:, columns]), f"{cell}_step_backward's gates in {dtype} ({N}, {H})"


@triton.jit
def _exp(x):
  return tl.exp(x)


@triton.jit
def _tanh(x):
  t = tl.exp(-2.0 * tl.abs(x))
  y = (1.0 - t) / (1.0 + t)
  return tl.where(x < 0, -y, y)


def _patch_libdevice():
  """Triton 3.6's interpreter cannot run libdevice's calls: stand in tl.exp for exp and a formula over it for tanh
  (test-only; the tolerance covers their rounding)."""
  from triton.language.extra.cuda import libdevice
  libdevice.exp, libdevice.tanh = _exp, _tanh


def main() -> None:
  _patch_libdevice()
  for cell in ("lstm", "gru"):
    for case in ((3, 5, "fp32"), (4, 130, "bf16"), (1, 1, "fp32")):
      _run_case(cell, *case)
  print("ok")


def test_lstm_cell_kernels_under_triton_interpreter():
  run_under_triton_interpreter("tests.test_rnn_interpret")


if __name__ == "__main__":
  main()
