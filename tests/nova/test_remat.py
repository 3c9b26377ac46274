"""Nova's rematerialization: a step computes the same with and without it, its planned peak goes down, a memory budget
is met when it can be and reported when it cannot, the memory plan's invariants hold after it, and a recomputed
dropout mask is the same mask."""
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import blutrain as bt
from blutrain import dtypes, nn
from blutrain.nn import functional as F
from blutrain.models import GPT, GPTConfig
from blutrain.nova import ir
from blutrain.nova.memory import plan
from blutrain.nova.pipeline import compile_graph
from blutrain.nova import remat
from blutrain.nova.budget import parse_size
from blutrain.nova.remat import rematerialize
from tests.loopback import LOOPBACK
from tests.nova.graphs import Builder
from tests.nova.test_memory import _check


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setenv("BLUTRAIN_NOVA_FUSE", "0")  # the plans checked here are remat's; fusion shrinks them further


class _Llama(nn.Module):
  """RMSNorm, a gated SiLU MLP and dropout: the elementwise chains remat recomputes from kept values."""

  def __init__(self, V=48, C=32, L=2):
    super().__init__()
    self.emb, self.head = nn.Embedding(V, C), nn.Linear(C, V, bias=False)
    self.norms = nn.ModuleList([nn.RMSNorm(C) for _ in range(L)])
    self.gates = nn.ModuleList([nn.Linear(C, 4 * C, bias=False) for _ in range(L)])
    self.ups = nn.ModuleList([nn.Linear(C, 4 * C, bias=False) for _ in range(L)])
    self.downs = nn.ModuleList([nn.Linear(4 * C, C, bias=False) for _ in range(L)])
    self.drop = nn.Dropout(0.1)

  def forward(self, idx, targets):
    x = self.emb(idx)
    for norm, gate, up, down in zip(self.norms, self.gates, self.ups, self.downs):
      h = norm(x)
      x = x + self.drop(down(F.silu(gate(h)) * up(h)))
    logits = self.head(x)
    return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _gpt(): return GPT(GPTConfig(vocab_size=48, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1))


def _train(make, steps=4, **compile_kw):
  """A model trained `steps` AdamW steps by a compiled step: (losses, parameters, the step's info)."""
  bt.manual_seed(0)
  model = make()
  opt = bt.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

  def step(x, y):
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss
  compiled = bt.compile(step, **compile_kw)
  rng = np.random.default_rng(0)
  losses = []
  for _ in range(steps):
    x, y = (bt.from_numpy(rng.integers(0, 48, (4, 32))) for _ in range(2))
    losses.append(compiled(x, y).item())
  return np.array(losses), [p.detach().numpy().copy() for p in model.parameters()], compiled.info


@pytest.mark.parametrize("make", [_gpt, _Llama], ids=["gpt", "llama"])
def test_remat_computes_what_the_step_without_it_computes(make, monkeypatch):
  default = _train(make)
  with pytest.warns(UserWarning, match="memory budget"):
    budgeted = _train(make, memory_budget=1)  # a budget no plan meets: recompute all it can
  monkeypatch.setenv("BLUTRAIN_NOVA_REMAT", "0")
  off = _train(make)
  assert off[2]["remat"] is None and default[2]["remat"]["recomputed"]
  assert len(budgeted[2]["remat"]["recomputed"]) > len(default[2]["remat"]["recomputed"])
  for losses, params, _ in (default, budgeted):
    np.testing.assert_allclose(losses, off[0], rtol=1e-6)
    for p, q in zip(params, off[1]): np.testing.assert_allclose(p, q, rtol=1e-6, atol=1e-7)


def test_remat_lowers_the_planned_peak_and_meets_a_budget(monkeypatch):
  default = _train(_gpt, steps=2)[2]
  with pytest.warns(UserWarning, match="memory budget"): floor = _train(_gpt, steps=2, memory_budget=1)[2]
  monkeypatch.setenv("BLUTRAIN_NOVA_REMAT", "0")
  off = _train(_gpt, steps=2)[2]
  inputs = default["remat"]["inputs_bytes"]
  assert floor["live_peak_bytes"] < default["live_peak_bytes"] < off["live_peak_bytes"]
  assert default["remat"]["time_share"] <= remat.DEFAULT_TIME_SHARE and default["remat"]["bytes_saved"] > 0
  monkeypatch.delenv("BLUTRAIN_NOVA_REMAT")
  budget = inputs + (floor["arena_bytes"] + default["arena_bytes"]) // 2  # more than the default recomputes
  info = _train(_gpt, steps=2, memory_budget=budget)[2]
  assert info["remat"]["over_budget"] == 0 and inputs + info["arena_bytes"] <= budget < inputs + off["arena_bytes"]
  assert info["remat"]["flops_added"] < floor["remat"]["flops_added"], "it stops once the plan fits"


def test_a_budget_below_the_floor_says_by_how_much():
  with pytest.warns(UserWarning, match="above its memory budget of 0.00 MiB") as caught:
    info = _train(_gpt, steps=2, memory_budget="1KiB")[2]
  r = info["remat"]
  assert r["budget"] == 1024 and r["over_budget"] == r["inputs_bytes"] + info["arena_bytes"] - 1024 > 0
  assert f"stays {r['over_budget'] / 2**20:.2f} MiB above" in str(caught[-1].message)  # the steady graph's


def test_the_dump_holds_the_remat_report_and_ir(tmp_path):
  info = _train(_gpt, steps=2, dump_ir=str(tmp_path / "ir"))[2]
  text = next((tmp_path / "ir" / info["key"]).rglob("remat.txt")).read_text()  # the steady graph's
  assert text.startswith(f"live peak {info['remat']['live_peak_before']} -> {info['live_peak_bytes']} bytes")
  for name in info["remat"]["recomputed"] + info["remat"]["saved"]: assert f"  {name} " in text
  assert " = gelu  frees " in text, "the default recomputes GELU outputs (from the pre-activation a gemm saved)"
  dumped = sorted(p.name for p in (tmp_path / "ir" / info["key"]).glob("*.mlir"))
  assert dumped[-1].endswith("-remat.mlir") and len(dumped) >= 3  # the fusion passes after it are off here


def _forward_backward(b: Builder, x, weight, rng, acts_kinds, reads):
  """A forward of square activations, then a backward that reads some of them back in reverse order."""
  acts, h = [], x
  for i, kind in enumerate(acts_kinds):
    if kind == "matmul": h = b("matmul", h, weight, tf32=False)
    elif kind == "gelu": h = b("gelu", h, approximate="tanh")
    elif kind == "layer_norm": h = b("layer_norm", h, None, None, n=1, eps=1e-5)
    elif kind == "tanh_mul": h = b("mul", b("tanh", h), h)
    else:
      mask = b("bernoulli", rng, shape=h.shape, dtype=dtypes.bool_, offset=h.shape[0] * h.shape[1] * i, p=0.7)
      h = b("where", mask, h, b.full((), 0.0))
    acts.append(h)
  g = b("mul", h, b.full((), 2.0))
  for a, how in zip(reversed(acts), reads):
    if how == "direct": g = b("mul", g, b("sigmoid", a))
    elif how == "view": g = b("add", g, b("permute", a, dims=(1, 0)))
    elif how == "matmul": g = b("matmul", g, a, tf32=False)
  return b.output(g, b("sum", h, dims=(0, 1), keepdim=False, dtype=dtypes.float32))


@settings(max_examples=25, deadline=None)
@given(kinds=st.lists(st.sampled_from(["matmul", "gelu", "layer_norm", "tanh_mul", "dropout"]), min_size=2,
                      max_size=8),
       reads=st.lists(st.sampled_from(["direct", "view", "matmul", "none"]), min_size=2, max_size=8),
       budget=st.sampled_from([None, 0]))
def test_generated_graphs_keep_the_plan_invariants_and_values(kinds, reads, budget):
  S = 16
  b = Builder()
  x, weight, rng = b.input((S, S)), b.input((S, S)), b.rng()
  graph = _forward_backward(b, x, weight, rng, kinds, reads)
  rs = np.random.default_rng(len(kinds))
  args = [rs.standard_normal((S, S)).astype(np.float32) / 4, rs.standard_normal((S, S)).astype(np.float32) / 4,
          np.array([7, 3], np.int64)]
  expected = compile_graph(graph, remat=False).fn(*args)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    compiled = compile_graph(graph, memory_budget=budget)
  for e, a in zip(expected, compiled.fn(*args)): np.testing.assert_array_equal(a, e)
  _check(compiled.memory)
  r = compiled.remat
  assert r.peak_after <= r.peak_before and compiled.memory.lower_bound == r.peak_after


def test_a_recomputed_dropout_mask_is_the_same_mask():
  S = 64
  b = Builder()
  x, w, rng = b.input((S, S)), b.input((S, S)), b.rng()
  mask = b("bernoulli", rng, shape=(S, S), dtype=dtypes.bool_, offset=5, p=0.5)
  h = b("where", mask, x, b.full((), 0.0))
  big = b("matmul", h, w, tf32=False)
  for _ in range(3): big = b("matmul", b("tanh", big), w, tf32=False)  # a peak the mask is alive across
  g = b("where", mask, b("sum", big, dims=(1,), keepdim=True, dtype=dtypes.float32), b.full((), 0.0))
  graph = b.output(g)
  module = ir.to_module(graph)
  with pytest.warns(UserWarning, match="memory budget"): report = rematerialize(module, budget=0)
  assert any(r.ops == ["bernoulli"] for r in report.recomputed), report.report()
  draws = [op for op in ir.function(module).body.block.ops if op.name == "nova.bernoulli"]
  assert len(draws) == 2 and draws[0].properties == draws[1].properties and draws[0].rng is draws[1].rng
  rs = np.random.default_rng(0)
  args = [rs.standard_normal((S, S)).astype(np.float32), rs.standard_normal((S, S)).astype(np.float32) / 8,
          np.array([11, 40], np.int64)]
  expected = compile_graph(graph, remat=False).fn(*args)[0]
  with pytest.warns(UserWarning, match="memory budget"): compiled = compile_graph(graph, memory_budget=0)
  np.testing.assert_array_equal(compiled.fn(*args)[0], expected)
  assert (expected == 0).any() and (expected != 0).any(), "a mask that drops some rows and keeps others"
  assert _check(plan(module)).lower_bound == report.peak_after


def test_memory_budget_sizes():
  assert parse_size("10GiB") == 10 * 2**30 and parse_size("512 MB") == 512 * 10**6 and parse_size(4096) == 4096
  assert parse_size("1.5KiB") == 1536
  with pytest.raises(ValueError, match="10 gigs"): parse_size("10 gigs")
  with pytest.raises(ValueError, match=">= 0"): parse_size(-1)
  with pytest.raises(TypeError, match="float"): bt.compile(lambda: None, memory_budget=1.5)
  with pytest.raises(ValueError, match="cannot read"): bt.compile(lambda: None, memory_budget="lots")


def test_the_allocator_limit_is_a_budget_on_cuda_only(monkeypatch):
  from types import SimpleNamespace
  from blutrain.backend.cuda import runtime
  from blutrain.nova.budget import step_budget
  limits = {0: 3 * 2**30, 1: None}
  monkeypatch.setattr(runtime, "state",
                      lambda index=None: SimpleNamespace(allocator=SimpleNamespace(limit=limits[index])))
  assert step_budget("10GiB", bt.device("cuda", 0)) == step_budget(None, bt.device("cuda", 0)) == 3 * 2**30
  assert step_budget("1GiB", bt.device("cuda", 0)) == 2**30
  assert step_budget("10GiB", bt.device("cuda", 1)) == 10 * 2**30 and step_budget(None, bt.device("cuda", 1)) is None
  assert step_budget(None, bt.device("cpu")) is None and step_budget(512, bt.device("cpu")) == 512
  assert step_budget(None, bt.device("cuda", 0), held=2**30) == step_budget("3GiB", bt.device("cuda", 0), 2**30) == 2**31
  assert step_budget(None, bt.device("cuda", 1), held=2**30) is None


def test_the_clone_goes_right_before_the_first_read_after_the_peak_and_views_follow_it(monkeypatch):
  """IR in, IR out: gelu's output, read in the backward directly and through a view made in the forward, is cloned
  (gelu, then the view of the clone) before its first read after the peak; the forward keeps the original, and the
  forward's view, read only after the peak, goes."""
  monkeypatch.setattr(remat, "DEFAULT_TIME_SHARE", 0.2)  # a graph of 10 small ops: a launch is a tenth of the step
  S = 64
  b = Builder()
  x, w = b.input((S, S)), b.input((S, S))
  pre = b("matmul", x, w, tf32=False)
  act = b("gelu", pre, approximate="tanh")
  act_t = b("permute", act, dims=(1, 0))
  y = b("matmul", act, w, tf32=False)                                 # the forward's last read of act
  peak = b("matmul", b("tanh", y), w, tf32=False)                    # act alive across here, unread
  g = b("mul", b("mul", peak, act), act_t)                            # the backward reads act and its view
  module = ir.to_module(b.output(b("add", g, pre)))                   # pre stays alive: act recomputes from it
  report = rematerialize(module)
  assert [(r.ops, r.value) for r in report.recomputed] == [(["gelu"], "%3 -> %7")], report.report()
  names = [op.name[5:] for op in ir.function(module).body.block.ops][:-1]
  assert names == ["matmul", "gelu", "matmul", "tanh", "matmul", "gelu", "permute", "mul", "mul", "add"]
  ops = list(ir.function(module).body.block.ops)
  clone, view = ops[5], ops[6]
  assert ops[7].operands[1] is clone.result and view.operands[0] is clone.result and ops[8].operands[1] is view.result
  assert report.peak_after < report.peak_before and _check(plan(module)).lower_bound == report.peak_after


def test_a_collective_is_planned_as_any_op_and_never_recomputed():
  """A bucket reduced early and read after the peak (DDP's gradients, read by the optimizer): its recipe would be the
  collective alone (its operand is alive anyway), but remat never recomputes one (a round of communication, and every
  rank must run the same ones); the plan gives its result a buffer of its own."""
  S = 64
  b = Builder()
  x, w = b.input((S, S)), b.input((S, S))
  grad = b("matmul", x, w, tf32=False)
  bucket = b("all_reduce", grad, reduce_op="avg", group=LOOPBACK, size=1)
  peak = b("matmul", b("tanh", b("matmul", x, x, tf32=False)), w, tf32=False)
  module = ir.to_module(b.output(b("mul", peak, bucket), grad))  # grad alive to the end: bucket's recipe is one op
  with pytest.warns(UserWarning, match="above its memory budget"): report = rematerialize(module, budget=1)
  names = [op.name[5:] for op in ir.function(module).body.block.ops][:-1]
  assert names.count("all_reduce") == 1 and not any("all_reduce" in r.ops for r in report.recomputed), report.report()
  p = _check(plan(module))
  ops = {buf.op: buf for buf in p.buffers}
  assert "all_reduce" in ops and ops["all_reduce"].first == names.index("all_reduce"), sorted(ops)
