"""Autograd semantics against PyTorch: accumulation, retain_graph, grad modes, leaves, hooks, autograd.grad,
in-place ops and version counters, graphs with shared nodes."""
import collections

import numpy as np
import pytest
import torch

import blutrain as bt
from tests.helpers import assert_close, helper_test_op


def _pair(shape=(3, 4), seed=0):
  """The same random leaf in blutrain and torch."""
  data = np.random.default_rng(seed).uniform(-2, 2, shape).astype(np.float32)
  return bt.tensor(data, requires_grad=True), torch.tensor(data, requires_grad=True)


def test_backward_accumulates_over_calls():
  x, tx = _pair()
  for _ in range(2):
    (x * x).sum().backward()
    (tx * tx).sum().backward()
  assert_close(x.grad, tx.grad)
  x.grad = None
  (x * 3).sum().backward()
  assert_close(x.grad, torch.full((3, 4), 3.0))


def test_retain_graph():
  x, tx = _pair()
  y, ty = (x.exp() * x).sum(), (tx.exp() * tx).sum()
  y.backward(retain_graph=True)
  y.backward()
  ty.backward(retain_graph=True)
  ty.backward()
  assert_close(x.grad, tx.grad)
  with pytest.raises(RuntimeError, match="second time.*retain_graph=True"):
    y.backward()
  z = (x * 2).sin().sum()
  z.backward()
  with pytest.raises(RuntimeError, match="retain_graph"):
    bt.autograd.grad(z, x)


def test_no_grad_modes():
  x, _ = _pair()
  with bt.no_grad():
    y = x * 2
    assert not bt.is_grad_enabled()
    with bt.enable_grad():
      assert bt.is_grad_enabled() and (x * 2).requires_grad
    assert not (x + 1).requires_grad
  assert bt.is_grad_enabled() and not y.requires_grad and y.grad_fn is None
  with bt.set_grad_enabled(False):
    assert not (x * 2).requires_grad
  with bt.set_grad_enabled(True):
    assert (x * 2).requires_grad

  @bt.no_grad()
  def f(t): return t * 2

  @bt.enable_grad()
  def g(t): return t * 2

  @bt.set_grad_enabled(False)
  def h(t): return t * 2

  assert not f(x).requires_grad and not h(x).requires_grad
  with bt.no_grad():
    assert g(x).requires_grad
  assert f.__name__ == "f" and bt.is_grad_enabled()
  with pytest.raises(ValueError):
    with bt.no_grad(): raise ValueError("mode is restored on errors")
  assert bt.is_grad_enabled()
  assert bt.autograd.no_grad is bt.no_grad


def test_detach_and_requires_grad_():
  x, _ = _pair()
  y = x * 2
  d = y.detach()
  assert not d.requires_grad and d.grad_fn is None and d._storage is y._storage
  d.add_(1.0)  # shares memory, as torch's
  assert y[0, 0].item() == d[0, 0].item()
  z = bt.ones(2)
  assert z.requires_grad_() is z and z.requires_grad and z.is_leaf
  z.requires_grad_(False)
  assert not z.requires_grad
  with pytest.raises(RuntimeError, match="floating point"): bt.ones(2, dtype=bt.int64).requires_grad_()
  with pytest.raises(RuntimeError, match="leaf"): y.requires_grad_(False)
  w = y.detach_()
  assert w is y and not y.requires_grad and y.is_leaf


def test_leaf_and_grad_fn():
  x, tx = _pair()
  c = bt.ones(3, 4)
  y = x * c
  assert x.is_leaf and c.is_leaf and not y.is_leaf and x.grad_fn is None and y.grad_fn is not None
  assert y.requires_grad and not c.requires_grad and (c * 2).is_leaf
  y.sum().backward()
  assert y.grad is None and c.grad is None and x.grad is not None
  assert not (x > 0).requires_grad and not x.argmax().requires_grad


def test_retain_grad():
  x, tx = _pair()
  y, ty = x.exp(), tx.exp()
  y.retain_grad(); ty.retain_grad()
  z, tz = y * y, ty * ty
  z.retain_grad(); tz.retain_grad()
  z.sum().backward(); tz.sum().backward()
  assert_close(y.grad, ty.grad)
  assert_close(z.grad, tz.grad)
  assert_close(x.grad, tx.grad)


def test_register_hook():
  x, tx = _pair()
  seen = []
  for t in (x, tx):
    t.register_hook(lambda g: seen.append(g.shape) or g * 2)
  y, ty = x * 3, tx * 3
  hy = y.register_hook(lambda g: g + 1)
  ty.register_hook(lambda g: g + 1)
  (y * y).sum().backward(retain_graph=True)
  (ty * ty).sum().backward(retain_graph=True)
  assert_close(x.grad, tx.grad)
  assert len(seen) == 2
  hy.remove()
  x.grad = None
  (y * 1).sum().backward()
  assert_close(x.grad, torch.full((3, 4), 6.0))
  with pytest.raises(RuntimeError, match="require grad"): bt.ones(2).register_hook(lambda g: g)


def test_autograd_grad():
  x, tx = _pair()
  w, tw = _pair((4,), seed=1)
  h, th = x * w, tx * tw
  out, tout = (h.tanh() * x).sum(), (th.tanh() * tx).sum()
  gx, gh = bt.autograd.grad(out, [x, h], retain_graph=True)
  tgx, tgh = torch.autograd.grad(tout, [tx, th], retain_graph=True)
  assert_close(gx, tgx)
  assert_close(gh, tgh)
  assert x.grad is None and w.grad is None  # grad() does not accumulate into .grad
  (gw,) = bt.autograd.grad(out, w)
  assert_close(gw, torch.autograd.grad(tout, tw)[0])
  unused, _ = _pair((2,))
  with pytest.raises(RuntimeError, match="allow_unused"): bt.autograd.grad((x * 2).sum(), [x, unused])
  g1, g2 = bt.autograd.grad((x * 2).sum(), [x, unused], allow_unused=True)
  assert g2 is None and np.allclose(g1.numpy(), 2.0)
  with pytest.raises(RuntimeError, match="does not require grad"): bt.autograd.grad(bt.ones(1).sum(), [x])


def test_autograd_grad_with_grad_outputs():
  x, tx = _pair()
  v = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
  (g,) = bt.autograd.grad(x.sin(), x, grad_outputs=bt.tensor(v))
  (tg,) = torch.autograd.grad(tx.sin(), tx, grad_outputs=torch.tensor(v))
  assert_close(g, tg)


def test_backward_with_gradient_argument():
  x, tx = _pair()
  v = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
  (x * x).backward(bt.tensor(v))
  (tx * tx).backward(torch.tensor(v))
  assert_close(x.grad, tx.grad)
  with pytest.raises(RuntimeError, match="scalar"): (x * 2).backward()
  with pytest.raises(RuntimeError, match="shape"): (x * 2).backward(bt.ones(4))
  s = bt.tensor(2.0, requires_grad=True)
  s.backward()  # a leaf's own backward gives ones
  assert s.grad.item() == 1.0
  bt.autograd.backward([x.sum(), (x * 2).sum()])
  assert_close(x.grad, tx.grad + 3)


def test_inplace_on_leaf_raises():
  x, _ = _pair()
  for fn in (lambda t: t.add_(1), lambda t: t.mul_(2), lambda t: t.zero_(), lambda t: t.__setitem__(0, 1.0)):
    with pytest.raises(RuntimeError, match="leaf"): fn(x)
  with bt.no_grad():
    x.add_(1.0)  # allowed outside the graph, as an optimizer step
    x[0] = 0.0
  assert x.is_leaf and x[0, 0].item() == 0.0


def test_inplace_on_saved_tensor_raises_version_error():
  x, _ = _pair()
  y = x.exp()
  y.add_(1)
  with pytest.raises(RuntimeError, match="modified by an in-place operation.*exp.*version 1; expected version 0"):
    y.sum().backward()
  x2, _ = _pair()
  a = x2 * 2
  b = a * a  # mul saves a
  a.mul_(3)
  with pytest.raises(RuntimeError, match="in-place"): b.sum().backward()
  x3, _ = _pair()
  s = x3.sigmoid()
  s[0] = 0.0
  with pytest.raises(RuntimeError, match="in-place"): s.sum().backward()


@pytest.mark.parametrize("case", range(9))
def test_inplace_on_nonleaf_grads_match_torch(case):
  def fn(x, y):
    h = x * 2 + 0  # a non-leaf
    if case == 0: h.add_(y)
    elif case == 1: h.sub_(y, alpha=2)
    elif case == 2: h.mul_(y)
    elif case == 3: h.div_(y.abs() + 1)
    elif case == 4: h += y; h *= 3; h.neg_()
    elif case == 5: h.clamp_(-1.0, 1.0); h.masked_fill_(y > 0, 0.5)
    elif case == 6: h.pow_(2); h.sqrt_()
    elif case == 7:  # a plain buffer becomes part of the graph through in-place ops with y
      b = torch.ones(3, 4) if isinstance(x, torch.Tensor) else bt.ones(3, 4)
      b.mul_(y); b.add_(y)
      h = h + b
    elif case == 8:  # setitem with a value that requires grad
      b = torch.zeros(3, 4) if isinstance(x, torch.Tensor) else bt.zeros(3, 4)
      b[1] = y
      b[:, 2] = h[:, 0]
      h = h * b
    return h * x
  helper_test_op([(3, 4), (4,)], fn)


def test_inplace_version_counter_shared_by_views():
  x = bt.zeros(3, 4)
  v = x[1]
  before = x._storage.version
  v.add_(1)
  assert x._storage.version == before + 1 and x[1, 0].item() == 1.0


def test_diamond_and_shared_subexpression():
  def diamond(x):
    a = x.sin()
    b, c = a * 2, a.exp()
    return b * c + a
  helper_test_op([(3, 4)], diamond)

  def shared(x, w):
    h = x @ w
    return (h * h).sum(0) + h.sum(0) * h.mean(0) + h.relu().amax(0)
  helper_test_op([(4, 3), (3, 5)], shared)

  def reuse(x):
    y = x
    for _ in range(5): y = y * x + y.tanh()
    return y
  helper_test_op([(6,)], reuse)


def test_graph_of_many_ops_matches_torch():
  def mlp(x, w1, b1, w2):
    h = (x @ w1 + b1).relu()
    logits = h @ w2
    return logits.log_softmax(-1).mean(0)
  helper_test_op([(8, 5), (5, 16), (16,), (16, 3)], mlp)


def test_grad_of_integer_and_bool_paths():
  x, tx = _pair()
  idx = (x > 0).long()  # no gradient through comparisons and casts to int
  y = (x * idx.float()).sum()
  ty = (tx * (tx > 0).long().float()).sum()
  y.backward(); ty.backward()
  assert_close(x.grad, tx.grad)
  assert not idx.requires_grad


def test_dtype_of_grads():
  for dt in (bt.float16, bt.bfloat16, bt.float64):
    x = bt.ones(3, dtype=dt, requires_grad=True)
    (x.float() * 2).sum().backward()
    assert x.grad.dtype is dt and x.grad.tolist() == [2.0, 2.0, 2.0]


def _inplace_on_views(case, x, y):
  """In-place ops through views; the same code runs on torch and blutrain tensors."""
  lib = torch if isinstance(x, torch.Tensor) else bt
  c = lib.tensor(np.arange(12.0).reshape(3, 4) - 5.0, dtype=x.dtype)
  h = x * 2
  if case == "buffer_row_add":
    h = lib.zeros(3, 4, dtype=x.dtype)
    h[0].add_(y)
  elif case == "row_mul": h[1].mul_(y)
  elif case == "stale_view":
    v = h[0]
    h.mul_(3)
    h = h + v  # v is read after its base changed in place
  elif case == "sibling_views":
    v = h[:, 1]
    h[0].add_(y)
    h = h * v.unsqueeze(1)
  elif case == "flat_view": h.view(12).mul_(y.repeat(3))
  elif case == "view_chain": h.T[1].mul_(y[:3])
  elif case == "narrow_copy":
    h = lib.zeros(3, 4, dtype=x.dtype)
    h.narrow(1, 1, 2).copy_(x[:, :2] * y[:2])
  elif case == "setitem_on_view":
    h[1][2:] = y[:2] * 3
  elif case == "view_then_base":
    v = h[2]
    v.mul_(y)
    h.add_(1)
    h = h * v
  return h * c


@pytest.mark.parametrize("case", ["buffer_row_add", "row_mul", "stale_view", "sibling_views", "flat_view", "view_chain",
                                  "narrow_copy", "setitem_on_view", "view_then_base"])
def test_inplace_on_views_matches_torch(case):
  helper_test_op([(3, 4), (4,)], lambda x, y: _inplace_on_views(case, x, y))


def test_inplace_on_view_of_leaf_raises():
  x, _ = _pair()
  with pytest.raises(RuntimeError, match="view of a leaf"): x[0].add_(1)
  with pytest.raises(RuntimeError, match="view of a leaf"): x.T.mul_(2)
  with bt.no_grad(): x[0].add_(1)


def test_the_backward_owns_only_the_gradients_it_holds():
  """Slices add into an input's gradient in place only when the backward made that buffer (`owned`); an id leaves
  `owned` when its gradient is replaced or taken, so a tensor that Python later places at a freed one's address (a
  gradient shared with another input, say) is never added into."""
  from blutrain.autograd import engine
  grads, owned = {}, set()
  a, b = bt.randn(3), bt.randn(3)
  engine._accumulate(grads, 1, a, owned, fresh=True)
  assert owned == {id(a)}
  engine._accumulate(grads, 1, b, owned)
  total = grads[1]
  assert total is not a and owned == {id(total)}
  assert engine._take(grads, 1, owned) is total and not owned and engine._take(grads, 1, owned) is None


def test_slices_of_a_tensor_whose_gradient_is_shared_match_pytorch():
  """h feeds an add (whose VJP hands one gradient to both inputs) and three slices: the slices' gradients must not
  be added into the add's gradient in place."""
  rng = np.random.default_rng(0)
  for _ in range(20):
    xs = rng.standard_normal((4, 6)).astype(np.float32)
    x, tx = bt.tensor(xs, requires_grad=True), torch.tensor(xs, requires_grad=True)
    for t in (x, tx):
      h = t * 2
      s = h + t
      q, k, v = h[:, :2], h[:, 2:4], h[:, 4:]
      (s.sum() * 3 + (q * k).sum() + v.exp().sum()).backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["conv input", "conv weight", "matmul a", "matmul b"])
def test_backward_computes_only_the_gradients_inputs_need(case):
  """An input that needs no gradient (an image into the first convolution, a frozen weight) costs no kernel in
  backward, and the gradient that is computed still equals PyTorch's."""
  rng = np.random.default_rng(0)
  conv = case.startswith("conv")
  a, b = (rng.standard_normal((2, 3, 6, 6)), rng.standard_normal((4, 3, 3, 3))) if conv else \
    (rng.standard_normal((5, 3, 4)), rng.standard_normal((4, 2)))
  needs = (True, False) if case.endswith(("input", " a")) else (False, True)
  fn = (lambda m, x, y: m.nn.functional.conv2d(x, y, padding=1)) if conv else (lambda m, x, y: x @ y)
  ours = [bt.tensor(v, requires_grad=r) for v, r in zip((a, b), needs)]
  theirs = [torch.tensor(v, requires_grad=r) for v, r in zip((a, b), needs)]
  with bt.profiler.profile() as prof: fn(bt, *ours).square().sum().backward()
  fn(torch, *theirs).square().sum().backward()
  for o, t in zip(ours, theirs):
    assert (o.grad is None) == (t.grad is None)
    if t.grad is not None: assert_close(o.grad, t.grad, rtol=1e-10, atol=1e-10)
  ran = collections.Counter()
  for row in prof.rows: ran[row.name] += row.calls
  want = {"conv_grad_input": int(conv and needs[0]), "conv_grad_weight": int(conv and needs[1]),
          "matmul": 0 if conv else 2}  # the forward's and one gradient's
  assert {k: ran[k] for k in want} == want, ran


@pytest.mark.parametrize("case", ["x * 0.5", "x / c", "c - x", "where", "pow"])
def test_elementwise_backward_skips_the_gradients_of_constants(case):
  """A constant operand (a Python number, a tensor without grad) of add, sub, mul, div, pow and where costs no
  kernel in backward: `x * 0.5` runs one mul and no sum; the gradient equals PyTorch's."""
  rng = np.random.default_rng(1)
  a, c = rng.uniform(0.5, 2.0, (4, 5)), rng.uniform(0.5, 2.0, (5,))
  fns = {"x * 0.5": lambda m, x, c: x * 0.5, "x / c": lambda m, x, c: x / c, "c - x": lambda m, x, c: c - x,
         "where": lambda m, x, c: m.where(x > 1.0, x, c), "pow": lambda m, x, c: x ** c}
  ours, theirs = bt.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)
  out = fns[case](bt, ours, bt.tensor(c))
  with bt.profiler.profile() as prof: out.backward(bt.ones_like(out))
  fns[case](torch, theirs, torch.tensor(c)).backward(torch.ones(4, 5, dtype=torch.float64))
  assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-12)
  assert not any(row.name == "sum" for row in prof.rows), [(row.name, row.calls) for row in prof.rows]

