"""Structural hashing: invariant under value names, input identity and the order of independent equations;
sensitive to operand order, attributes and types; stable across processes; equal for identical blocks."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blutrain import dtypes
from blutrain.nova.graph import Equation, Graph, Value
from blutrain.nova.hashing import FORMAT_VERSION, graph_key, subgraph_hash, value_hashes
from tests.nova.graphs import Builder, gpt_like


def renamed(graph: Graph, order=None, start: int = 1000) -> Graph:
  """A copy with fresh Value objects and ids (counting down from `start`), equations in `order`."""
  new: dict[Value, Value] = {}

  def fresh(v: Value) -> Value:
    new[v] = Value(start - len(new), v.shape, v.dtype)
    return new[v]

  inputs = [fresh(v) for v in graph.inputs]
  eqs = [graph.equations[i] for i in (order or range(len(graph.equations)))]
  equations = [Equation(eq.op, [None if v is None else new[v] for v in eq.inputs], dict(eq.attrs),
                        [None if v is None else fresh(v) for v in eq.outs]) for eq in eqs]
  return Graph(inputs, equations, [new[v] for v in graph.outputs])


def small(op="sub", swap=False, attrs=None, dtype=dtypes.float32, value=2.0) -> Graph:
  b = Builder()
  x, y = b.input((4, 3), dtype), b.input((3,), dtype)
  a = b("exp", x)
  c = b("mul", y, b.full((), value, dtype))
  d = b(op, c, a) if swap else b(op, a, c)
  return b.output(b("sum", d, **(attrs or {"dims": (0,), "keepdim": False, "dtype": dtype})))


def test_renaming_and_reordering_keep_the_hash():
  g = small()
  assert graph_key(renamed(g)) == graph_key(g)
  # exp(x) and the splat/mul chain are independent: run the chain first
  assert graph_key(renamed(g, order=[1, 2, 0, 3, 4])) == graph_key(g)
  g2 = renamed(g)
  h, h2 = value_hashes(g), value_hashes(g2)
  assert [h[v] for eq in g.equations for v in eq.outs] == [h2[v] for eq in g2.equations for v in eq.outs]


@pytest.mark.parametrize("other", [
  lambda: small(swap=True),                                                       # sub(a, c) vs sub(c, a)
  lambda: small(op="add"),
  lambda: small(attrs={"dims": (0,), "keepdim": True, "dtype": dtypes.float32}),
  lambda: small(attrs={"dims": (0,), "keepdim": False, "dtype": dtypes.float64}),
  lambda: small(dtype=dtypes.bfloat16),
  lambda: small(value=2),                                                         # 2 vs 2.0
  lambda: small(value=-0.0), lambda: small(value=0.0),
])
def test_differences_change_the_hash(other):
  assert graph_key(other()) != graph_key(small())


def test_add_is_not_assumed_commutative():
  assert graph_key(small(op="add", swap=True)) != graph_key(small(op="add"))


def test_inputs_are_hashed_by_position():
  b = Builder()
  x, y = b.input((3,)), b.input((3,))
  g1 = b.output(b("sub", x, y))
  b = Builder()
  x, y = b.input((3,)), b.input((3,))
  g2 = b.output(b("sub", y, x))
  assert graph_key(g1) != graph_key(g2)
  key = graph_key(g1)
  g1.inputs.append(Value(99, (5,), dtypes.int64))  # an unused input still changes the calling convention
  assert graph_key(g1) != key


def test_each_result_of_an_op_hashes_with_its_index():
  def scaled(pick: int) -> Graph:
    b = Builder()
    x, s = b.input((4,)), b.input(())
    results = b("scale", x, x, s)
    return b.output(results[pick])
  g = scaled(0)
  first, second = (value_hashes(g)[v] for v in g.equations[0].outs)
  assert first != second, "two results of one op, of one type"
  assert graph_key(scaled(0)) == graph_key(renamed(scaled(0))) != graph_key(scaled(1))


def test_stable_across_processes():
  code = ("from tests.nova.graphs import gpt_like; from blutrain.nova.hashing import graph_key; "
          "print(graph_key(gpt_like(1)[0]))")
  env = dict(os.environ, PYTHONHASHSEED="12345")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  assert out.stdout.strip() == graph_key(gpt_like(1)[0])
  assert isinstance(FORMAT_VERSION, int)


def test_transformer_blocks_hash_equal():
  g1, blocks1 = gpt_like(3)
  g2, blocks2 = gpt_like(3)
  keys = [subgraph_hash(g, [out], [x, *params]) for g, blocks in ((g1, blocks1), (g2, blocks2))
          for x, params, out in blocks]
  assert len(set(keys)) == 1
  wide, wider = gpt_like(1, C=32)
  x, params, out = wider[0]
  assert subgraph_hash(wide, [out], [x, *params]) != keys[0]
  assert graph_key(g1) == graph_key(g2)


def test_subgraph_hash_names_a_missing_input():
  g, blocks = gpt_like(1)
  x, params, out = blocks[0]
  with pytest.raises(ValueError, match=r"depends on %\d+:float32\[16\], which is neither among the inputs"):
    subgraph_hash(g, [out], [x, *params[1:]])


def test_the_disk_cache_is_keyed_by_the_package_source(tmp_path, monkeypatch):
  """Generated code from another version of blutrain (here: a file in another version's directory) is never loaded."""
  jit = importlib.import_module("blutrain.nova.jit")
  from blutrain.nova.hashing import source_digest
  from tests.nova.graphs import Builder
  b = Builder()
  graph = b.output(b("exp", b.input((3,))))
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path))
  _, info = jit.build(graph, None)
  path = info["source"]
  assert info["cache"] == "miss" and f"v{FORMAT_VERSION}-{source_digest()}" in path
  other = path.replace(source_digest(), "0" * 16)
  Path(other).parent.mkdir(parents=True)
  Path(other).write_text("raise SystemExit('another version')\n")
  assert jit.build(graph, None)[1]["cache"] == "hit"
  assert source_digest() == source_digest() and len(source_digest()) == 16
