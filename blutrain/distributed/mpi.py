"""The MPI backend: collectives on CPU tensors through mpi4py's non-blocking calls on their numpy buffers.

Every collective is started non-blocking (Iallreduce, Ireduce_scatter_block, Iallgather, Ibcast, Ibarrier, Isend,
Irecv) and completed by polling, so no wait can hang: past its timeout it raises RuntimeError naming the ranks that did
not arrive. To find them, the waiting rank asks every peer, on a duplicate communicator kept for this, how many
collectives of the group it has started; a peer answers while it polls a collective of its own, so a peer that is
behind, or busy elsewhere, or dead, is named.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from blutrain import dtypes
from blutrain.device import cpu
from blutrain.distributed.process_group import ProcessGroup, ReduceOp, Work
from blutrain.tensor import Tensor

_QUERY, _REPLY = 1, 2
_NATIVE = {np.dtype(t) for t in (np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64, np.bool_)}


def _mpi():
  try:
    from mpi4py import MPI
  except ImportError as e:
    raise RuntimeError("the mpi backend needs mpi4py and an MPI library: pip install mpi4py mpich") from e
  return MPI


def _staged(t: Tensor) -> tuple[np.ndarray, Callable[[], None] | None]:
  """A contiguous numpy buffer MPI can read and write for `t` (t's own memory when it can be), and the write back
  into t when it is a copy (a strided view, or bfloat16/float16, which travel as float32)."""
  a = t._array()
  if a.dtype in _NATIVE and a.flags.c_contiguous: return a.reshape(-1), None
  buf = np.ascontiguousarray(a, dtype=a.dtype if a.dtype in _NATIVE else np.float32).reshape(-1)
  def write_back(): a[...] = buf.reshape(a.shape).astype(a.dtype)
  return buf, write_back


def _wrap(a: np.ndarray) -> Tensor:
  return Tensor._wrap(a, cpu, dtypes.to_dtype(a.dtype))


class MpiWork(Work):
  def __init__(self, group: MpiGroup, name: str, seq: int, requests: list, finish: Callable[[], None] | None,
               peer: int | None = None):
    self.group, self.name, self.seq, self.requests, self.finish, self.done = group, name, seq, requests, finish, False
    self.peer = peer  # a send's or recv's other rank

  def wait(self, timeout=None) -> bool:
    if not self.done:
      self.group._complete(self, self.group.timeout if timeout is None else timeout)
      if self.finish: self.finish()
      self.done = True
    return True

  def is_completed(self) -> bool:
    if not self.done and self.group._mpi.Request.Testall(self.requests): self.wait()  # AVG's division, write-backs
    return self.done


class MpiGroup(ProcessGroup):
  """A process group over an MPI communicator; `ranks` are its members' ranks in MPI.COMM_WORLD."""
  backend = "mpi"

  def __init__(self, comm, timeout: float):
    MPI = self._mpi = _mpi()
    self.comm, self.diag, self.timeout = comm, comm.Dup(), timeout
    self._rank, self.seq, self._replies = comm.Get_rank(), 0, []
    self.ranks = list(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())), MPI.COMM_WORLD.Get_group()))
    self._ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.PRODUCT: MPI.PROD, ReduceOp.MAX: MPI.MAX,
                 ReduceOp.MIN: MPI.MIN}

  # *** waiting, with the timeout's diagnosis ***

  def _answer_queries(self) -> None:
    MPI, st = self._mpi, self._mpi.Status()
    while self.diag.Iprobe(source=MPI.ANY_SOURCE, tag=_QUERY, status=st):
      src, q = st.Get_source(), np.empty(1, np.int64)
      self.diag.Recv(q, source=src, tag=_QUERY)
      reply = np.array([self.seq], np.int64)
      self._replies.append((self.diag.Isend(reply, dest=src, tag=_REPLY), reply))
    self._replies = [(r, b) for r, b in self._replies if not r.Test()]

  def _missing(self, seq: int, grace: float) -> list[int]:
    """The global ranks that have not started collective #seq: those that answer with a smaller count, or not at all
    within `grace` seconds."""
    peers = [r for r in range(self.size()) if r != self._rank]
    query = np.array([seq], np.int64)
    sends = [self.diag.Isend(query, dest=r, tag=_QUERY) for r in peers]
    answers = {r: np.full(1, -1, np.int64) for r in peers}
    recvs = {r: self.diag.Irecv(answers[r], source=r, tag=_REPLY) for r in peers}
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not all(q.Test() for q in recvs.values()):
      self._answer_queries()
      time.sleep(1e-3)
    for q in list(recvs.values()) + sends:
      if not q.Test(): q.Cancel()
    return [self.ranks[r] for r in peers if answers[r][0] < seq]

  def _complete(self, work: MpiWork, timeout: float) -> None:
    deadline, pause = time.monotonic() + timeout, 1e-5
    while not self._mpi.Request.Testall(work.requests):
      self._answer_queries()
      if time.monotonic() > deadline:
        missing = [work.peer] if work.peer is not None else self._missing(work.seq, grace=min(2.0, max(0.5, timeout)))
        raise RuntimeError(self.missing_message(work.name, work.seq, missing, timeout))
      time.sleep(pause)
      pause = min(pause * 2, 1e-3)

  def _start(self, name: str, requests: list, finish, async_op: bool, timeout: float | None,
             peer: int | None = None) -> Work | None:
    work = MpiWork(self, name, self.seq, requests, finish, peer)
    if async_op: return work
    work.wait(timeout)
    return None

  def _next(self) -> int:
    self.seq += 1
    return self.seq

  # *** collectives ***

  def all_reduce(self, t: Tensor, op: ReduceOp, async_op: bool, timeout=None) -> Work | None:
    self.check_tensor("all_reduce", t, "cpu")
    if op is ReduceOp.AVG and not t.dtype.is_floating_point:
      raise TypeError(f"all_reduce: ReduceOp.AVG needs a floating-point tensor, got {t.dtype.name}")
    self._next()
    buf, write_back = _staged(t)
    req = self.comm.Iallreduce(self._mpi.IN_PLACE, buf, self._ops[op])
    def finish():
      if op is ReduceOp.AVG: np.divide(buf, self.size(), out=buf)
      if write_back: write_back()
      t._storage.version += 1
    return self._start("all_reduce", [req], finish, async_op, timeout)

  def reduce_scatter_tensor(self, out: Tensor, inp: Tensor, op: ReduceOp, async_op: bool, timeout=None) -> Work | None:
    for x in (out, inp): self.check_tensor("reduce_scatter_tensor", x, "cpu")
    if inp.numel() != out.numel() * self.size() or inp.dtype is not out.dtype:
      raise RuntimeError(f"reduce_scatter_tensor: the input ({tuple(inp.shape)}, {inp.dtype.name}) must hold group size "
                         f"({self.size()}) times the output's elements ({tuple(out.shape)}, {out.dtype.name}), same dtype")
    self._next()
    send, _ = _staged(inp)
    recv, write_back = _staged(out)
    req = self.comm.Ireduce_scatter_block(send, recv, self._ops[op])
    def finish():
      if op is ReduceOp.AVG: np.divide(recv, self.size(), out=recv)
      if write_back: write_back()
      out._storage.version += 1
    return self._start("reduce_scatter_tensor", [req], finish, async_op, timeout)

  def all_gather_into_tensor(self, out: Tensor, inp: Tensor, async_op: bool, timeout=None) -> Work | None:
    for x in (out, inp): self.check_tensor("all_gather_into_tensor", x, "cpu")
    if out.numel() != inp.numel() * self.size() or inp.dtype is not out.dtype:
      raise RuntimeError(f"all_gather_into_tensor: the output ({tuple(out.shape)}, {out.dtype.name}) must hold group size "
                         f"({self.size()}) times the input's elements ({tuple(inp.shape)}, {inp.dtype.name}), same dtype")
    self._next()
    send, _ = _staged(inp)
    recv, write_back = _staged(out)
    req = self.comm.Iallgather(send, recv)
    def finish():
      if write_back: write_back()
      out._storage.version += 1
    return self._start("all_gather_into_tensor", [req], finish, async_op, timeout)

  def broadcast(self, t: Tensor, src: int, async_op: bool, timeout=None) -> Work | None:
    self.check_tensor("broadcast", t, "cpu")
    self._next()
    buf, write_back = _staged(t)
    req = self.comm.Ibcast(buf, root=self.ranks.index(src))
    def finish():
      if write_back: write_back()
      t._storage.version += 1
    return self._start("broadcast", [req], finish, async_op, timeout)

  def send(self, t: Tensor, dst: int, tag: int, async_op: bool, timeout=None) -> Work | None:
    self.check_tensor("send", t, "cpu")
    buf, _ = _staged(t)
    req = self.comm.Isend(buf, dest=self.ranks.index(dst), tag=tag)
    return self._start(f"send to rank {dst}", [req], None, async_op, timeout, peer=dst)

  def recv(self, t: Tensor, src: int, tag: int, async_op: bool, timeout=None) -> Work | None:
    self.check_tensor("recv", t, "cpu")
    buf, write_back = _staged(t)
    req = self.comm.Irecv(buf, source=self.ranks.index(src), tag=tag)
    def finish():
      if write_back: write_back()
      t._storage.version += 1
    return self._start(f"recv from rank {src}", [req], finish, async_op, timeout, peer=src)

  def barrier(self, async_op: bool = False, timeout=None) -> Work | None:
    self._next()
    return self._start("barrier", [self.comm.Ibarrier()], None, async_op, timeout)

  # *** the collective ops' kernels (backend/collective.py): new arrays, the collective completed before returning ***

  def all_reduce_array(self, x: np.ndarray, reduce_op: str) -> np.ndarray:
    t = _wrap(np.array(x))
    self.all_reduce(t, ReduceOp(reduce_op), False)
    return t._array()

  def reduce_scatter_array(self, x: np.ndarray, reduce_op: str) -> np.ndarray:
    out = _wrap(np.empty((x.shape[0] // self.size(), *x.shape[1:]), x.dtype))
    self.reduce_scatter_tensor(out, _wrap(np.ascontiguousarray(x)), ReduceOp(reduce_op), False)
    return out._array()

  def all_gather_array(self, x: np.ndarray) -> np.ndarray:
    out = _wrap(np.empty((x.shape[0] * self.size(), *x.shape[1:]), x.dtype))
    self.all_gather_into_tensor(out, _wrap(np.ascontiguousarray(x)), False)
    return out._array()

  def new_group(self, ranks: list[int], timeout: float) -> MpiGroup | None:
    """The subgroup of `ranks` (global ranks, in that order); None on ranks outside it. Only its members call MPI."""
    if self.ranks[self._rank] not in ranks: return None
    sub = self.comm.Create_group(self.comm.Get_group().Incl([self.ranks.index(r) for r in ranks]))
    return MpiGroup(sub, timeout)

  def destroy(self) -> None:
    self.diag.Free()
    if self.comm != self._mpi.COMM_WORLD: self.comm.Free()
