"""The NCCL backend's host code on the fake GPU (tests/fakegpu/fake_cuda.py) with a fake nccl.core
(tests/fakegpu/fake_nccl.py) that logs each call: the order of events and streams around every collective, DDP's buckets reduced during backward, ZeRO-2's
reduce-scatter and all-gather, and the watchdog's timeout. Values are not checked here (nothing is computed on the
fake device): tests/cuda/test_distributed.py does that on a GPU."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cuda.core")
HERE = Path(__file__).resolve().parent
TESTS = HERE.parent

PRELUDE = '''
import sys, time
import fake_cuda, fake_nccl
fake_cuda.install()
fake_nccl.install()
log = fake_nccl.log
fake_cuda.FakeStream.record = lambda self, e: log.append(("record", self.handle, id(e)))
fake_cuda.FakeStream.wait = lambda self, e: log.append(("wait", self.handle, id(e)))
import blutrain as bt
import blutrain.distributed as dist
from blutrain.backend.cuda import runtime
compute, comm = runtime.default_stream(0).handle, runtime.comm_stream(0).handle
'''


def _run(code: str, tmp_path: Path) -> str:
  script = f"import sys; sys.path[:0] = {[str(TESTS / 'fakegpu'), str(TESTS.parent)]!r}\n{PRELUDE}\n{code}"
  r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
  return r.stdout


def test_each_collective_runs_on_the_comm_stream_between_events(tmp_path):
  _run('''
dist.init_process_group("nccl")
t = bt.randn(8, device="cuda")
calls = [lambda: dist.all_reduce(t), lambda: dist.all_reduce(t, dist.ReduceOp.AVG),
         lambda: dist.broadcast(t, 0), lambda: dist.all_gather_into_tensor(bt.empty(8, device="cuda"), t),
         lambda: dist.reduce_scatter_tensor(bt.empty(8, device="cuda"), t)]
for call in calls:
  log.clear()
  call()
  i = next(k for k, e in enumerate(log) if e[0] not in ("record", "wait"))
  (rec, wait, coll, end, after) = log[i - 2:i + 3]  # (the allocator may record events of its own for freed blocks)
  assert rec[:2] == ("record", compute) and wait == ("wait", comm, rec[2]), log   # comm waits for the producers
  assert coll[1] == comm, log                                                       # the NCCL call on the comm stream
  assert end[:2] == ("record", comm) and after == ("wait", compute, end[2]), log   # compute waits for it: no host sync
log.clear()
work = dist.all_reduce(t, async_op=True)
assert [e[0] for e in log] == ["record", "wait", "allreduce", "record"], log       # async: nobody waits yet
work.wait()
assert log[-1] == ("wait", compute, log[-2][2])
assert dist.get_backend() == "nccl" and dist.get_world_size() == 1
log.clear()
dist.barrier()  # an all-reduce of one element whose end event the host waits for
assert [e[0] for e in log if e[0] not in ("record", "wait")] == ["allreduce"], log
sub = dist.new_group([0])
log.clear()
dist.all_reduce(t, group=sub)
assert [e[0] for e in log if e[0] not in ("record", "wait")] == ["allreduce"] and sub.ranks == [0], log
with __import__("pytest").raises(RuntimeError, match="contiguous"): dist.all_reduce(bt.randn(4, 4, device="cuda").t())
with __import__("pytest").raises(RuntimeError, match="cuda tensors"): dist.all_reduce(bt.ones(3))
dist.destroy_process_group()
assert log[-1] == ("destroy",)
''', tmp_path)


def test_ddp_reduces_buckets_during_backward_and_zero2_shards(tmp_path):
  _run('''
from blutrain.nn.parallel import DistributedDataParallel
from blutrain.distributed.optim import ZeroRedundancyOptimizer
dist.init_process_group("nccl")
net = bt.nn.Sequential(*[bt.nn.Linear(64, 64) for _ in range(6)]).to("cuda")
ddp = DistributedDataParallel(net, bucket_cap_mb=64 * 65 * 4 * 2 / 2**20)  # two layers a bucket: three buckets
assert [e[0] for e in log].count("broadcast") == 12                         # rank 0's weights and biases at wrap time
for _ in range(2):                                                          # the second backward uses rebuilt buckets
  log.clear()
  with bt.autocast(device_type="cuda", dtype=bt.bfloat16):
    loss = ddp(bt.randn(4, 64, device="cuda")).float().square().mean()
  before = fake_cuda.launches[0]
  loss.backward()
  end = fake_cuda.launches[0]
  reduces = [e for e in log if e[0] == "allreduce"]
  assert len(reduces) == 3 and all(e[1] == comm and e[2] == "AVG" for e in reduces), log
  assert reduces[0][3] < reduces[-1][3] <= end and reduces[0][3] < end - 10   # the first bucket goes while backward runs
with ddp.no_sync():
  log.clear()
  ddp(bt.randn(4, 64, device="cuda")).sum().backward()
  assert not [e for e in log if e[0] == "allreduce"]
net = bt.nn.Sequential(*[bt.nn.Linear(64, 64) for _ in range(6)]).to("cuda")  # ZeRO-2 reduces without DDP
opt = ZeroRedundancyOptimizer(net.parameters(), bt.optim.AdamW, stage=2, bucket_cap_mb=64 * 65 * 4 * 2 / 2**20, lr=1e-3)
log.clear()
loss = net(bt.randn(4, 64, device="cuda")).square().mean()
loss.backward()
end = fake_cuda.launches[0]
scatters = [e for e in log if e[0] == "reduce_scatter"]
assert len(scatters) == 3 and all(e[1] == comm and e[2] == "AVG" for e in scatters), log
assert scatters[0][3] < scatters[1][3] < scatters[2][3] <= end  # each bucket as its layers are done, during backward
assert all(p.grad is None for p in net.parameters())                   # its gradients freed
opt.clip_grad_norm_(1.0)
log.clear()
opt.step()
names = [e[0] for e in log if e[0] in ("reduce_scatter", "allgather", "allreduce")]
assert names == ["allgather"] * 3, names
''', tmp_path)


def test_compiled_ddp_step_overlaps_its_all_reduces_on_a_side_stream_inside_the_cuda_graph(tmp_path):
  """Under bt.compile DDP's buckets are collective ops whose NCCL calls go on a side stream of the step's stream,
  forked after the bucket's gradients and joined before the optimizer reads them, so the CUDA graph captures them
  beside the backward and a replay launches the graph alone."""
  _run('''
from blutrain.nn.parallel import DistributedDataParallel
dist.init_process_group("nccl")
net = bt.nn.Sequential(*[bt.nn.Linear(64, 64) for _ in range(6)]).to("cuda")
ddp = DistributedDataParallel(net, bucket_cap_mb=64 * 65 * 4 * 2 / 2**20)  # three buckets
opt = bt.optim.AdamW(ddp.parameters(), lr=1e-3)
@bt.compile
def step(x):
  loss = ddp(x).square().mean()
  loss.backward(); opt.step(); opt.zero_grad()
  return loss
x = bt.randn(4, 64, device="cuda")
reduces, launches = [], []
for i in range(5):  # the first call's graph once, the steady one kernel by kernel on its pool, captured, replayed twice
  log.clear()
  before = fake_cuda.launches[0]
  step(x)
  launches.append(fake_cuda.launches[0] - before)
  reduces.append([e[1] for e in log if e[0] == "allreduce"])
  if i == 2:  # the capture: each all-reduce forked onto the side stream, then joined by the step's stream
    at = [k for k, e in enumerate(log) if e[0] == "allreduce"]
    side = log[at[0]][1]
    for k in at:
      assert log[k - 1][:2] == ("wait", side) and log[k + 1][:2] == ("record", side), log[k - 1:k + 2]
      forked_after = [e for e in log[:k - 1] if e[0] == "record" and e[2] == log[k - 1][2]]
      assert forked_after and forked_after[-1][1] != side
      joins = [e for e in log[k + 2:] if e[0] == "wait" and e[2] == log[k + 1][2]]
      assert joins and joins[0][1] == forked_after[-1][1], "the step's stream waits for the all-reduce"
    first_join = min(j for j, e in enumerate(log) if e[0] == "wait" and e[1] != side and j > at[0]
                     and any(log[k + 1][2] == e[2] for k in at))
    assert first_join > at[-1], "every bucket is reduced before the first join: they overlap the backward"
assert step.info["cuda_graph"] == "on" and step.captures == 2  # the first call's graph (AdamW's state), the steady one
assert [len(r) for r in reduces] == [3, 3, 3, 0, 0], reduces   # replays run the captured calls: no host call
assert all(s not in (comm, compute) for r in reduces for s in r), reduces  # a graph pool's side stream, the step's
assert launches[3] == launches[4] == 1, launches              # the graph (the loss is copied out by a memcpy)
''', tmp_path)


def test_a_stuck_collective_times_out_through_the_watchdog(tmp_path):
  out = _run('''
store = dist.TCPStore("127.0.0.1", 0, is_master=True, secret="s", timeout=5)
dist.init_process_group("nccl", timeout=0.3, store=store)  # the watchdog publishes this rank's count to the store
fake_cuda.FakeEvent.is_done = False  # nothing the comm stream records ever completes
t = bt.randn(8, device="cuda")
work = dist.all_reduce(t, async_op=True)
start = time.monotonic()
while dist._world.error is None and time.monotonic() - start < 10: time.sleep(0.05)
assert ("abort",) in log
try:
  work.wait()
except RuntimeError as e:
  print("ERROR", e)
''', tmp_path)
  assert "ERROR all_reduce (collective #1 of the nccl group of ranks [0])" in out and "timed out after 0.3 s" in out
  assert "did not arrive: none (they arrived; the transfer stalled)" in out  # rank 0's count in the store is 1



def test_a_compiled_step_that_never_completes_times_out_and_the_next_call_raises(tmp_path):
  """A replayed graph's NCCL calls run without the host: after queueing the step, the group's watchdog watches it,
  aborts the communicator when it does not complete in time, and the next call raises the timeout error."""
  out = _run('''
from blutrain.nn.parallel import DistributedDataParallel
store = dist.TCPStore("127.0.0.1", 0, is_master=True, secret="s", timeout=5)
dist.init_process_group("nccl", timeout=30, store=store)  # short only for the step that never completes, below: a
net = bt.nn.Sequential(bt.nn.Linear(16, 16), bt.nn.Linear(16, 16)).to("cuda")  # loaded machine may take longer for
ddp = DistributedDataParallel(net)  # the wrapper's broadcast and the first steps' collectives
opt = bt.optim.AdamW(ddp.parameters(), lr=1e-3)
@bt.compile
def step(x):
  loss = ddp(x).square().mean()
  loss.backward(); opt.step(); opt.zero_grad()
  return loss
x = bt.randn(4, 16, device="cuda")
for _ in range(3): step(x)  # the first call's graph, warm, captured and replayed: every run completes
assert step.info["cuda_graph"] == "on" and ("abort",) not in log
fake_cuda.FakeEvent.is_done = False  # the next replay never completes
dist._world.timeout = 0.3
step(x)
start = time.monotonic()
while dist._world.error is None and time.monotonic() - start < 10: time.sleep(0.05)
assert ("abort",) in log
try:
  step(x)
except RuntimeError as e:
  print("ERROR", e)
''', tmp_path)
  assert "ERROR a compiled step with 1 collective (collective #" in out and "timed out after 0.3 s" in out


def test_the_wrappers_add_ops_per_bucket_not_per_parameter(tmp_path):
  """The eager step is host-bound, so DDP and ZeRO-2 may add work per bucket but no op per parameter: DDP's backward
  one cat a bucket (its gradients come back as tensors carved from the averaged bucket, no op), ZeRO-2's backward a
  cat and the reduce-scatter's output a bucket, and its step the slice of each bucket's piece besides the local
  optimizer's ops (the parameters live in the buckets the all-gathers write)."""
  _run('''
from blutrain.ops import core
from blutrain.nn.parallel import DistributedDataParallel
from blutrain.distributed.optim import ZeroRedundancyOptimizer
dist.init_process_group("nccl")
count, apply = [0], core.Op.__call__
def counted(*a, **k):
  count[0] += 1
  return apply(*a, **k)
core.Op.__call__ = counted
def ops_of(fn):
  count[0] = 0
  fn()
  return count[0]
cap = 64 * 65 * 4 * 2 / 2**20  # two layers a bucket
x = bt.randn(4, 64, device="cuda")
for layers in (6, 12):
  nets = [bt.nn.Sequential(*[bt.nn.Linear(64, 64) for _ in range(layers)]).to("cuda") for _ in range(3)]
  ddp = DistributedDataParallel(nets[1], bucket_cap_mb=cap)
  zero = ZeroRedundancyOptimizer(nets[2].parameters(), bt.optim.AdamW, stage=2, bucket_cap_mb=cap, lr=1e-3)
  runs = [(nets[0], bt.optim.AdamW(nets[0].parameters(), lr=1e-3)), (ddp, bt.optim.AdamW(ddp.parameters(), lr=1e-3)),
          (nets[2], zero)]
  counts = []
  for step in range(3):  # the third step counted: buckets rebuilt, optimizer state made
    counts = []
    for model, opt in runs:
      loss = model(x).square().mean()
      counts += [ops_of(loss.backward), ops_of(opt.step)]
      opt.zero_grad()
  (plain, plain_step), (ddp_ops, ddp_step), (zero_ops, zero_step) = zip(counts[::2], counts[1::2])
  buckets = layers // 2
  assert len(ddp._buckets) == len(zero.buckets) == buckets
  assert ddp_ops - plain == buckets and ddp_step == plain_step, (layers, counts)
  assert zero_ops - plain == 2 * buckets and zero_step == buckets + 2, (layers, counts)
''', tmp_path)
