"""Nova's compile time grows about linearly with the graph. Work is counted, not timed: the calls of each pass's
costly primitive while an LSTM language model step compiles at T = 8 and at T = 32, four times the ops: an LSTM
with projections (proj_size), whose time loop is unrolled into the graph (issue #17; without them it is one op). A
pass that rewalks the graph per decision (remat rewiring every op after each recomputed value, fuse-gemm finding op
positions by walking the block, the split-gradient pattern decoding each inner add's leaves, the planner testing every
pair of buffers) makes its count grow about sixteen times instead."""
import sys
from collections import Counter

import numpy as np
import pytest
from xdsl.ir import Block, Operation

import blutrain as bt
from blutrain.nova import memory, remat
from blutrain.nova.passes import canonicalize


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))


def _counted(counts: Counter, name: str, fn, weight=lambda result: 1):
  def wrapper(*args, **kwargs):
    result = fn(*args, **kwargs)
    counts[name] += weight(result)
    return result
  return wrapper


def _rewiring(counts: Counter, fget):
  """Operation.operands, counting the reads remat makes while it rewires reads to a recomputed value (in `_apply`
  or a function it nests, such as an accessor of a named operand: three frames up at most)."""
  def operands(op):
    frame = sys._getframe(1)
    for _ in range(3):
      if frame is None: break
      if frame.f_code.co_filename == remat.__file__ and frame.f_code.co_name in ("_apply", "remap"):
        counts["remat rewiring"] += 1
        break
      frame = frame.f_back
    return fget(op)
  return operands


def _compile_lstm(T: int, monkeypatch) -> Counter:
  """The counts while a compiled LSTM step compiles both of its graphs (the first call's and the steady one)."""
  counts: Counter = Counter()
  operands = Operation.operands
  with monkeypatch.context() as m:
    m.setattr(Operation, "operands", property(_rewiring(counts, operands.fget), operands.fset))
    # a position costs a walk of the ops before it
    m.setattr(Block, "get_operation_index", _counted(counts, "ops walked", Block.get_operation_index, lambda i: i + 1))
    m.setattr(canonicalize, "_band", _counted(counts, "bands decoded", canonicalize._band))
    m.setattr(memory.Buffer, "meets", _counted(counts, "buffer pairs", memory.Buffer.meets))
    bt.manual_seed(0)
    emb, head = bt.nn.Embedding(20, 8), bt.nn.Linear(4, 20)
    lstm = bt.nn.LSTM(8, 8, num_layers=2, batch_first=True, proj_size=4)
    params = [*emb.parameters(), *lstm.parameters(), *head.parameters()]
    opt = bt.optim.AdamW(params, lr=1e-3)

    def step(x):
      logits = head(lstm(emb(x))[0])
      loss = bt.nn.functional.cross_entropy(logits.reshape(-1, 20), x.reshape(-1))
      loss.backward()
      opt.step()
      opt.zero_grad(set_to_none=True)
      return loss
    compiled = bt.compile(step)
    x = bt.from_numpy(np.random.default_rng(0).integers(0, 20, (2, T)))
    for _ in range(2): compiled(x).item()
  return counts


def test_each_pass_costs_about_linear_work_in_the_graph(monkeypatch):
  small, large = _compile_lstm(8, monkeypatch), _compile_lstm(32, monkeypatch)
  assert small["remat rewiring"] > 0 and small["bands decoded"] > 0
  for name in ("remat rewiring", "ops walked", "bands decoded", "buffer pairs"):
    assert large[name] <= 6 * small[name], \
        f"{name}: {small[name]} at T=8, {large[name]} at T=32 (linear: about 4x, quadratic: about 16x)"


