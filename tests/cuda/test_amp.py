"""bt.autocast on CUDA with PyTorch's CUDA policy: a small GPT's training step in bfloat16 autocast against the same
model in float32 on the CPU (bf16 tolerance), output dtypes, float32 gradients and optimizer state."""
import numpy as np
import pytest

import blutrain as bt
from blutrain.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.cuda


def _models():
  bt.manual_seed(0)
  cpu = GPT(GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=64))
  gpu = GPT(GPTConfig(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=64))
  gpu.load_state_dict(cpu.state_dict())
  return cpu, gpu.cuda()


def test_gpt_step_under_cuda_autocast_matches_float32():
  cpu, gpu = _models()
  rng = np.random.default_rng(0)
  idx, tgt = (bt.tensor(rng.integers(0, 97, (4, 32))) for _ in range(2))
  _, ref = cpu(idx, tgt)
  ref.backward()
  opt = bt.optim.AdamW(gpu.parameters(), lr=1e-3)
  with bt.autocast("cuda", dtype=bt.bfloat16):
    logits, loss = gpu(idx.cuda(), tgt.cuda())
  assert logits.dtype is bt.bfloat16, "linear layers run in bfloat16 under autocast"
  assert loss.dtype is bt.float32, "cross_entropy runs in float32 under CUDA autocast"
  loss.backward()
  assert abs(loss.item() - ref.item()) < 2e-2 * abs(ref.item())
  for (name, p), (_, q) in zip(gpu.named_parameters(), cpu.named_parameters()):
    assert p.grad.dtype is bt.float32, f"{name}: gradient in {p.grad.dtype.name}"
    g, want = p.grad.cpu().numpy(), q.grad.numpy()
    err = np.abs(g - want).max() / max(np.abs(want).max(), 1e-12)
    assert err < 6e-2, f"{name}: gradient relative error {err:.2e} under bf16 autocast"
  with bt.autocast("cuda"):
    opt.step()
  assert all(p.dtype is bt.float32 for p in gpu.parameters()), "parameters stay float32 (master weights)"


@pytest.mark.parametrize("dtype", [bt.bfloat16, bt.float16])
def test_cast_many_converts_as_cast_does(dtype):
  """Nova's multi-tensor cast of autocast's weights: bit for bit the single cast's conversion, for sizes across
  chunk boundaries, an empty tensor, a channels-last weight (its layout kept) and a strided view (copied apart)."""
  from blutrain.backend.cuda import kernels, memory
  rs = np.random.default_rng(0)
  xs = [rs.standard_normal(s).astype(np.float32) * 300 for s in ((3,), (70_001,), (0, 5), (257, 129))]
  arrays = [memory.from_numpy(x) for x in xs]
  arrays.append(bt.randn(2, 8, 3, 3, device="cuda").contiguous(memory_format=bt.channels_last)._array())
  arrays.append(bt.randn(40, 30, device="cuda")[:, ::3]._array())
  got = kernels["cast_many"](*arrays, dtype=dtype)
  for a, g in zip(arrays, got, strict=True):
    want = kernels["cast"](a, dtype)
    assert g.dtype is dtype and g.shape == a.shape and g.strides == want.strides
    np.testing.assert_array_equal(memory.to_numpy(g).view(np.uint16), memory.to_numpy(want).view(np.uint16))


def test_parameter_gradients_cast_back_at_once_equal_one_cast_each(monkeypatch):
  """The engine casts the bf16 gradients of autocast's parameter casts back to float32 as one multi-tensor op at the
  end of the backward: the GPT's gradients are bit for bit those of one cast each, with fewer launches."""
  from blutrain.autograd import engine
  from blutrain.backend.cuda import kernels
  from blutrain.ops.elementwise import cast_many_op
  cast_each, calls = engine.cast_each, []
  monkeypatch.setitem(cast_many_op.kernels, "cuda", lambda *xs, **kw: calls.append(len(xs)) or
                      kernels["cast_many"](*xs, **kw))
  rng = np.random.default_rng(1)
  idx, tgt = (bt.tensor(rng.integers(0, 97, (4, 32))).cuda() for _ in range(2))

  def grads(batched):
    monkeypatch.setattr(engine, "cast_each", cast_each if batched else None)
    _, gpu = _models()
    with bt.autocast("cuda", dtype=bt.bfloat16): _, loss = gpu(idx, tgt)
    calls.clear()
    loss.backward()
    return {name: p.grad.cpu().numpy() for name, p in gpu.named_parameters()}, list(calls)

  (one_by_one, none), (at_once, batched) = grads(False), grads(True)
  # the two blocks' 8 linear weights and biases; the tied embedding, which also gets a float32 gradient, apart
  assert none == [] and batched == [16], batched
  for name, a in at_once.items():
    assert a.dtype == np.float32, name
    if ".wte." in name or ".wpe." in name:  # the embeddings' backward adds by atomics, in no fixed order
      np.testing.assert_allclose(a, one_by_one[name], rtol=1e-5, atol=1e-7, err_msg=name)
    else:
      np.testing.assert_array_equal(a, one_by_one[name], err_msg=name)
