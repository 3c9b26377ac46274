"""What every backend shares: reduction ops, work handles, the launchers' environments, and the group interface."""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum

from blutrain.tensor import Tensor

DEFAULT_TIMEOUT = timedelta(minutes=10)


class ReduceOp(Enum):
  """How all_reduce and reduce_scatter combine the ranks' values, as torch.distributed.ReduceOp."""
  SUM = "sum"
  AVG = "avg"
  PRODUCT = "product"
  MAX = "max"
  MIN = "min"


@dataclass(frozen=True)
class RankEnv:
  """Where this process stands in its job, as a launcher described it."""
  rank: int
  world_size: int
  local_rank: int
  master_addr: str | None
  master_port: int | None
  launcher: str  # "torchrun" (RANK/WORLD_SIZE: torchrun, blutrain launch), "openmpi", "mpich", "slurm" or "single"


def rank_env(environ: dict[str, str] | None = None) -> RankEnv:
  """Read rank, world size and local rank from the first convention present: torchrun's (RANK, WORLD_SIZE,
  LOCAL_RANK, which `blutrain launch` also sets), Open MPI's (OMPI_COMM_WORLD_*), MPICH/Hydra's (PMI_RANK, PMI_SIZE,
  MPI_LOCALRANKID), then srun's (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID); none of them: one process.
  MASTER_ADDR/MASTER_PORT come from the environment (under Slurm MASTER_ADDR defaults to SLURM_LAUNCH_NODE_IPADDR)."""
  env = os.environ if environ is None else environ
  conventions = [("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
                 ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                 ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
                 # SLURM_STEP_NUM_TASKS: srun sets it for its step; a batch script's own environment (SLURM_NTASKS of
                 # the whole allocation) must not make one process wait for ranks nobody started
                 ("slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")]
  for launcher, rank, size, local in conventions:
    if rank in env and size in env:
      r, n, lr = int(env[rank]), int(env[size]), int(env.get(local, env[rank]))
      break
  else:
    launcher, r, n, lr = "single", 0, 1, 0
  if not 0 <= r < n: raise RuntimeError(f"rank {r} is outside the world of {n} processes ({launcher}'s environment)")
  addr = env.get("MASTER_ADDR") or (env.get("SLURM_LAUNCH_NODE_IPADDR") if launcher == "slurm" else None)
  port = env.get("MASTER_PORT")
  return RankEnv(r, n, lr, addr, int(port) if port else None, launcher)


def seconds(timeout: timedelta | float | None) -> float:
  if timeout is None: return DEFAULT_TIMEOUT.total_seconds()
  return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class Work(ABC):
  """The handle of a collective started with async_op=True, as torch.distributed.Work: `wait()` makes later work wait
  for it (on the GPU: the current stream waits on the collective's event, no host sync; on the CPU: the MPI requests
  complete) and raises RuntimeError if it timed out."""

  @abstractmethod
  def wait(self, timeout: timedelta | float | None = None) -> bool: ...

  @abstractmethod
  def is_completed(self) -> bool: ...


class ProcessGroup:
  """A set of ranks that run collectives together. `ranks` are global ranks in group-rank order; `rank()` and
  `size()` are this process's rank in the group and the group's size. Backends implement the collectives on tensors,
  in place, returning a Work, and the collective ops' kernels on arrays (`backend.collective`)."""
  backend: str
  ranks: list[int]
  timeout: float
  gid: int  # the id that names it to the collective ops (blutrain.distributed registers it in backend.collective)

  def rank(self) -> int: return self._rank
  def size(self) -> int: return len(self.ranks)
  def __repr__(self) -> str: return f"<ProcessGroup {self.backend} ranks={self.ranks} rank={self._rank}>"

  def missing_message(self, name: str, seq: int, missing: list[int] | None, timeout: float) -> str:
    who = "unknown" if missing is None else (", ".join(map(str, missing)) or "none (they arrived; the transfer stalled)")
    return (f"{name} (collective #{seq} of the {self.backend} group of ranks {self.ranks}) timed out after {timeout:.1f} s "
            f"on rank {self.ranks[self._rank]}: ranks that did not arrive: {who}. A rank crashed, hangs, or called a "
            "different collective; the group cannot be used after this")

  def check_tensor(self, name: str, t: Tensor, device_type: str) -> None:
    if not isinstance(t, Tensor): raise TypeError(f"{name}: expected a Tensor, got {type(t).__name__}")
    if t.device.type != device_type:
      other = "nccl" if device_type == "cpu" else "mpi"
      raise RuntimeError(f"{name}: the {self.backend} backend works on {device_type} tensors, got a tensor on {t.device} "
                         f"(shape {tuple(t.shape)}, {t.dtype.name}); use backend='{other}' or move the tensor")
