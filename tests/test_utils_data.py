"""blutrain.utils.data against torch.utils.data: batches, collation, samplers, lengths and errors equal PyTorch's;
shuffling reproducible for a generator; worker processes give the single-process stream; drop_last."""
import collections
import os
import time

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import blutrain as bt
from blutrain.utils import data as bud
from tests.helpers import to_numpy

Point = collections.namedtuple("Point", "x y")


def same(got, want) -> None:
  """A blutrain batch equals a torch one: same structure, tensor shapes, dtypes and values."""
  if isinstance(want, torch.Tensor):
    assert isinstance(got, bt.Tensor), f"{type(got).__name__} where torch has a tensor"
    assert tuple(got.shape) == tuple(want.shape) and str(want.dtype).split(".")[-1] == got.dtype.name
    np.testing.assert_array_equal(to_numpy(got), to_numpy(want))
  elif isinstance(want, dict):
    assert isinstance(got, dict) and list(got) == list(want)
    for k in want: same(got[k], want[k])
  elif isinstance(want, (list, tuple)):
    assert type(got) is type(want) or (type(want).__name__ == type(got).__name__), (type(got), type(want))
    assert len(got) == len(want)
    for g, w in zip(got, want): same(g, w)
  else:
    assert got == want


def samples(seed=0):
  rng = np.random.default_rng(seed)
  return [{"img": rng.standard_normal((2, 3)).astype(np.float32), "label": int(rng.integers(10)), "w": float(rng.random()),
           "ok": bool(rng.random() < 0.5), "name": f"s{i}", "pair": (i, float(i) / 2), "pt": Point(i, [i, i + 1])}
          for i in range(7)]


def torch_view(s):
  return {**s, "img": torch.from_numpy(s["img"])}


def bt_view(s):
  return {**s, "img": bt.tensor(s["img"])}


@pytest.mark.parametrize("batch_size,drop_last", [(1, False), (3, False), (3, True), (7, True), (10, False)])
def test_default_collate_and_batching_equal_torch(batch_size, drop_last):
  data = samples()
  want = list(tud.DataLoader([torch_view(s) for s in data], batch_size=batch_size, drop_last=drop_last))
  loader = bud.DataLoader([bt_view(s) for s in data], batch_size=batch_size, drop_last=drop_last)
  got = list(loader)
  assert len(loader) == len(want) == len(got)
  for g, w in zip(got, want): same(g, w)


def test_numpy_samples_and_unbatched_loading_equal_torch():
  arrays = [np.arange(6, dtype=np.int32).reshape(2, 3) + i for i in range(4)]
  same(list(bud.DataLoader(arrays, batch_size=2)), list(tud.DataLoader(arrays, batch_size=2)))
  same(list(bud.DataLoader(arrays, batch_size=None)), list(tud.DataLoader(arrays, batch_size=None)))
  pairs = [(np.float64(i), i) for i in range(3)]
  same(list(bud.DataLoader(pairs, batch_size=None)), list(tud.DataLoader(pairs, batch_size=None)))


def test_collate_errors_match_torch():
  with pytest.raises(RuntimeError, match="equal size"): bud.default_collate([[1, 2], [3]])
  with pytest.raises(RuntimeError, match="equal size"): tud.default_collate([[1, 2], [3]])
  with pytest.raises(TypeError, match="object"): bud.default_collate([object(), object()])


def test_tensor_dataset_subset_concat_and_non_contiguous():
  x = bt.randn(6, 4).T  # (4, 6), non-contiguous
  y = bt.arange(4)
  ds = bud.TensorDataset(x, y)
  assert len(ds) == 4
  xb, yb = next(iter(bud.DataLoader(ds, batch_size=4)))
  np.testing.assert_array_equal(xb.numpy(), x.numpy())
  np.testing.assert_array_equal(yb.numpy(), [0, 1, 2, 3])
  sub = bud.Subset(ds, [3, 1])
  assert [int(s[1]) for s in sub] == [3, 1] and len(sub) == 2
  cat = ds + sub
  assert len(cat) == 6 and int(cat[5][1]) == 1 and int(cat[-1][1]) == 1
  with pytest.raises(ValueError, match="Size mismatch"): bud.TensorDataset(bt.zeros(3), bt.zeros(4))


def test_random_split_lengths_fractions_and_reproducibility():
  ds = list(range(10))
  a = bud.random_split(ds, [3, 7], generator=bt.Generator().manual_seed(1))
  b = bud.random_split(ds, [3, 7], generator=bt.Generator().manual_seed(1))
  assert [list(s) for s in a] == [list(s) for s in b] and [len(s) for s in a] == [3, 7]
  assert sorted(list(a[0]) + list(a[1])) == ds
  assert [len(s) for s in bud.random_split(ds, [0.33, 0.33, 0.34])] == \
    [len(s) for s in tud.random_split(ds, [0.33, 0.33, 0.34])]
  with pytest.raises(ValueError, match="Sum of input lengths"): bud.random_split(ds, [3, 3])


def test_shuffle_is_a_permutation_reproducible_with_a_generator_and_new_each_epoch():
  ds = bud.TensorDataset(bt.arange(20))
  order = lambda loader: [int(i) for (b,) in loader for i in b]
  l1 = bud.DataLoader(ds, batch_size=6, shuffle=True, generator=bt.Generator().manual_seed(5))
  l2 = bud.DataLoader(ds, batch_size=6, shuffle=True, generator=bt.Generator().manual_seed(5))
  e1, e2 = order(l1), order(l1)
  assert sorted(e1) == list(range(20)) and e1 != list(range(20)) and e1 != e2
  assert order(l2) == e1 and order(l2) == e2
  assert order(bud.DataLoader(ds, batch_size=6)) == list(range(20))


def test_samplers_and_batch_sampler_equal_torch():
  assert list(bud.SequentialSampler(range(5))) == list(tud.SequentialSampler(range(5)))
  for n, bs, drop in [(10, 3, False), (10, 3, True), (9, 3, True), (2, 5, False)]:
    got, want = bud.BatchSampler(range(n), bs, drop), tud.BatchSampler(range(n), bs, drop)
    assert list(got) == list(want) and len(got) == len(want)
  r = bud.RandomSampler(range(5), replacement=True, num_samples=12, generator=bt.Generator().manual_seed(0))
  draws = list(r)
  assert len(draws) == len(r) == 12 and set(draws) <= set(range(5))
  long = list(bud.RandomSampler(range(4), num_samples=10, generator=bt.Generator().manual_seed(0)))
  assert sorted(long[:4]) == sorted(long[4:8]) == [0, 1, 2, 3] and len(long) == 10
  assert sorted(bud.SubsetRandomSampler([5, 7, 9])) == [5, 7, 9]
  batches = list(bud.DataLoader(list(range(10)), batch_sampler=[[0, 4], [9]]))
  same(batches, list(tud.DataLoader(list(range(10)), batch_sampler=[[0, 4], [9]])))
  same(list(bud.DataLoader(list(range(6)), sampler=[5, 0, 2], batch_size=2)),
       list(tud.DataLoader(list(range(6)), sampler=[5, 0, 2], batch_size=2)))


@pytest.mark.parametrize("kwargs,err", [
  (dict(batch_size=0), ValueError), (dict(num_workers=-1), ValueError), (dict(sampler=[0], shuffle=True), ValueError),
  (dict(batch_sampler=[[0]], batch_size=2), ValueError), (dict(batch_size=None, drop_last=True), ValueError),
  (dict(prefetch_factor=2), ValueError)])
def test_bad_loader_options_raise_like_torch(kwargs, err):
  with pytest.raises(err): tud.DataLoader(list(range(4)), **kwargs)
  with pytest.raises(err): bud.DataLoader(list(range(4)), **kwargs)


class Squares(bud.Dataset):
  """Sample i is (i, i^2 as a tensor, a draw from the worker's default generator)."""

  def __len__(self): return 13
  def __getitem__(self, i): return i, bt.tensor([float(i * i)]), bt.rand(1)


class Broken(bud.Dataset):
  def __len__(self): return 4
  def __getitem__(self, i):
    if i == 2: raise KeyError(f"sample {i} is missing")
    return i


def test_workers_give_the_single_process_stream():
  gen = lambda: bt.Generator().manual_seed(3)
  one = list(bud.DataLoader(Squares(), batch_size=3, shuffle=True, generator=gen(), drop_last=True))
  two = list(bud.DataLoader(Squares(), batch_size=3, shuffle=True, generator=gen(), drop_last=True, num_workers=2))
  three = list(bud.DataLoader(Squares(), batch_size=3, shuffle=True, generator=gen(), drop_last=True, num_workers=3,
                              prefetch_factor=1))
  assert len(one) == len(two) == len(three) == 4
  for a, b, c in zip(one, two, three):
    assert a[0].tolist() == b[0].tolist() == c[0].tolist()
    np.testing.assert_array_equal(a[1].numpy(), b[1].numpy())
  # each worker seeds its generator from the loader's base seed: a second run repeats the draws, workers differ
  again = list(bud.DataLoader(Squares(), batch_size=3, shuffle=True, generator=gen(), drop_last=True, num_workers=2))
  assert all(np.array_equal(a[2].numpy(), b[2].numpy()) for a, b in zip(two, again))
  assert not np.array_equal(two[0][2].numpy(), two[1][2].numpy())


def test_worker_info_init_fn_and_iterable_dataset_sharding_equal_torch():
  class TorchStream(tud.IterableDataset):
    def __iter__(self):
      w = tud.get_worker_info()
      return iter(range(w.id, 11, w.num_workers) if w else range(11))

  class Stream(bud.IterableDataset):
    def __iter__(self):
      w = bud.get_worker_info()
      return iter(range(w.id, 11, w.num_workers) if w else range(11))

  for workers in (0, 2, 3):
    for bs, drop in ((2, False), (2, True), (None, False)):
      want = list(tud.DataLoader(TorchStream(), batch_size=bs, drop_last=drop, num_workers=workers))
      same(list(bud.DataLoader(Stream(), batch_size=bs, drop_last=drop, num_workers=workers)), want)
  assert bud.get_worker_info() is None
  ids = list(bud.DataLoader(list(range(4)), batch_size=1, num_workers=2, collate_fn=lambda b: bud.get_worker_info().id))
  assert ids == [0, 1, 0, 1]
  draws = list(bud.DataLoader(list(range(2)), batch_size=1, num_workers=2, worker_init_fn=lambda w: bt.manual_seed(7 + w),
                              collate_fn=lambda b: bt.rand(1).item()))
  assert draws == [bt.rand(1, generator=bt.Generator().manual_seed(7 + w)).item() for w in (0, 1)]
  with pytest.raises(ValueError, match="IterableDataset"): bud.DataLoader(Stream(), shuffle=True)


def test_a_worker_error_reaches_the_main_process_with_its_type():
  with pytest.raises(KeyError, match="sample 2 is missing"): list(bud.DataLoader(Broken(), num_workers=2))
  with pytest.raises(KeyError, match="sample 2 is missing"): list(bud.DataLoader(Broken()))


def test_pin_memory_keeps_cpu_batches():
  (b,) = list(bud.DataLoader(bud.TensorDataset(bt.arange(3)), batch_size=3, pin_memory=True))
  assert b[0].device == bt.device("cpu") and b[0].tolist() == [0, 1, 2]


def test_leaving_a_loader_early_stops_its_workers_promptly():
  ds = bud.TensorDataset(bt.randn(400, 64, 64))
  it = iter(bud.DataLoader(ds, batch_size=50, num_workers=2, prefetch_factor=4))
  next(it)
  workers, start = list(it.workers), time.monotonic()
  it.close()  # what dropping the iterator does; unread batches must not keep a worker waiting to flush its queue
  assert not any(p.is_alive() for p in workers) and time.monotonic() - start < 4.0


def test_persistent_workers_keep_their_processes_and_the_stream():
  gen = lambda: bt.Generator().manual_seed(4)
  ref = bud.DataLoader(Squares(), batch_size=4, shuffle=True, generator=gen())
  loader = bud.DataLoader(Squares(), batch_size=4, shuffle=True, generator=gen(), num_workers=2, persistent_workers=True)
  want = [[b[0].tolist() for b in ref] for _ in range(3)]
  first = iter(loader)
  assert [b[0].tolist() for b in first] == want[0]
  pids = [p.pid for p in loader._workers.workers]
  next(iter(loader))  # an epoch left after one batch: its unread batches are dropped at the next epoch
  assert [b[0].tolist() for b in loader] == want[2] and [p.pid for p in loader._workers.workers] == pids
  class Stream(bud.IterableDataset):
    def __iter__(self):
      w = bud.get_worker_info()
      return iter(range(w.id, 7, w.num_workers))
  streams = bud.DataLoader(Stream(), batch_size=2, num_workers=2, persistent_workers=True)
  assert [b.tolist() for b in streams] == [b.tolist() for b in streams] == [[0, 2], [1, 3], [4, 6], [5]]
  with pytest.raises(ValueError, match="persistent_workers option needs num_workers > 0"):
    bud.DataLoader(Squares(), persistent_workers=True)


class Dies(bud.Dataset):
  def __len__(self): return 4
  def __getitem__(self, i):
    if i == 1: os._exit(3)  # a worker killed mid-epoch (as by the out-of-memory killer)
    return i


class Slow(bud.Dataset):
  def __len__(self): return 2
  def __getitem__(self, i):
    time.sleep(1.5)
    return i


def test_a_dead_or_slow_worker_is_an_error_not_a_hang():
  with pytest.raises(RuntimeError, match="exited unexpectedly with exit code 3"): list(bud.DataLoader(Dies(), num_workers=2))
  with pytest.raises(RuntimeError, match="timed out after 0.3 seconds"): list(bud.DataLoader(Slow(), num_workers=1, timeout=0.3))
