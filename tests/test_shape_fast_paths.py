"""The host path's shortcuts keep PyTorch's answers: broadcasting of two shapes, one-int reduction dims (0-d tensors
included), transposes and permutes of cached layouts, and their errors."""
import numpy as np
import pytest
import torch

import blutrain as bt
from blutrain.shapes import ShapeError, broadcast_shapes, normalize_dims


@pytest.mark.parametrize("a, b", [((), ()), ((3,), ()), ((), (2, 3)), ((2, 3), (2, 3)), ((2, 1), (3,)), ((1,), (4, 1)),
                                  ((0, 3), (1, 3)), ((5, 1, 2), (4, 1))])
def test_broadcast_two_shapes_as_torch(a, b):
  assert broadcast_shapes(a, b) == tuple(torch.broadcast_shapes(a, b))
  assert broadcast_shapes(a, b, a) == tuple(torch.broadcast_shapes(a, b, a))


@pytest.mark.parametrize("a, b", [((2,), (3,)), ((2, 3), (3, 2)), ((0,), (2,))])
def test_broadcast_two_shapes_errors(a, b):
  with pytest.raises(RuntimeError, match=r"add: shapes .* cannot broadcast"):
    broadcast_shapes(a, b, op="add")


@pytest.mark.parametrize("dim, ndim, want", [(-1, 3, (2,)), (0, 3, (0,)), (2, 3, (2,)), (0, 0, ()), (-1, 0, ()),
                                             ((2, 0), 3, (0, 2)), (None, 2, (0, 1)), ((), 2, (0, 1))])
def test_normalize_dims(dim, ndim, want):
  assert normalize_dims(dim, ndim, "sum") == want


@pytest.mark.parametrize("dim, ndim", [(3, 3), (-4, 3), (1, 0), (-2, 0)])
def test_normalize_dims_out_of_range(dim, ndim):
  with pytest.raises(IndexError, match="sum: dimension"):
    normalize_dims(dim, ndim, "sum")
  with pytest.raises(IndexError):
    torch.zeros((2,) * ndim).sum(dim)


def test_int_dim_reductions_match_torch():
  rng = np.random.default_rng(0)
  a = rng.standard_normal((3, 4, 5)).astype(np.float32)
  for dim in (-1, 0, 1, 2, -3):
    np.testing.assert_allclose(bt.tensor(a).sum(dim).numpy(), torch.tensor(a).sum(dim).numpy(), rtol=1e-5, atol=1e-6)
  s = bt.tensor(2.5)
  assert s.sum(0).item() == s.sum(-1).item() == 2.5
  with pytest.raises(IndexError):
    s.sum(1)


def test_transpose_and_permute_layouts_match_torch():
  rng = np.random.default_rng(1)
  a = rng.standard_normal((2, 3, 4)).astype(np.float32)
  x, t = bt.tensor(a)[:, 1:, ::2], torch.tensor(a)[:, 1:, ::2]  # a non-contiguous view
  for _ in range(2):  # the second time from the layout caches
    for d0, d1 in ((0, 1), (-1, -2), (2, 0), (1, 1)):
      y, r = x.transpose(d0, d1), t.transpose(d0, d1)
      assert y.shape == r.shape and y.stride() == r.stride() and y.storage_offset() == r.storage_offset()
      np.testing.assert_array_equal(y.numpy(), r.numpy())
    for dims in ((2, 0, 1), (0, 2, 1), (-1, 0, 1)):
      y, r = x.permute(*dims), t.permute(*dims)
      assert y.shape == r.shape and y.stride() == r.stride()
      np.testing.assert_array_equal(y.numpy(), r.numpy())
  assert x.transpose(1, -2) is x  # the same dim twice: no new view
  assert x.mT.shape == t.mT.shape and x.mT.stride() == t.mT.stride()
  with pytest.raises(ShapeError, match=r"permute: \(0, 0, 1\) is not a permutation of the 3 dimensions"):
    x.permute(0, 0, 1)
  with pytest.raises(IndexError, match="transpose"):
    x.transpose(0, 3)


def test_transpose_gradient_matches_torch():
  rng = np.random.default_rng(2)
  a, w = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((3, 4)).astype(np.float32)
  x, t = bt.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)
  (x.mT * bt.tensor(w).mT).sum().backward()
  (t.mT * torch.tensor(w).mT).sum().backward()
  np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), rtol=1e-6)
