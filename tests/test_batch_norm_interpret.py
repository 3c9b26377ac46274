"""The CUDA batch-norm kernels' values without a GPU: Triton's interpreter (TRITON_INTERPRET=1, in a subprocess, since
it must be set before Triton is imported) runs the statistics, forward and backward kernels, launched as
`norm.reduce_plan` and `norm.apply_plan` say, on torch CPU tensors (test-only) in NCHW, channels-last and strided
layouts, against the CPU backend's float64 kernels, the backward's g also masked by a ReLU's output; the forward with
Nova's epilogue (a residual added, relu) against the CPU kernel's; the finalize kernel alone over many splits; the
running statistics' update against PyTorch's."""
import numpy as np

from tests.helpers import patch_interpreter_loop_bounds, run_under_triton_interpreter

CASES = [  # (shape, layout of x, layout of g, dtype, training, weight, bias, SMs the schedule is made for, g masked
  # by a ReLU's output laid out as g)
  ((32, 2, 32, 32), "nchw", "nchw", "fp32", True, True, True, 2, False),  # two SMs: the reduction splits R in two
  ((4, 6, 5, 7), "channels_last", "channels_last", "bf16", True, True, False, 132, True),
  ((4, 6, 5, 7), "channels_last", "nchw", "fp32", True, False, True, 132, False),
  ((3, 4, 2, 3, 5), "strided", "channels_last", "fp32", True, True, True, 132, True),
  ((9, 5), "nchw", "nchw", "fp64", True, True, True, 132, False),
  ((2, 3, 7), "nchw", "strided", "bf16", False, True, True, 132, True),  # eval: given statistics
  ((6, 5), "nchw", "nchw", "fp32", False, False, False, 132, False),
]


def _layout(t, layout: str):
  """t (contiguous) as channels-last (dim 1 innermost), as every other element of a twice-wider last dim, or as is."""
  import torch
  if layout == "channels_last": return t.movedim(1, -1).contiguous().movedim(-1, 1)
  if layout == "strided": return torch.stack([t, t], -1).flatten(-2)[..., ::2]
  return t


def _run_case(shape, x_layout, g_layout, dtype, training, weight, bias, sms, masked) -> None:
  import dataclasses
  import torch
  from blutrain import configurator, dtypes
  from blutrain.backend.cpu.kernels import kernels as cpu
  from blutrain.backend.cuda.kernels import norm as K
  from blutrain.shapes import cdiv
  dt = {"fp32": dtypes.float32, "bf16": dtypes.bfloat16, "fp64": dtypes.float64}[dtype]
  tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[dtype]
  acc, tacc = (dtypes.float64, torch.float64) if dtype == "fp64" else (dtypes.float32, torch.float32)
  hw = dataclasses.replace(configurator.H200, sms=sms)
  rng = np.random.default_rng(sum(shape))
  C, R, eps = shape[1], int(np.prod(shape)) // shape[1], 1e-3
  x = _layout(torch.tensor(rng.standard_normal(shape) * 2 + 5).to(tdt), x_layout)  # far from 0: a stable variance
  g = _layout(torch.tensor(rng.standard_normal(shape)).to(tdt), g_layout)
  relu_out = _layout(torch.relu(torch.tensor(rng.standard_normal(shape))).to(tdt), g_layout) if masked else None
  assert relu_out is None or relu_out.stride() == g.stride()
  w = torch.tensor(rng.standard_normal(C), dtype=tacc) if weight else None
  b = torch.tensor(rng.standard_normal(C), dtype=tacc) if bias else None
  x64, g64 = x.double().numpy(), g.double().numpy()  # what the kernels read, rounded as they read it
  relu64 = None if relu_out is None else relu_out.double().numpy()
  w64, b64 = (None if t is None else t.double().numpy() for t in (w, b))
  tol = {"fp32": 1e-5, "bf16": 1e-2, "fp64": 1e-12}[dtype]

  def close(name, got, want, rel):
    err = float(np.abs(got.double().numpy() - want).max() / max(np.abs(want).max(), 1e-30))
    assert err < rel, f"{name} ({shape}, {x_layout}/{g_layout}, {dtype}, training={training}): relative error {err:.2e}"

  def reduce(grad, mean=None, var=None, out0=None, out1=None):
    stats = acc if grad else None
    mask = relu_out is not None and grad
    s, grid, scalars, S, chunk = K.reduce_plan(grad, dt, dt if grad else None, stats, stats, shape, x.stride(),
                                               g.stride() if grad else None, eps, hw, dt if mask else None)
    assert S == (2 if sms == 2 else 1), f"{S} splits for {shape} on {sms} SMs"
    part = torch.empty((2, S, C), dtype=tacc)
    s[0][grid](part[0], part[1], x, g if grad else x, relu_out if mask else x, part if mean is None else mean,
               part if var is None else var, *scalars, **s.constexprs)
    sums = torch.empty((2, C), dtype=tacc)
    f = K.batch_norm_finalize_spec(grad, acc, None if out0 is None else acc, None if out1 is None else acc)
    f[0][(cdiv(C, K.FINALIZE_BLOCK_C),)](part if out0 is None else out0, part if out1 is None else out1, sums, part[0],
                                          part[1], C, R, S, chunk, *_no_running(part), **f.constexprs)
    return sums

  def apply(mode, out, mean, var, sums=None):
    mask = relu_out is not None and mode != "forward"
    s, grid, scalars = K.apply_plan(mode, dt, None if mode == "forward" else dt, dt, acc, acc,
                                    None if w is None else acc, None if b is None else acc, shape, x.stride(),
                                    (x if mode == "forward" else g).stride(), out.stride(), eps,
                                    relu_out=dt if mask else None)
    s[0][grid](out, x, x if mode == "forward" else g, relu_out if mask else x, mean, var, mean if w is None else w,
               mean if b is None else b, mean if sums is None else sums, *scalars, **s.constexprs)
    return out

  if training:
    mean, var = torch.empty(C, dtype=tacc), torch.empty(C, dtype=tacc)
    reduce(False, out0=mean, out1=var)
    want_mean, want_var = cpu["batch_norm_stats"](x64)[:2]
    close("mean", mean, want_mean, tol if dtype != "bf16" else 1e-5)  # halves are read exactly: float32 stats
    close("var", var, want_var, tol if dtype != "bf16" else 1e-5)
    mean64, var64 = want_mean, want_var
  else:
    mean64, var64 = rng.standard_normal(C) + 5, rng.uniform(1, 4, C)
    mean, var = torch.tensor(mean64, dtype=tacc), torch.tensor(var64, dtype=tacc)
  mean64, var64 = mean.double().numpy(), var.double().numpy()
  out = apply("forward", torch.empty_like(x), mean, var)
  assert out.stride() == x.stride() or x_layout == "strided"
  close("out", out, cpu["batch_norm"](x64, mean64, var64, w64, b64, eps=eps, training=training), tol)
  want_dx, want_dw, want_db = cpu["batch_norm_backward"](g64, x64, mean64, var64, w64, relu64, eps=eps,
                                                         training=training, input_grad=True, weight_grad=True,
                                                         bias_grad=True)
  dw, db = torch.empty(C, dtype=tacc), torch.empty(C, dtype=tacc)
  sums = reduce(True, mean, var, dw, db)
  close("dweight", dw, want_dw, 1e-5 if dtype != "fp64" else tol)
  close("dbias", db, want_db, 1e-5 if dtype != "fp64" else tol)
  dx = apply("train" if training else "eval", torch.empty_like(x), mean, var, sums)
  close("dx", dx, want_dx, tol if dtype != "fp32" else 1e-4)  # dx subtracts nearly equal terms


EPILOGUES = [  # (shape, layout of x, layout of the residual (None: no residual), dtype, relu)
  ((4, 6, 5, 7), "channels_last", "nchw", "bf16", True),
  ((8, 3, 4, 4), "nchw", "nchw", "fp32", False),
  ((3, 4, 2, 3, 5), "strided", None, "fp32", True),
  ((9, 5), "nchw", "nchw", "fp64", True),
]


def _run_epilogue(shape, x_layout, r_layout, dtype, relu) -> None:
  """relu(batch_norm(x) + residual) in one kernel against the CPU kernel, which rounds as the separate ops do."""
  import ml_dtypes
  import torch
  from blutrain import dtypes
  from blutrain.backend.cpu.kernels import kernels as cpu
  from blutrain.backend.cuda.kernels import norm as K
  dt = {"fp32": dtypes.float32, "bf16": dtypes.bfloat16, "fp64": dtypes.float64}[dtype]
  tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}[dtype]
  acc, tacc = (dtypes.float64, torch.float64) if dtype == "fp64" else (dtypes.float32, torch.float32)
  rng = np.random.default_rng(len(shape) + shape[0])
  C, eps = shape[1], 1e-5
  x = _layout(torch.tensor(rng.standard_normal(shape) * 3 - 1).to(tdt), x_layout)
  r = None if r_layout is None else _layout(torch.tensor(rng.standard_normal(shape)).to(tdt), r_layout)
  mean, var = (torch.tensor(v, dtype=tacc) for v in (rng.standard_normal(C) - 1, rng.uniform(4, 12, C)))
  w, b = (torch.tensor(rng.standard_normal(C), dtype=tacc) for _ in range(2))
  out = torch.empty_like(x)
  s, grid, scalars = K.apply_plan("forward", dt, None if r is None else dt, dt, acc, acc, acc, acc, shape, x.stride(),
                                  (x if r is None else r).stride(), out.stride(), eps, relu)
  s[0][grid](out, x, x if r is None else r, x, mean, var, w, b, mean, *scalars, **s.constexprs)

  def host(t):  # the array in its own dtype, as the CPU backend holds it
    if t is None: return None
    return t.float().numpy().astype(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
  want = cpu["batch_norm"](host(x), *(host(t) for t in (mean, var, w, b, r)), eps=eps, training=True, relu=relu)
  got = out.double().numpy()
  err = np.abs(got - want.astype(np.float64)).max() / np.abs(want.astype(np.float64)).max()
  assert err < {"fp32": 1e-6, "bf16": 2e-2, "fp64": 1e-12}[dtype], (shape, x_layout, r_layout, dtype, relu, err)
  if relu: assert (got >= 0).all() and (got == 0).mean() > 0.2, (shape, dtype)


def _run_finalize(S: int, C: int, grad: bool) -> None:
  """The finalize kernel alone on S splits' partials (more than a step of its tile, the last split short): Welford
  merges of (mean, M2) against the merge in float64, or plain sums with `grad`."""
  import torch
  from blutrain import dtypes
  from blutrain.backend.cuda.kernels import norm as K
  from blutrain.shapes import cdiv
  rng = np.random.default_rng(S + C)
  chunk, R = 100, 100 * (S - 1) + 37
  n = np.minimum(chunk, R - np.arange(S) * chunk).astype(np.float64)[:, None]
  p0, p1 = rng.standard_normal((S, C)) + 3, rng.uniform(0.5, 2, (S, C)) * n
  part = torch.tensor(np.stack([p0, p1]), dtype=torch.float32)
  out0, out1, sums = torch.empty(C), torch.empty(C), torch.empty((2, C))
  f = K.batch_norm_finalize_spec(grad, dtypes.float32, dtypes.float32, dtypes.float32)
  f[0][(cdiv(C, K.FINALIZE_BLOCK_C),)](out0, out1, sums, part[0], part[1], C, R, S, chunk, *_no_running(part),
                                        **f.constexprs)
  p0, p1 = part[0].double().numpy(), part[1].double().numpy()
  if grad: want = (p0.sum(0), p1.sum(0))
  else:
    mean = (n * p0).sum(0) / R
    want = (mean, (p1.sum(0) + (n * (p0 - mean) ** 2).sum(0)) / R)
  for got, w in zip((out0, out1), want):
    assert np.allclose(got.double().numpy(), w, rtol=1e-5, atol=1e-6), (S, C, grad)


def _no_running(buffer) -> tuple:
  """The finalize kernel's running-statistics arguments when it moves none."""
  return (buffer,) * 6 + (0.0, 0.0, 0, 0, 0, 0)


def _run_running_stats(in_place: bool) -> None:
  """The finalize kernel's running-statistics update (from one split's mean and M2 per channel) against PyTorch's
  BatchNorm2d's, with the batch count's increment counted once by one program of two: in place (out = the running
  statistics, strided) or into new arrays."""
  import torch
  from blutrain import dtypes
  from blutrain.backend.cuda.kernels import norm as K
  from blutrain.shapes import cdiv
  C = 100
  x = torch.tensor(np.random.default_rng(5).standard_normal((6, C, 2, 2)), dtype=torch.float32) * 3 + 1
  R = x.numel() // C
  bn = torch.nn.BatchNorm2d(C, momentum=0.3)
  bn.running_mean.uniform_(-1, 1)
  bn.running_var.uniform_(0.5, 2)
  rm, rv = torch.empty(2 * C)[::2], torch.empty(3 * C)[::3]  # strided running statistics
  rm.copy_(bn.running_mean)
  rv.copy_(bn.running_var)
  bn.train()(x)
  mean, m2 = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False) * R
  part, out0, out1, sums = torch.stack([mean, m2])[:, None], torch.empty(C), torch.empty(C), torch.empty((2, C))
  batches, new_batches = torch.tensor(41), torch.tensor(41) if in_place else torch.tensor(0)
  new_mean, new_var = (rm, rv) if in_place else (torch.empty(C), torch.empty(C))
  f = K.batch_norm_finalize_spec(False, dtypes.float32, dtypes.float32, dtypes.float32, dtypes.float32, True)
  f[0][(cdiv(C, K.FINALIZE_BLOCK_C),)](out0, out1, sums, part[0], part[1], C, R, 1, R, new_mean, new_var,
                                        batches if in_place else new_batches, rm, rv, batches, 0.3, R / (R - 1),
                                        *(t.stride(0) for t in (new_mean, new_var, rm, rv)), **f.constexprs)
  assert torch.allclose(out0, mean, rtol=1e-6) and torch.allclose(out1, m2 / R, rtol=1e-6)
  assert torch.allclose(new_mean, bn.running_mean, rtol=1e-6, atol=1e-6)
  assert torch.allclose(new_var, bn.running_var, rtol=1e-6)
  assert int(batches if in_place else new_batches) == 42 and (in_place or int(batches) == 41)


def main() -> None:
  patch_interpreter_loop_bounds()
  for case in CASES: _run_case(*case)
  for case in EPILOGUES: _run_epilogue(*case)
  for S, C, grad in ((70, 70, False), (70, 70, True), (1, 3, False)): _run_finalize(S, C, grad)
  for in_place in (True, False): _run_running_stats(in_place)
  print("ok")


def test_batch_norm_kernels_under_triton_interpreter():
  run_under_triton_interpreter("tests.test_batch_norm_interpret")


if __name__ == "__main__":
  main()
