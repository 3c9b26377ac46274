"""Nova's memory under a cap, on the fake GPU: one limit over the device allocator and every CUDA graph pool, and
a compiled step whose copies are all in its memory plan."""
from tests.test_cuda_host_paths import GPT_STEP, _run_fake



def test_the_limit_caps_the_device_allocator_and_the_graph_pools_together_on_the_fake_gpu(tmp_path):
  """The pool's own allocator needs more than 32 MiB (cuBLASLt's workspace for its stream): with 20 MiB of room
  above what the eager step reserved, the device allocator alone would fit the arena (a 20 MiB segment) and the pool
  alone its 34 MiB, but the two together do not, which the error says with both figures; with 60 MiB of room the
  compiled step trains and what both reserve together never passes the limit."""
  out = _run_fake(GPT_STEP + """
MiB = 1 << 20
step(x, y)
base = bt.cuda.memory_reserved()
bt.cuda.set_memory_limit(base + 20 * MiB)
try:
  step(x, y)
  raise SystemExit("no error")
except bt.cuda.OutOfMemoryError as e:
  msg = str(e)
# planned under the limit less what is not the step's: other memory, and the workspace its pool makes (32 MiB)
assert step.info["memory_budget"] <= base + 20 * MiB - 32 * MiB, step.info["memory_budget"]
for part in ("plan's peak", "arena", "a limit of", "memory_budget", "in all (", "by the device's caching allocator",
             "CUDA graph pool"):
  assert part in msg, (part, msg)
bt.cuda.set_memory_limit(base + 60 * MiB)
bt.cuda.reset_peak_memory_stats()
for _ in range(3): step(x, y)
s = bt.cuda.memory_stats()
assert s["pools_reserved_bytes.all.current"] > 32 * MiB, s
assert s["limited_reserved_bytes.all.peak"] <= base + 60 * MiB, s
joint = s["reserved_bytes.all.current"] + s["pools_reserved_bytes.all.current"]
assert s["limited_reserved_bytes.all.current"] == joint, s
print("ok", step.info["planned_peak_bytes"])
""", tmp_path)
  assert int(out.split("ok")[-1]) > 0


def test_a_compiled_gpt_step_makes_no_copy_outside_its_memory_plan_on_the_fake_gpu(tmp_path):
  """Capture gives a view the layout its rule gives, so `.contiguous()` after attention's transpose, and the reshapes
  of the backward, record their copies in the graph, where the plan places them: the generated code's views
  (`cuda_view`) copy nothing at run time, and the step's copies are copy ops of the graph served from the arena.
  (Without the fusion passes: fuse-norms has the attention kernel write its output transposed, and no copy is left.)"""
  out = _run_fake("import os\nos.environ['BLUTRAIN_NOVA_FUSE'] = '0'\n" + GPT_STEP + """
import sys
from blutrain.backend.cuda import graphs, kernels, runtime
copy, outside, planned = kernels["copy"], [], []
def spy(x, *a, **k):
  r = copy(x, *a, **k)
  if sys._getframe(1).f_code.co_name == "cuda_view": outside.append(x.shape)
  else:
    a = runtime.current_stream().allocator
    if isinstance(a, graphs.PlannedAllocator): planned.append(a.arena.ptr <= r.ptr < a.arena.ptr + a.arena.nbytes)
  return r
kernels["copy"] = spy
for _ in range(4): step(x, y)
exe = next(iter(step._entries.values()))
assert exe.graph is not None and not outside, outside
assert all(planned), planned
print("ok", len(planned))
""", tmp_path)
  # each block's copy after attention's transpose, in the warm run and the capture (remat may add clones)
  assert int(out.split("ok")[-1]) >= 2 * 2


def test_a_compiled_steps_first_call_allocates_what_its_plan_says_on_the_fake_gpu(tmp_path):
  """The first call is captured, not run eagerly: its graph (which creates AdamW's state) runs once in a pool holding
  its plan's arena, so the device allocator's peak during the call is the plan's peak (the step's inputs, the arena,
  and the copies of the state it creates) besides the call's own batch, and the pool is given back afterwards; the
  graph is not kept, and the next call captures the steady graph."""
  out = _run_fake(GPT_STEP + """
MiB = 1 << 20
bt.cuda.reset_peak_memory_stats()
step(x, y)
s, info = bt.cuda.memory_stats(), step.info
assert info["capture"].startswith("initial") and info["created"] == 3 * len(list(model.parameters())), info
assert not step._entries and info["cuda_graph"].startswith("off: runs once"), (step._entries, info)
batch = 2 * x.numel() * x.dtype.itemsize
assert 0 < s["allocated_bytes.all.peak"] <= info["planned_peak_bytes"] + batch + 64 * 1024, (s, info)
assert s["pools_reserved_bytes.all.current"] <= 2 * MiB, s  # what kernels keep (the error flag, adamw's tables)
# adamw updates the parameters in their own memory and makes the new state (moments, steps) in the arena (None in
# its out=), not new parameters outside the plan (0.46 GiB of a 12 GiB cap for GPT-2 124M) copied back afterwards
call = next(line for line in open(info["source"]).read().splitlines() if 'kernels["adamw"](' in line)
n = len(list(model.parameters()))
assert "out=(" in call and call.count("None") == 3 * n, call[-300:]  # the new moments and steps
from blutrain.tensor import Traced
assert all(type(v._storage.data) is not Traced and v.device.type == "cuda"
           for st in opt.state.values() for v in st.values())
step(x, y)
assert step.info["capture"] == "steady" and len(step._entries) == 1
print("ok", info["planned_peak_bytes"])
""", tmp_path)
  assert int(out.split("ok")[-1]) > 0


def test_a_first_call_that_does_not_fit_leaves_no_state_behind_on_the_fake_gpu(tmp_path):
  """An out-of-memory error in the first call's graph says so with the plan's figures, and puts the optimizer's state
  and the gradients back as they were (no traced tensor stays in them): with the limit lifted, training goes on."""
  _run_fake(GPT_STEP + """
from blutrain.tensor import Traced
bt.cuda.set_memory_limit(bt.cuda.memory_reserved() + (1 << 20))
try:
  step(x, y)
  raise SystemExit("no error")
except bt.cuda.OutOfMemoryError as e:
  msg = str(e)
assert "running it once" in msg and "plan's peak" in msg, msg
assert not any(opt.state.values()) and all(p.grad is None for p in model.parameters())
bt.cuda.set_memory_limit(None)
for _ in range(3): step(x, y)
assert all(type(v._storage.data) is not Traced for s in opt.state.values() for v in s.values())
assert step.info["capture"] == "steady" and step.captures == 3
""", tmp_path)


def _captured(fn, *args):
  """fn compiled on the CPU and called twice (captured, then replayed): its results and the graph's op counts."""
  import blutrain as bt
  f = bt.compile(fn)
  f(*args)
  return f(*args), f.info["counts_before"]


def test_capture_records_the_copies_that_views_of_strided_values_need(tmp_path, monkeypatch):
  """A view gets the layout its rule gives: `.contiguous()` after a transpose and a reshape that cannot view its input
  record a copy, as eagerly; views that can view record none, nor does a transpose undone, nor a view of a tensor
  whose strided view was updated in place (its new value is contiguous)."""
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path))  # a cached step carries no op counts
  import numpy as np
  import blutrain as bt
  x = bt.randn(2, 3, 4)
  want = (x.transpose(1, 2).contiguous().view(2, 12) * 2).numpy(), x.transpose(1, 2).reshape(2, 12).numpy()
  (a, b), counts = _captured(lambda x: (x.transpose(1, 2).contiguous().view(2, 12) * 2,
                                        x.transpose(1, 2).reshape(2, 12)), x)
  np.testing.assert_array_equal(a.numpy(), want[0])
  np.testing.assert_array_equal(b.numpy(), want[1])
  assert counts.get("copy") == 2, counts
  _, counts = _captured(lambda x: (x.transpose(1, 2).transpose(1, 2).contiguous().reshape(6, 4) + 1,), x)
  assert "copy" not in counts, counts

  def updated(x):
    v = (x * 1).transpose(1, 2)
    v.add_(1)
    return (v.reshape(-1),)
  (c,), counts = _captured(updated, x)
  np.testing.assert_array_equal(c.numpy(), (x.transpose(1, 2) + 1).reshape(-1).numpy())
  assert "copy" not in counts, counts


def test_gpt2_trains_at_its_largest_batches_under_a_12_gib_cap_on_the_fake_gpu(tmp_path):
  """GPT-2 124M (T=1024, fused AdamW) under a 12 GiB cap trains compiled at B=18 in TF32 and B=30 in bf16, the
  first call (which creates AdamW's state) and the steady one: their budgets leave room for what the plan does not
  hold (the device allocator's segments for the new state, two 9 MiB moments to a 20 MiB segment; free memory in its
  split segments; a segment of kernels' own temporaries), where the plans used to fill the budget and the runs to
  stop 20 MiB short."""
  out = _run_fake("""
import contextlib
import blutrain as bt
from blutrain.models import GPT, GPTConfig
from blutrain.train import training_step
bt.cuda.set_memory_limit(12 << 30)
for precision, batch in (("tf32", 18), ("bf16", 30)):
  bt.manual_seed(0)
  model = GPT(GPTConfig(block_size=1024, n_layer=12, n_embd=768, n_head=12)).to("cuda")
  step = bt.compile(training_step(model, model.configure_optimizers(0.1, 6e-4, fused=True)))
  ctx = bt.autocast(device_type="cuda", dtype=bt.bfloat16) if precision == "bf16" else contextlib.nullcontext()
  x, y = (bt.randint(50257, (batch, 1024)).to("cuda") for _ in range(2))
  with ctx:
    for _ in range(3): step(x, y)
  assert bt.cuda.memory_stats()["limited_reserved_bytes.all.peak"] <= 12 << 30
  print(precision, "ok")
  del model, step, x, y
  bt.cuda.empty_cache()
""", tmp_path)
  assert "tf32 ok" in out and "bf16 ok" in out, out
