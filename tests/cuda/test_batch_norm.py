"""batch_norm's Triton kernels on the GPU against the CPU backend on the same inputs: float32 and bfloat16 inputs
stored NCHW, channels-last or strided, training (with the running statistics' update) and eval, values, gradients and
the output's layout; a ResNet-sized input whose reduction splits over the SMs."""
import numpy as np
import pytest

import blutrain as bt
from blutrain.nn import functional as F
from tests.helpers import channel_layout

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("shape", [(8, 64, 14, 14), (5, 3), (2, 7, 3, 4, 5), (64, 32, 56, 56)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_matches_the_cpu(shape, layout, dtype, training):
  rng = np.random.default_rng(sum(shape))
  a = rng.standard_normal(shape) * 2 + 3
  c = shape[1]
  w0, b0, u = rng.standard_normal(c), rng.standard_normal(c), rng.standard_normal(shape)
  rm0, rv0 = rng.standard_normal(c), rng.uniform(0.5, 2, c)
  results = []
  for dev in ("cpu", "cuda"):
    leaf, x = channel_layout(a, layout, bt.tensor, dtype, device=dev)
    w, b = (bt.tensor(p, dtype=bt.float32, device=dev, requires_grad=True) for p in (w0, b0))
    rm, rv = (bt.tensor(p, dtype=bt.float32, device=dev) for p in (rm0, rv0))
    y = F.batch_norm(x, rm, rv, w, b, training, 0.1, 1e-5)
    (y * bt.tensor(u, dtype=dtype, device=dev)).sum().backward()
    if dev == "cuda" and layout != "strided": assert y.stride() == x.stride(), (y.stride(), x.stride())
    results.append((y, leaf.grad, w.grad, b.grad, rm, rv))
  half = dtype is bt.bfloat16
  for name, got, want, tol in zip(("out", "dx", "dweight", "dbias", "running_mean", "running_var"), results[1],
                                  results[0], (2e-2 if half else 1e-4, 2e-2 if half else 1e-3, 1e-3, 1e-3, 1e-5, 1e-5)):
    g, w = got.detach().cpu().float().numpy(), want.detach().float().numpy()
    np.testing.assert_allclose(g, w, rtol=0, atol=tol * max(1.0, float(np.abs(w).max())), err_msg=f"{name} {shape}")
