"""Tensor and context parallelism on GPUs over NCCL: a sharded GPT's loss, gradients and AdamW step against the whole
model in float32 (TF32 off), and ring attention against attention on the whole sequence. Written for any world size
that divides the test model (1, 2, 4): `python -m pytest tests/cuda/test_parallel.py` at world size 1, and
`python -m blutrain.distributed.launch --nproc-per-node N $(which pytest) tests/cuda/test_parallel.py` on N GPUs (keep
NCCL_NVLS_ENABLE=0 set on the lent machines). Each rank computes the whole model's reference itself."""
import numpy as np
import pytest

import blutrain as bt
import blutrain.distributed as dist
from blutrain.nn.parallel.context_parallel import (all_reduce_gradients, ring_attention, shard_sequence,
                                                   unshard_sequence)
from blutrain.models.parallelize import parallelize_gpt
from blutrain.ops.nn import flash_attention_lse
from blutrain.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.cuda
CFG = GPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.0)


@pytest.fixture(scope="module")
def world():
  dist.init_process_group("nccl", timeout=120)
  bt.set_float32_matmul_precision("highest")
  yield dist.get_rank(), dist.get_world_size()
  bt.set_float32_matmul_precision("high")
  dist.destroy_process_group()


def gpt():
  bt.manual_seed(0)
  return GPT(CFG).to("cuda")


def host(t): return t.detach().cpu().numpy()


def plan_for(mode, r, n):
  """parallelize_gpt's arguments for `mode` over the world."""
  if mode == "cp": return ([dist.new_group([k]) for k in range(n)][r], dist.new_group(), False, 1)
  return (None, None, mode.startswith("sp"), 3 if mode.endswith("overlap") else 1)


@pytest.mark.parametrize("mode", ["tp", "sp", "overlap", "sp-overlap", "cp"])
def test_parallel_gpt_step_equals_the_whole_model(world, mode):
  r, n = world
  plan = plan_for(mode, r, n)
  par, ref = parallelize_gpt(gpt(), *plan), gpt()
  rng = np.random.default_rng(0)
  x, y = (bt.from_numpy(rng.integers(0, CFG.vocab_size, (4, 16))).to("cuda") for _ in range(2))
  shard = (lambda t: shard_sequence(t, plan[1])) if mode == "cp" else (lambda t: t)
  loss = par(shard(x), shard(y))[1]
  loss.backward()
  if mode == "cp": all_reduce_gradients(list(par.parameters()), plan[1])
  ref_loss = ref(x, y)[1]
  ref_loss.backward()
  whole = loss.detach().reshape(1).clone()
  if mode == "cp": dist.all_reduce(whole, dist.ReduceOp.AVG, group=plan[1])
  np.testing.assert_allclose(host(whole)[0], ref_loss.item(), rtol=1e-5)
  grads = gpt()
  with bt.no_grad():
    for p, q in zip(grads.parameters(), ref.parameters()): p.copy_(q.grad)
  want = dict(parallelize_gpt(grads, *plan).named_parameters())
  for name, p in par.named_parameters():
    np.testing.assert_allclose(host(p.grad), host(want[name]), rtol=1e-3, atol=2e-6, err_msg=name)
  for model in (par, ref):
    opt = bt.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
  want = dict(parallelize_gpt(ref, *plan).named_parameters())
  for name, p in par.named_parameters():
    np.testing.assert_allclose(host(p), host(want[name]), rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_equals_attention_on_the_whole_sequence(world, causal):
  r, n = world
  rng = np.random.default_rng(1)
  q, k, v, g = (rng.standard_normal((2, 4, 8 * n, 16)).astype(np.float32) for _ in range(4))
  whole = [bt.from_numpy(a).to("cuda").requires_grad_() for a in (q, k, v)]
  ref = bt.nn.functional.scaled_dot_product_attention(*whole, is_causal=causal)
  ref.backward(bt.from_numpy(g).to("cuda"))
  parts = [shard_sequence(bt.from_numpy(a).to("cuda"), None, dim=2).requires_grad_() for a in (q, k, v)]
  out = ring_attention(*parts, None, is_causal=causal)
  out.backward(shard_sequence(bt.from_numpy(g).to("cuda"), None, dim=2))
  np.testing.assert_allclose(host(unshard_sequence(out.detach(), None, dim=2)), host(ref), rtol=1e-4, atol=1e-5)
  for p, w in zip(parts, whole):
    np.testing.assert_allclose(host(p.grad), host(shard_sequence(w.grad, None, dim=2)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("N,V,start,C", [(37, 12, 4, 4), (9, 10000, 5000, 5000), (3, 50304, 0, 50304)], ids=str)
def test_vocab_parallel_cross_entropy_kernels_match_float64(N, V, start, C, dtype):
  """cross_entropy_stats and cross_entropy_lse_backward on the GPU (classes [start, start + C) of V: a strided slice,
  rows longer than one 4096 tile) against the float64 numpy kernels on the same rounded logits, with ignored rows,
  targets on other ranks and a broadcast g (a mean's)."""
  rng = np.random.default_rng(5)
  full = bt.from_numpy(rng.standard_normal((N, V)) * 4).to(dtype)
  target = rng.integers(0, V, N)
  target[::5] = -100
  outs = {}
  for device in ("cuda", "cpu"):
    x = (full.to("cuda") if device == "cuda" else full.double())[:, start:start + C]
    t = bt.from_numpy(target).to(device)
    stats = bt.ops.nn.cross_entropy_stats_op(x, t, start=start)
    lse = bt.from_numpy(np.log(np.exp(host(full.double()) - 3).sum(1)) + 3).to(device).to(stats[0].dtype)
    g = bt.full((), 0.7, dtype=stats[0].dtype, device=device).expand(N)
    outs[device] = [*stats, bt.ops.nn.cross_entropy_lse_backward_op(g, x, t, lse, start=start, ignore_index=-100)]
  assert [a.dtype for a in outs["cuda"]] == [bt.float32] * 3 + [dtype]
  tol = 1e-5 if dtype is bt.float32 else 1e-2
  for name, a, b in zip(("max", "sum", "picked", "grad"), outs["cuda"], outs["cpu"]):
    a, b = host(a).astype(np.float64), host(b)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.abs(b).max()), err_msg=name)


@pytest.mark.parametrize("dtype,tol", [(bt.float32, 2e-4), (bt.bfloat16, 4e-2)], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(2, 3, 40, 72, 64), (1, 2, 65, 65, 80), (3, 1, 17, 129, 32)], ids=str)
def test_flash_attention_lse_kernels_match_float64(shape, causal, dtype, tol):
  """The CUDA flash_attention_lse (output and logsumexp written by the forward kernel) and its backward (dlse folded
  into delta) against the float64 numpy kernel on the same (rounded) inputs, through a loss of both outputs."""
  B, H, L, S, D = shape
  rng = np.random.default_rng(4)
  arrays = [rng.standard_normal(s) for s in ((B, H, L, D), (B, H, S, D), (B, H, S, D))]
  g, h = rng.standard_normal((B, H, L, D)), rng.standard_normal((B, H, L))
  bt.set_float32_matmul_precision("highest")
  grads = {}
  for device in ("cuda", "cpu"):
    qkv = [bt.from_numpy(a).to(dtype) for a in arrays]
    qkv = [(t.to("cuda") if device == "cuda" else t.double()).requires_grad_() for t in qkv]
    out, lse = flash_attention_lse(*qkv, is_causal=causal, scale=0.3)
    g_out, g_lse = (bt.from_numpy(a).to(device).to(out.dtype) for a in (g, h))
    ((out * g_out).sum() + (lse * g_lse).sum()).backward()
    grads[device] = [out, lse] + [t.grad for t in qkv]
  bt.set_float32_matmul_precision("high")
  assert grads["cuda"][0].dtype is grads["cuda"][1].dtype is bt.float32
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), grads["cuda"], grads["cpu"]):
    a, b = host(a).astype(np.float64), host(b)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.abs(b).max()), err_msg=name)
