"""The CUDA convolution kernels' values without a GPU: Triton's interpreter (TRITON_INTERPRET=1, in a subprocess,
since it must be set before Triton is imported) runs the forward, dgrad and split-K wgrad kernels, launched as
`conv.plan` says, on torch CPU tensors (test-only), against PyTorch CPU's convolution and its gradients: the general
kernels on channels-last views and, for channel counts that `conv.vectorizes`, the channels-last variants on operands
copied channels-last as the host wrappers copy them (NCHW ones stay on the general kernels)."""
from tests.helpers import patch_interpreter_loop_bounds, run_under_triton_interpreter

CASES = [  # (x shape, w shape, stride, padding, dilation, groups, SMs of the device the schedule is made for:
  # fewer than the H200's must split the wgrad's K)
  ((2, 4, 9, 10), (6, 2, 3, 2), (2, 1), (1, 2), (1, 2), 2, 132),
  ((2, 6, 13), (4, 3, 4), (3,), (2,), (2,), 2, 132),
  ((2, 3, 20, 20), (4, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1, 1),  # one SM: the wgrad's K (800) splits in two
  ((2, 4, 5, 6, 7), (6, 2, 3, 2, 3), (2, 1, 2), (1, 0, 2), (1, 2, 1), 2, 132),  # 3-D: the kernels' DEPTH variant
  ((2, 2, 6, 8, 14), (2, 1, 3, 3, 2), (1, 2, 1), (2, 1, 0), (2, 1, 2), 2, 1),  # and a split wgrad
  # channel counts of multiples of 16: the channels-last variants
  ((2, 32, 7, 6), (16, 32, 3, 3), (1, 1), (1, 1), (1, 1), 1, 132),
  ((2, 48, 16, 17), (16, 48, 2, 2), (1, 1), (1, 0), (1, 1), 1, 4),  # 48: a part-masked K block; 4 SMs: split
  ((2, 32, 6, 7), (32, 16, 3, 3), (2, 1), (1, 1), (1, 2), 2, 132),  # groups
  ((2, 16, 11), (16, 16, 3), (2,), (1,), (1,), 1, 132),  # 1-D
  ((1, 16, 4, 5, 6), (16, 16, 3, 2, 3), (1, 2, 1), (1, 0, 1), (1, 1, 2), 1, 132),  # 3-D
]
CONV = {3: "conv1d", 4: "conv2d", 5: "conv3d"}  # by the input's rank


def _run_case(xs, ws, stride, padding, dilation, groups, split_hw) -> None:
  import dataclasses
  import torch
  import torch.nn.functional as TF
  from blutrain import configurator, dtypes
  from blutrain.backend.cuda.kernels import conv as K
  torch.manual_seed(0)
  x, w = torch.randn(xs, dtype=torch.float64), torch.randn(ws, dtype=torch.float64)
  conv = getattr(TF, CONV[len(xs)])
  hw = dataclasses.replace(configurator.H200, sms=split_hw)
  lay = lambda t: (tuple(t.shape), tuple(t.stride()))
  last = lambda t: t.movedim(1, -1).contiguous().movedim(-1, 1)  # channels-last strides, as conv._channels_last's
  geo, splits = (stride, padding, dilation, groups), []
  vector = K.vectorizes(dtypes.float32, ws, groups)  # the channels-last cases also run halves and NCHW operands
  for dtype, tdtype, tol in ((dtypes.float64, torch.float64, 1e-12), (dtypes.float32, torch.float32, 1e-5),
                             (dtypes.float16, torch.float16, 5e-3))[:3 if vector else 2]:
    # (the interpreter's bf16 dot multiplies raw bits: halves run as float16)
    xr, wr = x.to(tdtype), w.to(tdtype)  # the reference from the rounded inputs
    y = conv(xr.double(), wr.double(), None, *geo)
    g = torch.randn(y.shape, dtype=torch.float64).to(tdtype)
    x64, w64 = xr.double().requires_grad_(), wr.double().requires_grad_()
    dx, dw = torch.autograd.grad(conv(x64, w64, None, *geo), [x64, w64], g.double())
    fast = K.vectorizes(dtype, ws, groups)
    for layout in ("channels_last", "nchw") if fast else ("channels_last",):
      xt, wt, gt = (last(t) if layout == "channels_last" else t.contiguous() for t in (xr, wr, g))
      want_cl = fast and layout == "channels_last"
      out = torch.empty(y.shape, dtype=tdtype)
      s, grid, args, _, cl = K.plan("fwd", dtype, lay(xt), lay(wt), lay(out), *geo, False, hw, True)
      assert cl == want_cl, ("fwd", layout, dtype.name, xs, ws)
      s[0][grid](out, xt, wt, *args, **s.constexprs)
      gx = torch.empty(xs, dtype=tdtype)
      s, grid, args, _, cl = K.plan("dgrad", dtype, lay(gx), lay(wt), lay(gt), *geo, False, hw, True)
      assert cl == want_cl, ("dgrad", layout, dtype.name, xs, ws)
      s[0][grid](gx, gt, wt, *args, **s.constexprs)
      s, grid, args, split, cl = K.plan("wgrad", dtype, lay(xt), (ws, (0,) * len(ws)), lay(gt), *geo, False, hw, True)
      assert cl == want_cl, ("wgrad", layout, dtype.name, xs, ws)
      part = torch.empty((split, ws[0], w[0].numel()), dtype=tdtype if dtype is dtypes.float64 else torch.float32)
      s[0][grid](part, gt, xt, *args, **s.constexprs)
      got_dw = part.sum(0)
      got_dw = got_dw.reshape(ws[0], *ws[2:], ws[1]).movedim(-1, 1) if cl else got_dw.reshape(ws)
      for name, got, want in (("out", out, y), ("dx", gx, dx), ("dw", got_dw, dw)):
        err = float((got.double() - want).abs().max() / want.abs().max())
        assert err < tol, f"{name} ({dtype.name}, {layout}, {xs}, {ws}, split over {split}): relative error {err:.2e}"
      splits.append(split)
  assert split_hw == configurator.H200.sms or max(splits) > 1, f"the wgrad of {xs} by {ws} does not split"


def main() -> None:
  patch_interpreter_loop_bounds()
  for case in CASES: _run_case(*case)
  print("ok")


def test_conv_kernels_under_triton_interpreter():
  run_under_triton_interpreter("tests.test_conv_interpret")


if __name__ == "__main__":
  main()
