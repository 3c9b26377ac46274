"""CUDA graphs: the work a function queues, captured once and replayed with one launch.

A `Pool` is a stream of its own whose allocator is private (a CachingAllocator of its own over the same device, under
the device allocator's limit: `bt.cuda.set_memory_limit` caps both together): work run through the pool (`Pool.run`,
`Pool.capture`) takes every allocation from it, and memory freed there is reused there only, so nothing outside is
ever handed memory that a graph captured in the pool reads or writes when it replays; once a capture begins, the pool
keeps its segments even when an out-of-memory retry empties the caches. A step run once through the pool before its
capture leaves the pool holding what the capture needs. The pool lives as long as its graphs (and as long as any array
cut from it).

`replayed` applies the same to one host loop of the eager backend (a recurrent layer's time steps): captured the
second time its shapes come, then replayed over buffers of its own that each call's inputs are copied into.

Capture runs in relaxed mode, so that the pool may ask the driver for a segment while capturing. Work that needs the
host (a device-to-host copy, a synchronization) cannot be captured: the driver's error ends the capture, and
`Pool.capture` raises it as `GraphCaptureError`. `Graph.replay()` launches the whole graph on the current stream,
ordered with everything else queued there.
"""
from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable

from blutrain.backend.cuda import errors, memory, runtime
from blutrain.backend.cuda.allocator import Block, CachingAllocator, round_size


class GraphCaptureError(RuntimeError):
  """The work of a function could not be captured into a CUDA graph (it synchronizes with the host, or copies to it)."""


class PlannedAllocator:
  """The allocator of a pool whose work follows a static memory plan: an allocation the plan foresees (announced by
  `expect` right before the op that makes it, matched by size, and withdrawn after it) is served at its offset in one
  arena; any other (a kernel's temporary, a copy the plan did not foresee, and whatever is allocated as
  `memory.kept`) comes from a caching allocator of the pool's own. Arena memory is never freed block by block: the
  plan says when it is reused."""

  def __init__(self, arena: Block, scratch: CachingAllocator):
    self.arena, self.scratch, self.device = arena, scratch, scratch.device
    self.slots: list[tuple[int, int]] = []

  def expect(self, slots: tuple[tuple[int, int], ...]) -> None:
    """The (offset, bytes) of the results the next op allocates."""
    self.slots = list(slots)

  def malloc(self, nbytes: int, stream) -> Block:
    if memory.kept.depth: return self.scratch.malloc(nbytes, stream)
    size = round_size(nbytes)
    for i, (offset, n) in enumerate(self.slots):
      if n == size:
        del self.slots[i]
        return Block(self.arena.ptr + offset, nbytes, self.device, stream, None, None)
    return self.scratch.malloc(nbytes, stream)


def expect(*slots: tuple[int, int]) -> None:
  """Announce the planned (offset, bytes) of the results of the op about to run, to the current stream's allocator
  when it follows a plan (a `Pool` with an arena); otherwise nothing."""
  a = runtime.current_stream().allocator
  if a.__class__ is PlannedAllocator: a.expect(slots)


class overlapped:
  """Context manager that runs the work queued in its block on a side stream of the current stream (a pool's own
  side stream, with the pool's allocator, else the device's communication stream), after the work queued before it,
  so that it overlaps the work queued after the block; `join(e)` makes the current stream wait for it. A CUDA graph
  captures both streams, forked and joined by events."""
  __slots__ = ("event", "_stream")

  def __enter__(self) -> overlapped:
    origin = runtime.current_stream()
    side = origin.side or runtime.comm_stream(origin.device)
    side.wait_event(origin.record_event())
    self._stream = runtime.stream(side)
    self._stream.__enter__()
    return self

  def __exit__(self, *exc) -> None:
    self.event = runtime.current_stream().record_event()
    self._stream.__exit__(*exc)


def join(work: overlapped) -> None:
  """Make the current stream wait for the work of an `overlapped` block."""
  runtime.current_stream().wait_event(work.event)


def _retire(streams: tuple[runtime.Stream, ...], scratch: CachingAllocator, device_allocator: CachingAllocator) -> None:
  """When a pool is collected: its streams outlive it (blocks that caches keep, such as cuBLASLt's workspace or a
  kernel's device tables, were allocated on them), so they must stop pointing at the pool's allocator and through it
  at the arena, which would otherwise never be freed; the workspaces made for them and the free scratch segments go."""
  from blutrain.backend.cuda.kernels import cublaslt
  for s in streams:
    s.allocator, s.side = device_allocator, None
    with cublaslt._lock: cublaslt._workspaces.pop((s.device, s.handle), None)
  scratch.empty_cache()


class Pool:
  """A private memory pool and the stream whose allocations it serves: work run through it (`run`, `capture`) takes
  its memory from the pool, on the pool's stream, ordered after the work queued before it on the current stream and
  before the work queued there after it. With `arena` bytes, the pool holds one arena for the results a static
  memory plan places (`PlannedAllocator`), cut once from the device's caching allocator."""

  def __init__(self, device: int | None = None, arena: int = 0):
    origin = runtime.current_stream(device)
    self.scratch = CachingAllocator(runtime._DeviceDriver(origin.device), origin.device, sharing=origin.allocator)
    self.arena = origin.allocator.malloc(arena, origin) if arena else None
    self.allocator = PlannedAllocator(self.arena, self.scratch) if arena else self.scratch
    # the stream lives as long as the pool: per-stream resources made on it (cuBLASLt's workspace) are keyed by its
    # handle, which a new stream must not take over while a graph captured on it may replay
    self.stream = runtime.Stream(origin.device)
    self.stream.allocator, self.stream.is_default = self.allocator, True
    self.side = runtime.Stream(origin.device)  # for `overlapped` work (a compiled step's collectives)
    self.side.allocator, self.side.is_default = self.allocator, True
    self.stream.side = self.side
    weakref.finalize(self, _retire, (self.stream, self.side), self.scratch, origin.allocator)

  def nbytes(self) -> int:
    """Device memory the pool's own caching allocator reserved (the arena is the device allocator's, counted in
    `bt.cuda.memory_allocated`)."""
    return self.scratch.memory_stats()["reserved_bytes.all.current"]

  def release(self) -> None:
    """Give the pool's memory back after its step failed (out of memory before a graph was captured): the arena, the
    cuBLASLt workspace made for its stream and its allocator's free segments. The pool is not used again."""
    from blutrain.backend.cuda.kernels import cublaslt
    self.stream.synchronize()  # the step's kernels queued before the failure may still read and write that memory
    if self.arena is not None: self.arena.free()
    with cublaslt._lock: cublaslt._workspaces.pop((self.stream.device, self.stream.handle), None)
    self.scratch.empty_cache()

  def _order(self, first: runtime.Stream, then: runtime.Stream) -> None:
    e = runtime.Event()
    e.record(first)
    then.wait_event(e)

  def run(self, fn: Callable[[], Any]) -> Any:
    """Run `fn()` with the pool's stream current."""
    origin = runtime.current_stream(self.stream.device)
    self._order(origin, self.stream)
    try:
      with runtime.stream(self.stream): return fn()
    finally:
      self._order(self.stream, origin)

  def capture(self, fn: Callable[[], Any]) -> tuple[Graph, Any]:
    """Capture the work `fn()` queues into a graph; returns the graph and what `fn` returned (arrays whose memory the
    graph writes when it replays: their values exist only after `replay()`)."""
    drv = runtime.driver()
    s = self.stream
    self.scratch.frozen = True  # the graph replays in the memory the capture is handed, free or not
    self._order(runtime.current_stream(s.device), s)
    mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    runtime.check(drv.cuStreamBeginCapture(s._s.handle, mode), "cuStreamBeginCapture")
    held = runtime.capture_holds[s.handle] = []  # the host sources of captured uploads (pointer tables)
    try:
      with runtime.stream(s): out = fn()
    except BaseException as e:
      del runtime.capture_holds[s.handle]
      err, graph = drv.cuStreamEndCapture(s._s.handle)
      if err == 0 and graph is not None: drv.cuGraphDestroy(graph)
      if isinstance(e, RuntimeError) and "CAPTURE" in str(e):
        raise GraphCaptureError(f"CUDA graph capture failed: {e}. The captured function synchronizes with the host or "
                                "copies to it; run it kernel by kernel (BLUTRAIN_CUDA_GRAPHS=0)") from e
      raise
    del runtime.capture_holds[s.handle]
    graph = runtime.check(drv.cuStreamEndCapture(s._s.handle), "cuStreamEndCapture")
    exe = runtime.check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    nodes = runtime.check(drv.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")[-1]
    return Graph(graph, exe, self, int(nodes), held), out


class Graph:
  """An instantiated CUDA graph and the pool its memory comes from. `replay()` launches it."""

  def __init__(self, graph: Any, exe: Any, pool: Pool, nodes: int, held: list):
    self._graph, self._exe, self.pool, self.nodes, self.held = graph, exe, pool, nodes, held

  def replay(self, stream: runtime.Stream | None = None) -> None:
    """Launch the graph on `stream` (default: the current stream)."""
    s = runtime.launch_stream(stream)
    runtime.check(runtime.driver().cuGraphLaunch(self._exe, s._s.handle), "cuGraphLaunch")
    errors.mark(s.device)  # its index kernels may record a bad index

  def __del__(self):
    drv = runtime.driver()
    if getattr(self, "_exe", None) is not None: drv.cuGraphExecDestroy(self._exe)
    if getattr(self, "_graph", None) is not None: drv.cuGraphDestroy(self._graph)


def enabled() -> bool:
  """Whether work may replay as CUDA graphs (`BLUTRAIN_CUDA_GRAPHS=0` runs everything kernel by kernel)."""
  return os.environ.get("BLUTRAIN_CUDA_GRAPHS", "1") != "0"


REPLAYS = 8  # loops kept captured (the least recently used is dropped): each holds its buffers and temporaries
_replays: OrderedDict[Hashable, tuple] = OrderedDict()  # key -> (graph, input buffers, output arrays)
_seen: set[Hashable] = set()


def replayed(key: Hashable, fn: Callable[..., tuple], *arrays) -> tuple:
  """fn(*arrays), a loop of device work over CudaArrays returning a tuple of CudaArrays (or None), run as a CUDA graph
  from the second call with the same `key` (which must hold every shape, stride, dtype and setting fn depends on) on:
  then the graph is captured in a pool of its own over input buffers of its own, and each call copies its inputs into
  them, replays the graph and copies its outputs out into new arrays, all on the current stream. A loop of many small
  launches (a recurrent layer's 256 steps, each a GEMM and a cell kernel) then costs the host one launch. The first
  call, calls inside a capture or a pool's work (a compiled step's), and BLUTRAIN_CUDA_GRAPHS=0 run fn as it is."""
  s = runtime.current_stream()
  if not enabled() or s.handle in runtime.capture_holds or s.allocator is not runtime.state(s.device).allocator:
    return fn(*arrays)
  hit = _replays.get(key)
  if hit is None:
    if key not in _seen:  # a shape seen once (a last short batch) is not worth a graph's memory
      if len(_seen) > 4096: _seen.clear()
      _seen.add(key)
      return fn(*arrays)
    hit = _replays[key] = _capture(fn, arrays)
    if len(_replays) > REPLAYS:
      s.synchronize()  # the dropped graph may still be replaying (on this stream, where replays go)
      while len(_replays) > REPLAYS: _replays.popitem(last=False)
  _replays.move_to_end(key)
  graph, buffers, outs = hit
  for buf, a in zip(buffers, arrays):
    if buf is not None: memory.copy_into(buf, a)
  graph.replay(s)
  return tuple(None if o is None else _own_copy(o) for o in outs)


def _own_copy(a):
  """A new array (the device allocator's, in a's dense layout) holding a's values."""
  from blutrain.backend.cuda.kernels import empty_like
  out = empty_like(a)
  memory.copy_into(out, a)
  return out


def _capture(fn: Callable[..., tuple], arrays) -> tuple:
  """(graph, input buffers, outputs) of fn captured in a new pool, after one run there (which compiles its kernels
  and leaves the pool the memory the capture needs)."""
  pool = Pool(next(a.device for a in arrays if a is not None))
  buffers = pool.run(lambda: [None if a is None else _own_copy(a) for a in arrays])
  pool.run(lambda: fn(*buffers))
  graph, outs = pool.capture(lambda: fn(*buffers))
  return graph, buffers, outs

