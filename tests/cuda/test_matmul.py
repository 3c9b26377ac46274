"""cuBLASLt matmul on the GPU against float64 numpy: GPT-2 124M's GEMMs in their forward and backward layouts, small
odd shapes, every transpose and leading dim, batches and broadcasts, the bias epilogue, every precision (relative
error, max over max: fp32 < 1e-5, TF32 < 2e-3 and clearly above fp32's, bf16 < 1e-2), and the op through bt."""
import itertools

import numpy as np
import pytest

import blutrain as bt
from blutrain import dtypes
from blutrain.backend.cuda import memory
from blutrain.backend.cuda.kernels import cublaslt
from tests.cuda.operands import host, linear_on_both, place, stride_zero_batch

pytestmark = pytest.mark.cuda

# name -> (dtype, float32 matmul precision, bound on the relative error)
PRECISIONS = {"fp32": (dtypes.float32, "highest", 1e-5), "tf32": (dtypes.float32, "high", 2e-3),
              "bf16": (dtypes.bfloat16, "highest", 1e-2), "fp16": (dtypes.float16, "highest", 2e-3),
              "fp64": (dtypes.float64, "highest", 1e-12)}


@pytest.fixture(autouse=True)
def _highest():
  yield
  bt.set_float32_matmul_precision("highest")


def rounded(shape, dtype, seed) -> np.ndarray:
  """Random values already representable in dtype (so the float64 reference sees the same inputs)."""
  return np.random.default_rng(seed).standard_normal(shape).astype(dtype.np).astype(np.float64)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
  assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
  assert np.isfinite(got).all(), "non-finite values"
  return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def check(a, b, ma, mb, name, rows=None, what=""):
  dtype, precision, bound = PRECISIONS[name]
  bt.set_float32_matmul_precision(precision)
  out = cublaslt.matmul(place(a, dtype, ma), place(b, dtype, mb), tf32=precision != "highest")
  assert out.dtype is dtype and out.shape == np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
  got = host(out)
  if rows is not None: got, a = got[..., rows, :], a[..., rows, :]
  err = rel_err(got, a @ b)
  assert err < bound, f"{what} {name} a:{ma} b:{mb} {a.shape}@{b.shape}: relative error {err:.2e} >= {bound:.0e}"
  return err


# GPT-2 124M with B*T = 4096 rows (m, k, n): qkv, attention projection, MLP up and down, and the LM head (1024 rows)
GPT2 = {"qkv": (4096, 768, 2304), "proj": (4096, 768, 768), "fc": (4096, 768, 3072), "fc2": (4096, 3072, 768),
        "lm_head": (1024, 768, 50304)}


@pytest.mark.parametrize("name", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("gemm", GPT2)
def test_gpt2_gemms_in_linear_layouts(gemm, name):
  """y = x W^T (W stored (n, k): op T), dx = dy W (op N), dW = dy^T x (dy stored (rows, n): op T on A)."""
  m, k, n = GPT2[gemm]
  rows = np.random.default_rng(9).choice(m, 48, replace=False)
  x, w, dy = rounded((m, k), dtypes.float32, 1), rounded((n, k), dtypes.float32, 2) * 0.05, rounded((m, n), dtypes.float32, 3)
  dtype = PRECISIONS[name][0]
  x, w, dy = (t.astype(dtype.np).astype(np.float64) for t in (x, w, dy))
  check(x, w.T, "n", "t", name, rows, f"{gemm} forward")
  check(dy, w, "n", "n", name, rows, f"{gemm} dX")
  if gemm != "lm_head":  # dW contracts over the rows: (n, m) @ (m, k)
    check(dy.T, x, "t", "n", name, np.arange(0, n, max(1, n // 48)), f"{gemm} dW")


def test_tf32_is_used_and_less_precise_than_fp32():
  a, b = rounded((512, 1024), dtypes.float32, 4), rounded((1024, 384), dtypes.float32, 5)
  e32, e_tf32 = check(a, b, "n", "n", "fp32"), check(a, b, "n", "n", "tf32")
  assert e_tf32 > 10 * e32 and e_tf32 > 1e-5, f"TF32 error {e_tf32:.1e} vs fp32 {e32:.1e}: TF32 does not seem active"


ODD = [(1, 1, 1), (3, 5, 7), (17, 33, 65), (1, 64, 129), (127, 1, 5), (5, 300, 1), (64, 64, 64)]


@pytest.mark.parametrize("name", ["fp32", "tf32", "bf16", "fp64"])
@pytest.mark.parametrize("m,k,n", ODD)
def test_odd_shapes_every_layout(m, k, n, name):
  a, b = rounded((m, k), PRECISIONS[name][0], 6), rounded((k, n), PRECISIONS[name][0], 7)
  for ma, mb in itertools.product("n t ld".split(), repeat=2):
    check(a, b, ma, mb, name)


@pytest.mark.parametrize("name", ["fp32", "bf16"])
@pytest.mark.parametrize("sa,sb,ma,mb", [
  ((4, 33, 65), (4, 65, 17), "n", "t"),       # strided batch
  ((4, 33, 65), (65, 17), "n", "n"),          # shared weight: folded into one GEMM
  ((4, 33, 65), (65, 17), "t", "t"),          # shared weight with A transposed: B broadcast by stride 0
  ((2, 3, 9, 16), (3, 16, 5), "n", "t"),      # broadcast outer batch dim: host loop
  ((3, 1, 9, 16), (3, 4, 16, 5), "ld", "n"),  # A broadcast inside: stride 0 in cuBLASLt's batch
  ((2, 12, 64, 64), (2, 12, 64, 128), "t", "n"),
])
def test_batched_and_broadcast(sa, sb, ma, mb, name):
  dtype = PRECISIONS[name][0]
  check(rounded(sa, dtype, 8), rounded(sb, dtype, 9), ma, mb, name)


def test_expanded_operand_with_stride_zero_batch():
  expanded, b, want = stride_zero_batch()
  assert rel_err(host(cublaslt.matmul(expanded, b)), want) < 1e-5


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_bias_epilogue(name):
  dtype, _, bound = PRECISIONS[name]
  x, w, bias = rounded((3, 100, 96), dtype, 12), rounded((80, 96), dtype, 13), rounded((80,), dtype, 14)
  got = host(cublaslt.matmul_bias(place(x, dtype, "n"), place(w.T, dtype, "t"), memory.from_numpy(bias.astype(dtype.np))))
  assert rel_err(got, x @ w.T + bias) < bound


def test_empty_and_zero_k():
  out = cublaslt.matmul(place(np.ones((4, 0)), dtypes.float32, "n"), place(np.ones((0, 3)), dtypes.float32, "n"))
  np.testing.assert_array_equal(host(out), np.zeros((4, 3)))
  assert cublaslt.matmul(place(np.ones((0, 5)), dtypes.float32, "n"), place(np.ones((5, 3)), dtypes.float32, "n")).shape == (0, 3)


def test_integer_matmul_is_refused():
  a = memory.from_numpy(np.ones((2, 2), np.int64))
  with pytest.raises(RuntimeError, match="matmul: int64 matmul .* not supported on CUDA"):
    cublaslt.matmul(a, a)


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_through_the_op_library_with_gradients(precision):
  bt.set_float32_matmul_precision(precision)
  results = linear_on_both()
  bound = 1e-5 if precision == "highest" else 3e-3
  for name, got, want in zip(("y", "dx", "dw"), results["cuda"], results["cpu"]):
    assert rel_err(got, want) < bound, f"{name} on CUDA vs CPU ({precision})"


@pytest.mark.parametrize("name", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("matmul", ["cublas", "triton"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained weight", "frozen weight"])
def test_linear_op_with_bias_and_its_gradients(name, matmul, frozen, monkeypatch):
  """Eager linear (one GEMM whose epilogue adds the bias) and its VJP (`linear_backward`: dW and db from one GEMM, or
  db alone from a reduction when the weight is frozen) against float64, with x a transposed view (read through a
  copy); bf16 through autocast, as a model runs it."""
  dtype, precision, bound = PRECISIONS[name]
  monkeypatch.setattr(bt.backends, "matmul", matmul)
  bt.set_float32_matmul_precision(precision)
  x, w, b, g = (rounded(s, dtype, seed) for s, seed in (((3, 40, 64), 20), ((48, 64), 21), ((48,), 22), ((3, 40, 48), 23)))
  xt = bt.tensor(np.ascontiguousarray(x.swapaxes(1, 2)).astype(np.float32)).to("cuda").requires_grad_()
  wt, bias = (bt.tensor(a.astype(np.float32)).to("cuda").requires_grad_() for a in (w, b))
  if frozen: wt.requires_grad_(False)
  with bt.autocast("cuda", dtype=bt.bfloat16, enabled=name == "bf16"):
    y = bt.nn.functional.linear(xt.transpose(1, 2), wt, bias)
  assert y._node.op.name == "linear" and y.dtype is dtype
  (y.float() * bt.tensor(g.astype(np.float32)).to("cuda")).sum().backward()
  want = {"y": x @ w.T + b, "dx": np.swapaxes(g @ w, 1, 2), "dw": np.einsum("bto,bti->oi", g, x), "db": g.sum((0, 1))}
  assert (wt.grad is None) == frozen
  for what, t in zip(want, (y, xt.grad, wt.grad, bias.grad)):
    if t is None: continue
    err = rel_err(t.detach().float().cpu().numpy().astype(np.float64), want[what])
    assert err < bound, f"linear {name} ({matmul}) {what}: relative error {err:.2e} >= {bound:.0e}"
