"""Nova's static memory plan: no two buffers that are alive at one op share memory, the arena is never below the
live peak and close to it, views and graph inputs take no arena memory, returned values live to the end."""
import numpy as np
import pytest

import blutrain as bt
from blutrain.models import GPT, GPTConfig
from blutrain.nova import ir
from blutrain.nova.dialect import LayoutOp
from blutrain.nova.memory import ALIGN, plan
from blutrain.nova.pipeline import compile_graph, optimize
from tests.nova.graphs import Builder, every_op, gpt_like


def _check(p):
  """The plan's invariants; returns it."""
  for b in p.buffers:
    assert b.offset >= 0 and b.offset % ALIGN == 0 and b.nbytes % ALIGN == 0 and b.first <= b.last
    assert b.offset + b.nbytes <= p.arena
  by_offset = sorted(p.buffers, key=lambda b: b.offset)
  for i, a in enumerate(by_offset):
    for c in by_offset[i + 1:]:
      if c.offset >= a.offset + a.nbytes: break
      assert not a.meets(c), f"{a} and {c} overlap in memory and in time"
  assert p.arena >= p.lower_bound > 0
  return p


@pytest.mark.parametrize("make", [lambda: gpt_like(n_layer=3)[0], lambda: every_op()[0]], ids=["gpt_like", "every_op"])
def test_no_two_live_buffers_share_memory(make):
  module = optimize(ir.to_module(make()))
  p = _check(plan(module))
  ops = list(ir.function(module).body.block.ops)
  made = sum(len(op.results) for op in ops if op.name.startswith("nova.") and not isinstance(op, LayoutOp))
  assert len(p.buffers) == made, "one buffer per result of an op that is not a view"


def test_a_chain_ping_pongs_between_two_buffers():
  b = Builder()
  x = b.input((64, 64))
  y = x
  for _ in range(6): y = b("exp", y)  # each result dies at the next op: two buffers suffice
  p = _check(plan(ir.to_module(b.output(y))))
  size = 64 * 64 * 4
  assert len(p.buffers) == 6 and p.lower_bound == 2 * size and p.arena == 2 * size


def test_views_stretch_their_source_and_returns_live_to_the_end():
  b = Builder()
  x = b.input((8, 8))
  e = b("exp", x)
  t = b("permute", e, dims=(1, 0))  # a view of e: e must live while t is read
  s = b("sin", x)
  out = b("add", t, s)
  p = plan(ir.to_module(b.output(out, s)))
  exp, sin, add = (next(buf for buf in p.buffers if buf.op == name) for name in ("exp", "sin", "add"))
  assert exp.last == add.first, "the permute's read at add keeps exp alive"
  assert sin.last == add.last == 4, "returned values live past the last op (positions 0-3, return at 4)"
  assert not exp.meets(sin) or exp.offset != sin.offset


def test_a_compiled_training_step_reports_and_dumps_its_plan(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))
  bt.manual_seed(0)
  model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
  opt = model.configure_optimizers(0.1, 1e-3)

  @bt.compile(dump_ir=str(tmp_path / "ir"))
  def step(x, y):
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss
  x, y = (bt.from_numpy(np.random.default_rng(i).integers(0, 64, (2, 16))) for i in range(2))
  for _ in range(2): step(x, y)
  info = step.info
  assert 0 < info["live_peak_bytes"] <= info["arena_bytes"] <= 1.3 * info["live_peak_bytes"], info
  report = next((tmp_path / "ir").rglob("memory-plan.txt")).read_text()
  assert report.startswith(f"arena {info['arena_bytes']} bytes")


def test_compile_graph_carries_the_plan():
  compiled = compile_graph(gpt_like(n_layer=2)[0])
  assert compiled.memory.arena >= compiled.memory.lower_bound > 0 and "plan" in compiled.timings
