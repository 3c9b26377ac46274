"""bt.autocast against torch.autocast on the CPU (output dtypes, values, gradients), the CUDA policy emulated on
CPU tensors, and the float32 matmul precision setting."""
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import blutrain as bt
import blutrain.nn.functional as F
from blutrain import amp
from tests.helpers import TORCH_DTYPES, assert_close, dtype_name, to_numpy

BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}


def _pair(shape, dtype=bt.float32, seed=0, requires_grad=False, low=-2.0, high=2.0):
  a = np.random.default_rng(seed).uniform(low, high, shape)
  b = bt.tensor(a, dtype=bt.float32).to(dtype).requires_grad_(requires_grad)
  t = torch.tensor(a, dtype=torch.float32).to(TORCH_DTYPES[dtype]).requires_grad_(requires_grad)
  return b, t


# op name -> (blutrain fn, torch fn, input shapes); every input is passed both in float32 and in bfloat16
OPS = {
  "matmul": (lambda x, y: x @ y, lambda x, y: x @ y, [(3, 4, 5), (5, 6)]),
  "linear": (lambda x, w, b: F.linear(x, w, b), lambda x, w, b: TF.linear(x, w, b), [(4, 5), (3, 5), (3,)]),
  "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
           lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=True), [(2, 5, 8)] * 3),
  "sdpa_mask": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bt.tensor(np.tri(5, dtype=bool))),
                lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, attn_mask=torch.tensor(np.tri(5, dtype=bool))),
                [(2, 5, 8)] * 3),
  "softmax": (lambda x: F.softmax(x, -1), lambda x: TF.softmax(x, -1), [(3, 7)]),
  "log_softmax": (lambda x: F.log_softmax(x, -1), lambda x: TF.log_softmax(x, -1), [(3, 7)]),
  "layer_norm": (lambda x: F.layer_norm(x, (7,)), lambda x: TF.layer_norm(x, (7,)), [(3, 7)]),
  "cross_entropy": (lambda x: F.cross_entropy(x, bt.tensor([0, 6, 2])),
                    lambda x: TF.cross_entropy(x, torch.tensor([0, 6, 2])), [(3, 7)]),
  "sum": (lambda x: x.sum(-1), lambda x: x.sum(-1), [(3, 7)]),
  "mean": (lambda x: x.mean(), lambda x: x.mean(), [(3, 7)]),
  "exp": (lambda x: x.exp(), lambda x: x.exp(), [(3, 7)]),
  "gelu": (lambda x: F.gelu(x), lambda x: TF.gelu(x), [(3, 7)]),
  "add": (lambda x, y: x + y, lambda x, y: x + y, [(3, 7), (7,)]),
}


@pytest.mark.parametrize("dtype", [bt.float32, bt.bfloat16], ids=["f32_in", "bf16_in"])
@pytest.mark.parametrize("name", OPS)
def test_cpu_autocast_matches_torch(name, dtype):
  fn, tfn, shapes = OPS[name]
  pairs = [_pair(s, dtype, seed=i) for i, s in enumerate(shapes)]
  with bt.autocast("cpu"):
    got = fn(*[b for b, _ in pairs])
  with torch.autocast("cpu", dtype=torch.bfloat16):
    want = tfn(*[t for _, t in pairs])
  assert_close(got, want, what=f"{name} under autocast", **BF16_TOL)


class _Block:
  """LayerNorm -> causal self-attention -> residual -> LayerNorm -> logits -> cross-entropy, in either framework."""

  def __init__(self, lib, params):
    self.lib, self.p = lib, params

  def __call__(self, x, target):
    lib, p = self.lib, self.p
    f = TF if lib is torch else F
    B, T, C = x.shape
    h = f.layer_norm(x, (C,), p["ln_w"], p["ln_b"])
    q, k, v = f.linear(h, p["qkv_w"], p["qkv_b"]).split(C, dim=-1)
    heads = lambda t: t.reshape(B, T, 2, C // 2).transpose(1, 2)
    y = f.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    x = x + f.linear(y.transpose(1, 2).reshape(B, T, C), p["proj_w"])
    logits = f.linear(f.layer_norm(x, (C,)), p["head_w"])
    return f.cross_entropy(logits.reshape(B * T, -1), target.reshape(-1))


def _block_params(C=16, V=11):
  shapes = {"ln_w": (C,), "ln_b": (C,), "qkv_w": (3 * C, C), "qkv_b": (3 * C,), "proj_w": (C, C), "head_w": (V, C)}
  pairs = {n: _pair(s, seed=i, requires_grad=True, low=-0.5, high=0.5) for i, (n, s) in enumerate(shapes.items())}
  return {n: b for n, (b, _) in pairs.items()}, {n: t for n, (_, t) in pairs.items()}


@pytest.mark.parametrize("backward_inside", [False, True])
def test_cpu_autocast_training_step_matches_torch(backward_inside):
  bp, tp = _block_params()
  x, tx = _pair((2, 6, 16), seed=9)
  target = np.random.default_rng(3).integers(0, 11, (2, 6))
  with bt.autocast("cpu", dtype=bt.bfloat16):
    loss = _Block(bt, bp)(x, bt.tensor(target))
    if backward_inside: loss.backward()
  if not backward_inside: loss.backward()
  with torch.autocast("cpu", dtype=torch.bfloat16):
    tloss = _Block(torch, tp)(tx, torch.tensor(target))
  tloss.backward()
  assert_close(loss, tloss, what="loss", **BF16_TOL)
  for name in bp:
    assert bp[name].grad.dtype is bt.float32, f"{name}: gradient of a float32 parameter is {bp[name].grad.dtype.name}"
    assert_close(bp[name].grad, tp[name].grad, what=f"grad of {name}", atol=2e-2, rtol=5e-2)


def test_tied_weight_cast_once_gradients_add():
  w, tw = _pair((4, 4), requires_grad=True)
  x, tx = _pair((3, 4), seed=1)
  with bt.autocast("cpu"):
    out = F.linear(F.linear(x, w), w)
    again = F.linear(x, w)
  out.sum().backward()
  with torch.autocast("cpu", dtype=torch.bfloat16):
    tout = TF.linear(TF.linear(tx, tw), tw)
  tout.sum().backward()
  assert again.dtype is bt.bfloat16 and not amp._state.cache, "the cast cache lives only inside the context"
  assert_close(w.grad, tw.grad, what="grad of a weight used twice", atol=5e-2, rtol=5e-2)


def test_parameter_updated_inside_context_is_cast_again():
  w, _ = _pair((3, 4), requires_grad=True)
  x, _ = _pair((2, 4), seed=1)
  with bt.autocast("cpu"):
    before = F.linear(x, w)
    with bt.no_grad(): w.mul_(2.0)
    after = F.linear(x, w)
  np.testing.assert_allclose(to_numpy(after), 2 * to_numpy(before), rtol=2e-2, atol=1e-2)


def _steps_with_cache(cache_enabled: bool, steps: int = 3):
  """Steps of a 3-layer MLP under autocast whose second layer is skipped in the last step, with SGD updates between:
  the losses and the parameters' gradients of each step."""
  bt.manual_seed(0)
  layers = [bt.nn.Linear(8, 8) for _ in range(3)]
  x = bt.randn(4, 8)
  losses, grads = [], []
  for step in range(steps):
    with bt.autocast("cpu", cache_enabled=cache_enabled):
      h = x
      for m in layers if step < steps - 1 else layers[::2]: h = m(h).relu()
      loss = h.float().square().mean()
    loss.backward()
    losses.append(loss.item())
    grads.append([None if p.grad is None else p.grad.numpy().copy() for m in layers for p in m.parameters()])
    with bt.no_grad():
      for p in (p for m in layers for p in m.parameters() if p.grad is not None): p.sub_(0.1 * p.grad)
    for m in layers: m.zero_grad(set_to_none=True)
  return losses, grads


def test_parameters_cast_again_give_the_same_results():
  """From the second context on, the parameters the previous context cast are cast at its first cast by one
  multi-tensor op; losses and gradients equal those of casts one by one (no cache), bit for bit, also after each
  update and when a layer is skipped (its copies, cast ahead, get no gradient)."""
  (la, ga), (lb, gb) = _steps_with_cache(True), _steps_with_cache(False)
  assert la == lb
  for step_a, step_b in zip(ga, gb):
    for a, b in zip(step_a, step_b):
      assert (a is None) == (b is None)
      if a is not None: np.testing.assert_array_equal(a, b)
  assert ga[-1][2] is None and ga[-1][3] is None  # the skipped layer's weight and bias


def test_second_context_casts_its_parameters_in_one_op(monkeypatch):
  from blutrain.backend.cpu.kernels import kernels
  from blutrain.ops.elementwise import cast_many_op, cast_op
  calls = []
  for o in (cast_op, cast_many_op):
    monkeypatch.setitem(o.kernels, "cpu", lambda *xs, _k=kernels[o.name], _n=o.name, **kw: calls.append(_n) or _k(*xs, **kw))
  layers, x = [bt.nn.Linear(4, 4) for _ in range(3)], bt.randn(2, 4)
  for context in range(2):
    calls.clear()
    with bt.autocast("cpu"):
      h = x
      for m in layers: h = m(h)
      assert all(amp._state.cache[k][2]._node.op.name == "cast" for k in amp._state.cache)
    assert calls == (["cast"] * 7 if context == 0 else ["cast", "cast_many"])  # x, then the 6 parameters
    h.float().sum().backward()
  assert all(p.grad is not None and p.grad.dtype is bt.float32 for m in layers for p in m.parameters())


def test_parameter_gradients_are_cast_back_in_one_op_with_the_same_bits(monkeypatch):
  """Under autocast the parameters' gradients come back through their casts; the engine casts them back at the end
  of the walk, all in one op, except a parameter with a hook (cast when ready, which the hook sees) and one that
  also gets a float32 gradient (cast before that is added). Gradients equal one cast each, bit for bit."""
  from blutrain.autograd import engine
  from blutrain.backend.cpu.kernels import kernels
  from blutrain.ops.elementwise import cast_many_op
  batched = []
  monkeypatch.setitem(cast_many_op.kernels, "cpu", lambda *xs, **kw: batched.append(len(xs)) or
                      kernels["cast_many"](*xs, **kw))

  def grads(cast_each):
    monkeypatch.setattr(engine, "cast_each", cast_each)
    bt.manual_seed(0)
    layers = [bt.nn.Linear(8, 8) for _ in range(3)]
    seen = []
    layers[0].weight.register_hook(lambda g: seen.append(g.dtype))
    layers[2].bias.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.dtype))
    h = bt.randn(4, 8)
    with bt.autocast("cpu", dtype=bt.bfloat16):
      for m in layers: h = bt.nn.functional.gelu(m(h))
    (h.float().square().mean() + layers[1].weight.sum() / 7).backward()  # layers[1].weight also in float32
    assert seen == [bt.float32, bt.float32]
    return [p.grad.numpy() for m in layers for p in m.parameters()]

  cast_each = engine.cast_each
  one_by_one = grads(None)
  assert batched == []
  at_once = grads(cast_each)
  assert batched == [3], "layers[0].bias, layers[1].bias, layers[2].weight in one cast"
  for a, b in zip(at_once, one_by_one):
    assert a.dtype == np.float32
    np.testing.assert_array_equal(a, b)


def test_nesting_disable_and_device_type():
  x, _ = _pair((2, 3))
  with bt.autocast("cpu"):
    assert (x @ x.mT).dtype is bt.bfloat16 and bt.amp.is_autocast_enabled("cpu")
    with bt.autocast("cpu", enabled=False):
      assert (x @ x.mT).dtype is bt.float32 and not bt.amp.is_autocast_enabled("cpu")
    assert (x @ x.mT).dtype is bt.bfloat16
    with bt.autocast("cpu", dtype=bt.float16):
      assert (x @ x.mT).dtype is bt.float16 and bt.amp.get_autocast_dtype("cpu") is bt.float16
  assert (x @ x.mT).dtype is bt.float32 and bt.amp.get_autocast_dtype("cpu") is None
  with bt.autocast("cuda"):  # CUDA autocast leaves CPU tensors alone
    assert (x @ x.mT).dtype is bt.float32


def test_decorator_and_float64_untouched():
  @bt.autocast("cpu")
  def f(a, b): return a @ b

  x, _ = _pair((2, 3))
  assert f(x, x.mT).dtype is bt.bfloat16
  d = x.double()
  assert f(d, d.mT).dtype is bt.float64


@pytest.mark.parametrize("name,want", [("softmax", "float32"), ("log_softmax", "float32"), ("layer_norm", "float32"),
                                       ("sum", "float32"), ("mean", "float32"), ("exp", "float32"),
                                       ("cross_entropy", "float32"), ("gelu", "bfloat16"), ("add", "bfloat16"),
                                       ("matmul", "bfloat16"), ("linear", "bfloat16"), ("sdpa", "bfloat16")])
def test_cuda_policy_emulated_on_cpu(monkeypatch, name, want):
  """PyTorch's CUDA lists run softmax, norms, sums and exp/log in float32: emulated here by giving CPU tensors the
  CUDA table; values against torch with the casts the CUDA policy makes written out."""
  monkeypatch.setitem(amp.POLICY, "cpu", amp.POLICY["cuda"])
  fn, tfn, shapes = OPS[name]
  pairs = [_pair(s, bt.bfloat16, seed=i) for i, s in enumerate(shapes)]
  with bt.autocast("cpu"):
    got = fn(*[b for b, _ in pairs])
  tin = [t.float() if want == "float32" else t for _, t in pairs]
  ref = tfn(*tin)
  assert dtype_name(got) == want, f"{name}: {dtype_name(got)} under the CUDA policy, PyTorch gives {want}"
  assert_close(got, ref.to(TORCH_DTYPES[got.dtype]), what=name, **BF16_TOL)


def test_bad_arguments():
  with pytest.raises(ValueError, match="autocast: device_type must be one of"): bt.autocast("tpu")
  with pytest.raises(ValueError, match="autocast: dtype must be bfloat16 or float16, got float32"):
    bt.autocast("cpu", dtype=bt.float32)
  with pytest.raises(ValueError, match="set_float32_matmul_precision: expected one of"):
    bt.set_float32_matmul_precision("tf32")


def test_float32_matmul_precision_roundtrip():
  assert bt.get_float32_matmul_precision() == "highest"
  try:
    for p in ("high", "medium", "highest"):
      bt.set_float32_matmul_precision(p)
      assert bt.get_float32_matmul_precision() == p
  finally:
    bt.set_float32_matmul_precision("highest")
