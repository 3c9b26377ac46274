"""The library surface on the GPU, against the same code on the CPU: a small CNN's training steps (conv, batch norm,
pooling), LSTM/GRU/MultiheadAttention gradients, the composite functions, bt.save/bt.load with map_location, and
DataLoader batches moved to the device."""
import numpy as np
import pytest

import blutrain as bt
from blutrain import nn
from blutrain.nn import functional as F
from blutrain.utils.data import DataLoader, TensorDataset
from tests.helpers import assert_as_accurate

pytestmark = pytest.mark.cuda


def _close(gpu: bt.Tensor, cpu: bt.Tensor, what: str, tol: float = 1e-4) -> None:
  g, c = gpu.detach().cpu().numpy(), cpu.detach().numpy()
  np.testing.assert_allclose(g, c, rtol=tol, atol=tol * max(1.0, float(np.abs(c).max())), err_msg=what)


def _twins(make):
  bt.manual_seed(0)
  cpu = make()
  gpu = make()
  gpu.load_state_dict(cpu.state_dict())
  return cpu, gpu.cuda()


class SmallCNN(nn.Module):
  def __init__(self):
    super().__init__()
    self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
    self.conv2, self.bn2 = nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=2), nn.BatchNorm2d(16)
    self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
    self.pool, self.gap, self.fc = nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Linear(8, 10)

  def forward(self, x):
    x = self.pool(F.relu(self.bn1(self.conv1(x))))
    x = F.relu(self.bn2(self.conv2(x)))
    return self.fc(self.gap(F.avg_pool2d(self.up(x), 2)).flatten(1))


def test_small_cnn_training_steps_match_the_cpu():
  cpu, gpu = _twins(SmallCNN)
  opts = [bt.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (cpu, gpu)]
  rng = np.random.default_rng(0)
  for _ in range(3):
    x, y = bt.tensor(rng.standard_normal((8, 3, 16, 16)).astype(np.float32)), bt.tensor(rng.integers(0, 10, 8))
    for m, o, dev in ((cpu, opts[0], "cpu"), (gpu, opts[1], "cuda")):
      loss = F.cross_entropy(m(x.to(dev)), y.to(dev), label_smoothing=0.1)
      loss.backward()
      o.step(); o.zero_grad()
  for (name, c), g in zip(cpu.state_dict().items(), gpu.state_dict().values()):
    assert g.device.type == "cuda", name
    _close(g, c, name, tol=1e-3)


@pytest.mark.parametrize("make", [lambda: nn.LSTM(8, 16, num_layers=2, bidirectional=True, batch_first=True),
                                  lambda: nn.GRU(8, 16, num_layers=2), lambda: nn.MultiheadAttention(8, 2)])
def test_recurrent_and_attention_gradients_match_the_cpu(make):
  cpu, gpu = _twins(make)
  x = np.random.default_rng(1).standard_normal((5, 3, 8)).astype(np.float32)
  for m, dev in ((cpu, "cpu"), (gpu, "cuda")):
    t = bt.tensor(x, device=dev)
    out = m(t) if not isinstance(m, nn.MultiheadAttention) else m(t, t, t)
    (out[0] * out[0]).sum().backward()
  for (name, c), (_, g) in zip(cpu.named_parameters(), gpu.named_parameters()): _close(g.grad, c.grad, name, tol=1e-3)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_fused_cells_with_bfloat16_gates_match_the_cpu(cell):
  """The fused LSTM and GRU steps' kernels on bf16 gates and a float32 state that is a view of a wider tensor (as
  nn.LSTM and nn.GRU pass them), values and gradients against the CPU kernels on the same inputs."""
  rng = np.random.default_rng(0)
  N, H, gates = 33, 70, 4 if cell == "lstm" else 3
  gi, gh = (rng.standard_normal((N, gates * H)).astype(np.float32) for _ in range(2))
  state, w = rng.standard_normal((N, 2 * H)).astype(np.float32), rng.standard_normal((N, 2 * H)).astype(np.float32)
  results = []
  for dev in ("cpu", "cuda"):
    leaves = [bt.tensor(a, device=dev).to(bt.bfloat16).requires_grad_() for a in (gi, gh)] + \
      [bt.tensor(state, device=dev, requires_grad=True)]
    outs = bt.ops.lstm_cell(*leaves[:2], leaves[2][:, :H]) if cell == "lstm" else \
      (bt.ops.gru_cell(*leaves[:2], leaves[2][:, :H]),)
    sum((o * bt.tensor(w[:, k * H:(k + 1) * H], device=dev)).sum() for k, o in enumerate(outs)).backward()
    results.append((*outs, *(t.grad for t in leaves)))
  for i, (c_, g_) in enumerate(zip(*results)): _close(g_.float(), c_.float(), f"{cell} result {i}", tol=1e-2)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("reverse", [False, True])
def test_sequences_match_the_cpu(kind, dtype, reverse):
  """A direction's whole loop on the GPU (a GEMM and a cell kernel per step; backward a cell kernel, adds and a GEMM
  per step) against the CPU kernels on the same inputs: bf16 gates and weights with float32 states (as under
  autocast), or all float32; gi a non-contiguous view; every h (and the LSTM's last c), and every input's gradient.
  bf16 results round at every step (a gradient through nine steps is a few percent off), so the GPU's error against a
  float64 run must be within 3x the CPU's own bf16 error. Three draws of the same shapes: the second captures each loop
  as a CUDA graph, the third replays it."""
  (gates, n_states), (L, N, H) = (4, 2) if kind == "lstm" else (3, 1), (9, 5, 48)
  shapes = [(N, L, gates * H)] + [(N, H)] * n_states + [(gates * H, H), (gates * H,)]
  runs = [("cpu", dtype), ("cuda", dtype)] + ([("cpu", bt.float64)] if dtype is bt.bfloat16 else [])
  for draw in range(3):
    rng = np.random.default_rng(draw)
    arrays = [rng.standard_normal(s).astype(np.float32) * 0.5 for s in shapes]
    results = []
    for dev, dt in runs:
      state_dtype = bt.float32 if dt is bt.bfloat16 else dt
      leaves = [bt.tensor(a, device=dev).to(state_dtype if 0 < i <= n_states else dt).requires_grad_()
                for i, a in enumerate(arrays)]
      outs = getattr(bt.ops, f"{kind}_sequence")(leaves[0].transpose(0, 1), *leaves[1:], reverse=reverse)
      outs = outs if kind == "lstm" else (outs,)
      us = [bt.tensor(np.random.default_rng(10 + draw).standard_normal(tuple(o.shape)), device=dev).to(o.dtype)
            for o in outs]
      sum((o * u).sum() for o, u in zip(outs, us)).backward()
      results.append((*outs, *(t.grad for t in leaves)))
    for i, (c_, g_, *exact) in enumerate(zip(*results)):
      assert g_.dtype is c_.dtype, f"result {i}"
      what = f"{kind} result {i}, draw {draw}"
      if exact:
        as_np = lambda t: t.detach().cpu().double().numpy()
        assert_as_accurate(as_np(g_), as_np(c_), as_np(exact[0]), what, slack=3.0)
      else:
        _close(g_, c_, what, tol=1e-3)


FUNCTIONS = [
  lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False),
  lambda x: F.interpolate(x, size=(5, 3)),
  lambda x: F.pad(x, (2, 1, 1, 2), mode="reflect"),
  lambda x: F.pad(x, (1, 1, 0, 2), mode="circular"),
  lambda x: F.group_norm(x, 2),
  lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True),
  lambda x: F.normalize(x, dim=1) + F.softplus(x) + F.mish(x) + F.hardswish(x) + F.elu(x),
  lambda x: F.binary_cross_entropy_with_logits(x, x.sigmoid().detach(), pos_weight=bt.ones(6, device=x.device) * 2),
]


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_composite_functions_match_the_cpu(fn):
  x = np.random.default_rng(2).standard_normal((2, 4, 5, 6)).astype(np.float32)
  outs, grads = [], []
  for dev in ("cpu", "cuda"):
    t = bt.tensor(x, device=dev, requires_grad=True)
    out = fn(t)
    (out * out).sum().backward()
    outs.append(out); grads.append(t.grad)
  _close(outs[1], outs[0], "output")
  _close(grads[1], grads[0], "gradient")


def test_save_and_load_cuda_tensors(tmp_path):
  state = {"w": bt.randn(3, 4).cuda(), "b": bt.arange(5).cuda(), "h": bt.randn(2).to(bt.bfloat16).cuda()}
  bt.save(state, tmp_path / "s.bt")
  same = bt.load(tmp_path / "s.bt")
  assert all(v.device.type == "cuda" for v in same.values())
  on_cpu = bt.load(tmp_path / "s.bt", map_location="cpu")
  mapped = bt.load(tmp_path / "s.bt", map_location={"cuda:0": "cpu"})
  for k, v in state.items():
    assert on_cpu[k].device.type == "cpu" and mapped[k].device.type == "cpu" and on_cpu[k].dtype is v.dtype
    np.testing.assert_array_equal(on_cpu[k].float().numpy(), v.cpu().float().numpy())


def test_data_loader_batches_move_to_the_gpu():
  ds = TensorDataset(bt.randn(10, 3), bt.arange(10))
  seen = []
  for xb, yb in DataLoader(ds, batch_size=4, shuffle=True, generator=bt.Generator().manual_seed(0), pin_memory=True,
                           num_workers=2):
    xb, yb = xb.cuda(), yb.cuda()
    assert xb.device.type == "cuda"
    seen += yb.cpu().tolist()
  assert sorted(seen) == list(range(10))
