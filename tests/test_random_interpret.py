"""The CUDA dropout kernel without a GPU: under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess) it keeps
exactly the elements bernoulli's kernel draws True for a mask of the same shape, seed and offset (probability 1 - p),
scaled by 1 / (1 - p), reading the seed and offset from arguments or from a generator state in memory."""
import numpy as np

from tests.helpers import run_under_triton_interpreter


def main() -> None:
  import torch
  from blutrain import dtypes
  from blutrain.backend.cuda.kernels import random as K
  from blutrain.shapes import cdiv
  n, p, seed, offset = 3000, 0.3, 1234, 77
  x = torch.tensor(np.random.default_rng(0).standard_normal(n), dtype=torch.float32)
  mask = torch.empty(n, dtype=torch.bool)
  s = K.random_spec("bernoulli", dtypes.bool_, n)
  s[0][(cdiv(n, s.constexprs["BLOCK"]),)](mask, n, seed, offset, mask, 0, 1, 1.0 - p, **s.constexprs)
  assert 0.6 < float(mask.float().mean()) < 0.8
  for state in (False, True):
    out = torch.empty(n, dtype=torch.float32)
    s = K.dropout_spec(dtypes.float32, n, state)
    where = torch.tensor([seed, offset - 7], dtype=torch.int64)  # the base offset; the op's own offset is added
    args = (0, 7, where) if state else (seed, offset, where)
    s[0][(cdiv(n, s.constexprs["BLOCK"]),)](out, x, n, *args, 1.0 - p, 1.0 / (1.0 - p), **s.constexprs)
    want = torch.where(mask, x * torch.tensor(1.0 / (1.0 - p), dtype=torch.float32), 0.0)
    assert torch.equal(out, want), f"dropout (state={state}) differs from bernoulli's mask"
  print("ok")


def test_dropout_kernel_under_triton_interpreter():
  run_under_triton_interpreter("tests.test_random_interpret")


if __name__ == "__main__":
  main()
