"""Ordering, sampling and the PyTorch surface of issue #17 (sort, topk, kthvalue, cumprod, prod, multinomial,
randperm, flip, roll, diag, einsum, ...) against PyTorch CPU: forward, gradients, non-contiguous inputs, bad input;
VJPs against float64 finite differences; random ops by their statistics and by compiled == eager."""
import numpy as np
import pytest
import torch

import blutrain as bt
from tests.helpers import Int, assert_close, check_vjp, helper_test_op

LAYOUTS = ("contiguous", "transposed", "strided")


def ties(shape, seed=0):
  """Values with many ties (and signed zeros), so that sorts must be stable to agree."""
  return np.round(np.random.default_rng(seed).uniform(-3, 3, shape)) * 0.5


# *** sorting ***

@pytest.mark.parametrize("dim,descending", [(-1, False), (0, True), (1, False), (-1, True)])
def test_sort_argsort(dim, descending):
  x = ties((4, 9))
  helper_test_op([x], lambda t: t.sort(dim=dim, descending=descending, stable=True), lambda t: t.sort(dim, descending),
                 layouts=LAYOUTS)
  helper_test_op([x], lambda t: t.argsort(dim=dim, descending=descending, stable=True),
                 lambda t: t.argsort(dim, descending), grad=False)
  helper_test_op([(3, 4, 5)], lambda t: torch.msort(t), lambda t: bt.msort(t))


def test_sort_nan_inf_and_small_shapes():
  x = [3.0, float("nan"), -float("inf"), 1.0, float("inf"), 1.0, -0.0, 0.0]
  for desc in (False, True):
    b, t = bt.tensor(x).sort(descending=desc), torch.tensor(x).sort(descending=desc, stable=True)
    assert b.indices.tolist() == t.indices.tolist()
    assert_close(b.values, t.values)
  for shape in ((), (0,), (1,), (3, 0)):
    b, t = bt.zeros(shape).sort(), torch.zeros(shape).sort()
    assert tuple(b.values.shape) == tuple(t.values.shape) and b.indices.dtype is bt.int64
  assert bt.tensor([True, False, True]).sort().indices.tolist() == [1, 0, 2]


@pytest.mark.parametrize("k,dim,largest", [(1, -1, True), (3, 1, False), (2, 0, True), (9, -1, True), (0, -1, True)])
def test_topk(k, dim, largest):
  distinct = np.random.default_rng(1).permutation(36).reshape(4, 9) - 17.5  # PyTorch's order of ties is unspecified
  helper_test_op([distinct], lambda t: t.topk(k, dim, largest), layouts=LAYOUTS)
  b, t = bt.tensor(ties((4, 9))).topk(k, dim, largest), torch.tensor(ties((4, 9))).topk(k, dim, largest)
  assert_close(b.values, t.values)


@pytest.mark.parametrize("k,dim,keepdim", [(1, -1, False), (3, 0, True), (9, 1, False)])
def test_kthvalue(k, dim, keepdim):
  x = (np.random.default_rng(2).permutation(36).reshape(4, 9) - 17.5) / 4  # distinct: PyTorch's pick among ties differs
  helper_test_op([x], lambda t: t.kthvalue(k, dim, keepdim), layouts=LAYOUTS)
  helper_test_op([np.full((), 1.5)], lambda t: t.kthvalue(1))


def test_ordering_bad_input():
  x = bt.ones(3, 4)
  with pytest.raises(IndexError, match="topk: k=5"): x.topk(5)
  with pytest.raises(RuntimeError, match="topk: k=-1"): x.topk(-1)
  with pytest.raises(IndexError, match="kthvalue: k=0"): x.kthvalue(0)
  with pytest.raises(IndexError, match="sort: dimension 2"): x.sort(2)


def test_sorted_values_vjp():
  check_vjp(lambda x: x.sort(1, descending=True).values * x.topk(2, 1).values.sum(), [(3, 5)])
  check_vjp(lambda x: x.kthvalue(2, 0).values, [(4, 3)])


# *** cumprod, prod ***

WITH_ZEROS = np.array([[2.0, 0.0, 3.0, -1.5, 0.0, 2.0], [0.5, -2.0, 1.5, 3.0, 0.0, 1.0], [1.0, 2.0, -0.5, 0.0, 4.0, 0.5]])


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cumprod(dim):
  for x in (WITH_ZEROS, (3, 6)):
    helper_test_op([x], lambda t: t.cumprod(dim), layouts=LAYOUTS)
  helper_test_op([Int((3, 4), -3, 4)], lambda t: t.cumprod(dim), grad=False)
  helper_test_op([(2, 3)], lambda t: torch.cumprod(t, dim, dtype=torch.float64), lambda t: bt.cumprod(t, dim, dtype=bt.float64))


@pytest.mark.parametrize("dim,keepdim", [(None, False), (0, False), (1, True), (-1, False)])
def test_prod(dim, keepdim):
  args = () if dim is None else (dim, keepdim)
  for x in (WITH_ZEROS, WITH_ZEROS[:, 2:4], (3, 6)):  # two zeros, one zero, none
    helper_test_op([x], lambda t: t.prod(*args), layouts=LAYOUTS)
  helper_test_op([Int((3, 4), -3, 4)], lambda t: t.prod(*args), grad=False)


def test_prod_vjp():  # at zeros the gradients are compared with PyTorch's above
  check_vjp(lambda t: t.prod(1), [(2, 6)])
  check_vjp(lambda t: t.prod(), [(2, 3)])


# *** random ***

def test_randperm_is_a_permutation_and_seeded():
  for n in (0, 1, 7, 1000):
    p = bt.randperm(n)
    assert p.dtype is bt.int64 and sorted(p.tolist()) == list(range(n))
  g1, g2 = bt.Generator().manual_seed(3), bt.Generator().manual_seed(3)
  assert bt.randperm(50, generator=g1).tolist() == bt.randperm(50, generator=g2).tolist()
  assert bt.randperm(50, generator=g1).tolist() != bt.randperm(50, generator=g2.manual_seed(4)).tolist()
  assert bt.randperm(5, dtype=bt.int32).dtype is bt.int32


@pytest.mark.parametrize("replacement", [True, False])
def test_multinomial_frequencies(replacement):
  w = bt.tensor([[0.1, 0.0, 0.5, 0.4], [1.0, 1.0, 1.0, 1.0]])
  n = 4000
  if replacement:
    draws = bt.multinomial(w, n, replacement=True).numpy()
    for row, want in zip(draws, (w[0] / w[0].sum(), w[1] / 4)):
      freq = np.bincount(row, minlength=4) / n
      np.testing.assert_allclose(freq, want.numpy(), atol=4 * np.sqrt(0.25 / n))  # four standard deviations
  else:
    firsts = np.array([bt.multinomial(w[0], 3).tolist() for _ in range(600)])
    assert (np.sort(firsts, 1) != firsts).any() and all(len(set(r)) == 3 and 1 not in r for r in firsts.tolist())
    np.testing.assert_allclose(np.bincount(firsts[:, 0], minlength=4) / 600, [0.1, 0, 0.5, 0.4], atol=0.07)


def test_multinomial_generator_shapes_and_errors():
  g = bt.Generator().manual_seed(1)
  a = bt.multinomial(bt.tensor([0.2, 0.8]), 5, True, generator=g)
  b = bt.multinomial(bt.tensor([0.2, 0.8]), 5, True, generator=bt.Generator().manual_seed(1))
  assert a.tolist() == b.tolist() and a.shape == (5,) and a.dtype is bt.int64
  assert bt.multinomial(bt.ones(3, 6), 6).shape == (3, 6)
  with pytest.raises(RuntimeError, match="cannot draw 7 samples"): bt.multinomial(bt.ones(6), 7)
  with pytest.raises(RuntimeError, match="non-negative"): bt.multinomial(bt.tensor([1.0, -1.0]), 1)
  with pytest.raises(RuntimeError, match="1-D or 2-D"): bt.multinomial(bt.ones(2, 2, 2), 1)


def test_bernoulli_and_normal():
  p = bt.tensor([0.0, 1.0, 0.3]).expand(20000, 3)
  draws = bt.bernoulli(p)
  assert draws.dtype is bt.float32 and set(np.unique(draws.numpy())) <= {0.0, 1.0}
  np.testing.assert_allclose(draws.mean(0).numpy(), [0.0, 1.0, 0.3], atol=0.02)
  x = bt.normal(bt.tensor([1.0, -5.0]).expand(20000, 2), 2.0)
  np.testing.assert_allclose(x.mean(0).numpy(), [1.0, -5.0], atol=0.1)
  np.testing.assert_allclose(x.std(0).numpy(), [2.0, 2.0], atol=0.1)
  assert bt.normal(0.0, 1.0, size=(3, 2)).shape == (3, 2)
  with pytest.raises(TypeError, match="size="): bt.normal(0.0, 1.0)


def test_sampling_compiled_equals_eager():
  """nanoGPT's generate step: top-k filtering, softmax, a draw; compiled from the same generator state."""
  def step(logits, g):
    v, _ = logits.topk(3)
    logits = bt.where(logits < v[:, -1:], -float("inf"), logits)
    probs = bt.nn.functional.softmax(logits, dim=-1)
    return bt.multinomial(probs, 2, generator=g), logits.sort(-1, descending=True).values, logits.cumprod(-1)
  logits = bt.randn(4, 10)
  compiled, g_eager, g_compiled = bt.compile(step), bt.Generator().manual_seed(5), bt.Generator().manual_seed(5)
  for _ in range(3):  # the first call captures, the next ones replay
    eager, got = step(logits, g_eager), compiled(logits, g_compiled)
    assert eager[0].tolist() == got[0].tolist()
    for e, c in zip(eager[1:], got[1:]): np.testing.assert_allclose(c.numpy(), e.numpy(), rtol=1e-6)


# *** reordering, products ***

@pytest.mark.parametrize("dims", [0, (1,), (0, 1), (), (-1, 0)])
def test_flip(dims):
  helper_test_op([(3, 4)], lambda t: t.flip(dims), layouts=LAYOUTS)


@pytest.mark.parametrize("shifts,dims", [(1, 0), (-2, 1), ((1, 3), (0, 1)), (5, None), (0, 1), (13, -1)])
def test_roll(shifts, dims):
  helper_test_op([(3, 4)], lambda t: t.roll(shifts, dims), layouts=LAYOUTS)


@pytest.mark.parametrize("k", [0, 1, -2, 5])
def test_diag_diagonal(k):
  helper_test_op([(4,)], lambda t: t.diag(k))
  helper_test_op([(3, 5)], lambda t: t.diag(k), layouts=LAYOUTS)
  helper_test_op([(2, 3, 4)], lambda t: t.diagonal(k, 2, 0), layouts=LAYOUTS)
  helper_test_op([Int((3,), 0, 9)], lambda t: t.diag(k), grad=False)
  with pytest.raises(RuntimeError, match="diag: expected a 1-D or 2-D"): bt.zeros(2, 2, 2).diag()


def test_products():
  helper_test_op([(3,), (4,)], lambda a, b: torch.outer(a, b), lambda a, b: bt.outer(a, b))
  helper_test_op([(3, 4), (4, 2)], lambda a, b: torch.mm(a, b), lambda a, b: bt.mm(a, b), layouts=LAYOUTS)
  helper_test_op([(2, 3, 4), (2, 4, 5)], lambda a, b: torch.bmm(a, b), lambda a, b: bt.bmm(a, b), layouts=LAYOUTS)
  with pytest.raises(RuntimeError, match="mm: expected two 2-D"): bt.mm(bt.ones(3), bt.ones(3, 2))
  with pytest.raises(RuntimeError, match="bmm: expected 3-D"): bt.bmm(bt.ones(2, 3, 4), bt.ones(3, 4, 5))
  with pytest.raises(RuntimeError, match="outer"): bt.outer(bt.ones(2, 2), bt.ones(2))


EINSUMS = [("ij,jk->ik", [(3, 4), (4, 5)]), ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]), ("ii->i", [(4, 4)]),
           ("ii", [(4, 4)]), ("ij->", [(3, 4)]), ("i,j->ij", [(3,), (4,)]), ("...ij,...jk", [(2, 3, 4), (4, 5)]),
           ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]), ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),
           ("ij->ji", [(3, 4)]), ("i,i->", [(5,), (5,)]), ("ijk,ikl->jl", [(2, 3, 4), (2, 4, 5)]),
           ("iij->j", [(3, 3, 4)]), ("b i d, b j d -> b i j", [(2, 3, 4), (2, 5, 4)])]


@pytest.mark.parametrize("eq,shapes", EINSUMS, ids=[e for e, _ in EINSUMS])
def test_einsum(eq, shapes):
  helper_test_op(shapes, lambda *t: torch.einsum(eq, *t), lambda *t: bt.einsum(eq, *t), layouts=LAYOUTS)


def test_einsum_vjp_and_errors():
  check_vjp(lambda a, b: bt.einsum("bij,jk->bik", a, b), [(2, 3, 4), (4, 2)])
  with pytest.raises(RuntimeError, match="names 2 operands, got 1"): bt.einsum("ij,jk", bt.ones(2, 2))
  with pytest.raises(RuntimeError, match="do not fit an operand of shape"): bt.einsum("ijk->i", bt.ones(2, 2))


def test_isclose_allclose_equal():
  a = [1.0, float("nan"), float("inf"), -float("inf"), 1e-9, 2.0]
  b = [1.0 + 1e-6, float("nan"), float("inf"), float("inf"), 0.0, 2.1]
  for kw in ({}, {"equal_nan": True}, {"rtol": 0.1}, {"atol": 0.0, "rtol": 0.0}):
    assert bt.isclose(bt.tensor(a), bt.tensor(b), **kw).tolist() == torch.isclose(torch.tensor(a), torch.tensor(b), **kw).tolist()
    assert bt.allclose(bt.tensor(a[4:]), bt.tensor(b[4:]), **kw) == torch.allclose(torch.tensor(a[4:]), torch.tensor(b[4:]), **kw)
  assert bt.isclose(bt.tensor([1, 2]), bt.tensor([1, 3])).tolist() == [True, False]
  assert bt.equal(bt.tensor([1.0, 2.0]), bt.tensor([1.0, 2.0])) and not bt.equal(bt.ones(2), bt.ones(3))
  assert not bt.equal(bt.tensor([float("nan")]), bt.tensor([float("nan")]))


# *** surface ***

def test_size_type_and_creation_keywords():
  x = bt.zeros(size=(2, 3))
  assert isinstance(x.shape, bt.Size) and isinstance(x.shape, tuple) and x.shape == (2, 3) and x.size() == (2, 3)
  assert repr(x.shape) == "bt.Size([2, 3])" and str(x.shape) == "(2, 3)" and x.shape.numel() == 6
  assert {x.shape: 1}[(2, 3)] == 1
  assert bt.ones(size=4).shape == (4,) and bt.rand(size=(2, 1)).shape == (2, 1) and bt.randn(size=[3]).shape == (3,)
  assert bt.empty(2, size=None).shape == (2,)
  with pytest.raises(TypeError, match="both"): bt.zeros(2, size=(2,))
  assert x.type() == "blutrain.FloatTensor" and bt.ones(2, dtype=bt.int64).type() == "blutrain.LongTensor"
  assert x.type(bt.float64).dtype is bt.float64 and x.type("torch.IntTensor").dtype is bt.int32
  with pytest.raises(TypeError, match="unknown tensor type"): x.type("torch.ComplexTensor")


def test_inference_mode():
  w = bt.ones(2, requires_grad=True)
  with bt.inference_mode(): assert not (w * 2).requires_grad
  with bt.inference_mode(False): assert (w * 2).requires_grad
  assert bt.inference_mode()(lambda: (w * 2).requires_grad)() is False
  assert (w * 2).requires_grad


# *** indexing and scans ***

@pytest.mark.parametrize("repeats,dim", [(2, 0), (3, 1), (1, -1), (0, 0), (2, None)])
def test_repeat_interleave(repeats, dim):
  helper_test_op([(3, 4)], lambda t: t.repeat_interleave(repeats, dim), layouts=LAYOUTS)


def test_repeat_interleave_counts():
  counts = [2, 0, 1]
  helper_test_op([(3, 4)], lambda t: t.repeat_interleave(torch.tensor(counts), 0),
                 lambda t: t.repeat_interleave(bt.tensor(counts), 0), layouts=LAYOUTS)
  with pytest.raises(RuntimeError, match="2 counts for dimension 0 of size 3"): bt.ones(3).repeat_interleave(bt.tensor([1, 2]))


def test_masked_select():
  mask = np.array([[True, False, True, True]])
  helper_test_op([(3, 4)], lambda t: t.masked_select(torch.tensor(mask)), lambda t: t.masked_select(bt.tensor(mask)),
                 layouts=LAYOUTS)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_logcumsumexp(dim):
  helper_test_op([(3, 5)], lambda t: t.logcumsumexp(dim), layouts=LAYOUTS, low=-30.0, high=30.0)
  edges = [[0.0, -float("inf"), 2.0], [-float("inf"), -float("inf"), 1.0], [float("inf"), 3.0, float("nan")]]
  assert_close(bt.tensor(edges).logcumsumexp(dim), torch.tensor(edges).logcumsumexp(dim))


def test_nested_tuple_indices():
  x = np.arange(12.0).reshape(3, 4)
  for key in (((0,),), ((0, 1),), ((0, 1), (1, 2)), ([0, 2], (1, 3))):
    helper_test_op([x], lambda t: t[key], layouts=LAYOUTS)


def test_sdpa_grouped_query_heads():
  fn = lambda lib: lambda q, k, v: (torch.nn.functional if lib is torch else bt.nn.functional).scaled_dot_product_attention(
    q, k, v, enable_gqa=True, is_causal=True)
  helper_test_op([(2, 6, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8)], fn(torch), fn(bt), tol_scale=4)
  helper_test_op([(2, 6, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8)], fn(torch), fn(bt), dtype=bt.float64)
  with pytest.raises(RuntimeError, match="6 query heads cannot be grouped over 4"):
    fn(bt)(bt.ones(1, 6, 2, 4), bt.ones(1, 4, 2, 4), bt.ones(1, 4, 2, 4))


@pytest.mark.parametrize("name", ["sum", "mean", "amax", "argmin", "std", "all", "prod", "cumsum", "logsumexp", "sort"])
def test_axis_is_dim(name):
  helper_test_op([(3, 4)], lambda t: getattr(t, name)(axis=1), grad=name not in ("argmin", "all"))
  with pytest.raises(TypeError, match="both dim= and its alias axis="): getattr(bt.ones(2, 2), name)(dim=0, axis=1)
  assert bt.cat([bt.ones(2, 1), bt.ones(2, 2)], axis=1).shape == (2, 3)


@pytest.mark.parametrize("name", ["cummax", "cummin"])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cummax_cummin(name, dim):
  helper_test_op([ties((5, 9), 3)], lambda t: getattr(t, name)(dim), layouts=LAYOUTS)  # ties: the latest index
  helper_test_op([Int((4, 7), -3, 4)], lambda t: getattr(t, name)(dim), grad=False)
  edges = [[1.0, float("nan"), 3.0, float("nan")], [-float("inf"), 2.0, 2.0, float("inf")]]
  b, t = getattr(bt.tensor(edges), name)(dim), getattr(torch.tensor(edges), name)(dim)
  assert_close(b.values, t.values)
  assert b.indices.tolist() == t.indices.tolist()
  b, t = getattr(bt.tensor(2.5), name)(0), getattr(torch.tensor(2.5), name)(0)
  assert b.values.shape == t.values.shape == () and b.indices.item() == t.indices.item() == 0


def test_elementwise_math_compiled_equals_eager():
  def f(x, y, n):
    a = x.tan() + x.atan2(y) + x.asinh() + x.expm1() + (x.abs() + 1).log2() + x.round(decimals=1) + x.trunc()
    b = (x % y) + x.fmod(y) + x.div(y, rounding_mode="floor") + x.copysign(y) + x.logaddexp(y) + x.cummax(1).values
    c = (n & 6) | (n << 2) ^ (n >> 1) + ~n + n // 3 + n % 5
    return a * b, c, x.cumprod(1).prod(0), bt.einsum("ij,kj->ik", x, y)
  x, y = bt.randn(3, 5), bt.randn(3, 5) + 0.1
  n = bt.randint(-50, 50, (3, 5))
  compiled = bt.compile(f)
  for _ in range(3):  # eager, capture, replay
    for e, c in zip(f(x, y, n), compiled(x, y, n)):
      assert e.dtype is c.dtype
      np.testing.assert_allclose(c.numpy(), e.numpy(), rtol=1e-6, atol=1e-6)


def test_nanogpt_generate_sampling_ports_verbatim():
  """The sampling lines of nanoGPT's `generate`, `torch.` written `bt.`: every id drawn is among its row's top k."""
  logits = bt.randn(3, 50)
  v, _ = bt.topk(logits, min(10, logits.size(-1)))
  kept = logits.clone()
  kept[kept < v[:, [-1]]] = -float("Inf")
  probs = bt.nn.functional.softmax(kept, dim=-1)
  idx_next = bt.multinomial(probs, num_samples=1)
  idx = bt.cat((bt.zeros((3, 1), dtype=bt.long), idx_next), dim=1)
  assert idx.shape == (3, 2)
  top = logits.topk(10).indices.tolist()
  assert all(i in row for i, row in zip(idx_next.reshape(-1).tolist(), top))


# *** norm, unfold, scatter ***

@pytest.mark.parametrize("p", ["fro", 2, 1, 3, 0.5, 0, float("inf"), -float("inf")])
@pytest.mark.parametrize("dim,keepdim", [(None, False), (1, True), ((0, 2), False)])
def test_norm(p, dim, keepdim):
  helper_test_op([(3, 4, 5)], lambda t: t.norm(p, dim, keepdim), layouts=LAYOUTS, low=0.1)
  helper_test_op([(3, 4, 5)], lambda t: torch.norm(t, p, dim, keepdim), lambda t: bt.norm(t, p, dim, keepdim))


def test_norm_of_zeros_has_a_zero_gradient():
  for p in (2, 3, "fro"):
    x, t = bt.zeros(2, 3, requires_grad=True), torch.zeros(2, 3, requires_grad=True)
    x.norm(p, 1).sum().backward()
    t.norm(p, 1).sum().backward()
    assert_close(x.grad, t.grad)
  with pytest.raises(RuntimeError, match="norm: expected a floating point tensor, got int64"): bt.tensor([1, 2]).norm()


@pytest.mark.parametrize("dim,size,step", [(1, 3, 2), (1, 7, 1), (0, 1, 1), (-1, 2, 3), (1, 0, 2)])
def test_unfold(dim, size, step):
  helper_test_op([(3, 7, 4)], lambda t: t.unfold(dim, size, step), layouts=LAYOUTS)
  assert_close(bt.tensor(5.0).unfold(0, 1, 1), torch.tensor(5.0).unfold(0, 1, 1))
  with pytest.raises(RuntimeError, match=r"unfold: size 8 must be in \[0, 7\]"): bt.ones(3, 7).unfold(1, 8, 1)


def test_scatter():
  rng = np.random.default_rng(0)
  index = np.stack([rng.permutation(5)[:3] for _ in range(4)], 1)  # distinct rows per column: one value per position
  helper_test_op([(5, 4), index, (3, 4)], lambda x, i, s: x.scatter(0, i, s), layouts=LAYOUTS)
  helper_test_op([(4, 5), index.T.copy(), (4, 4)], lambda x, i, s: x.scatter(1, i, s), grad=False)  # src > index
  helper_test_op([(5, 4), index], lambda x, i: x.scatter(0, i, -1.5))
  helper_test_op([(5, 4), index], lambda x, i: x.scatter(0, i, value=2.0))
  repeated = rng.integers(0, 5, (6, 4))
  for reduce in ("add", "multiply"):
    helper_test_op([(5, 4), repeated, (6, 4)], lambda x, i, s: x.scatter(0, i, s, reduce=reduce), grad=False)
  helper_test_op([(5, 4), index, (3, 4)], lambda x, i, s: torch.scatter(x, 0, i, s), lambda x, i, s: bt.scatter(x, 0, i, s))
  x, t = bt.zeros(5, 4), torch.zeros(5, 4)
  x.scatter_(0, bt.tensor(index), bt.ones(3, 4)).scatter_add_(0, bt.tensor(repeated), bt.ones(6, 4))
  t.scatter_(0, torch.tensor(index), torch.ones(3, 4)).scatter_add_(0, torch.tensor(repeated), torch.ones(6, 4))
  assert_close(x, t)
  with pytest.raises(RuntimeError, match="scatter: src must be a tensor of the input's dtype float32, got int64"):
    bt.zeros(2, 3).scatter(0, bt.tensor([[0]]), bt.tensor([[1]]))
  with pytest.raises(TypeError, match="scatter: expected one of src"): bt.zeros(2, 3).scatter(0, bt.tensor([[0]]))


# *** the names of issue #17's "Missing today" list ***

MISSING_TODAY = {  # where PyTorch has them -> names
  "blutrain": "save load mm bmm einsum sort argsort topk kthvalue cumprod multinomial bernoulli normal randperm allclose "
              "isclose equal diag outer flip roll inference_mode Size tan asin acos atan atan2 sinh cosh asinh acosh "
              "atanh round ceil floor trunc fmod remainder div exp2 log2 log10 copysign logaddexp isinf isnan isfinite "
              "int8 uint8 prod cummax cummin logcumsumexp repeat_interleave diagonal masked_select nonzero "
              "scatter_reduce",
  "Tensor": "__floordiv__ __mod__ type new_zeros new_ones new_full scatter_ log1p expm1 norm __and__ __or__ __xor__ "
            "__invert__ __lshift__ __rshift__ unfold masked_select nonzero scatter_reduce",
  "blutrain.nn": "Conv1d Conv2d ConvTranspose2d MaxPool2d AvgPool2d AdaptiveAvgPool2d BatchNorm1d BatchNorm2d GroupNorm "
                 "Flatten Unflatten LSTM GRU MultiheadAttention Softmax LogSoftmax LeakyReLU SiLU Mish Hardswish "
                 "Identity CrossEntropyLoss MSELoss L1Loss SmoothL1Loss BCEWithLogitsLoss NLLLoss KLDivLoss",
  "blutrain.nn.functional": "conv1d conv2d max_pool2d avg_pool2d interpolate pad normalize cosine_similarity one_hot "
                            "binary_cross_entropy binary_cross_entropy_with_logits elu selu celu relu6 hardsigmoid "
                            "hardtanh softplus softsign logsigmoid softmin",
  "blutrain.utils.data": "Dataset TensorDataset DataLoader",
  "blutrain.optim": "RMSprop Adagrad",
  "blutrain.optim.lr_scheduler": "OneCycleLR ReduceLROnPlateau LambdaLR",
}


def test_every_name_the_issue_lists_exists():
  import importlib
  missing = [f"{where}.{name}" for where, names in MISSING_TODAY.items() for name in names.split()
             if not hasattr(bt.Tensor if where == "Tensor" else importlib.import_module(where), name)]
  assert not missing, f"named missing by issue #17 and still missing: {missing}"
