"""DistributedSampler: each rank's share of a dataset's indices, as torch.utils.data.distributed.DistributedSampler."""
from __future__ import annotations

from typing import Iterator

import numpy as np

from blutrain import distributed as dist


class DistributedSampler:
  """The indices of `dataset` (a length or anything with len()) that rank `rank` of `num_replicas` reads in one epoch.

  Every rank draws the same permutation (seeded by `seed + epoch`), pads it by repeating its start to a multiple of
  `num_replicas` (or drops the tail with `drop_last`), and keeps every num_replicas-th index from its rank on, so the
  ranks' shares are disjoint and together cover the dataset. Call `set_epoch(e)` before each epoch to reshuffle.
  """

  def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None, shuffle: bool = True,
               seed: int = 0, drop_last: bool = False):
    self.n = dataset if isinstance(dataset, int) else len(dataset)
    self.num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
    self.rank = dist.get_rank() if rank is None else rank
    if not 0 <= self.rank < self.num_replicas:
      raise ValueError(f"DistributedSampler: invalid rank {self.rank}, rank should be in [0, {self.num_replicas - 1}]")
    self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
    self.num_samples = self.n // self.num_replicas if drop_last else -(-self.n // self.num_replicas)

  def set_epoch(self, epoch: int) -> None:
    """Make the next iteration use the permutation of `epoch` (the same on every rank)."""
    self.epoch = epoch

  def __iter__(self) -> Iterator[int]:
    order = np.random.default_rng(self.seed + self.epoch).permutation(self.n) if self.shuffle else np.arange(self.n)
    total = self.num_samples * self.num_replicas
    order = order[:total] if self.drop_last else np.resize(order, total)  # np.resize repeats from the start
    return iter(order[self.rank::self.num_replicas].tolist())

  def __len__(self) -> int:
    return self.num_samples
