"""batch_norm as primitives (`ops.nn.batch_norm_stats`, `batch_norm`, `batch_norm_backward`): F.batch_norm and the
BatchNorm modules against PyTorch CPU (test-only) in float64 and float32, on 2-D to 5-D inputs stored contiguous,
channels-last or strided, with and without weight and bias, training and eval; bfloat16 inputs against float32 math;
the running statistics; autocast; `needs`; compiled == eager."""
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import blutrain as bt
from blutrain import nn, ops
from blutrain.nn import functional as F
from tests.helpers import channel_layout

TORCH = {bt.float64: torch.float64, bt.float32: torch.float32}


def _params(c: int, which: str, rng, make, dtype):
  w = make(rng.standard_normal(c), dtype=dtype, requires_grad=True) if which in ("both", "weight") else None
  b = make(rng.standard_normal(c), dtype=dtype, requires_grad=True) if which in ("both", "bias") else None
  return w, b


def _close(got, want, what: str, dtype) -> None:
  tol = 1e-10 if dtype is bt.float64 else 2e-5
  want = want.detach().double().numpy()
  np.testing.assert_allclose(got.detach().to(bt.float64).numpy(), want, rtol=tol, atol=tol * max(np.abs(want).max(), 1),
                             err_msg=what)


def _compare(shape, layout: str, dtype, training: bool, params: str = "both", momentum=0.3, eps=1e-3, seed=0):
  """F.batch_norm against torch's: the output, the gradients of every leaf, the running statistics."""
  rng = np.random.default_rng(seed)
  a = rng.standard_normal(shape) * 1.5 + 2
  c = shape[1]
  rm, rv = rng.standard_normal(c), rng.uniform(0.5, 2, c)
  out, grads, stats = [], [], []
  for make, dt in ((bt.tensor, dtype), (torch.tensor, TORCH[dtype])):
    leaf, x = channel_layout(a, layout, make, dt)
    w, b = _params(c, params, np.random.default_rng(seed + 1), make, dt)
    run_mean, run_var = make(rm, dtype=dt), make(rv, dtype=dt)
    y = (F.batch_norm if make is bt.tensor else TF.batch_norm)(x, run_mean, run_var, w, b, training, momentum, eps)
    u = make(np.random.default_rng(seed + 2).standard_normal(shape), dtype=dt)
    (y * u).sum().backward()
    out.append(y)
    grads.append([t.grad for t in (leaf, w, b) if t is not None])
    stats.append((run_mean, run_var))
  assert out[0].dtype is dtype and tuple(out[0].shape) == shape
  _close(out[0], out[1], f"output {shape} {layout}", dtype)
  for i, (g, want) in enumerate(zip(*grads)): _close(g, want, f"gradient {i} {shape} {layout}", dtype)
  for got, want, name in zip(*stats, ("running_mean", "running_var")): _close(got, want, name, dtype)


@pytest.mark.parametrize("shape", [(7, 3), (4, 3, 5), (3, 4, 5, 2), (2, 3, 4, 3, 2)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
@pytest.mark.parametrize("dtype", [bt.float64, bt.float32])
@pytest.mark.parametrize("training", [True, False])
def test_values_gradients_and_running_stats_match_torch(shape, layout, dtype, training):
  _compare(shape, layout, dtype, training)


@pytest.mark.parametrize("params", ["weight", "bias", "none"])
@pytest.mark.parametrize("training", [True, False])
def test_without_weight_or_bias(params, training):
  _compare((3, 4, 5, 2), "channels_last", bt.float64, training, params)


def test_batch_norm_is_one_primitive_each_way():
  """Training: the statistics op and the normalization forward; one batch_norm_backward node computes dx, dweight
  and dbias (the composite was ~8 ops forward and more backward)."""
  x = bt.randn(4, 3, 5, requires_grad=True)
  w, b = bt.randn(3, requires_grad=True), bt.randn(3, requires_grad=True)
  with bt.profiler.profile() as prof:
    y = F.batch_norm(x, None, None, w, b, training=True)
    y.sum().backward()
  calls = {r.name: r.calls for r in prof.rows if "batch_norm" in r.name}
  assert calls == {"batch_norm_stats": 1, "batch_norm": 1, "batch_norm_backward": 1}, calls


def test_backward_computes_only_the_gradients_needed():
  """`needs`: a frozen weight and bias get no kernel work (the outputs are absent), and dx alone of the eval form
  reads no sums."""
  x, w, b = bt.randn(4, 3, 2), bt.randn(3), bt.randn(3)
  mean, var = ops.nn.batch_norm_stats(x)
  calls = []
  op = ops.nn.batch_norm_backward_op
  original = op.rule
  op.rule = lambda *a, **k: calls.append(k) or original(*a, **k)
  try:
    for needs_x, needs_w in ((True, False), (False, True)):
      xr, wr = x.detach().requires_grad_(needs_x), w.detach().requires_grad_(needs_w)
      ops.nn.batch_norm(xr, mean, var, wr, b, training=True).sum().backward()
      assert (xr.grad is not None, wr.grad is not None) == (needs_x, needs_w)
  finally:
    op.rule = original
  assert [(k["input_grad"], k["weight_grad"], k["bias_grad"]) for k in calls] == [(True, False, False),
                                                                                  (False, True, False)]
  dx, dw, db = op(bt.randn(4, 3, 2), x, mean, var, w, eps=1e-5, training=False, input_grad=True, weight_grad=False,
                  bias_grad=False)
  assert dw is None and db is None and dx.shape == x.shape


def test_bfloat16_input_uses_float32_math():
  """A bf16 input with float32 parameters and running statistics: the output and dx in bf16, the statistics and the
  parameters' gradients float32, all as float32 math on the bf16 values gives them."""
  rng = np.random.default_rng(3)
  a = (rng.standard_normal((4, 3, 5, 6)) * 2 + 3).astype(np.float32)
  xb = bt.tensor(a, dtype=bt.bfloat16, requires_grad=True)
  exact = xb.detach().float().numpy()
  xt = torch.tensor(exact, requires_grad=True)
  u, w0, b0 = (rng.standard_normal(s).astype(np.float32) for s in (a.shape, 3, 3))
  u = bt.tensor(u, dtype=bt.bfloat16).float().numpy()  # the output's gradient, exact in both dtypes
  outs = []
  for make, x in ((bt.tensor, xb), (torch.tensor, xt)):
    w, b = make(w0, requires_grad=True), make(b0, requires_grad=True)
    rm, rv = make(np.zeros(3, np.float32)), make(np.ones(3, np.float32))
    y = (F.batch_norm if make is bt.tensor else TF.batch_norm)(x, rm, rv, w, b, True, 0.1, 1e-5)
    (y * make(u, dtype=y.dtype)).sum().backward()
    outs.append((y, x.grad, w.grad, b.grad, rm, rv))
  (y, dx, dw, db, rm, rv), want = outs
  assert y.dtype is bt.bfloat16 and dx.dtype is bt.bfloat16 and dw.dtype is bt.float32 and rm.dtype is bt.float32
  for got, ref, tol in ((y, want[0], 1e-2), (dx, want[1], 2e-2), (dw, want[2], 1e-4), (db, want[3], 1e-4),
                        (rm, want[4], 1e-6), (rv, want[5], 1e-6)):
    ref = ref.detach().double().numpy()
    np.testing.assert_allclose(got.detach().float().numpy(), ref, atol=tol * np.abs(ref).max(), rtol=0)


def test_runs_in_the_input_dtype_under_autocast():
  """As PyTorch's autocast leaves batch_norm alone: the bf16 output of a lowered convolution is normalized in bf16
  with float32 statistics, no cast to float32 and back."""
  bt.manual_seed(0)
  conv, bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
  x = bt.randn(2, 3, 6, 6)
  with bt.autocast("cpu"):
    h = conv(x)
    with bt.profiler.profile() as prof:
      y = bn(h)
  assert h.dtype is bt.bfloat16 and y.dtype is bt.bfloat16 and bn.running_mean.dtype is bt.float32
  assert "cast" not in [r.name for r in prof.rows]
  bn2 = nn.BatchNorm2d(4)
  np.testing.assert_array_equal(y.detach().float().numpy(), bn2(h).detach().float().numpy())


@pytest.mark.parametrize("cls, shape", [(nn.BatchNorm1d, (6, 4)), (nn.BatchNorm1d, (3, 4, 5)),
                                        (nn.BatchNorm2d, (3, 4, 2, 5)), (nn.BatchNorm3d, (2, 4, 3, 2, 3))])
def test_modules_over_steps_match_torch(cls, shape):
  """Training steps with the cumulative-average momentum (None) and a float one, then eval, as torch's modules."""
  tcls = getattr(torch.nn, cls.__name__)
  for momentum in (None, 0.2):
    bm, tm = cls(4, momentum=momentum), tcls(4, momentum=momentum)
    rng = np.random.default_rng(0)
    for step in range(4):
      if step == 3: bm.eval(); tm.eval()
      a = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
      got, want = bm(bt.tensor(a)).detach().numpy(), tm(torch.tensor(a)).detach().numpy()
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for k, v in tm.state_dict().items():
      np.testing.assert_allclose(bm.state_dict()[k].numpy(), v.numpy(), rtol=1e-6, atol=1e-7, err_msg=k)
  with pytest.raises(ValueError, match=r"expected 5D input \(got 4D input\)"): nn.BatchNorm3d(4)(bt.randn(2, 4, 3, 3))


@pytest.mark.parametrize("running_dtype", [bt.float32, bt.float64])
def test_statistics_move_running_statistics_in_place(running_dtype):
  """batch_norm_stats with running statistics (strided views into one buffer) and a batch count: the statistics are
  new tensors, the running ones move as PyTorch's BatchNorm moves them, each in its own memory (the rest of the buffer
  untouched, versions bumped), float64 ones kept float64."""
  rng = np.random.default_rng(3)
  a = (rng.standard_normal((5, 4, 3)) * 2 + 1).astype(np.float32)
  start = rng.uniform(0.5, 2, 12)
  buf = bt.tensor(start, dtype=running_dtype)
  rm, rv, batches = buf[0:8:2], buf[1:9:2], bt.tensor(6)
  versions = rm._storage.version
  mean, var = ops.nn.batch_norm_stats(bt.tensor(a), rm, rv, batches, momentum=0.3)
  tm = torch.nn.BatchNorm1d(4, momentum=0.3).double()
  with torch.no_grad(): tm.running_mean.copy_(torch.tensor(start[0:8:2])), tm.running_var.copy_(torch.tensor(start[1:9:2]))
  tm.train()(torch.tensor(a, dtype=torch.float64))
  np.testing.assert_allclose(mean.numpy(), a.mean((0, 2)), rtol=1e-6)
  np.testing.assert_allclose(var.numpy(), a.var((0, 2)), rtol=1e-5)
  np.testing.assert_allclose(rm.numpy(), tm.running_mean.numpy(), rtol=1e-6)  # from float32 statistics
  np.testing.assert_allclose(rv.numpy(), tm.running_var.numpy(), rtol=1e-6)
  np.testing.assert_array_equal(buf.numpy()[8:], start[8:].astype(buf.numpy().dtype))
  assert batches.item() == 7 and rm._storage.version > versions
  assert mean.dtype is bt.float32 and rm.dtype is running_dtype


def test_errors():
  with pytest.raises(RuntimeError, match="batch_norm: mean should be a floating tensor of 3 elements"):
    ops.nn.batch_norm(bt.randn(2, 3), bt.randn(4), bt.ones(3))
  with pytest.raises(RuntimeError, match="batch_norm_stats: expected a floating input"):
    ops.nn.batch_norm_stats(bt.randn(3))
  x, c = bt.randn(4, 3), bt.ones(3)
  with pytest.raises(RuntimeError, match=r"batch_norm_stats: expected floating running statistics of shape \(3,\), a "
                                         r"momentum .* got float32\[3\], float32\[2\], momentum 0.1 over 4 values"):
    ops.nn.batch_norm_stats(x, c, bt.ones(2), momentum=0.1)
  with pytest.raises(RuntimeError, match="a momentum .* momentum None"): ops.nn.batch_norm_stats(x, c, c.clone())
  with pytest.raises(RuntimeError, match="over 1 values"): ops.nn.batch_norm_stats(x[:1], c, c.clone(), momentum=0.1)
  with pytest.raises(RuntimeError, match=r"the batch count should be a 0-d int64 tensor, got float32\[\]"):
    ops.nn.batch_norm_stats(x, c, c.clone(), bt.tensor(1.0), momentum=0.1)


class _Net(nn.Module):
  def __init__(self):
    super().__init__()
    self.conv, self.bn = nn.Conv3d(2, 4, 2), nn.BatchNorm3d(4)
    self.bn1, self.fc = nn.BatchNorm1d(4, affine=False), nn.Linear(4, 3)

  def forward(self, x):
    h = F.relu(self.bn(self.conv(x.permute(0, 4, 1, 2, 3))))  # a channels-last input
    return self.fc(self.bn1(h.mean((2, 3, 4))))


def test_compiled_equals_eager(tmp_path, monkeypatch):
  """Training steps then an eval forward, compiled and eager: equal losses, parameters and running statistics; the
  graph holds the three primitives."""
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))
  models = []
  for _ in range(2):
    bt.manual_seed(0)
    m = _Net()
    models.append((m, bt.optim.SGD(m.parameters(), lr=0.1)))

  def make_step(model, opt):
    def step(x, y):
      loss = F.cross_entropy(model(x), y)
      loss.backward()
      opt.step()
      opt.zero_grad()
      return loss
    return step
  (m1, o1), (m2, o2) = models
  eager, compiled = make_step(m1, o1), bt.compile(make_step(m2, o2), dump_ir=str(tmp_path / "ir"))
  rng = np.random.default_rng(0)
  for _ in range(3):
    x, y = bt.tensor(rng.standard_normal((4, 3, 4, 3, 2)).astype(np.float32)), bt.tensor(rng.integers(0, 3, 4))
    np.testing.assert_allclose(compiled(x, y).item(), eager(x, y).item(), rtol=1e-6)
  for (name, p), q in zip(m1.state_dict().items(), m2.state_dict().values()):
    np.testing.assert_allclose(q.numpy(), p.numpy(), rtol=1e-6, atol=1e-7, err_msg=name)
  captured = "".join(p.read_text() for p in (tmp_path / "ir").rglob("00-captured.mlir"))
  for name in ("nova.batch_norm_stats", "nova.batch_norm ", "nova.batch_norm_backward"): assert name in captured
  m1.eval(); m2.eval()
  forward = bt.compile(m2)
  with bt.no_grad():
    np.testing.assert_allclose(forward(x).numpy(), m1(x).numpy(), rtol=1e-6, atol=1e-7)
