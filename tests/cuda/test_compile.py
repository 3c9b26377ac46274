"""Nova's GPU target on a real GPU: a compiled step equals the eager one (losses and parameters after several
AdamW or SGD steps with clipping and a changing learning rate), for GPT and for a model the GPT preset does not
cover, in float32 and under bf16 autocast; CUDA-graph replay equals kernel-by-kernel execution (losses bitwise); a
step that draws random numbers (dropout) replays as a graph that reads the generator's state from device memory,
drawing the numbers eager mode draws."""
import numpy as np
import pytest

import blutrain as bt
from blutrain import nn
from blutrain.nn import functional as F
from blutrain.models import GPT, GPTConfig
from tests.helpers import assert_as_accurate

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))


class _Block(nn.Module):
  """RMSNorm, a gated SiLU MLP, no biases."""
  def __init__(self, d):
    super().__init__()
    self.norm, self.gate = nn.RMSNorm(d), nn.Linear(d, 2 * d, bias=False)
    self.up, self.down = nn.Linear(d, 2 * d, bias=False), nn.Linear(2 * d, d, bias=False)

  def forward(self, x): return x + self.down(F.silu(self.gate(self.norm(x))) * self.up(self.norm(x)))


class _GatedLM(nn.Module):
  """Untied embedding and head around two gated blocks."""
  def __init__(self, vocab=48, d=64):
    super().__init__()
    self.emb, self.blocks, self.head = nn.Embedding(vocab, d), nn.ModuleList([_Block(d), _Block(d)]), nn.Linear(d, vocab, bias=False)

  def forward(self, x, y):
    h = self.emb(x)
    for b in self.blocks: h = b(h)
    logits = self.head(h)
    return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))


def _make(kind, dropout=0.0):
  bt.manual_seed(0)
  if kind == "gpt":
    model = GPT(GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=64, dropout=dropout)).to("cuda")
    return model, model.configure_optimizers(0.1, 1e-3, fused=True)
  model = _GatedLM().to("cuda")
  if kind == "gated-sgd": return model, bt.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=1e-4)
  return model, bt.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)


def _step(model, opt, amp):
  def step(x, y):
    with bt.autocast(device_type="cuda", dtype=bt.bfloat16, enabled=amp):
      _, loss = model(x, y)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss
  return step


def _train(kind, compiled, amp=False, steps=5, dropout=0.0, graphs="1", monkeypatch=None):
  if monkeypatch is not None: monkeypatch.setenv("BLUTRAIN_CUDA_GRAPHS", graphs)
  model, opt = _make(kind, dropout)
  step = _step(model, opt, amp)
  if compiled: step = bt.compile(step)
  rng = np.random.default_rng(1)
  vocab = 96 if kind == "gpt" else 48
  losses = []
  bt.manual_seed(7)
  for i in range(steps):
    opt.param_groups[0]["lr"] = 1e-3 * (1 + i) / steps  # a schedule: the graph reads each step's rate
    x, y = (bt.from_numpy(rng.integers(0, vocab, (4, 32))).to("cuda") for _ in range(2))
    losses.append(step(x, y).item())
  params = {n: p.detach().float().numpy() for n, p in model.named_parameters()}
  return losses, params, step


@pytest.mark.parametrize("kind", ["gpt", "gated", "gated-sgd"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_compiled_step_equals_eager(kind, amp, monkeypatch):
  l1, p1, _ = _train(kind, False, amp)
  l2, p2, step = _train(kind, True, amp, monkeypatch=monkeypatch)
  assert step.captures == 2 and step.info["cuda_graph"] == "on"  # the graph making the optimizer's state, the steady
  if amp:  # the two bf16 runs round differently (fused kernels round once) and Adam amplifies that in near-zero
    # gradients: each must be about as close to a float32 run as the other (a rarely touched embedding's error over
    # 5 steps varies by 2x between runs; a wrong kernel's is 10x and more)
    l32, p32, _ = _train(kind, False, False)
    assert_as_accurate(l2, l1, np.array(l32), "losses")
    for name in p1: assert_as_accurate(p2[name], p1[name], p32[name], name, slack=3.0)
    return
  np.testing.assert_allclose(l2, l1, rtol=2e-5)
  for name in p1:  # noise-sized differences (the key slice of c_attn.bias, a third of it, has a zero true gradient)
    np.testing.assert_allclose(p2[name], p1[name], atol=5e-7 + 5e-3 * name.endswith("c_attn.bias"), rtol=2e-5,
                               err_msg=name)


def test_graph_replay_equals_kernel_by_kernel(monkeypatch):
  """The same kernels on the same buffers: the first loss agrees bitwise. The embedding's gradient adds rows with
  atomics, whose order differs from run to run in either mode, so the parameters, and the losses after them, agree to
  the last bits only."""
  l1, p1, s1 = _train("gpt", True, amp=True, monkeypatch=monkeypatch, graphs="0")
  l2, p2, s2 = _train("gpt", True, amp=True, monkeypatch=monkeypatch, graphs="1")
  assert s1.info["cuda_graph"].startswith("off") and s2.info["cuda_graph"] == "on" and s2.info["graph_nodes"] > 50
  assert l1[0] == l2[0]
  np.testing.assert_allclose(l2, l1, rtol=1e-5)
  for name in p1: np.testing.assert_allclose(p2[name], p1[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_dropout_step_replays_as_a_graph_and_equals_eager(monkeypatch):
  """Each replay draws new masks (the generator's offset advances per call, as eagerly): a frozen mask would make the
  losses drift from eager's after the capture."""
  l1, p1, _ = _train("gpt", False, dropout=0.1, steps=6)
  l2, p2, step = _train("gpt", True, dropout=0.1, steps=6, monkeypatch=monkeypatch)
  assert step.info["cuda_graph"] == "on" and step.captures == 2
  np.testing.assert_allclose(l2, l1, rtol=2e-5)
  for name in p1:  # the key slice of c_attn.bias has a zero true gradient: Adam moves it by noise, within lr
    np.testing.assert_allclose(p2[name], p1[name], rtol=2e-5, atol=1e-6 + 5e-3 * name.endswith("c_attn.bias"),
                               err_msg=name)


def test_compiled_inference_equals_eager():
  model, _ = _make("gpt")
  model.eval()
  x = bt.from_numpy(np.random.default_rng(0).integers(0, 96, (2, 32))).to("cuda")
  fwd = bt.compile(lambda x: model(x)[0])
  with bt.no_grad():
    want = model(x)[0].numpy()
    for _ in range(3): got = fwd(x).numpy()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_cat_whose_inputs_the_plan_computes_in_place_equals_eager(monkeypatch):
  """The memory plan computes a cat's qualifying inputs inside its result (as a data-parallel bucket's gradients), and
  the cat kernel skips their copies: the result equals eager's, replayed as a graph and kernel by kernel (which runs
  without an arena). Captured, the cat copies only the input read again later (s) and the one not of whole 512 bytes
  (d); an eager first call, if any, copies all four."""
  from blutrain.backend.cuda.kernels import copy
  rng = np.random.default_rng(0)
  xs = [bt.from_numpy(rng.standard_normal(s).astype(np.float32)).to("cuda") for s in ((4, 32), (128,), (3,))]

  def f(a, c, d):
    e, s = a.exp(), a.sin()
    return bt.cat([e.reshape(-1), s.reshape(-1), c.cos(), d.exp()]) * 2, s.sum()
  want = [w.numpy() for w in f(*xs)]
  copies = []
  monkeypatch.setattr(copy, "copy", lambda x, out=None, _copy=copy.copy: copies.append(x.shape) or _copy(x, out=out))
  for graphs in ("1", "0"):
    monkeypatch.setenv("BLUTRAIN_CUDA_GRAPHS", graphs)
    step = bt.compile(f)
    for _ in range(3): got = [g.numpy() for g in step(*xs)]
    for g, w in zip(got, want): np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    if graphs == "1":
      planned = copies[4:] if copies[:4] == [(128,)] * 3 + [(3,)] else copies
      assert planned and planned == [(128,), (3,)] * (len(planned) // 2), copies


def test_empty_buffers_filled_in_a_replayed_step_equal_eager():
  """bt.empty on the GPU is memory no kernel writes, eager and in a replayed graph (where the plan places it): what
  the step writes into it is what eager mode computes."""
  def fill(x):
    buf = bt.empty(64, 48, device="cuda")
    buf.copy_(x * 2)
    other = bt.empty_like(x.T)
    other.copy_(x.T.exp())
    return buf + other.T
  compiled, x = bt.compile(fill), bt.randn(64, 48, device="cuda")
  for _ in range(3): np.testing.assert_array_equal(compiled(x).cpu().numpy(), fill(x).cpu().numpy())
  assert compiled.info["counts_before"]["empty"] == 2
