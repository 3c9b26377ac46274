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


def train_zero(stage, r, n, m, steps):
  net = DistributedDataParallel(m) if stage == 1 else m
  opt = ZeroRedundancyOptimizer(m.parameters(), bt.optim.AdamW, stage=stage, lr=0.05, weight_decay=0.1)
  for step in steps:
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
  return {"param": worst(max(diff(p, q) for p, q in zip(m.parameters(), ref.parameters()))), "state_numel": state,
          "param_numel": sum(p.numel() for p in m.parameters())}


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
  opt = ZeroRedundancyOptimizer(m.parameters(), bt.optim.AdamW, stage=2, lr=0.05, weight_decay=0.1)
  scalars = {k: bt.tensor(v, dtype=bt.float64) for k, v in state["scalars"].items()}
  opt.load_full_state({k: v for k, v in full.items() if not k.startswith("model.")}, scalars)
  loss_of(m, *batch(step, r, n)).backward(); opt.step()
  got = np.concatenate([p.detach().numpy().reshape(-1) for p in m.parameters()])
  return {"param": worst(float(np.abs(got - np.load(f"{path}/expected.npy")).max()))}


if __name__ == "__main__":
  dist.init_process_group("mpi", timeout=60)
  r, n = dist.get_rank(), dist.get_world_size()
  name, args = sys.argv[1], sys.argv[2:]
  out = {"ddp": case_ddp, "no_sync": case_no_sync, "zero": case_zero, "save": case_save, "load": case_load}[name](*args, r, n)
  if r == 0: print(json.dumps({"case": name, "world": n, **out}), flush=True)
  dist.destroy_process_group()
