"""Eager `linear` as one primitive (x @ W^T + b, the bias added in the GEMM's epilogue): values against float64 numpy
and PyTorch, gradients against the composite it replaces (which a capture still records), autocast, and errors."""
import numpy as np
import pytest
import torch

import blutrain as bt
from blutrain import ops


def _inputs(rng, x_shape=(2, 3, 4), n=5, dtype=np.float32):
  x, w, b = (rng.standard_normal(s).astype(dtype) for s in (x_shape, (n, x_shape[-1]), (n,)))
  return x, w, b


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_values_and_gradients_equal_the_composite(layout):
  rng = np.random.default_rng(0)
  x, w, b = _inputs(rng)
  if layout == "transposed":  # x and W as transposed views of other tensors
    ws = (bt.tensor(np.ascontiguousarray(x.swapaxes(1, 2)), requires_grad=True),
          bt.tensor(np.ascontiguousarray(w.T), requires_grad=True))
    inputs = lambda: (ws[0].transpose(1, 2), ws[1].T)
  else:
    ws = (bt.tensor(x, requires_grad=True), bt.tensor(w, requires_grad=True))
    inputs = lambda: ws
  bias = bt.tensor(b, requires_grad=True)
  g = rng.standard_normal((2, 3, 5)).astype(np.float32)
  y = bt.nn.functional.linear(*inputs(), bias)
  assert y._node.op.name == "linear"
  (y * bt.tensor(g)).sum().backward()
  np.testing.assert_allclose(y.detach().numpy(), x.astype(np.float64) @ w.T.astype(np.float64) + b, rtol=1e-5, atol=1e-5)
  grads = [t.grad.numpy() for t in (*ws, bias)]
  for t in (*ws, bias): t.grad = None
  xs = inputs()
  composite = xs[0] @ xs[1].mT + bias
  (composite * bt.tensor(g)).sum().backward()
  for got, t in zip(grads, (*ws, bias)): np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_matches_torch_with_broadcast_batch_and_no_bias():
  rng = np.random.default_rng(1)
  x, w, b = _inputs(rng, (3, 2, 6, 7), n=4)
  for bias in (b, None):
    ours = bt.nn.functional.linear(bt.tensor(x), bt.tensor(w), None if bias is None else bt.tensor(bias))
    ref = torch.nn.functional.linear(torch.tensor(x), torch.tensor(w), None if bias is None else torch.tensor(bias))
    np.testing.assert_allclose(ours.numpy(), ref.numpy(), rtol=1e-5, atol=1e-5)


def test_bf16_under_autocast_equals_the_composite():
  """Under autocast x, W and b are cast to bfloat16; the CPU kernel rounds as the matmul and add it stands for, bit
  for bit (a compiled step, which captures those two ops, equals eager mode exactly)."""
  rng = np.random.default_rng(3)
  x, w, b = (bt.tensor(a) for a in _inputs(rng, (4, 64), n=32))
  with bt.autocast("cpu", dtype=bt.bfloat16):
    y, composite = bt.nn.functional.linear(x, w, b), x @ w.mT + b.to(bt.bfloat16)
  assert y.dtype is bt.bfloat16 and y._node is None
  np.testing.assert_array_equal(y.float().numpy(), composite.float().numpy())


def test_gradient_dtypes_under_autocast():
  rng = np.random.default_rng(4)
  x, w, b = _inputs(rng)
  wt, bias = bt.tensor(w, requires_grad=True), bt.tensor(b, requires_grad=True)
  with bt.autocast("cpu", dtype=bt.bfloat16):
    y = bt.nn.functional.linear(bt.tensor(x), wt, bias)
  y.float().sum().backward()
  assert wt.grad.dtype is bt.float32 and bias.grad.dtype is bt.float32
  np.testing.assert_allclose(bias.grad.numpy(), np.full(5, 6.0), rtol=0)
  np.testing.assert_allclose(wt.grad.numpy(), np.broadcast_to(x.reshape(6, 4).sum(0), (5, 4)), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shapes, error, match", [
  (((2, 4), (5, 3), (5,)), RuntimeError, r"linear: expected x \(\.\.\., K\).*\(2, 4\), \(5, 3\) and \(5,\)"),
  (((2, 4), (5, 4), (4,)), ValueError, r"linear:.*\(2, 4\), \(5, 4\) and \(4,\)"),
])
def test_shape_errors(shapes, error, match):
  x, w, b = (bt.randn(*s) for s in shapes)
  with pytest.raises(error, match=match): bt.nn.functional.linear(x, w, b)


def test_dtype_error():
  with pytest.raises(TypeError, match="linear: expected x, weight and bias of one floating dtype, got float32, "
                                      "float32 and float64"):
    bt.nn.functional.linear(bt.randn(2, 4), bt.randn(5, 4), bt.randn(5, dtype=bt.float64))


@pytest.mark.parametrize("trained", ["x and bias", "bias", "weight"])
def test_backward_computes_only_the_gradients_asked(trained):
  """linear_backward's outputs follow `needs`: each asked gradient equals the composite's, the others are not made."""
  rng = np.random.default_rng(5)
  x, w, b = _inputs(rng)
  leaves = {name: bt.tensor(a, requires_grad=name in trained) for name, a in (("x", x), ("weight", w), ("bias", b))}
  y = bt.nn.functional.linear(leaves["x"], leaves["weight"], leaves["bias"])
  (y * y).sum().backward()
  got = {k: None if t.grad is None else t.grad.numpy() for k, t in leaves.items()}
  ref = {k: torch.tensor(a, requires_grad=k in trained) for k, a in (("x", x), ("weight", w), ("bias", b))}
  (torch.nn.functional.linear(ref["x"], ref["weight"], ref["bias"]) ** 2).sum().backward()
  for k, t in ref.items():
    assert (got[k] is None) == (t.grad is None), k
    if t.grad is not None: np.testing.assert_allclose(got[k], t.grad.numpy(), rtol=1e-5, atol=1e-5)
