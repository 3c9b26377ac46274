"""The flash_attention primitive on the CPU (the reference for the CUDA kernels): values and gradients equal the
composite attention and torch's scaled_dot_product_attention; the primitive is taken exactly when it applies."""
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import blutrain as bt
import blutrain.nn.functional as F
from blutrain import ops
from tests.helpers import TORCH_DTYPES, assert_close

CASES = [((2, 3, 7, 8), (2, 3, 7, 8)), ((1, 5, 16), (1, 9, 16)), ((4, 9, 4), (4, 5, 4)), ((6, 32), (6, 32)),
         ((2, 1, 1, 8), (2, 1, 1, 8))]


def _inputs(qshape, kshape, dtype, seed=0):
  rng = np.random.default_rng(seed)
  arrays = [rng.standard_normal(s) for s in (qshape, kshape, kshape)]
  b = [bt.tensor(a, dtype=bt.float32).to(dtype).requires_grad_() for a in arrays]
  t = [torch.tensor(a, dtype=torch.float32).to(TORCH_DTYPES[dtype]).requires_grad_() for a in arrays]
  return b, t, rng.standard_normal(qshape[:-1] + (kshape[-1],))


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("qshape,kshape", CASES, ids=str)
def test_flash_path_matches_torch(qshape, kshape, causal, dtype):
  (q, k, v), (tq, tk, tv), g = _inputs(qshape, kshape, dtype)
  out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
  assert out.grad_fn.op.name == "flash_attention"
  out.backward(bt.tensor(g, dtype=bt.float32).to(dtype))
  ref = TF.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
  ref.backward(torch.tensor(g, dtype=torch.float32).to(TORCH_DTYPES[dtype]))
  assert_close(out, ref, what="attention")
  for name, a, b in (("dq", q, tq), ("dk", k, tk), ("dv", v, tv)):
    assert_close(a.grad, b.grad, what=name)


@pytest.mark.parametrize("causal", [False, True])
def test_primitive_equals_composite_in_float64(causal):
  (q, k, v), _, g = _inputs((2, 6, 8), (2, 10, 8), bt.float32, seed=3)
  q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
  flash = ops.nn.flash_attention_op(q64, k64, v64, causal=causal, scale=0.3)
  comp = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, scale=0.3)  # float64 takes the composite
  assert comp.grad_fn.op.name != "flash_attention"
  gt = bt.tensor(g, dtype=bt.float64)
  grads = bt.autograd.grad((flash * gt).sum(), [q64, k64, v64])
  want = bt.autograd.grad((comp * gt).sum(), [q64, k64, v64])
  np.testing.assert_allclose(flash.detach().numpy(), comp.detach().numpy(), rtol=1e-12, atol=1e-12)
  for a, b in zip(grads, want): np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12)


def test_composite_kept_for_masks_dropout_and_broadcast():
  (q, k, v), _, _ = _inputs((2, 4, 8), (2, 4, 8), bt.float32)
  mask = bt.tensor(np.tri(4, dtype=bool))
  assert F.scaled_dot_product_attention(q, k, v, attn_mask=mask).grad_fn.op.name != "flash_attention"
  assert F.scaled_dot_product_attention(q, k, v, dropout_p=0.5).grad_fn.op.name != "flash_attention"
  assert F.scaled_dot_product_attention(q, k[:1], v[:1]).grad_fn.op.name != "flash_attention"  # broadcast batch
  assert F.scaled_dot_product_attention(q, k, v, scale=0.1).grad_fn.op.name == "flash_attention"


def test_rule_errors_name_the_op():
  q = bt.randn(2, 4, 8)
  with pytest.raises(ValueError, match=r"flash_attention: expected q \(\.\.\., L, E\).*\(2, 4, 8\), \(2, 5, 8\)"):
    ops.nn.flash_attention_op(q, bt.randn(2, 5, 8), bt.randn(2, 4, 8), causal=False, scale=1.0)
  with pytest.raises(TypeError, match="flash_attention: q, k, v must share one dtype"):
    ops.nn.flash_attention_op(q, q.bfloat16(), q, causal=False, scale=1.0)


def _torch_lse_attention(q, k, v, causal, scale):
  """PyTorch's attention and the logsumexp of its scaled (causally masked) scores: the composite reference."""
  scores = q @ k.transpose(-1, -2) * scale
  if causal: scores = scores.masked_fill(~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(), float("-inf"))
  return TF.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale), scores.logsumexp(-1)


@pytest.mark.parametrize("dtype", [bt.float64, bt.float32, bt.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("qshape,kshape", CASES, ids=str)
def test_lse_op_and_its_gradients_match_torch(qshape, kshape, causal, dtype):
  """Output, logsumexp and the gradients of a loss of both (the lse's gradient reaches dS as P * dlse) against torch
  on the same inputs in float32 (float64 for float64); non-contiguous q (a transposed copy)."""
  (q, k, v), _, g = _inputs(qshape, kshape, dtype, seed=5)
  q = q.detach().mT.contiguous().mT.requires_grad_()
  h = np.random.default_rng(6).standard_normal(qshape[:-1])
  wide = torch.float64 if dtype is bt.float64 else torch.float32
  tq, tk, tv = (torch.tensor(t.detach().double().numpy(), dtype=wide, requires_grad=True) for t in (q, k, v))
  out, lse = ops.nn.flash_attention_lse(q, k, v, is_causal=causal, scale=0.4)
  assert out.dtype is lse.dtype is (bt.float64 if dtype is bt.float64 else bt.float32)
  tout, tlse = _torch_lse_attention(tq, tk, tv, causal, 0.4)
  assert_close(out, tout.detach().numpy(), out.dtype, "out")
  assert_close(lse, tlse.detach().numpy(), out.dtype, "lse")
  ((out * bt.tensor(g)).sum() + (lse * bt.tensor(h)).sum()).backward()
  ((tout * torch.tensor(g, dtype=wide)).sum() + (tlse * torch.tensor(h, dtype=wide)).sum()).backward()
  for name, a, b in (("dq", q, tq), ("dk", k, tk), ("dv", v, tv)):
    assert a.grad.dtype is dtype
    assert_close(a.grad, b.grad.numpy(), dtype, name)


def test_lse_op_equals_float64_numpy_math():
  rng = np.random.default_rng(8)
  q, k, v = (rng.standard_normal(s) for s in ((2, 7, 8), (2, 7, 8), (2, 7, 8)))
  out, lse = ops.nn.flash_attention_lse(*(bt.from_numpy(a) for a in (q, k, v)), is_causal=True)
  s = q @ k.swapaxes(-1, -2) / np.sqrt(8) + np.where(np.tri(7, dtype=bool), 0.0, -np.inf)
  want_lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
  np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-13, atol=1e-13)
  np.testing.assert_allclose(out.numpy(), np.exp(s - want_lse[..., None]) @ v, rtol=1e-12, atol=1e-13)


def test_lse_op_bad_inputs():
  q = bt.randn(2, 4, 8)
  with pytest.raises(ValueError, match=r"flash_attention_lse: expected q \(\.\.\., L, E\).*\(2, 4, 8\), \(2, 5, 8\)"):
    ops.nn.flash_attention_lse(q, bt.randn(2, 5, 8), bt.randn(2, 4, 8))
  with pytest.raises(TypeError, match="flash_attention_lse: expected floating q, k, v, got int64"):
    ops.nn.flash_attention_lse(*(bt.ones(2, 4, 8, dtype=bt.int64),) * 3)


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16])
@pytest.mark.parametrize("packed", [True, False], ids=["one-projection", "separate"])
def test_queries_with_heads_inside_positions_keep_their_layout(packed, dtype):
  """q, k, v laid out (B, L, H, E) in memory (a transformer's heads views): the output keeps that layout, so its
  `transpose(1, 2)` is contiguous with no copy, and values and gradients equal torch's. Split from one projection
  (B, L, 3 H E), their gradients arrive as one tensor that the views take apart without a copy."""
  B, L, H, E = 2, 7, 3, 8
  rng = np.random.default_rng(5)
  shape = (B, L, 3 * H * E) if packed else (3, B, L, H * E)
  x, g = rng.standard_normal(shape), rng.standard_normal((B, L, H * E))
  bx = bt.tensor(x, dtype=bt.float32).to(dtype).requires_grad_()
  tx = torch.tensor(x, dtype=torch.float32).to(TORCH_DTYPES[dtype]).requires_grad_()

  def attention(x, sdpa):
    parts = x.split(H * E, dim=2) if packed else (x[0], x[1], x[2])
    q, k, v = (t.view(B, L, H, E).transpose(1, 2) for t in parts)
    return sdpa(q, k, v, is_causal=True)
  out, ref = attention(bx, F.scaled_dot_product_attention), attention(tx, TF.scaled_dot_product_attention)
  assert out._base.grad_fn.op.name == "flash_attention_transposed" and out.transpose(1, 2).is_contiguous()
  bg, tg = bt.tensor(g, dtype=bt.float32).to(dtype), torch.tensor(g, dtype=torch.float32).to(TORCH_DTYPES[dtype])
  (out.transpose(1, 2).reshape(B, L, H * E) * bg).sum().backward()
  (ref.transpose(1, 2).reshape(B, L, H * E) * tg).sum().backward()
  assert_close(out, ref, what="attention")
  assert_close(bx.grad, tx.grad, what="the projection's gradient")


def test_transposed_backward_packs_gradients_only_for_one_projection():
  """The packed backward runs for q, k, v side by side in one tensor; any other layout (here k and v swapped) takes
  the three-array backward, with the same values."""
  B, L, H, E = 1, 5, 2, 4
  x = bt.tensor(np.random.default_rng(6).standard_normal((B, L, 3 * H * E)), dtype=bt.float64)
  q, k, v = (t.view(B, L, H, E).transpose(1, 2) for t in x.split(H * E, dim=2))
  assert ops.nn._split_from_one_projection(q, k, v)
  assert not ops.nn._split_from_one_projection(q, v, k)
  assert not ops.nn._split_from_one_projection(q, k, v.contiguous())
