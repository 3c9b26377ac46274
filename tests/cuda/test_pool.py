"""max_pool2d on the GPU (the window search, the values' read and the gradient's sums, backend/cuda/kernels/pool.py)
against the CPU backend: values, indices and the input gradient for a random output gradient, float32 and bf16, NCHW
and channels-last, overlapping and dilated windows, with ties and NaNs; Nova's one-pass search that stores the maxima
against the two kernels."""
import numpy as np
import pytest

import blutrain as bt
from blutrain.nn import functional as F

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("kw", [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=(3, 2), stride=(2, 1),
                                                                               padding=(1, 0), ceil_mode=True),
                                dict(kernel_size=2, stride=1, dilation=2)])
def test_max_pool2d_matches_the_cpu(dtype, channels_last, kw):
  rng = np.random.default_rng(0)
  a = rng.standard_normal((4, 16, 17, 15)).round(1)  # ties
  a.flat[rng.integers(0, a.size, 20)] = np.nan
  results = []
  for device in ("cpu", "cuda"):
    x = bt.tensor(a, device=device).to(dtype)
    if channels_last: x = x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    x.requires_grad_()
    y, idx = F.max_pool2d(x, return_indices=True, **kw)
    g = np.random.default_rng(1).standard_normal(tuple(y.shape)).round(2)
    (y.float() * bt.tensor(g, device=device).float()).sum().backward()
    results.append([t.detach().float().cpu().numpy() for t in (y, idx, x.grad)])
  (y, idx, dx), (y_cpu, idx_cpu, dx_cpu) = results[::-1]
  np.testing.assert_array_equal(y, y_cpu)
  np.testing.assert_array_equal(idx, idx_cpu)
  np.testing.assert_allclose(dx, dx_cpu, rtol=1e-6, atol=1e-6)  # sums of overlapping windows: float32 vs float64


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_max_pool2d_with_indices_matches_the_two_kernels(dtype, channels_last):
  """Nova's one-pass op (the window search storing the maxima) against the search and the values' read on the GPU:
  the same bits and layouts, with ties and NaNs."""
  from blutrain.ops import registry
  rng = np.random.default_rng(2)
  a = rng.standard_normal((4, 32, 17, 15)).round(1)
  a.flat[rng.integers(0, a.size, 20)] = np.nan
  x = bt.tensor(a, device="cuda").to(dtype)
  if channels_last: x = x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
  geometry = dict(kernel=(3, 3), stride=(2, 2), padding=(1, 1), dilation=(1, 1))
  values, idx = bt.ops.core.apply(registry["max_pool2d_with_indices"], x, out_size=(9, 8), **geometry)
  want_idx = bt.ops.nn.max_pool2d_indices(x, out_size=(9, 8), **geometry)
  want = bt.ops.nn.max_pool2d_values(x, want_idx, **geometry)
  np.testing.assert_array_equal(idx.cpu().numpy(), want_idx.cpu().numpy())
  np.testing.assert_array_equal(values.float().cpu().numpy(), want.float().cpu().numpy())
  assert values.stride() == want.stride() and idx.stride() == want_idx.stride()
