"""Nova's norm fusion on a real GPU: the fused kernels compute the bits of the kernels they replace (the residual add
and the layer norm; the norm's backward and the gradient's add), for one-tile and two-pass rows, float32 and half
operands; a compiled GPT step with the fusions equals the eager step."""
import numpy as np
import pytest

import blutrain as bt
from blutrain.ops import registry
from blutrain.ops.core import apply
from tests.helpers import assert_as_accurate

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))


def _randn(shape, dtype=bt.float32, scale=1.0, shift=0.0):
  return (bt.randn(*shape) * scale + shift).to(dtype).to("cuda")


@pytest.mark.parametrize("shape", [(64, 768), (3, 20000), (0, 8)])
@pytest.mark.parametrize("half, out", [(None, None), (bt.bfloat16, bt.bfloat16), (bt.float16, None)])
@pytest.mark.parametrize("affine", [True, False])
def test_add_layer_norm_equals_the_add_and_the_norm(shape, half, out, affine):
  x, y = _randn(shape, scale=3, shift=1), _randn(shape, half or bt.float32)
  n = shape[-1]
  w, b = (_randn((n,)), _randn((n,))) if affine else (None, None)
  attrs = dict(n=1, eps=1e-5, **({"dtype": out} if out else {}))
  h, normed = apply(registry["add_layer_norm"], x, y, w, b, **attrs)
  want_h = apply(registry["add"], x, y)
  want = apply(registry["layer_norm"], want_h, w, b, **attrs)
  assert h.dtype is bt.float32 and normed.dtype is (out or bt.float32)
  np.testing.assert_array_equal(h.cpu().numpy(), want_h.cpu().numpy())
  np.testing.assert_array_equal(normed.float().cpu().numpy(), want.float().cpu().numpy())


@pytest.mark.parametrize("shape", [(16384, 768), (5, 20000), (7, 33)])
@pytest.mark.parametrize("g_dtype, r_dtype", [(bt.float32, bt.float32), (bt.bfloat16, bt.bfloat16),
                                              (bt.float32, bt.float16)])
@pytest.mark.parametrize("weight, has_bias", [(True, True), (False, False), (True, False)])
def test_norm_backward_with_a_residual_gradient_equals_the_backward_and_the_add(shape, g_dtype, r_dtype, weight,
                                                                                has_bias):
  g, x, r = _randn(shape, g_dtype), _randn(shape, scale=2, shift=-1), _randn(shape, r_dtype)
  w = _randn(shape[-1:]) if weight else None
  attrs = dict(n=1, eps=1e-5, has_bias=has_bias)
  fused = apply(registry["layer_norm_backward"], g, x, w, r, **attrs)
  plain = apply(registry["layer_norm_backward"], g, x, w, None, **attrs)
  np.testing.assert_array_equal(fused[0].cpu().numpy(), apply(registry["add"], plain[0], r).cpu().numpy())
  for a, b in zip(fused[1:], plain[1:]):
    assert (a is None) == (b is None)
    if a is not None: np.testing.assert_array_equal(a.cpu().numpy(), b.cpu().numpy())


@pytest.mark.parametrize("shape", [(16384, 768), (5, 20000), (7, 33)])
@pytest.mark.parametrize("cast", [bt.bfloat16, bt.float16])
@pytest.mark.parametrize("residual", [False, True])
def test_the_half_copy_of_dx_is_dx_cast(shape, cast, residual):
  """layer_norm_backward(..., cast=half)[3] is the cast of its dx, bit for bit (Nova's fuse-norms folds autocast's
  cast of the residual stream's gradient into the kernel), and the other results are the plain op's."""
  g, x, w = _randn(shape, bt.bfloat16), _randn(shape, scale=2, shift=-1), _randn(shape[-1:])
  r = _randn(shape) if residual else None
  attrs = dict(n=1, eps=1e-5, has_bias=True)
  fused = apply(registry["layer_norm_backward"], g, x, w, r, cast=cast, **attrs)
  plain = apply(registry["layer_norm_backward"], g, x, w, r, **attrs)
  assert fused[3].dtype is cast and plain[3] is None
  np.testing.assert_array_equal(fused[3].float().cpu().numpy(), plain[0].to(cast).float().cpu().numpy())
  for a, b in zip(fused[:3], plain[:3]): np.testing.assert_array_equal(a.cpu().numpy(), b.cpu().numpy())


@pytest.mark.parametrize("shape", [(16384, 768), (5, 20000), (7, 33)])
@pytest.mark.parametrize("cast", [None, bt.bfloat16])
def test_the_column_sums_of_dx_are_a_bias_gradient(shape, cast):
  """layer_norm_backward(..., bias_grad=True)[4]: the float32 column sums of dx as stored (its half copy when there is
  one; Nova's fuse-bias-grads takes the next linear layer's bias gradient from them) against float64 sums of the
  stored values; the other results are the plain op's, bit for bit."""
  g, x, w, r = _randn(shape, bt.bfloat16), _randn(shape, scale=2, shift=-1), _randn(shape[-1:]), _randn(shape)
  attrs = dict(n=1, eps=1e-5, has_bias=True, cast=cast)
  fused = apply(registry["layer_norm_backward"], g, x, w, r, bias_grad=True, **attrs)
  plain = apply(registry["layer_norm_backward"], g, x, w, r, **attrs)
  stored = (fused[3] if cast else fused[0]).cpu().numpy().astype(np.float64)
  assert fused[4].dtype is bt.float32 and fused[4].shape == shape[-1:] and plain[4] is None
  np.testing.assert_allclose(fused[4].cpu().numpy(), stored.sum(0), rtol=1e-5, atol=1e-5 * np.abs(stored).sum(0).max())
  for a, b in zip(fused[:4], plain[:4]):
    if a is not None: np.testing.assert_array_equal(a.float().cpu().numpy(), b.float().cpu().numpy())


def test_param_grads_against_float64():
  """dx, dw and db of GPT-2's rows (dw and db through the partial sums and their reduction kernel), against PyTorch's
  CPU backward in float64."""
  torch = pytest.importorskip("torch")
  g, x, w = _randn((16384, 768), bt.bfloat16), _randn((16384, 768), scale=2), _randn((768,))
  dx, dw, db, _, _ = apply(registry["layer_norm_backward"], g, x, w, None, n=1, eps=1e-5, has_bias=True)
  tx = torch.from_numpy(x.cpu().numpy()).double().requires_grad_()
  tw = torch.from_numpy(w.cpu().numpy()).double().requires_grad_()
  tb = torch.zeros(768, dtype=torch.float64, requires_grad=True)
  torch.nn.functional.layer_norm(tx, (768,), tw, tb, 1e-5).backward(torch.from_numpy(g.float().cpu().numpy()).double())
  for got, want in ((dx, tx.grad), (dw, tw.grad), (db, tb.grad)):
    np.testing.assert_allclose(got.cpu().numpy(), want.numpy(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("amp", [False, True])
def test_compiled_gpt_step_with_fused_norms_equals_eager(amp):
  """Compiled == eager; under bf16 autocast, where the two round differently (the compiled step's fused groups round
  once) and Adam amplifies that noise in near-zero gradients, the compiled parameters must be at least about as close
  to a float32 run's as the eager ones are."""
  from blutrain.models import GPT, GPTConfig
  results = []
  for compiled, autocast in ((False, amp), (True, amp)) + (((False, False),) if amp else ()):
    bt.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=64)).to("cuda")
    opt = bt.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    def step(x, y):
      with bt.autocast(device_type="cuda", dtype=bt.bfloat16, enabled=autocast):
        _, loss = model(x, y)
      loss.backward()
      bt.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
      opt.step(); opt.zero_grad()
      return loss
    fn = bt.compile(step) if compiled else step
    rng = np.random.default_rng(2)
    losses = [fn(*(bt.from_numpy(rng.integers(0, 96, (4, 32))).to("cuda") for _ in range(2))).item() for _ in range(4)]
    results.append((losses, [p.detach().cpu().numpy() for p in model.parameters()]))
    if compiled: source = open(fn.info["source"]).read()
  (eager_losses, eager_params), (losses, params) = results[:2]
  exact_params = results[-1][1]
  if amp: assert_as_accurate(np.array(losses), np.array(eager_losses), np.array(results[-1][0]), "losses")
  else: np.testing.assert_allclose(losses, eager_losses, rtol=1e-4)
  for name, a, b, exact in zip((n for n, _ in model.named_parameters()), params, eager_params, exact_params):
    if amp: assert_as_accurate(a, b, exact, name)
    else: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4, err_msg=name)
  # each residual add before a norm folds into the GEMM before it or the norm
  assert source.count('kernels["add_layer_norm"]') + source.count("epilogue='bias,residual'") == 4
