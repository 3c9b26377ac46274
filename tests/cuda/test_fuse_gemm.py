"""Nova's gemm op on the GPU: both paths of its kernel (cuBLASLt and separate kernels, one synthesized GEMM) against
the CPU kernel (the composition of the ops it replaces), and compiled == eager for GPT and MLPs with and without
biases, exact and tanh GELU, in float32 and under bf16 autocast."""
import numpy as np
import pytest

import blutrain as bt
from blutrain import dtypes, nn
from blutrain.backend.cpu.kernels import kernels as cpu
from blutrain.backend.cuda import kernels as cuda, memory
from blutrain.models import GPT, GPTConfig
from blutrain.nn import functional as F
from tests.cuda.operands import host, place
from tests.helpers import assert_adam_close

pytestmark = pytest.mark.cuda

F32, BF16 = dtypes.float32, dtypes.bfloat16
# bound on the error relative to the output's largest magnitude: TF32 products against the CPU's float32 ones; bf16
# outputs may differ by one rounding where the accumulation orders differ
BOUNDS = {F32: 2e-3, BF16: 2e-2}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))


CASES = [("bias", [(96,)], None), ("bias,gelu", [(96,)], None), ("bias,save,gelu_tanh", [(96,)], None),
         ("bias,gelu_tanh", [(96,)], None), ("save,gelu_tanh", [], None), ("gelu_tanh", [], None),
         ("bias,residual", [(96,), (3, 40, 96)], F32), ("gelu", [], None), ("residual", [(3, 40, 96)], None),
         ("gelu_backward", [(3, 40, 96)], None), ("gelu_backward_tanh", [(3, 40, 96)], None),
         ("gelu_backward,bias_grad", [(3, 40, 96)], None), ("gelu_backward_tanh,bias_grad", [(3, 40, 96)], None),
         ("residual,bias_grad", [(3, 40, 96)], None)]


@pytest.mark.parametrize("path", ["cublas", "nova"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("epilogue,shapes,out", CASES, ids=[c[0] for c in CASES])
def test_both_paths_compute_the_cpu_kernel(epilogue, shapes, out, dtype, path):
  rs = np.random.default_rng(3)
  a, w = rs.standard_normal((3, 40, 64)), rs.standard_normal((96, 64)) / 8
  out = out or dtype
  # a bias in the operands' dtype; a residual or GELU input in the output's (as the pass makes them)
  xs = [rs.standard_normal(s).astype((dtype if len(s) == 1 else out).np) for s in shapes]
  want = cpu["gemm"](a.astype(dtype.np), np.swapaxes(w.astype(dtype.np), 0, 1), *xs, epilogue=epilogue, dtype=out,
                     tf32=True)
  got = cuda["gemm"](place(a, dtype, "n"), place(np.swapaxes(w, 0, 1), dtype, "t"),
                     *(memory.from_numpy(x) for x in xs), epilogue=epilogue, dtype=out, tf32=True, path=path)
  sums = epilogue.endswith("bias_grad")
  assert len(got) == len(want) == 1 + epilogue.split(",").count("save") + sums
  for g, e in zip(got[:len(got) - sums], want):
    assert g.dtype is (out if g is got[0] else dtype) and g.shape == e.shape
    e = e.astype(np.float64)
    assert np.abs(host(g) - e).max() <= BOUNDS[dtype] * np.abs(e).max(), (epilogue, path)
  if sums:  # the output's column sums as stored, in float32 (the GELU backward's kernel or a reduction)
    stored = host(got[0]).astype(np.float64).reshape(-1, 96)
    assert got[-1].dtype is F32 and got[-1].shape == (96,)
    np.testing.assert_allclose(host(got[-1]), stored.sum(0), rtol=1e-5, atol=1e-5 * np.abs(stored).sum(0).max())


def _gelu_tanh(h):
  return 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))


def _gelu_tanh_grad(h):
  t = np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3))
  return 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * h * h)


@pytest.mark.parametrize("dtype", [BF16, dtypes.float16], ids=str)
@pytest.mark.parametrize("rows", [16384, 200], ids=str)
def test_a_tanh_gelu_and_its_backward_run_in_cublaslts_epilogue(rows, dtype):
  """GPT-2's MLP GEMMs with a tanh GELU: the forward (bias, GELU, its input saved) and the backward (GELU's
  derivative at the saved input) each one cuBLASLt call with its own epilogue (no fallback to separate kernels),
  within a rounding of the float64 result of the operands as stored; with the bias gradient, the backward keeps
  the separate kernels (cuBLASLt's DGELU_BGRAD measured slower)."""
  from blutrain.backend.cuda.kernels import cublaslt
  rs = np.random.default_rng(7)
  x, w, b = rs.standard_normal((rows, 768)), rs.standard_normal((3072, 768)) / 28, rs.standard_normal(3072) / 10
  a, wt, bias = place(x, dtype, "n"), place(w.T, dtype, "t"), place(b, dtype, "n")
  fwd = cublaslt._gelu_epilogue(a, wt, (bias,), ("bias", "save", "gelu_tanh"), dtype, False, False)
  assert fwd is not None, "cuBLASLt offers GELU_AUX_BIAS for GPT-2's forward"
  y, h = fwd
  h64 = host(a) @ host(wt) + host(bias)
  for got, want in ((h, h64), (y, _gelu_tanh(h64))):
    assert got.dtype is dtype and got.shape == want.shape
    assert np.abs(host(got) - want).max() <= 1e-2 * np.abs(want).max()
  g, w2 = place(rs.standard_normal((rows, 768)), dtype, "n"), place(rs.standard_normal((768, 3072)) / 28, dtype, "n")
  bwd = cublaslt._gelu_epilogue(g, w2, (h,), ("gelu_backward_tanh",), dtype, False, False)
  assert bwd is not None, "cuBLASLt offers DGELU for GPT-2's backward"
  (dx,) = bwd
  want = (host(g) @ host(w2)) * _gelu_tanh_grad(host(h))
  assert dx.dtype is dtype and np.abs(host(dx) - want).max() <= 1e-2 * np.abs(want).max()
  assert cublaslt._gelu_epilogue(g, w2, (h,), ("gelu_backward_tanh",), dtype, False, True) is None


@pytest.mark.parametrize("shape", [(16384, 3072), (3, 100, 96), (7, 33)], ids=str)
@pytest.mark.parametrize("dtype, approximate", [(BF16, "none"), (F32, "tanh"), (dtypes.float16, "none")], ids=str)
def test_gelu_backward_with_column_sums_stores_the_elementwise_kernels_bits(shape, dtype, approximate):
  """reduce.gelu_backward_sums (fuse-bias-grads' GELU backward): dx bit for bit the elementwise kernel's, and the
  float32 sums of dx as stored over all dims but the last; strided operands take the elementwise kernel too."""
  from blutrain.backend.cuda.kernels import reduce
  rs = np.random.default_rng(5)
  g, x = ((rs.standard_normal(shape) * 2).astype(dtype.np) for _ in range(2))
  g = memory.from_numpy(g)
  want = host(cuda["gelu_backward"](g, memory.from_numpy(x), approximate=approximate))
  for mode in ("n", "t"):
    dx, sums = reduce.gelu_backward_sums(g, place(x, dtype, mode), approximate)
    np.testing.assert_array_equal(host(dx), want)
    stored = want.astype(np.float64).reshape(-1, shape[-1])
    assert sums.dtype is F32 and sums.shape == shape[-1:]
    np.testing.assert_allclose(host(sums), stored.sum(0), rtol=1e-5, atol=1e-5 * np.abs(stored).sum(0).max())


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(2304, 768), (768, 3072), (96, 40)], ids=["qkv", "fc", "small"])
def test_weight_grad_is_the_product_and_the_bias_gradient_from_one_gemm(shape, dtype):
  """dW = g^T x in float32 from cuBLASLt's accumulator and db = the column sums of g from its BGRADB epilogue, for
  g (tokens, out) read through its transposed view as Nova passes it; cuBLASLt must offer the epilogue for these
  layouts (no fallback to a reduction)."""
  from blutrain.backend.cuda.kernels import cublaslt
  rs = np.random.default_rng(5)
  n_out, n_in = shape
  g, x = rs.standard_normal((1000, n_out)), rs.standard_normal((1000, n_in))
  a, b = place(g.T, dtype, "t"), place(x, dtype, "n")
  g64, x64 = host(a).T, host(b)  # the operands as stored (rounded to dtype)
  out, db = memory.empty((n_out, n_in), F32, 0), memory.empty((n_out,), F32, 0)
  cublaslt._matmul(a, b, db, True, out, "bgradb")  # raises NoAlgorithm where cuBLASLt has no such kernel
  dw, db2 = cuda["weight_grad"](a, b, dtype=F32, bias_grad=True, tf32=True)
  want_w, want_b = g64.T @ x64, g64.sum(0)
  for got, want in ((out, want_w), (dw, want_w), (db, want_b), (db2, want_b)):
    assert got.dtype is F32 and got.shape == want.shape
    # float32 operands go through TF32 (the epilogue may sum them as rounded for the tensor cores); bf16 operands
    # multiply exactly and accumulate in float32
    tol = (2e-3 if dtype is F32 else 1e-5) * np.abs(want).max()
    assert np.abs(host(got) - want).max() <= tol
  (plain,) = cuda["weight_grad"](a, b, dtype=F32, bias_grad=False, tf32=True)
  np.testing.assert_array_equal(host(plain), host(dw))


def _train(make, compiled, autocast, steps=3):
  bt.manual_seed(0)
  model = make().to("cuda")
  opt = bt.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

  def step(x, y):
    with bt.autocast(device_type="cuda", dtype=bt.bfloat16, enabled=autocast):
      loss = model(x, y)[1] if isinstance(model, GPT) else F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss
  fn = bt.compile(step) if compiled else step
  rng = np.random.default_rng(1)
  losses = []
  for _ in range(steps):
    if isinstance(model, GPT): x, y = (bt.from_numpy(rng.integers(0, 96, (4, 32))).to("cuda") for _ in range(2))
    else:
      x = bt.from_numpy(rng.standard_normal((64, 48)).astype(np.float32)).to("cuda")
      y = bt.from_numpy(rng.integers(0, 10, 64)).to("cuda")
    losses.append(fn(x, y).item())
  return losses, {n: p.detach().float().cpu().numpy() for n, p in model.named_parameters()}, getattr(fn, "info", None)


def _gpt(bias, gelu="none"):
  return lambda: GPT(GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=64, bias=bias, gelu=gelu))


def _mlp(bias, approximate):
  return lambda: nn.Sequential(nn.Linear(48, 128, bias=bias), nn.GELU(approximate), nn.Linear(128, 10, bias=bias))


@pytest.mark.parametrize("autocast", [False, True], ids=["f32", "bf16-autocast"])
@pytest.mark.parametrize("make", [_gpt(True), _gpt(False), _gpt(True, "tanh"), _mlp(True, "none"), _mlp(True, "tanh"),
                                  _mlp(False, "none"), _mlp(False, "tanh")],
                         ids=["gpt", "gpt-nobias", "gpt-tanh", "mlp", "mlp-tanh", "mlp-nobias", "mlp-nobias-tanh"])
def test_models_compiled_equal_eager(make, autocast):
  eager_losses, eager_params, _ = _train(make, False, autocast)
  losses, params, info = _train(make, True, autocast)
  np.testing.assert_allclose(losses, eager_losses, rtol=2e-2 if autocast else 2e-5)
  for name, a in eager_params.items():
    # the GEMMs' rounding differs (synthesized against cuBLASLt; under bf16 cuBLASLt's bias and GELU epilogues round
    # once where eager rounds twice); Adam turns the noise of a gradient near zero (the key slice of c_attn.bias:
    # softmax ignores a bias added to every key alike) into steps of up to lr either way in each run, over 3 steps.
    # The tanh GPT's GELU epilogue moves up to 0.15 % of a weight's elements so (18 of 12,288 in one run); a wrong
    # gradient moves most of them
    if autocast:
      assert_adam_close(params[name], a, lr=2 * 3 * 1e-3, rtol=2e-2, atol=1e-4, what=name,
                        outliers=0.34 if name.endswith("c_attn.bias") else 1e-2)
      continue
    noise = 2 * 3 * 1e-3 if name.endswith("c_attn.bias") else 0.0
    np.testing.assert_allclose(params[name], a, rtol=2e-5, atol=1e-6 + noise, err_msg=name)
  assert info["counts_after"].get("gemm", 0) >= 2 and len(info["gemms"]) == info["counts_after"]["gemm"]
