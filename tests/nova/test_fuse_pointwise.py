"""Pointwise fusion and kernel synthesis without a GPU: which ops the pass groups (IR in, IR out), that the CPU runs
fused graphs as eagerly, that generated sources are deterministic and shared by identical groups, and that every
kernel of a GPT training step and of a gated-SiLU/RMSNorm model compiles for sm_90. The generated kernels' values
are checked against float64 numpy by Triton's interpreter (tests/nova/synth_interpret.py, in a process of its own)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from xdsl.utils.exceptions import VerifyException

import blutrain as bt
from blutrain import dtypes
from blutrain.backend.cuda import launch
from blutrain.nova import codegen, ir, synth
from blutrain.nova.dialect import FullOp, FusedOp, NovaOp
from blutrain.nova.passes.fuse_pointwise import MAX_INPUTS, MAX_MEMBERS, fuse
from blutrain.nova.pipeline import compile_graph
from tests.nova.graphs import Builder, evaluate
from tests.nova.test_codegen import assert_same

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))


def _fused(b: Builder):
  """The module of b's graph after the pass, and its top-level ops by name."""
  module = ir.to_module(b.graph)
  fuse(module)
  module.verify()
  ops = [op for op in ir.function(module).body.block.ops if isinstance(op, NovaOp)]
  return module, ops


def _body(op: FusedOp) -> list[str]:
  return [m.name[5:] for m in list(op.body.block.ops)[:-1]]


def test_a_chain_becomes_one_op_with_the_values_used_outside_as_results():
  b = Builder()
  x, bias, r = b.input((8, 32)), b.input((32,)), b.input((8, 32))
  h = b("add", x, bias)
  y = b("add", b("gelu", h, approximate="tanh"), r)
  b.output(h, y)
  module, ops = _fused(b)
  assert [op.opname for op in ops] == ["fused"]
  (f,) = ops
  assert _body(f) == ["add", "gelu", "add"]
  assert len(f.xs) == 3 and len(f.outs) == 2  # h is returned, so it is a result; the GELU stays in registers
  assert [v.owner for v in ir.function(module).body.block.last_op.operands] == [f, f]
  assert "nova.fused" in ir.print_module(module) and ir.parse_module(ir.print_module(module))


def test_nothing_crosses_a_reduction_and_a_value_read_before_stays_out():
  b = Builder()
  x = b.input((4, 16))
  e = b("mul", b("exp", x), b.full((), 2.0))
  s = b("sum", e, dims=(1,), keepdim=True, dtype=None)
  z = b("div", b("sub", e, s), s)  # reads e after the sum did: a group of its own
  b.output(z)
  _, ops = _fused(b)
  assert [op.opname for op in ops] == ["fused", "sum", "fused"]
  assert _body(ops[0]) == ["exp", "full", "mul"] and _body(ops[2]) == ["sub", "div"]
  assert not any(isinstance(op, FullOp) for op in ops), "a splat read only by a group goes into its body"


def test_groups_merge_through_a_shared_reader_and_shapes_stay_apart():
  b = Builder()
  x, y, v = b.input((4, 8)), b.input((4, 8)), b.input((8,))
  u = b("sqrt", b("abs", v))  # shape (8,): a group of its own, read by the (4, 8) group as a broadcast input
  c = b("add", b("exp", x), b("log", y))
  b.output(b("mul", c, u))
  _, ops = _fused(b)
  assert [op.opname for op in ops] == ["fused", "fused"]
  assert _body(ops[0]) == ["abs", "sqrt"] and _body(ops[1]) == ["exp", "log", "add", "mul"]


@pytest.mark.parametrize("breaker", ["expand", "view", "bernoulli", "matmul"])
def test_views_random_draws_and_other_ops_are_boundaries(breaker):
  b = Builder()
  x = b.input((4, 4))
  h = b("neg", x)
  if breaker == "expand": h = b("expand", b("sum", h, dims=(0,), keepdim=True, dtype=None), shape=(4, 4))
  elif breaker == "view": h = b("view", h, shape=(4, 4))
  elif breaker == "bernoulli": h = b("mul", h, b("bernoulli", b.rng(), shape=(4, 4), dtype=dtypes.float32, p=0.5,
                                                 offset=0))
  else: h = b("matmul", h, x)
  b.output(b("tanh", h))
  _, ops = _fused(b)
  if breaker == "bernoulli":  # a draw is an input of the group, never a member
    assert [op.opname for op in ops] == ["bernoulli", "fused"] and _body(ops[1]) == ["neg", "mul", "tanh"]
  else: assert "fused" not in [op.opname for op in ops], "neg and tanh stay apart: groups of one stay as they are"


def test_a_group_of_one_stays():
  b = Builder()
  x = b.input((3,))
  b.output(b("mul", x, b.full((), 3.0)))
  _, ops = _fused(b)
  assert [op.opname for op in ops] == ["full", "mul"]


def test_a_long_sum_splits_into_groups_within_the_kernel_limits():
  # an LSTM's weight gradient: one addend per time step; its one kernel of 256 inputs took 28 s to compile
  b = Builder()
  xs = [b.input((4, 8)) for _ in range(3 * MAX_INPUTS + 5)]
  total = xs[0]
  for x in xs[1:]: total = b("add", total, b("mul", x, b.full((), 0.5)))
  graph = b.output(total)
  module, ops = _fused(b)
  fused = [op for op in ops if op.opname == "fused"]
  assert len(fused) == 4 and [op.opname for op in ops].count("add") + [op.opname for op in ops].count("mul") == 0
  assert all(len(f.xs) <= MAX_INPUTS and len([m for m in _body(f) if m != "full"]) <= MAX_MEMBERS for f in fused)
  assert sum(len(f.xs) for f in fused) == len(xs) + len(fused) - 1  # each group reads the last one's partial sum
  rng = np.random.default_rng(1)
  arrays = [rng.standard_normal((4, 8)).astype(np.float32) for _ in xs]
  compiled = compile_graph(graph, verify=True)
  np.testing.assert_allclose(compiled.fn(*arrays)[0], arrays[0] + 0.5 * np.sum(arrays[1:], axis=0), rtol=1e-5, atol=1e-5)


def _mlp_graph(dtype=dtypes.float32):
  """A gated SiLU MLP's elementwise part with RMSNorm written as composites, in `dtype`."""
  b = Builder()
  x, w, g, u = b.input((4, 8, 16), dtype), b.input((16,), dtype), b.input((4, 8, 16), dtype), b.input((4, 8, 16), dtype)
  x32 = b("cast", x, dtype=dtypes.float32)
  ms = b("div", b("sum", b("mul", x32, x32), dims=(2,), keepdim=True, dtype=None), b.full((), 16.0))
  n = b("cast", b("mul", x32, b("rsqrt", b("add", ms, b.full((), 1e-6)))), dtype=dtype)
  normed = b("mul", n, w)
  act = b("mul", b("mul", g, b("sigmoid", g)), u)
  return b.output(normed, b("add", act, b("where", b("gt", x, b.full((), 0.0, dtype)), x, normed)))


@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.bfloat16])
def test_fused_graphs_compile_to_eager_on_the_cpu(dtype):
  graph = _mlp_graph(dtype)
  rng = np.random.default_rng(0)
  arrays = [rng.standard_normal(v.shape).astype(v.dtype.np) for v in graph.inputs]
  compiled = compile_graph(graph, verify=True)
  assert "fused" in [op.opname for op in ir.function(compiled.module).body.block.ops if isinstance(op, NovaOp)]
  assert_same(compiled.fn(*arrays), evaluate(graph, arrays))
  unfused = compile_graph(graph, fuse=False)
  assert "fused" not in unfused.source
  assert_same(compiled.fn(*arrays), unfused.fn(*arrays))


def test_a_gated_silu_rmsnorm_model_compiled_with_fusion_equals_eager(tmp_path, monkeypatch):
  from tests.nova.test_remat import _Llama
  from blutrain.train import training_step
  monkeypatch.setenv("BLUTRAIN_DUMP_IR", str(tmp_path))
  losses = []
  for compiled in (False, True):
    bt.manual_seed(0)
    model = _Llama()
    step = training_step(model, bt.optim.AdamW(model.parameters(), lr=1e-2))
    if compiled: step = bt.compile(step)
    x = bt.randint(48, (2, 16))
    losses.append([step(x, x).item() for _ in range(3)])
  assert "nova.fused" in next(tmp_path.rglob("*fuse-pointwise.mlir")).read_text()
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


def test_sources_are_deterministic_and_identical_groups_share_a_kernel():
  b = Builder()
  x = b.input((4, 32))
  for _ in range(3):  # three equal blocks, as a transformer's
    x = b("add", b("mul", b("tanh", x), b.full((), 0.5)), x)
    x = b("sum", x, dims=(1,), keepdim=True, dtype=None)
    x = b("expand", x, shape=(4, 32))
  b.output(x)
  module, ops = _fused(b)
  fused = [op for op in ops if isinstance(op, FusedOp)]
  assert len(fused) == 3
  bodies = {codegen.body_of(op) for op in fused}
  assert len(bodies) == 1 and len(codegen.specs(module)) == 1
  body = bodies.pop()
  variant = synth.Variant(2, ("strided:01",), False, True)
  assert synth.source(body, variant) == synth.source(codegen.body_of(fused[0]), variant)
  assert synth.key(body, variant) != synth.key(body, synth.Variant(1, ("flat",), False, True))
  assert synth.jit_function(body, variant) is synth.jit_function(codegen.body_of(fused[1]), variant)


def _gpt_step_modules(tmp_path, monkeypatch):
  """The fused modules of a GPT-2-shaped training step (2 of its 12 identical blocks, d=768, T=64) and of a
  gated-SiLU/RMSNorm model, as bt.compile dumps them on the CPU (the steady graphs, not the first calls')."""
  from blutrain.models import GPT, GPTConfig
  from blutrain.train import training_step
  from tests.nova.test_remat import _Llama
  monkeypatch.setenv("BLUTRAIN_DUMP_IR", str(tmp_path / "dump"))
  bt.manual_seed(0)
  gpt = GPT(GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=12, n_embd=768))
  llama = _Llama()
  keys = []
  for model, vocab in ((gpt, 512), (llama, 48)):
    step = bt.compile(training_step(model, bt.optim.AdamW(model.parameters(), lr=1e-3)))
    x = bt.randint(vocab, (1, 64 if model is gpt else 16))
    step(x, x)
    step(x, x)
    keys.append(step.info["key"])
  return [ir.parse_module(p.read_text())
          for k in keys for p in sorted((tmp_path / "dump" / k).rglob("*fuse-pointwise.mlir"))]


def test_every_kernel_of_a_gpt_and_a_gated_mlp_step_compiles_for_sm90(tmp_path, monkeypatch):
  modules = _gpt_step_modules(tmp_path, monkeypatch)
  assert len(modules) == 2
  specs, shared = {}, False
  for m in modules:
    n_fused = sum(isinstance(op, FusedOp) for op in ir.function(m).body.block.ops)
    found = codegen.specs(m)
    assert 0 < len(found) <= n_fused
    shared |= len(found) < n_fused  # identical groups (one per block) share one kernel
    specs.update(((s[0], tuple(s[1].items()), tuple(s[2].items())), s) for s in found)
  assert shared
  for s in specs.values():
    fn, sig, consts, opts = s
    assert launch.cubin(fn, sig, consts, opts["num_warps"], opts["num_stages"])[:4] == b"\x7fELF"
  assert sorted(p.name for p in (tmp_path / "dump").glob("fused_*.py")), "BLUTRAIN_DUMP_IR holds the sources"


def test_interpreted_kernels_equal_float64_numpy():
  env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
  out = subprocess.run([sys.executable, "-m", "tests.nova.synth_interpret"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "checked" in out.stdout


def test_a_compiled_gpt_step_launches_fewer_kernels_on_the_fake_gpu(tmp_path):
  """The host side of synthesized kernels (plans, argument packing, launches; Triton compiles for real) on the fake
  GPU: a GPT training step run kernel by kernel launches fewer kernels with fusion than without."""
  pytest.importorskip("cuda.core")
  from tests.test_cuda_host_paths import _run_fake
  code = f"""
import os
import blutrain as bt
from blutrain.models import GPT, GPTConfig
os.environ["BLUTRAIN_CUDA_GRAPHS"] = "0"
os.environ["BLUTRAIN_DUMP_IR"] = {str(tmp_path / "dump")!r}
def launches(fuse):
  os.environ["BLUTRAIN_NOVA_FUSE"] = fuse
  bt.manual_seed(0)
  model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=32)).to("cuda")
  opt = bt.optim.AdamW(model.parameters(), lr=1e-3)
  @bt.compile
  def step(x, y):
    _, loss = model(x, y)
    loss.backward()
    bt.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad()
    return loss
  x, y = (bt.randint(32, (2, 16)).to("cuda") for _ in range(2))
  for _ in range(3): step(x, y)
  before = fake_cuda.launches[0]
  step(x, y)
  return fake_cuda.launches[0] - before
print("launches", launches("1"), launches("0"))
"""
  fused, plain = map(int, _run_fake(code, tmp_path).split("launches")[1].split())
  assert fused < plain, (fused, plain)
  assert list((tmp_path / "dump").glob("fused_*.py")), "BLUTRAIN_DUMP_IR holds the synthesized sources"


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["cpu", "fake-gpu"])  # an id "cuda" would mark it a GPU test
def test_a_step_served_from_the_disk_cache_never_loads_the_compiler(device, tmp_path):
  """A second process whose step's code is cached runs it without importing xDSL, the dialect or the passes (their
  import is most of a warm first call); the first process compiles and fills the cache. "cuda" runs on the fake GPU
  and includes synthesized kernels."""
  pytest.importorskip("cuda.core")
  from tests.test_cuda_host_paths import _run_fake
  code = f"""
import os, sys
os.environ["BLUTRAIN_CACHE_DIR"] = {str(tmp_path / "cache")!r}
import blutrain as bt
from blutrain.models import GPT, GPTConfig
assert "xdsl" not in sys.modules
bt.manual_seed(0)
model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=32)).to({device!r})
opt = bt.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
@bt.compile
def step(x, y):
  with bt.autocast({device!r}, dtype=bt.bfloat16):
    _, loss = model(x, y)
  loss.backward()
  opt.step(); opt.zero_grad()
  return loss
x, y = (bt.randint(32, (2, 16)).to({device!r}) for _ in range(2))
for _ in range(3): step(x, y)
print("cache", step.info["cache"], "compiler", sorted({{m.split(".")[0] for m in sys.modules if m.startswith("xdsl")}}),
      "fused", "Body(" in open(step.info["source"]).read())
"""
  first = _run_fake(code, tmp_path).split("cache")[-1].split()
  second = _run_fake(code, tmp_path).split("cache")[-1].split()
  assert first[:3] == ["miss", "compiler", "['xdsl']"], first
  assert second[:3] == ["hit", "compiler", "[]"], second
  if device == "cuda": assert second[-1] == "True", "the cached step calls synthesized kernels"


def test_fused_results_take_the_buffers_of_inputs_read_for_the_last_time():
  from blutrain.nova import codegen, memory
  b = Builder()
  x, bias, r, w = b.input((8, 32)), b.input((32,)), b.input((8, 32)), b.input((32, 32))
  h = b("add", b("matmul", x, w), bias)
  y = b("add", b("gelu", h, approximate="tanh"), r)
  b.output(b("exp", h), b("mul", y, y))  # output 1 is r's new value
  module, _ = _fused(b)
  reused, updated = memory.reused_in_place(module), memory.updated_in_place(module, {1: 2})
  (f,) = [op for op in ir.function(module).body.block.ops if isinstance(op, FusedOp)]
  assert updated == {f.results[1]: ir.function(module).body.block.args[2]}  # r's new value, in r's memory
  assert list(reused) == [f.results[0]], "exp(h) takes the matmul's buffer"
  source = codegen.generate(module, target="cuda", in_place=reused | updated, plan=memory.plan(module, {1: 2}))
  assert "out=(v4, a2))" in source
  assert memory.plan(module, {1: 2}).arena == memory.ALIGN * 2  # the matmul's buffer only


_STEPS = ["tanh", "neg", "add", "mul", "sub", "maximum", "where", "sum", "matmul", "row"]


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_STEPS), st.integers(0, 10**6), st.integers(0, 10**6)), min_size=2,
                max_size=14))
def test_generated_graphs_fused_equal_unfused(steps):
  """Random DAGs of elementwise ops with reductions, matmuls and broadcasts between them: the fused module verifies,
  every group's readers come after it (codegen would fail on a name used before it is made) and the values are the
  unfused ones exactly."""
  b = Builder()
  values = [b.input((4, 8)), b.input((4, 8)), b.input((8,))]
  for name, i, j in steps:
    x, y = values[i % len(values)], values[j % len(values)]
    if name in ("tanh", "neg"): v = b(name, x)
    elif name == "sum": v = b("sum", x, dims=(len(x.shape) - 1,), keepdim=True, dtype=None)
    elif name == "matmul": v = b("matmul", x, b.input((x.shape[-1], 8))) if len(x.shape) == 2 else b("tanh", x)
    elif name == "row": v = b("mul", x, b.input((8,)))
    elif name == "where": v = b("where", b("gt", x, b.full((), 0.1)), x, y)
    else:
      if len(x.shape) < len(y.shape): x, y = y, x
      v = b(name, x, y)
    values.append(v)
  graph = b.output(*values[3:])
  arrays = [np.random.default_rng(0).standard_normal(v.shape).astype(np.float32) for v in graph.inputs]
  fused, plain = compile_graph(graph, verify=True), compile_graph(graph, fuse=False)
  assert_same(fused.fn(*arrays), plain.fn(*arrays))


_T, _V = "tensor<4x8xf32>", "tensor<8xf32>"


@pytest.mark.parametrize("body,expected", [
  (f"^bb0(%a: {_V}):\n  %b = nova.exp %a : ({_V}) -> {_V}\n  nova.yield %b : {_V}",
   f"nova.fused: the body's arguments ({_V}) do not match the operands ({_T})"),
  (f"^bb0(%a: {_T}):\n  %b = nova.sum %a {{dims = array<i64: 0>, keepdim = false}} : ({_T}) -> {_V}\n"
   f"  nova.yield %b : {_V}", "nova.fused: the body may hold only elementwise ops and splats, not ['nova.sum']"),
  (f"^bb0(%a: {_T}):\n  %b = nova.exp %a : ({_T}) -> {_T}\n  nova.yield %b : {_T}",
   f"nova.fused: the body yields ({_T}), but the results are ({_V})"),
])
def test_invalid_fused_ops_are_reported(body, expected):
  result = _V if "yields" in expected else _T
  text = (f"builtin.module {{\n  func.func @step(%0: {_T}) -> {result} {{\n"
          f"    %1 = nova.fused %0 : ({_T}) -> {result} {{\n{body}\n    }}\n    func.return %1 : {result}\n  }}\n}}")
  with pytest.raises(VerifyException, match=re.escape(expected)):
    ir.parse_module(text)


def test_host_scalar_transposed_and_64_bit_variants_compile_for_sm90():
  b = Builder()
  x, s, t = b.input((64, 48), dtypes.bfloat16), b.input((), dtypes.bfloat16), b.input((64, 48), dtypes.bfloat16)
  b.output(b("gt", b("add", b("mul", x, s), t), b.full((), 0.0, dtypes.bfloat16)))
  module, ops = _fused(b)
  body = codegen.body_of(ops[0])
  bf16 = dtypes.bfloat16
  plans = [synth.plan(body, (64, 48), [((64, 48), (48, 1), bf16, 0), None, ((64, 48), (1, 64), bf16, 0)]),
           synth.plan(body, (1 << 16, 1 << 15), [((1 << 16, 1 << 15), (1 << 15, 1), bf16, 0)] * 3)]
  for (fn, sig, consts, opts), grid, args, _ in plans:
    assert launch.cubin(fn, sig, consts, opts["num_warps"], opts["num_stages"])[:4] == b"\x7fELF"
  sig = plans[0][0][1]
  assert sig["i1"] == "fp32" and "s2_1" in sig and "s2_0" not in sig  # by value; t transposed: a unit stride in dim 0
  assert plans[0][2] == (64 * 48, 48, 64)  # n, the inner size, t's stride along it
  assert plans[1][0][1]["n"] == "i64" and plans[1][2] == (1 << 31,)


@pytest.mark.parametrize("n,itemsize,operands", [(1 << 24, 4, 2), (1 << 24, 4, 4), (1 << 24, 4, 5), (1 << 24, 2, 2),
                                                 (1 << 24, 2, 3), (1000, 4, 3), (1, 8, 9)])
def test_fused_schedule_keeps_registers_within_the_budget(n, itemsize, operands):
  from blutrain.configurator import FUSED_REGS, flat_schedule, fused_schedule
  block, warps = fused_schedule(n, itemsize, operands)
  per_thread = block // (32 * warps)
  assert block & (block - 1) == 0 and warps == flat_schedule(n, itemsize)[1]
  assert per_thread * operands <= FUSED_REGS or per_thread == 1
  assert per_thread * 2 * operands > FUSED_REGS or block == flat_schedule(n, itemsize)[0], "halved only as needed"
