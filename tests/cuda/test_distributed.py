"""The NCCL process group on GPUs: every collective against numpy, DDP and ZeRO-2 (eager and compiled) against one
process on the whole batch. Written for any world size: `python -m pytest tests/cuda/test_distributed.py` runs it at
world size 1, and `python -m blutrain.distributed.launch --nproc-per-node N $(which pytest) tests/cuda/test_distributed.py` on N GPUs
(keep NCCL_NVLS_ENABLE=0 set on the lent machines). Each rank can compute every rank's inputs (seeded by rank), so
each checks the full result itself."""
import numpy as np
import pytest

import blutrain as bt
import blutrain.distributed as dist
from blutrain.distributed.optim import ZeroRedundancyOptimizer
from blutrain.nn.parallel import DistributedDataParallel

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def world():
  dist.init_process_group("nccl", timeout=120)
  yield dist.get_rank(), dist.get_world_size()
  dist.destroy_process_group()


def values(n, shape, seed=0):
  return [np.random.default_rng(seed + k).standard_normal(shape).astype(np.float32) for k in range(n)]


def on_gpu(a, dtype=bt.float32): return bt.from_numpy(np.ascontiguousarray(a)).to("cuda").to(dtype)


@pytest.mark.parametrize("op, ref", [(dist.ReduceOp.SUM, lambda v: sum(v)), (dist.ReduceOp.AVG, lambda v: sum(v) / len(v)),
                                     (dist.ReduceOp.MAX, lambda v: np.max(v, 0)), (dist.ReduceOp.MIN, lambda v: np.min(v, 0))])
@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce(world, op, ref, async_op):
  r, n = world
  v = values(n, (1000, 3))
  t = on_gpu(v[r])
  work = dist.all_reduce(t, op, async_op=async_op)
  if async_op: work.wait()
  np.testing.assert_allclose(t.cpu().numpy(), ref(v), rtol=1e-5, atol=1e-5)


def test_all_reduce_bfloat16(world):
  r, n = world
  v = [on_gpu(a, bt.bfloat16).float().cpu().numpy() for a in values(n, (4096,))]
  t = on_gpu(v[r], bt.bfloat16)
  dist.all_reduce(t)
  np.testing.assert_allclose(t.float().cpu().numpy(), sum(v), rtol=2e-2, atol=2e-2)


def test_all_gather_reduce_scatter_broadcast(world):
  r, n = world
  v = values(n, (257,))
  out = bt.empty(n * 257, device="cuda")
  dist.all_gather_into_tensor(out, on_gpu(v[r]))
  np.testing.assert_array_equal(out.cpu().numpy(), np.concatenate(v))
  big = values(n, (n * 300,), seed=10)
  mine = bt.empty(300, device="cuda")
  dist.reduce_scatter_tensor(mine, on_gpu(big[r]), dist.ReduceOp.SUM)
  np.testing.assert_allclose(mine.cpu().numpy(), sum(big)[r * 300:(r + 1) * 300], rtol=1e-5, atol=1e-5)
  b = on_gpu(v[r])
  dist.broadcast(b, src=n - 1)
  np.testing.assert_array_equal(b.cpu().numpy(), v[n - 1])
  dist.barrier()


def test_send_recv_ring(world):
  r, n = world
  if n == 1: pytest.skip("NCCL's send to oneself needs a group call; the ring needs two ranks")
  v = values(n, (64,))
  got = bt.empty(64, device="cuda")
  if r % 2 == 0:
    dist.send(on_gpu(v[r]), (r + 1) % n); dist.recv(got, (r - 1) % n)
  else:
    dist.recv(got, (r - 1) % n); dist.send(on_gpu(v[r]), (r + 1) % n)
  np.testing.assert_array_equal(got.cpu().numpy(), v[(r - 1) % n])


def _net(seed):
  bt.manual_seed(seed)
  return bt.nn.Sequential(bt.nn.Linear(32, 64), bt.nn.GELU(), bt.nn.Linear(64, 64), bt.nn.GELU(), bt.nn.Linear(64, 8)).to("cuda")


def _batch(step, n, r=None):
  rng = np.random.default_rng(100 + step)
  x, y = rng.standard_normal((4 * n, 32)).astype(np.float32), rng.standard_normal((4 * n, 8)).astype(np.float32)
  if r is not None: x, y = x[4 * r:4 * (r + 1)], y[4 * r:4 * (r + 1)]
  return on_gpu(x), on_gpu(y)


@pytest.mark.parametrize("amp", [False, True])
def test_ddp_equals_one_process_on_the_whole_batch(world, amp):
  r, n = world
  ddp = DistributedDataParallel(_net(7 + r), bucket_cap_mb=0.01)  # several buckets
  ref = _net(0)
  ref.load_state_dict({k.removeprefix("module."): v.detach().clone() for k, v in ddp.state_dict().items()})
  opt, ref_opt = bt.optim.AdamW(ddp.parameters(), lr=1e-2), bt.optim.AdamW(ref.parameters(), lr=1e-2)
  tol = 3e-2 if amp else 1e-5
  for step in range(3):
    for model, batch in ((ddp, _batch(step, n, r)), (ref, _batch(step, n))):
      with bt.autocast(device_type="cuda", dtype=bt.bfloat16, enabled=amp):
        loss = ((model(batch[0]).float() - batch[1]) ** 2).mean()
      loss.backward()
    for p, q in zip(ddp.parameters(), ref.parameters()):
      np.testing.assert_allclose(p.grad.cpu().numpy(), q.grad.cpu().numpy(), rtol=tol, atol=tol)
    opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
  for p, q in zip(ddp.parameters(), ref.parameters()):
    np.testing.assert_allclose(p.detach().cpu().numpy(), q.detach().cpu().numpy(), rtol=tol, atol=tol)


def test_zero2_equals_adamw(world):
  r, n = world
  net, ref = _net(0), _net(0)
  opt = ZeroRedundancyOptimizer(net.parameters(), bt.optim.AdamW, stage=2, lr=1e-2, weight_decay=0.1)
  ref_opt = bt.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
  for step in range(3):
    ((net(_batch(step, n, r)[0]) - _batch(step, n, r)[1]) ** 2).mean().backward()
    ((ref(_batch(step, n)[0]) - _batch(step, n)[1]) ** 2).mean().backward()
    opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
  for p, q in zip(net.parameters(), ref.parameters()):
    np.testing.assert_allclose(p.detach().cpu().numpy(), q.detach().cpu().numpy(), rtol=1e-5, atol=1e-5)


def _step(net, opt):
  def step(x, y):
    loss = ((net(x) - y) ** 2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    return loss
  return step


def test_compiled_ddp_step_equals_eager_ddp_and_one_process(world):
  """The compiled step (one CUDA graph, the bucket all-reduces in it on the step's stream) against the same step
  eagerly (its all-reduces on the communication stream) and one process on the whole batch."""
  r, n = world
  nets = [_net(7 + r), _net(0), _net(0)]
  ddp = DistributedDataParallel(nets[0], bucket_cap_mb=0.01)  # several buckets
  for ref in nets[1:]:
    ref.load_state_dict({k.removeprefix("module."): v.detach().clone() for k, v in ddp.state_dict().items()})
  eager = DistributedDataParallel(nets[1], bucket_cap_mb=0.01)
  opts = [bt.optim.AdamW(m.parameters(), lr=1e-2) for m in (ddp, eager, nets[2])]
  compiled = bt.compile(_step(ddp, opts[0]))
  eager_step, ref_step = _step(eager, opts[1]), _step(nets[2], opts[2])
  for step in range(5):
    loss, eager_loss = compiled(*_batch(step, n, r)), eager_step(*_batch(step, n, r))
    ref_step(*_batch(step, n))
    np.testing.assert_allclose(loss.item(), eager_loss.item(), rtol=1e-5, atol=1e-6)
  assert compiled.captures == 2 and compiled.info["cuda_graph"] == "on", compiled.info  # first call's graph, steady
  for p, q, s in zip(ddp.parameters(), eager.parameters(), nets[2].parameters()):
    np.testing.assert_allclose(p.detach().cpu().numpy(), q.detach().cpu().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(p.detach().cpu().numpy(), s.detach().cpu().numpy(), rtol=1e-4, atol=1e-5)


def test_compiled_zero2_step_equals_adamw(world):
  r, n = world
  net, ref = _net(0), _net(0)
  opt = ZeroRedundancyOptimizer(net.parameters(), bt.optim.AdamW, stage=2, bucket_cap_mb=0.01, lr=1e-2,
                                weight_decay=0.1)
  ref_opt = bt.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
  compiled, ref_step = bt.compile(_step(net, opt)), _step(ref, ref_opt)
  for step in range(5):
    compiled(*_batch(step, n, r)); ref_step(*_batch(step, n))
  assert compiled.captures == 2 and compiled.info["cuda_graph"] == "on", compiled.info  # first call's graph, steady
  for p, q in zip(net.parameters(), ref.parameters()):
    np.testing.assert_allclose(p.detach().cpu().numpy(), q.detach().cpu().numpy(), rtol=1e-4, atol=1e-5)
