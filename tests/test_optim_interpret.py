"""The CUDA multi-tensor SGD kernel's values without a GPU: Triton's interpreter (TRITON_INTERPRET=1, in a subprocess,
since it must be set before Triton is imported) runs `_sgd_kernel` on torch CPU tensors (test-only) through the tables
`fused_sgd` builds (`_sgd_rows`, `host_tables`), for every branch but the clip factor (inline PTX, which the
interpreter cannot run; sm_90's compile covers it), against the CPU backend's numpy kernel: bit for bit in float32
(the interpreter contracts no multiply-add).
Tensor sizes straddle the kernel's chunks and blocks; a set of sizes that are all multiples of 4 takes the kernel's
16-byte-vector variant (`optim._vectors`), the others the plain one."""
import numpy as np
import pytest

from tests.helpers import run_under_triton_interpreter

SIZES = [(70000,), (3, 5), (), (0, 4), (4097,)]
ALIGNED_SIZES = [(70000,), (4, 4), (0, 4), (4096,)]  # every size a multiple of 4: the VECTORS variant
CASES = [  # momentum, dampening, nesterov, weight_decay, maximize, is_first_step, lr on device, param / grad dtypes
  (0.9, 0.0, False, 0.01, False, False, False, "fp32"), (0.9, 0.0, False, 0.01, False, True, True, "fp32"),
  (0.9, 0.3, False, 0.0, True, False, False, "fp32"), (0.8, 0.0, True, 0.05, False, False, True, "fp32"),
  (0.0, 0.0, False, 0.0, False, False, False, "fp32"), (0.0, 0.0, False, 0.02, True, False, True, "fp32"),
  (0.9, 0.1, False, 0.01, False, False, False, "bf16"), (0.9, 0.0, True, 0.0, False, False, True, "fp32/bf16")]


def _run_case(momentum, dampening, nesterov, weight_decay, maximize, first, lr_on_device, dtypes_, sizes=SIZES) -> None:
  import torch
  from blutrain import dtypes
  from blutrain.backend.cpu.kernels import kernels as cpu
  from blutrain.backend.cuda.array import CudaArray
  from blutrain.backend.cuda.kernels import optim
  from blutrain.shapes import contiguous_strides
  pdt, gdt = (dtypes_.split("/") * 2)[:2]
  ty = {"fp32": (torch.float32, dtypes.float32), "bf16": (torch.bfloat16, dtypes.bfloat16)}
  rng = np.random.default_rng(len(dtypes_) + int(100 * momentum))
  make = lambda dt: [torch.tensor(rng.standard_normal(s)).to(ty[dt][0]) for s in sizes]
  params, grads, bufs = make(pdt), make(gdt), make(pdt)
  lr, state = 0.05, bufs if momentum else []
  host = lambda t: t.view(torch.int16).numpy().view(dtypes.bfloat16.np) if t.dtype == torch.bfloat16 else t.numpy()
  want = cpu["sgd"](*(host(t).copy() for t in (*params, *grads, *state)), np.float64(lr), n=len(sizes),
                    momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                    maximize=maximize, is_first_step=first)
  strides = lambda t: tuple(t.stride()) if t.numel() else contiguous_strides(tuple(t.shape))  # torch's empty: 0s
  arrays = lambda ts, dt: [CudaArray(t.data_ptr(), tuple(t.shape), strides(t), ty[dt][1], 0, t) for t in ts]
  rows = optim._sgd_rows(arrays(params, pdt), arrays(grads, gdt), arrays(state or params, pdt), [])
  ((p_dt, g_dt, _), group), = rows.items()
  host, chunks = optim.host_tables(group, 4)
  table, chunks = torch.from_numpy(host), torch.from_numpy(chunks)
  lr_dev, clip = torch.tensor([lr], dtype=torch.float64), torch.ones(1)
  vectors = optim._vectors(host, 3)
  assert vectors == (sizes is ALIGNED_SIZES)
  s = optim.sgd_spec(p_dt, g_dt, momentum != 0, first, dampening != 0, nesterov, maximize, weight_decay != 0,
                     lr_on_device, False, vectors)
  s[0][(chunks.shape[0],)](table, chunks, 0 if lr_on_device else optim.f64_bits(lr), lr_dev, clip,
                           float(np.float32(weight_decay)), float(np.float32(momentum)),
                           float(np.float32(1 - dampening)), **s.constexprs)
  got = [*params, *state]
  assert len(got) == len(want)
  for i, (a, b) in enumerate(zip(got, want)):
    what = f"case {dtypes_} momentum {momentum}: output {i}"
    if a.dtype == torch.bfloat16:  # the interpreter rounds to bfloat16 toward zero (a GPU to nearest): an ulp apart
      np.testing.assert_allclose(a.float().numpy(), b.astype(np.float32), rtol=2**-7, atol=2**-7, err_msg=what)
    else: np.testing.assert_array_equal(a.numpy(), b, err_msg=what)


def _patch_interpreter_index():
  """Triton 3.6's interpreter holds a loaded scalar as a 1-element array, which numpy 2 will not turn into the int a
  `range` bound needs (the kernel loops from its chunk's start to its end, both loaded): take the element
  (test-only)."""
  from triton.runtime import interpreter
  patch = interpreter._patch_lang_tensor

  def patched(tensor, scope):
    patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
  interpreter._patch_lang_tensor = patched


def main() -> None:
  _patch_interpreter_index()
  for case in CASES: _run_case(*case)
  for case in CASES[:2]: _run_case(*case, sizes=ALIGNED_SIZES)
  print("ok")


def test_vectors_need_every_walked_pointer_aligned_and_every_size_a_multiple_of_four():
  from blutrain.backend.cuda.kernels import optim
  assert optim._vectors(np.array([(4096, 8192, 12, 64), (16, 32, 99, 4)]), 2)  # the third pointer is not walked
  assert not optim._vectors(np.array([(4096, 8200, 64)]), 2)
  assert not optim._vectors(np.array([(4096, 8192, 66)]), 2)


def test_sgd_kernel_under_triton_interpreter():
  run_under_triton_interpreter("tests.test_optim_interpret")


if __name__ == "__main__":
  main()


def test_chunks_cut_every_tensor_from_its_sizes_alone():
  from blutrain.backend.cuda.kernels import optim
  rng = np.random.default_rng(0)
  c = optim.CHUNK
  for sizes in [(1,), (c,), (c + 1, 1, 3 * c, 5), tuple(int(n) for n in rng.integers(1, 4 * c, 40))]:
    want = [(t, s) for t, n in enumerate(sizes) for s in range(0, n, c)]
    got = optim.host_tables([x for n in sizes for x in (0, n)], 2)[1]
    assert got.dtype == np.int64 and got.tolist() == [list(w) for w in want]


def test_rows_check_each_param_with_its_operands():
  """`_sgd_rows` and `_adamw_rows`, one pass over the parameters, refuse a param with gaps, a grad of another shape, a
  state of another dtype or layout than its param and a step not float64 (ValueError naming their shapes, dtypes and
  strides); an empty param has no row."""
  from blutrain import dtypes
  from blutrain.backend.cuda.array import CudaArray
  from blutrain.backend.cuda.kernels import optim
  f32, bf16, f64 = dtypes.float32, dtypes.bfloat16, dtypes.float64
  a = lambda strides=(3, 1), dtype=f32, shape=(4, 3), ptr=4096: CudaArray(ptr, shape, strides, dtype, 0, None)
  p, g, b, s, empty = a(), a(ptr=8192), a(ptr=12288), a((), f64, (), 256), a(shape=(0, 3))
  assert optim._sgd_rows([p, empty], [g, empty], [b, empty], []) == {(f32, f32, 0): [4096, 8192, 12288, 12]}
  assert optim._adamw_rows([p], [g], [b], [b], [s], []) == {(f32, f32, 0): [4096, 8192, 12288, 12288, 256, 12]}
  gaps, flipped = a((6, 1)), a((1, 4))
  for args, got in ((([gaps], [g], [gaps]), r"\(4, 3\) float32 strides \(6, 1\)"),
                    (([p], [a((4, 1), shape=(3, 4))], [b]), r"\(3, 4\) float32, \(4, 3\)"),
                    (([p], [g], [a(dtype=bf16)]), r"\(4, 3\) bfloat16 strides"),
                    (([p], [g], [flipped]), r"\(4, 3\) float32 strides \(1, 4\)$")):
    with pytest.raises(ValueError, match="fused_sgd: needs a dense param.*" + got): optim._sgd_rows(*args, [])
  for args, got in ((([gaps], [g], [gaps], [gaps], [s]), r"\(4, 3\) float32 strides \(6, 1\), \(4, 3\)"),
                    (([p], [g], [b], [flipped], [s]), r"strides \(1, 4\), step float64$"),
                    (([p], [g], [b], [b], [a((), f32, ())]), "step float32$")):
    with pytest.raises(ValueError, match="fused_adamw: needs a dense param.*" + got): optim._adamw_rows(*args, [])
