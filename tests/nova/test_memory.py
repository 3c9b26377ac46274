"""Nova's static memory plan: no two buffers that are alive at one op share memory, the arena is never below the
live peak and close to it, views and graph inputs take no arena memory, returned values live to the end."""
import numpy as np
import pytest

import blutrain as bt
from blutrain.models import GPT, GPTConfig
from blutrain.nova import codegen, ir
from blutrain.nova.dialect import LayoutOp
from blutrain import dtypes
from blutrain.nova.memory import ALIGN, joins, plan, reused_in_place
from blutrain.nova.pipeline import compile_graph, optimize
from tests.nova.graphs import Builder, every_op, gpt_like


def _check(p):
  """The plan's invariants; returns it. A part of a cat's buffer lies inside it, within its lifetime; the buffers
  that are not parts never overlap in memory and in time."""
  hosts = {b.name: b for b in p.buffers if b.inside is None}
  for b in p.buffers:
    assert b.offset >= 0 and b.offset % ALIGN == 0 and b.nbytes % ALIGN == 0 and b.first <= b.last
    assert b.offset + b.nbytes <= p.arena
    if b.inside is not None:
      host = hosts[b.inside[0]]
      assert b.offset == host.offset + b.inside[1] and b.offset + b.nbytes <= host.offset + host.nbytes
      assert host.first <= b.first and b.last == host.allocated_at <= host.last
  parts = sorted((b for b in p.buffers if b.inside is not None), key=lambda b: b.offset)
  assert all(a.offset + a.nbytes <= c.offset for a, c in zip(parts, parts[1:]))
  by_offset = sorted(hosts.values(), key=lambda b: b.offset)
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
  assert sum(len(buf.op.split(" > ")) for buf in p.buffers) == made, \
    "every result of an op that is not a view has a buffer, its own or one it writes in place"


def test_a_chain_runs_in_place_in_one_buffer():
  b = Builder()
  x = b.input((64, 64))
  y = x
  for _ in range(6): y = b("exp", y)  # each result is read once, by the next op: it may write in place
  p = _check(plan(ir.to_module(b.output(y))))
  size = 64 * 64 * 4
  assert len(p.buffers) == 1 and p.arena == p.lower_bound == size
  assert p.buffers[0].op == " > ".join(["exp"] * 6)


def test_in_place_needs_a_last_read_of_an_unviewed_buffer_of_equal_size():
  b = Builder()
  x = b.input((8, 8))
  e = b("exp", x)               # x is a graph input: e gets a buffer of its own
  t = b("permute", e, dims=(1, 0))
  s = b("sin", t)               # reads e through a view: not in place
  c = b("cos", e)               # e's last read, but e is read again below: not in place
  w = b("add", c, e)            # e's last read and c's last read: writes into c's buffer (the first operand)
  m = b("sum", w, dims=(0,), keepdim=False, dtype=None)  # not elementwise
  p = _check(plan(ir.to_module(b.output(s, m))))
  assert sorted(buf.op for buf in p.buffers) == ["cos > add", "exp", "sin", "sum"]


def test_a_cat_computes_its_qualifying_operands_in_its_own_buffer():
  """As a data-parallel bucket of gradients: single-result ops whose results are only read by the cat (through a
  flattening view or not) are planned inside the cat's buffer, from the first of them on; an operand read again
  later, one of a multi-result op and one that does not end on ALIGN bytes are copied by the cat."""
  b = Builder()
  x = b.input((4, 32))
  e = b("exp", x)                                   # 512 bytes: a part, through a view
  s = b("sin", x)                                   # read again after the cat: copied
  c = b("cos", b.input((128,)))                      # a part
  odd = b("exp", b.input((3,)))                     # 12 bytes: copied
  cat = b("cat", b("view", e, shape=(128,)), b("view", s, shape=(128,)), c, odd, dim=0)
  out = b("add", b("sum", cat, dims=(0,), keepdim=False, dtype=None), b("sum", s, dims=(0, 1), keepdim=False, dtype=None))
  p = _check(plan(ir.to_module(b.output(out))))
  host = next(buf for buf in p.buffers if buf.op == "cat")
  inside = sorted((buf.inside[1], buf.op) for buf in p.buffers if buf.inside is not None)
  assert inside == [(0, "exp"), (1024, "cos")], inside
  assert host.first == min(buf.first for buf in p.buffers if buf.inside is not None) < host.allocated_at


def test_compiled_cat_of_parts_equals_eager():
  """The plan's parts change where results live, never what the cat returns (CPU here; the GPU's kernel skips the
  copies of the inputs already in place: tests/cuda/test_compile.py)."""
  xs = [bt.randn(4, 32), bt.randn(128), bt.randn(3)]

  def f(a, c, d):
    e, s = a.exp(), a.sin()
    cat = bt.cat([e.reshape(-1), s.reshape(-1), c.cos(), d.exp()])
    return cat * 2, s.sum()
  got, want = bt.compile(f), f
  for _ in range(3): out = got(*xs)
  for g, w in zip(out, want(*xs)): np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6)


def test_cross_entropy_backward_writes_the_gradient_over_its_logits():
  """The logits (viewed as (N, C)) are read for the last time by the backward, which reads each row whole before
  writing it: the gradient takes their buffer, and the CUDA code writes it there (`out=` the view)."""
  b = Builder()
  h, w = b.input((2, 8, 16)), b.input((16, 64))
  logits = b("matmul", h, w)
  flat = b("view", logits, shape=(16, 64))
  t = b.input((16,), dtypes.int64)
  loss = b("cross_entropy", flat, t, ignore_index=-1)
  g = b("cross_entropy_backward", b("exp", loss), flat, t, ignore_index=-1)
  module = ir.to_module(b.output(b("sum", g, dims=(0,), keepdim=False, dtype=None)))
  p = _check(plan(module))
  assert any(buf.op == "matmul > cross_entropy_backward" for buf in p.buffers), p.report()
  source = codegen.generate(module, target="cuda", in_place=reused_in_place(module), plan=p)
  line = next(ln for ln in source.splitlines() if "cross_entropy_backward" in ln)
  assert line.split("out=")[1].rstrip(")") == line.split("(")[1].split(", ")[1], line


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


def _compiled_gpt_step(tmp_path, monkeypatch, dump_ir=None):
  """A small GPT's training step compiled and run twice (so it is captured), and the model."""
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))
  bt.manual_seed(0)
  model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
  opt = model.configure_optimizers(0.1, 1e-3)

  def step(x, y):
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss
  compiled = bt.compile(step, dump_ir=dump_ir)
  x, y = (bt.from_numpy(np.random.default_rng(i).integers(0, 64, (2, 16))) for i in range(2))
  for _ in range(2): compiled(x, y)
  return compiled, model


def test_a_compiled_training_step_reports_and_dumps_its_plan(tmp_path, monkeypatch):
  step, _ = _compiled_gpt_step(tmp_path, monkeypatch, dump_ir=str(tmp_path / "ir"))
  info = step.info
  assert 0 < info["live_peak_bytes"] <= info["arena_bytes"] <= 1.3 * info["live_peak_bytes"], info
  report = next((tmp_path / "ir" / info["key"]).rglob("memory-plan.txt")).read_text()  # the steady graph's
  assert report.startswith(f"arena {info['arena_bytes']} bytes")


def test_compile_graph_carries_the_plan():
  compiled = compile_graph(gpt_like(n_layer=2)[0])
  assert compiled.memory.arena >= compiled.memory.lower_bound > 0 and "plan" in compiled.timings


def test_updates_of_inputs_take_the_inputs_memory():
  """A step's in-place updates (new values written back to their inputs) need no arena buffer when the op reads the
  input for the last time, element by element; otherwise they keep one."""
  b = Builder()
  p, g = b.input((32, 32)), b.input((32, 32))
  new_p = b("sub", p, g)          # the update of p, written back into p...
  other = b("exp", p)             # ...but p's old value is read after it: sub needs a buffer of its own
  kept = b("mul", other, g)       # (in place on exp's buffer)
  module = ir.to_module(b.output(new_p, kept))
  assert len(plan(module).buffers) == len(_check(plan(module, written={0: 0})).buffers) == 2
  b2 = Builder()
  p2, g2 = b2.input((32, 32)), b2.input((32, 32))
  keep = b2("exp", p2)
  new_p2 = b2("sub", p2, g2)      # p's last read: sub may write into p
  module2 = ir.to_module(b2.output(new_p2, keep))
  assert len(plan(module2).buffers) == 2 and len(_check(plan(module2, written={0: 0})).buffers) == 1


def test_sgd_updates_parameters_and_momentum_buffers_where_they_live():
  """The sgd op's new parameters and buffers, written back to their inputs, take the inputs' memory and no arena: the
  CUDA code hands the kernel those inputs as `out`."""
  from blutrain.nova.memory import updated_in_place
  b = Builder()
  p, g, buf, lr = b.input((64, 32)), b.input((64, 32)), b.input((64, 32)), b.input((), dtypes.float64)
  outs = b("sgd", p, g, buf, lr, n=1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
           is_first_step=False)
  module = ir.to_module(b.output(*outs))
  written = {0: 0, 1: 2}
  updated = updated_in_place(module, written)
  assert list(updated.values()) == [ir.function(module).body.block.args[i] for i in (0, 2)]
  assert plan(module, written=written).arena == 0 and _check(plan(module)).arena >= 2 * 64 * 32 * 4
  source = codegen.generate(module, target="cuda", in_place=updated, plan=plan(module, written))
  assert 'kernels["sgd"](' in source and "out=(a0, a2,)" in source, source


def test_a_training_step_updates_parameters_and_moments_where_they_live(tmp_path, monkeypatch):
  compiled, model = _compiled_gpt_step(tmp_path, monkeypatch)
  state = sum(p.numel() * 4 for p in model.parameters()) * 3  # new parameters, exp_avg, exp_avg_sq
  assert compiled.info["arena_bytes"] < state, "the optimizer's results take no arena memory of their own"


def _collective_then_compute():
  """x = exp(a); r = all_reduce(x); independent work on c; then r is read: the all-reduce's join is that read."""
  b = Builder()
  a, c = b.input((256, 256)), b.input((256, 256))
  x = b("exp", a)
  r = b("all_reduce", x, reduce_op="sum", group=0, size=1)
  y = c
  for _ in range(3): y = b("exp", y)
  return b.output(b("add", b("view", r, shape=(256, 256)), y))


def test_a_collective_reads_its_input_until_its_result_is_read():
  module = ir.to_module(_collective_then_compute())
  ops = list(ir.function(module).body.block.ops)
  names = [op.name for op in ops]
  reduce_at, add_at = names.index("nova.all_reduce"), names.index("nova.add")
  assert joins(ops) == {reduce_at: add_at}
  p = _check(plan(module))
  (x,) = [b for b in p.buffers if b.first == reduce_at - 1]
  assert x.last == add_at, "the all-reduce may still read x until the add waits for it"


def test_cuda_code_runs_a_collective_overlapped_and_joins_before_its_first_reader():
  module = ir.to_module(_collective_then_compute())
  lines = codegen.generate(module, target="cuda").splitlines()
  (start,) = [i for i, s in enumerate(lines) if "with overlapped() as" in s]
  event = lines[start].split(" as ")[1].rstrip(":")
  assert 'kernels["all_reduce"]' in lines[start + 1] and lines[start + 1].startswith("    ")
  (joined,) = [i for i, s in enumerate(lines) if s.strip() == f"join({event})"]
  assert 'kernels["add"]' in lines[joined + 1], "the join comes right before the first op that reads the result"
  x = lines[start + 1].split("(")[1].split(",")[0]
  (deleted,) = [i for i, s in enumerate(lines) if s.strip().startswith("del ") and x in s.strip()[4:].split(", ")]
  assert deleted > joined, "the collective's input outlives the join"
  assert "overlapped" not in codegen.generate(module, target="cpu")
