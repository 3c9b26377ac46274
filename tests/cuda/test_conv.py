"""The CUDA convolutions, on each engine of `bt.backends.conv` (cuDNN where it loads, and the implicit-GEMM kernels of
backend/cuda/kernels/conv.py), against PyTorch CUDA in float64 as the reference: forward, input and weight gradients through bt for 1-D, 2-D and 3-D geometry (stride, padding, dilation,
groups, 'same'), channels-last views, every dtype and float32 precision (the channels-last kernels where channel
counts are multiples of 16), channels-last views that they must copy, the split-K weight gradient of a ResNet
layer, conv_transpose, and a small CNN's training step under bf16 autocast."""
import numpy as np
import pytest

import blutrain as bt
from blutrain import nn
from blutrain.backend.cuda.kernels import cudnn_conv
from blutrain.nn import functional as F

pytestmark = pytest.mark.cuda

# name -> (dtype, float32 matmul precision, bound on relative errors)
PRECISIONS = {"fp32": (bt.float32, "highest", 1e-5), "tf32": (bt.float32, "high", 5e-3),
              "fp16": (bt.float16, "highest", 5e-3), "bf16": (bt.bfloat16, "highest", 3e-2),
              "fp64": (bt.float64, "highest", 1e-12)}
GEOMETRY = [  # (x shape, w shape, kwargs)
  ((2, 4, 9, 10), (6, 2, 3, 2), dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2)),
  ((3, 16, 14, 14), (32, 16, 3, 3), dict(padding=1)),
  ((2, 8, 15, 15), (8, 1, 3, 3), dict(stride=2, padding=1, groups=8)),
  ((2, 3, 17, 17), (16, 3, 7, 7), dict(stride=2, padding=3)),
  ((4, 5, 8, 8), (7, 5, 4, 3), dict(padding="same", dilation=(1, 2))),
  ((2, 6, 33), (4, 3, 5), dict(stride=3, padding=2, dilation=2, groups=2)),
  ((2, 4, 6, 9, 10), (6, 2, 3, 3, 2), dict(stride=(1, 2, 1), padding=(1, 1, 2), dilation=(2, 1, 2), groups=2)),
  ((2, 8, 5, 12, 12), (16, 8, 3, 3, 3), dict(padding=1)),
  ((1, 3, 7, 8, 9), (4, 3, 2, 3, 2), dict(stride=2, padding="valid")),
  # channels per group of multiples of 16: the channels-last kernels (48: a part-masked channel block)
  ((2, 48, 15, 15), (32, 48, 3, 3), dict(stride=2, padding=1)),
  ((2, 32, 9, 10), (32, 16, 3, 2), dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2)),
  ((2, 16, 33), (32, 16, 5), dict(stride=2, padding=2, dilation=2)),
  ((2, 16, 5, 8, 8), (16, 16, 3, 3, 3), dict(stride=(1, 2, 2), padding=1)),
]
FUNCTIONS = {3: "conv1d", 4: "conv2d", 5: "conv3d"}  # by the input's rank


@pytest.fixture(autouse=True)
def _highest():
  yield
  bt.set_float32_matmul_precision("highest")


@pytest.fixture(params=bt.backends.CONV)
def engine(request):
  """Each convolution engine in turn (cuDNN skipped where it does not load)."""
  if request.param == "cudnn" and not cudnn_conv.available(): pytest.skip("cuDNN's frontend or library does not load")
  before, bt.backends.conv = bt.backends.conv, request.param
  yield request.param
  bt.backends.conv = before


def rel_err(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape and np.isfinite(got).all()
  return float(np.abs(got - want).max() / (np.abs(want).max() or 1.0))


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("prec", list(PRECISIONS))
@pytest.mark.parametrize("geometry", GEOMETRY)
def test_conv_and_gradients_match_torch_cuda(geometry, prec, layout, engine, torch_cuda):
  torch, (xs, ws, kw) = torch_cuda, geometry
  dtype, precision, tol = PRECISIONS[prec]
  bt.set_float32_matmul_precision(precision)
  rng = np.random.default_rng(0)
  x, w, b = (rng.standard_normal(s).astype(dtype.np) for s in (xs, ws, ws[:1]))
  fn = getattr(F, FUNCTIONS[len(xs)])
  bx = bt.tensor(x, device="cuda")
  if layout == "channels_last":
    perm = (0, *range(2, len(xs)), 1)
    bx = bt.tensor(np.ascontiguousarray(x.transpose(perm)), device="cuda").permute(0, len(xs) - 1, *range(1, len(xs) - 1))
  bx.requires_grad_()
  bw, bb = (bt.tensor(a, device="cuda", requires_grad=True) for a in (w, b))
  y = fn(bx, bw, bb, **kw)
  tx, tw, tb = (torch.tensor(a.astype(np.float64), device="cuda", requires_grad=True) for a in (x, w, b))
  ty = getattr(torch.nn.functional, FUNCTIONS[len(xs)])(tx, tw, tb, **kw)
  g = rng.standard_normal(tuple(ty.shape)).astype(dtype.np)
  y.backward(bt.tensor(g, device="cuda"))
  ty.backward(torch.tensor(g.astype(np.float64), device="cuda"))
  assert y.dtype is dtype
  for name, got, want in (("out", y, ty), ("dx", bx.grad, tx.grad), ("dw", bw.grad, tw.grad), ("db", bb.grad, tb.grad)):
    err = rel_err(got.detach().float().cpu().numpy() if dtype is not bt.float64 else got.detach().cpu().numpy(),
                  want.detach().cpu().numpy())
    assert err < tol, f"{name}: relative error {err:.2e} over {tol:.0e} ({engine}, {prec}, {layout}, {xs}, {ws}, {kw})"


def test_cudnn_takes_the_halves_and_tf32_of_one_group(engine):
  """The cuDNN engine builds graphs for what it takes (bfloat16, TF32; 1-D as 2-D) and leaves float32 in full
  precision and grouped convolutions to the Triton kernels; the Triton engine builds none."""
  rng = np.random.default_rng(5)
  cases = [((2, 16, 9, 9), (32, 16, 3, 3), 1, bt.bfloat16, "highest", True),
           ((2, 16, 21), (8, 16, 3), 1, bt.float32, "high", True),
           ((2, 16, 9, 9), (32, 16, 3, 3), 1, bt.float32, "highest", False),
           ((2, 16, 9, 9), (32, 8, 3, 3), 2, bt.bfloat16, "highest", False)]
  for xs, ws, groups, dtype, precision, cudnn in cases:
    bt.set_float32_matmul_precision(precision)
    x = bt.tensor(rng.standard_normal(xs).astype(np.float32), device="cuda").to(dtype).requires_grad_()
    w = bt.tensor(rng.standard_normal(ws).astype(np.float32), device="cuda").to(dtype).requires_grad_()
    before = cudnn_conv._graph.cache_info().misses + cudnn_conv._graph.cache_info().hits
    y = (F.conv1d if len(xs) == 3 else F.conv2d)(x, w, padding=1, groups=groups)
    y.float().sum().backward()
    runs = cudnn_conv._graph.cache_info().misses + cudnn_conv._graph.cache_info().hits - before
    assert runs == (3 if cudnn and engine == "cudnn" else 0), (xs, ws, groups, dtype, precision, engine)


@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float32])
def test_resnet_layer_weight_gradient_splits_k(dtype, engine, torch_cuda):
  """56x56x64 at batch 32: the weight gradient's K (N*OH*OW = 100352) is split over programs and summed."""
  torch = torch_cuda
  rng = np.random.default_rng(1)
  x, w = rng.standard_normal((32, 64, 56, 56)).astype(dtype.np), (rng.standard_normal((64, 64, 3, 3)) * 0.05).astype(dtype.np)
  bx, bw = bt.tensor(x, device="cuda", requires_grad=True), bt.tensor(w, device="cuda", requires_grad=True)
  y = F.conv2d(bx, bw, padding=1)
  y.float().square().sum().backward()
  tx, tw = (torch.tensor(a.astype(np.float32), device="cuda", requires_grad=True) for a in (x, w))
  torch.backends.cudnn.allow_tf32 = False
  ty = torch.nn.functional.conv2d(tx, tw, padding=1)
  ty.square().sum().backward()
  tol = 3e-2 if dtype is bt.bfloat16 else 1e-4
  assert rel_err(bw.grad.float().cpu().numpy(), tw.grad.cpu().numpy()) < tol
  assert rel_err(bx.grad.float().cpu().numpy(), tx.grad.cpu().numpy()) < tol


def test_channels_last_views_off_16_bytes_match_torch_cuda(engine, torch_cuda):
  """A channel slice of a channels-last tensor (pointer 2 bytes in, row strides of 34 channels): the host copies it
  for the channels-last kernels, whose promise of 16-byte alignment it breaks."""
  torch = torch_cuda
  rng = np.random.default_rng(3)
  x, w = rng.standard_normal((2, 10, 9, 34)).astype(np.float32), rng.standard_normal((16, 32, 3, 3)).astype(np.float32)
  bx = bt.tensor(x, device="cuda").to(bt.bfloat16).permute(0, 3, 1, 2)[:, 1:33].requires_grad_()
  bw = bt.tensor(w, device="cuda").to(bt.bfloat16).requires_grad_()
  y = F.conv2d(bx, bw, stride=2, padding=1)
  y.float().square().sum().backward()
  tx = torch.tensor(x, device="cuda").to(torch.bfloat16).double().permute(0, 3, 1, 2)[:, 1:33].requires_grad_()
  tw = torch.tensor(w, device="cuda").to(torch.bfloat16).double().requires_grad_()
  ty = torch.nn.functional.conv2d(tx, tw, stride=2, padding=1)
  ty.square().sum().backward()
  for got, want in ((y, ty), (bx.grad, tx.grad), (bw.grad, tw.grad)):
    assert rel_err(got.detach().float().cpu().numpy(), want.detach().cpu().numpy()) < 3e-2


def test_conv_transpose_matches_torch_cuda(torch_cuda):
  torch = torch_cuda
  rng = np.random.default_rng(2)
  x, w = rng.standard_normal((2, 4, 5, 6)), rng.standard_normal((4, 3, 3, 2))
  kw = dict(stride=(2, 3), padding=(1, 0), output_padding=(1, 2), groups=2, dilation=(1, 2))
  y = F.conv_transpose2d(bt.tensor(x, device="cuda"), bt.tensor(w, device="cuda"), **kw)
  ty = torch.nn.functional.conv_transpose2d(torch.tensor(x, device="cuda"), torch.tensor(w, device="cuda"), **kw)
  assert rel_err(y.cpu().numpy(), ty.cpu().numpy()) < 1e-12
  x, w = rng.standard_normal((2, 4, 3, 4, 5)), rng.standard_normal((4, 3, 2, 3, 2))
  kw = dict(stride=(2, 1, 3), padding=(0, 1, 1), output_padding=(1, 0, 2), groups=2, dilation=(1, 2, 1))
  y = F.conv_transpose3d(bt.tensor(x, device="cuda"), bt.tensor(w, device="cuda"), **kw)
  ty = torch.nn.functional.conv_transpose3d(torch.tensor(x, device="cuda"), torch.tensor(w, device="cuda"), **kw)
  assert rel_err(y.cpu().numpy(), ty.cpu().numpy()) < 1e-12


def test_small_cnn_step_under_autocast_matches_cpu(engine, torch_cuda):
  bt.manual_seed(0)
  model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=4),
                        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
  x, y = bt.randn(8, 3, 16, 16), bt.randint(0, 10, (8,))
  grads = []
  for device in ("cpu", "cuda"):
    model.to(device).zero_grad()
    with bt.autocast(device, dtype=bt.bfloat16):
      loss = F.cross_entropy(model(x.to(device)), y.to(device))
    loss.backward()
    grads.append([p.grad.float().cpu().numpy() for p in model.parameters()])
  for cpu, cuda in zip(*grads): assert rel_err(cuda, cpu) < 5e-2


def test_channels_last_cnn_step_matches_nchw_eager_and_compiled(engine):
  """A conv / batch norm / relu / residual / max pool / linear step under bf16 autocast on a channels-last batch: the
  activations stay channels-last and the loss and gradients match the NCHW run's, eager and compiled."""
  rng = np.random.default_rng(7)
  x = rng.standard_normal((8, 16, 20, 20)).astype(np.float32)
  y = rng.integers(0, 10, (8,))

  def run(channels_last: bool, compiled: bool):
    bt.manual_seed(0)
    conv, bn = nn.Conv2d(16, 32, 3, padding=1, bias=False).cuda(), nn.BatchNorm2d(32).cuda()
    conv2, head = nn.Conv2d(32, 32, 3, padding=1, bias=False).cuda(), nn.Linear(32, 10).cuda()
    params = [*conv.parameters(), *bn.parameters(), *conv2.parameters(), *head.parameters()]
    seen = []

    def step(xb, yb):
      with bt.autocast("cuda", dtype=bt.bfloat16):
        h = F.relu(bn(conv(xb)))
        h = F.max_pool2d(F.relu(conv2(h) + h), 3, 2, 1)
        seen.append(h.is_contiguous(memory_format=bt.channels_last) and not h.is_contiguous())
        loss = F.cross_entropy(head(h.mean((2, 3))), yb)
      loss.backward()
      return loss

    fn = bt.compile(step) if compiled else step
    xb = bt.tensor(x, device="cuda")
    if channels_last: xb = xb.contiguous(memory_format=bt.channels_last)
    loss = fn(xb, bt.tensor(y, device="cuda"))
    if not compiled: assert seen == [channels_last]
    return float(loss.item()), [p.grad.float().cpu().numpy() for p in params]

  loss, grads = run(False, False)
  for channels_last, compiled in ((True, False), (True, True)):
    got_loss, got = run(channels_last, compiled)
    assert abs(got_loss - loss) < 2e-2 * abs(loss), (channels_last, compiled, got_loss, loss)
    for g, w in zip(got, grads): assert rel_err(g, w) < 5e-2, (channels_last, compiled)


def test_compiled_nchw_cnn_step_runs_channels_last_and_matches_eager(engine):
  """A compiled training step (SGD inside) on an NCHW batch binds the batch channels-last (`nova.jit._conv_images`):
  its losses and updated weights over four steps match the eager NCHW run's."""
  rng = np.random.default_rng(3)
  x = rng.standard_normal((8, 16, 20, 20)).astype(np.float32)
  y = rng.integers(0, 10, (8,))

  def run(compiled: bool):
    bt.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(32, 10)).cuda()
    opt = bt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(xb, yb):
      with bt.autocast("cuda", dtype=bt.bfloat16):
        loss = F.cross_entropy(model(xb), yb)
      loss.backward()
      opt.step()
      opt.zero_grad()
      return loss

    fn = bt.compile(step) if compiled else step
    xb, yb = bt.tensor(x, device="cuda"), bt.tensor(y, device="cuda")
    before = [p.detach().float().cpu().numpy() for p in model.parameters()]
    losses = [float(fn(xb, yb).item()) for _ in range(4)]
    if compiled: assert next(iter(fn._entries.values())).channels_last == {0}
    assert xb.is_contiguous()
    return losses, [p.detach().float().cpu().numpy() - b for p, b in zip(model.parameters(), before)]

  (want_losses, want), (losses, got) = run(False), run(True)
  np.testing.assert_allclose(losses, want_losses, rtol=2e-2)
  for g, w in zip(got, want): assert rel_err(g, w) < 5e-2  # each parameter's change over the four steps
