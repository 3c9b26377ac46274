"""Runs under `mpiexec -n N`: data-parallel training checks against one process on the concatenated batch.

Usage: worker.py CASE [ARGS...]; rank 0 prints one JSON line per case with the largest differences over all ranks.
"""
import json
import sys

import numpy as np

import blutrain as bt
import blutrain.distributed as dist
from blutrain.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from blutrain.distributed.optim import ZeroRedundancyOptimizer
from blutrain.nn.parallel import DistributedDataParallel

B, STEPS = 8, 3


def model(seed):
  bt.manual_seed(seed)
  return bt.nn.Sequential(bt.nn.Linear(6, 16), bt.nn.GELU(), bt.nn.Linear(16, 3))


def batch(step, rank=None, world=None):
  rng = np.random.default_rng(step)
  x, y = rng.standard_normal((B, 6)).astype(np.float32), rng.standard_normal((B, 3)).astype(np.float32)
  if rank is not None: x, y = x[rank * B // world:(rank + 1) * B // world], y[rank * B // world:(rank + 1) * B // world]
  return bt.from_numpy(x), bt.from_numpy(y)


def loss_of(m, x, y): return ((m(x) - y) ** 2).mean()


def replica(ddp_model):
  ref = model(0)
  ref.load_state_dict({k.removeprefix("module."): v.detach().clone() for k, v in ddp_model.state_dict().items()})
  return ref


def diff(a, b): return float(np.abs(a.detach().numpy() - b.detach().numpy()).max())


def worst(x):
  t = bt.tensor([x])
  dist.all_reduce(t, dist.ReduceOp.MAX)
  return t.item()


def case_ddp(r, n):
  m = DistributedDataParallel(model(100 + r), bucket_cap_mb=200 / 2**20)  # 200-byte buckets: several per backward
  ref = replica(m)
  opt, ref_opt = bt.optim.SGD(m.parameters(), lr=0.1), bt.optim.SGD(ref.parameters(), lr=0.1)
  grad_err = 0.0
  for step in range(STEPS):
    loss_of(m, *batch(step, r, n)).backward()
    loss_of(ref, *batch(step)).backward()
    grad_err = max(grad_err, max(diff(p.grad, q.grad) for p, q in zip(m.parameters(), ref.parameters())))
    opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
  return {"buckets": len(m._buckets), "grad": worst(grad_err),
          "param": worst(max(diff(p, q) for p, q in zip(m.parameters(), ref.parameters())))}


def case_no_sync(r, n):
  m = DistributedDataParallel(model(100 + r))
  ref = replica(m)
  with m.no_sync():
    for step in range(2): loss_of(m, *batch(step, r, n)).backward()
  loss_of(m, *batch(2, r, n)).backward()
  for step in range(3): loss_of(ref, *batch(step)).backward()
  return {"grad": worst(max(diff(p.grad, q.grad) for p, q in zip(m.parameters(), ref.parameters())))}


def train_zero(stage, r, n, m, steps, bucket_cap_mb=100 / 2**20, move_at=None):
  """ZeRO training of m (100-byte buckets: one a parameter, some padded). At step `move_at` the first parameter is
  moved out of the memory the optimizer gathers into (`p.data = ...`), which the optimizer must still update."""
  net = DistributedDataParallel(m) if stage == 1 else m
  opt = ZeroRedundancyOptimizer(m.parameters(), bt.optim.AdamW, stage=stage, bucket_cap_mb=bucket_cap_mb, lr=0.05,
                                weight_decay=0.1)
  for step in steps:
    if step == move_at:
      first = next(m.parameters())
      first.data = first.detach().clone()
    loss_of(net, *batch(step, r, n)).backward()
    opt.step(); opt.zero_grad()
  return opt


def case_zero(stage, r, n):
  m = model(0)
  ref = model(0)
  ref_opt = bt.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
  opt = train_zero(int(stage), r, n, m, range(STEPS))
  for step in range(STEPS):
    loss_of(ref, *batch(step)).backward()
    ref_opt.step(); ref_opt.zero_grad()
  state = sum(v.numel() for s in opt.optim.state.values() for v in s.values() if isinstance(v, bt.Tensor) and v.ndim)
  whole = model(0)  # one bucket of every parameter, gathered into their memory, and one parameter moved out midway
  train_zero(int(stage), r, n, whole, range(STEPS), bucket_cap_mb=25, move_at=1)
  return {"param": worst(max(diff(p, q) for p, q in zip(m.parameters(), ref.parameters()))), "state_numel": state,
          "param_one_bucket": worst(max(diff(p, q) for p, q in zip(whole.parameters(), ref.parameters()))),
          "param_numel": sum(p.numel() for p in m.parameters()), "shard_numel": sum(s.numel() for s in opt.shards),
          "buckets": len(opt.buckets)}


def case_zero_accumulate_and_clip(r, n):
  """ZeRO-2 with two backwards per step (accumulation across reduce-scatters) and its sharded gradient clipping,
  against AdamW with clip_grad_norm_ on the whole batch."""
  m, ref = model(0), model(0)
  opt = ZeroRedundancyOptimizer(m.parameters(), bt.optim.AdamW, stage=2, bucket_cap_mb=100 / 2**20, lr=0.05)
  ref_opt = bt.optim.AdamW(ref.parameters(), lr=0.05)
  norm_err = 0.0
  for step in range(STEPS):
    for micro in (2 * step, 2 * step + 1):
      loss_of(m, *batch(micro, r, n)).backward()
      loss_of(ref, *batch(micro)).backward()
    assert all(p.grad is None for p in m.parameters())  # freed as their buckets were reduce-scattered
    norm, ref_norm = opt.clip_grad_norm_(0.5), bt.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    norm_err = max(norm_err, abs(norm.item() - ref_norm.item()))
    opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
  return {"norm": worst(norm_err), "param": worst(max(diff(p, q) for p, q in zip(m.parameters(), ref.parameters())))}


def case_save(path, r, n):
  """ZeRO-2 for STEPS steps, a sharded checkpoint, then one more step whose parameters are the expected result."""
  m = model(0)
  opt = train_zero(2, r, n, m, range(STEPS))
  pieces = dict(opt.shard_state()["pieces"])
  if r == 0: pieces.update({f"model.{k}": (v.numel(), 0, v.reshape(-1)) for k, v in m.state_dict().items()})
  scalars = {k: v.item() if isinstance(v, bt.Tensor) else v for k, v in opt.shard_state()["scalars"].items()}
  save_sharded_checkpoint(path, STEPS, pieces, r, n, state={"scalars": scalars}, barrier=dist.barrier)
  loss_of(m, *batch(STEPS, r, n)).backward(); opt.step()
  if r == 0: np.save(f"{path}/expected.npy", np.concatenate([p.detach().numpy().reshape(-1) for p in m.parameters()]))
  return {"saved": True}


def case_load(path, r, n):
  full, state, step = load_sharded_checkpoint(path)
  m = model(1)
  m.load_state_dict({k: full[f"model.{k}"].reshape(v.shape) for k, v in m.state_dict().items()})
  opt = ZeroRedundancyOptimizer(m.parameters(), bt.optim.AdamW, stage=2, bucket_cap_mb=100 / 2**20, lr=0.05,
                                weight_decay=0.1)
  scalars = {k: bt.tensor(v, dtype=bt.float64) for k, v in state["scalars"].items()}
  opt.load_full_state({k: v for k, v in full.items() if not k.startswith("model.")}, scalars)
  loss_of(m, *batch(step, r, n)).backward(); opt.step()
  got = np.concatenate([p.detach().numpy().reshape(-1) for p in m.parameters()])
  return {"param": worst(float(np.abs(got - np.load(f"{path}/expected.npy")).max()))}


def case_collectives(r, n):
  """Every collective against numpy on the values each rank can compute for all ranks; errors by name."""
  rng = [np.random.default_rng(k) for k in range(n)]
  vals = [g.standard_normal((3, 4)).astype(np.float32) for g in rng]
  err = {}
  for op, ref in [(dist.ReduceOp.SUM, sum(vals)), (dist.ReduceOp.AVG, sum(vals) / n),
                  (dist.ReduceOp.MAX, np.max(vals, 0)), (dist.ReduceOp.MIN, np.min(vals, 0))]:
    t = bt.from_numpy(vals[r].copy())
    dist.all_reduce(t, op)
    err[f"all_reduce_{op.name}"] = float(np.abs(t.numpy() - ref).max())
  base = bt.from_numpy(np.ascontiguousarray(vals[r].T.copy()))
  view = base.t()  # a non-contiguous view: reduced through a staging copy and written back
  work = dist.all_reduce(view, dist.ReduceOp.AVG, async_op=True)
  while not work.is_completed(): pass
  work.wait()
  err["all_reduce_view"] = float(np.abs(view.numpy() - sum(vals) / n).max())
  h = bt.from_numpy(vals[r]).to(bt.bfloat16)
  dist.all_reduce(h)
  err["all_reduce_bf16"] = float(np.abs(h.float().numpy() - sum(v.astype(np.float32) for v in [
    bt.from_numpy(v).to(bt.bfloat16).float().numpy() for v in vals])).max())
  out = bt.zeros(n * 12)
  dist.all_gather_into_tensor(out, bt.from_numpy(vals[r]))
  err["all_gather"] = float(np.abs(out.numpy() - np.concatenate([v.reshape(-1) for v in vals])).max())
  big = [g.standard_normal(n * 5).astype(np.float32) for g in rng]
  mine = bt.zeros(5)
  dist.reduce_scatter_tensor(mine, bt.from_numpy(big[r]), dist.ReduceOp.SUM)
  err["reduce_scatter"] = float(np.abs(mine.numpy() - sum(big)[r * 5:(r + 1) * 5]).max())
  b = bt.from_numpy(vals[r].copy())
  dist.broadcast(b, src=n - 1)
  err["broadcast"] = float(np.abs(b.numpy() - vals[n - 1]).max())
  nxt, prv = (r + 1) % n, (r - 1) % n
  got = bt.zeros(3, 4)
  sent = dist.isend(bt.from_numpy(vals[r]), nxt)
  dist.recv(got, prv)
  sent.wait()
  err["send_recv"] = float(np.abs(got.numpy() - vals[prv]).max())
  evens = dist.new_group([k for k in range(n) if k % 2 == 0])
  if r % 2 == 0:
    t = bt.from_numpy(vals[r].copy())
    dist.all_reduce(t, group=evens)
    err["new_group"] = float(np.abs(t.numpy() - sum(vals[0::2])).max())
  else:
    err["new_group"] = 0.0 if evens is None else 1.0
  dist.barrier()
  return {k: worst(v) for k, v in err.items()}


def case_functional(r, n):
  """The collective ops of blutrain.ops.collective eagerly: values against numpy, gradients against the math of the
  ranks' summed losses (inputs are strided views), on the world and on a subgroup; and their errors."""
  from blutrain.ops import collective
  g = dist.get_group()
  rng = [np.random.default_rng(10 + k) for k in range(n)]
  xs = [k.standard_normal((2 * n, 3)).astype(np.float32) for k in rng]
  ws = [k.standard_normal((2 * n, 3)).astype(np.float32) for k in rng]
  big = [k.standard_normal((2 * n * n, 3)).astype(np.float32) for k in rng]
  err = {}

  def run(name, fn, x, w, want, want_grad):
    t = bt.from_numpy(np.ascontiguousarray(x.T)).t().requires_grad_(True)  # a strided view of the values
    y = fn(t)
    (y * bt.from_numpy(w)).sum().backward()
    err[name] = float(np.abs(y.detach().numpy() - want).max())
    err[name + "_grad"] = float(np.abs(t.grad.numpy() - want_grad).max())

  block = lambda a, k: a[k * a.shape[0] // n:(k + 1) * a.shape[0] // n]
  run("all_reduce_sum", lambda t: collective.all_reduce(t, "sum", g.gid, n), xs[r], ws[r], sum(xs), sum(ws))
  run("all_reduce_avg", lambda t: collective.all_reduce(t, "avg", g.gid, n), xs[r], ws[r], sum(xs) / n, sum(ws) / n)
  run("reduce_scatter_avg", lambda t: collective.reduce_scatter(t, "avg", g.gid, n), xs[r], block(ws[r], 0)[:2],
      block(sum(xs) / n, r), np.concatenate([block(w, 0)[:2] for w in ws]) / n)
  run("all_gather", lambda t: collective.all_gather(t, g.gid, n), xs[r], big[r], np.concatenate(xs), block(sum(big), r))
  t = bt.from_numpy(xs[r])
  err["all_reduce_max"] = float(np.abs(collective.all_reduce(t, "max", g.gid, n).numpy() - np.max(xs, 0)).max())
  err["input_kept"] = float(np.abs(t.numpy() - xs[r]).max())
  pair = dist.new_group([0, 1])
  err["subgroup"] = 0.0 if pair is None else \
    float(np.abs(collective.all_reduce(t, "sum", pair.gid, 2).numpy() - xs[0] - xs[1]).max())
  messages = []
  for call in (lambda: collective.reduce_scatter(bt.ones(2 * n + 1), "sum", g.gid, n),
               lambda: collective.all_reduce(bt.ones(3, dtype=bt.int64), "avg", g.gid, n),
               lambda: collective.all_reduce(bt.ones(3), "mean", g.gid, n),
               lambda: collective.all_reduce(bt.ones(3), "sum", 12345, n),
               lambda: collective.all_reduce(bt.ones(3), "sum", g.gid, n + 1),
               lambda: collective.all_reduce(bt.ones(3, requires_grad=True), "max", g.gid, n).sum().backward()):
    try: call(); messages.append(None)
    except (RuntimeError, TypeError, ValueError) as e: messages.append(f"{type(e).__name__}: {e}")
  return {**{k: worst(v) for k, v in err.items()}, "messages": messages}


def kernel_calls(compiled):
  """The kernels a compiled step calls, in order, read from its generated source (one call a line)."""
  source = open(compiled.info["source"]).read()
  return [line.split('kernels["')[1].split('"')[0] for line in source.splitlines() if 'kernels["' in line]


def case_compile(r, n):
  """A DDP step with AdamW under bt.compile (the first call's graph creates AdamW's state, the second's is replayed)
  against the same step eagerly and against one process on the whole batch; and the in-place API's refusal under a
  capture."""
  def make_step(net, opt):
    def step(x, y):
      loss = loss_of(net, x, y)
      loss.backward(); opt.step(); opt.zero_grad()
      return loss
    return step

  m = DistributedDataParallel(model(100 + r), bucket_cap_mb=200 / 2**20)
  eager, ref = DistributedDataParallel(replica(m), bucket_cap_mb=200 / 2**20), replica(m)
  adamw = lambda net: bt.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1)
  compiled = bt.compile(make_step(m, adamw(m)), dump_ir=sys.argv[2])
  eager_step, ref_step = make_step(eager, adamw(eager)), make_step(ref, adamw(ref))
  loss_err = 0.0
  for step in range(STEPS + 2):
    loss, eager_loss = compiled(*batch(step, r, n)), eager_step(*batch(step, r, n))
    ref_step(*batch(step))
    loss_err = max(loss_err, abs(loss.item() - eager_loss.item()))
  calls = kernel_calls(compiled)

  acc = DistributedDataParallel(model(100 + r))  # no_sync accumulation with a compiled micro-step
  acc_ref = replica(acc)

  def micro(x, y):
    loss = loss_of(acc, x, y)
    loss.backward()
    return loss
  compiled_micro = bt.compile(micro)
  with acc.no_sync():
    for step in range(3): compiled_micro(*batch(step, r, n))  # captured with no .grad, with .grads, replayed
  compiled_micro(*batch(3, r, n))                               # synchronized: a graph of its own
  for step in range(4): loss_of(acc_ref, *batch(step)).backward()

  def refused():
    t = bt.ones(3)
    dist.all_reduce(t)
    return t
  once = bt.compile(refused)
  try:
    once()
    error = None
  except RuntimeError as e:
    error = str(e)
  return {"captures": compiled.captures, "buckets": len(m._buckets), "all_reduces": calls.count("all_reduce"),
          "first_all_reduce": calls.index("all_reduce"), "last_matmul": len(calls) - 1 - calls[::-1].index("matmul"),
          "loss": worst(loss_err), "eager": worst(max(diff(p, q) for p, q in zip(m.parameters(), eager.parameters()))),
          "param": worst(max(diff(p, q) for p, q in zip(m.parameters(), ref.parameters()))), "error": error,
          "no_sync_captures": compiled_micro.captures,
          "no_sync_grad": worst(max(diff(p.grad, q.grad) for p, q in zip(acc.parameters(), acc_ref.parameters())))}


def case_zero_compile(stage, r, n):
  """ZeRO-1 (under DDP) or ZeRO-2 (with its sharded clipping) under bt.compile against the same step eagerly and
  plain AdamW with clip_grad_norm_ on the whole batch, over several steps."""
  stage = int(stage)

  def make_step(m, ref):
    net = DistributedDataParallel(m) if stage == 1 and not ref else m
    opt = bt.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1) if ref else ZeroRedundancyOptimizer(
      m.parameters(), bt.optim.AdamW, stage=stage, bucket_cap_mb=100 / 2**20, lr=0.05, weight_decay=0.1)

    def step(x, y):
      loss = loss_of(net, x, y)
      loss.backward()
      if stage == 2: (bt.nn.utils.clip_grad_norm_(m.parameters(), 0.5) if ref else opt.clip_grad_norm_(0.5))
      opt.step(); opt.zero_grad()
      return loss
    return step

  m, eager, ref = model(0), model(0), model(0)
  compiled = bt.compile(make_step(m, False))
  eager_step, ref_step = make_step(eager, False), make_step(ref, True)
  for step in range(STEPS + 2):
    compiled(*batch(step, r, n)); eager_step(*batch(step, r, n)); ref_step(*batch(step))
  calls = kernel_calls(compiled)
  return {"captures": compiled.captures, "reduce_scatters": calls.count("reduce_scatter"),
          "all_gathers": calls.count("all_gather"), "all_reduces": calls.count("all_reduce"),
          "eager": worst(max(diff(p, q) for p, q in zip(m.parameters(), eager.parameters()))),
          "param": worst(max(diff(p, q) for p, q in zip(m.parameters(), ref.parameters())))}


def case_timeout(r, n):
  """Rank 1 never arrives at the all_reduce; every other rank must raise within its 1 s timeout naming rank 1."""
  import os
  import time
  if r == 1:
    time.sleep(4)  # past the others' timeout and diagnosis, so they have reported before anyone leaves
    os._exit(0)
  start = time.monotonic()
  try:
    dist.all_reduce(bt.ones(3))
    print(json.dumps({"case": "timeout", "rank": r, "raised": False}), flush=True)
  except RuntimeError as e:
    print(json.dumps({"case": "timeout", "rank": r, "raised": True, "seconds": time.monotonic() - start,
                      "message": str(e)}), flush=True)
  time.sleep(3)  # leave after rank 1: mpiexec may end every rank when the first leaves without MPI_Finalize
  os._exit(0)  # the group is unusable after a timeout: no finalize


if __name__ == "__main__":
  dist.init_process_group("mpi", timeout=1.0 if sys.argv[1] == "timeout" else 60)
  r, n = dist.get_rank(), dist.get_world_size()
  name, args = sys.argv[1], sys.argv[2:] if sys.argv[1] != "compile" else []
  cases = {"ddp": case_ddp, "no_sync": case_no_sync, "zero": case_zero, "save": case_save, "load": case_load,
           "collectives": case_collectives, "zero_accumulate": case_zero_accumulate_and_clip, "compile": case_compile,
           "functional": case_functional, "zero_compile": case_zero_compile, "timeout": case_timeout}
  out = cases[name](*args, r, n)
  if r == 0: print(json.dumps({"case": name, "world": n, **out}), flush=True)
  dist.destroy_process_group()
