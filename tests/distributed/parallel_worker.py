"""Runs under `mpiexec -n N`: tensor- and context-parallel checks against one process on the whole model (float64).

Usage: parallel_worker.py CASE [ARGS...]; rank 0 prints one JSON line with the largest differences over all ranks.
"""
import json
import sys

import numpy as np

import blutrain as bt
import blutrain.distributed as dist
from blutrain.nn.parallel.context_parallel import (all_reduce_gradients, ring_attention, sequence_positions,
                                                   shard_sequence, unshard_sequence)
from blutrain.distributed.device_mesh import init_device_mesh
from blutrain.models.parallelize import parallelize_gpt
from blutrain.nn.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, vocab_parallel_cross_entropy
from blutrain.models.gpt import GPT, GPTConfig
from blutrain.nn.parallel import DistributedDataParallel

CFG = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
B, T, STEPS = 4, 8, 3


def worst(x):
  t = bt.tensor([float(x)], dtype=bt.float64)
  dist.all_reduce(t, dist.ReduceOp.MAX)
  return t.item()


def diff(a, b): return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def gpt():
  bt.manual_seed(0)
  return GPT(CFG).to(bt.float64)


def batch(step, ignore=True):
  rng = np.random.default_rng(step)
  x = rng.integers(0, CFG.vocab_size, (B, T))
  y = rng.integers(0, CFG.vocab_size, (B, T))
  if ignore: y[0, :3] = -1  # ignored targets
  return bt.from_numpy(x), bt.from_numpy(y)


def sharded_grads(ref, plan):
  """The reference model's gradients laid out as the parallel model's parameters: shard a model whose weights are
  those gradients by the same plan."""
  g = gpt()
  with bt.no_grad():
    for p, q in zip(g.parameters(), ref.parameters()): p.copy_(q.grad)
  return dict(parallelize_gpt(g, *plan).named_parameters())


def compare_training(par, ref, plan, shard=lambda x, y: (x, y), whole_loss=lambda loss: loss.item(), net=None,
                     reduce_group=None, ignore=True):
  """STEPS AdamW steps of the parallel model `par` (called through `net`, default par, on shard(batch)) and of the
  reference `ref` on the whole batch, the second step's gradients clipped; the largest loss, first-step gradient,
  gradient norm and final parameter differences, the reference's laid out by the same `plan` (parallelize_gpt's
  arguments). `whole_loss`: the whole batch's loss from this rank's; `reduce_group`: average the gradients over it
  after backward (context parallel)."""
  net = net or par
  opt = bt.optim.AdamW(par.parameters(), lr=1e-2, weight_decay=0.1)
  ref_opt = bt.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
  loss_err = grad_err = norm_err = 0.0
  for step in range(STEPS):
    x, y = batch(step, ignore)
    loss = net(*shard(x, y))[1]
    loss.backward()
    if reduce_group is not None: all_reduce_gradients(list(par.parameters()), reduce_group)
    ref_loss = ref(x, y)[1]
    ref_loss.backward()
    if step == 1:  # a clipped step: the whole model's norm from the shards
      norm_err = abs(par.clip_grad_norm_(0.05).item() - bt.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item())
    loss_err = max(loss_err, abs(whole_loss(loss) - ref_loss.item()))
    if step == 0:
      want = sharded_grads(ref, plan)
      grad_err = max(diff(p.grad.numpy(), want[name].detach().numpy()) for name, p in par.named_parameters())
    opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
  want = dict(parallelize_gpt(ref, *plan).named_parameters())
  param_err = max(diff(p.detach().numpy(), want[name].detach().numpy()) for name, p in par.named_parameters())
  full, ref_state = par.full_state_dict(), ref.state_dict()  # the shards gathered back: the whole model's weights
  full_err = max(diff(full[k].numpy(), v.numpy()) for k, v in ref_state.items()) if set(full) == set(ref_state) else 1.0
  return {"loss": worst(loss_err), "grad": worst(grad_err), "norm": worst(norm_err), "param": worst(param_err),
          "full": worst(full_err)}


def mean_over(group):
  def whole(loss):
    t = loss.detach().reshape(1).clone()
    dist.all_reduce(t, dist.ReduceOp.AVG, group=group)
    return t.item()
  return whole


def case_cross_entropy(r, n):
  """The vocabulary-parallel cross-entropy and its gradient against F.cross_entropy on the whole logits."""
  rng = np.random.default_rng(1)
  full = rng.standard_normal((3, 5, 8 * n)) * 4
  target = rng.integers(0, 8 * n, (3, 5))
  target[1, 2:] = -100
  logits = bt.from_numpy(full)[..., r * 8:(r + 1) * 8].requires_grad_()
  t = bt.from_numpy(target)
  err = {}
  for reduction in ("mean", "sum", "none"):
    mine = vocab_parallel_cross_entropy(logits, t, None, reduction=reduction)
    whole = bt.from_numpy(full).requires_grad_()
    ref = bt.nn.functional.cross_entropy(whole.reshape(-1, 8 * n), t.reshape(-1), reduction=reduction)
    err[reduction] = diff(mine.detach().numpy().reshape(-1), ref.detach().numpy().reshape(-1))
    g = np.random.default_rng(2).standard_normal(mine.shape)
    mine.backward(bt.from_numpy(g))
    ref.backward(bt.from_numpy(g.reshape(ref.shape)))
    err[f"grad_{reduction}"] = diff(logits.grad.numpy(), whole.grad.numpy()[..., r * 8:(r + 1) * 8])
    logits.grad = None
  half = bt.from_numpy(full).to(bt.bfloat16)  # 16-bit logits: float32 sums and losses, as F.cross_entropy's
  mine = vocab_parallel_cross_entropy(half[..., r * 8:(r + 1) * 8], t)
  whole = bt.nn.functional.cross_entropy(half.float().reshape(-1, 8 * n), t.reshape(-1))
  err["bf16"] = diff(mine.numpy(), whole.numpy())
  err["bf16_dtype"] = float(mine.dtype is not bt.float32)
  err["errors"] = float(not raises(ValueError, "divisible by the tensor-parallel group size", lambda: (
    ColumnParallelLinear(4, 8 * n + 1)), lambda: RowParallelLinear(8 * n + 1, 4), lambda: parallelize_gpt(gpt())))
  return {k: worst(v) for k, v in err.items()}


def raises(kind, text, *calls):
  """Whether every call raises `kind` with `text` in its message."""
  for call in calls:
    try: call()
    except kind as e:
      if text not in str(e): return False
      continue
    return False
  return True


def case_tp_gpt(mode, r, n):
  """A GPT sharded over all ranks against the whole model, same batch; mode "tp": tensor parallel, "sp": and sequence
  parallel, "overlap" and "sp-overlap": the forward collectives in 3 chunks overlapping the GEMMs."""
  plan = (None, None, mode.startswith("sp"), 3 if mode.endswith("overlap") else 1)
  par = parallelize_gpt(gpt(), *plan)
  out = compare_training(par, gpt(), plan)
  return {**out, "local_params": sum(p.numel() for p in par.parameters()),
          "params": sum(p.numel() for p in gpt().parameters())}


def case_uneven_chunks(r, n):
  """The overlapped layers with chunks of unequal sizes (a batch of 5 in 3 chunks, 7 x 2 tokens in 3): outputs and
  gradients against the same layers in one chunk, float64, with and without sequence parallelism."""
  rng = np.random.default_rng(6)
  err = {}
  for sp in (False, True):
    x = rng.standard_normal((5, 2 * n, 8))  # this rank's part of the sequence with SP, else the whole input
    g = rng.standard_normal((5, 2 * n if not sp else 2, 8))
    results = []
    for chunks in (1, 3):
      bt.manual_seed(0)
      col = ColumnParallelLinear(8, 4 * n, sequence_parallel=sp, overlap_chunks=chunks, dtype=bt.float64)
      row = RowParallelLinear(4 * n, 8, sequence_parallel=sp, overlap_chunks=chunks, dtype=bt.float64)
      xt = bt.from_numpy(x if not sp else x[:, :2]).requires_grad_()
      y = row(col(xt).relu())
      y.backward(bt.from_numpy(g))
      results.append([y.detach().numpy(), xt.grad.numpy(), col.weight.grad.numpy(), col.bias.grad.numpy(),
                      row.weight.grad.numpy()])
    for name, a, b in zip(("y", "dx", "dw_col", "db_col", "dw_row"), *results): err[f"{name}_{sp}"] = diff(a, b)
  return {k: worst(v) for k, v in err.items()}


def case_gradient_buckets(r, n):
  """all_reduce_gradients over buckets of a few gradients (a cap of 300 bytes), float64 and float32 gradients
  interleaved, one larger than the cap, one parameter without a gradient: each gradient the ranks' average."""
  shapes = [(3, 4), (5,), (7, 9), (2,), (4, 4), (6,)]
  dtypes = [bt.float64, bt.float64, bt.float64, bt.float32, bt.float32, bt.float64]
  ranks = [[np.random.default_rng(10 * k + i).standard_normal(s) for i, s in enumerate(shapes)] for k in range(n)]
  params = [bt.zeros(s, dtype=d) for s, d in zip(shapes, dtypes)]
  for p, g, d in zip(params, ranks[r], dtypes): p.grad = bt.tensor(g).to(d)  # a copy: reduced in place
  params[4].grad = None
  all_reduce_gradients(params, bucket_cap_mb=300 / 2**20)
  err = {"missing": float(params[4].grad is not None)}
  for i, (p, d) in enumerate(zip(params, dtypes)):
    if i == 4: continue
    want = np.mean([ranks[k][i] for k in range(n)], 0)
    err[f"grad_{i}"] = diff(p.grad.numpy(), want) / (1e-6 if d is bt.float32 else 1e-12)
    err[f"dtype_{i}"] = float(p.grad.dtype is not d)
  return {k: worst(v) for k, v in err.items()}


def case_dp_tp(r, n):
  """4 ranks: tensor-parallel pairs {0, 1}, {2, 3} (sequence parallel), data parallel across them ({0, 2}, {1, 3})
  with DDP; each pair trains on half the batch, against one process on the whole batch. No ignored targets: DDP
  averages the halves' means, which is the whole batch's mean only when the halves count as many targets."""
  mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
  tp, dp = mesh["tp"].get_group(), mesh.get_group("dp")
  layout = {"tp": tp.ranks, "dp": dp.ranks, "d": mesh.get_local_rank("dp"), "size": mesh.size()}
  errors = raises(RuntimeError, "init_device_mesh", lambda: init_device_mesh("cpu", (3,)),
                  lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "dp")))
  d, plan = dp.rank(), (tp, None, True)
  par = parallelize_gpt(gpt(), *plan)
  half = lambda x, y: (x[d * B // 2:(d + 1) * B // 2], y[d * B // 2:(d + 1) * B // 2])
  out = compare_training(par, gpt(), plan, half, mean_over(dp), DistributedDataParallel(par, process_group=dp),
                         ignore=False)
  want = {"tp": [r // 2 * 2, r // 2 * 2 + 1], "dp": [r % 2, r % 2 + 2], "d": r // 2, "size": 4}
  return {**out, "mesh": worst(float(layout != want or not errors))}


def graph_nodes(t):
  """The tape nodes that t's backward would visit."""
  seen, stack = {}, [t._node]
  while stack:
    nd = stack.pop()
    if id(nd) in seen: continue
    seen[id(nd)] = nd
    stack += [p for p in nd.parents if p is not None and not isinstance(p, bt.Tensor)]
  return list(seen.values())


def case_ring_attention(r, n):
  """Ring attention on the load-balanced parts against attention on the whole sequence, forward and gradients; the
  inputs are (B, H, T, D) views of (B, T, H, D) tensors (not contiguous)."""
  rng = np.random.default_rng(3)
  Tn = 4 * n
  qkv = [rng.standard_normal((2, Tn, 3, 5)) for _ in range(3)]
  g = rng.standard_normal((2, 3, Tn, 5))
  err = {}
  for causal in (True, False):
    whole = [bt.from_numpy(a).requires_grad_() for a in qkv]
    ref = bt.nn.functional.scaled_dot_product_attention(*(w.transpose(1, 2) for w in whole), is_causal=causal)
    ref.backward(bt.from_numpy(g))
    parts = [shard_sequence(bt.from_numpy(a)).requires_grad_() for a in qkv]
    out = ring_attention(*(p.transpose(1, 2) for p in parts), None, is_causal=causal)
    nodes = graph_nodes(out)
    err[f"lse_path_{causal}"] = float(not any(nd.op.name == "flash_attention_lse" for nd in nodes))
    local = Tn // n  # no (L, S) scores among what the tape keeps for the backward
    err[f"scores_kept_{causal}"] = float(sum(t is not None and tuple(t.shape[-2:]) == (local, local)
                                             for nd in nodes for t in (*nd.saved, nd.out)))
    out.backward(shard_sequence(bt.from_numpy(g), None, dim=2))
    err[f"out_{causal}"] = diff(unshard_sequence(out.detach(), None, dim=2).numpy(), ref.detach().numpy())
    for name, p, w in zip("qkv", parts, whole):
      err[f"d{name}_{causal}"] = diff(p.grad.numpy(), shard_sequence(w.grad).numpy())
  parts = [shard_sequence(bt.from_numpy(a).to(bt.bfloat16)).transpose(1, 2) for a in qkv]  # float32 scores and merge
  ref = bt.nn.functional.scaled_dot_product_attention(*(bt.from_numpy(a).to(bt.bfloat16).double().transpose(1, 2)
                                                        for a in qkv), is_causal=True)
  out = ring_attention(*parts, None)
  err["bf16"] = diff(unshard_sequence(out.double(), None, dim=2).numpy(), ref.numpy())
  err["bf16_dtype"] = float(out.dtype is not bt.bfloat16)
  x = bt.from_numpy(rng.standard_normal((2, Tn, 3)))
  err["round_trip"] = diff(unshard_sequence(shard_sequence(x)).numpy(), x.numpy())
  c = Tn // (2 * n)  # rank r's positions: chunks r and 2n-1-r
  want = np.concatenate([np.arange(k * c, (k + 1) * c) for k in (r, 2 * n - 1 - r)])
  err["positions"] = diff(sequence_positions(Tn).numpy(), want)
  return {k: worst(v) for k, v in err.items()}


def case_cp_gpt(r, n):
  """A GPT whose sequence is split over all ranks (ring attention, load-balanced, true positions; a tensor-parallel
  group of one rank each) against the whole model. Each rank's loss is its mean over as many tokens, so the gradients
  are averaged over the ranks; no ignored targets (they would weight the ranks unequally)."""
  mesh = init_device_mesh("cpu", (n, 1), mesh_dim_names=("cp", "tp"))
  plan = (mesh.get_group("tp"), mesh.get_group("cp"), False)
  par = parallelize_gpt(gpt(), *plan)
  return compare_training(par, gpt(), plan, lambda x, y: (shard_sequence(x), shard_sequence(y)), mean_over(None),
                          reduce_group=plan[1], ignore=False)


def case_dp_cp(r, n):
  """4 ranks: context-parallel pairs {0, 1}, {2, 3} (gradients averaged over the pair), data parallel across them
  ({0, 2}, {1, 3}) with DDP, whose ranks have the same graphs (the same position in their pairs); each pair trains
  on half the batch, against one process on the whole batch."""
  mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp", "cp", "tp"))  # a tensor-parallel group of one
  cp, dp = mesh.get_group("cp"), mesh.get_group("dp")
  d, plan = dp.rank(), (mesh.get_group("tp"), cp, False)
  par = parallelize_gpt(gpt(), *plan)
  half = lambda x, y: tuple(shard_sequence(t[d * B // 2:(d + 1) * B // 2], cp) for t in (x, y))
  whole = lambda loss: mean_over(dp)(bt.tensor([mean_over(cp)(loss)], dtype=bt.float64))
  return compare_training(par, gpt(), plan, half, whole, DistributedDataParallel(par, process_group=dp),
                          reduce_group=cp, ignore=False)


def case_tp_cp(r, n):
  """4 ranks: context-parallel pairs of tensor-parallel pairs (sequence parallel): the ring's transfers and the TP
  collectives interleave in forward and backward."""
  mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
  cp, plan = mesh.get_group("cp"), (mesh.get_group("tp"), mesh.get_group("cp"), True)
  par = parallelize_gpt(gpt(), *plan)
  return compare_training(par, gpt(), plan, lambda x, y: (shard_sequence(x, cp), shard_sequence(y, cp)),
                          mean_over(cp), reduce_group=cp, ignore=False)


if __name__ == "__main__":
  dist.init_process_group("mpi", timeout=60)
  r, n = dist.get_rank(), dist.get_world_size()
  name, args = sys.argv[1], sys.argv[2:]
  out = {"cross_entropy": case_cross_entropy, "tp_gpt": case_tp_gpt, "dp_tp": case_dp_tp,
         "uneven_chunks": case_uneven_chunks, "gradient_buckets": case_gradient_buckets,
         "ring_attention": case_ring_attention, "cp_gpt": case_cp_gpt,
         "dp_cp": case_dp_cp, "tp_cp": case_tp_cp}[name](*args, r, n)
  if r == 0: print(json.dumps({"case": name, "world": n, **out}), flush=True)
  dist.destroy_process_group()
