"""Nova's memory on a real GPU: a compiled step that follows its memory plan, with remat by default, under a budget
that recomputes matmuls and with remat off, equals the eager step; the plan's peak is what the step holds; an
out-of-memory inside a compiled step under a small cap is the clear error, and training goes on after the cap is
raised."""
import numpy as np
import pytest

import blutrain as bt
from blutrain.backend.cuda.kernels.cublaslt import WORKSPACE
from blutrain.models import GPT, GPTConfig

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))
  yield
  bt.cuda.set_memory_limit(None)


def _train(compiled: bool, steps: int = 5, **kw):
  bt.manual_seed(0)
  model = GPT(GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=2, n_embd=64)).to("cuda")
  opt = model.configure_optimizers(0.1, 1e-3, fused=True)

  def step(x, y):
    _, loss = model(x, y)
    loss.backward()
    bt.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss
  if compiled: step = bt.compile(step, **kw)
  rng = np.random.default_rng(1)
  losses = []
  for _ in range(steps):
    x, y = (bt.from_numpy(rng.integers(0, 96, (4, 64))).to("cuda") for _ in range(2))
    losses.append(step(x, y).item())
  return losses, {n: p.detach().numpy() for n, p in model.named_parameters()}, step


@pytest.mark.parametrize("mode", ["default", "budget", "off"])
def test_compiled_step_with_its_plan_and_remat_equals_eager(mode, monkeypatch):
  if mode == "off": monkeypatch.setenv("BLUTRAIN_NOVA_REMAT", "0")
  l1, p1, _ = _train(False)
  if mode == "budget":  # below the floor: everything recomputable is recomputed, matmuls among it
    with pytest.warns(UserWarning, match="memory budget"): l2, p2, step = _train(True, memory_budget=1 << 20)
  else: l2, p2, step = _train(True)
  info = step.info
  assert info["cuda_graph"] == "on" and info["graph_arena_bytes"] > 0
  if mode == "budget": assert info["remat"]["flops_share"] > 0.03, info["remat"]  # matmuls recomputed too
  if mode == "off": assert info["remat"] is None
  np.testing.assert_allclose(l2, l1, rtol=2e-5)
  for name in p1:
    np.testing.assert_allclose(p2[name], p1[name], rtol=2e-5, atol=1e-4 * 5e-3 + 5e-3 * name.endswith("c_attn.bias"),
                               err_msg=name)


def test_the_plans_peak_is_what_a_replay_holds():
  """During a replay the device allocator holds the step's inputs and its arena (the plan's peak) beside the model's
  eager leftovers, and the graph pool only temporaries the plan does not see (kernels' scratch, cuBLASLt's
  workspace): no copy of a view, no activation."""
  _, _, step = _train(True, steps=3)
  exe = next(iter(step._entries.values()))
  bt.cuda.synchronize()
  before = bt.cuda.memory_allocated()
  bt.cuda.reset_peak_memory_stats()
  x = bt.from_numpy(np.random.default_rng(2).integers(0, 96, (4, 64))).to("cuda")
  step(x, x).item()
  assert bt.cuda.max_memory_allocated() - before < (1 << 20)  # a replay allocates only the returned loss's copy
  assert exe.planned_peak() <= before
  from blutrain.backend.cuda.kernels.cublaslt import WORKSPACE
  pool = exe.pool.scratch.memory_stats()["allocated_bytes.all.peak"]
  assert pool - WORKSPACE < (1 << 20), pool  # the pool's stream's workspace and kernels' temporaries


def _compiled_gpt_step():
  """A small GPT's compiled AdamW step, not yet called."""
  bt.manual_seed(0)
  model = GPT(GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=2, n_embd=64)).to("cuda")
  opt = model.configure_optimizers(0.1, 1e-3, fused=True)

  @bt.compile
  def step(x, y):
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss
  return step


def test_the_first_call_holds_what_its_plan_says():
  """The first call is captured, not run eagerly: its graph (which creates AdamW's state) runs once in a pool holding
  its plan's arena, so the device allocator's peak during it is the plan's peak (the step's inputs, the arena and the
  copies of the state it creates) beside the call's batch; the pool is given back after the call."""
  step = _compiled_gpt_step()
  x, y = (bt.from_numpy(np.random.default_rng(3).integers(0, 96, (16, 64))).to("cuda") for _ in range(2))
  bt.cuda.synchronize()
  pools = bt.cuda.memory_stats()["pools_reserved_bytes.all.current"]  # earlier tests' steps this process still holds
  bt.cuda.reset_peak_memory_stats()
  step(x, y).item()
  info = step.info
  assert info["capture"].startswith("initial") and not step._entries, info
  batch = 2 * x.numel() * x.dtype.itemsize  # and cuBLASLt's workspace for the pool's stream, made at its first GEMM
  assert bt.cuda.max_memory_allocated() <= info["planned_peak_bytes"] + batch + WORKSPACE + (1 << 20), info
  assert bt.cuda.memory_stats()["pools_reserved_bytes.all.current"] - pools <= 2 << 20  # kernels keep the error flag
  losses = [step(x, y).item() for _ in range(3)]
  assert step.info["capture"] == "steady" and all(np.isfinite(losses))


def test_out_of_memory_in_a_compiled_step_is_clear_and_training_goes_on():
  step = _compiled_gpt_step()
  x, y = (bt.from_numpy(np.random.default_rng(3).integers(0, 96, (4, 64))).to("cuda") for _ in range(2))
  first = step(x, y).item()
  bt.cuda.empty_cache()  # no cached segment from the first call's graph may hold the step's arena: it must ask for more
  bt.cuda.set_memory_limit(bt.cuda.memory_reserved() + (256 << 10))
  with pytest.raises(bt.cuda.OutOfMemoryError) as e:
    step(x, y)
  for part in ("plan's peak", "a limit of", "memory_budget", "CUDA out of memory"):
    assert part in str(e.value), (part, str(e.value))
  bt.cuda.set_memory_limit(None)
  losses = [step(x, y).item() for _ in range(4)]
  assert step.info["cuda_graph"] == "on" and all(np.isfinite(losses)) and losses[-1] < first
