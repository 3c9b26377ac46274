"""Bad indices on the GPU: the kernels record them in the device's error flag without a host wait, and the next
synchronization (`.item()`, `.numpy()`, `bt.cuda.synchronize()`) raises an error naming the op, the index and the
bound; the flag is cleared, so the process goes on."""
import numpy as np
import pytest

import blutrain as bt
from blutrain.nn import functional as F

pytestmark = pytest.mark.cuda


def test_embedding_index_out_of_range_raises_at_the_next_sync():
  w = bt.randn(10, 4).to("cuda")
  out = F.embedding(bt.tensor([1, 12, 3]).to("cuda"), w)  # queued: nothing raises yet
  with pytest.raises(IndexError, match=r"embedding: index 12 is out of range for a dimension of size 10"):
    out.sum().item()
  good = F.embedding(bt.tensor([1, 3]).to("cuda"), w)
  np.testing.assert_array_equal(good.numpy(), w.numpy()[[1, 3]])


def test_negative_index_and_synchronize_and_runtime_error_type():
  x = bt.randn(5, 6).to("cuda")
  bt.gather(x, 1, bt.tensor([[0, -7], [2, 3], [0, 0], [1, 1], [5, 5]]).to("cuda"))
  with pytest.raises(RuntimeError, match=r"gather: index -7 is out of range for a dimension of size 6"):
    bt.cuda.synchronize()
  bt.cuda.synchronize()  # cleared


def test_embedding_backward_with_a_bad_token_raises_and_writes_nothing():
  w = bt.randn(8, 3).to("cuda").requires_grad_()
  F.embedding(bt.tensor([0, 9]).to("cuda"), w).sum().backward()
  with pytest.raises(bt.cuda.DeviceIndexError, match="out of range"):
    w.grad.numpy()
