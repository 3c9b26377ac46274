"""`torch.utils.data`: datasets, samplers, collation and the DataLoader, with worker processes.

A map-style `Dataset` answers `dataset[i]`; an `IterableDataset` is a stream. A sampler yields indices, a
`BatchSampler` lists of them; the DataLoader fetches each list, collates it (`default_collate` stacks tensors,
numbers, dicts and sequences as PyTorch's does) and yields batches. With `num_workers > 0`, batch k is made by
worker k % num_workers and batches are read back in that same order, so the stream equals the single-process one.
Each worker seeds Python's `random`, numpy and blutrain's default generator from `base_seed + worker_id`, where
`base_seed` is drawn from the loader's `generator` at each new iterator (as PyTorch's).
"""
from __future__ import annotations

import bisect
import collections
import collections.abc as cabc
import itertools
import math
import multiprocessing
import queue
import random
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from blutrain import dtypes, ops
from blutrain.ops import Generator
from blutrain.tensor import Tensor

T = TypeVar("T")

__all__ = ["Dataset", "IterableDataset", "TensorDataset", "ConcatDataset", "Subset", "random_split", "Sampler",
           "SequentialSampler", "RandomSampler", "SubsetRandomSampler", "BatchSampler", "DataLoader",
           "default_collate", "default_convert", "get_worker_info"]


# *** datasets ***

class Dataset(Generic[T]):
  """A map-style dataset: subclasses define `__getitem__(index)` and usually `__len__`."""

  def __getitem__(self, index: int) -> T: raise NotImplementedError(f"{type(self).__name__} does not define __getitem__")
  def __add__(self, other: Dataset[T]) -> ConcatDataset[T]: return ConcatDataset([self, other])


class IterableDataset(Dataset[T]):
  """A dataset that is a stream: subclasses define `__iter__`. With worker processes each worker iterates its own
  copy, so a dataset that should not repeat splits its stream by `get_worker_info()`."""

  def __iter__(self) -> Iterator[T]: raise NotImplementedError(f"{type(self).__name__} does not define __iter__")


class TensorDataset(Dataset[tuple[Tensor, ...]]):
  """Sample i is (t[i] for t in tensors); every tensor has the same first dimension."""

  def __init__(self, *tensors: Tensor) -> None:
    if not tensors or any(t.shape[:1] != tensors[0].shape[:1] for t in tensors):
      raise ValueError(f"Size mismatch between tensors: TensorDataset needs tensors with one first dimension, got "
                       f"shapes {[tuple(t.shape) for t in tensors]}")
    self.tensors = tensors

  def __getitem__(self, index: int) -> tuple[Tensor, ...]: return tuple(t[index] for t in self.tensors)
  def __len__(self) -> int: return self.tensors[0].shape[0]


class ConcatDataset(Dataset[T]):
  """The datasets one after another."""

  def __init__(self, datasets: Iterable[Dataset[T]]) -> None:
    self.datasets = list(datasets)
    if not self.datasets: raise ValueError("datasets should not be an empty iterable")
    if any(isinstance(d, IterableDataset) for d in self.datasets):
      raise TypeError("ConcatDataset does not support IterableDataset")
    self.cumulative_sizes = list(itertools.accumulate(len(d) for d in self.datasets))

  def __len__(self) -> int: return self.cumulative_sizes[-1]

  def __getitem__(self, index: int) -> T:
    if index < 0:
      if -index > len(self): raise ValueError("absolute value of index should not exceed dataset length")
      index += len(self)
    d = bisect.bisect_right(self.cumulative_sizes, index)
    return self.datasets[d][index - (self.cumulative_sizes[d - 1] if d else 0)]


class Subset(Dataset[T]):
  """The samples of `dataset` at `indices`, in that order."""

  def __init__(self, dataset: Dataset[T], indices: Sequence[int]) -> None: self.dataset, self.indices = dataset, indices
  def __getitem__(self, index):
    if isinstance(index, list): return [self.dataset[self.indices[i]] for i in index]
    return self.dataset[self.indices[index]]
  def __len__(self) -> int: return len(self.indices)


def _permutation(n: int, generator: Generator | None) -> list[int]:
  """A random permutation of range(n) drawn from `generator` (the default one when None)."""
  keys = ops.rand(n, dtype=dtypes.float64, generator=generator).numpy()
  return np.argsort(keys, kind="stable").tolist()


def random_split(dataset: Dataset[T], lengths: Sequence[int | float], generator: Generator | None = None) -> list[Subset[T]]:
  """Split into non-overlapping random subsets of the given lengths, or fractions summing to 1 (the remainder of
  rounding goes round-robin to the first subsets, as PyTorch's)."""
  n = len(dataset)
  if math.isclose(sum(lengths), 1) and sum(lengths) <= 1:
    counts = [int(math.floor(n * f)) for f in lengths]
    for i in range(n - sum(counts)): counts[i % len(counts)] += 1
    lengths = counts
  if sum(lengths) != n:
    raise ValueError(f"Sum of input lengths ({sum(lengths)}) does not equal the length of the input dataset ({n})!")
  perm, ends = _permutation(n, generator), list(itertools.accumulate(lengths))
  return [Subset(dataset, perm[end - k:end]) for k, end in zip(lengths, ends)]


# *** samplers ***

class Sampler(Generic[T]):
  """Yields the indices (or, for a batch sampler, lists of indices) a DataLoader fetches."""

  def __iter__(self) -> Iterator[T]: raise NotImplementedError(f"{type(self).__name__} does not define __iter__")


class SequentialSampler(Sampler[int]):
  """0, 1, ..., len(data_source) - 1."""

  def __init__(self, data_source: Any) -> None: self.data_source = data_source
  def __iter__(self) -> Iterator[int]: return iter(range(len(self.data_source)))
  def __len__(self) -> int: return len(self.data_source)


class RandomSampler(Sampler[int]):
  """A random permutation of the indices each pass (or `num_samples` draws with replacement), from `generator`.

  The order is blutrain's own (a counter-based generator), reproducible for a seed but not PyTorch's numbers."""

  def __init__(self, data_source: Any, replacement: bool = False, num_samples: int | None = None,
               generator: Generator | None = None) -> None:
    if not isinstance(replacement, bool):
      raise TypeError(f"replacement should be a boolean value, but got replacement={replacement}")
    if num_samples is not None and (not isinstance(num_samples, int) or num_samples <= 0):
      raise ValueError(f"num_samples should be a positive integer value, but got num_samples={num_samples}")
    self.data_source, self.replacement, self._num_samples, self.generator = data_source, replacement, num_samples, generator

  @property
  def num_samples(self) -> int: return len(self.data_source) if self._num_samples is None else self._num_samples

  def __iter__(self) -> Iterator[int]:
    n = len(self.data_source)
    if self.replacement:
      yield from ops.randint(0, n, (self.num_samples,), generator=self.generator).tolist()
      return
    for _ in range(self.num_samples // n): yield from _permutation(n, self.generator)
    yield from _permutation(n, self.generator)[:self.num_samples % n]

  def __len__(self) -> int: return self.num_samples


class SubsetRandomSampler(Sampler[int]):
  """The given indices in a random order each pass."""

  def __init__(self, indices: Sequence[int], generator: Generator | None = None) -> None:
    self.indices, self.generator = indices, generator

  def __iter__(self) -> Iterator[int]:
    for i in _permutation(len(self.indices), self.generator): yield self.indices[i]

  def __len__(self) -> int: return len(self.indices)


class BatchSampler(Sampler[list[int]]):
  """Groups the indices of `sampler` into lists of `batch_size`; the last, shorter one is kept unless `drop_last`."""

  def __init__(self, sampler: Sampler[int] | Iterable[int], batch_size: int, drop_last: bool) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
      raise ValueError(f"batch_size should be a positive integer value, but got batch_size={batch_size}")
    if not isinstance(drop_last, bool):
      raise ValueError(f"drop_last should be a boolean value, but got drop_last={drop_last}")
    self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

  def __iter__(self) -> Iterator[list[int]]:
    it = iter(self.sampler)
    while batch := list(itertools.islice(it, self.batch_size)):
      if len(batch) < self.batch_size and self.drop_last: return
      yield batch

  def __len__(self) -> int:
    n = len(self.sampler)
    return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


# *** collation ***

def default_convert(data: Any) -> Any:
  """Numpy arrays and numbers to tensors, inside dicts and sequences too (the collation of unbatched loading)."""
  if isinstance(data, np.ndarray) and data.dtype.kind in "biuf": return ops.as_tensor(data)
  if isinstance(data, np.generic) and data.dtype.kind in "biuf": return ops.as_tensor(data)
  if isinstance(data, cabc.Mapping): return {k: default_convert(v) for k, v in data.items()}
  if isinstance(data, tuple) and hasattr(data, "_fields"): return type(data)(*(default_convert(d) for d in data))
  if isinstance(data, tuple): return [default_convert(d) for d in data]
  if isinstance(data, cabc.Sequence) and not isinstance(data, (str, bytes)): return [default_convert(d) for d in data]
  return data


def default_collate(batch: Sequence[Any]) -> Any:
  """A list of samples into one batch, as PyTorch's: tensors and numpy arrays are stacked along a new first dim,
  ints become an int64 tensor, floats a float64 one, bools a bool one; strings stay a list; a dict gives a dict of
  collated fields; a namedtuple the same type; other sequences a list of collated positions."""
  elem = batch[0]
  if isinstance(elem, Tensor): return ops.stack(list(batch), 0)
  if isinstance(elem, np.ndarray):
    if elem.dtype.kind not in "biuf": raise TypeError(f"default_collate: batch must contain tensors, numpy arrays, "
                                                      f"numbers, dicts or lists; found a numpy array of {elem.dtype}")
    return ops.stack([ops.as_tensor(b) for b in batch], 0)
  if isinstance(elem, np.generic) and elem.dtype.kind in "biuf": return ops.as_tensor(np.stack(batch))
  if isinstance(elem, bool): return ops.tensor(list(batch), dtype=dtypes.bool_)
  if isinstance(elem, int): return ops.tensor(list(batch), dtype=dtypes.int64)
  if isinstance(elem, float): return ops.tensor(list(batch), dtype=dtypes.float64)
  if isinstance(elem, (str, bytes)): return list(batch)
  if isinstance(elem, cabc.Mapping): return {k: default_collate([d[k] for d in batch]) for k in elem}
  if isinstance(elem, tuple) and hasattr(elem, "_fields"): return type(elem)(*(default_collate(s) for s in zip(*batch)))
  if isinstance(elem, cabc.Sequence):
    if any(len(e) != len(elem) for e in batch): raise RuntimeError("each element in list of batch should be of equal size")
    return [default_collate(list(s)) for s in zip(*batch)]
  raise TypeError(f"default_collate: batch must contain tensors, numpy arrays, numbers, dicts or lists; found "
                  f"{type(elem).__name__}")


# *** workers ***

@dataclass(frozen=True)
class WorkerInfo:
  """What `get_worker_info()` returns inside a worker process."""
  id: int
  num_workers: int
  seed: int
  dataset: Any


_worker_info: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
  """This worker's id, the number of workers, its seed and its copy of the dataset; None in the main process."""
  return _worker_info


class _Fetcher:
  """Turns one task into one batch: a list of indices for a map-style dataset, the next batch of a stream. A
  stream starts (`restart`) in the process that reads it, where get_worker_info() says which worker that is."""

  def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Callable, batch_size: int | None,
               drop_last: bool) -> None:
    self.dataset, self.auto, self.collate_fn, self.batch_size, self.drop_last = (dataset, auto_collation, collate_fn,
                                                                                  batch_size, drop_last)
    self.stream: Iterator | None = None

  def restart(self) -> None:
    if isinstance(self.dataset, IterableDataset): self.stream = iter(self.dataset)

  def fetch(self, index: Any) -> Any:
    if self.stream is None:
      return self.collate_fn([self.dataset[i] for i in index]) if self.auto else self.collate_fn(self.dataset[index])
    if not self.auto: return self.collate_fn(next(self.stream))
    batch = list(itertools.islice(self.stream, self.batch_size))
    if not batch or (self.drop_last and len(batch) < self.batch_size): raise StopIteration
    return self.collate_fn(batch)


class _WorkerError:
  """An exception raised in a worker, carried to the main process with its traceback text."""

  def __init__(self, exc: BaseException, worker_id: int) -> None:
    self.type, self.text = type(exc), f"Caught {type(exc).__name__} in DataLoader worker process {worker_id}.\n" \
                                      f"Original {traceback.format_exc()}"

  def reraise(self) -> None:
    try: exc = self.type(self.text)
    except Exception: exc = RuntimeError(self.text)
    raise exc


_STREAM_END, _RESET = "__stream_end__", "__reset__"


def _worker_loop(fetcher: _Fetcher, tasks, results, worker_id: int, num_workers: int, seed: int,
                 init_fn: Callable[[int], None] | None) -> None:
  """A worker: seed, then answer each task (None stops) with (task, batch), an error, or the end of its stream."""
  global _worker_info
  results.cancel_join_thread()  # exit without flushing batches nobody will read (the loader was left early)
  random.seed(seed)
  np.random.seed(seed % 2**32)
  ops.manual_seed(seed)
  _worker_info = WorkerInfo(worker_id, num_workers, seed, fetcher.dataset)
  try:
    if init_fn is not None: init_fn(worker_id)
    fetcher.restart()
  except Exception as e:
    results.put((None, _WorkerError(e, worker_id)))
    return
  while (task := tasks.get()) is not None:
    k, index = task
    if k == _RESET:  # a new epoch of persistent workers: the stream starts over
      fetcher.restart()
      continue
    try: results.put((k, fetcher.fetch(index)))
    except StopIteration: results.put((k, _STREAM_END))
    except Exception as e: results.put((k, _WorkerError(e, worker_id)))


class _MultiProcessIter:
  """Batches from worker processes in task order: tasks go round-robin to the workers whose stream has not ended
  (all of them, for a map-style dataset: task k to worker k % num_workers), each worker answers its own tasks in
  order on its own queue, and the answers are read back in the order the tasks were sent."""

  def __init__(self, loader: DataLoader, fetcher: _Fetcher, tasks: Iterator[Any], base_seed: int) -> None:
    ctx = loader.multiprocessing_context
    ctx = multiprocessing.get_context(ctx) if isinstance(ctx, str) or ctx is None else ctx
    n, self.timeout = loader.num_workers, loader.timeout or None
    self.tasks, self.task_queues, self.result_queues, self.workers = tasks, [], [], []
    for w in range(n):
      tq, rq = ctx.Queue(), ctx.Queue()
      p = ctx.Process(target=_worker_loop, args=(fetcher, tq, rq, w, n, base_seed + w, loader.worker_init_fn),
                      daemon=True)
      p.start()
      self.task_queues.append(tq); self.result_queues.append(rq); self.workers.append(p)
    self.prefetch, self.persistent, self.pending = loader.prefetch_factor * n, loader.persistent_workers, collections.deque()
    self._start(tasks)

  def _start(self, tasks: Iterator[Any]) -> None:
    self.tasks, self.alive, self.next_id, self.sent = tasks, list(range(len(self.workers))), 0, 0
    for _ in range(self.prefetch): self._send()

  def restart(self, tasks: Iterator[Any]) -> _MultiProcessIter:
    """The next epoch on the same (persistent) workers: unread batches of the last one are dropped."""
    while self.pending: self._get(self.pending.popleft())
    for tq in self.task_queues: tq.put((_RESET, None))
    self._start(tasks)
    return self

  def _send(self) -> None:
    if self.tasks is None or not self.alive: return
    try: task = next(self.tasks)
    except StopIteration:
      self.tasks = None
      return
    w = min((a for a in self.alive if a >= self.next_id), default=self.alive[0])
    self.next_id = w + 1
    self.task_queues[w].put((self.sent, task))
    self.pending.append(w)
    self.sent += 1

  def _get(self, w: int) -> Any:
    """Worker w's next answer, polling so that a worker that died (killed, out of memory) is an error, not a hang."""
    start = time.monotonic()
    while True:
      try: return self.result_queues[w].get(timeout=0.25 if self.timeout is None else min(self.timeout, 0.25))[1]
      except queue.Empty:
        p = self.workers[w]
        if not p.is_alive():
          self.close(force=True)
          raise RuntimeError(f"DataLoader worker {w} (pid {p.pid}) exited unexpectedly with exit code "
                             f"{p.exitcode}") from None
        if self.timeout is not None and time.monotonic() - start > self.timeout:
          self.close(force=True)
          raise RuntimeError(f"DataLoader timed out after {self.timeout} seconds waiting for worker {w}") from None

  def __iter__(self) -> _MultiProcessIter: return self

  def __next__(self) -> Any:
    while self.pending:
      w = self.pending.popleft()
      data = self._get(w)
      if isinstance(data, _WorkerError):
        self.close()
        self.persistent = False
        data.reraise()
      if isinstance(data, str) and data == _STREAM_END:
        if w in self.alive: self.alive.remove(w)
        self._send()
        continue
      self._send()
      return data
    if not self.persistent: self.close()
    raise StopIteration

  def close(self, force: bool = False) -> None:
    """Stop the workers: ask them to finish (their current batch first), or with `force` terminate them."""
    for tq, p in zip(self.task_queues, self.workers):
      if p.is_alive() and not force: tq.put(None)
    for p in self.workers:
      if not force: p.join(timeout=5)
      if p.is_alive(): p.terminate()
      p.join()
    self.workers, self.task_queues, self.result_queues = [], [], []

  def __del__(self) -> None:
    if self.workers: self.close()


# *** the loader ***

class DataLoader(Generic[T]):
  """Batches from a dataset, as `torch.utils.data.DataLoader`.

  Args:
    dataset: a map-style `Dataset` (or anything with `__getitem__` and `__len__`) or an `IterableDataset`.
    batch_size: samples per batch; None loads single samples without collation (through `default_convert`).
    shuffle: draw a new random order each epoch from `generator` (map-style datasets only).
    sampler: the order of indices (instead of `shuffle`); batch_sampler: lists of indices (instead of
      `batch_size`, `shuffle`, `sampler` and `drop_last`).
    num_workers: worker processes (0 loads in the main process); batches come in the same order either way.
    collate_fn: samples -> batch (`default_collate`, or `default_convert` when batch_size is None).
    pin_memory: accepted for PyTorch compatibility: batches stay ordinary CPU tensors, and the CUDA backend already
      copies host memory to the device through its own pinned staging buffers.
    drop_last: drop the last batch when it is short.
    timeout: seconds to wait for a worker's batch (0 waits forever).
    worker_init_fn: called with the worker id in each worker after seeding.
    multiprocessing_context: a start method name or context (the platform's default when None).
    generator: the generator of the random order and of the workers' base seed.
    prefetch_factor: batches each worker has in flight (2 when workers are used).
    persistent_workers: keep the worker processes (and their dataset copies and seeds) from epoch to epoch.

  Example:
    >>> loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=bt.Generator().manual_seed(0))
    >>> for xb, yb in loader: ...
  """

  def __init__(self, dataset: Dataset[T], batch_size: int | None = 1, shuffle: bool | None = None,
               sampler: Sampler | Iterable | None = None, batch_sampler: Sampler | Iterable | None = None,
               num_workers: int = 0, collate_fn: Callable | None = None, pin_memory: bool = False,
               drop_last: bool = False, timeout: float = 0, worker_init_fn: Callable[[int], None] | None = None,
               multiprocessing_context: Any = None, generator: Generator | None = None, *,
               prefetch_factor: int | None = None, persistent_workers: bool = False) -> None:
    if num_workers < 0:
      raise ValueError("num_workers option should be non-negative; use num_workers=0 to disable multiprocessing.")
    if timeout < 0: raise ValueError("timeout option should be non-negative")
    if persistent_workers and num_workers == 0: raise ValueError("persistent_workers option needs num_workers > 0")
    if num_workers == 0 and prefetch_factor is not None:
      raise ValueError("prefetch_factor option could only be specified in multiprocessing. let num_workers > 0 to "
                       "enable multiprocessing, otherwise set prefetch_factor to None.")
    if isinstance(dataset, IterableDataset):
      if shuffle not in (None, False):
        raise ValueError(f"DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle={shuffle}")
      if sampler is not None:
        raise ValueError(f"DataLoader with IterableDataset: expected unspecified sampler option, but got sampler={sampler}")
      if batch_sampler is not None:
        raise ValueError("DataLoader with IterableDataset: expected unspecified batch_sampler option, but got "
                         f"batch_sampler={batch_sampler}")
    if sampler is not None and shuffle: raise ValueError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None:
      if batch_size != 1 or shuffle or sampler is not None or drop_last:
        raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last")
      batch_size, drop_last = None, False
    elif batch_size is None and drop_last:
      raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive with drop_last")
    if not isinstance(dataset, IterableDataset):
      if sampler is None: sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
      if batch_size is not None and batch_sampler is None: batch_sampler = BatchSampler(sampler, batch_size, drop_last)
    self.dataset, self.batch_size, self.drop_last, self.sampler, self.batch_sampler = (dataset, batch_size, drop_last,
                                                                                       sampler, batch_sampler)
    self.num_workers, self.pin_memory, self.timeout, self.worker_init_fn = num_workers, pin_memory, timeout, worker_init_fn
    self.multiprocessing_context, self.generator = multiprocessing_context, generator
    self.persistent_workers, self._workers = persistent_workers, None
    self.prefetch_factor = 2 if num_workers and prefetch_factor is None else prefetch_factor
    self.collate_fn = collate_fn or (default_collate if batch_size is not None or batch_sampler is not None else
                                     default_convert)

  @property
  def _auto_collation(self) -> bool: return self.batch_sampler is not None or (
    isinstance(self.dataset, IterableDataset) and self.batch_size is not None)

  def _tasks(self) -> Iterator[Any]:
    """What each batch is made from: index lists, single indices, or (for a stream) nothing."""
    if isinstance(self.dataset, IterableDataset): return itertools.repeat(None)
    return iter(self.batch_sampler if self.batch_sampler is not None else self.sampler)

  def __iter__(self) -> Iterator[Any]:
    base_seed = int(ops.randint(0, 2**62, (), generator=self.generator).item())
    fetcher = _Fetcher(self.dataset, self._auto_collation, self.collate_fn, self.batch_size, self.drop_last)
    tasks = self._tasks()
    if not self.num_workers: return self._single(fetcher, tasks)
    if self._workers is not None and self._workers.workers: return self._workers.restart(tasks)
    it = _MultiProcessIter(self, fetcher, tasks, base_seed)
    if self.persistent_workers: self._workers = it
    return it

  @staticmethod
  def _single(fetcher: _Fetcher, tasks: Iterator[Any]) -> Iterator[Any]:
    fetcher.restart()
    for task in tasks:
      try: yield fetcher.fetch(task)
      except StopIteration: return

  def __len__(self) -> int:
    if isinstance(self.dataset, IterableDataset):
      n = len(self.dataset)
      if self.batch_size is None: return n
      return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
    return len(self.batch_sampler if self.batch_sampler is not None else self.sampler)
