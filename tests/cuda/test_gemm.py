"""Synthesized GEMMs (kernels/gemm/) on the GPU against float64 numpy: each structure the host picks (persistent TMA
and pointer kernels, split-K, the K-major copy of TF32 operands, the swapped orientation), every precision, operand
layout and stride, batches and broadcasts, every epilogue op against the composition of ops, and matmul through the
op library with `bt.backends.matmul = "triton"`. Errors are relative in the Frobenius norm: TF32 < 5e-4 (the issue's
target) on random float32 inputs, 3xTF32 < 2e-6, fp16 < 1e-3, bf16 < 6e-3 (both with the output's rounding); layout
tests feed TF32 values it multiplies exactly."""
import importlib
import itertools
import math

import numpy as np
import pytest

import blutrain as bt
from blutrain import dtypes
from blutrain.backend.cuda import memory
from blutrain.backend.cuda.array import CudaArray
from tests.cuda.operands import host, linear_on_both, place, stride_zero_batch

G = importlib.import_module("blutrain.backend.cuda.kernels.gemm")
pytestmark = pytest.mark.cuda

# name -> (operand dtype, precision, bound on the relative error)
KINDS = {"tf32": (dtypes.float32, "tf32", 5e-4), "tf32x3": (dtypes.float32, "tf32x3", 2e-6),
         "bf16": (dtypes.bfloat16, "", 6e-3), "fp16": (dtypes.float16, "", 1e-3)}
_SQRT1_2, _SQRT_2_PI = 0.7071067811865476, 0.7978845608028654


def rounded(shape, dtype, seed, scale=1.0) -> np.ndarray:
  """Random values representable in dtype (so the float64 reference sees the same inputs)."""
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype.np).astype(np.float64)


def exact(shape, kind, seed, scale=1.0) -> np.ndarray:
  """Inputs for layout tests: for TF32, values with 10 mantissa bits, which TF32 multiplies exactly, so any error
  beyond float32 rounding is a wrong element (few-element outputs would otherwise show TF32's error unaveraged)."""
  x = rounded(shape, KINDS[kind][0], seed, scale)
  if kind != "tf32": return x
  bits = x.astype(np.float32).view(np.uint32)
  return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
  assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
  assert np.isfinite(got).all(), "non-finite values"
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _phi(x): return 0.5 * (1 + np.vectorize(math.erf)(x * _SQRT1_2))  # the normal CDF


def gelu(x, tanh=False):
  if tanh: return 0.5 * x * (1 + np.tanh(_SQRT_2_PI * (x + 0.044715 * x ** 3)))
  return x * _phi(x)


def gelu_grad(x, tanh=False):
  if tanh:
    t = np.tanh(_SQRT_2_PI * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_PI * (1 + 3 * 0.044715 * x * x)
  return _phi(x) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def check(a, b, ma, mb, kind, what="", **kw):
  """gemm of a (stored as ma) and b (stored as mb) against float64; returns the error and the plan."""
  dtype, precision, bound = KINDS[kind]
  da, db = place(a, dtype, ma), place(b, dtype, mb)
  out = G.gemm(da, db, precision=precision or None, **kw)
  shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
  assert out.dtype is (kw.get("out_dtype") or dtype) and out.shape == shape, (out.dtype, out.shape)
  err = rel_err(host(out), a @ b)
  p = G.plan(da, db, out, precision=precision)
  s = p.schedule
  where = (f"{what} {kind} a:{ma} b:{mb} {a.shape}@{b.shape} ({p.structure.kind}, {s.BM}x{s.BN}x{s.BK}, split {s.split_k}, "
           f"copy {p.copy or '-'}, swap {s.swap})")
  assert err < bound, f"{where}: relative error {err:.2e} >= {bound:.0e}"
  return err, p


# GPT-2 124M's linears with B*T = 4096 rows (m, k, n)
GPT2 = {"qkv": (4096, 768, 2304), "proj": (4096, 768, 768), "fc": (4096, 768, 3072), "fc2": (4096, 3072, 768),
        "lm_head": (2048, 768, 50304)}


@pytest.mark.parametrize("kind", ["tf32", "bf16"])
@pytest.mark.parametrize("gemm", GPT2)
def test_gpt2_forward_and_backward_layouts(gemm, kind):
  """y = x W^T (W stored (n, k)), dx = dy W, dW = dy^T x: no copies of the activations, TF32 under 5e-4."""
  m, k, n = GPT2[gemm]
  dtype = KINDS[kind][0]
  x, w, dy = rounded((m, k), dtype, 1), rounded((n, k), dtype, 2, 0.05), rounded((m, n), dtype, 3)
  check(x, w.T, "n", "t", kind, f"{gemm} forward")
  check(dy, w, "n", "n", kind, f"{gemm} dX")
  check(dy.T, x, "t", "n", kind, f"{gemm} dW")


ODD = [(1, 1, 1), (3, 5, 7), (17, 33, 65), (127, 1, 5), (5, 300, 1), (64, 64, 64)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m,k,n", ODD)
def test_odd_shapes_every_layout(m, k, n, kind):
  """Both stored layouts of each operand, and misaligned rows in TF32 and bf16 (3xTF32 and fp16 share their paths);
  padded aligned rows run in the batched test."""
  a, b = exact((m, k), kind, 6), exact((k, n), kind, 7)
  modes = "n t odd" if kind in ("tf32", "bf16") else "n t"
  for ma, mb in itertools.product(modes.split(), repeat=2):
    check(a, b, ma, mb, kind)


@pytest.mark.parametrize("kind", ["tf32", "bf16"])
@pytest.mark.parametrize("m,k,n", [(512, 8192, 512), (96, 20000, 200), (96, 20001, 200)])
def test_split_k(m, k, n, kind):
  """Small outputs with a long K split K; every layout, so the TF32 copy of an operand combines with it. An odd K
  keeps float32 off TMA (16-byte row strides): the pointer kernel splits too."""
  a, b = exact((m, k), kind, 16), exact((k, n), kind, 17)
  splits = set()
  for ma, mb in itertools.product("nt", repeat=2):
    splits.add(check(a, b, ma, mb, kind, "split-K")[1].schedule.split_k)
  assert max(splits) > 1, f"no split-K for {m}x{k}x{n}: the configurator's rule changed"


# (m, k, n, stored layouts of a and b): warp-specialized TF32 kernels (non-split, and split-K storing its partial sums
# by TMA), the in-kernel-rounding and swapped ones beside them, bf16 split-K by TMA
REPEATED = [(2048, 50304, 768, "n", "n"), (512, 8192, 512, "n", "n"), (512, 8192, 512, "t", "t"),
            (512, 8192, 512, "n", "t"), (1024, 768, 50304, "n", "t"), (4096, 768, 2304, "n", "t"),
            (2304, 16384, 768, "t", "n"), (1024, 4096, 1024, "n", "n"), (1024, 32768, 768, "n", "n")]


@pytest.mark.parametrize("kind", ["tf32", "bf16"])
@pytest.mark.parametrize("m,k,n,ma,mb", REPEATED)
def test_repeated_runs_are_exact_and_bitwise_equal(m, k, n, ma, mb, kind):
  """Ten runs of one GEMM on inputs TF32 multiplies exactly: every run within the bound and bitwise equal to the
  first. Catches races (a warp-specialized kernel's producer overwriting data its consumers still read gave wrong
  elements that changed between runs), which one run can miss."""
  a, b = exact((m, k), kind, 21), exact((k, n), kind, 22, 0.05)
  dtype, precision, bound = KINDS[kind]
  da, db = place(a, dtype, ma), place(b, dtype, mb)
  first = host(G.gemm(da, db, precision=precision or None))
  p = G.plan(da, db, G.gemm(da, db, precision=precision or None), precision=precision)
  where = f"{kind} {m}x{k}x{n} a:{ma} b:{mb} ({p.schedule})"
  assert rel_err(first, a @ b) < bound, where
  for i in range(9):
    again = host(G.gemm(da, db, precision=precision or None))
    assert np.array_equal(again, first), f"{where}: run {i + 2} differs in {int((again != first).sum())} elements"


@pytest.mark.parametrize("kind", ["tf32", "bf16"])
@pytest.mark.parametrize("sa,sb,ma,mb", [
  ((4, 33, 65), (4, 65, 17), "n", "t"),       # strided batch
  ((4, 33, 65), (65, 17), "n", "n"),          # shared weight: folded into one GEMM
  ((4, 33, 65), (65, 17), "t", "t"),          # shared weight with A transposed: a batched kernel, B by stride 0
  ((2, 3, 9, 16), (3, 16, 5), "n", "t"),      # broadcast outer batch dim: host loop
  ((3, 1, 9, 16), (3, 4, 16, 5), "ld", "n"),  # A broadcast inside: stride 0 in the kernel's batch
  ((2, 12, 64, 64), (2, 12, 64, 128), "t", "n"),
  ((8, 128, 4096), (8, 4096, 64), "n", "n"),  # batched split-K
])
def test_batched_and_broadcast(sa, sb, ma, mb, kind):
  check(exact(sa, kind, 8), exact(sb, kind, 9), ma, mb, kind)


def test_expanded_operand_with_stride_zero_batch():
  expanded, b, want = stride_zero_batch()
  assert rel_err(host(G.gemm(expanded, b, precision="tf32x3")), want) < 2e-6


EPILOGUES = [("scale",), ("bias",), ("gelu",), ("gelu_tanh",), ("residual",), ("gelu_backward",),
             ("gelu_backward_tanh",), ("bias", "gelu_tanh"), ("scale", "bias", "gelu", "residual"),
             ("bias", "residual", "gelu_backward")]


def _reference(acc, epilogue, alpha, bias, res, x):
  for op in epilogue:
    if op == "scale": acc = acc * alpha
    elif op == "bias": acc = acc + bias
    elif op in ("gelu", "gelu_tanh"): acc = gelu(acc, op == "gelu_tanh")
    elif op == "residual": acc = acc + res
    else: acc = acc * gelu_grad(x, op.endswith("tanh"))
  return acc


# (kind, shape, operand modes): a batched pointer kernel, a persistent TMA kernel, a split-K one; each epilogue runs
# in two of them, in both precisions
CASES = [("tf32", (3, 100, 96, 80), "nt"), ("bf16", (256, 1024, 384), "tn"), ("tf32", (64, 20000, 96), "nn"),
         ("bf16", (3, 100, 96, 80), "nt"), ("tf32", (256, 1024, 384), "tn"), ("bf16", (64, 20000, 96), "nn")]


@pytest.mark.parametrize("i", range(2))
@pytest.mark.parametrize("e", range(len(EPILOGUES)), ids=["+".join(e) for e in EPILOGUES])
def test_epilogues_match_the_composition(e, i):
  """The fused epilogue against the same ops applied to the float64 product; the residual broadcasts over rows in
  the batched case, the gelu input is stored transposed; the split-K case runs the epilogue after the sum."""
  epilogue = EPILOGUES[e]
  kind, shape, modes = CASES[(e + 3 * i) % len(CASES)]
  dtype, precision, bound = KINDS[kind]
  *batch, m, k, n = shape
  a, b = exact((*batch, m, k), kind, 20), exact((*batch, k, n), kind, 21, 1 / np.sqrt(k))
  bias, x = rounded((n,), dtype, 22), rounded((*batch, m, n), dtype, 23)
  res = rounded((n,) if batch else (m, n), dtype, 24)
  kw = {"bias": place(bias, dtype, "n") if "bias" in epilogue else None,
        "residual": place(res, dtype, "n") if "residual" in epilogue else None,
        "gelu_input": place(x, dtype, "t") if any(op.startswith("gelu_backward") for op in epilogue) else None}
  out = G.gemm(place(a, dtype, modes[0]), place(b, dtype, modes[1]), epilogue=epilogue, alpha=0.75,
               precision=precision or None, **kw)
  want = _reference(a @ b, epilogue, 0.75, bias, res, x)
  err = rel_err(host(out), want)
  assert err < 2 * bound, f"{'+'.join(epilogue)} {kind} {shape}: relative error {err:.2e}"


@pytest.mark.parametrize("kind", ["tf32", "bf16"])
def test_out_argument_and_dtype(kind):
  """A given output of any strides (here transposed, then one without a unit stride) and a float32 output of
  16-bit operands."""
  dtype, precision, bound = KINDS[kind]
  a, b = exact((130, 70), kind, 30), exact((70, 90), kind, 31)
  t = memory.empty((90, 130), dtype)
  out = CudaArray(t.ptr, (130, 90), (1, 130), dtype, t.device, t.owner)
  assert G.gemm(place(a, dtype, "n"), place(b, dtype, "n"), out=out, precision=precision or None) is out
  assert rel_err(host(out), a @ b) < bound
  t = memory.empty((130, 180), dtype)
  out = CudaArray(t.ptr, (130, 90), (180, 2), dtype, t.device, t.owner)
  G.gemm(place(a, dtype, "n"), place(b, dtype, "t"), out=out, precision=precision or None)
  assert rel_err(host(out), a @ b) < bound
  got = G.gemm(place(a, dtype, "n"), place(b, dtype, "n"), out_dtype=dtypes.float32, precision=precision or None)
  assert got.dtype is dtypes.float32 and rel_err(host(got), a @ b) < (5e-4 if kind == "tf32" else 1e-5)


def test_tf32_rounds_operands_and_3xtf32_is_float32_level():
  """Both operands rounded (a K-major copy of B) stay well under TF32 truncation's 7.7e-4; B truncated (a square
  too small for its copy) still under 5e-4; 3xTF32 at float32's level."""
  a, b = rounded((16384, 256), dtypes.float32, 40), rounded((256, 512), dtypes.float32, 41)
  err, p = check(a, b, "n", "t", "tf32")
  assert p.copy == "b" and err < 3.5e-4, (p.copy, err)
  a, b = rounded((512, 1024), dtypes.float32, 42), rounded((1024, 384), dtypes.float32, 43)
  err, p = check(a, b, "n", "t", "tf32")
  assert not p.copy and 1e-5 < err < 5e-4, (p.copy, err)
  assert check(a, b, "n", "t", "tf32x3")[0] < 2e-6


def test_empty_and_zero_k():
  out = G.gemm(place(np.ones((4, 0)), dtypes.float32, "n"), place(np.ones((0, 3)), dtypes.float32, "n"))
  np.testing.assert_array_equal(host(out), np.zeros((4, 3)))
  bias = place(np.arange(3.0), dtypes.float32, "n")
  out = G.gemm(place(np.ones((4, 0)), dtypes.float32, "n"), place(np.ones((0, 3)), dtypes.float32, "n"),
               epilogue=("bias", "gelu"), bias=bias)
  np.testing.assert_allclose(host(out), np.broadcast_to(gelu(np.arange(3.0)), (4, 3)), rtol=1e-6)
  assert G.gemm(place(np.ones((0, 5)), dtypes.float32, "n"), place(np.ones((5, 3)), dtypes.float32, "n")).shape == (0, 3)


def test_misuse_is_refused():
  a = place(np.ones((4, 5)), dtypes.float32, "n")
  with pytest.raises(ValueError, match="gemm: cannot contract"):
    G.gemm(a, a)
  with pytest.raises(ValueError, match="bias must be given exactly when"):
    G.gemm(a, place(np.ones((5, 3)), dtypes.float32, "n"), epilogue=("bias",))
  with pytest.raises(TypeError, match="share a dtype"):
    G.gemm(a, place(np.ones((5, 3)), dtypes.bfloat16, "n"))


@pytest.fixture
def triton_matmul():
  before = bt.backends.matmul
  bt.backends.matmul = "triton"
  yield
  bt.backends.matmul = before
  bt.set_float32_matmul_precision("highest")


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_matmul_op_through_triton_gemm_with_gradients(triton_matmul, precision):
  """bt.backends.matmul = "triton": linear forward and backward on CUDA against the CPU backend."""
  bt.set_float32_matmul_precision(precision)
  results = linear_on_both()
  bound = 2e-6 if precision == "highest" else 2e-3  # TF32: dx and dw also carry y's error
  for name, got, want in zip(("y", "dx", "dw"), results["cuda"], results["cpu"]):
    assert rel_err(got, want) < bound, f"{name} on CUDA (triton, {precision}) vs CPU"
