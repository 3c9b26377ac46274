"""batch_norm's Triton kernels on the GPU against the CPU backend on the same inputs: float32 and bfloat16 inputs
stored NCHW, channels-last or strided, training (with the running statistics' update) and eval, values, gradients and
the output's layout; a ResNet-sized input whose reduction splits over the SMs; the kernel with Nova's epilogue
(residual, relu) against the CPU's, and a compiled ResNet block, whose norms take it, against eager mode."""
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


@pytest.mark.parametrize("running_dtype", [bt.float32, bt.float64])
def test_statistics_move_strided_running_statistics_as_the_cpu(running_dtype):
  """batch_norm_stats' finalize moving running statistics (strided views into one buffer) and counting the batch, in
  place through the op and into new arrays through the kernel alone, against the CPU backend."""
  from blutrain.backend.cuda.kernels import norm
  rng = np.random.default_rng(7)
  a, start = rng.standard_normal((6, 300, 5)) * 2 + 1, rng.uniform(0.5, 2, 700)
  results = []
  for dev in ("cpu", "cuda"):
    x, buf, batches = bt.tensor(a, dtype=bt.float32, device=dev), bt.tensor(start, dtype=running_dtype, device=dev), \
      bt.tensor(6, device=dev)
    rm, rv = buf[0:600:2], buf[1:601:2]
    results.append((*bt.ops.nn.batch_norm_stats(x, rm, rv, batches, momentum=0.3), buf, batches))
  assert int(results[1][3].item()) == 7
  mean, var, buf, _ = (t.cpu().double().numpy() for t in results[1])
  before = buf.copy()
  new = norm.batch_norm_stats(x._array(), rm._array(), rv._array(), batches._array(), momentum=0.5)
  got = [bt.Tensor._wrap(arr, x.device, d).cpu().double().numpy()
         for arr, d in zip(new[2:], (running_dtype, running_dtype, bt.int64))]
  want = (0.5 * before[0:600:2] + 0.5 * mean, 0.5 * before[1:601:2] + 0.5 * var * 30 / 29, 8)
  for name, g, w in zip(("new mean", "new var", "new count"), got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6, err_msg=name)
  np.testing.assert_array_equal(results[1][2].cpu().double().numpy(), before)  # new arrays: the buffer untouched


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_batch_norm_with_residual_and_relu_matches_the_cpu(dtype, layout):
  """The forward kernel's epilogue: relu(batch_norm(x) + r) in one kernel, as the CPU kernel rounds it."""
  from blutrain.ops import registry
  rng = np.random.default_rng(11)
  a, r = (rng.standard_normal((16, 32, 14, 14)) * 2 - 1 for _ in range(2))
  wb = [rng.standard_normal(32).astype(np.float32) for _ in range(2)]
  outs = []
  for device in ("cpu", "cuda"):
    x = channel_layout(a, layout, bt.tensor, dtype, device=device)[1].detach()
    res = channel_layout(r, layout, bt.tensor, dtype, device=device)[1].detach()
    mean, var = bt.ops.nn.batch_norm_stats(x)
    w, b = (bt.tensor(v, device=device) for v in wb)
    outs.append(bt.ops.core.apply(registry["batch_norm"], x, mean, var, w, b, res, eps=1e-5, training=True, relu=True))
  cpu, cuda = (o.float().cpu().numpy() for o in outs)
  assert outs[1].stride() == outs[0].stride()
  tol = 1e-5 if dtype is bt.float32 else 2e-2
  assert np.abs(cuda - cpu).max() <= tol * np.abs(cpu).max() and (cuda >= 0).all() and (cuda == 0).mean() > 0.2


@pytest.mark.parametrize("amp", [False, True])
def test_compiled_resnet_block_with_fused_norms_matches_eager(amp):
  """A ResNet basic block with a downsample branch (its norms take the relu and the residual add), three SGD steps
  compiled and eager on the GPU: the same losses and updates."""
  from tests.nova.test_fuse_norms import _Block
  rng = np.random.default_rng(4)
  batches = [(rng.standard_normal((8, 3, 16, 16)).astype(np.float32), rng.integers(0, 4, 8)) for _ in range(3)]
  runs = []
  for compiled in (False, True):
    bt.manual_seed(0)
    model = _Block().cuda()
    opt = bt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, y):
      with bt.autocast("cuda", dtype=bt.bfloat16, enabled=amp):
        loss = F.cross_entropy(model(x), y)
      loss.backward()
      opt.step()
      opt.zero_grad()
      return loss
    fn = bt.compile(step) if compiled else step
    losses = [float(fn(bt.tensor(x, device="cuda"), bt.tensor(y, device="cuda")).item()) for x, y in batches]
    runs.append((losses, [p.detach().float().cpu().numpy() for p in model.parameters()], fn))
  (want, want_params, _), (got, params, fn) = runs
  np.testing.assert_allclose(got, want, rtol=1e-2 if amp else 1e-4)
  for a, b in zip(params, want_params): np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-3 if amp else 1e-4)
  source = open(fn.info["source"]).read()
  assert source.count("relu=True") == 2 and 'kernels["relu"]' not in source
