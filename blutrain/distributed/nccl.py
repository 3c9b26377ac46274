"""The NCCL backend: collectives on CUDA tensors through nccl4py, on the device's communication stream.

A collective makes the communication stream wait for an event recorded on the current stream (the tensors' producers),
tells the caching allocator that the comm stream uses the tensors' memory, enqueues the NCCL call on the comm stream
and records an end event there. `Work.wait()` makes the current stream wait for that event: no host sync anywhere.
Tensors travel by DLPack (stream -1: we order the streams ourselves).

Timeouts: a watchdog thread polls the end events of pending collectives; one still pending past its timeout aborts the
communicator, and the next call on the group raises RuntimeError naming the collective and the ranks that had not
started it. Each watchdog publishes, off the critical path, how many collectives its rank has enqueued to the TCP
store (when the group has one), which is how a rank knows who did not arrive.
"""
from __future__ import annotations

import threading
import time

from blutrain import ops
from blutrain.backend.cuda import memory, runtime
from blutrain.device import Device
from blutrain.distributed.process_group import ProcessGroup, ReduceOp, Work
from blutrain.tensor import Tensor


def _nccl():
  try:
    import nccl.core as nccl
  except ImportError as e:
    raise RuntimeError("the nccl backend needs nccl4py: pip install 'blutrain[cuda]' (nccl4py==0.6.0)") from e
  return nccl


def new_unique_id() -> bytes:
  """A fresh NCCL unique id, as bytes to send to the other ranks."""
  return bytes(_nccl().get_unique_id())


class NcclWork(Work):
  def __init__(self, group: NcclGroup, name: str, seq: int, end: runtime.Event, deadline: float):
    self.group, self.name, self.seq, self.end, self.deadline = group, name, seq, end, deadline

  def wait(self, timeout=None) -> bool:
    self.group.raise_if_failed()
    runtime.current_stream(self.group.device).wait_event(self.end)
    return True

  def is_completed(self) -> bool:
    self.group.raise_if_failed()
    return self.end.query()


class NcclGroup(ProcessGroup):
  """A process group over one NCCL communicator (one GPU per rank); `ranks` are its members' global ranks."""
  backend = "nccl"

  def __init__(self, comm, ranks: list[int], rank: int, device: int, timeout: float, store=None, name: str = "0"):
    self.comm, self.ranks, self._rank, self.device, self.timeout = comm, ranks, rank, device, timeout
    self.store, self.name, self.seq, self.error = store, name, 0, None
    red = _nccl().NcclRedOp
    self.ops = {ReduceOp.SUM: red.SUM, ReduceOp.AVG: red.AVG, ReduceOp.PRODUCT: red.PROD, ReduceOp.MAX: red.MAX,
                ReduceOp.MIN: red.MIN}
    self._fork = runtime.Event()  # re-recorded by every collective: a stream wait takes the event's state when enqueued
    self._pending: list[NcclWork] = []
    self._lock, self._stop = threading.Lock(), threading.Event()
    threading.Thread(target=self._watch, daemon=True, name=f"blutrain-nccl-watchdog-{name}").start()

  @classmethod
  def create(cls, unique_id: bytes, ranks: list[int], rank: int, device: int, timeout: float, store=None,
             name: str = "0") -> NcclGroup:
    nccl = _nccl()
    runtime.set_device(device)
    comm = nccl.Communicator.init(len(ranks), rank, nccl.UniqueId.from_bytes(unique_id))
    return cls(comm, ranks, rank, device, timeout, store, name)

  # *** the watchdog ***

  def _watch(self) -> None:
    runtime.state(self.device)  # the device's context, current in this thread for the event queries
    published = 0
    while not self._stop.wait(0.1):
      if self.store is not None and self.seq != published:
        published = self.seq
        self.store.set(f"nccl/{self.name}/enqueued/{self._rank}", str(published))
      with self._lock:
        self._pending = [w for w in self._pending if not w.end.query()]
        late = next((w for w in self._pending if time.monotonic() > w.deadline), None)
      if late is not None and self.error is None:
        self.error = self.missing_message(late.name, late.seq, self._missing(late.seq), self.timeout)
        self.comm.abort()
        return

  def _missing(self, seq: int) -> list[int] | None:
    if self.store is None: return None
    counts = [self.store.check(f"nccl/{self.name}/enqueued/{r}") for r in range(self.size())]
    return [self.ranks[r] for r, c in enumerate(counts) if c is None or int(c) < seq]

  def raise_if_failed(self) -> None:
    if self.error is not None: raise RuntimeError(self.error)

  # *** enqueueing ***

  def _enqueue(self, name: str, tensors: list[Tensor], call, async_op: bool, timeout, counted: bool = True):
    self.raise_if_failed()
    for t in tensors:
      self.check_tensor(name, t, "cuda")
      if not t.is_contiguous(): raise RuntimeError(f"{name}: NCCL needs contiguous tensors, got shape {tuple(t.shape)} "
                                                   f"with strides {t.stride()}; pass .contiguous()")
    comm_stream = runtime.comm_stream(self.device)
    comm_stream.wait_event(runtime.current_stream(self.device).record_event(self._fork))
    for t in tensors:
      owner = t._array().owner
      if hasattr(owner, "record_stream"): owner.record_stream(comm_stream)
    if counted: self.seq += 1
    call(comm_stream.handle)
    deadline = time.monotonic() + (self.timeout if timeout is None else float(timeout))
    work = NcclWork(self, name, self.seq, comm_stream.record_event(), deadline)
    with self._lock: self._pending.append(work)
    if async_op: return work
    work.wait()
    return None

  def all_reduce(self, t: Tensor, op: ReduceOp, async_op: bool, timeout=None) -> Work | None:
    return self._enqueue("all_reduce", [t], lambda s: self.comm.allreduce(t, t, self.ops[op], stream=s), async_op, timeout)

  def reduce_scatter_tensor(self, out: Tensor, inp: Tensor, op: ReduceOp, async_op: bool, timeout=None) -> Work | None:
    return self._enqueue("reduce_scatter_tensor", [out, inp],
                         lambda s: self.comm.reduce_scatter(inp, out, self.ops[op], stream=s), async_op, timeout)

  def all_gather_into_tensor(self, out: Tensor, inp: Tensor, async_op: bool, timeout=None) -> Work | None:
    return self._enqueue("all_gather_into_tensor", [out, inp], lambda s: self.comm.allgather(inp, out, stream=s),
                         async_op, timeout)

  def broadcast(self, t: Tensor, src: int, async_op: bool, timeout=None) -> Work | None:
    root = self.ranks.index(src)
    return self._enqueue("broadcast", [t], lambda s: self.comm.broadcast(t, t, root, stream=s), async_op, timeout)

  def send(self, t: Tensor, dst: int, tag: int, async_op: bool, timeout=None) -> Work | None:
    peer = self.ranks.index(dst)
    return self._enqueue(f"send to rank {dst}", [t], lambda s: self.comm.send(t, peer, stream=s), async_op, timeout,
                         counted=False)

  def recv(self, t: Tensor, src: int, tag: int, async_op: bool, timeout=None) -> Work | None:
    peer = self.ranks.index(src)
    return self._enqueue(f"recv from rank {src}", [t], lambda s: self.comm.recv(t, peer, stream=s), async_op, timeout,
                         counted=False)

  def barrier(self, async_op: bool = False, timeout=None) -> Work | None:
    """An all-reduce of one element; unlike the other collectives the host waits for it, as a barrier must."""
    one = ops.ones(1, device=f"cuda:{self.device}")
    work = self.all_reduce(one, ReduceOp.SUM, True, timeout)
    if async_op: return work
    while not work.end.query():  # past the timeout the watchdog aborts the communicator and sets the error
      self.raise_if_failed()
      time.sleep(1e-4)
    return None

  # *** the collective ops' kernels (backend/collective.py): new arrays, the NCCL call on the current stream ***

  def _on_current_stream(self, call) -> None:
    """Enqueue an NCCL call on the current stream, where a CUDA graph being captured records it (no comm stream, no
    events: the op's consumers follow it on that stream). The watchdog sees these calls through `watch_queued`, which
    the compiled step calls after queueing its work."""
    self.raise_if_failed()
    self.seq += 1
    call(runtime.current_stream(self.device).handle)

  def watch_queued(self, count: int) -> None:
    """Watch the work queued so far on the current stream, which holds `count` of this group's collectives (a
    compiled step's, replayed in a CUDA graph): the watchdog aborts the communicator when it has not completed within
    the group's timeout, and the next use raises the error naming the ranks that did not arrive."""
    self.seq += count
    end, deadline = runtime.current_stream(self.device).record_event(), time.monotonic() + self.timeout
    with self._lock: self._pending.append(NcclWork(self, f"a compiled step with {count} collective{'s' * (count > 1)}", self.seq,
                                        end, deadline))

  def _tensor(self, a) -> Tensor:
    return Tensor._wrap(a, Device("cuda", a.device), a.dtype)

  def _dense(self, a):
    if a.is_contiguous(): return a
    out = memory.empty_like(a)
    memory.copy_into(out, a)
    return out

  def all_reduce_array(self, x, reduce_op: str):
    x, out = self._dense(x), memory.empty(x.shape, x.dtype, x.device)
    op = self.ops[ReduceOp(reduce_op)]
    self._on_current_stream(lambda s: self.comm.allreduce(self._tensor(x), self._tensor(out), op, stream=s))
    return out

  def reduce_scatter_array(self, x, reduce_op: str):
    x, out = self._dense(x), memory.empty((x.shape[0] // self.size(), *x.shape[1:]), x.dtype, x.device)
    op = self.ops[ReduceOp(reduce_op)]
    self._on_current_stream(lambda s: self.comm.reduce_scatter(self._tensor(x), self._tensor(out), op, stream=s))
    return out

  def all_gather_array(self, x):
    x, out = self._dense(x), memory.empty((x.shape[0] * self.size(), *x.shape[1:]), x.dtype, x.device)
    self._on_current_stream(lambda s: self.comm.allgather(self._tensor(x), self._tensor(out), stream=s))
    return out

  def new_group(self, ranks: list[int], timeout: float) -> NcclGroup | None:
    """The subgroup of `ranks` (global ranks), split from this communicator: every rank of this group calls it."""
    me = self.ranks[self._rank]
    sub = self.comm.split(0 if me in ranks else None, key=ranks.index(me) if me in ranks else 0)
    if me not in ranks: return None
    return NcclGroup(sub, list(ranks), ranks.index(me), self.device, timeout, self.store,
                     f"{self.name}.{'-'.join(map(str, ranks))}")

  def destroy(self) -> None:
    self._stop.set()
    if self.error is None: self.comm.destroy()
