"""Synthesized kernels of fused pointwise groups on a real GPU: each layout kind (flat, broadcast, transposed, 0-d,
a host scalar by value) and dtype (float32, bfloat16, bool results) against float64 numpy; identical groups launch
one kernel; a compiled GPT step with fusion equals the same step without it."""
import numpy as np
import pytest

import blutrain as bt
from blutrain import dtypes
from blutrain.backend import cuda
from blutrain.models import GPT, GPTConfig
from blutrain.nova import codegen, ir, synth
from blutrain.nova.dialect import FusedOp
from blutrain.nova.passes.fuse_pointwise import fuse
from tests.nova.graphs import Builder, evaluate

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))


def _group(dt):
  b = Builder()
  x, bias, s = b.input((6, 40), dt), b.input((40,), dt), b.input((), dt)
  h = b("add", x, bias)
  y = b("mul", b("sigmoid", h), b("exp", b("div", h, s)))
  pos = b("gt", y, b.full((), 0.5, dt))
  return b.output(h, b("where", pos, y, b("rsqrt", b("add", b("abs", h), b.full((), 1.0, dt)))), pos)


@pytest.mark.parametrize("dt", [dtypes.float32, dtypes.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "host_scalar"])
def test_fused_kernel_equals_float64(dt, layout):
  graph = _group(dt)
  module = ir.to_module(graph)
  assert fuse(module) == 1
  op = next(o for o in ir.function(module).body.block.ops if isinstance(o, FusedOp))
  rng = np.random.default_rng(0)
  arrays = [rng.standard_normal(v.shape) + 2.0 * (i == 2) for i, v in enumerate(graph.inputs)]
  xs = []
  for i, (v, a) in enumerate(zip(graph.inputs, arrays)):
    a = np.asarray(a, v.dtype.np)
    if layout == "transposed" and i == 0:
      t = cuda.from_numpy(np.ascontiguousarray(a.T))
      xs.append(type(t)(t.ptr, a.shape, t.strides[::-1], t.dtype, t.device, t.owner))  # a's values, strided
    elif layout == "host_scalar" and i == 2: xs.append(a)
    else: xs.append(cuda.from_numpy(a))
  outs = synth.fused(codegen.body_of(op), (6, 40), *xs)
  want = evaluate(_group(dtypes.float64), [np.asarray(np.asarray(a, dt.np), np.float64) for a in arrays])
  tol = 2e-2 if dt is dtypes.bfloat16 else 2e-6
  returned = list(list(ir.function(module).body.block.ops)[-1].operands)
  assert sorted(returned.index(r) for r in op.results) == [0, 1, 2]
  for got, r in zip(outs, op.results):  # the group's results in its own order, each one of the graph's outputs
    w = want[returned.index(r)]
    got = cuda.to_numpy(got).astype(np.float64)
    if w.dtype == bool: assert (got != w).mean() < 0.02  # a comparison near its threshold may flip once rounded
    else: np.testing.assert_allclose(got, w, rtol=tol, atol=tol)


def test_identical_groups_share_one_kernel():
  b = Builder()
  xs = [b.input((64, 32)) for _ in range(3)]
  b.output(*[b("mul", b("tanh", x), b("exp", x)) for x in xs])
  module = ir.to_module(b.graph)
  assert fuse(module) == 3
  assert len(codegen.specs(module)) == 1


@pytest.mark.parametrize("autocast", [False, True])
def test_gpt_step_with_fusion_equals_without(autocast, monkeypatch):
  losses = {}
  for fuse_on in ("1", "0"):
    monkeypatch.setenv("BLUTRAIN_NOVA_FUSE", fuse_on)
    bt.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=64)).to("cuda")
    opt = model.configure_optimizers(0.1, 1e-3, fused=True)

    def step(x, y):
      with bt.autocast("cuda", dtype=bt.bfloat16, enabled=autocast):
        _, loss = model(x, y)
      loss.backward()
      opt.step()
      opt.zero_grad(set_to_none=True)
      return loss

    compiled = bt.compile(step)
    x = bt.randint(96, (4, 32)).to("cuda")
    losses[fuse_on] = [compiled(x, x).item() for _ in range(4)]
  np.testing.assert_allclose(losses["1"], losses["0"], rtol=2e-2 if autocast else 1e-5)
