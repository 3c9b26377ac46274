"""The CUDA backend's host code on a fake device (tests/fakegpu/fake_cuda.py), so CI, which has no GPU, runs it:
the caching allocator, launch planning and argument packing, autograd, autocast, the fused optimizer and clipping,
checkpoints and the CLI. Nothing is computed there, so values are not checked: tests/cuda does that on a GPU. Each
case runs in a fresh process, since the fake replaces module state."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cuda.core")
HERE = Path(__file__).parent

# a compiled GPT-2-shaped step on the GPU (the fake one here), `step(x, y)` ready to call
GPT_STEP = """
import blutrain as bt
from blutrain.models import GPT, GPTConfig
bt.manual_seed(0)
model = GPT(GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=2, n_embd=64)).to("cuda")
opt = bt.optim.AdamW(model.parameters(), lr=1e-3)
@bt.compile
def step(x, y):
  _, loss = model(x, y)
  loss.backward()
  opt.step(); opt.zero_grad()
  return loss
x, y = (bt.randint(256, (4, 64)).to("cuda") for _ in range(2))
"""


def _run_fake(code: str, tmp_path: Path) -> str:
  """Run code in a fresh process on the fake GPU, importing blutrain from this checkout."""
  paths = [str(HERE / "fakegpu"), str(HERE.parent)]
  script = f"import sys; sys.path[:0] = {paths!r}\nimport fake_cuda; fake_cuda.install()\n{code}"
  r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path)
  assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
  return r.stdout


def test_cli_trains_and_resumes_a_gpt_on_the_fake_gpu(tmp_path):
  args = ["train", "--preset", "char-tiny", "--device", "cuda", "--dtype", "bfloat16", "--warmup-steps", "1",
          "--eval-interval", "2", "--eval-batches", "1", "--log-interval", "1", "--sample-tokens", "4",
          "--batch-size", "2", "--block-size", "16", "--out-dir", str(tmp_path / "run")]
  out = _run_fake(f"from blutrain.cli import main\nassert main({args + ['--steps', '2']!r}) == 0\n"
                  f"assert main({args + ['--steps', '3', '--resume']!r}) == 0\nprint('launches', fake_cuda.launches[0])",
                  tmp_path)
  assert int(out.split("launches")[-1]) > 100
  assert {"config.json", "metrics.csv", "sample.txt", "checkpoints"} <= {p.name for p in (tmp_path / "run").iterdir()}


def test_eager_ops_autograd_and_in_place_on_the_fake_gpu(tmp_path):
  _run_fake("""
import blutrain as bt
x = bt.randn(4, 6, device="cuda", requires_grad=True)
w = bt.randn(6, 5, device="cuda", requires_grad=True)
y = (x @ w).relu() * 2.0 + 1
base = bt.randn(4, 6, device="cuda")
t = base[:, ::2]
t.add_(1); t.mul_(base[:, 1::2]); t[0] = 3.0; base[1:] = base[:-1].clone()
with bt.autocast(device_type="cuda", dtype=bt.bfloat16):
  z = bt.nn.functional.gelu(x @ w, approximate="tanh").sum()
(y.sum() + z.float()).backward()
assert x.grad.shape == (4, 6) and w.grad.shape == (6, 5) and x.grad.device.type == "cuda"
bt.nn.utils.clip_grad_norm_([x, w], 1.0)
opt = bt.optim.AdamW([x, w], lr=1e-3, fused=True)
opt.step()
assert bt.cuda.memory_allocated() > 0
""", tmp_path)


def test_empty_launches_no_kernel_on_the_fake_gpu(tmp_path):
  _run_fake("""
import blutrain as bt
x = bt.randn(64, 32, device="cuda")
before = fake_cuda.launches[0]
a, b = bt.empty(64, 32, device="cuda"), bt.empty_like(x)
assert fake_cuda.launches[0] == before, "no fill kernel"
assert a.device.type == b.device.type == "cuda" and a.shape == b.shape == (64, 32)
b.add_(1)
assert fake_cuda.launches[0] == before + 1
""", tmp_path)


def test_compiled_gpt_step_replays_as_one_cuda_graph_on_the_fake_gpu(tmp_path):
  """Nova's GPU target on the fake device: the first call runs the graph that creates AdamW's state once, the second
  runs the steady graph kernel by kernel on bound buffers, the next captures it into a CUDA graph, and a replay is one
  graph launch (the returned loss is copied out by a memcpy); with a scheduled learning rate the graph is reused, and
  BLUTRAIN_CUDA_GRAPHS=0 runs every kernel at every call."""
  code = """
import os
import blutrain as bt
from blutrain.models import GPT, GPTConfig
def run(graphs, dropout=0.0):
  os.environ["BLUTRAIN_CUDA_GRAPHS"] = graphs
  bt.manual_seed(0)
  model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=32, dropout=dropout)).to("cuda")
  opt = bt.optim.AdamW(model.parameters(), lr=1e-3)
  @bt.compile
  def step(x, y):
    _, loss = model(x, y)
    loss.backward()
    bt.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad()
    return loss
  x, y = (bt.randint(32, (2, 16)).to("cuda") for _ in range(2))
  counts, offsets = [], []
  for i in range(5):
    opt.param_groups[0]["lr"] = 1e-3 * (i + 1)
    before = fake_cuda.launches[0]
    loss = step(x, y)
    counts.append(fake_cuda.launches[0] - before)
    offsets.append(bt.default_generator.offset)
  assert loss.shape == () and loss.device.type == "cuda" and step.captures == 2
  return counts, step.info["cuda_graph"], offsets
graphed, mode, _ = run("1")
assert mode == "on", mode
assert graphed[3] == graphed[4] == 1, graphed  # the graph (the loss's copy out is a memcpy)
dropped, mode, offsets = run("1", dropout=0.1)  # the generator's state is read from device memory: replays too
assert mode == "on" and dropped[3] == dropped[4] == 1, (mode, dropped)
steps = [b - a for a, b in zip(offsets, offsets[1:])]
assert steps[0] > 0 and len(set(steps)) == 1, offsets  # every call, replays included, advances the generator alike
plain, mode, _ = run("0")
assert mode.startswith("off"), mode
assert plain[3] == plain[4] > 20, plain  # every kernel (cuBLASLt's GEMMs are not counted)
print("ok")
"""
  assert "ok" in _run_fake(code, tmp_path)


def test_multi_tensor_updates_keep_every_relaid_gradient_alive_until_queued_on_the_fake_gpu(tmp_path):
  """SGD and AdamW read each gradient laid out unlike its parameter through a copy in the parameter's layout: every
  copy lives until the update is queued, so copies of same-sized gradients never share memory (one freed as the next
  is made would give it its block, and the update would read the last copy for all)."""
  code = """
import blutrain as bt
from blutrain.backend.cuda.kernels import optim
tables = []
def spy(rows, width, *rest):
  tables.append((list(rows), width))
  return real(rows, width, *rest)
real, optim._tables_for = optim._tables_for, spy
ps = [bt.randn(64, 32, device="cuda", requires_grad=True) for _ in range(3)]
for make in (lambda: bt.optim.SGD(ps, lr=0.1, momentum=0.9), lambda: bt.optim.AdamW(ps, lr=1e-3)):
  opt = make()
  for _ in range(2):
    for p in ps: p.grad = bt.ones(32, 64, device="cuda").t()
    tables.clear()
    opt.step()
    (rows, width), = tables
    grads = rows[1::width]
    assert len(set(grads)) == 3 and not set(grads) & {p.grad.data_ptr() for p in ps}, grads
print("ok")
"""
  assert "ok" in _run_fake(code, tmp_path)


def test_sgd_is_one_launch_per_dtype_group_eager_and_compiled_on_the_fake_gpu(tmp_path):
  """SGD with momentum on the fake device: eagerly one launch a step per (param, grad) dtype pair once the buffers
  exist (a gradient laid out unlike its parameter copied first; a channels-last parameter with a channels-last
  gradient and buffer joins the launch as is); compiled with clipping and a scheduled learning rate, the sgd op reads
  the clip factor and the learning rate from device memory and the step replays as a CUDA graph."""
  code = """
import blutrain as bt
ps = [bt.randn(64, 32, device="cuda", requires_grad=True), bt.randn(7, device="cuda", requires_grad=True),
      bt.randn(16, device="cuda").bfloat16().requires_grad_(),
      bt.randn(8, 4, 3, 3, device="cuda").contiguous(memory_format=bt.channels_last).requires_grad_()]
opt = bt.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
counts = []
for _ in range(3):
  for p in ps: p.grad = bt.ones(p.shape, device="cuda", dtype=p.dtype)
  ps[0].grad = bt.ones(32, 64, device="cuda").t()
  ps[3].grad = bt.ones(8, 3, 3, 4, device="cuda").permute(0, 3, 1, 2)
  before = fake_cuda.launches[0]
  opt.step()
  counts.append(fake_cuda.launches[0] - before)
assert counts == [4 + 1 + 2, 1 + 2, 1 + 2], counts  # the new buffers' fills, the strided grad's copy, 2 dtype groups
assert opt.state[ps[3]]["momentum_buffer"].stride() == ps[3].stride() == (36, 1, 12, 4)
model = bt.nn.Sequential(bt.nn.Linear(8, 16), bt.nn.ReLU(), bt.nn.Linear(16, 4)).to("cuda")
opt = bt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
@bt.compile
def step(x, y):
  loss = bt.nn.functional.cross_entropy(model(x), y)
  loss.backward()
  bt.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
  opt.step(); opt.zero_grad()
  return loss
x, y = bt.randn(5, 8, device="cuda"), bt.randint(4, (5,)).to("cuda")
for i in range(5):
  opt.param_groups[0]["lr"] = 0.1 / (i + 1)
  step(x, y)
source = open(step.info["source"]).read()
assert step.captures == 2 and step.info["cuda_graph"] == "on", (step.captures, step.info["cuda_graph"])
assert source.count('kernels["sgd"](') == 1 and "clip=True" in source and 'kernels["scale"]' not in source
cnn = bt.nn.Sequential(bt.nn.Conv2d(3, 8, 3, padding=1, bias=False), bt.nn.BatchNorm2d(8), bt.nn.ReLU(),
                       bt.nn.Flatten(), bt.nn.Linear(200, 4)).to("cuda").to(memory_format=bt.channels_last)
opt = bt.optim.SGD(cnn.parameters(), lr=0.1, momentum=0.9)
@bt.compile
def cnn_step(x, y):
  loss = bt.nn.functional.cross_entropy(cnn(x), y)
  loss.backward()
  opt.step(); opt.zero_grad()
  return loss
x = bt.randn(2, 3, 5, 5, device="cuda").contiguous(memory_format=bt.channels_last)
for _ in range(3): cnn_step(x, y[:2])
w = cnn[0].weight  # its buffer, made in the first capture, keeps its layout through the plan's buffer
assert opt.state[w]["momentum_buffer"].stride() == w.stride() == (27, 1, 9, 3)
assert open(cnn_step.info["source"]).read().count('kernels["sgd"](') == 1
print("ok")
"""
  assert "ok" in _run_fake(code, tmp_path)


def test_a_compiled_cnn_step_binds_its_nchw_images_channels_last_on_the_fake_gpu(tmp_path):
  """A compiled step whose NCHW argument reaches a convolution (through autocast's cast) binds it channels-last, so
  the convolutions run on channels-last operands; an argument that reaches none, and a step that returns a 4-D tensor
  (whose strides the caller would see), keep the argument's own layout."""
  code = """
import blutrain as bt
from blutrain.backend import cuda
seen = []
def spy(x, w, *a, _conv=cuda.kernels["conv"], **k):
  seen.append(x.strides)
  return _conv(x, w, *a, **k)
cuda.kernels["conv"] = spy
cnn = bt.nn.Sequential(bt.nn.Conv2d(3, 8, 3, padding=1, bias=False), bt.nn.BatchNorm2d(8), bt.nn.ReLU(),
                       bt.nn.Conv2d(8, 8, 3, padding=1), bt.nn.Flatten(), bt.nn.Linear(200, 4)).to("cuda")
opt = bt.optim.SGD(cnn.parameters(), lr=0.1, momentum=0.9)
@bt.compile
def step(x, y, z):
  with bt.autocast(device_type="cuda", dtype=bt.bfloat16):
    loss = bt.nn.functional.cross_entropy(cnn(x), y) + z.sum()
  loss.backward()
  opt.step(); opt.zero_grad()
  return loss
x, y, z = bt.randn(2, 3, 5, 5, device="cuda"), bt.randint(4, (2,)).to("cuda"), bt.randn(2, 3, 5, 5, device="cuda")
step(x, y, z)  # the capture, on the call's own tensors
seen.clear()
for _ in range(2): step(x, y, z)
exe = next(iter(step._entries.values()))
assert [b.strides for b in exe.static if b.shape == (2, 3, 5, 5)] == [(75, 1, 15, 3), (75, 25, 5, 1)]
# every convolution's input channels-last (how many calls: the compile-ahead dry run runs only on a disk-cache miss)
assert len(seen) >= 2 and all(s[1] == 1 for s in seen), seen
assert x.stride() == (75, 25, 5, 1)
@bt.compile
def features(x): return cnn[0](x)
with bt.no_grad():
  for _ in range(3): out = features(x)
exe = next(iter(features._entries.values()))
assert exe.channels_last == frozenset() and out.stride() == (200, 25, 5, 1)
print("ok")
"""
  assert "ok" in _run_fake(code, tmp_path)


def test_compiled_step_places_its_buffers_by_the_memory_plan_on_the_fake_gpu(tmp_path):
  """The graph's pool cuts one arena of the plan's size; the results the plan places come from it at their offsets
  (announced by `expect`), and only temporaries the plan does not see (kernels' scratch, a view that needs a copy)
  come from the pool's caching allocator: most bytes come from the arena."""
  code = """
import blutrain as bt
from blutrain.backend.cuda import graphs
from blutrain.backend.cuda.kernels.cublaslt import WORKSPACE
from blutrain.models import GPT, GPTConfig
bt.manual_seed(0)
model = GPT(GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=2, n_embd=64)).to("cuda")
opt = bt.optim.AdamW(model.parameters(), lr=1e-3)
served = []
malloc = graphs.PlannedAllocator.malloc
def spy(self, nbytes, stream):
  b = malloc(self, nbytes, stream)
  served.append((self.arena.ptr <= b.ptr < self.arena.ptr + self.arena.nbytes, nbytes))
  return b
graphs.PlannedAllocator.malloc = spy
@bt.compile
def step(x, y):
  with bt.autocast(device_type="cuda", dtype=bt.bfloat16):
    _, loss = model(x, y)
  loss.backward()
  opt.step(); opt.zero_grad()
  return loss
x, y = (bt.randint(256, (4, 64)).to("cuda") for _ in range(2))
for _ in range(4): step(x, y)
exe = next(iter(step._entries.values()))
assert exe.pool.arena.nbytes == exe.fn.arena_bytes > 0
served = [(a, n) for a, n in served if n != WORKSPACE]  # cuBLASLt's workspace of the pool's stream, made once
planned = sum(n for in_arena, n in served if in_arena)
assert planned > 0.75 * sum(n for _, n in served), (planned, sum(n for _, n in served))
print("ok")
"""
  assert "ok" in _run_fake(code, tmp_path)


def test_a_deleted_compiled_step_gives_its_arena_and_pool_back_on_the_fake_gpu(tmp_path):
  """Caches that outlive a compiled step (cuBLASLt's workspace, kernels' device tables) keep blocks allocated on its
  pool's stream; deleting the step must still free the plan's arena, the pool's workspace and its scratch segments."""
  code = GPT_STEP + """
import gc
for _ in range(3): step(x, y)
exe = next(iter(step._entries.values()))
arena, pool_bytes = exe.pool.arena.nbytes, exe.pool.nbytes()
assert arena > 0
held = bt.cuda.memory_allocated()
del step, exe
gc.collect()
freed = held - bt.cuda.memory_allocated()
assert freed >= arena, (freed, arena, pool_bytes)
print("ok")
"""
  assert "ok" in _run_fake(code, tmp_path)


def test_a_compiled_first_call_makes_host_constants_for_real_on_the_fake_gpu(tmp_path):
  """Pooling's host-computed constants (averaging divisors, gather indices), first needed by a captured call, are
  made and copied to the GPU for real (a copy to the device cannot be captured) and cached; the graph reads them."""
  _run_fake("""
import blutrain as bt
from blutrain.nn import functional as F
f = bt.compile(lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False).sum())
x = bt.randn(1, 2, 7, 7).to("cuda")
for _ in range(3): f(x)
from blutrain.nn.spatial import _cached_constant
assert _cached_constant.cache_info().currsize >= 1
""", tmp_path)


def test_compiled_step_that_does_not_fit_says_so_and_training_goes_on_on_the_fake_gpu(tmp_path):
  code = GPT_STEP + """
step(x, y)
bt.cuda.set_memory_limit(bt.cuda.memory_reserved() + (1 << 20))
try:
  step(x, y)
  raise SystemExit("no error")
except bt.cuda.OutOfMemoryError as e:
  msg = str(e)
assert "memory_budget" in msg and "arena" in msg and "set_memory_limit" in msg, msg
bt.cuda.set_memory_limit(None)
for _ in range(3): step(x, y)
print("ok")
"""
  assert "ok" in _run_fake(code, tmp_path)


def test_flash_attention_lse_forward_and_backward_launch_on_the_fake_gpu(tmp_path):
  """The LSE variant's host path: the packed float32 output (unaligned rows of D + 1), the forward's logsumexp kept
  for the backward, dlse handed to the dq kernel."""
  out = _run_fake("""
import blutrain as bt
from blutrain.ops.nn import flash_attention_lse
q, k, v = (bt.randn(2, 3, 40, 64, device="cuda", dtype=bt.bfloat16).requires_grad_() for _ in range(3))
o, lse = flash_attention_lse(q, k[..., :24, :], v[..., :24, :], is_causal=False)
assert o.shape == (2, 3, 40, 64) and lse.shape == (2, 3, 40) and o.dtype is lse.dtype is bt.float32
from blutrain.backend.cuda.kernels import attention
arrays = [t._array() for t in (q, k[..., :24, :], v[..., :24, :])]
kept = attention._recall(arrays[0], attention._inputs_key(*arrays, False, 0.125))  # the backward reads it
assert kept is not None and kept.shape == (2 * 3 * 40,)
before = fake_cuda.launches[0]
(o.sum() + lse.sum()).backward()
assert q.grad.dtype is bt.bfloat16 and k.grad.shape == (2, 3, 40, 64)
print('backward launches', fake_cuda.launches[0] - before)
""", tmp_path)
  assert int(out.split()[-1]) >= 2  # the dq and dk/dv kernels (and the slices' and casts' own)


def test_vocab_parallel_loss_primitives_launch_on_the_fake_gpu(tmp_path):
  """cross_entropy_stats and cross_entropy_lse_backward's host paths on a strided slice of bfloat16 logits wider
  than one tile: one launch each, float32 statistics, the gradient in the logits' dtype from a broadcast g."""
  out = _run_fake("""
import blutrain as bt
from blutrain.ops.nn import cross_entropy_stats_op, cross_entropy_lse_backward_op
x = bt.randn(6, 10000, device="cuda", dtype=bt.bfloat16)[:, 5000:]
t = bt.tensor([0, 5001, -100, 9999, 7000, 3], device="cuda")
before = fake_cuda.launches[0]
stats = cross_entropy_stats_op(x, t, start=5000)
assert [tuple(a.shape) for a in stats] == [(6,)] * 3 and all(a.dtype is bt.float32 for a in stats)
g = bt.full((), 0.5, device="cuda").expand(6)
d = cross_entropy_lse_backward_op(g, x, t, stats[0], start=5000, ignore_index=-100)
assert tuple(d.shape) == (6, 5000) and d.dtype is bt.bfloat16 and d.is_contiguous()
print('launches', fake_cuda.launches[0] - before)
""", tmp_path)
  assert int(out.split()[-1]) == 3  # the two kernels and the fill of g


def test_gemm_op_host_paths_on_the_fake_gpu(tmp_path):
  """Nova's gemm op through both paths of its CUDA kernel (cuBLASLt and separate kernels, one synthesized GEMM with
  round and save epilogue steps): shapes, dtypes and results; and a compiled MLP step reports each gemm's choice."""
  _run_fake(f"""
import os
os.environ["BLUTRAIN_CACHE_DIR"] = {str(tmp_path / "cache")!r}  # a miss, so that info lists the gemms
import blutrain as bt
from blutrain import dtypes
from blutrain.backend.cuda import kernels, memory
f32, bf16 = dtypes.float32, dtypes.bfloat16
for dtype in (f32, bf16):
  a, w = memory.empty((3, 40, 64), dtype, 0), memory.empty((64, 96), dtype, 0)
  bias, res = memory.empty((96,), dtype, 0), memory.empty((3, 40, 96), f32, 0)
  for path in ("cublas", "nova"):
    for epilogue, xs, out in (("bias,save,gelu", [bias], dtype), ("bias,residual", [bias, res], f32),
                              ("gelu_backward_tanh", [res], f32)):
      got = kernels["gemm"](a, w, *xs, epilogue=epilogue, dtype=out, path=path)
      assert [(g.shape, g.dtype) for g in got] == [((3, 40, 96), out)] + [((3, 40, 96), dtype)] * ("save" in epilogue)
model = bt.nn.Sequential(bt.nn.Linear(48, 128), bt.nn.GELU(), bt.nn.Linear(128, 10)).to("cuda")
def step(x):
  loss = model(x).square().mean()
  loss.backward()
  return loss
fn = bt.compile(step)
for _ in range(3): fn(bt.randn(64, 48, device="cuda"))
assert len(fn.info["gemms"]) == fn.info["counts_after"]["gemm"] >= 3, fn.info
source = open(fn.info["source"]).read()
assert source.count("path=") == source.count(" us, nova ") == len(fn.info["gemms"]), source
""", tmp_path)


def test_weight_gradients_and_casts_of_the_weights_fold_on_the_fake_gpu(tmp_path):
  """The GPU's fuse-bias-grads and fuse-wgrad: a compiled GPT step under autocast computes each linear layer's weight
  gradient in one weight_grad (float32) and its bias gradient there (cuBLASLt's BGRADB epilogue) or, for the layers
  after a norm's backward, in that backward's kernel, with no bias-gradient reduction or widening cast left,
  and casts its weights in one cast_many; and both kernels' shapes and dtypes (weight_grad with and without the bias
  gradient, cast_many of dense and strided tensors)."""
  _run_fake(f"""
import pathlib
import blutrain as bt
from blutrain import dtypes
from blutrain.backend.cuda import kernels, memory
for dtype in (dtypes.float32, dtypes.bfloat16):
  g, x = memory.empty((96, 640), dtype, 0), memory.empty((640, 48), dtype, 0)
  for bias_grad in (True, False):
    got = kernels["weight_grad"](g, x, dtype=dtypes.float32, bias_grad=bias_grad, tf32=True)
    assert [(r.shape, r.dtype) for r in got] == [((96, 48), dtypes.float32)] + [((96,), dtypes.float32)] * bias_grad
from blutrain.backend.cuda.kernels import cublaslt
asked, real_plan = [], cublaslt.plan
def plan(p, device):  # a cuBLASLt without BGRADB kernels: weight_grad falls back to a reduction, asking once
  if p.epilogue == "bgradb":
    asked.append(p)
    raise cublaslt.NoAlgorithm("no BGRADB kernel")
  return real_plan(p, device)
cublaslt.plan = plan
g, x = memory.empty((24, 80), dtypes.bfloat16, 0), memory.empty((80, 16), dtypes.bfloat16, 0)
for _ in range(2):
  got = kernels["weight_grad"](g, x, dtype=dtypes.float32, bias_grad=True)
  assert [(r.shape, r.dtype) for r in got] == [((24, 16), dtypes.float32), ((24,), dtypes.float32)]
assert len(asked) == 1, asked
cublaslt.plan = real_plan
x, w = bt.randn(40, 30, device="cuda"), bt.randn(7, device="cuda")
got = kernels["cast_many"](x._array(), x[:, ::3]._array(), w._array(), dtype=dtypes.bfloat16)
assert [(r.shape, r.dtype) for r in got] == [((40, 30), dtypes.bfloat16), ((40, 10), dtypes.bfloat16), ((7,), dtypes.bfloat16)]
{GPT_STEP.replace("@bt.compile", f"@bt.compile(dump_ir={str(tmp_path / 'ir')!r})").replace("_, loss = model(x, y)",
  "with bt.autocast(device_type='cuda', dtype=bt.bfloat16): _, loss = model(x, y)")}
for _ in range(3): step(x, y)
final = sorted(pathlib.Path({str(tmp_path / 'ir')!r}).rglob("*-group-casts.mlir"))[-1].read_text()
lines = final.splitlines()
# the projections' bias gradients come from the norms' backward kernels writing their output gradients, the MLP's
# first layer's from the GELU backward's (their weight gradients stay bf16 matmuls: this AdamW reads half gradients),
# the q, k, v projection's from its weight gradient's GEMM
assert sum("nova.weight_grad" in l and "bias_grad = true" in l for l in lines) == 2, final
assert sum("nova.weight_grad" in l for l in lines) == 2, final
assert sum("nova.layer_norm_backward" in l and "bias_grad = true" in l for l in lines) == 4, final
assert sum('epilogue = "gelu_backward,bias_grad"' in l for l in lines) == 2, final
assert "nova.sum" not in final.split("nova.weight_grad")[1], "no bias gradient is reduced apart"
assert final.count("nova.cast_many") == 1 and "nova.cast %" not in final.split("nova.cast_many")[0], final
""", tmp_path)


def test_scatter_reduce_launches_on_the_fake_gpu(tmp_path):
  """scatter_reduce's host path for every reduction, with and without self, in float32 (with its gradients), bfloat16
  (float32 atomics) and int8 and int64 (integer atomics, floor-divided mean): shapes and dtypes."""
  _run_fake("""
import blutrain as bt
index = bt.randint(4, (6, 3)).to("cuda")
for dtype in (bt.float32, bt.bfloat16, bt.int8, bt.int64):
  x, src = (bt.randint(-3, 4, shape).to(dtype).to("cuda") for shape in ((4, 5), (6, 4)))
  grad = dtype is bt.float32
  if grad: x.requires_grad_(); src.requires_grad_()
  for reduce in ("sum", "prod", "mean", "amax", "amin"):
    for include_self in (True, False):
      out = x.scatter_reduce(0, index, src, reduce, include_self=include_self)
      assert out.shape == (4, 5) and out.dtype is dtype and out.device.type == "cuda"
      if grad: out.sum().backward()
  if grad: assert x.grad.shape == (4, 5) and src.grad.shape == (6, 4)
""", tmp_path)


def test_convolutions_launch_on_the_fake_gpu(tmp_path):
  """The implicit-GEMM kernels' host path (plan, argument packing, the channels-last copies) for 3-D convolutions
  and 2-D ones of 16-divisible channel counts, forward and both gradients, and transposed ones: shapes and dtypes."""
  _run_fake("""
import blutrain as bt
from blutrain import nn
from blutrain.backend.cuda.kernels import conv
plans, plan = [], conv.plan
conv.plan = lambda *args: plans.append(plan(*args)) or plans[-1]
for layer, shape in ((nn.Conv3d(4, 6, (3, 2, 3), stride=(2, 1, 1), padding=1, groups=2), (2, 4, 5, 6, 7)),
                     (nn.ConvTranspose3d(6, 4, 3, stride=2, output_padding=1, groups=2), (2, 6, 3, 4, 5)),
                     (nn.Conv2d(32, 32, 3, stride=2, padding=1, groups=2), (2, 32, 9, 9)),
                     (nn.ConvTranspose2d(16, 32, 3, stride=2), (2, 16, 4, 5))):
  layer.to("cuda")
  x = bt.randn(*shape, device="cuda", requires_grad=True)
  with bt.autocast("cuda", dtype=bt.bfloat16):
    y = layer(x)
  y.float().sum().backward()
  assert y.dtype is bt.bfloat16 and x.grad.shape == shape and layer.weight.grad.shape == layer.weight.shape
assert [p[4] for p in plans] == [False] * 6 + [True] * 6, [p[4] for p in plans]  # the 2-D ones read channels-last
""", tmp_path)


def test_an_image_stem_runs_padded_to_16_channels_on_the_fake_gpu(tmp_path):
  """A 3-channel input of a convolution with 16-divisible output channels runs the channels-last forward and dgrad on
  zero-padded channels (x and w padded to 16; dgrad cut back to 3) and the general wgrad; a grouped one and one whose
  output channels do not vectorize stay on the general kernels."""
  _run_fake("""
import blutrain as bt
from blutrain import nn
from blutrain.backend.cuda.kernels import conv
plans, plan = [], conv.plan
def traced(*args):
  p = plan(*args)
  plans.append((args[0], args[3][0], p[4]))  # (kind, the weight's shape as planned, channels-last)
  return p
conv.plan = traced
assert conv.padded_channels(bt.bfloat16, (64, 3, 7, 7), 1) == 16 and conv.padded_channels(bt.float32, (32, 20, 3, 3), 1) == 32
assert conv.padded_channels(bt.bfloat16, (10, 3, 7, 7), 1) == 3 and conv.padded_channels(bt.bfloat16, (64, 3, 3, 3), 3) == 3
assert conv.padded_channels(bt.float64, (64, 3, 7, 7), 1) == 3
stem = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False).to("cuda")
x = bt.randn(2, 3, 32, 32, device="cuda", requires_grad=True)
with bt.autocast("cuda", dtype=bt.bfloat16):
  y = stem(x)
y.float().sum().backward()
assert y.shape == (2, 64, 16, 16) and y.dtype is bt.bfloat16
assert x.grad.shape == (2, 3, 32, 32) and stem.weight.grad.shape == (64, 3, 7, 7)
assert sorted(plans) == [("dgrad", (64, 16, 7, 7), True), ("fwd", (64, 16, 7, 7), True),
                         ("wgrad", (64, 3, 7, 7), False)], plans  # wgrad unpadded: see conv_grad_weight
""", tmp_path)


def test_batch_norm_launches_on_the_fake_gpu(tmp_path):
  """batch_norm's host path: the statistics (reduction and finalize), the normalization and the one backward (its
  reduction, finalize and dx) in NCHW, channels-last (kept in the output and dx) and 7-D layouts, the eval form
  (one kernel), the module's running statistics (moved by the statistics' finalize), a bf16 input under autocast, and a compiled
  ResNet-style step."""
  _run_fake("""
import fake_cuda
import blutrain as bt
from blutrain import nn
from blutrain.nn import functional as F
from blutrain.backend.cuda.kernels import norm
finalized, real_run = [], norm.run
def run(s, *a, **k):
  if s[0] is norm._batch_norm_finalize_kernel: finalized.append(s.constexprs["RUNNING"])
  return real_run(s, *a, **k)
norm.run = run
for shape, perm in (((8, 16, 6, 5), None), ((8, 6, 5, 16), (0, 3, 1, 2)), ((2, 3, 4, 2, 3, 2, 3), None)):
  base = bt.randn(*shape, device="cuda", requires_grad=True)
  x = base.permute(*perm) if perm else base
  w, b = (bt.randn(x.shape[1], device="cuda", requires_grad=True) for _ in range(2))
  g = bt.randn(*x.shape, device="cuda")
  n0 = fake_cuda.launches[0]
  y = F.batch_norm(x, None, None, w, b, training=True)
  n1 = fake_cuda.launches[0]
  y.backward(g)
  assert (n1 - n0, fake_cuda.launches[0] - n1) == (3, 3), (shape, n1 - n0, fake_cuda.launches[0] - n1)
  assert finalized == [False, False], finalized  # no running statistics: the finalize moves none (nor writes for them)
  finalized.clear()
  assert y.stride() == x.stride() and base.grad.stride() == base.stride() and w.grad.dtype is bt.float32
  with bt.no_grad():
    running_var = b.detach().abs()
    n0 = fake_cuda.launches[0]
    F.batch_norm(x, w.detach(), running_var, w, None, False)
    assert fake_cuda.launches[0] - n0 == 1
conv, bn = nn.Conv2d(3, 8, 3).cuda(), nn.BatchNorm2d(8).cuda()
h = conv(bt.randn(2, 3, 8, 8, device="cuda")).detach()
n0 = fake_cuda.launches[0]
finalized.clear()
bn(h)  # the statistics (2; the finalize moves the running statistics and counts the batch), the normalization (1)
assert fake_cuda.launches[0] - n0 == 3 and finalized == [True], (fake_cuda.launches[0] - n0, finalized)
with bt.autocast("cuda", dtype=bt.bfloat16):
  y = bn(conv(bt.randn(2, 3, 8, 8, device="cuda")))
assert y.dtype is bt.bfloat16 and bn.running_var.dtype is bt.float32
y.float().sum().backward()
model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 4)).cuda()
opt = bt.optim.SGD(model.parameters(), lr=0.1)
@bt.compile
def step(x, y):
  loss = F.cross_entropy(model(x), y)
  loss.backward(); opt.step(); opt.zero_grad()
  return loss
x, t = bt.randn(4, 3, 8, 8, device="cuda"), bt.randint(4, (4,)).to("cuda")
for _ in range(3): step(x, t)
""", tmp_path)


@pytest.mark.parametrize("kind,autocast", [("LSTM", True), ("GRU", False)])
def test_sequences_launch_on_the_fake_gpu(tmp_path, kind, autocast):
  """nn.LSTM's and nn.GRU's time loops on the GPU: per time step, layer and direction one cell kernel forward (which
  also writes h in the GEMM's dtype, so nothing casts) and one backward (which adds the later step's gradients itself
  and writes the gates' gradient in the GEMM's dtype), besides cuBLASLt's GEMMs (not counted); float32 and bf16 under
  autocast (a float32 state, bf16 GEMMs), both directions, given initial states, at two lengths; kernel by kernel
  (BLUTRAIN_CUDA_GRAPHS=0: the replayed loops are the next test's)."""
  out = _run_fake(f"""
import os
os.environ["BLUTRAIN_CUDA_GRAPHS"] = "0"
import blutrain as bt
lstm = {kind == "LSTM"}
m = bt.nn.{kind}(8, 16, num_layers=2, bidirectional=True).to("cuda")
for L in (5, 7, 9):  # (the first call's autocast casts one by one; later ones cast the parameters in one launch)
  m.zero_grad(set_to_none=True)
  x = bt.randn(L, 3, 8, device="cuda", requires_grad=True)
  states = [bt.randn(4, 3, 16, device="cuda", requires_grad=True) for _ in range(2 if lstm else 1)]
  with bt.autocast("cuda", dtype=bt.bfloat16, enabled={autocast}):
    before = fake_cuda.launches[0]
    out, last = m(x, tuple(states) if lstm else states[0])
    forward = fake_cuda.launches[0] - before
  last = last if lstm else (last,)
  assert out.shape == (L, 3, 32) and all(s.shape == (4, 3, 16) for s in last) and out.dtype is bt.float32
  before = fake_cuda.launches[0]
  (out.sum() + sum(s.sum() for s in last)).backward()
  assert x.grad.shape == x.shape and all(s.grad.shape == s.shape for s in states)
  assert m.weight_hh_l1_reverse.grad.dtype is bt.float32 and m.bias_hh_l0.grad.shape == (16 * (4 if lstm else 3),)
  print('launches', forward, fake_cuda.launches[0] - before)
""", tmp_path)
  (f7, b7), (f9, b9) = [map(int, line.split()[1:]) for line in out.splitlines() if line.startswith("launches")][1:]
  sequences = 4  # layers x directions
  assert (f9 - f7, b9 - b7) == (2 * sequences, 2 * sequences), (f7, b7, f9, b9)  # two more steps: one kernel each way


def test_recurrent_loops_replay_as_cuda_graphs_on_the_fake_gpu(tmp_path):
  """An LSTM's time loops, forward and backward, run step by step the first time their shapes come, are captured the
  second (here the second layer's, which has the first's shapes) and then replay as one graph launch each: a call's
  launches stop growing with the length; BLUTRAIN_CUDA_GRAPHS=0 keeps them step by step; inside bt.compile the loops
  are the compiled step's own (no graph within its graph); past REPLAYS keys the oldest are dropped."""
  _run_fake("""
import os
import fake_cuda
import blutrain as bt
from blutrain.backend.cuda import graphs
def launches(L, calls=3):
  bt.manual_seed(0)
  m = bt.nn.LSTM(16, 16, num_layers=2).to("cuda")
  x = bt.randn(L, 3, 16, device="cuda")
  counts = []
  for _ in range(calls):
    before = fake_cuda.launches[0]
    m(x)[0].sum().backward()
    counts.append(fake_cuda.launches[0] - before)
  return counts
short, long = launches(6), launches(30)
assert short[1] == short[2] == long[1] == long[2] and long[0] > short[0] > short[1], (short, long)
assert [k[0] for k in graphs._replays][-2:] == ["lstm_sequence", "lstm_sequence_backward"]
os.environ["BLUTRAIN_CUDA_GRAPHS"] = "0"
plain = launches(30, 2)
assert min(plain) > 4 * long[2], (plain, long)  # 30 steps each way, each a kernel (and a GEMM)
del os.environ["BLUTRAIN_CUDA_GRAPHS"]
m = bt.nn.LSTM(16, 16).to("cuda")
opt = bt.optim.SGD(m.parameters(), lr=0.1)
@bt.compile
def step(x):
  loss = m(x)[0].sum()
  loss.backward(); opt.step(); opt.zero_grad()
  return loss
captured = len(graphs._replays)
for _ in range(4): step(bt.randn(7, 3, 16, device="cuda"))
assert len(graphs._replays) == captured and step.info["cuda_graph"] == "on"
for L in range(3, 14):  # many lengths: the least recently used loops are dropped
  for _ in range(2): m(bt.randn(L, 2, 16, device="cuda"))[0].sum().backward()
assert len(graphs._replays) == graphs.REPLAYS
""", tmp_path)


def test_max_pool2d_launches_on_the_fake_gpu(tmp_path):
  """max_pool2d on the GPU: the window search and the read of the values forward, one kernel summing the gradient
  back (a channels-last input is read in place); bf16, 3x3 windows at stride 2 as ResNet's stem pool."""
  _run_fake("""
import fake_cuda
import blutrain as bt
from blutrain.nn import functional as F
for channels_last in (False, True):
  base = bt.randn(2, 8, 9, 10, device="cuda").to(bt.bfloat16)
  x = (base.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2) if channels_last else base).requires_grad_()
  g = bt.ones(2, 8, 5, 5, device="cuda", dtype=bt.bfloat16)
  n0 = fake_cuda.launches[0]
  y, idx = F.max_pool2d(x, 3, 2, 1, return_indices=True)
  n1 = fake_cuda.launches[0]
  y.backward(g)
  n2 = fake_cuda.launches[0]
  assert y.shape == (2, 8, 5, 5) and y.dtype is bt.bfloat16 and idx.dtype is bt.int64 and x.grad.shape == x.shape
  assert n1 - n0 == 2 and n2 - n1 == 1, (channels_last, n1 - n0, n2 - n1)
""", tmp_path)


def test_channels_last_flows_through_a_resnet_block_on_the_fake_gpu(tmp_path):
  """New arrays keep their input's memory format, as PyTorch's do: a channels-last image stays channels-last through
  a convolution, batch norm, relu, a residual add and max pool, eager and compiled (Nova's fused kernels), and so do
  the input gradients (a broadcast gradient gives no order); a weight gradient comes channels-last and takes its
  weight's layout: contiguous for a contiguous weight, channels-last for a channels-last one; an image in another
  dense order gives a contiguous weight gradient (PyTorch's suggested format)."""
  _run_fake("""
import blutrain as bt
from blutrain import nn
from blutrain.nn import functional as F
bt.manual_seed(0)
conv, bn = nn.Conv2d(16, 16, 3, padding=1, bias=False).cuda(), nn.BatchNorm2d(16).cuda()
def cl(t): return t.permute(0, 2, 3, 1).is_contiguous() and not t.is_contiguous()
def block(x): return F.relu(bn(conv(x))) + x
x = bt.randn(2, 9, 10, 16, device="cuda").permute(0, 3, 1, 2).requires_grad_()
h = conv(x)
assert cl(h) and cl(bn(h)) and cl(F.relu(h)) and cl(h + x) and cl(F.max_pool2d(h, 3, 2, 1)), "eager forward"
out = block(x)
out.sum().backward()
assert cl(out) and cl(x.grad) and conv.weight.grad.is_contiguous(), "eager backward"
conv.weight.grad = None
conv.to(memory_format=bt.channels_last)
block(x).sum().backward()
assert cl(conv.weight) and cl(conv.weight.grad), "a channels-last weight's gradient"
from blutrain.backend.cuda.kernels import conv as kernels
xt = x.detach().permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)  # dense, neither format
assert not xt.is_contiguous() and not cl(xt)
g, w = conv(x).detach(), conv.weight.detach()
for image, want in ((x, w.stride()), (xt, w.contiguous().stride())):  # w is channels-last here
  dw = kernels.conv_grad_weight(g._array(), image.detach()._array(), tuple(w.shape), (1, 1), (1, 1), (1, 1), 1)
  assert dw.strides == want, (image.stride(), dw.strides)
step = bt.compile(lambda x: F.max_pool2d(block(x), 3, 2, 1))
with bt.no_grad():
  for _ in range(2): assert cl(step(x.detach())), "compiled"
""", tmp_path)


def test_a_replayed_step_keeps_gradients_in_place_and_recaptures_when_a_parameter_moves_on_the_fake_gpu(tmp_path):
  """A replay rewrites the gradients in the graph's buffers: each parameter keeps its `.grad` tensor, whose storage
  version goes up (what autograd's in-place checks read), as do the versions of the parameters and optimizer state
  it updates; a parameter whose memory is replaced (`p.data = ...`) is found by the binding's check of its storage
  and the step recaptures, reading the new values."""
  _run_fake("""
import blutrain as bt
bt.manual_seed(0)
model = bt.nn.Linear(8, 4).to("cuda")
opt = bt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
@bt.compile
def step(x):
  opt.zero_grad()  # the step makes new gradients, which it leaves in the parameters' .grad
  loss = model(x).square().mean()
  loss.backward()
  opt.step()
  return loss
x = bt.randn(5, 8, device="cuda")
for _ in range(3): step(x)
assert step.captures == 2 and step.info["cuda_graph"] == "on", (step.captures, step.info)
g = model.weight.grad
version, updated = g._storage.version, [t._storage.version for t in (model.weight, model.bias,
                                                                    opt.state[model.weight]["momentum_buffer"])]
step(x)
assert model.weight.grad is g and g._storage.version > version and step.captures == 2
assert [t._storage.version for t in (model.weight, model.bias, opt.state[model.weight]["momentum_buffer"])] == \
  [v + 1 for v in updated]
assert set(step.info["host_s"]) == {"guard", "bind", "run", "deliver"} and min(step.info["host_s"].values()) > 0
model.weight.data = bt.randn(4, 8, device="cuda")
step(x)
assert step.captures == 3, step.captures
""", tmp_path)


def test_a_compiled_step_compiles_its_kernels_ahead_on_threads_on_the_fake_gpu(tmp_path):
  """Before its first run a compiled step dry-runs on scratch copies of its inputs: the Triton kernels it meets
  (through `kernels.run`: the library's, the synthesized ones, the elementwise plans and the reductions' passes)
  compile on threads instead of launching (cold caches: both blutrain's and Triton's), and none compiles on the main
  thread during the call; the calls after the first compile nothing."""
  _run_fake(f"""
import os, threading
os.environ["BLUTRAIN_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"] = {str(tmp_path / "bt")!r}, {str(tmp_path / "tr")!r}
from blutrain.backend.cuda import launch
compiles, real = [], launch._compile
def counted(fn, sig, constexprs, *a):
  key = (fn.__name__, repr(sorted(sig.items())), repr(sorted(constexprs.items())), repr(a))
  compiles.append((key, threading.current_thread().name.startswith("blutrain-compile")))
  return real(fn, sig, constexprs, *a)
launch._compile = counted
{GPT_STEP}
eager = len(compiles)  # what making the model and the batch compiled
step(x, y)
ahead = [key for key, threaded in compiles if threaded]
assert step.info["compile_ahead"].startswith(f"{{len(ahead)}} kernels on"), (step.info["compile_ahead"], compiles)
names = {{key[0] for key in ahead}}
assert len(ahead) >= 8 and {{"_attn_fwd", "_adamw_kernel", "_layer_norm_backward_kernel", "_reduce_kernel"}} <= names, names
assert all(threaded for _, threaded in compiles[eager:]), [key for key, threaded in compiles[eager:] if not threaded]
n = len(compiles)
for _ in range(2): step(x, y)
assert len(compiles) == n, compiles[n:]
""", tmp_path)


def test_a_failed_compile_ahead_leaves_the_compiling_to_the_first_run_on_the_fake_gpu(tmp_path):
  """A compile that fails on a thread ends the dry run (said in info["compile_ahead"]); the first run compiles what is
  left, one variant after another, and the step runs."""
  _run_fake(f"""
import os, threading
os.environ["BLUTRAIN_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"] = {str(tmp_path / "bt")!r}, {str(tmp_path / "tr")!r}
from blutrain.backend.cuda import launch
real = launch._compile
def flaky(fn, *a):
  if threading.current_thread().name.startswith("blutrain-compile") and fn.__name__ == "_attn_fwd":
    raise RuntimeError("no compiler today")
  return real(fn, *a)
launch._compile = flaky
{GPT_STEP}
step(x, y)
assert step.info["compile_ahead"] == "skipped: RuntimeError: no compiler today", step.info["compile_ahead"]
for _ in range(2): step(x, y)
""", tmp_path)


def test_a_dry_runs_scratch_arrays_share_one_buffer_within_its_bounds_on_the_fake_gpu(tmp_path):
  """`jit._scratch`: every input's layout over one buffer the size of the largest span, a flipped view's elements
  inside it too (its first element at the span's end)."""
  _run_fake("""
import importlib
from blutrain import dtypes
from blutrain.backend.cuda import memory
from blutrain.backend.cuda.array import CudaArray
jit = importlib.import_module("blutrain.nova.jit")
a = memory.empty((4, 6), dtypes.float32, 0)
flipped = CudaArray(a.ptr + 5 * 4, (4, 6), (6, -1), dtypes.float32, 0, a)
b = memory.empty((10,), dtypes.bfloat16, 0)
out = jit._scratch([a, flipped, b, memory.empty((0, 3), dtypes.bfloat16, 0)])
buf = out[0].owner
assert all(o.owner is buf for o in out) and buf.nbytes == 96, buf
assert [o.ptr - out[0].ptr for o in out] == [0, 20, 0, 0] and [o.strides for o in out[:2]] == [(6, 1), (6, -1)]
""", tmp_path)


def test_cudnn_convolutions_build_a_graph_once_per_layout_and_pass_the_operands(tmp_path):
  """The cuDNN path (kernels/cudnn_conv.py) over a stand-in frontend (fakegpu/fake_cudnn.py): one graph per problem,
  found again by the operands' layouts; the operands' pointers handed to `_execute`; a workspace only when the graph
  asks for one; an operand off 16 bytes copied first."""
  out = _run_fake("""
import fake_cudnn; fake_cudnn.install()
import blutrain as bt
from blutrain.backend.cuda.kernels import conv
cl = bt.channels_last
x = bt.randn(2, 16, 8, 8).to("cuda").to(bt.bfloat16).contiguous(memory_format=cl)
w = bt.randn(32, 16, 3, 3).to("cuda").to(bt.bfloat16).contiguous(memory_format=cl)
xa, wa = x._array(), w._array()
geometry = ((1, 1), (1, 1), (1, 1), 1)
y = conv.conv(xa, wa, *geometry)
assert y.shape == (2, 32, 8, 8) and y.strides == (2048, 1, 256, 32), y.strides   # channels-last in, channels-last out
ua, ub, uo = (t.uid for t in fake_cudnn.graphs[-1].tensors[:3])   # the graph's a, b and out
graph, pack, ws, handle = fake_cudnn.executed[-1]
assert graph.kind == "fwd" and pack == {ua: xa.ptr, ub: wa.ptr, uo: y.ptr} and ws == 0, (pack, ws)
for _ in range(3): conv.conv(bt.randn(2, 16, 8, 8).to("cuda").to(bt.bfloat16).contiguous(memory_format=cl)._array(),
                             wa, *geometry)
assert len(fake_cudnn.graphs) == 1 and len(fake_cudnn.executed) == 4   # one graph, found by the layouts
dw = conv.conv_grad_weight(y, xa, tuple(wa.shape), *geometry)
graph, pack, ws, _ = fake_cudnn.executed[-1]
assert graph.kind == "wgrad" and ws != 0 and dw.strides == wa.strides, (ws, dw.strides)   # its 1 MiB workspace
flat = bt.randn(2 * 16 * 8 * 8 + 1).to("cuda").to(bt.bfloat16)
off = flat[1:].view(2, 8, 8, 16).permute(0, 3, 1, 2)._array()   # channels-last, 2 bytes off 16
conv.conv(off, wa, *geometry)
graph, pack, _, _ = fake_cudnn.executed[-1]
a_uid = graph.tensors[0].uid
assert pack[a_uid] != off.ptr and pack[a_uid] % 16 == 0   # read through an aligned copy
print("ok", len(fake_cudnn.graphs))
""", tmp_path)
  assert out.split()[-2:] == ["ok", "3"], out
