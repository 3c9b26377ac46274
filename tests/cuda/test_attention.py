"""Flash attention on the GPU against a float64 reference: forward and backward, causal and not, GPT-2's shape and
small odd ones (L != S, head dims 8/32/64/80/128), GPT-2's strided q/k/v views, every dtype and matmul precision,
the backward with and without the forward's saved logsumexp, the op through bt, and peak memory linear in T."""
import numpy as np
import pytest

import blutrain as bt
from blutrain import dtypes
from blutrain.backend.cuda import memory
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import attention as att
from blutrain.backend.cuda.kernels.copy import copy

pytestmark = pytest.mark.cuda

# name -> (dtype, float32 matmul precision, bound on the forward's and the gradients' relative errors)
PRECISIONS = {"fp32": (dtypes.float32, "highest", 2e-5, 1e-4), "tf32": (dtypes.float32, "high", 5e-3, 2e-2),
              "fp16": (dtypes.float16, "highest", 5e-3, 2e-2), "bf16": (dtypes.bfloat16, "highest", 2e-2, 5e-2)}


@pytest.fixture(autouse=True)
def _highest():
  yield
  bt.set_float32_matmul_precision("highest")


def reference(q, k, v, g, causal, scale):
  """out, dq, dk, dv in float64 (top-left causal mask, as PyTorch's is_causal)."""
  s = q @ np.swapaxes(k, -1, -2) * scale
  if causal: s = np.where(np.tri(q.shape[-2], k.shape[-2], dtype=bool), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  out = p @ v
  dp = g @ np.swapaxes(v, -1, -2)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))
  return out, ds @ k * scale, np.swapaxes(ds, -1, -2) @ q * scale, np.swapaxes(p, -1, -2) @ g


def rounded(shape, dtype, seed, scale=1.0) -> np.ndarray:
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype.np).astype(np.float64)


def host(a: CudaArray) -> np.ndarray: return memory.to_numpy(a).astype(np.float64)


def rel_err(got, want) -> float:
  assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
  assert np.isfinite(got).all(), "non-finite values"
  return float(np.abs(got - want).max() / (np.abs(want).max() or 1.0))  # (a zero reference: absolute error)


def run(q, k, v, g, dtype, causal, scale, layout="contiguous", saved_lse=True):
  """The kernels on device copies of q, k, v, g; layout "gpt2" stores q, k, v as GPT-2's qkv.split().view().transpose()."""
  if layout == "gpt2":  # (B, H, T, D) views of one (B, T, 3, H, D) buffer
    B, H, T, D = q.shape
    qkv = np.stack([np.swapaxes(t, 1, 2) for t in (q, k, v)], axis=2)
    buf = memory.from_numpy(qkv.astype(dtype.np))
    strides = (T * 3 * H * D, D, 3 * H * D, 1)
    dq_, dk_, dv_ = (CudaArray(buf.ptr + i * H * D * dtype.itemsize, (B, H, T, D), strides, dtype, buf.device, buf.owner)
                     for i in range(3))
  else:
    dq_, dk_, dv_ = (memory.from_numpy(t.astype(dtype.np)) for t in (q, k, v))
  tf32 = bt.get_float32_matmul_precision() != "highest"
  out = att.flash_attention(dq_, dk_, dv_, causal, scale, tf32)
  saved = out if saved_lse else copy(out)  # a copy is not the forward's output: the backward recomputes the lse
  grads = att.flash_attention_backward(memory.from_numpy(g.astype(dtype.np)), dq_, dk_, dv_, saved, causal, scale, tf32)
  return (host(out),) + tuple(host(a) for a in grads)


def check(qshape, kshape, name, causal, layout="contiguous", saved_lse=True, scale=None):
  dtype, precision, fwd_bound, bwd_bound = PRECISIONS[name]
  bt.set_float32_matmul_precision(precision)
  q, k, v = rounded(qshape, dtype, 1), rounded(kshape, dtype, 2), rounded(kshape, dtype, 3)
  g = rounded(qshape, dtype, 4)
  scale = 1 / np.sqrt(qshape[-1]) if scale is None else scale
  got = run(q, k, v, g, dtype, causal, scale, layout, saved_lse)
  want = reference(q, k, v, g, causal, scale)
  for what, x, y, bound in zip(("out", "dq", "dk", "dv"), got, want, (fwd_bound,) + (bwd_bound,) * 3):
    err = rel_err(x, y)
    assert err < bound, (f"{what} {name} causal={causal} q{qshape} k{kshape} {layout} saved_lse={saved_lse}: "
                         f"relative error {err:.2e} >= {bound:.0e}")


@pytest.mark.parametrize("name", PRECISIONS)
@pytest.mark.parametrize("causal", [True, False])
def test_gpt2_shape(causal, name):
  check((1, 4, 1024, 64), (1, 4, 1024, 64), name, causal)


@pytest.mark.parametrize("name", ["bf16", "fp32"])
@pytest.mark.parametrize("causal", [True, False])
def test_gpt2_strided_qkv_views(causal, name):
  check((2, 3, 200, 64), (2, 3, 200, 64), name, causal, layout="gpt2")


ODD = [((1, 1, 1, 64), (1, 1, 1, 64)), ((2, 3, 37, 64), (2, 3, 37, 64)), ((1, 2, 5, 32), (1, 2, 19, 32)),
       ((1, 2, 19, 32), (1, 2, 5, 32)), ((1, 130, 128), (1, 130, 128)), ((2, 33, 80), (2, 33, 80)),
       ((17, 8), (17, 8)), ((1, 2, 300, 64), (1, 2, 300, 64))]


@pytest.mark.parametrize("name", ["bf16", "fp32", "tf32"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("qshape,kshape", ODD, ids=str)
def test_odd_shapes(qshape, kshape, causal, name):
  check(qshape, kshape, name, causal)


@pytest.mark.parametrize("name", ["bf16", "fp32"])
@pytest.mark.parametrize("causal", [True, False])
def test_backward_without_the_saved_lse(causal, name):
  check((2, 2, 150, 64), (2, 2, 150, 64), name, causal, saved_lse=False)


def test_large_scores_do_not_overflow():
  """Scores of hundreds (a large scale) keep the online softmax and the backward finite and exact."""
  check((1, 2, 100, 64), (1, 2, 77, 64), "fp32", True, scale=3.0)
  check((1, 2, 100, 64), (1, 2, 77, 64), "fp32", False, scale=-3.0, saved_lse=False)


def test_through_the_op_library_with_gradients():
  """GPT-2's attention block pattern on CUDA (bf16 and fp32) against the CPU backend: the output in q's (B, T, H, D)
  layout, the three gradients written as one (B, T, 3, H, D) tensor."""
  rng = np.random.default_rng(5)
  B, T, H, D = 2, 96, 4, 32
  x_np, g_np = rng.standard_normal((B, T, 3 * H * D)).astype(np.float32), rng.standard_normal((B, T, H * D)).astype(np.float32)
  for dtype, bound in ((bt.float32, 1e-4), (bt.bfloat16, 5e-2)):
    results = {}
    for device in ("cpu", "cuda"):
      x = bt.tensor(x_np).to(device).to(dtype).requires_grad_()
      q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in x.split(H * D, dim=2))
      y = bt.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
      assert y._base.grad_fn.op.name == "flash_attention_transposed"  # q's layout kept, gradients packed
      y = y.transpose(1, 2).reshape(B, T, H * D)
      y.backward(bt.tensor(g_np).to(device).to(dtype))
      results[device] = [t.detach().float().cpu().numpy().astype(np.float64) for t in (y, x.grad)]
    for what, got, want in zip(("out", "dx"), results["cuda"], results["cpu"]):
      assert rel_err(got, want) < bound, f"{what} in {dtype.name}: CUDA vs CPU"


def test_peak_memory_linear_in_sequence_length():
  """Forward + backward allocate O(T): quadrupling T may quadruple the peak, never square it."""
  def peak(T):
    q = memory.from_numpy(rounded((1, 4, T, 64), dtypes.bfloat16, 6).astype(dtypes.bfloat16.np))
    bt.cuda.synchronize()
    bt.cuda.reset_peak_memory_stats()
    base = bt.cuda.memory_allocated()
    out = att.flash_attention(q, q, q, True, 0.125)
    att.flash_attention_backward(q, q, q, q, out, True, 0.125)
    bt.cuda.synchronize()
    return bt.cuda.max_memory_allocated() - base
  p1, p4 = peak(1024), peak(4096)
  assert p4 < 6 * p1, f"peak memory {p1} bytes at T=1024, {p4} at T=4096: not linear in T"
  assert p4 < 4096 * 4096 * 4, f"peak memory {p4} bytes at T=4096 is more than one head's float32 scores"


@pytest.mark.parametrize("name", ["bf16", "fp32"])
@pytest.mark.parametrize("shape, causal", [((4, 12, 256, 64), True), ((2, 3, 100, 32), False)], ids=str)
def test_packed_gradients_are_the_three_gradients_in_place(shape, causal, name):
  """flash_attention_backward_packed writes dq, dk, dv into one (B, L, 3, H, D) array: the same bits as the three
  arrays of flash_attention_backward, each at its place along dim 2."""
  dtype, precision, _, _ = PRECISIONS[name]
  bt.set_float32_matmul_precision(precision)
  q, k, v, g = (memory.from_numpy(rounded(shape, dtype, seed).astype(dtype.np)) for seed in range(4))
  out = att.flash_attention(q, k, v, causal, 0.25)
  grads = att.flash_attention_backward(g, q, k, v, out, causal, 0.25)
  packed = memory.to_numpy(att.flash_attention_backward_packed(g, q, k, v, out, causal, 0.25))
  assert packed.shape == (shape[0], shape[2], 3, shape[1], shape[3])
  for i, (what, a) in enumerate(zip(("dq", "dk", "dv"), grads)):
    np.testing.assert_array_equal(packed[:, :, i], np.swapaxes(memory.to_numpy(a), 1, 2), err_msg=what)


@pytest.mark.parametrize("name", ["bf16", "fp32"])
@pytest.mark.parametrize("shape, causal", [((4, 12, 256, 64), True), ((2, 3, 100, 32), False)], ids=str)
def test_the_transposed_output_is_the_output_and_keeps_its_logsumexp(shape, causal, name):
  """flash_attention_transposed writes the output (B, L, H, D): the same bits as flash_attention's, transposed; the
  backward given its (B, H, L, D) view finds the forward's logsumexp and gives the same gradients."""
  dtype, precision, _, _ = PRECISIONS[name]
  bt.set_float32_matmul_precision(precision)
  q, k, v, g = (memory.from_numpy(rounded(shape, dtype, seed).astype(dtype.np)) for seed in range(4))
  out = att.flash_attention(q, k, v, causal, 0.25)
  t = att.flash_attention_transposed(q, k, v, causal, 0.25)
  np.testing.assert_array_equal(memory.to_numpy(t), np.swapaxes(memory.to_numpy(out), 1, 2))
  B, L, H, D = t.shape
  heads_first = CudaArray(t.ptr, (B, H, L, D), (L * H * D, D, H * D, 1), t.dtype, t.device, t.owner)
  assert att._recall(heads_first, att._lse_key(heads_first, k, causal, 0.25)) is not None, "the logsumexp is kept"
  want = att.flash_attention_backward(g, q, k, v, out, causal, 0.25)
  got = att.flash_attention_backward(g, q, k, v, heads_first, causal, 0.25)
  for what, a, b in zip(("dq", "dk", "dv"), got, want):
    np.testing.assert_array_equal(memory.to_numpy(a), memory.to_numpy(b), err_msg=what)
