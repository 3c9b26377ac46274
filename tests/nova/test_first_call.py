"""bt.compile's first call is captured, not run eagerly: the graph that creates the optimizer's state (and lazily made
buffers) runs once and hands that state over as ordinary tensors; training then equals the eager loop, and today's
path (an eager first step, then the compiled steady graph), bit for bit on the CPU."""
import numpy as np
import pytest

import blutrain as bt
from blutrain import nn
from blutrain.nn import functional as F
from blutrain.models import GPT, GPTConfig
from blutrain.tensor import Traced


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))


OPTIMIZERS = {
  "sgd": lambda ps: bt.optim.SGD(ps, lr=0.1),
  "sgd-momentum": lambda ps: bt.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
  "sgd-nesterov": lambda ps: bt.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
  "adam": lambda ps: bt.optim.Adam(ps, lr=1e-2, weight_decay=0.01),
  "adam-amsgrad": lambda ps: bt.optim.Adam(ps, lr=1e-2, amsgrad=True),
  "adamw-fused": lambda ps: bt.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
  "adamw-unfused": lambda ps: bt.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=False),
}


def _mlp():
  return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))


def _gpt():
  return GPT(GPTConfig(vocab_size=40, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0))


def _run(make_model, make_opt, how: str, steps=4, clip=False, autocast=False):
  """Losses, parameters and the optimizer after `steps` steps: "eager", "compiled" (from the first call), or "today"
  (the first step eager, then compiled)."""
  bt.manual_seed(0)
  model = make_model()
  opt = make_opt(list(model.parameters()))
  gpt = isinstance(model, GPT)

  def step(x, y):
    with bt.autocast("cpu", dtype=bt.bfloat16, enabled=autocast):
      loss = model(x, y)[1] if gpt else F.cross_entropy(model(x), y)
    loss.backward()
    if clip: nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()
    return loss
  compiled = bt.compile(step) if how != "eager" else None
  rng = np.random.default_rng(1)
  losses = []
  for i in range(steps):
    if gpt: x, y = (bt.from_numpy(rng.integers(0, 40, (3, 8))) for _ in range(2))
    else: x, y = bt.from_numpy(rng.standard_normal((5, 6)).astype(np.float32)), bt.from_numpy(rng.integers(0, 3, 5))
    fn = step if how == "eager" or how == "today" and i == 0 else compiled
    losses.append(fn(x, y).detach().float().numpy().copy())
    if i == 0 and how == "compiled":
      assert compiled.info["capture"].startswith("initial") == any(opt.state.values()), compiled.info["capture"]
  if compiled is not None: assert compiled.info["capture"] == "steady"
  return np.array(losses), [p.detach().numpy().copy() for p in model.parameters()], opt, compiled


def _assert_bit_equal(a, b):
  np.testing.assert_array_equal(a[0], b[0])
  for p, q in zip(a[1], b[1]): np.testing.assert_array_equal(p, q)
  for (_, sa), (_, sb) in zip(a[2].state.items(), b[2].state.items()):
    assert sa.keys() == sb.keys()
    for k in sa: np.testing.assert_array_equal(np.asarray(sa[k].numpy()), np.asarray(sb[k].numpy()), err_msg=k)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compiled_from_the_first_call_equals_eager_and_todays_path(name):
  eager, today, compiled = (_run(_mlp, OPTIMIZERS[name], how) for how in ("eager", "today", "compiled"))
  _assert_bit_equal(compiled, today)
  _assert_bit_equal(compiled, eager)
  stateful = name != "sgd"
  assert compiled[3].captures == (2 if stateful else 1), "the graph creating the state, then the steady one"
  for state in compiled[2].state.values():  # the state is made of ordinary tensors, with ordinary storage
    for v in state.values(): assert type(v._storage.data) is np.ndarray and v.device.type == "cpu"
  keys = lambda opt: {k for s in opt.state_dict()["state"].values() for k in s}
  assert keys(compiled[2]) == keys(eager[2])


@pytest.mark.parametrize("name,clip,autocast", [("adamw-fused", True, False), ("adamw-fused", False, True),
                                                ("adamw-fused", True, True), ("sgd-momentum", True, False)],
                         ids=["clip", "bf16", "clip-bf16", "sgd-clip"])
def test_clipping_and_autocast_from_the_first_call(name, clip, autocast):
  runs = [_run(_mlp, OPTIMIZERS[name], how, clip=clip, autocast=autocast) for how in ("eager", "today", "compiled")]
  _assert_bit_equal(runs[2], runs[1])
  _assert_bit_equal(runs[2], runs[0])
  if clip:  # the update scales the gradients as it reads them (fuse-norms)
    source = open(runs[2][3].info["source"]).read()
    assert 'kernels["scale"]' not in source and "clip=True" in source


def test_gpt_from_the_first_call():
  make_opt = lambda ps: bt.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True)
  eager, today, compiled = (_run(_gpt, make_opt, how, steps=3, clip=True) for how in ("eager", "today", "compiled"))
  _assert_bit_equal(compiled, today)
  _assert_bit_equal(compiled, eager)


class _Counted(nn.Module):
  """A linear layer that makes a buffer on its first forward and counts its calls in it."""
  def __init__(self):
    super().__init__()
    self.lin = nn.Linear(4, 2)

  def forward(self, x):
    if "calls" not in self._buffers: self.register_buffer("calls", bt.zeros((), dtype=bt.float32))
    self.calls.add_(1)
    return self.lin(x) * self.calls


def test_a_buffer_made_by_the_first_forward_becomes_an_ordinary_tensor():
  outs = []
  for compiled in (False, True):
    bt.manual_seed(0)
    m = _Counted()
    fn = bt.compile(m) if compiled else m
    x = bt.randn(3, 4)
    with bt.no_grad(): outs.append(([fn(x).numpy().copy() for _ in range(3)], m.calls))
  (want, want_calls), (got, got_calls) = outs
  for a, b in zip(want, got): np.testing.assert_array_equal(b, a)
  assert type(got_calls._storage.data) is np.ndarray and got_calls.item() == want_calls.item() == 3


def test_a_failed_first_capture_leaves_no_traced_state():
  bt.manual_seed(0)
  model = nn.Linear(3, 1)
  opt = bt.optim.Adam(model.parameters(), lr=1e-2)

  def step(x):
    loss = model(x).sum()
    loss.backward()
    opt.step()
    if loss.item() > 1e9: return loss * 0  # reads a value in Python after the state was made: a graph break
    return loss
  with pytest.raises(bt.nova.GraphBreakError):
    bt.compile(step)(bt.randn(2, 3))
  assert not any(opt.state.values()) and all(p.grad is None for p in model.parameters())
  step(bt.randn(2, 3))  # the optimizer works eagerly afterwards
  assert all(type(v._storage.data) is np.ndarray for s in opt.state.values() for v in s.values())
