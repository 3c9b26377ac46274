"""Convolution, pooling and batch/group normalization (composites in nn/spatial.py) and their layers against PyTorch
CPU: values and gradients on contiguous and strided inputs, float64 finite differences, running statistics and eval
mode, bad inputs raising PyTorch's exception types; and a small CNN's compiled training step equal to eager."""
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import blutrain as bt
from blutrain import nn
from blutrain.nn import functional as F
from tests.helpers import Int, assert_close, check_vjp, helper_test_op

CONV2D = [dict(), dict(stride=2), dict(padding=1), dict(padding=(2, 0), stride=(1, 2)), dict(dilation=2, padding=2),
          dict(padding="same"), dict(padding="same", dilation=(1, 2)), dict(padding="valid", stride=(3, 1))]


@pytest.mark.parametrize("kw", CONV2D)
@pytest.mark.parametrize("groups", [1, 2])
def test_conv2d_matches_torch(kw, groups):
  helper_test_op([(2, 4, 7, 6), (6, 4 // groups, 3, 2), (6,)],
                 lambda x, w, b: TF.conv2d(x, w, b, groups=groups, **kw),
                 lambda x, w, b: F.conv2d(x, w, b, groups=groups, **kw), layouts=("contiguous", "strided"), tol_scale=3)


@pytest.mark.parametrize("kw", [dict(), dict(stride=2, padding=1), dict(dilation=3, groups=3), dict(padding="same")])
def test_conv1d_matches_torch_with_and_without_batch(kw):
  helper_test_op([(2, 3, 11), (6, 3 // kw.get("groups", 1), 4)], lambda x, w: TF.conv1d(x, w, **kw),
                 lambda x, w: F.conv1d(x, w, **kw), layouts=("contiguous", "transposed"), tol_scale=3)
  helper_test_op([(3, 11), (6, 3 // kw.get("groups", 1), 4)], lambda x, w: TF.conv1d(x, w, **kw),
                 lambda x, w: F.conv1d(x, w, **kw))


@pytest.mark.parametrize("kw", [dict(), dict(stride=2), dict(stride=2, padding=1, output_padding=1),
                                dict(stride=(2, 3), padding=(2, 0), dilation=2, output_padding=(1, 0), groups=2),
                                # output_padding at or above the stride, below the dilation
                                dict(stride=(1, 2), padding=(1, 0), dilation=3, output_padding=(2, 1)),
                                dict(dilation=(2, 3), output_padding=(1, 2), groups=2)])
def test_conv_transpose2d_matches_torch(kw):
  helper_test_op([(2, 4, 5, 4), (4, 3, 3, 2), (3 * kw.get("groups", 1),)], lambda x, w, b: TF.conv_transpose2d(x, w, b, **kw),
                 lambda x, w, b: F.conv_transpose2d(x, w, b, **kw), layouts=("contiguous", "strided"), tol_scale=3)
  helper_test_op([(2, 4, 6), (4, 2, 3)], lambda x, w: TF.conv_transpose1d(x, w, stride=2, padding=1),
                 lambda x, w: F.conv_transpose1d(x, w, stride=2, padding=1))


def test_conv_transpose_output_padding_limit():
  """PyTorch's bound: output_padding below the stride or the dilation; output_padding >= stride pads with zeros."""
  helper_test_op([(2, 4, 6), (4, 2, 3)], lambda x, w: TF.conv_transpose1d(x, w, stride=2, dilation=4, output_padding=3),
                 lambda x, w: F.conv_transpose1d(x, w, stride=2, dilation=4, output_padding=3))
  for lib, fn in ((torch, TF.conv_transpose1d), (bt, F.conv_transpose1d)):
    with pytest.raises(RuntimeError, match="output padding must be smaller than either stride or dilation"):
      fn(lib.ones(1, 2, 4), lib.ones(2, 2, 3), stride=2, dilation=3, output_padding=3)


@pytest.mark.parametrize("kw", [dict(), dict(stride=(2, 1, 2), padding=(1, 0, 1), dilation=(1, 2, 1), groups=2),
                                dict(padding="same", dilation=(2, 1, 1))])
def test_conv3d_matches_torch(kw):
  helper_test_op([(2, 4, 5, 4, 6), (6, 4 // kw.get("groups", 1), 3, 2, 3), (6,)],
                 lambda x, w, b: TF.conv3d(x, w, b, **kw), lambda x, w, b: F.conv3d(x, w, b, **kw),
                 layouts=("contiguous", "strided"), tol_scale=3)
  tkw = dict(stride=(2, 1, 2), padding=(1, 0, 1), output_padding=(1, 0, 0), groups=2)
  helper_test_op([(2, 4, 3, 2, 3), (4, 3, 2, 3, 2)], lambda x, w: TF.conv_transpose3d(x, w, **tkw),
                 lambda x, w: F.conv_transpose3d(x, w, **tkw), tol_scale=3)


def test_conv_layers_under_autocast_give_torch_dtype():
  """The bias joins the convolution in the autocast dtype, as PyTorch passes it into the op."""
  for name, shape in (("Conv2d", (2, 4, 6, 6)), ("ConvTranspose1d", (2, 4, 6)), ("Conv3d", (1, 4, 3, 3, 3))):
    with bt.autocast("cpu", dtype=bt.bfloat16): got = getattr(nn, name)(4, 2, 2)(bt.randn(*shape))
    with torch.autocast("cpu", dtype=torch.bfloat16): want = getattr(torch.nn, name)(4, 2, 2)(torch.randn(*shape))
    assert got.dtype.name == str(want.dtype).split(".")[-1] == "bfloat16", name


def test_conv_vjps_against_finite_differences():
  check_vjp(lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1, groups=2), [(1, 4, 5, 5), (2, 2, 3, 3), (2,)])
  check_vjp(lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1), [(1, 2, 3, 3), (2, 3, 3, 3)])
  check_vjp(lambda x, w: F.conv_transpose2d(x, w, dilation=2, output_padding=(1, 0)), [(1, 2, 3, 3), (2, 3, 3, 3)])


def test_conv_errors_name_the_shapes():
  x, w = bt.randn(2, 3, 8, 8), bt.randn(4, 3, 3, 3)
  with pytest.raises(RuntimeError, match=r"expected input\[2, 5, 8, 8\] to have 3 channels, but got 5"):
    F.conv2d(bt.randn(2, 5, 8, 8), w)
  with pytest.raises(RuntimeError): TF.conv2d(torch.randn(2, 5, 8, 8), torch.randn(4, 3, 3, 3))
  with pytest.raises(RuntimeError, match="Kernel size can't be greater than actual input size"): F.conv2d(bt.randn(1, 3, 2, 2), w)
  with pytest.raises(RuntimeError, match=r"Expected 3D \(unbatched\) or 4D \(batched\) input to conv2d"): F.conv2d(bt.randn(8, 8), w)
  with pytest.raises(RuntimeError, match="divisible by 2"): F.conv2d(x, bt.randn(3, 3, 3, 3), groups=2)
  with pytest.raises(RuntimeError, match="strided convolutions"): F.conv2d(x, w, stride=2, padding="same")
  with pytest.raises(RuntimeError, match="strided convolutions"): TF.conv2d(torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), stride=2, padding="same")
  with pytest.raises(ValueError, match="strided convolutions"): nn.Conv2d(3, 4, 3, stride=2, padding="same")
  with pytest.raises(RuntimeError, match="Invalid padding string"): F.conv2d(x, w, padding="full")
  with pytest.raises(ValueError, match="in_channels must be divisible by groups"): nn.Conv2d(3, 4, 3, groups=2)


POOLS = [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=3, stride=2, ceil_mode=True),
         dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), ceil_mode=True)]


@pytest.mark.parametrize("kw", POOLS + [dict(kernel_size=2, dilation=2, padding=1)])
def test_max_pool2d_values_indices_and_grads(kw):
  helper_test_op([(2, 3, 7, 6)], lambda x: TF.max_pool2d(x, **kw), lambda x: F.max_pool2d(x, **kw),
                 layouts=("contiguous", "strided"))
  x = np.random.default_rng(0).standard_normal((2, 3, 7, 6)).astype(np.float32)
  _, bi = F.max_pool2d(bt.tensor(x), return_indices=True, **kw)
  _, ti = TF.max_pool2d(torch.tensor(x), return_indices=True, **kw)
  np.testing.assert_array_equal(bi.numpy(), ti.numpy())
  helper_test_op([(3, 9)], lambda x: TF.max_pool1d(x, 3, 2, 1), lambda x: F.max_pool1d(x, 3, 2, 1))


def test_max_pool2d_picks_the_maxima_pytorch_picks():
  """Ties (the first maximum), NaNs (the last NaN), integers and a channels-last input: values, indices and the
  gradient, which goes to the chosen element only, against PyTorch."""
  rng = np.random.default_rng(3)
  a = rng.standard_normal((2, 3, 9, 8)).round(0)  # many ties
  a.flat[rng.integers(0, a.size, 6)] = np.nan
  for x_np in (a.astype(np.float32), rng.integers(-4, 4, (2, 3, 9, 8))):
    for channels_last in (False, True):
      tx = torch.tensor(x_np)
      if channels_last: tx = tx.contiguous(memory_format=torch.channels_last)
      bx = bt.tensor(x_np).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2) if channels_last else bt.tensor(x_np)
      for kw in (dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2, dilation=2, ceil_mode=True)):
        ty, ti = TF.max_pool2d(tx, return_indices=True, **kw)
        by, bi = F.max_pool2d(bx, return_indices=True, **kw)
        np.testing.assert_array_equal(bi.numpy(), ti.numpy())
        np.testing.assert_array_equal(by.numpy(), ty.numpy())
  tx = torch.tensor(a.astype(np.float64), requires_grad=True)
  bx = bt.tensor(a.astype(np.float64), requires_grad=True)
  g = rng.standard_normal((2, 3, 5, 4))
  TF.max_pool2d(tx, 3, 2, 1).backward(torch.tensor(g))
  F.max_pool2d(bx, 3, 2, 1).backward(bt.tensor(g))
  np.testing.assert_array_equal(bx.grad.numpy(), tx.grad.numpy())


@pytest.mark.parametrize("kw", POOLS)
@pytest.mark.parametrize("count_include_pad", [True, False])
def test_avg_pool2d_matches_torch(kw, count_include_pad):
  helper_test_op([(2, 3, 7, 6)], lambda x: TF.avg_pool2d(x, count_include_pad=count_include_pad, **kw),
                 lambda x: F.avg_pool2d(x, count_include_pad=count_include_pad, **kw), layouts=("contiguous", "strided"))
  helper_test_op([(2, 3, 7, 6)], lambda x: TF.avg_pool2d(x, 3, divisor_override=4), lambda x: F.avg_pool2d(x, 3, divisor_override=4))
  helper_test_op([(2, 3, 9)], lambda x: TF.avg_pool1d(x, 3, 2, 1, True, count_include_pad),
                 lambda x: F.avg_pool1d(x, 3, 2, 1, True, count_include_pad))


@pytest.mark.parametrize("size", [(1, 1), (3, 4), (7, 2), (None, 3), 5])
def test_adaptive_avg_pool_matches_torch(size):
  helper_test_op([(2, 3, 7, 6)], lambda x: TF.adaptive_avg_pool2d(x, size), lambda x: F.adaptive_avg_pool2d(x, size),
                 layouts=("contiguous", "transposed"))
  helper_test_op([(2, 3, 10)], lambda x: TF.adaptive_avg_pool1d(x, 4), lambda x: F.adaptive_avg_pool1d(x, 4))


@pytest.mark.parametrize("size", [(1, 1), (2, 3), (3, 4)])
def test_adaptive_avg_pool_keeps_dtype_and_channels_last(size):
  """bf16 in, bf16 out (autocast or not), as PyTorch's; a channels-last input pools as a contiguous one."""
  x = np.random.default_rng(0).standard_normal((2, 5, 6, 6)).astype(np.float32)
  ref = TF.adaptive_avg_pool2d(torch.from_numpy(x).double(), size).numpy()
  xb = bt.tensor(x).to(bt.bfloat16)
  with bt.autocast(device_type="cpu", dtype=bt.bfloat16):
    y = F.adaptive_avg_pool2d(xb, size)
  assert y.dtype == bt.bfloat16 and F.adaptive_avg_pool2d(xb, size).dtype == bt.bfloat16
  np.testing.assert_allclose(y.float().numpy(), ref, rtol=2e-2, atol=2e-2)
  cl = F.adaptive_avg_pool2d(bt.tensor(x).contiguous(memory_format=bt.channels_last), size)
  np.testing.assert_allclose(cl.numpy(), ref, rtol=1e-6, atol=1e-6)


def test_pool_errors():
  with pytest.raises(RuntimeError, match="pad should be at most half"): F.max_pool2d(bt.randn(1, 1, 5, 5), 2, padding=2)
  with pytest.raises(RuntimeError): TF.max_pool2d(torch.randn(1, 1, 5, 5), 2, padding=2)
  with pytest.raises(RuntimeError, match="Expected 3D"): F.avg_pool2d(bt.randn(5, 5), 2)


# *** normalization ***

@pytest.mark.parametrize("shape", [(6, 4), (5, 4, 3), (3, 4, 5, 2)])
def test_batch_norm_training_and_eval_match_torch(shape):
  rng = np.random.default_rng(0)
  rm, rv = rng.standard_normal(4).astype(np.float32), rng.uniform(0.5, 2, 4).astype(np.float32)
  brm, brv, trm, trv = bt.tensor(rm), bt.tensor(rv), torch.tensor(rm), torch.tensor(rv)
  helper_test_op([shape, (4,), (4,)], lambda x, w, b: TF.batch_norm(x, trm, trv, w, b, True, 0.3, 1e-3),
                 lambda x, w, b: F.batch_norm(x, brm, brv, w, b, True, 0.3, 1e-3), layouts=("contiguous", "strided"))
  assert_close(brm, trm, what="running_mean")
  assert_close(brv, trv, what="running_var")
  helper_test_op([shape, (4,), (4,)], lambda x, w, b: TF.batch_norm(x, trm, trv, w, b, False),
                 lambda x, w, b: F.batch_norm(x, brm, brv, w, b, False))
  with pytest.raises(ValueError, match="more than 1 value per channel"): F.batch_norm(bt.randn(1, 4), brm, brv, training=True)


@pytest.mark.parametrize("momentum,affine,track,bias", [(0.1, True, True, True), (None, True, True, False),
                                                        (0.5, False, True, True), (0.1, True, False, True)])
def test_batch_norm_modules_over_steps_match_torch(momentum, affine, track, bias):
  for bcls, tcls, shape in [(nn.BatchNorm1d, torch.nn.BatchNorm1d, (8, 5)), (nn.BatchNorm1d, torch.nn.BatchNorm1d, (4, 5, 3)),
                            (nn.BatchNorm2d, torch.nn.BatchNorm2d, (4, 5, 3, 3))]:
    kw = dict(momentum=momentum, affine=affine, track_running_stats=track, bias=bias)
    bm, tm = bcls(5, **kw), tcls(5, **kw)
    assert list(bm.state_dict()) == list(tm.state_dict()) and repr(bm) == repr(tm)
    for step in range(3):
      helper_test_op([shape], tm, bm, seed=step)
    for k, v in tm.state_dict().items():
      np.testing.assert_allclose(bm.state_dict()[k].numpy(), v.numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
    bm.eval(); tm.eval()
    helper_test_op([shape], tm, bm, seed=7)
  with pytest.raises(ValueError, match=r"expected 4D input \(got 3D input\)"): nn.BatchNorm2d(5)(bt.randn(2, 5, 3))


@pytest.mark.parametrize("groups,shape", [(1, (2, 6, 4)), (3, (2, 6, 3, 2)), (6, (3, 6, 5))])
def test_group_norm_matches_torch(groups, shape):
  helper_test_op([shape, (6,), (6,)], lambda x, w, b: TF.group_norm(x, groups, w, b, 1e-4),
                 lambda x, w, b: F.group_norm(x, groups, w, b, 1e-4), layouts=("contiguous", "strided"))
  helper_test_op([shape], torch.nn.GroupNorm(groups, 6), nn.GroupNorm(groups, 6))
  assert repr(nn.GroupNorm(groups, 6, bias=False)) == repr(torch.nn.GroupNorm(groups, 6, bias=False))
  check_vjp(lambda x: F.group_norm(x, groups), [shape])
  with pytest.raises(RuntimeError, match="divisible by num_groups"): F.group_norm(bt.randn(2, 6, 3), 4)
  with pytest.raises(ValueError, match="divisible by num_groups"): nn.GroupNorm(4, 6)


# *** layers ***

def load(bmod: nn.Module, tmod: torch.nn.Module) -> None:
  g = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for p in tmod.parameters(): p.copy_(torch.randn(p.shape, generator=g))
  bmod.load_state_dict({k: bt.tensor(v.numpy()) for k, v in tmod.state_dict().items()})


LAYERS = [
  (lambda m: m.Conv2d(4, 6, 3, padding=1, bias=False), (2, 4, 5, 5)),
  (lambda m: m.Conv2d(4, 6, (3, 2), stride=2, groups=2, padding_mode="reflect", padding=1), (2, 4, 7, 6)),
  (lambda m: m.Conv2d(4, 6, 3, padding="same", padding_mode="circular", dilation=2), (2, 4, 7, 6)),
  (lambda m: m.Conv1d(4, 2, 3, padding=2, padding_mode="replicate"), (2, 4, 9)),
  (lambda m: m.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1), (2, 4, 3, 3)),
  (lambda m: m.ConvTranspose1d(4, 2, 3, stride=3), (2, 4, 5)),
  (lambda m: m.Conv3d(4, 6, (3, 2, 3), stride=(2, 1, 1), padding=1, groups=2), (2, 4, 5, 4, 5)),
  (lambda m: m.Conv3d(2, 3, 2, padding="same", padding_mode="replicate"), (2, 2, 3, 4, 3)),
  (lambda m: m.ConvTranspose3d(4, 2, (2, 3, 2), stride=(2, 1, 2), output_padding=(1, 0, 1)), (2, 4, 3, 2, 3)),
  (lambda m: m.MaxPool2d(3, 2, 1, ceil_mode=True), (2, 3, 7, 6)), (lambda m: m.AvgPool2d(2, count_include_pad=False, padding=1), (2, 3, 5, 5)),
  (lambda m: m.AvgPool1d(3), (2, 3, 7)), (lambda m: m.MaxPool1d(2, 1), (2, 3, 7)),
  (lambda m: m.AdaptiveAvgPool2d((2, 3)), (2, 3, 7, 6)), (lambda m: m.AdaptiveAvgPool1d(2), (2, 3, 7)),
]


@pytest.mark.parametrize("make,shape", LAYERS)
def test_layers_match_torch(make, shape):
  bmod, tmod = make(nn), make(torch.nn)
  assert repr(bmod) == repr(tmod)
  assert [(k, tuple(v.shape)) for k, v in bmod.state_dict().items()] == [(k, tuple(v.shape)) for k, v in tmod.state_dict().items()]
  load(bmod, tmod)
  helper_test_op([shape], tmod, bmod, tol_scale=3)


def test_conv_init_statistics():
  w = nn.Conv2d(16, 32, 3).weight.detach().numpy()
  bound = 1 / np.sqrt(16 * 9)
  assert np.abs(w).max() <= bound and np.abs(w).max() > 0.9 * bound and abs(w.mean()) < 0.1 * bound


# *** a small CNN, eager and compiled ***

class SmallCNN(nn.Module):
  def __init__(self):
    super().__init__()
    self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
    self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2), nn.BatchNorm2d(8)
    self.pool, self.gap, self.fc = nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Linear(8, 5)

  def forward(self, x):
    x = self.pool(F.relu(self.bn1(self.conv1(x))))
    x = F.relu(self.bn2(self.conv2(x)))
    return self.fc(self.gap(x).flatten(1))


def test_small_cnn_matches_torch_and_compiled_equals_eager(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))
  models = []
  for _ in range(2):
    bt.manual_seed(0)
    m = SmallCNN()
    models.append((m, bt.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)))

  def make_step(model, opt):
    def step(x, y):
      loss = F.cross_entropy(model(x), y)
      loss.backward()
      opt.step()
      opt.zero_grad()
      return loss
    return step
  (m1, o1), (m2, o2) = models
  eager, compiled = make_step(m1, o1), bt.compile(make_step(m2, o2))
  rng = np.random.default_rng(0)
  for _ in range(4):
    x, y = bt.tensor(rng.standard_normal((4, 3, 8, 8)).astype(np.float32)), bt.tensor(rng.integers(0, 5, 4))
    np.testing.assert_allclose(compiled(x, y).item(), eager(x, y).item(), rtol=1e-5)
  for (name, p), q in zip(m1.state_dict().items(), m2.state_dict().values()):
    np.testing.assert_allclose(q.numpy(), p.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
  assert int(m2.bn1.num_batches_tracked.item()) == 4


def test_max_pool2d_values_and_gradient_vjps_against_finite_differences():
  """`max_pool2d_values` and `max_pool2d_backward` are each the other's VJP (so max pooling has a double backward):
  both against finite differences, at fixed indices of overlapping, dilated windows."""
  from blutrain.ops import nn as onn
  geom = dict(kernel=(3, 2), stride=(2, 1), padding=(1, 1), dilation=(1, 2))
  x = bt.tensor(np.random.default_rng(3).standard_normal((2, 3, 7, 8)))
  idx = onn.max_pool2d_indices(x, out_size=(4, 8), **geom)
  check_vjp(lambda x: onn.max_pool2d_values(x, idx, **geom), [(2, 3, 7, 8)])
  check_vjp(lambda g: onn.max_pool2d_backward_op(g, idx, size=(7, 8), **geom), [(2, 3, 4, 8)])
