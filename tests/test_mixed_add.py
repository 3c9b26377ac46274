"""`x + y` of a float32 tensor and a bfloat16 (float16) one in eager mode: one add whose kernel reads each operand in
its own dtype, with values, dtypes and gradients equal to the cast-then-add that PyTorch's promotion stands for."""
import numpy as np
import pytest
import torch

import blutrain as bt


def _pair(rng, half=bt.bfloat16, shapes=((2, 3, 8), (2, 3, 8))):
  wide = bt.tensor(rng.standard_normal(shapes[0]).astype(np.float32), requires_grad=True)
  narrow = bt.tensor(rng.standard_normal(shapes[1]).astype(np.float32)).to(half).requires_grad_()
  return wide, narrow


@pytest.mark.parametrize("half", [bt.bfloat16, bt.float16])
@pytest.mark.parametrize("order", ["wide first", "half first"])
@pytest.mark.parametrize("shapes", [((2, 3, 8), (2, 3, 8)), ((2, 3, 8), (8,)), ((3, 1), (2, 3, 8))])
def test_equals_the_cast_then_add(half, order, shapes):
  rng = np.random.default_rng(0)
  wide, narrow = _pair(rng, half, shapes)
  out = wide + narrow if order == "wide first" else narrow + wide
  assert out.dtype is bt.float32 and out._node.op.name == "add"
  assert {id(p) for p in out._node.parents} == {id(wide), id(narrow)}  # no cast between
  g = rng.standard_normal(out.shape).astype(np.float32)
  (out * bt.tensor(g)).sum().backward()
  tw, tn = torch.tensor(wide.detach().numpy(), requires_grad=True), torch.tensor(
    narrow.detach().float().numpy()).to(getattr(torch, half.name)).requires_grad_()
  ref = tw + tn if order == "wide first" else tn + tw
  (ref * torch.tensor(g)).sum().backward()
  np.testing.assert_array_equal(out.detach().numpy(), ref.detach().numpy())
  np.testing.assert_allclose(wide.grad.numpy(), tw.grad.numpy(), rtol=1e-6)  # sums of broadcasts: orders differ
  assert narrow.grad.dtype is half
  np.testing.assert_allclose(narrow.grad.float().numpy(), tn.grad.float().numpy(), rtol=1e-2)


def test_a_0d_float32_tensor_does_not_promote():
  """PyTorch's promotion: a 0-d float32 tensor with a bfloat16 one gives bfloat16 (cast, then add in bfloat16)."""
  h = bt.tensor(np.array([1.0, 2.5, -3.0], np.float32)).to(bt.bfloat16)
  out = bt.tensor(np.float32(0.1)) + h
  ref = torch.tensor(np.float32(0.1)) + torch.tensor([1.0, 2.5, -3.0]).bfloat16()
  assert out.dtype is bt.bfloat16
  np.testing.assert_array_equal(out.float().numpy(), ref.float().numpy())


def test_in_place_and_alpha_keep_the_cast():
  rng = np.random.default_rng(1)
  wide, narrow = (t.detach() for t in _pair(rng))
  want = wide.numpy() + 2 * narrow.float().numpy()
  np.testing.assert_allclose(bt.add(wide, narrow, alpha=2).numpy(), want, rtol=1e-6)
  wide.add_(narrow)
  assert wide.dtype is bt.float32
  np.testing.assert_allclose(wide.numpy(), want - narrow.float().numpy(), rtol=1e-6)
