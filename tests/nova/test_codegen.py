"""CPU code generation and the whole pipeline: compiled graphs compute what eager blutrain computes."""
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, strategies as st

import blutrain as bt
from blutrain import dtypes
from blutrain.nova import codegen, ir
from blutrain.nova.graph import Equation, Value, literal
from blutrain.nova.pipeline import compile_graph
from tests.nova.graphs import Builder, evaluate, every_op, gpt_like


def assert_same(got, want, exact=True):
  assert len(got) == len(want)
  for i, (a, b) in enumerate(zip(got, want)):
    assert isinstance(a, np.ndarray), f"output {i} is a {type(a).__name__}"
    assert (a.shape, a.dtype) == (b.shape, b.dtype), f"output {i}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if exact: np.testing.assert_array_equal(a64, b64, err_msg=f"output {i}")
    else: np.testing.assert_allclose(a64, b64, rtol=1e-5, atol=1e-6, err_msg=f"output {i}")


def test_every_op_generated_equals_eager():
  graph, arrays = every_op()
  fn = codegen.load(codegen.generate(ir.to_module(graph)))
  assert_same(fn(*arrays), evaluate(graph, arrays))


def test_every_op_compiled_equals_eager():
  graph, arrays = every_op()
  compiled = compile_graph(graph, verify=True)
  assert_same(compiled.fn(*arrays), evaluate(graph, arrays))
  assert sum(compiled.counts_after.values()) < sum(compiled.counts_before.values())
  assert set(compiled.timings) == {"build", "optimize", "remat", "fuse", "plan", "codegen", "load"}


def test_gpt_compiled_equals_eager(tmp_path, monkeypatch):
  graph, _ = gpt_like(2)
  rs = np.random.default_rng(1)
  arrays = [rs.integers(0, 32, v.shape) if v.dtype is dtypes.int64 else rs.standard_normal(v.shape).astype(np.float32)
            for v in graph.inputs]
  monkeypatch.setenv("BLUTRAIN_DUMP_IR", str(tmp_path))
  compiled = compile_graph(graph)
  assert_same(compiled.fn(*arrays), evaluate(graph, arrays), exact=False)
  files = sorted(p.name for p in tmp_path.iterdir())
  assert files == ["00-captured.mlir", "01-canonicalize.mlir", "02-fold.mlir", "03-fuse-casts.mlir", "04-fuse-gemm.mlir",
                   "05-cse.mlir", "06-dce.mlir", "07-remat.mlir", "08-fuse-norms.mlir", "09-fuse-pointwise.mlir",
                   "memory-plan.txt", "remat.txt", "step.py"]
  assert (tmp_path / "step.py").read_text() == compiled.source
  assert compiled.counts_after["arange"] == 1, "cse keeps one arange of each kind"


def test_random_ops_follow_the_capture_convention():
  """The compiled draw at offset k of a state (seed, base) is eager's draw from a generator at (seed, base + k)."""
  b = Builder()
  rng = b.rng()
  graph = b.output(b("randn", rng, shape=(3, 5), dtype=dtypes.float32, offset=7),
                   b("bernoulli", rng, shape=(4,), dtype=dtypes.bool_, offset=22, p=0.25))
  fn = compile_graph(graph).fn
  normal, mask = fn(np.array([2024, 100], np.int64))
  gen = bt.Generator().manual_seed(2024)
  gen.offset = 107
  np.testing.assert_array_equal(normal, bt.randn(3, 5, generator=gen).numpy())
  gen.offset = 122
  np.testing.assert_array_equal(mask, bt.ops.bernoulli_mask((4,), 0.25, generator=gen).numpy())


def test_dead_values_are_freed():
  """A chain of n ops keeps two arrays alive at a time, not n."""
  b = Builder()
  x = b.input((256, 1024))
  y = x
  for _ in range(12): y = b("exp", b("neg", y))
  graph = b.output(y)
  source = codegen.generate(ir.to_module(graph))
  assert "  del a0\n" in source and source.count("del ") == 24
  fn = codegen.load(source)
  arg = np.zeros((256, 1024), np.float32)
  tracemalloc.start()
  fn(arg)
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  assert peak < 3.5 * arg.nbytes, f"peak {peak / arg.nbytes:.1f} arrays"


def test_outputs_may_be_inputs_and_unused_values_go():
  b = Builder()
  x, y = b.input((2,)), b.input((2,))
  b("exp", x)
  graph = b.output(y, b("add", x, y))
  source = codegen.generate(ir.to_module(graph))
  assert "return (a1, v3)" in source and "del v2" in source
  x_arr, y_arr = np.ones(2, np.float32), np.arange(2, dtype=np.float32)
  out = codegen.load(source)(x_arr, y_arr)
  assert out[0] is y_arr and np.array_equal(out[1], x_arr + y_arr)


def test_to_device_is_rejected():
  b = Builder()
  x = b.input((2,))
  b.graph.equations.append(Equation("to_device", [x], {"device": "cuda:0"}, [Value(1, (2,), dtypes.float32)]))
  b.graph.outputs.extend(b.graph.equations[-1].outs)
  with pytest.raises(ValueError, match="to_device"):
    compile_graph(b.graph)


def test_literals_round_trip():
  for v in (float("inf"), float("-inf"), -0.0, 0.1, (1,), (), ((0, 3, 1),), "tanh", None, True, dtypes.bool_,
            dtypes.bfloat16):
    got = eval(literal(v), {"dtypes": dtypes})
    assert got is v or got == v and str(got) == str(v)
  assert np.isnan(eval(literal(float("nan"))))


# *** random chains (hypothesis) ***

UNARY = ("neg", "exp", "tanh", "sigmoid", "relu", "abs", "sin", "erf", "copy")
BINARY = ("add", "sub", "mul", "maximum", "minimum")


@st.composite
def chains(draw):
  """A graph of 1-8 steps on a 2-D float32 value: elementwise ops with inputs, splats (broadcast or not), identities
  that the passes remove, reductions, views, transposes, casts and matmuls."""
  m, n = draw(st.integers(1, 4)), draw(st.integers(1, 4))
  b = Builder()
  x = b.input((m, n))
  outputs = []
  for _ in range(draw(st.integers(1, 8))):
    kind = draw(st.sampled_from(["unary", "binary", "splat", "identity", "reduce", "view", "permute", "cast", "matmul",
                                 "expand"]))
    shape = x.shape
    if kind == "unary": x = b(draw(st.sampled_from(UNARY)), x)
    elif kind == "binary":
      other = b.input(draw(st.sampled_from([shape, shape[-1:], ()])))
      x = b(draw(st.sampled_from(BINARY)), *draw(st.permutations([x, other])))
    elif kind == "splat":
      c = b.full(draw(st.sampled_from([(), shape[-1:], shape])), draw(st.sampled_from([0.5, 2.0, -1.0])))
      x = b(draw(st.sampled_from(BINARY)), x, b("exp", c) if draw(st.booleans()) else c)
    elif kind == "identity":
      op, value = draw(st.sampled_from([("mul", 1.0), ("add", 0.0), ("sub", 0.0), ("div", 1.0)]))
      x = b(op, x, b.full((), value))
    elif kind == "reduce" and len(shape) == 2:
      op = draw(st.sampled_from(["sum", "amax", "amin"]))
      attrs = {"dtype": dtypes.float32} if op == "sum" else {}
      x = b(op, x, dims=(draw(st.integers(0, 1)),), keepdim=True, **attrs)
    elif kind == "view": x = b("view", b("view", x, shape=(int(np.prod(shape)),)), shape=shape[::-1])
    elif kind == "permute" and len(shape) == 2:
      for _ in range(draw(st.integers(1, 3))): x = b("permute", x, dims=(1, 0))
    elif kind == "cast":
      x = b("cast", b("cast", x, dtype=draw(st.sampled_from([dtypes.float64, dtypes.float16]))), dtype=dtypes.float32)
    elif kind == "matmul" and len(shape) == 2: x = b("matmul", x, b.input((shape[1], draw(st.integers(1, 3)))))
    elif kind == "expand" and len(shape) == 2:
      x = b("expand", b("view", x, shape=(1, *shape)), shape=(2, *shape))
      x = b("sum", x, dims=(0,), keepdim=False, dtype=dtypes.float32)
    if draw(st.booleans()): outputs.append(x)
  return b.output(*outputs, x)


@given(chains(), st.integers(0, 2**16))
def test_random_chains_compiled_equal_eager(graph, seed):
  rs = np.random.default_rng(seed)
  arrays = [rs.standard_normal(v.shape).astype(np.float32) for v in graph.inputs]
  compiled = compile_graph(graph, verify=True)
  assert_same(compiled.fn(*arrays), evaluate(graph, arrays))
