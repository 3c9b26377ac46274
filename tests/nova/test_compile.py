"""bt.compile end to end on the CPU: compiled == eager for whole training steps and inference, guards and
recapture, the disk cache, dynamic learning rates, RNG, and graph breaks."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import blutrain as bt
from blutrain import nn
from blutrain.nn import functional as F
from blutrain.models import GPT, GPTConfig


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))


def _twins(make):
  """Two identical (model, optimizer) pairs built from the same seed."""
  pairs = []
  for _ in range(2):
    bt.manual_seed(0)
    pairs.append(make())
  return pairs


def _train_step(model, opt, clip=True):
  def step(x, y):
    _, loss = model(x, y) if isinstance(model, GPT) else (None, F.cross_entropy(model(x), y))
    loss.backward()
    if clip: nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss
  return step


def _assert_same_params(m1, m2, rtol=1e-6, atol=1e-7, noise: dict | None = None):
  """Parameters equal after the same steps. `noise` maps a parameter name to a slice whose true gradient is zero
  (rounding noise, which Adam turns into steps of about lr): there the two may differ by up to `lr * steps`, given
  as the value."""
  for (name, p), (_, q) in zip(m1.named_parameters(), m2.named_parameters()):
    a, b = p.detach().numpy().copy(), q.detach().numpy().copy()
    if noise and name in noise:
      where, bound = noise[name]
      assert np.abs(a[where] - b[where]).max() <= bound, name
      a[where] = b[where] = 0
    np.testing.assert_allclose(b, a, rtol=rtol, atol=atol, err_msg=name)


def test_gpt_training_steps_equal_eager():
  cfg = GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
  (m1, o1), (m2, o2) = _twins(lambda: (lambda m: (m, m.configure_optimizers(0.1, 1e-2)))(GPT(cfg)))
  eager, compiled = _train_step(m1, o1), bt.compile(_train_step(m2, o2))
  sched1 = bt.optim.lr_scheduler.warmup_cosine(o1, 2, 6)
  sched2 = bt.optim.lr_scheduler.warmup_cosine(o2, 2, 6)
  rng = np.random.default_rng(0)
  gen_state = bt.default_generator.offset
  for _ in range(5):
    x, y = (bt.from_numpy(rng.integers(0, 40, (3, 16))) for _ in range(2))
    bt.default_generator.offset = gen_state
    a = eager(x, y).item()
    bt.default_generator.offset = gen_state
    b = compiled(x, y).item()
    gen_state = bt.default_generator.offset
    assert abs(a - b) <= 1e-6 * abs(a), (a, b)
    sched1.step(); sched2.step()
  assert compiled.captures == 2, "the first call's graph (it creates AdamW's state), then the steady one"
  # softmax ignores a bias added to every key alike: the key slice of c_attn.bias has a zero true gradient
  keys = slice(cfg.n_embd, 2 * cfg.n_embd)
  _assert_same_params(m1, m2, noise={f"transformer.h.{i}.attn.c_attn.bias": (keys, 2 * 5 * 1e-2)
                                     for i in range(cfg.n_layer)})
  for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
    s1, s2 = o1.state[p], o2.state[q]
    assert s1["step"].item() == s2["step"].item() == 5
    v1, v2 = s1["exp_avg_sq"].numpy(), s2["exp_avg_sq"].numpy()
    np.testing.assert_allclose(v2, v1, rtol=1e-5, atol=1e-12 + 1e-5 * np.abs(v1).max(), err_msg=name)


@pytest.mark.parametrize("kind", ["mlp", "layernorm", "attention"])
def test_small_models_equal_eager(kind):
  def make():
    if kind == "mlp":
      model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 5))
    elif kind == "layernorm":
      model = nn.Sequential(nn.Linear(12, 16), nn.LayerNorm(16), nn.SiLU(), nn.RMSNorm(16), nn.Linear(16, 5))
    else:
      model = _Attention()
    return model, bt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
  (m1, o1), (m2, o2) = _twins(make)
  eager, compiled = _train_step(m1, o1, clip=False), bt.compile(_train_step(m2, o2, clip=False))
  rng = np.random.default_rng(1)
  for _ in range(4):
    x = bt.from_numpy(rng.standard_normal((6, 4, 12)).astype(np.float32)) if kind == "attention" else \
        bt.from_numpy(rng.standard_normal((6, 12)).astype(np.float32))
    y = bt.from_numpy(rng.integers(0, 5, 6))
    np.testing.assert_allclose(compiled(x, y).item(), eager(x, y).item(), rtol=1e-6)
  _assert_same_params(m1, m2)


class _Attention(nn.Module):
  def __init__(self):
    super().__init__()
    self.qkv, self.out = nn.Linear(12, 36), nn.Linear(12, 5)

  def forward(self, x):
    q, k, v = self.qkv(x).chunk(3, dim=-1)
    a = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), is_causal=True).squeeze(1)
    return self.out(a.mean(1))


def test_inference_function_and_module():
  bt.manual_seed(0)
  model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).eval()
  fwd = bt.compile(model)
  x = bt.randn(5, 8)
  with bt.no_grad():
    for _ in range(3):
      np.testing.assert_allclose(fwd(x).numpy(), model(x).numpy(), rtol=1e-6)

  @bt.compile
  def stats(a, b):
    return {"sum": (a * b).sum(), "parts": [a.softmax(-1), (a @ b.T).relu()]}
  a, b = bt.randn(4, 6), bt.randn(4, 6)
  for _ in range(3): out = stats(a, b)
  np.testing.assert_allclose(out["sum"].item(), (a * b).sum().item(), rtol=1e-5)
  np.testing.assert_allclose(out["parts"][1].numpy(), (a @ b.T).relu().numpy(), rtol=1e-6)


def test_a_step_that_fills_an_empty_tensor_equals_eager():
  """bt.empty is captured as nova.empty (a buffer no kernel writes); what the step writes into it comes out as eager
  mode's (a capture takes whole-tensor writes into an intermediate, not writes into its views)."""
  def fill(x):
    buf = bt.empty(4, 6)
    buf.copy_(x * 2)
    other = bt.empty_like(x.T)
    other.copy_(x.T.exp())
    return buf + other.T, bt.empty(0, 3, dtype=bt.int64)
  compiled = bt.compile(fill)
  x = bt.randn(4, 6)
  for _ in range(3):
    (got, nothing), (want, _) = compiled(x), fill(x)
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert nothing.shape == (0, 3) and nothing.dtype is bt.int64
  assert compiled.info["counts_before"]["empty"] == 3


def test_guard_recaptures_on_new_shape_and_hyperparameter():
  bt.manual_seed(0)
  model = nn.Linear(4, 2)
  opt = bt.optim.AdamW(model.parameters(), lr=1e-2)
  step = bt.compile(_train_step(model, opt, clip=False))
  y = bt.tensor([0, 1, 1])
  for _ in range(3): step(bt.randn(3, 4), y)
  assert step.captures == 2  # the first call's graph creates the optimizer's state; the second is replayed
  step(bt.randn(5, 4), bt.tensor([0, 1, 1, 0, 1]))
  assert step.captures == 3
  opt.param_groups[0]["weight_decay"] = 0.5
  step(bt.randn(3, 4), y)
  assert step.captures == 4
  opt.param_groups[0]["lr"] = 1e-3  # the learning rate is read at each call: no recapture
  step(bt.randn(3, 4), y)
  assert step.captures == 4


def test_guard_sees_every_change_of_the_module_trees_and_the_optimizer():
  """The guard walks the module trees again only when a registry changed: a replaced child, a parameter assigned
  deep in the tree or through the registry itself, and an optimizer's new group each recapture, and the compiled
  steps go on equal to eager ones; steps that change nothing replay."""
  def make():
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    return model, bt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  (m1, o1), (m2, o2) = _twins(make)
  step1, step2 = _train_step(m1, o1, clip=False), bt.compile(_train_step(m2, o2, clip=False))
  x, y = bt.randn(5, 4), bt.tensor([0, 2, 1, 1, 0])

  def both(*changes):
    for change in changes:
      bt.manual_seed(len(changes))
      change(m1, o1)
      bt.manual_seed(len(changes))
      change(m2, o2)
    np.testing.assert_allclose(step2(x, y).numpy(), step1(x, y).detach().numpy(), rtol=1e-6)
    _assert_same_params(m1, m2)

  for _ in range(3): both()
  assert step2.captures == 2

  def new_head(m, o):
    m[2] = nn.Linear(6, 3)
    o.add_param_group({"params": list(m[2].parameters())})
  both(new_head)
  both()
  assert step2.captures == 4, "a new child and its parameters' group: a new graph (first call creating momentum)"

  def deep_parameter(m, o): m[0].weight = nn.Parameter(bt.randn(6, 4))
  both(deep_parameter)
  both()
  both()
  n = step2.captures
  assert n > 4

  def through_registry(m, o): m[0]._parameters["bias"] = nn.Parameter(bt.randn(6))
  both(through_registry)
  both()
  assert step2.captures > n
  n = step2.captures
  for _ in range(3): both()
  assert step2.captures == n, "nothing changed: the graph replays"


def test_guard_holds_autocast_and_matmul_precision():
  """Global state that changes what a step computes is part of the guard: flipping it between calls recaptures, and
  each replay computes what eager mode computes under the state of its call."""
  bt.manual_seed(0)
  w, x = bt.randn(6, 5), bt.randn(4, 6)
  fn = bt.compile(lambda a: a @ w)
  autocast = bt.autocast("cpu", dtype=bt.bfloat16)
  for _ in range(2):
    with autocast: out = fn(x)
  assert fn.captures == 1 and out.dtype is bt.bfloat16
  with autocast: want = x @ w
  np.testing.assert_array_equal(out.float().numpy(), want.float().numpy())
  out = fn(x)  # autocast ended: a float32 graph, not the bfloat16 one replayed
  assert fn.captures == 2 and out.dtype is bt.float32
  np.testing.assert_allclose(out.numpy(), (x @ w).numpy(), rtol=1e-6)
  with autocast: assert fn(x).dtype is bt.bfloat16 and fn.captures == 2  # both graphs stay cached

  bt.set_float32_matmul_precision("high")
  try:
    fn(x)
    assert fn.captures == 3, "the precision is a matmul attribute: a new precision is a new graph"
    with bt.autocast("cpu", dtype=bt.bfloat16, enabled=False): fn(x)
    assert fn.captures == 3, "autocast disabled casts nothing: the same graph"
  finally:
    bt.set_float32_matmul_precision("highest")
  fn(x)
  assert fn.captures == 3


def test_matmul_precision_travels_as_an_attribute(tmp_path):
  bt.manual_seed(0)
  w, x = bt.randn(6, 5), bt.randn(4, 6)
  for precision, tf32 in (("highest", "false"), ("high", "true")):
    bt.set_float32_matmul_precision(precision)
    try:
      fn = bt.compile(lambda a: a @ w, dump_ir=str(tmp_path / precision))
      for _ in range(2): fn(x)
    finally:
      bt.set_float32_matmul_precision("highest")
    captured = next((tmp_path / precision).rglob("00-captured.mlir")).read_text()
    assert f"tf32 = {tf32}" in captured, captured


def test_multi_tensor_updates_compile():
  """sum_squares, scale_ and adamw_ in a compiled function: one op each in the graph (scale and adamw with a result
  per tensor they update, written back in place); the values equal eager mode's bit for bit."""
  def make():
    rng = np.random.default_rng(0)
    params, grads = ([bt.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in ((3, 4), (4,))] for _ in range(2))
    state = [[bt.zeros_like(p) for p in params] for _ in range(2)] + [[bt.zeros((), dtype=bt.float64) for _ in params]]

    def step():
      norm = bt.ops.sum_squares(grads).sqrt()
      bt.ops.scale_(grads, 1.0 / (norm + 1.0))
      bt.ops.adamw_(params, grads, *state, 1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
      return norm
    return step, params + grads + [t for ts in state for t in ts]

  (eager, want), (compiled, got) = make(), make()
  compiled = bt.compile(compiled)
  for _ in range(3):
    assert eager().item() == compiled().item()
  for a, b in zip(want, got): np.testing.assert_array_equal(b.numpy(), a.numpy())
  assert compiled.captures == 1
  assert {k: compiled.info["counts_before"][k] for k in ("adamw", "scale", "sum_squares")} == \
         {"adamw": 1, "scale": 1, "sum_squares": 1}


def test_compiled_sgd_step_is_one_op_per_group_and_equals_eager():
  """SGD with momentum over two parameter groups under a scheduler: the compiled step (from its first call, which
  starts the momentum buffers) updates each group with one `sgd` op, reads the scheduled learning rate without
  recapturing, and equals eager mode bit for bit."""
  def make():
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
    decay = [p for p in model.parameters() if p.ndim == 2]
    opt = bt.optim.SGD([{"params": decay, "weight_decay": 0.01},
                        {"params": [p for p in model.parameters() if p.ndim < 2], "dampening": 0.2}],
                       lr=0.1, momentum=0.9)
    return model, opt, bt.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
  (m1, o1, s1), (m2, o2, s2) = _twins(make)
  eager, compiled = _train_step(m1, o1, clip=False), bt.compile(_train_step(m2, o2, clip=False))
  rng = np.random.default_rng(2)
  for _ in range(5):
    x, y = bt.from_numpy(rng.standard_normal((5, 6)).astype(np.float32)), bt.from_numpy(rng.integers(0, 3, 5))
    assert eager(x, y).item() == compiled(x, y).item()
    s1.step(); s2.step()
  assert compiled.captures == 2 and compiled.info["counts_before"]["sgd"] == 2
  for p, q in zip(m1.parameters(), m2.parameters()):
    np.testing.assert_array_equal(q.detach().numpy(), p.detach().numpy())
    np.testing.assert_array_equal(o2.state[q]["momentum_buffer"].numpy(), o1.state[p]["momentum_buffer"].numpy())


def test_warm_cache_skips_the_passes():
  def make_step():
    bt.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return bt.compile(_train_step(model, bt.optim.SGD(model.parameters(), lr=0.1), clip=False))
  x, y = bt.randn(3, 4), bt.tensor([0, 1, 1])
  first = make_step()
  for _ in range(2): first(x, y)
  assert first.info["cache"] == "miss"
  second = make_step()
  for _ in range(2): second(x, y)
  assert second.info["cache"] == "hit" and second.info["key"] == first.info["key"]


def test_corrupt_cache_entry_is_rebuilt(tmp_path):
  f = bt.compile(lambda a: (a * 2).exp())
  x = bt.randn(3)
  for _ in range(2): f(x)
  path = f.info["source"]
  with open(path, "w") as fh: fh.write("this is not python (")
  g = bt.compile(lambda a: (a * 2).exp())
  for _ in range(2): out = g(x)
  assert g.info["cache"] == "miss"
  np.testing.assert_allclose(out.numpy(), (x * 2).exp().numpy(), rtol=1e-6)


def test_gradient_accumulation_without_zero_grad():
  bt.manual_seed(0)
  m1 = nn.Linear(3, 2)
  bt.manual_seed(0)
  m2 = nn.Linear(3, 2)

  def accumulate(model):
    def f(x):
      (model(x) ** 2).sum().backward()
      return model.weight.grad
    return f
  eager, compiled = accumulate(m1), bt.compile(accumulate(m2))
  x = bt.randn(4, 3)
  for _ in range(4):
    eager(x)
    compiled(x)
  np.testing.assert_allclose(m2.weight.grad.numpy(), m1.weight.grad.numpy(), rtol=1e-6)
  np.testing.assert_allclose(m2.bias.grad.numpy(), m1.bias.grad.numpy(), rtol=1e-6)


def test_graph_break_is_an_error():
  model = nn.Linear(3, 1)

  @bt.compile
  def step(x):
    loss = model(x).sum()
    if loss.item() > 0:  # data-dependent Python control flow
      loss = loss * 2
    return loss
  with pytest.raises(bt.nova.GraphBreakError, match="graph break"):
    step(bt.randn(2, 3))


def test_in_place_update_of_a_view_of_an_intermediate_is_refused():
  def f(x):
    h = x * 2
    h[1:3].add_(x[1:3])  # eagerly this changes h; in the graph the view is a value of its own
    return (h * h).sum()
  c, x = bt.compile(f), bt.randn(5)
  with pytest.raises(RuntimeError, match="read after one of its views was updated in place"):
    c(x)


def test_forward_only_training_call_is_refused():
  model = nn.Linear(3, 1)
  f = bt.compile(model)
  with pytest.raises(RuntimeError, match="runs no backward"):
    f(bt.randn(2, 3))


def test_dump_ir(tmp_path):
  f = bt.compile(lambda a, b: (a @ b).relu().sum() * 1.0, dump_ir=str(tmp_path / "ir"))
  a, b = bt.randn(3, 4), bt.randn(4, 5)
  for _ in range(2): out = f(a, b)
  np.testing.assert_allclose(out.item(), (a @ b).relu().sum().item(), rtol=1e-5)
  graph_dir = tmp_path / "ir" / f.info["key"]  # one folder per compiled graph
  dumps = sorted(p.name for p in graph_dir.iterdir())
  assert dumps[0].startswith("00-") and len(dumps) >= 2
  assert "nova.matmul" in (graph_dir / dumps[0]).read_text()


_UNARY = [lambda a: a.exp() * 0.1, lambda a: a.tanh(), lambda a: a.sigmoid(), F.gelu, lambda a: a.relu() + a * 0.5,
          lambda a: (a * a + 1).sqrt(), lambda a: a.softmax(-1), lambda a: F.layer_norm(a, a.shape[-1:])]
_BINARY = [lambda a, b: a + b, lambda a, b: a * b, lambda a, b: a - b * 2, lambda a, b: a / (b * b + 1),
           lambda a, b: bt.maximum(a, b), lambda a, b: a @ b.mT @ b * 0.1]


@settings(deadline=None, max_examples=15)
@given(program=st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 5)), min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_random_programs_values_and_gradients(program, seed):
  """Random chains of ops over a parameter and an input: the compiled loss and gradients equal eager's."""
  rng = np.random.default_rng(seed)
  w = bt.from_numpy(rng.standard_normal((3, 4)).astype(np.float32)).requires_grad_()
  x = bt.from_numpy(rng.standard_normal((3, 4)).astype(np.float32))

  def f(x):
    h = w
    for unary, u, b in program: h = _UNARY[u](h) if unary else _BINARY[b](h, x)
    loss = (h * h).mean()
    return (loss,) + bt.autograd.grad(loss, [w])
  compiled = bt.compile(f)
  eager = [t.detach().numpy() for t in f(x)]
  for _ in range(2): got = compiled(x)
  for a, b in zip(got, eager): np.testing.assert_allclose(a.numpy(), b, rtol=2e-5, atol=1e-6)
