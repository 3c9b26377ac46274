"""Tensor creation, views and storage sharing, strides, conversion, host interop (numpy, DLPack) and repr,
against PyTorch."""
import numpy as np
import pytest
import torch

from hypothesis import given, strategies as st

import blutrain as bt
from tests.helpers import TORCH_DTYPES, assert_close

# *** creation ***


def test_tensor_from_data():
  cases = [1.5, 3, True, [1, 2, 3], [[1.0, 2.0], [3.0, 4.0]], [True, False], [], [[1, 2.5]], np.arange(6).reshape(2, 3),
           np.float64(2.0), np.ones((2, 2), np.float32), np.ones(3, np.int32), np.array([1, 2], np.int64)]
  for data in cases:
    assert_close(bt.tensor(data), torch.tensor(data))
  for dt in (bt.float16, bt.bfloat16, bt.float64, bt.int32, bt.bool):
    assert_close(bt.tensor([[1, 0], [2, 3]], dtype=dt), torch.tensor([[1, 0], [2, 3]], dtype=TORCH_DTYPES[dt]))
  x = bt.tensor([1.0, 2.0], requires_grad=True)
  assert x.requires_grad and x.is_leaf
  src = bt.arange(3.0)
  y = bt.tensor(src)
  assert y._storage is not src._storage and y.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("name", ["zeros", "ones", "empty"])
def test_constant_creation(name):
  for size in [(), (0,), (3,), (2, 3)]:
    got, want = getattr(bt, name)(*size), getattr(torch, name)(size)
    assert got.shape == tuple(want.shape) and got.dtype is bt.float32
    if name != "empty": assert_close(got, want)
    assert_close(getattr(bt, name)(size, dtype=bt.int32).to(bt.float32) * 0, torch.zeros(size))
  assert getattr(bt, name)(2, 3, dtype=bt.bfloat16).dtype is bt.bfloat16


def test_full():
  for value, dt in [(2.5, None), (3, None), (True, None), (7, bt.float16), (1.5, bt.float64)]:
    got = bt.full((2, 3), value, dtype=dt)
    want = torch.full((2, 3), value, dtype=TORCH_DTYPES[dt] if dt else None)
    assert_close(got, want)
  assert bt.full(4, 1.0).shape == (4,)
  with pytest.raises(ValueError, match="negative"): bt.zeros(2, -1)


@pytest.mark.parametrize("args", [(5,), (2, 7), (1, 10, 3), (0, 1, 0.25), (1, 2.5, 0.5), (5, 0, -1), (10, 0, -3),
                                  (-1.5, 1.5, 0.7), (0, 0), (0.0, 1.0, 0.1), (2.5,)])
def test_arange(args):
  assert_close(bt.arange(*args), torch.arange(*args))
  assert_close(bt.arange(*args, dtype=bt.float64), torch.arange(*args, dtype=torch.float64))


def test_arange_errors():
  with pytest.raises(ValueError, match="step"): bt.arange(0, 5, 0)
  with pytest.raises(ValueError, match="sign"): bt.arange(3, 1)
  with pytest.raises(RuntimeError): torch.arange(3, 1)


@pytest.mark.parametrize("args", [(0, 1, 5), (-2, 3, 1), (1, 0, 4), (0, 10, 0), (0.5, 1.5, 11), (3, 3, 3)])
def test_linspace(args):
  assert_close(bt.linspace(*args), torch.linspace(*args))
  assert_close(bt.linspace(*args, dtype=bt.float64), torch.linspace(*args, dtype=torch.float64))


@pytest.mark.parametrize("nm", [(3, None), (2, 4), (4, 2), (0, None), (1, 1)])
def test_eye(nm):
  n, m = nm
  assert_close(bt.eye(n, m), torch.eye(n, m) if m is not None else torch.eye(n))
  want = torch.eye(n, m, dtype=torch.int64) if m is not None else torch.eye(n, dtype=torch.int64)
  assert_close(bt.eye(n, m, dtype=bt.int64), want)


def test_like_functions():
  x = bt.tensor([[1, 2, 3]], dtype=bt.int32)
  for name in ("zeros_like", "ones_like", "empty_like"):
    y = getattr(bt, name)(x)
    assert y.shape == x.shape and y.dtype is bt.int32
  assert bt.full_like(x, 7).tolist() == [[7, 7, 7]]
  assert bt.zeros_like(x, dtype=bt.float16).dtype is bt.float16
  f = bt.randn(2, 3)
  assert bt.rand_like(f).shape == (2, 3) and bt.randn_like(f, dtype=bt.float64).dtype is bt.float64
  assert bt.ones_like(f, requires_grad=True).requires_grad


def test_empty_takes_pytorchs_arguments_and_is_writable():
  assert bt.empty(2, 3).shape == (2, 3) and bt.empty((2, 3)).dtype is bt.float32
  assert bt.empty(size=(4,), dtype=bt.bfloat16).dtype is bt.bfloat16 and bt.empty(0, 5).numel() == 0
  assert bt.empty(3, requires_grad=True).requires_grad
  x = bt.randn(2, 3, 4, 5).contiguous(memory_format=bt.channels_last)
  like = bt.empty_like(x)
  assert like.shape == x.shape and like.stride() == x.stride(), "empty_like keeps x's dense layout"
  like.copy_(x)
  np.testing.assert_array_equal(like.numpy(), x.numpy())
  with pytest.raises(ValueError, match="negative dimension"): bt.empty(2, -1)


def test_rand_randn_statistics():
  u = bt.rand(200_000).numpy()
  assert u.dtype == np.float32 and 0 <= u.min() and u.max() < 1
  assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
  n = bt.randn(200_000).numpy().astype(np.float64)
  assert abs(n.mean()) < 0.01 and abs(n.std() - 1) < 0.01
  assert abs(((n - n.mean()) ** 3).mean()) < 0.03 and abs((n ** 4).mean() - 3) < 0.1
  h = bt.randn(1000, dtype=bt.bfloat16)
  assert h.dtype is bt.bfloat16 and abs(h.float().mean().item()) < 0.1
  assert bt.randn(2, 3).shape == (2, 3) and bt.rand((4,)).shape == (4,)


def test_random_seeding():
  bt.manual_seed(1234)
  a, b = bt.randn(5), bt.rand(3)
  bt.manual_seed(1234)
  assert bt.randn(5).tolist() == a.tolist() and bt.rand(3).tolist() == b.tolist()
  assert bt.randn(5).tolist() != a.tolist()  # the generator advances
  g1, g2 = bt.Generator().manual_seed(7), bt.Generator().manual_seed(7)
  x = bt.randn(4, generator=g1)
  bt.randn(10)  # draws from the default generator do not disturb g2
  assert x.tolist() == bt.randn(4, generator=g2).tolist()
  assert bt.randn(4, generator=g1).tolist() != x.tolist()
  state = g1.get_state()
  y = bt.rand(6, generator=g1)
  g1.set_state(state)
  assert bt.rand(6, generator=g1).tolist() == y.tolist()
  assert bt.Generator().manual_seed(8).initial_seed() == 8
  seeded = lambda s: bt.randn(4, generator=bt.Generator().manual_seed(s)).tolist()
  assert seeded(7) != seeded(9)


def test_randint():
  x = bt.randint(3, 9, (10_000,))
  v = x.numpy()
  assert x.dtype is bt.int64 and v.min() == 3 and v.max() == 8
  counts = np.bincount(v - 3)
  assert counts.min() > 10_000 / 6 * 0.85
  assert bt.randint(5, (2, 3)).shape == (2, 3) and bt.randint(5, (2, 3)).numpy().max() < 5
  assert bt.randint(0, 4, (5,), dtype=bt.int32).dtype is bt.int32
  with pytest.raises(ValueError, match="randint"): bt.randint(5, 5, (2,))
  bt.manual_seed(3)
  a = bt.randint(0, 100, (8,))
  bt.manual_seed(3)
  assert bt.randint(0, 100, (8,)).tolist() == a.tolist()


# *** views share storage ***

VIEWS = {
  "view": lambda x: x.view(4, 6),
  "view_infer": lambda x: x.view(-1),
  "reshape": lambda x: x.reshape(2, 12),
  "permute": lambda x: x.permute(2, 0, 1),
  "transpose": lambda x: x.transpose(0, 2),
  "T": lambda x: x[0].T,
  "expand": lambda x: x[:, :1].expand(2, 5, 4),
  "slice": lambda x: x[1, 1:, ::2],
  "squeeze": lambda x: x[:, :1].squeeze(1),
  "unsqueeze": lambda x: x.unsqueeze(1),
  "flatten": lambda x: x.flatten(1),
  "narrow": lambda x: x.narrow(2, 1, 2),
  "split": lambda x: x.split(1, dim=1)[2],
  "chunk": lambda x: x.chunk(2, dim=2)[1],
  "unbind": lambda x: x.unbind(2)[3],
  "select": lambda x: x[-1],
  "view_of_transpose": lambda x: x.transpose(1, 2).unsqueeze(0).view(1, 2, 4, 3),
  "unflatten": lambda x: x.unflatten(2, (2, 2)),
}


@pytest.mark.parametrize("name", VIEWS)
def test_view_shares_storage(name):
  fn = VIEWS[name]
  data = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
  x, t = bt.tensor(data), torch.tensor(data)
  v, tv = fn(x), fn(t)
  assert_close(v, tv)
  assert v._storage is x._storage
  assert v.stride() == tv.stride() and v.storage_offset() == tv.storage_offset(), \
    f"strides {v.stride()} offset {v.storage_offset()} != torch's {tv.stride()} {tv.storage_offset()}"
  assert v.is_contiguous() == tv.is_contiguous()
  if name != "expand":  # writes through an expanded view alias one element many times
    v.mul_(-1.0); tv.mul_(-1.0)
    assert_close(x, t)  # write through the view, read through the base
  x.add_(100.0); t.add_(100.0)
  assert_close(v, tv)  # write through the base, read through the view


def test_view_chains_match_torch_strides():
  data = np.arange(120, dtype=np.float32).reshape(2, 3, 4, 5)
  chains = [lambda x: x.permute(0, 2, 1, 3).flatten(2), lambda x: x[:, 1:, ::2].unsqueeze(-1).squeeze(0),
            lambda x: x.transpose(1, 3)[0, ::2].mT, lambda x: x.view(6, 20)[1::2, 3:].unsqueeze(0),
            lambda x: x.expand(3, 2, 3, 4, 5).transpose(0, 1)[1].flatten(0, 1),
            lambda x: x[..., None, 2].view(2, 3, 4), lambda x: x[:, :, 1:3].reshape(6, 2, 5),
            lambda x: x.unsqueeze(2).expand(2, 3, 7, 4, 5)[:, :, 2], lambda x: x[0, 0, 0].view(5, 1).squeeze()]
  for fn in chains:
    v, tv = fn(bt.tensor(data)), fn(torch.tensor(data))
    assert_close(v, tv)
    assert v.stride() == tv.stride() and v.storage_offset() == tv.storage_offset(), (v.stride(), tv.stride())


@st.composite
def _view_case(draw):
  shape = tuple(draw(st.lists(st.integers(0, 4), min_size=1, max_size=4)))
  perm = draw(st.permutations(range(len(shape))))
  start = [draw(st.integers(0, max(n - 1, 0))) for n in shape]
  step = [draw(st.integers(1, 2)) for _ in shape]
  new = draw(st.lists(st.integers(1, 4), max_size=4))
  return shape, perm, start, step, new


@given(_view_case())
def test_view_strides_property(case):
  """Slice, permute, then view to a random shape: blutrain views exactly when torch does, with torch's strides."""
  shape, perm, start, step, new = case
  n = int(np.prod(shape))
  key = tuple(slice(a, None, s) for a, s in zip(start, step))
  t = torch.arange(float(n)).reshape(shape)[key].permute(*perm)
  x = bt.arange(float(n)).reshape(shape)[key].permute(*perm)
  assert x.stride() == t.stride() and x.storage_offset() == t.storage_offset()
  target = tuple(new) + (-1,) if t.numel() and t.numel() % max(int(np.prod(new)), 1) == 0 else (-1,)
  try: tv = t.view(target)
  except RuntimeError: tv = None
  if tv is None:
    with pytest.raises(RuntimeError, match="view"): x.view(target)
  else:
    xv = x.view(target)
    assert xv.shape == tuple(tv.shape) and xv.tolist() == tv.tolist()
    if tv.numel() > 1: assert xv.stride() == tv.stride(), (x.shape, x.stride(), target, xv.stride(), tv.stride())
  r = x.reshape(target)
  assert r.tolist() == t.reshape(target).tolist()


def test_basic_indexing_strides_match_torch():
  """Strides agree with torch's except on size-1 dims, whose stride is arbitrary (torch derives it from the
  indexing steps, blutrain from the layout rule of `view` when None and int indices reshape the result)."""
  from tests.test_ops import BASIC_KEYS
  data = np.arange(120, dtype=np.float32).reshape(4, 5, 6)
  for key in BASIC_KEYS + [(slice(None, None, 2), 0, None), (0, 0, slice(None, None, 4)), (None, None, 3)]:
    for base in (lambda m: m, lambda m: m.transpose(0, 2), lambda m: m[:, ::2]):
      v, tv = base(bt.tensor(data))[key], base(torch.tensor(data))[key]
      assert_close(v, tv)
      assert v.storage_offset() == tv.storage_offset() and v.is_contiguous() == tv.is_contiguous()
      assert [s for s, n in zip(v.stride(), v.shape) if n != 1] == [s for s, n in zip(tv.stride(), tv.shape) if n != 1], \
        (key, v.stride(), tv.stride())


def test_reshape_noncontiguous_copies():
  x = bt.arange(12.0).reshape(3, 4)
  xt = x.T
  assert not xt.is_contiguous()
  r = xt.reshape(12)
  assert r._storage is not x._storage
  assert r.tolist() == torch.arange(12.0).reshape(3, 4).T.reshape(12).tolist()
  with pytest.raises(RuntimeError, match="view"): xt.view(12)
  c = xt.contiguous()
  assert c.is_contiguous() and c._storage is not x._storage and c.stride() == (3, 1)
  assert x.contiguous() is x
  assert xt.reshape(4, 3) is xt
  y = x[:, 1:3]
  assert y.reshape(6)._storage is not x._storage and y.reshape(3, 2, 1)._storage is x._storage


def test_squeeze_unsqueeze_dims():
  x = bt.zeros(1, 3, 1, 2)
  t = torch.zeros(1, 3, 1, 2)
  for args in [(), (0,), (2,), (-2,), (1,), ((0, 2),)]:
    assert x.squeeze(*args).shape == tuple(t.squeeze(*args).shape)
  for d in (0, 2, 4, -1, -5):
    assert x.unsqueeze(d).shape == tuple(t.unsqueeze(d).shape)
  assert bt.tensor(3.0).unsqueeze(0).shape == (1,) and bt.tensor(3.0).squeeze().shape == ()


def test_size_and_properties():
  x = bt.zeros(2, 3, 4)
  assert x.size() == (2, 3, 4) and x.size(-1) == 4 and x.dim() == 3 and x.ndim == 3 and x.numel() == 24
  assert x.element_size() == 4 and x.stride(0) == 12 and len(x) == 2 and x.is_floating_point()
  assert not bt.zeros(2, dtype=bt.int64).is_floating_point() and x.device == bt.device("cpu")
  assert x.mT.shape == (2, 4, 3) and bt.zeros(2, 3).t().shape == (3, 2)
  with pytest.raises(IndexError, match="dimension"): x.size(3)
  with pytest.raises(TypeError): len(bt.tensor(1.0))


# *** conversion and host interop ***

@pytest.mark.parametrize("src", [bt.float32, bt.float64, bt.float16, bt.bfloat16, bt.int32, bt.int64, bt.bool])
def test_to_dtype(src):
  data = np.array([[-2.7, 0.0, 1.5], [3.49, -0.5, 250.0]])
  for dst in (bt.float32, bt.float64, bt.float16, bt.bfloat16, bt.int32, bt.int64, bt.bool):
    x = bt.tensor(data, dtype=src)
    t = torch.tensor(data, dtype=TORCH_DTYPES[src])
    assert_close(x.to(dst), t.to(TORCH_DTYPES[dst]))
  x = bt.tensor(data, dtype=src)
  assert x.to(src) is x and x.to(x) is x
  assert x.float().dtype is bt.float32 and x.double().dtype is bt.float64 and x.half().dtype is bt.float16
  assert x.long().dtype is bt.int64 and x.int().dtype is bt.int32 and x.bool().dtype is bt.bool
  assert x.to("cpu", bt.bfloat16).dtype is bt.bfloat16 and x.to(dtype=bt.int32).dtype is bt.int32
  assert x.type_as(bt.zeros(1, dtype=bt.float16)).dtype is bt.float16


def test_numpy_shares_memory():
  x = bt.zeros(2, 3)
  a = x.numpy()
  a[0, 1] = 5.0
  assert x[0, 1].item() == 5.0
  arr = np.arange(6, dtype=np.float32).reshape(2, 3)
  y = bt.from_numpy(arr)
  arr[1, 2] = -1.0
  assert y[1, 2].item() == -1.0
  y.add_(1.0)
  assert arr[0, 0] == 1.0
  for dt in (np.float16, np.float64, np.int32, np.int64, np.bool_):
    assert bt.from_numpy(np.zeros(2, dt)).dtype is bt.dtypes.to_dtype(dt)
  with pytest.raises(RuntimeError, match="requires grad"): bt.zeros(2, requires_grad=True).numpy()
  with pytest.raises(TypeError): bt.from_numpy([1, 2])
  assert bt.tensor(np.ones(3, np.float64)).numpy().dtype == np.float64
  t = bt.arange(6.0).reshape(2, 3).T
  np.testing.assert_array_equal(t.numpy(), np.arange(6.0).reshape(2, 3).T)


def test_from_numpy_keeps_strides_and_shares_memory():
  a = np.arange(24, dtype=np.float32).reshape(4, 6)
  for view in (lambda m: m.T, lambda m: m[:, ::2], lambda m: m[1:, 2:5]):
    x, t = bt.from_numpy(view(a)), torch.from_numpy(view(a))
    assert x.stride() == t.stride() and x.tolist() == t.tolist()
  assert bt.from_numpy(np.broadcast_to(a[0], (3, 6))).stride() == (0, 1)
  x = bt.from_numpy(a.T)
  a[0, 1] = -1.0
  assert x[1, 0].item() == -1.0
  x[2, 3] = 5.0
  assert a[3, 2] == 5.0
  assert bt.tensor(a.T).stride() == (4, 1)  # tensor() copies into a contiguous layout, as torch.tensor
  with pytest.raises(ValueError, match="negative"): bt.from_numpy(a[::-1])
  tt = torch.arange(12.0).reshape(3, 4)[:, 1::2]
  d = bt.from_dlpack(tt)
  tt[0, 0] = 42.0
  assert d.stride() == tt.stride() and d[0, 0].item() == 42.0


def test_item_tolist():
  assert bt.tensor(2.5).item() == 2.5 and isinstance(bt.tensor(3).item(), int) and bt.tensor(True).item() is True
  assert bt.tensor([[1.5]]).item() == 1.5
  with pytest.raises(RuntimeError, match="elements"): bt.tensor([1.0, 2.0]).item()
  x = bt.tensor([[1, 2], [3, 4]])
  assert x.tolist() == [[1, 2], [3, 4]] and x.T.tolist() == [[1, 3], [2, 4]]
  assert bt.tensor(1.0).tolist() == 1.0 and bt.zeros(0, 2).tolist() == []
  assert float(bt.tensor(2.0)) == 2.0 and int(bt.tensor(3.7)) == 3 and bool(bt.tensor(1))
  assert [2, 3, 4][bt.tensor(1)] == 3
  with pytest.raises(RuntimeError, match="ambiguous"): bool(bt.tensor([1, 2]))
  assert bt.zeros(2, requires_grad=True).tolist() == [0.0, 0.0]
  assert bt.tensor([1.0], dtype=bt.bfloat16).item() == 1.0


def test_data_ptr_is_the_first_elements_address_as_torchs():
  """data_ptr: a view's is its storage's plus its offset in bytes (PyTorch's figure for the same view), views of one
  storage at one offset share it, a copy has its own, an empty tensor's is 0; numpy agrees for shared memory."""
  a = np.arange(24, dtype=np.float32).reshape(4, 6)
  x, t = bt.from_numpy(a), torch.from_numpy(a)
  for view, tview in ((x, t), (x[1:, 2:], t[1:, 2:]), (x.T[3], t.T[3]), (x.reshape(6, 4)[2], t.reshape(6, 4)[2])):
    assert view.data_ptr() - x.data_ptr() == tview.data_ptr() - t.data_ptr(), view.shape
  assert x.data_ptr() == a.ctypes.data and x[0].data_ptr() == x.data_ptr() and x.clone().data_ptr() != x.data_ptr()
  assert bt.zeros(0, 3).data_ptr() == 0 and x[:, 6:].data_ptr() == 0


@pytest.mark.parametrize("dt", [bt.float32, bt.float64, bt.float16, bt.int32, bt.int64, bt.bool])
def test_dlpack_round_trip(dt):
  x = bt.tensor([[1, 0, 3], [4, 5, 0]], dtype=dt)
  n = np.from_dlpack(x)
  np.testing.assert_array_equal(n, x.numpy())
  t = torch.from_dlpack(x)
  assert_close(x, t)
  back = bt.from_dlpack(t)
  assert back.dtype is dt and back.tolist() == x.tolist()
  back2 = bt.from_dlpack(n)
  assert back2.dtype is dt
  if dt is bt.float32:
    t[0, 0] = 9.0  # zero copy both ways
    assert x[0, 0].item() == 9.0 and back[0, 0].item() == 9.0
    tt = torch.arange(6.0).reshape(2, 3).T
    assert bt.from_dlpack(tt).tolist() == tt.tolist()


def test_dlpack_bfloat16_raises():
  with pytest.raises(TypeError, match="bfloat16"): np.from_dlpack(bt.zeros(2, dtype=bt.bfloat16))
  with pytest.raises(TypeError, match="bfloat16"): torch.from_dlpack(bt.zeros(2, dtype=bt.bfloat16))


@pytest.mark.parametrize("make", [
  lambda lib: lib.tensor([1.0, 2.5, -3.0]), lambda lib: lib.tensor([[1, 2], [3, 4]]), lambda lib: lib.tensor(2.5),
  lambda lib: lib.tensor([True, False]), lambda lib: lib.tensor([1.0, 2.0], dtype=lib.float64),
  lambda lib: lib.tensor([1.5, 2.0], dtype=lib.float16), lambda lib: lib.zeros(0, 3),
  lambda lib: lib.tensor([], dtype=lib.int64),
  lambda lib: lib.tensor([1.0, 2.0], requires_grad=True), lambda lib: lib.tensor([1, 2], dtype=lib.int32)])
def test_repr_resembles_torch(make):
  got, want = repr(make(bt)), repr(make(torch))
  want = want.replace("torch.", "blutrain.")
  norm = lambda s: " ".join(s.replace(".0000", ".").replace("0.,", "0.").split())
  assert got.startswith("tensor(")
  for part in ("dtype=", "requires_grad=True", "size="): assert (part in got) == (part in want), f"{got} vs {want}"
  assert [s for s in norm(want).split() if "dtype" in s] == [s for s in norm(got).split() if "dtype" in s], f"{got} vs {want}"


def test_repr_values_and_grad_fn():
  x = bt.tensor([1.0, 2.0], requires_grad=True)
  assert "grad_fn=<" in repr(x * 2) and repr(bt.tensor([1.5, -2.0])) == "tensor([ 1.5, -2. ])"
  big = repr(bt.arange(1000.0))
  assert "..." in big and len(big) < 400


# *** dtype promotion ***

ALL_DTYPES = [bt.bool, bt.int32, bt.int64, bt.float16, bt.bfloat16, bt.float32, bt.float64]


@pytest.mark.parametrize("a", ALL_DTYPES)
def test_promote_types_matches_torch(a):
  for b in ALL_DTYPES:
    want = torch.promote_types(TORCH_DTYPES[a], TORCH_DTYPES[b])
    assert TORCH_DTYPES[bt.promote_types(a, b)] == want, f"promote_types({a}, {b})"


@pytest.mark.parametrize("a", ALL_DTYPES)
def test_result_type_matches_torch(a):
  ta = torch.ones(2, dtype=TORCH_DTYPES[a])
  xa = bt.ones(2, dtype=a)
  for b in ALL_DTYPES:
    tb, xb = torch.ones(2, dtype=TORCH_DTYPES[b]), bt.ones(2, dtype=b)
    t0, x0 = torch.ones((), dtype=TORCH_DTYPES[b]), bt.ones((), dtype=b)
    for args, targs in [((xa, xb), (ta, tb)), ((xa, x0), (ta, t0)), ((x0, xa), (t0, ta))]:
      assert TORCH_DTYPES[bt.result_type(*args)] == torch.result_type(*targs), f"result_type{tuple(x.dtype for x in args)}"
    assert_close(xa + x0, ta + t0)  # the operator follows the same rule
  for s in (True, 2, 2.5):
    assert TORCH_DTYPES[bt.result_type(xa, s)] == torch.result_type(ta, s), f"result_type({a}, {s!r})"
    t0 = torch.ones((), dtype=TORCH_DTYPES[a])
    assert TORCH_DTYPES[bt.result_type(bt.ones((), dtype=a), s)] == torch.result_type(t0, s)
    assert_close(xa * s, ta * s)
    if a is not bt.bool and s is not True: assert_close(s - xa, s - ta)


def test_result_type_three_tiers():
  i, h0, f = bt.ones(2, dtype=bt.int32), bt.ones((), dtype=bt.float16), 2.5
  assert bt.result_type(i, h0) is bt.float16 and bt.result_type(i, f) is bt.float32
  assert bt.result_type(bt.ones((), dtype=bt.float64), bt.ones(2, dtype=bt.float16)) is bt.float16
  assert bt.result_type(bt.ones((), dtype=bt.int64), bt.ones(2, dtype=bt.int32)) is bt.int32
  assert bt.result_type(2, 2.5) is bt.float32 and bt.result_type(True, 2) is bt.int64


def test_memory_formats_as_pytorch():
  """`contiguous(memory_format=...)`, `to(memory_format=...)` and `is_contiguous(memory_format=...)` give PyTorch's
  strides and answers, and the channels-last copy passes gradients back."""
  import torch
  rng = np.random.default_rng(0)
  a = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
  x, t = bt.tensor(a, requires_grad=True), torch.tensor(a)
  y, ty = x.contiguous(memory_format=bt.channels_last), t.contiguous(memory_format=torch.channels_last)
  assert y.stride() == ty.stride() and np.array_equal(y.detach().numpy(), ty.numpy())
  for fmt, tfmt in ((bt.channels_last, torch.channels_last), (bt.contiguous_format, torch.contiguous_format)):
    for u, tu in ((x, t), (y, ty), (x[:, :, :1, :1], t[:, :, :1, :1])):
      assert u.is_contiguous(memory_format=fmt) == tu.is_contiguous(memory_format=tfmt), (fmt, u.stride())
  assert x.to(memory_format=bt.channels_last).stride() == ty.stride()
  assert y.contiguous().stride() == x.stride() and y.contiguous(memory_format=bt.channels_last) is y
  v = bt.tensor(rng.standard_normal((2, 3, 4, 5, 6)).astype(np.float32))
  assert v.contiguous(memory_format=bt.channels_last_3d).stride() == \
    torch.zeros(2, 3, 4, 5, 6).contiguous(memory_format=torch.channels_last_3d).stride()
  (y * bt.tensor(a)).sum().backward()
  assert np.array_equal(x.grad.numpy(), a)
  with pytest.raises(RuntimeError, match="channels_last needs a tensor of 4 dims"):
    bt.zeros(2, 3, 4).contiguous(memory_format=bt.channels_last)


def test_elementwise_results_keep_their_inputs_layout_as_pytorch():
  """An elementwise op (unary, binary, with a scalar or a broadcast operand, a cast, where) on a channels-last or a
  transposed input gives PyTorch's strides and values on the CPU too, operands of two layouts the first one's;
  `contiguous()` stays row-major."""
  import torch
  a = np.random.default_rng(2).standard_normal((2, 3, 4, 5)).astype(np.float32)
  x, t = bt.tensor(a), torch.tensor(a)
  ops = {"exp": lambda m, u: u.exp(), "add": lambda m, u: u + u * 2, "scalar": lambda m, u: 1.5 - u,
         "broadcast": lambda m, u: u * m.arange(u.shape[-1]), "cast": lambda m, u: u.to(m.float64),
         "where": lambda m, u: m.where(u > 0, u, 0.0), "relu": lambda m, u: m.nn.functional.relu(u),
         "contiguous": lambda m, u: (u + 0).contiguous(), "first_laid_out": lambda m, u: u + u.contiguous(),
         "first_row_major": lambda m, u: u.contiguous() * u, "compare": lambda m, u: u > u.contiguous()}
  for u, tu in ((x.contiguous(memory_format=bt.channels_last), t.contiguous(memory_format=torch.channels_last)),
                (x.transpose(1, 3), t.transpose(1, 3))):
    for name, f in ops.items():
      got, want = f(bt, u), f(torch, tu)
      assert got.stride() == want.stride(), (name, u.stride(), got.stride(), want.stride())
      np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, err_msg=name)  # numpy's exp: an ulp off


@pytest.mark.parametrize("fn", ["zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"])
def test_like_functions_keep_a_dense_layout_as_pytorch(fn):
  """`*_like` keep a dense input's strides (channels-last, transposed; PyTorch's preserve_format), lay out a non-dense
  input row-major, and honour an explicit memory_format; values, dtype and requires_grad as asked."""
  import torch
  a = np.random.default_rng(1).standard_normal((2, 3, 4, 5)).astype(np.float32)
  x, t = bt.tensor(a), torch.tensor(a)
  args = (2.5,) if fn == "full_like" else ()
  cases = [(x.contiguous(memory_format=bt.channels_last), t.contiguous(memory_format=torch.channels_last), {}, {}),
           (x.transpose(1, 3), t.transpose(1, 3), {}, {}), (x[:, :, ::2], t[:, :, ::2], {}, {}),
           (x, t, dict(memory_format=bt.channels_last), dict(memory_format=torch.channels_last)),
           (x.contiguous(memory_format=bt.channels_last), t.contiguous(memory_format=torch.channels_last),
            dict(memory_format=bt.contiguous_format), dict(memory_format=torch.contiguous_format))]
  for u, tu, kw, tkw in cases:
    got, want = getattr(bt, fn)(u, *args, **kw), getattr(torch, fn)(tu, *args, **tkw)
    assert got.stride() == want.stride() and got.shape == tuple(want.shape), (fn, u.stride(), kw)
    if fn not in ("empty_like", "rand_like", "randn_like"): assert np.array_equal(got.numpy(), want.numpy())
  g = getattr(bt, fn)(x.contiguous(memory_format=bt.channels_last), *args, dtype=bt.float64, requires_grad=True)
  assert g.dtype is bt.float64 and g.requires_grad and g.is_leaf
  (g * 2).sum().backward()
  assert np.array_equal(g.grad.numpy(), np.full(a.shape, 2.0))
