"""A fake `nccl.core` (nccl4py's module) for the NCCL backend's host code on the fake GPU (fake_cuda.py): a
communicator of any size whose calls read their buffers by DLPack, as nccl4py does, and append
(name, stream handle, extra arguments..., fake_cuda.launches so far) to `log`; nothing is transferred. Call
`install()` before `blutrain.distributed` loads its backend."""
from __future__ import annotations

import enum
import sys
import types

import fake_cuda

log: list[tuple] = []


class UniqueId:
  def __init__(self, b: bytes = bytes(128)): self.b = b
  def __bytes__(self) -> bytes: return self.b
  @staticmethod
  def from_bytes(b) -> UniqueId: return UniqueId(bytes(b))


class NcclRedOp(enum.IntEnum):
  SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4


class Communicator:
  def __init__(self, n: int = 1): self.n = n

  @classmethod
  def init(cls, nranks, rank, unique_id):
    assert isinstance(unique_id, UniqueId) and 0 <= rank < nranks
    return cls(nranks)

  def _call(self, name, bufs, stream, *extra):
    for b in bufs: b.__dlpack__(stream=-1)  # nccl4py reads tensors by DLPack; -1: we order the streams
    log.append((name, stream, *extra, fake_cuda.launches[0]))

  def allreduce(self, s, r, op, *, stream): self._call("allreduce", [s, r], stream, op.name)
  def reduce_scatter(self, s, r, op, *, stream): self._call("reduce_scatter", [s, r], stream, op.name)
  def allgather(self, s, r, *, stream): self._call("allgather", [s, r], stream)
  def broadcast(self, s, r, root, *, stream): self._call("broadcast", [s, r], stream, root)
  def send(self, s, peer, *, stream): self._call("send", [s], stream, peer)
  def recv(self, r, peer, *, stream): self._call("recv", [r], stream, peer)
  def split(self, color, key=0): return Communicator(1)
  def abort(self): log.append(("abort",))
  def destroy(self): log.append(("destroy",))


def install() -> None:
  core = types.ModuleType("nccl.core")
  core.UniqueId, core.NcclRedOp, core.Communicator = UniqueId, NcclRedOp, Communicator
  core.get_unique_id = lambda: UniqueId(b"x" * 128)
  sys.modules["nccl"] = types.ModuleType("nccl")
  sys.modules["nccl.core"] = core
