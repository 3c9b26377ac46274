"""nn: Module registration and state_dict against torch.nn's, layers forward and backward against torch.nn with the
same weights, init statistics, clip_grad_norm_ against torch's, and a nanoGPT-style model ported by its import."""
import copy
import math
import pickle
from collections import OrderedDict

import numpy as np
import pytest
import torch

import blutrain as bt
from blutrain import nn
from blutrain.nn import functional as F
from tests.helpers import assert_close


def to_torch(t: bt.Tensor) -> torch.Tensor: return torch.from_numpy(t.detach().numpy().copy())
def to_bt(t: torch.Tensor) -> bt.Tensor: return bt.tensor(t.detach().numpy())


def load_from_torch(bmod: nn.Module, tmod: torch.nn.Module) -> None:
  bmod.load_state_dict({k: to_bt(v) for k, v in tmod.state_dict().items()})


def randomize(tmod: torch.nn.Module, seed: int = 0) -> None:
  """Give every parameter of a torch module random values (so ones/zeros inits don't hide a mistake)."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in tmod.parameters(): p.copy_(torch.randn(p.shape, generator=g))


def compare_module(bmod: nn.Module, tmod: torch.nn.Module, x: np.ndarray, atol=1e-5, rtol=1e-4) -> None:
  """Same weights in both; forward, then backward of a random projection; outputs, input and weight grads equal."""
  load_from_torch(bmod, tmod)
  floating = x.dtype.kind == "f"
  tx, bx = torch.tensor(x, requires_grad=floating), bt.tensor(x, requires_grad=floating)
  tout, bout = tmod(tx), bmod(bx)
  assert_close(bout, tout, what="forward", atol=atol, rtol=rtol)
  u = np.random.default_rng(1).standard_normal(tuple(tout.shape)).astype(np.float32)
  (tout * torch.tensor(u)).sum().backward()
  (bout * bt.tensor(u)).sum().backward()
  if floating: assert_close(bx.grad, tx.grad, what="input grad", atol=atol, rtol=rtol)
  bparams = dict(bmod.named_parameters())
  for name, tp in tmod.named_parameters():
    assert_close(bparams[name].grad, tp.grad, what=f"grad of {name}", atol=atol, rtol=rtol)


# *** Parameter ***

def test_parameter_shares_storage_and_requires_grad():
  t = bt.randn(3, 4)
  p = nn.Parameter(t)
  assert isinstance(p, bt.Tensor) and isinstance(p, nn.Parameter)
  assert p.requires_grad and p.is_leaf and p.shape == (3, 4) and p.dtype is bt.float32
  with bt.no_grad(): p.fill_(2.0)
  np.testing.assert_array_equal(t.numpy(), np.full((3, 4), 2.0, np.float32))
  assert not nn.Parameter(bt.randn(2), requires_grad=False).requires_grad
  assert nn.Parameter().shape == (0,)
  assert repr(p).startswith("Parameter containing:\ntensor([[2., 2., 2., 2.],")
  assert type(p + 1) is bt.Tensor and type(p.detach()) is bt.Tensor


def test_parameter_errors():
  with pytest.raises(RuntimeError, match="floating point"): nn.Parameter(bt.arange(3))
  with pytest.raises(TypeError, match="expected a Tensor"): nn.Parameter(np.ones(3))
  assert nn.Parameter(bt.arange(3), requires_grad=False).dtype is bt.int64


# *** registration and traversal ***

class Net(nn.Module):
  def __init__(self):
    super().__init__()
    self.w = nn.Parameter(bt.randn(3, 2))
    self.fc = nn.Linear(2, 4)
    self.register_buffer("mask", bt.ones(4))
    self.register_buffer("scratch", bt.zeros(2), persistent=False)
    self.inner = nn.Sequential(nn.Linear(4, 4), nn.GELU())

  def forward(self, x): return self.inner(self.fc(x @ self.w) * self.mask)


class TorchNet(torch.nn.Module):
  def __init__(self):
    super().__init__()
    self.w = torch.nn.Parameter(torch.randn(3, 2))
    self.fc = torch.nn.Linear(2, 4)
    self.register_buffer("mask", torch.ones(4))
    self.register_buffer("scratch", torch.zeros(2), persistent=False)
    self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())

  def forward(self, x): return self.inner(self.fc(x @ self.w) * self.mask)


def test_registration_matches_torch():
  b, t = Net(), TorchNet()
  assert [n for n, _ in b.named_parameters()] == [n for n, _ in t.named_parameters()]
  assert [n for n, _ in b.named_buffers()] == [n for n, _ in t.named_buffers()]
  assert [n for n, _ in b.named_modules()] == [n for n, _ in t.named_modules()]
  assert [n for n, _ in b.named_children()] == [n for n, _ in t.named_children()]
  assert list(b.state_dict()) == list(t.state_dict())
  assert [p.shape for p in b.parameters()] == [tuple(p.shape) for p in t.parameters()]
  assert [n for n, _ in b.named_parameters(recurse=False)] == ["w"]
  assert [n for n, _ in b.named_parameters(prefix="model")][:2] == ["model.w", "model.fc.weight"]
  assert b.num_parameters() == sum(p.numel() for p in t.parameters())
  assert b.get_submodule("inner.0") is b.inner[0] and b.get_parameter("fc.bias") is b.fc.bias
  with pytest.raises(AttributeError, match="no submodule"): b.get_submodule("inner.7")
  assert "fc" in dir(b) and "mask" in dir(b)


def test_forward_matches_torch():
  b, t = Net(), TorchNet()
  randomize(t)
  compare_module(b, t, np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32))


def test_setattr_rules():
  m = nn.Module()
  m.p = nn.Parameter(bt.randn(2))
  with pytest.raises(TypeError, match="cannot assign 'Tensor' as parameter 'p'"): m.p = bt.randn(2)
  m.p = None
  assert m.p is None and list(m.parameters()) == [] and list(m.state_dict()) == []
  m.child = nn.Linear(2, 2)
  with pytest.raises(TypeError, match="child module 'child'"): m.child = 3
  m.register_buffer("buf", bt.zeros(2))
  m.buf = bt.ones(2)
  assert m._buffers["buf"] is m.buf
  with pytest.raises(TypeError, match="buffer 'buf'"): m.buf = 1.0
  m.child = nn.Parameter(bt.randn(1))  # a name changes kind: it leaves the modules' registry
  assert "child" not in m._modules and m._parameters["child"] is m.child
  del m.child
  assert not hasattr(m, "child")
  with pytest.raises(KeyError, match=r'contain "\."'): m.register_buffer("a.b", bt.zeros(1))
  with pytest.raises(KeyError, match="already exists"): m.register_parameter("buf", None)
  with pytest.raises(TypeError, match="nn.Parameter or None required"): m.register_parameter("q", bt.zeros(1))
  with pytest.raises(AttributeError, match="'Module' object has no attribute 'nope'"): m.nope

  class Early(nn.Module):
    def __init__(self):
      self.w = nn.Parameter(bt.zeros(1))
  with pytest.raises(AttributeError, match="before Module.__init__"): Early()


def test_shared_modules_and_tied_parameters():
  shared = nn.Linear(3, 3)
  m = nn.Sequential(shared, nn.ReLU(), shared)
  assert len(list(m.modules())) == 3 and len(list(m.parameters())) == 2
  assert len(list(m.named_modules(remove_duplicate=False))) == 4
  assert list(m.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
  a, b = nn.Linear(4, 5, bias=False), nn.Embedding(5, 4)
  owner = nn.ModuleDict(dict(a=a, b=b))
  b.weight = a.weight
  assert len(list(owner.parameters())) == 1 and list(owner.state_dict()) == ["a.weight", "b.weight"]


def test_train_eval_apply_zero_grad_requires_grad():
  m = Net()
  assert m.training and all(x.training for x in m.modules())
  m.eval()
  assert not any(x.training for x in m.modules())
  m.train()
  assert all(x.training for x in m.modules())
  seen = []
  m.apply(lambda mod: seen.append(type(mod).__name__))
  assert seen == ["Linear", "Linear", "GELU", "Sequential", "Net"]
  m(bt.randn(2, 3)).sum().backward()
  assert all(p.grad is not None for p in m.parameters())
  m.zero_grad(set_to_none=False)
  assert all(float(p.grad.abs().sum()) == 0.0 for p in m.parameters())
  m.zero_grad()
  assert all(p.grad is None for p in m.parameters())
  m.requires_grad_(False)
  assert not any(p.requires_grad for p in m.parameters())


def test_to_converts_in_place():
  m = Net()
  m.register_buffer("count", bt.zeros(2, dtype=bt.int64))
  params = list(m.parameters())
  m(bt.randn(2, 3)).sum().backward()
  assert m.to(bt.float64) is m
  assert [id(p) for p in m.parameters()] == [id(p) for p in params]
  assert all(p.dtype is bt.float64 and p.grad.dtype is bt.float64 and isinstance(p, nn.Parameter) for p in params)
  assert m.mask.dtype is bt.float64 and m.count.dtype is bt.int64
  assert m(bt.randn(2, 3, dtype=bt.float64)).dtype is bt.float64
  m.float()
  assert all(p.dtype is bt.float32 for p in params)
  m.to("cpu")
  with pytest.raises(TypeError, match="floating point"): m.to(bt.int32)


def test_deepcopy_and_pickle():
  m = Net()
  for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
    assert list(clone.state_dict()) == list(m.state_dict()) and isinstance(clone.fc.weight, nn.Parameter)
    assert clone.fc.weight.requires_grad and clone.fc.weight._storage is not m.fc.weight._storage
    x = bt.randn(2, 3)
    np.testing.assert_array_equal(clone(x).detach().numpy(), m(x).detach().numpy())


def test_forward_hooks():
  m = nn.Linear(2, 2)
  pre = m.register_forward_pre_hook(lambda mod, args: (args[0] * 0,))
  post = m.register_forward_hook(lambda mod, args, out: out + 1)
  y = m(bt.randn(3, 2))
  assert_close(y, (m.bias + 1).expand(3, 2).detach().numpy())
  pre.remove(); post.remove()
  x = bt.randn(3, 2)
  assert_close(m(x), F.linear(x, m.weight, m.bias).detach().numpy())


def test_missing_forward():
  with pytest.raises(NotImplementedError, match='missing the required "forward"'): nn.Module()(1)


def test_repr_matches_torch():
  def build(lib):
    return lib.nn.Sequential(OrderedDict(
      emb=lib.nn.Embedding(10, 4, padding_idx=0), ln=lib.nn.LayerNorm(4), rms=lib.nn.RMSNorm(4),
      blocks=lib.nn.ModuleList([lib.nn.Linear(4, 4) for _ in range(3)] + [lib.nn.Linear(4, 2, bias=False)]),
      act=lib.nn.GELU(approximate="tanh"), drop=lib.nn.Dropout(0.1), silu=lib.nn.SiLU(), relu=lib.nn.ReLU(),
      tanh=lib.nn.Tanh(), id=lib.nn.Identity(), d=lib.nn.ModuleDict({"x": lib.nn.Linear(1, 1)})))
  assert repr(build(bt)) == repr(build(torch))
  assert repr(nn.ModuleList()) == repr(torch.nn.ModuleList())


# *** state_dict and load_state_dict ***

def test_state_dict_detached_shared_and_keep_vars():
  m = nn.Linear(3, 2)
  sd = m.state_dict()
  assert isinstance(sd, OrderedDict) and list(sd) == ["weight", "bias"]
  assert not sd["weight"].requires_grad and type(sd["weight"]) is bt.Tensor
  with bt.no_grad(): sd["weight"].copy_(bt.ones(2, 3))  # nanoGPT's from_pretrained writes through the state_dict
  np.testing.assert_array_equal(m.weight.detach().numpy(), np.ones((2, 3), np.float32))
  assert m.state_dict(keep_vars=True)["weight"] is m.weight
  assert list(m.state_dict(prefix="lin.")) == ["lin.weight", "lin.bias"]


def test_load_state_dict_in_place():
  src, dst = nn.Linear(3, 2), nn.Linear(3, 2)
  weight, version = dst.weight, dst.weight._storage.version
  result = dst.load_state_dict(src.state_dict())
  assert result.missing_keys == [] and result.unexpected_keys == [] and tuple(result) == ([], [])
  assert dst.weight is weight and dst.weight._storage.version > version and dst.weight.requires_grad
  np.testing.assert_array_equal(dst.weight.detach().numpy(), src.weight.detach().numpy())
  dst.load_state_dict({"weight": np.zeros((2, 3)), "bias": bt.zeros(2, dtype=bt.float64)})  # converted to float32
  assert dst.weight.dtype is bt.float32 and float(dst.weight.abs().sum()) == 0.0


def test_load_state_dict_errors():
  m = Net()
  sd = m.state_dict()
  good = {k: v.clone() for k, v in sd.items()}
  bad = dict(good)
  del bad["fc.bias"]
  bad["extra.weight"] = bt.zeros(1)
  with pytest.raises(RuntimeError) as e: m.load_state_dict(bad)
  msg = str(e.value)
  assert msg.startswith("Error(s) in loading state_dict for Net:")
  assert 'Missing key(s) in state_dict: "fc.bias".' in msg and 'Unexpected key(s) in state_dict: "extra.weight".' in msg
  missing, unexpected = m.load_state_dict(bad, strict=False)
  assert missing == ["fc.bias"] and unexpected == ["extra.weight"]

  wrong = dict(good, **{"fc.weight": bt.zeros(5, 2)})
  before = m.w.detach().numpy().copy()
  with bt.no_grad(): wrong["w"] = good["w"] + 1
  for strict in (True, False):
    with pytest.raises(RuntimeError, match=r"size mismatch for fc\.weight: copying a param with shape \(5, 2\) from "
                                           r"checkpoint, the shape in current model is \(4, 2\)\."):
      m.load_state_dict(wrong, strict=strict)
  np.testing.assert_array_equal(m.w.detach().numpy(), before)  # nothing is written when loading fails
  with pytest.raises(RuntimeError, match='parameter named "w"'): m.load_state_dict(dict(good, w=3.0))


def test_load_state_dict_errors_match_torch():
  """The same key lists as torch reports, from the same bad state_dict."""
  b, t = Net(), TorchNet()
  bad_keys = [k for k in t.state_dict() if k != "inner.0.bias"] + ["bogus"]
  tr = t.load_state_dict({k: (torch.zeros(1) if k == "bogus" else t.state_dict()[k]) for k in bad_keys}, strict=False)
  br = b.load_state_dict({k: (bt.zeros(1) if k == "bogus" else b.state_dict()[k]) for k in bad_keys}, strict=False)
  assert (br.missing_keys, br.unexpected_keys) == (tr.missing_keys, tr.unexpected_keys)


# *** layers against torch.nn ***

RNG = np.random.default_rng(0)


def randn(*shape) -> np.ndarray: return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("shape,out,bias", [((5,), 3, True), ((4, 5), 7, True), ((2, 3, 5), 4, False), ((0, 5), 2, True)])
def test_linear(shape, out, bias):
  compare_module(nn.Linear(shape[-1], out, bias=bias), torch.nn.Linear(shape[-1], out, bias=bias), randn(*shape))


@pytest.mark.parametrize("shape,normalized,kw", [((4, 8), 8, {}), ((2, 3, 4, 5), (4, 5), {}), ((3, 6), 6, {"bias": False}),
                                                 ((3, 6), [6], {"elementwise_affine": False}), ((2, 6), 6, {"eps": 1e-2})])
def test_layer_norm(shape, normalized, kw):
  t = torch.nn.LayerNorm(normalized, **kw)
  randomize(t)
  compare_module(nn.LayerNorm(normalized, **kw), t, randn(*shape) * 3 + 1)


@pytest.mark.parametrize("shape,normalized,kw", [((4, 8), 8, {}), ((2, 3, 4, 5), (4, 5), {"eps": 1e-6}),
                                                 ((3, 6), 6, {"elementwise_affine": False})])
def test_rms_norm(shape, normalized, kw):
  t = torch.nn.RMSNorm(normalized, **kw)
  randomize(t)
  compare_module(nn.RMSNorm(normalized, **kw), t, randn(*shape) * 2)


@pytest.mark.parametrize("idx_shape", [(7,), (3, 5), (2, 2, 3)])
def test_embedding(idx_shape):
  idx = RNG.integers(0, 6, idx_shape)  # repeated indices accumulate into one row's gradient
  compare_module(nn.Embedding(6, 4), torch.nn.Embedding(6, 4), idx)


@pytest.mark.parametrize("padding_idx", [0, 2, -1])
def test_embedding_padding_idx(padding_idx):
  b, t = nn.Embedding(5, 3, padding_idx=padding_idx), torch.nn.Embedding(5, 3, padding_idx=padding_idx)
  assert b.padding_idx == t.padding_idx
  np.testing.assert_array_equal(b.weight.detach().numpy()[padding_idx], np.zeros(3, np.float32))
  randomize(t)
  compare_module(b, t, np.array([[0, 1, 2, 3, 4], [4, 4, 2, 0, 1]]))
  with pytest.raises(ValueError, match="padding_idx"): nn.Embedding(5, 3, padding_idx=5)


@pytest.mark.parametrize("name,kw", [("GELU", {}), ("GELU", {"approximate": "tanh"}), ("SiLU", {}), ("ReLU", {}),
                                     ("Tanh", {}), ("Sigmoid", {}), ("Identity", {})])
def test_activations(name, kw):
  compare_module(getattr(nn, name)(**kw), getattr(torch.nn, name)(**kw), randn(3, 7) * 3)


def test_sequential_mlp_matches_torch():
  def build(lib):
    return lib.nn.Sequential(lib.nn.Linear(6, 16), lib.nn.GELU(), lib.nn.LayerNorm(16), lib.nn.Linear(16, 3))
  t = build(torch)
  randomize(t)
  compare_module(build(bt), t, randn(4, 6))


def test_dropout_eval_and_edges():
  x = bt.randn(4, 5)
  d = nn.Dropout(0.5).eval()
  assert d(x) is x
  assert F.dropout(x, 0.3, training=False) is x
  assert nn.Dropout(0.0)(x) is x
  assert float(nn.Dropout(1.0)(x).abs().sum()) == 0.0
  with pytest.raises(ValueError, match="between 0 and 1"): nn.Dropout(1.5)
  assert repr(nn.Dropout(0.2)) == "Dropout(p=0.2, inplace=False)"


def test_dropout_values_and_gradient_on_a_strided_view():
  """Kept elements are x / (1 - p) and the rest 0, under the mask the same generator state draws; the gradient is
  the same mask and scale applied to the upstream gradient (float64 reference)."""
  base = bt.randn(64, 96, requires_grad=True)
  x, p = base[::2, 1::3], 0.3
  out = F.dropout(x, p, generator=bt.Generator().manual_seed(7))
  keep = bt.ops.bernoulli_mask(x.shape, 1 - p, generator=bt.Generator().manual_seed(7)).numpy()
  want = np.where(keep, x.detach().numpy().astype(np.float64) / (1 - p), 0.0)
  np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-6)
  g = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
  out.backward(bt.tensor(g))
  grad = np.zeros((64, 96))
  grad[::2, 1::3] = np.where(keep, g / (1 - p), 0.0)
  np.testing.assert_allclose(base.grad.numpy(), grad, rtol=1e-6)


def test_dropout_backward_keeps_no_mask():
  """The tape keeps the generator and the draw's seed and offset, not the mask or the input: backward draws the same
  numbers again (the values test above checks that they are the same)."""
  x = bt.randn(8, 8, requires_grad=True)
  node = F.dropout(x, 0.5)._node
  assert node.op.name == "dropout" and node.out is None and not any(isinstance(s, bt.Tensor) for s in node.saved)
  assert node.attrs["rng"] is bt.ops.default_generator and node.attrs["p"] == 0.5


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_train_statistics(p):
  x = bt.ones(200_000, requires_grad=True)
  y = nn.Dropout(p)(x)
  vals = y.detach().numpy()
  kept = vals != 0
  assert abs(1 - kept.mean() - p) < 0.005, f"dropped fraction {1 - kept.mean()} for p={p}"
  np.testing.assert_allclose(vals[kept], 1 / (1 - p), rtol=1e-6)
  assert abs(vals.mean() - 1.0) < 0.02  # unbiased in expectation
  y.sum().backward()
  np.testing.assert_array_equal(x.grad.numpy(), vals)  # the gradient goes through the same mask and scale
  assert (nn.Dropout(p)(x).detach().numpy() != vals).any()  # a fresh mask each call


# *** containers ***

def test_sequential_container():
  a, b, c = nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)
  s = nn.Sequential(a, b, c)
  assert len(s) == 3 and s[0] is a and s[-1] is c and list(s) == [a, b, c]
  assert isinstance(s[1:], nn.Sequential) and list(s[1:]) == [b, c] and list(s[1:]._modules) == ["1", "2"]
  d = nn.Tanh()
  s[1] = d
  assert s[1] is d
  s.append(nn.Identity())
  assert list(s._modules) == ["0", "1", "2", "3"]
  del s[3]
  assert len(s) == 3
  with pytest.raises(IndexError, match="out of range"): s[5]
  named = nn.Sequential(OrderedDict(fc=a, act=b))
  assert list(named.state_dict()) == ["fc.weight", "fc.bias"] and named.fc is a


def test_module_list_container():
  layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
  assert len(layers) == 3 and list(layers._modules) == ["0", "1", "2"]
  extra = nn.Linear(2, 2)
  layers.insert(1, extra)
  assert layers[1] is extra and list(layers._modules) == ["0", "1", "2", "3"]
  del layers[0]
  assert layers[0] is extra and list(layers._modules) == ["0", "1", "2"]
  layers += [nn.ReLU()]
  layers.append(nn.Tanh()).extend([nn.SiLU()])
  assert len(layers) == 6 and isinstance(layers[-1], nn.SiLU)
  assert isinstance(layers[1:3], nn.ModuleList) and len(layers[1:3]) == 2
  assert len(layers + nn.ModuleList([nn.ReLU()])) == 7
  layers[0] = nn.Identity()
  assert isinstance(layers[0], nn.Identity)
  assert list(nn.ModuleList([nn.Linear(1, 2)]).state_dict()) == ["0.weight", "0.bias"]


def test_module_dict_container():
  d = nn.ModuleDict({"a": nn.Linear(1, 1), "b": nn.ReLU()})
  assert list(d) == ["a", "b"] and "a" in d and len(d) == 2
  assert list(d.keys()) == ["a", "b"] and [k for k, _ in d.items()] == ["a", "b"] and len(list(d.values())) == 2
  d["c"] = nn.Tanh()
  d.update([("e", nn.SiLU())])
  assert isinstance(d.pop("b"), nn.ReLU) and list(d) == ["a", "c", "e"]
  del d["c"]
  assert list(d) == ["a", "e"] and isinstance(d.e, nn.SiLU)
  d.clear()
  assert len(d) == 0


# *** functional ***

@pytest.mark.parametrize("shape,pad,value", [((2, 5), (1, 2), None), ((2, 3, 4), (0, 1, 2, 0), 1.5),
                                             ((3, 6), (-1, 2), None), ((2, 3, 4), (1, -2, -1, 1, 1, 1), -2.0)])
def test_pad(shape, pad, value):
  x = randn(*shape)
  tx, bx = torch.tensor(x, requires_grad=True), bt.tensor(x, requires_grad=True)
  tout = torch.nn.functional.pad(tx, pad, value=value)
  bout = F.pad(bx, pad, value=value)
  assert_close(bout, tout)
  u = randn(*tout.shape)
  (tout * torch.tensor(u)).sum().backward()
  (bout * bt.tensor(u)).sum().backward()
  assert_close(bx.grad, tx.grad)


def test_pad_errors():
  with pytest.raises(ValueError, match="even number"): F.pad(bt.zeros(2, 2), (1,))
  with pytest.raises(NotImplementedError, match="reflect"): F.pad(bt.zeros(2, 2), (1, 1), mode="reflection")


def test_functional_names_and_losses():
  for name in F.__all__: assert callable(getattr(F, name)), name
  logits, target = randn(6, 5), RNG.integers(0, 5, 6)
  target[2] = -1
  want = torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(target), ignore_index=-1)
  assert_close(F.cross_entropy(bt.tensor(logits), bt.tensor(target), ignore_index=-1), want)
  want = torch.nn.functional.mse_loss(torch.tensor(logits), torch.tensor(logits[::-1].copy()), reduction="sum")
  assert_close(F.mse_loss(bt.tensor(logits), bt.tensor(logits[::-1].copy()), reduction="sum"), want, rtol=1e-5)
  logp = torch.log_softmax(torch.tensor(logits), -1)
  assert_close(F.nll_loss(bt.tensor(logp.numpy()), bt.tensor(np.abs(target))),
               torch.nn.functional.nll_loss(logp, torch.tensor(np.abs(target))))
  weight = RNG.uniform(0.5, 2.0, 5).astype(logits.dtype)  # PyTorch's third positional argument is a class weight
  assert_close(F.cross_entropy(bt.tensor(logits), bt.tensor(target), bt.tensor(weight), ignore_index=-1),
               torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(target), torch.tensor(weight),
                                                 ignore_index=-1))


# *** init ***

def big(*shape) -> bt.Tensor: return bt.empty(*shape)


def test_calculate_gain_and_fans_match_torch():
  for nl, param in [("linear", None), ("sigmoid", None), ("tanh", None), ("relu", None), ("leaky_relu", None),
                    ("leaky_relu", 0.2), ("leaky_relu", math.sqrt(5)), ("selu", None), ("conv2d", None)]:
    assert nn.init.calculate_gain(nl, param) == pytest.approx(torch.nn.init.calculate_gain(nl, param), rel=1e-12)
  for shape in [(3, 5), (8, 4, 3, 3), (2, 7, 5)]:
    assert nn.init._calculate_fan_in_and_fan_out(bt.empty(*shape)) == \
      torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(*shape))
  with pytest.raises(ValueError, match="fewer than 2 dimensions"): nn.init.kaiming_uniform_(bt.empty(5))
  with pytest.raises(ValueError, match="Unsupported|unsupported"): nn.init.calculate_gain("softsign")
  with pytest.raises(ValueError, match="fan_in, fan_out"): nn.init.kaiming_normal_(bt.empty(2, 2), mode="fan")


@pytest.mark.parametrize("mode,nonlinearity,a", [("fan_in", "relu", 0), ("fan_out", "leaky_relu", 0.1),
                                                 ("fan_in", "leaky_relu", math.sqrt(5))])
def test_kaiming_uniform_bounds(mode, nonlinearity, a):
  w = nn.init.kaiming_uniform_(big(256, 512), a=a, mode=mode, nonlinearity=nonlinearity).numpy()
  fan = 512 if mode == "fan_in" else 256
  bound = nn.init.calculate_gain(nonlinearity, a) * math.sqrt(3.0 / fan)
  assert w.min() >= -bound and w.max() <= bound
  assert w.max() > 0.99 * bound and w.min() < -0.99 * bound
  assert abs(w.var() / (bound ** 2 / 3) - 1) < 0.02 and abs(w.mean()) < 0.01 * bound


@pytest.mark.parametrize("mode", ["fan_in", "fan_out"])
def test_kaiming_normal_std(mode):
  w = nn.init.kaiming_normal_(big(256, 512), mode=mode, nonlinearity="relu").numpy()
  std = math.sqrt(2.0 / (512 if mode == "fan_in" else 256))
  assert abs(w.std() / std - 1) < 0.01 and abs(w.mean()) < 0.01 * std


def test_xavier():
  w = nn.init.xavier_uniform_(big(300, 500), gain=2.0).numpy()
  a = 2.0 * math.sqrt(6.0 / 800)
  assert w.min() >= -a and w.max() <= a and abs(w.std() / (a / math.sqrt(3)) - 1) < 0.01
  w = nn.init.xavier_normal_(big(300, 500)).numpy()
  assert abs(w.std() / math.sqrt(2.0 / 800) - 1) < 0.01


def test_normal_uniform_constant_trunc():
  w = nn.init.normal_(big(400, 400), mean=1.0, std=0.02).numpy()
  assert abs(w.mean() - 1.0) < 1e-3 and abs(w.std() / 0.02 - 1) < 0.01
  w = nn.init.uniform_(big(400, 400), -3.0, 5.0).numpy()
  assert w.min() >= -3.0 and w.max() < 5.0 and abs(w.mean() - 1.0) < 0.02
  assert (nn.init.constant_(big(3, 3), 0.5).numpy() == 0.5).all()
  assert (nn.init.ones_(big(3)).numpy() == 1).all() and (nn.init.zeros_(big(3)).numpy() == 0).all()
  w = nn.init.trunc_normal_(big(300, 300), std=1.0, a=-2.0, b=2.0).numpy()
  assert w.min() >= -2.0 and w.max() <= 2.0
  # the standard deviation of N(0, 1) truncated to [-2, 2]
  phi, Z = math.exp(-2) / math.sqrt(2 * math.pi), math.erf(2 / math.sqrt(2))
  assert abs(w.std() / math.sqrt(1 - 4 * phi / Z) - 1) < 0.01
  with pytest.raises(ValueError, match="a < b"): nn.init.trunc_normal_(big(2), a=1.0, b=0.0)


def test_init_on_parameters_with_generator():
  p = nn.Parameter(bt.empty(50, 40))
  g1, g2 = bt.Generator().manual_seed(7), bt.Generator().manual_seed(7)
  first = nn.init.kaiming_normal_(p, generator=g1).detach().numpy().copy()
  assert p.requires_grad and p.is_leaf and p.grad_fn is None
  assert (nn.init.kaiming_normal_(p, generator=g2).detach().numpy() == first).all()
  assert nn.init.kaiming_uniform_(bt.empty(0, 3)).shape == (0, 3)


def test_default_inits():
  lin = nn.Linear(400, 300)
  bound = 1 / math.sqrt(400)
  for t in (lin.weight, lin.bias):
    w = t.detach().numpy()
    assert w.min() >= -bound and w.max() <= bound and w.max() > 0.9 * bound
  assert abs(lin.weight.detach().numpy().std() / (bound / math.sqrt(3)) - 1) < 0.02
  w = nn.Embedding(500, 200).weight.detach().numpy()
  assert abs(w.mean()) < 0.01 and abs(w.std() - 1) < 0.01
  ln = nn.LayerNorm(5)
  assert (ln.weight.detach().numpy() == 1).all() and (ln.bias.detach().numpy() == 0).all()
  assert (nn.RMSNorm(5).weight.detach().numpy() == 1).all()
  assert nn.Linear(3, 4, dtype=bt.float64).weight.dtype is bt.float64


# *** clip_grad_norm_ ***

def _params_with_grads(lib, seed=0):
  rng = np.random.default_rng(seed)
  shapes = [(5, 3), (7,), (2, 3, 4), (1,)]
  arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
  grads = [rng.standard_normal(s).astype(np.float32) * (i + 1) for i, s in enumerate(shapes)]
  params = []
  for a, g in zip(arrays, grads):
    p = (torch.nn.Parameter(torch.tensor(a)) if lib is torch else nn.Parameter(bt.tensor(a)))
    p.grad = torch.tensor(g) if lib is torch else bt.tensor(g)
    params.append(p)
  return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("max_norm", [0.5, 1e4])
def test_clip_grad_norm_matches_torch(norm_type, max_norm):
  tp, bp = _params_with_grads(torch), _params_with_grads(bt)
  want = torch.nn.utils.clip_grad_norm_(tp, max_norm, norm_type)
  got = nn.utils.clip_grad_norm_(iter(bp), max_norm, norm_type)
  assert_close(got, want, what="total norm")
  for i, (b, t) in enumerate(zip(bp, tp)): assert_close(b.grad, t.grad, what=f"grad {i}")


def test_clip_grad_norm_edges():
  p = nn.Parameter(bt.randn(4))
  assert float(nn.utils.clip_grad_norm_([p], 1.0)) == 0.0  # no gradients
  p.grad = bt.tensor([3.0, 4.0, 0.0, 0.0])
  q = nn.Parameter(bt.randn(2))  # no grad: skipped
  assert float(nn.utils.clip_grad_norm_([p, q], 1.0)) == pytest.approx(5.0)
  np.testing.assert_allclose(p.grad.numpy(), [0.6, 0.8, 0, 0], rtol=1e-5)
  p.grad = bt.tensor([float("nan"), 1.0, 0.0, 0.0])
  with pytest.raises(RuntimeError, match="non-finite"): nn.utils.clip_grad_norm_(p, 1.0, error_if_nonfinite=True)
  p.grad = bt.tensor([1.0, 1.0, 1.0, 1.0], dtype=bt.float64)
  p.grad = p.grad.to(bt.bfloat16)
  total = nn.utils.clip_grad_norm_(p, 1.0)
  assert total.dtype is bt.float32 and float(total) == pytest.approx(2.0, rel=1e-3) and p.grad.dtype is bt.bfloat16


def test_clip_grad_value():
  bp, tp = _params_with_grads(bt), _params_with_grads(torch)
  nn.utils.clip_grad_value_(bp, 0.7)
  torch.nn.utils.clip_grad_value_(tp, 0.7)
  for b, t in zip(bp, tp): assert_close(b.grad, t.grad)


# *** a nanoGPT-style model: the same source runs on torch and on blutrain ***

def define_gpt(lib):
  """nanoGPT's model code with `torch` replaced by `lib`; only the import differs between the two frameworks."""
  nn_, F_ = lib.nn, lib.nn.functional

  class CausalSelfAttention(nn_.Module):
    def __init__(self, C, H, T):
      super().__init__()
      self.c_attn = nn_.Linear(C, 3 * C)
      self.c_proj = nn_.Linear(C, C)
      self.n_head, self.n_embd = H, C
      self.register_buffer("bias", lib.tril(lib.ones(T, T)).view(1, 1, T, T))

    def forward(self, x):
      B, T, C = x.size()
      q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
      q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
      att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
      att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
      y = F_.softmax(att, dim=-1) @ v
      return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

  class Block(nn_.Module):
    def __init__(self, C, H, T):
      super().__init__()
      self.ln_1, self.attn = nn_.LayerNorm(C), CausalSelfAttention(C, H, T)
      self.ln_2 = nn_.RMSNorm(C, eps=1e-5)
      self.mlp = nn_.Sequential(nn_.Linear(C, 4 * C), nn_.GELU(approximate="tanh"), nn_.Linear(4 * C, C), nn_.Dropout(0.0))

    def forward(self, x):
      x = x + self.attn(self.ln_1(x))
      return x + self.mlp(self.ln_2(x))

  class GPT(nn_.Module):
    def __init__(self, V=11, C=8, H=2, T=6, L=2):
      super().__init__()
      self.transformer = nn_.ModuleDict(dict(wte=nn_.Embedding(V, C), wpe=nn_.Embedding(T, C), drop=nn_.Dropout(0.1),
                                             h=nn_.ModuleList([Block(C, H, T) for _ in range(L)]),
                                             ln_f=nn_.LayerNorm(C, bias=False)))
      self.lm_head = nn_.Linear(C, V, bias=False)
      self.transformer.wte.weight = self.lm_head.weight
      self.apply(self._init_weights)

    def _init_weights(self, module):
      if isinstance(module, nn_.Linear):
        lib.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None: lib.nn.init.zeros_(module.bias)

    def forward(self, idx, targets):
      B, T = idx.size()
      pos = lib.arange(0, T, dtype=lib.long)
      x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
      for block in self.transformer.h: x = block(x)
      logits = self.lm_head(self.transformer.ln_f(x))
      return logits, F_.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

  return GPT()


def test_gpt_ports_by_import():
  b, t = define_gpt(bt), define_gpt(torch)
  assert list(b.state_dict()) == list(t.state_dict())
  assert [tuple(v.shape) for v in b.state_dict().values()] == [tuple(v.shape) for v in t.state_dict().values()]
  assert [n for n, _ in b.named_parameters()] == [n for n, _ in t.named_parameters()]
  assert b.num_parameters() == sum(p.numel() for p in t.parameters())
  assert repr(b) == repr(t)
  randomize(t)
  b.load_state_dict({k: to_bt(v) for k, v in t.state_dict().items()})
  assert b.transformer.wte.weight is b.lm_head.weight
  b.eval(); t.eval()
  idx = np.random.default_rng(3).integers(0, 11, (3, 6))
  targets = np.random.default_rng(4).integers(0, 11, (3, 6))
  targets[0, 0] = -1
  blogits, bloss = b(bt.tensor(idx), bt.tensor(targets))
  tlogits, tloss = t(torch.tensor(idx), torch.tensor(targets))
  assert_close(blogits, tlogits, what="logits", atol=1e-4)
  assert_close(bloss, tloss, what="loss", atol=1e-4)
  bloss.backward(); tloss.backward()
  bparams = dict(b.named_parameters())
  for name, tp in t.named_parameters():
    assert_close(bparams[name].grad, tp.grad, what=f"grad of {name}", atol=1e-4, rtol=1e-3)


def test_module_to_channels_last_as_pytorch():
  """`model.to(memory_format=bt.channels_last)` lays out 4-d parameters (a convolution's weight) as PyTorch's does,
  leaves the others, and two SGD (momentum) or AdamW steps from there match PyTorch's with the layout kept: the states
  take their parameter's layout and every parameter is updated by the one multi-tensor op (`sgd` / `adamw`)."""
  x, y = np.random.default_rng(0).standard_normal((2, 3, 5, 5)).astype(np.float32), np.array([1, 3])
  for name, kw in (("SGD", dict(lr=0.1, momentum=0.9)), ("AdamW", dict(lr=0.01, weight_decay=0.1))):
    bt.manual_seed(0)
    # no bias before the batch norm: its gradient is rounding noise, which Adam's normalization would amplify
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                      nn.Linear(200, 4))
    tm = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                             torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(200, 4))
    tm.load_state_dict({k: torch.tensor(v.detach().numpy()) for k, v in m.state_dict().items()})
    assert m.to(memory_format=bt.channels_last) is m
    tm.to(memory_format=torch.channels_last)
    assert [p.stride() for p in m.parameters()] == [p.stride() for p in tm.parameters()]
    opt, topt = getattr(bt.optim, name)(m.parameters(), **kw), getattr(torch.optim, name)(tm.parameters(), **kw)
    for _ in range(2):
      for mod, lib in ((m, bt), (tm, torch)):
        lib.nn.functional.cross_entropy(mod(lib.tensor(x)), lib.tensor(y)).backward()
      with bt.profiler.profile() as prof: opt.step()
      calls = {r.name: r.calls for r in prof.rows}
      assert calls.get(name.lower()) == 1, (name, calls)
      topt.step()
      opt.zero_grad(), topt.zero_grad()
    w = m[0].weight
    assert w.is_contiguous(memory_format=bt.channels_last)
    assert all(s.stride() == w.stride() for s in opt.state[w].values() if isinstance(s, bt.Tensor) and s.ndim == 4)
    for a, b in zip(m.parameters(), tm.parameters()):
      np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_parameters_follow_every_change_of_the_module_tree():
  """named_parameters() keeps its walk between calls; any change of a registry anywhere makes it walk again."""
  net = bt.nn.Sequential(bt.nn.Linear(3, 4), bt.nn.ReLU(), bt.nn.Linear(4, 2))
  names = lambda: [n for n, _ in net.named_parameters()]
  assert names() == names() == ["0.weight", "0.bias", "2.weight", "2.bias"]
  net[2] = bt.nn.Linear(4, 5, bias=False)
  assert names() == ["0.weight", "0.bias", "2.weight"] and next(iter(net[2].parameters())).shape == (5, 4)
  net[0].extra = bt.nn.Parameter(bt.ones(2))
  assert names() == ["0.weight", "0.bias", "0.extra", "2.weight"] and list(net.parameters())[2] is net[0].extra
  net[0]._parameters["bias"] = None
  assert names() == ["0.weight", "0.extra", "2.weight"]
  del net[0].extra
  assert names() == ["0.weight", "2.weight"]
  net[0].weight = bt.nn.Parameter(bt.zeros(4, 3))
  assert next(net.parameters()) is net[0].weight
