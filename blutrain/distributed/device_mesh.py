"""DeviceMesh: the ranks laid out on a grid, with this rank's process group along each dimension, as
torch.distributed.device_mesh.

  >>> mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))   # 8 ranks: 2 replicas of 4-way TP
  >>> model = DistributedDataParallel(parallelize_gpt(GPT(cfg), mesh["tp"].get_group()),
  ...                                 process_group=mesh["dp"].get_group())

Ranks fill the grid row-major, so the last dimension's ranks are consecutive (put tensor parallelism last: its
groups, which talk most, then sit on one node's NVLink).
"""
from __future__ import annotations

import itertools
import math

from blutrain import distributed as dist


class DeviceMesh:
  """A grid of global ranks (`mesh`, nested lists of shape `shape`) and this rank's process group along each dim.
  Index by a dimension's name for the 1-D mesh of this rank's line along it (`mesh["tp"].get_group()`)."""

  def __init__(self, device_type: str, shape: tuple[int, ...], ranks: list[int], groups: list[dist.ProcessGroup],
               mesh_dim_names: tuple[str, ...] | None) -> None:
    self.device_type, self.shape, self.ranks, self._groups = device_type, shape, ranks, groups
    self.mesh_dim_names = mesh_dim_names

  def _dim(self, mesh_dim: int | str) -> int:
    if isinstance(mesh_dim, str):
      if not self.mesh_dim_names or mesh_dim not in self.mesh_dim_names:
        raise KeyError(f"DeviceMesh: no dimension named {mesh_dim!r}; the dimensions are {self.mesh_dim_names}")
      return self.mesh_dim_names.index(mesh_dim)
    if not -len(self.shape) <= mesh_dim < len(self.shape):
      raise IndexError(f"DeviceMesh: dimension {mesh_dim} is out of range for a {len(self.shape)}-D mesh")
    return mesh_dim % len(self.shape)

  def get_group(self, mesh_dim: int | str | None = None) -> dist.ProcessGroup:
    """This rank's group along `mesh_dim` (optional for a 1-D mesh)."""
    if mesh_dim is None:
      if len(self.shape) != 1:
        raise RuntimeError(f"DeviceMesh.get_group: name a dimension of this {len(self.shape)}-D mesh")
      mesh_dim = 0
    return self._groups[self._dim(mesh_dim)]

  def size(self, mesh_dim: int | str | None = None) -> int:
    return math.prod(self.shape) if mesh_dim is None else self.shape[self._dim(mesh_dim)]

  def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
    """This rank's index along `mesh_dim` (its rank in that dimension's group)."""
    return self.get_group(mesh_dim).rank()

  def __getitem__(self, name: str) -> DeviceMesh:
    d = self._dim(name)
    group = self._groups[d]
    return DeviceMesh(self.device_type, (self.shape[d],), list(group.ranks), [group], (name,))

  def __repr__(self) -> str: return f"DeviceMesh({self.device_type!r}, shape={self.shape}, names={self.mesh_dim_names})"


def init_device_mesh(device_type: str, mesh_shape: tuple[int, ...], *,
                     mesh_dim_names: tuple[str, ...] | None = None) -> DeviceMesh:
  """Lay the world's ranks out on a grid of `mesh_shape` (its product: the world size) and create the process group of
  every line along every dimension; every rank calls it. Initializes the default group first if needed (nccl for
  "cuda", mpi for "cpu")."""
  if not dist.is_initialized(): dist.init_process_group("nccl" if device_type == "cuda" else "mpi")
  shape, world = tuple(int(n) for n in mesh_shape), dist.get_world_size()
  if math.prod(shape) != world or any(n < 1 for n in shape):
    raise RuntimeError(f"init_device_mesh: a mesh of shape {shape} holds {math.prod(shape)} ranks, the world "
                       f"{world}; make the product of mesh_shape the world size")
  if mesh_dim_names is not None and (len(mesh_dim_names) != len(shape) or len(set(mesh_dim_names)) != len(shape)):
    raise RuntimeError(f"init_device_mesh: mesh_dim_names {mesh_dim_names} must name each of the {len(shape)} "
                       "dimensions once")
  strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
  me, groups = dist.get_rank(), []
  for d in range(len(shape)):
    mine = None
    others = [range(n) if e != d else range(1) for e, n in enumerate(shape)]
    for start in itertools.product(*others):  # every line along d, in one order on every rank
      base = sum(i * s for i, s in zip(start, strides))
      g = dist.new_group([base + k * strides[d] for k in range(shape[d])])
      if g is not None: mine = g
    groups.append(mine)
  return DeviceMesh(device_type, shape, list(range(world)), groups, mesh_dim_names)
