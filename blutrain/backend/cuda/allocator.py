"""The caching allocator: device memory cut from large driver segments and reused without driver calls.

The design is PyTorch's CUDACachingAllocator, in Python, over a small `Driver` protocol so that the bookkeeping
runs (and is tested) on the CPU with a fake driver; its hot path (a request served by a kept block of its size, and
the free that keeps it) runs in C where the C front builds (`allocator_front.py`), on the same state:

- sizes are rounded up to 512 B; requests up to 1 MiB come from the small pool, whose segments are 2 MiB;
  larger ones from the large pool, whose segments are 20 MiB for requests under 10 MiB and the request rounded
  up to 2 MiB (the driver's page size, so the rounding costs no device memory) above that;
- a freed block is kept as it is, under its stream and size, and the next request of that size and stream takes
  it back without a search, split or merge (a training step asks for the same sizes every time);
- any other request takes the smallest free block of its pool that was allocated on the same stream (best fit);
  a block larger than needed is split when the remainder is worth keeping (>= 512 B small, > 1 MiB large). When
  none fits, a new segment serves it while the memory reserved stays within GROWTH (2) times the peak of allocated
  memory (on a device's allocator, not a CUDA graph pool's), so that kept blocks stay with their sizes and a
  repeating step stops searching after a step or two; past that, the smallest kept block of a larger size serves
  it, then the pool's kept blocks join the pool, each merged with its free neighbours of the same segment, and the
  search runs again, and only then is the driver asked;
- a block is reused only in the order of the stream it was allocated on. When it was also used on other
  streams (`Block.record_stream`), its free records an event on each of them and the block is kept (as above)
  once every event has completed, which is checked by querying at the next allocation, never by waiting;
- when the driver is out of memory, or the reserve would pass `set_memory_limit`, the allocator waits for the
  pending events, returns every fully free segment to the driver (its own, then those of the allocators sharing its
  limit) and tries once more; then it raises `OutOfMemoryError` with the request and the state of the cache.

One limit caps a device: the allocators of CUDA graph pools (`graphs.Pool`) are made `sharing` the device allocator's,
so the limit applies to what all of them reserve together. A pool whose graph was captured is `frozen`: its free
segments stay reserved, since the graph replays in them.
"""
from __future__ import annotations

import bisect
import functools
import sys
import threading
import warnings
import weakref
from typing import Any, Protocol

from blutrain.backend.cuda import allocator_front

MiB = 1 << 20
MIN_BLOCK = 512              # every size is rounded up to a multiple of this
SMALL_SIZE = 1 * MiB         # requests up to this come from the small pool
SMALL_SEGMENT = 2 * MiB      # the small pool's segment size
MIN_LARGE_ALLOC = 10 * MiB   # requests under this get a MID_SEGMENT of their own
MID_SEGMENT = 20 * MiB
ROUND_LARGE = 2 * MiB        # larger segments are rounded up to this
GROWTH = 2.0                 # the reserve may grow to this many times the peak of allocated memory before kept blocks
                             # serve other sizes (`CachingAllocator._may_grow`)


class Driver(Protocol):
  """What the allocator needs from a device: raw allocations and events."""
  def malloc(self, nbytes: int) -> int: ...          # a device address; raises MemoryError when out of memory
  def free(self, ptr: int) -> None: ...
  def mem_get_info(self) -> tuple[int, int]: ...     # (free, total) bytes on the device
  def record_event(self, stream: Any) -> Any: ...    # an event recorded on stream: query() -> bool, synchronize()


class OutOfMemoryError(RuntimeError):
  """Raised when the device (or the limit set by `set_memory_limit`) cannot hold a requested allocation."""


def round_size(nbytes: int) -> int:
  """The size a request occupies: a multiple of 512 B, at least 512 B."""
  return max(MIN_BLOCK, (nbytes + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK)


def segment_size(size: int) -> int:
  """The driver allocation that serves a rounded request of `size` bytes when no cached block fits."""
  if size <= SMALL_SIZE: return SMALL_SEGMENT
  if size < MIN_LARGE_ALLOC: return MID_SEGMENT
  return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


def reserve_for(sizes) -> int:
  """The bytes of the segments that new requests of `sizes` bytes, made in order from empty pools and all kept, take:
  the small and the mid-sized ones packed into their pools' segments one after another, each large one a segment of
  its own. What the allocator reserves to hold them, at most (cached blocks may serve some)."""
  total, room = 0, {SMALL_SEGMENT: 0, MID_SEGMENT: 0}
  for n in sizes:
    size = round_size(n)
    seg = segment_size(size)
    if size >= MIN_LARGE_ALLOC: total += seg
    else:
      if room[seg] < size: total, room[seg] = total + seg, seg
      room[seg] -= size
  return total


def format_size(n: int) -> str:
  for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
    if abs(n) >= scale: return f"{n / scale:.2f} {unit}"
  return f"{n} bytes"


_SID_SHIFT, _SIZE_SHIFT = 112, 56


def _key(sid: int, size: int, ptr: int) -> int:
  """A free block's place in its pool: ordered by stream, then size, then address, as one int (which compares
  faster than a tuple); sizes and addresses stay below 2**56."""
  return sid << _SID_SHIFT | size << _SIZE_SHIFT | ptr


class _Block:
  """A piece of one segment, linked to its neighbours in address order."""
  __slots__ = ("ptr", "size", "requested", "kept_as", "stream", "sid", "small", "pooled", "prev", "next",
               "stream_uses", "events")

  def __init__(self, ptr: int, size: int, stream: Any, sid: int, small: bool):
    self.ptr, self.size, self.requested, self.kept_as = ptr, size, 0, 0
    self.stream, self.sid, self.small = stream, sid, small
    self.pooled = False  # free in a pool, where a freed neighbour merges with it
    self.prev, self.next, self.stream_uses, self.events = None, None, None, None

  def is_split(self) -> bool: return self.prev is not None or self.next is not None


class Block:
  """Device memory handed out by the allocator: `ptr`, `nbytes`, the device and the stream it was allocated on.

  It returns to the cache when it is garbage collected (or at `free()`); a use on another stream must be
  declared with `record_stream` so that the memory is reused only after that stream's work is done."""
  __slots__ = ("ptr", "nbytes", "device", "stream", "_b", "_alloc", "__weakref__")

  def __init__(self, ptr: int, nbytes: int, device: int, stream: Any, b: _Block | None, alloc: CachingAllocator | None):
    self.ptr, self.nbytes, self.device, self.stream, self._b, self._alloc = ptr, nbytes, device, stream, b, alloc

  def record_stream(self, stream: Any) -> None:
    """Mark this memory as used by work queued on `stream`, as torch.Tensor.record_stream."""
    if stream is not self.stream and self._b is not None:
      uses = self._b.stream_uses
      if uses is None: self._b.stream_uses = {stream}
      else: uses.add(stream)

  def free(self) -> None:
    b, self._b = self._b, None
    if b is not None: self._alloc._release(b)

  def __del__(self, _finalizing=sys.is_finalizing):  # bound early: at exit this module's globals may be None
    b = self._b
    if b is not None and not _finalizing(): self._alloc._release(b)

  def __repr__(self) -> str:
    return f"Block(ptr=0x{self.ptr:x}, nbytes={self.nbytes}, device={self.device})"


@functools.cache
def _native():
  """The C front's module (`allocator_front`), or None where it does not build: the allocator then runs in Python
  alone, which costs ~1 us more a request (with a warning saying why)."""
  try: return allocator_front.build()
  except Exception as e:  # noqa: BLE001 (no compiler, headers or cache: any of them only costs speed)
    warnings.warn(f"blutrain: the allocator's C front did not build ({type(e).__name__}: {e}); allocating in Python "
                  f"alone. Install a C compiler (gcc or clang) to build it.", RuntimeWarning, stacklevel=3)
    return None


class _Stat:
  __slots__ = ("current", "peak")

  def __init__(self): self.current = self.peak = 0

  def add(self, n: int) -> None:
    self.current = c = self.current + n
    if c > self.peak: self.peak = c


class CachingAllocator:
  """A stream-aware caching allocator for one device over `driver`; with `sharing`, under that allocator's limit,
  which then caps what both (and every other allocator sharing it) reserve together."""

  def __init__(self, driver: Driver, device: int = 0, sharing: CachingAllocator | None = None, native: bool = True):
    native = _native() if native else None
    self.driver, self.device = driver, device
    self.root = self if sharing is None else sharing.root  # the allocator that holds the limit
    self._limit: int | None = None
    self.pools: weakref.WeakSet[CachingAllocator] = weakref.WeakSet()  # on the root: the allocators sharing it
    self._joint, self._joint_lock = _Stat(), threading.Lock()  # on the root: reserved by it and those sharing it
    if sharing is not None: self.root.pools.add(self)
    self.frozen = False  # keep free segments reserved (a CUDA graph replays in them)
    # new segments may serve requests that kept blocks of other sizes could (`_may_grow`): on a device's allocator,
    # whose steps repeat; a graph pool's serves one capture, whose memory it keeps
    self._growing = sharing is None
    self._pools: dict[bool, list[int]] = {True: [], False: []}  # small? -> sorted keys of its free blocks
    self._free: dict[int, _Block] = {}
    self._kept: dict[int, list[_Block]] = {}   # _key(stream id, size, 0) -> freed blocks of that size, not pooled yet
    self._kept_keys: list[int] = []            # the keys of _kept in order (best fit bisects them)
    self._pending: list[_Block] = []            # freed, waiting for events on other streams
    self._sids: dict[Any, int] = {}
    self._lock = threading.Lock()
    self._deferred: list[_Block] = []           # frees that arrived while the lock was held (GC, other threads)
    stat = native.Stat if native else _Stat
    self._stats = {k: stat() for k in ("allocated", "reserved", "active", "requested", "segments")}
    self._allocated, self._requested, self._active = (self._stats[k] for k in ("allocated", "requested", "active"))
    self._counts = {"num_device_alloc": 0, "num_device_free": 0, "num_alloc_retries": 0, "num_ooms": 0}
    # the C front serves kept hits (allocator_front.py) and calls the methods below for the rest; Blocks made here
    # give their memory back through it
    self._front, self._block = None, Block
    if native:
      self._block, self._front = native.Block, native.Front(
        self, type(self).malloc, type(self)._release, self._kept, self._sids, self._deferred, self._pending,
        self._lock.locked, self._allocated, self._requested, self._active, device, MIN_BLOCK, _SID_SHIFT,
        _SIZE_SHIFT)
      self.malloc = self._front

  # *** allocation ***

  def malloc(self, nbytes: int, stream: Any) -> Block:
    """A block of at least `nbytes` bytes usable in the order of `stream`. (With the C front, `malloc` is the front,
    which serves a kept block of the request's size itself and calls this for the rest.)"""
    if nbytes == 0: return Block(0, 0, self.device, stream, None, None)
    size = (nbytes + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK  # round_size(nbytes > 0), inline: the hot path
    with self._lock:
      if self._deferred: self._drain()
      if self._pending: self._process_events()
      sid = self._sids.get(stream)
      if sid is None: sid = self._sids[stream] = len(self._sids)
      kept = self._kept.get(key := sid << _SID_SHIFT | size << _SIZE_SHIFT)  # _key(sid, size, 0)
      b = kept.pop() if kept else self._best_fit(nbytes, size, stream, sid)
      b.requested, b.kept_as = nbytes, key
      st = self._allocated
      st.current += b.size
      if st.current > st.peak: st.peak = st.current
      st = self._requested
      st.current += nbytes
      if st.current > st.peak: st.peak = st.current
      st = self._active
      st.current += 1
      if st.current > st.peak: st.peak = st.current
    if self._deferred: self._try_drain()
    return self._block(b.ptr, nbytes, self.device, stream, b, self)

  def _best_fit(self, nbytes: int, size: int, stream: Any, sid: int) -> _Block:
    """A block for a request of `size` (nbytes rounded) that no kept block of its size serves: the smallest free
    block of this stream's pool that fits; else a new segment while the cache may grow (`_may_grow`); else the
    smallest kept block of a larger size; else the smallest once the pool's kept blocks are merged; else a new
    segment. Split to `size` when the rest is worth keeping."""
    small, seg = size <= SMALL_SIZE, segment_size(size)
    b = self._take_pooled(small, sid, size)
    if b is None and self._may_grow(seg):
      b = self._new_segment(seg, stream, sid, small)
      self._growing = b is not None  # a refusal (the limit, the driver) stops growth until the cache is emptied
    if b is None: b = self._take(small, sid, size)
    if b is None and self._kept:
      self._pool_kept(small)
      b = self._take(small, sid, size)
    if b is None:
      b = self._new_segment(seg, stream, sid, small)
      if b is None:
        self._counts["num_alloc_retries"] += 1
        self._release_cached(wait=True)
        for other in (self.root, *self.root.pools):
          if other is not self: other._release_if_idle()
        b = self._new_segment(seg, stream, sid, small)
      if b is None:
        self._counts["num_ooms"] += 1
        raise OutOfMemoryError(self._oom_message(nbytes, seg))
    if b.size - size >= (MIN_BLOCK if small else SMALL_SIZE + 1):
      rest = _Block(b.ptr + size, b.size - size, stream, sid, small)
      rest.prev, rest.next = b, b.next
      if b.next is not None: b.next.prev = rest
      b.next, b.size = rest, size
      self._return(rest)
    return b

  def _may_grow(self, seg: int) -> bool:
    """Whether a new segment may serve a request that the pool cannot, rather than kept blocks of other sizes: while
    the memory reserved stays within GROWTH times the peak of allocated memory. Kept blocks then stay with their
    sizes, so a repeating training step finds each request's size kept from its last step after a step or two;
    taking them for other sizes (and merging them when none fits) moves memory between sizes step after step, each
    time through this search (ResNet-18 on the H200: ~70-100 of its ~415 requests a step, and 1-3 merges of every
    kept block of a pool; its cache settles at 1.45 times its peak, its stem's 196 MiB activation the last to grow).
    Once the limit or the driver refuses a segment, the cache stops growing until `empty_cache`. A CUDA graph pool's
    allocator (`sharing` another's limit) never grows so: a capture runs once, and its pool keeps what it reserved."""
    return self._growing and self._stats["reserved"].current + seg <= GROWTH * self._allocated.peak

  def _take_pooled(self, small: bool, sid: int, size: int) -> _Block | None:
    """The smallest block of this stream's pool that fits, out of the pool."""
    pool = self._pools[small]
    i = bisect.bisect_left(pool, _key(sid, size, 0))
    if i == len(pool) or pool[i] >= _key(sid + 1, 0, 0): return None
    b = self._free.pop(pool.pop(i))
    b.pooled = False
    return b

  def _take(self, small: bool, sid: int, size: int) -> _Block | None:
    """The smallest free block of this stream and pool that fits, pooled or kept (by the size it is kept under)."""
    lo, end = _key(sid, size, 0), _key(sid + 1, 0, 0)
    pool = self._pools[small]
    i = bisect.bisect_left(pool, lo)
    pooled = pool[i] if i < len(pool) and pool[i] < end else end
    hi = min(pooled, _key(sid, SMALL_SIZE + 1, 0)) if small else pooled  # kept under <= 1 MiB: small pool
    keys = self._kept_keys
    j = bisect.bisect_left(keys, lo)
    while j < len(keys) and keys[j] < hi:  # the smallest kept size that fits; emptied lists go on the way
      kept = self._kept[keys[j]]
      if kept: return kept.pop()
      del self._kept[keys[j]], keys[j]
    if pooled == end: return None
    b = self._free.pop(pool.pop(i))
    b.pooled = False
    return b

  def _new_segment(self, seg: int, stream: Any, sid: int, small: bool) -> _Block | None:
    root = self.root
    with root._joint_lock:
      if root._limit is not None and root._joint.current + seg > root._limit: return None
      root._joint.add(seg)  # claimed before the driver call, so that two allocators cannot both pass the limit
    try: ptr = self.driver.malloc(seg)
    except MemoryError:
      self._reserve_jointly(-seg)
      return None
    self._counts["num_device_alloc"] += 1
    self._stats["reserved"].add(seg); self._stats["segments"].add(1)
    return _Block(ptr, seg, stream, sid, small)

  def _reserve_jointly(self, n: int) -> None:
    with self.root._joint_lock: self.root._joint.add(n)

  # *** free ***

  def _release(self, b: _Block) -> None:
    """Called by Block.free: take the lock if free, else leave the block for the next operation."""
    if not self._lock.acquire(False):  # non-blocking
      self._deferred.append(b)
      return
    try:
      self._allocated.current -= b.size
      self._requested.current -= b.requested
      if b.stream_uses: self._wait_for_uses(b)
      else:  # _keep(b), inline: the hot path
        self._active.current -= 1
        kept = self._kept.get(b.kept_as)
        if kept is None:
          self._kept[b.kept_as] = [b]
          bisect.insort(self._kept_keys, b.kept_as)
        else: kept.append(b)
    finally: self._lock.release()

  def _free_block(self, b: _Block) -> None:
    self._allocated.current -= b.size
    self._requested.current -= b.requested
    if b.stream_uses: self._wait_for_uses(b)
    else: self._keep(b)

  def _wait_for_uses(self, b: _Block) -> None:
    """Record an event on each other stream that used b; b is kept once they have all completed."""
    b.events = [self.driver.record_event(s) for s in b.stream_uses]
    b.stream_uses = None
    self._pending.append(b)

  def _keep(self, b: _Block) -> None:
    """Keep a block whose memory no stream still uses for the next request of its size (as rounded for its last
    request: a block larger than that, whose rest was not worth a split, serves it again) and stream."""
    self._active.current -= 1
    kept = self._kept.get(b.kept_as)
    if kept is None:
      self._kept[b.kept_as] = [b]
      bisect.insort(self._kept_keys, b.kept_as)
    else: kept.append(b)

  def _return(self, b: _Block) -> None:
    """Put a free block in its pool, merged with its free neighbours."""
    for nb in (b.prev, b.next):
      if nb is not None and nb.pooled:
        self._remove(nb)
        if nb is b.prev: b.ptr, b.prev = nb.ptr, nb.prev
        else: b.next = nb.next
        b.size += nb.size
    if b.prev is not None: b.prev.next = b
    if b.next is not None: b.next.prev = b
    self._insert(b)

  def _pool_kept(self, small: bool | None = None) -> None:
    """Return the kept blocks of one pool (or all) to their pools, so that best fit sees that memory merged."""
    for key, kept in list(self._kept.items()):
      if small is None or not kept or kept[0].small == small:
        del self._kept[key]
        for b in kept: self._return(b)
    self._kept_keys = sorted(self._kept)

  def _process_events(self) -> None:
    still = []
    for b in self._pending:
      if all(e.query() for e in b.events):
        b.events = None
        self._keep(b)
      else: still.append(b)
    self._pending[:] = still  # the same list: the C front reads it

  def _drain(self) -> None:
    while self._deferred: self._free_block(self._deferred.pop())

  def _try_drain(self) -> None:
    if self._lock.acquire(blocking=False):
      try: self._drain()
      finally: self._lock.release()

  def _release_if_idle(self) -> None:
    """`_release_cached(wait=True)` unless another thread is inside this allocator (an OOM in one allocator frees
    the others' caches; waiting for their locks could deadlock)."""
    if self._lock.acquire(blocking=False):
      try:
        self._drain()
        self._release_cached(wait=True)
      finally: self._lock.release()

  def _release_cached(self, wait: bool) -> None:
    """Return every fully free segment to the driver (none when `frozen`); with `wait`, first wait for pending
    cross-stream frees."""
    self._growing = self.root is self
    if wait:
      for b in self._pending:
        for e in b.events: e.synchronize()
    self._process_events()
    self._pool_kept()
    if self.frozen: return
    for small in (True, False):
      for b in [self._free[k] for k in self._pools[small]]:
        if b.is_split(): continue
        self._remove(b)
        self.driver.free(b.ptr)
        self._counts["num_device_free"] += 1
        self._stats["reserved"].add(-b.size); self._stats["segments"].add(-1)
        self._reserve_jointly(-b.size)

  def __del__(self):
    """An allocator sharing another's limit (a graph pool's) returns its segments when it is collected: every block
    it handed out, and every graph captured in it, is gone by then (they hold it)."""
    if self.root is not self and not sys.is_finalizing():
      self.frozen = False
      self._drain()
      self._release_cached(wait=True)

  # *** pools ***

  def _insert(self, b: _Block) -> None:
    key = _key(b.sid, b.size, b.ptr)
    self._free[key], b.pooled = b, True
    bisect.insort(self._pools[b.small], key)

  def _remove(self, b: _Block) -> None:
    key = _key(b.sid, b.size, b.ptr)
    pool = self._pools[b.small]
    del pool[bisect.bisect_left(pool, key)]
    del self._free[key]
    b.pooled = False

  # *** public state ***

  def empty_cache(self) -> None:
    """Return the cached segments that hold no allocation to the driver (pending cross-stream frees are queried,
    not waited for)."""
    with self._lock:
      self._drain()
      self._release_cached(wait=False)

  @property
  def limit(self) -> int | None:
    """The cap on what this allocator and those sharing its limit reserve together (None: no cap)."""
    return self.root._limit

  def set_memory_limit(self, nbytes: int | None) -> None:
    """Cap the memory reserved from the driver, by this allocator and every allocator sharing its limit together, at
    `nbytes` (None: no cap); emulates a smaller card."""
    if nbytes is not None and nbytes < 0: raise ValueError(f"set_memory_limit: expected a size >= 0, got {nbytes}")
    self.root._limit = None if nbytes is None else int(nbytes)

  def reset_peak_memory_stats(self) -> None:
    with self._lock:
      self._drain()
      for s in self._stats.values(): s.peak = s.current
    with self._joint_lock: self._joint.peak = self._joint.current

  def memory_stats(self) -> dict[str, int]:
    """PyTorch's flat statistics: '<stat>.all.current' / '.peak' and counters. `inactive_split_bytes` is the
    free memory inside segments that also hold allocations: what fragmentation costs. On an allocator others share
    (the device's), `pools_reserved_bytes` is what they reserve (CUDA graph pools) and `limited_reserved_bytes`
    (current and peak) what the limit caps: its own reserve and theirs."""
    with self._lock:
      self._drain()
      self._process_events()
      self._pool_kept()
      out = {}
      for name, key in (("allocated_bytes", "allocated"), ("reserved_bytes", "reserved"), ("active", "active"),
                        ("requested_bytes", "requested"), ("segment", "segments")):
        s = self._stats[key]
        out[f"{name}.all.current"], out[f"{name}.all.peak"] = s.current, s.peak
      split = [b for b in self._free.values() if b.is_split()]
      out["inactive_split.all.current"] = len(split)
      out["inactive_split_bytes.all.current"] = sum(b.size for b in split)
      out["cached_free_bytes.all.current"] = sum(b.size for b in self._free.values())
      out["pending_free_bytes.all.current"] = sum(b.size for b in self._pending)
      out.update(self._counts)
    if self.root is self:
      out["pools_reserved_bytes.all.current"] = sum(a._stats["reserved"].current for a in list(self.pools))
      with self._joint_lock:
        out["limited_reserved_bytes.all.current"] = self._joint.current
        out["limited_reserved_bytes.all.peak"] = self._joint.peak
    return out

  def _oom_message(self, nbytes: int, seg: int) -> str:
    st, free_blocks = self._stats, self._free.values()
    cached, split = sum(b.size for b in free_blocks), sum(b.size for b in free_blocks if b.is_split())
    try:
      free, total = self.driver.mem_get_info()
      device = f"the device has {format_size(free)} free of {format_size(total)} total"
    except Exception as e:  # the message must not fail because the driver could not answer
      device = f"the device's free memory could not be read ({e})"
    limit = "" if self.limit is None else f"the limit set by set_memory_limit is {format_size(self.limit)}; "
    root, reserved = self.root, format_size(st['reserved'].current)
    pools = list(root.pools)
    if pools:  # the limit caps the device allocator and the graph pools together: both figures
      mine = "the device's caching allocator" if self is root else "a CUDA graph pool's caching allocator"
      pooled = sum(a._stats["reserved"].current for a in pools)
      total = root._stats["reserved"].current + pooled
      reserved = (f"{format_size(total)} in all ({format_size(root._stats['reserved'].current)} by the device's "
                  f"caching allocator, {format_size(pooled)} by the caching allocators of {len(pools)} CUDA graph "
                  f"pool(s), which hold the temporaries of compiled steps); the request came to {mine}, which has reserved "
                  f"{reserved}")
    return (f"CUDA out of memory on cuda:{self.device}: tried to allocate {format_size(nbytes)} (a new segment of "
            f"{format_size(seg)}). State: {limit}{device}; blutrain has reserved {reserved},"
            f" of which {format_size(st['allocated'].current)} is allocated to tensors and {format_size(cached)} is "
            f"free in the cache ({format_size(split)} of it in split segments, i.e. fragmentation). Hint: free tensors "
            f"you no longer need (del, evaluate under bt.no_grad()), reduce the batch size or sequence length, or "
            f"train in bfloat16 under bt.autocast"
            + (", or raise the limit with bt.cuda.set_memory_limit." if limit else "."))
