"""The convolution primitives (`conv`, `conv_grad_input`, `conv_grad_weight` in ops/nn.py) against PyTorch CPU:
N-d geometry (stride, padding, dilation, groups) on channels-last and transposed views, the gradient primitives'
own VJPs against finite differences, bad
shapes and dtypes raising RuntimeError with the op and shapes named, autocast lowering and the cuDNN engine's layout rules; the layers in
test_nn_spatial.py cover F.conv*/nn.Conv* on top, and tests/cuda/test_conv.py the CUDA kernels."""
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import blutrain as bt
from blutrain import ops
from blutrain.nn import functional as F
from blutrain.ops.nn import conv_grad_weight_op
from tests.helpers import check_vjp

GEOMETRY = [  # (x shape, w shape, stride, padding, dilation, groups)
  ((2, 4, 9, 10), (6, 2, 3, 2), (2, 1), (1, 2), (1, 2), 2),
  ((3, 3, 7, 7), (5, 3, 1, 1), (1, 1), (0, 0), (1, 1), 1),
  ((1, 6, 8, 5), (6, 1, 3, 3), (3, 2), (2, 1), (2, 1), 6),   # depthwise
  ((2, 3, 12), (4, 3, 4), (3,), (2,), (2,), 1),
  ((2, 4, 10), (4, 2, 3), (1,), (0,), (3,), 2),
]


def _torch_conv(x, w, stride, padding, dilation, groups):
  return (TF.conv1d if x.ndim == 3 else TF.conv2d)(x, w, None, stride, padding, dilation, groups)


def _pair(shape, rng, layout):
  """A float64 numpy array of `shape` and, for blutrain, the same values in `layout`: 'contiguous', 'channels_last'
  (stored N, *spatial, C and permuted back) or 'transposed' (the last two dims swapped in storage)."""
  a = rng.standard_normal(shape)
  if layout == "channels_last":
    perm = (0, *range(2, len(shape)), 1)
    return a, bt.tensor(np.ascontiguousarray(a.transpose(perm))).permute(0, len(shape) - 1, *range(1, len(shape) - 1))
  if layout == "transposed":
    return a, bt.tensor(np.ascontiguousarray(np.swapaxes(a, -1, -2))).transpose(-1, -2)
  return a, bt.tensor(a)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed"])
@pytest.mark.parametrize("geometry", GEOMETRY)
def test_conv_primitive_and_gradients_match_torch(geometry, layout):
  xs, ws, stride, padding, dilation, groups = geometry
  rng = np.random.default_rng(0)
  (x, bx), (w, bw) = _pair(xs, rng, layout), _pair(ws, rng, "contiguous")
  assert layout == "contiguous" or not bx.is_contiguous()
  bx.requires_grad_(), bw.requires_grad_()
  tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
  y, ty = ops.conv(bx, bw, stride, padding, dilation, groups), _torch_conv(tx, tw, stride, padding, dilation, groups)
  np.testing.assert_allclose(y.detach().numpy(), ty.detach().numpy(), rtol=1e-10, atol=1e-10)
  g = rng.standard_normal(ty.shape)
  y.backward(bt.tensor(g)), ty.backward(torch.tensor(g))
  np.testing.assert_allclose(bx.grad.numpy(), tx.grad.numpy(), rtol=1e-10, atol=1e-10)
  np.testing.assert_allclose(bw.grad.numpy(), tw.grad.numpy(), rtol=1e-10, atol=1e-10)


def test_conv_gradient_primitives_against_finite_differences():
  kw = dict(stride=(2, 1), padding=(1, 1), dilation=(1, 2), groups=2)
  g_shape = (2, 4, 3, 6)  # the conv's output for x (2, 4, 5, 6) and w (4, 2, 3, 2)
  check_vjp(lambda g, w: ops.conv_transpose(g, w, (2, 4, 5, 6), **kw), [g_shape, (4, 2, 3, 2)])
  check_vjp(lambda g, x: conv_grad_weight_op(g, x, shape=(4, 2, 3, 2), tf32=False, **kw),
            [g_shape, (2, 4, 5, 6)])


def test_bad_shapes_and_dtypes_raise_runtime_error_naming_op_and_shapes():
  x, w = bt.randn(2, 4, 5, 5), bt.randn(6, 2, 3, 3)
  with pytest.raises(RuntimeError, match=r"conv: given groups=3, weight of size \[6, 2, 3, 3\].*\[2, 4, 5, 5\]"):
    ops.conv(x, w, (1, 1), (0, 0), (1, 1), 3)
  with pytest.raises(RuntimeError, match=r"conv: input of size \[2, 4, 5, 5\] .*smaller than the dilated kernel"):
    ops.conv(x, w, (1, 1), (0, 0), (3, 3), 2)
  with pytest.raises(RuntimeError, match=r"conv: .*same rank"):
    ops.conv(x, bt.randn(6, 2, 3), (1,), (0,), (1,), 2)
  with pytest.raises(RuntimeError, match="strides and dilations must be positive"):
    ops.conv(x, w, (0, 1), (0, 0), (1, 1), 2)
  with pytest.raises(RuntimeError, match=r"input type \(float64\) and weight type \(float32\)"):
    ops.conv(x.double(), w, (1, 1), (0, 0), (1, 1), 2)
  with pytest.raises(RuntimeError, match=r"conv_grad_input: gradient of size \[2, 6, 2, 3\] is not the output"):
    ops.conv_transpose(bt.randn(2, 6, 2, 3), w, (2, 4, 5, 5), (1, 1), (0, 0), (1, 1), 2)
  with pytest.raises(RuntimeError, match="Given groups=2, expected weight to be divisible by 2"):
    F.conv2d(x, bt.randn(5, 2, 3, 3), groups=2)


def test_autocast_runs_conv_and_conv_transpose_in_bfloat16():
  rng = np.random.default_rng(2)
  x, w = rng.standard_normal((2, 3, 8, 8)).astype(np.float32), rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
  bx, bw = bt.tensor(x, requires_grad=True), bt.tensor(w, requires_grad=True)
  with bt.autocast("cpu", dtype=bt.bfloat16):
    y = F.conv2d(bx, bw, padding=1)
    z = F.conv_transpose2d(y, bw, stride=2)
  assert y.dtype is bt.bfloat16 and z.dtype is bt.bfloat16
  ref = TF.conv2d(torch.tensor(x), torch.tensor(w), padding=1)
  np.testing.assert_allclose(y.float().detach().numpy(), ref.numpy(), rtol=0.05, atol=0.1)
  z.float().sum().backward()
  assert bx.grad.dtype is bt.float32 and bw.grad.dtype is bt.float32


# *** the cuDNN engine's host rules (cuDNN itself runs in tests/cuda/test_conv.py; its switch in test_gemm_synthesis.py) ***

def test_cudnn_layout_rules():
  from blutrain.backend.cuda.kernels import cudnn_conv
  assert cudnn_conv._as4d((2, 16, 33), (528, 33, 1)) == ((2, 16, 1, 33), (528, 33, 33, 1))
  assert cudnn_conv._as4d((2, 16, 5, 5), (400, 25, 5, 1)) == ((2, 16, 5, 5), (400, 25, 5, 1))
