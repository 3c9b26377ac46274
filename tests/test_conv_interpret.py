"""The CUDA convolution kernels' values without a GPU: Triton's interpreter (TRITON_INTERPRET=1, in a subprocess,
since it must be set before Triton is imported) runs the forward, dgrad and split-K wgrad kernels, launched as
`conv.plan` says, on torch CPU tensors (test-only), against PyTorch CPU's convolution and its gradients."""
import os
import subprocess
import sys

import pytest

CASES = [  # (x shape, w shape, stride, padding, dilation, groups, SMs of the device the schedule is made for)
  ((2, 4, 9, 10), (6, 2, 3, 2), (2, 1), (1, 2), (1, 2), 2, 132),
  ((2, 6, 13), (4, 3, 4), (3,), (2,), (2,), 2, 132),
  ((2, 3, 20, 20), (4, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1, 1),  # one SM: the wgrad's K (800) splits in two
  ((2, 4, 5, 6, 7), (6, 2, 3, 2, 3), (2, 1, 2), (1, 0, 2), (1, 2, 1), 2, 132),  # 3-D: the kernels' DEPTH variant
  ((2, 2, 6, 8, 14), (2, 1, 3, 3, 2), (1, 2, 1), (2, 1, 0), (2, 1, 2), 2, 1),  # and a split wgrad
]
CONV = {3: "conv1d", 4: "conv2d", 5: "conv3d"}  # by the input's rank


def _patch_interpreter():
  """Triton 3.6's interpreter reads loop bounds with int() of a 1-element array, which numpy 2 refuses: take the
  element (a patch of the interpreter's tensor, test-only)."""
  import triton.runtime.interpreter as interp
  original = interp._patch_lang_tensor

  def patched(tensor, scope):
    original(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
  interp._patch_lang_tensor = patched


def _run_case(xs, ws, stride, padding, dilation, groups, split_hw) -> None:
  import dataclasses
  import torch
  import torch.nn.functional as TF
  from blutrain import configurator, dtypes
  from blutrain.backend.cuda.kernels import conv as K
  torch.manual_seed(0)
  x, w = torch.randn(xs, dtype=torch.float64), torch.randn(ws, dtype=torch.float64)
  x_nhwc = x.movedim(1, -1).contiguous().movedim(-1, 1)  # channels-last strides
  conv = getattr(TF, CONV[len(xs)])
  y = conv(x, w, None, stride, padding, dilation, groups)
  g = torch.randn(y.shape, dtype=torch.float64)
  dx, dw = torch.autograd.grad(conv(x.requires_grad_(), w.requires_grad_(), None, stride, padding, dilation, groups),
                               [x, w], g)
  hw = dataclasses.replace(configurator.H200, sms=split_hw)
  lay = lambda t: (tuple(t.shape), tuple(t.stride()))
  geo = (stride, padding, dilation, groups)
  for dtype, tdtype, tol in ((dtypes.float64, torch.float64, 1e-12), (dtypes.float32, torch.float32, 1e-5)):
    xt, wt, gt = x_nhwc.detach().to(tdtype), w.detach().to(tdtype), g.to(tdtype)
    out = torch.empty(y.shape, dtype=tdtype)
    s, grid, args, _ = K.plan("fwd", dtype, lay(xt), lay(wt), lay(out), *geo, False, hw)
    s[0][grid](out, xt, wt, *args, **s.constexprs)
    gx = torch.empty(xs, dtype=tdtype)
    s, grid, args, _ = K.plan("dgrad", dtype, lay(gx), lay(wt), lay(gt), *geo, False, hw)
    s[0][grid](gx, gt, wt, *args, **s.constexprs)
    s, grid, args, split = K.plan("wgrad", dtype, lay(xt), (ws, (0,) * len(ws)), lay(gt), *geo, False, hw)
    part = torch.empty((split, ws[0], w[0].numel()), dtype=tdtype)
    s[0][grid](part, gt, xt, *args, **s.constexprs)
    for name, got, want in (("out", out, y), ("dx", gx, dx), ("dw", part.sum(0).reshape(ws), dw)):
      err = float((got.double() - want.detach()).abs().max() / want.abs().max())
      assert err < tol, f"{name} ({dtype.name}, {xs}, {ws}, split over {split}): relative error {err:.2e}"
    assert split_hw > 1 or split > 1, f"wgrad of K = {args[2]} on a 1-SM device does not split"


def main() -> None:
  _patch_interpreter()
  for case in CASES: _run_case(*case)
  print("ok")


def test_conv_kernels_under_triton_interpreter():
  pytest.importorskip("triton")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, "-m", "tests.test_conv_interpret"], cwd=root, capture_output=True, text=True,
                     env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
  assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


if __name__ == "__main__":
  main()
