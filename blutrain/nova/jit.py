"""`bt.compile`: guard, capture, compile (with a disk cache keyed by structural hash) and replay.

Every call is captured or replayed; none runs eagerly. A capture that creates persistent tensors (the optimizer's
state on the first step, lazily made buffers) makes them graph outputs: its graph runs once, and the runtime gives
those tensor objects real storage holding the values computed, so that the next call's guard (the state now exists)
captures the steady-state graph, which later calls replay. Returned tensors are plain values detached from autograd:
Nova compiles whole steps, so backward runs inside the compiled function.
"""
from __future__ import annotations

import functools
import operator
import os
import time
from collections import Counter
from itertools import chain, repeat
from pathlib import Path
from typing import Any, Callable

import numpy as np

from blutrain import amp, backend, backends, shapes
from blutrain.backend import collective
from blutrain.device import Device
from blutrain.backend.cuda.allocator import OutOfMemoryError, format_size
from blutrain.nova.capture import Arg, Ref, StaleGraph, Trace
from blutrain.autograd.tape import grad_mode, hooks
from blutrain.tensor import Tensor, Traced


# *** pytrees of call arguments and results ***

def flatten(x: Any) -> tuple[list, Any]:
  """Leaves (tensors and other values) and a structure to rebuild from them; tuples, lists, dicts recurse."""
  leaves: list = []

  def walk(v):
    if isinstance(v, (tuple, list)): return (type(v), tuple(walk(e) for e in v))
    if isinstance(v, dict): return (dict, tuple((k, walk(e)) for k, e in v.items()))
    leaves.append(v)
    return None
  return leaves, walk(x)


def unflatten(tree: Any, leaves: list) -> Any:
  it = iter(leaves)

  def build(t):
    if t is None: return next(it)
    kind, items = t
    if kind is dict: return {k: build(e) for k, e in items}
    return kind(build(e) for e in items)
  return build(tree)


# *** what a function touches: modules and optimizers (duck-typed: nova sits below nn and optim) ***

def _is_module(x) -> bool: return hasattr(x, "named_parameters") and hasattr(x, "training")
def _is_optimizer(x) -> bool: return hasattr(x, "param_groups") and hasattr(x, "state")


def discover(fn: Callable, leaves: list) -> tuple[list, list]:
  """Modules and optimizers `fn` reaches: itself, its bound object (and that object's attributes), its
  closure cells, the globals its code names, and the call's arguments; and the optimizers an optimizer wraps
  (ZeroRedundancyOptimizer's local one, whose state is the real one)."""
  roots = list(leaves) + [fn]
  func = fn
  if hasattr(fn, "__self__"):
    roots.append(fn.__self__)
    roots.extend(vars(fn.__self__).values() if hasattr(fn.__self__, "__dict__") else ())
    func = fn.__func__
  code = getattr(func, "__code__", None)
  if code is not None:
    roots.extend(c.cell_contents for c in func.__closure__ or () if c.cell_contents is not None)
    roots.extend(func.__globals__[n] for n in code.co_names if n in func.__globals__)
  modules, optimizers, seen = [], [], set()
  for obj in roots:
    if id(obj) in seen: continue
    seen.add(id(obj))
    if _is_module(obj): modules.append(obj)
    elif _is_optimizer(obj):
      optimizers.append(obj)
      roots.extend(v for v in vars(obj).values() if _is_optimizer(v))
  return modules, optimizers


class Persistent:
  """Where a step keeps tensors across calls that it may create lazily: its optimizers' per-parameter state, its
  modules' buffers and tensor attributes. Made before a capture, it remembers what they held: the traced tensors found
  there afterwards are the ones the capture created (`created`), and `restore` takes them out again when the capture
  fails, so that the state is as it was before the call."""

  def __init__(self, modules: list, optimizers: list):
    self.modules, self.optimizers = modules, optimizers
    self.before = {id(d): dict(d) for d in self._dicts()}

  def _dicts(self):
    for o in self.optimizers: yield from o.state.values()
    for top in self.modules:
      for m in top.modules(): yield from (m._buffers, vars(m))

  def _traced(self):
    for d in self._dicts():
      for k, v in d.items():
        if isinstance(v, Tensor) and type(v._storage.data) is Traced: yield d, k, v

  def created(self) -> list[Tensor]:
    """The traced tensors the containers hold now, one per storage."""
    seen: dict[int, Tensor] = {}
    for _, _, t in self._traced(): seen.setdefault(id(t._storage), t)
    return list(seen.values())

  def restore(self) -> None:
    """Put back what each container held before the capture in place of the traced tensors it holds now."""
    for d, k, _ in list(self._traced()):
      before = self.before.get(id(d), {})
      if k in before: d[k] = before[k]
      else: del d[k]


def _tree(modules, optimizers) -> tuple[list, list[Tensor]]:
  """(every module under the top ones, depth first; their parameters and the optimizers' after them, each once),
  from one walk of each module tree: the guard asks for both at every call."""
  mods = [m for top in modules for m in top.modules()]
  seen, params = set(), []
  for group in ([p for m in mods for p in m.parameters(recurse=False)],
                [p for o in optimizers for g in o.param_groups for p in g["params"]]):
    for p in group:
      if id(p) not in seen:
        seen.add(id(p))
        params.append(p)
  return mods, params


_GRAD, _TRAINING, _STATE = operator.attrgetter("grad"), operator.attrgetter("training"), operator.attrgetter("state")
_REQUIRE_SYNC, _GROUPS = operator.attrgetter("require_sync"), operator.attrgetter("param_groups")
_PARAMS = operator.itemgetter("params")
_IS_TENSOR = functools.partial(type.__instancecheck__, Tensor)


def _state_tensors(optimizers: list):
  """The tensors in the optimizers' states, in order (an iterator)."""
  per_parameter = chain.from_iterable(map(dict.values, map(_STATE, optimizers)))
  return filter(_IS_TENSOR, chain.from_iterable(map(dict.values, per_parameter)))


def _hashable(v: Any) -> Any:
  try:
    hash(v)
    return (type(v).__name__, v)
  except TypeError:
    return (type(v).__name__, id(v))


# *** the executable ***

def _memory(a) -> int:
  """The identity of the memory an array views: a numpy array's root base, a CudaArray's owner."""
  if isinstance(a, np.ndarray):
    while isinstance(a.base, np.ndarray): a = a.base
    return id(a)
  return id(getattr(a, "owner", a))


class Executable:
  """A compiled graph bound to where its inputs come from and where its outputs go, run kernel by kernel. A graph
  that creates persistent tensors (`once`) is run once, by the call that captured it."""

  def __init__(self, fn: Callable, trace: Trace, spec: list, out_tree: Any, device: Device, info: dict):
    self.fn, self.sources, self.spec, self.out_tree, self.device, self.info = fn, trace.sources, spec, out_tree, device, info
    self.once = any(kind == "new" for kind, _ in spec)
    self.persistent: Persistent | None = None  # of a graph run once: what to restore when its run fails
    self.rng_advance = trace.rng_advance
    self.out_dtypes = [v.dtype for v in trace.graph.outputs]
    self.collectives = dict(Counter(e.attrs["group"] for e in trace.graph.equations if e.op in collective.KERNELS))
    # the last call's host seconds: the guard (and any capture), and on the GPU the binding, the run (a replay: the
    # graph's launch) and the delivery of the outputs
    self.host_s: dict[str, float] = info.setdefault("host_s", {})

  def _input(self, source, leaves) -> np.ndarray:
    return source.array(leaves) if hasattr(source, "array") else source.tensor(leaves)._array()

  def run(self, leaves: list) -> Any:
    inputs = [self._input(s, leaves) for s in self.sources]
    collective.check(self.collectives)
    outs = self.fn(*inputs)
    if self.device.type == "cuda": collective.watch(self.collectives)
    return self._deliver(leaves, inputs, outs)

  def _deliver(self, leaves: list, inputs: list, outs, replayed: bool = False, owned: set | None = None,
               entries: list[int] | None = None) -> Any:
    """Hand the step's outputs over: returned tensors, gradients, and the write-backs of updated inputs. After a
    graph's replay (`replayed`) the write-backs are done and every returned tensor is copied out of the graph's
    buffers. `owned`: the memories of `inputs` (`_memory`), when the caller keeps them; the set is added to.
    `entries`: the outputs to hand over (default all), when the caller did the others' version bumps itself."""
    be = backend.get(self.device)
    copy = _copy if self.device.type == "cuda" else be.kernels["copy"]  # (keeping a channels-last array's layout)
    owned = {_memory(a) for a in inputs} if owned is None else owned
    given = () if replayed else {id(a) for a in inputs}
    returned = []
    for i in range(len(self.spec)) if entries is None else entries:
      (kind, where), arr, dtype = self.spec[i], outs[i], self.out_dtypes[i]
      if kind == "new":  # a created tensor gets memory of its own: never an input's, nor another output's
        if _memory(arr) in owned: arr = copy(arr)
        owned.add(_memory(arr))
        t = Tensor._wrap(arr, self.device, dtype)
        where._storage.data, where._view = t._storage.data, t._view
        where._strides, where._offset = t._strides, t._offset
        continue
      if kind == "write":  # an update the step made in the input's own memory needs no copy
        if not replayed and id(arr) not in given: be.copy_into(where.tensor(leaves)._array(), arr)
        where.storage_of(leaves).version += 1
        continue
      if _memory(arr) in owned or replayed and kind == "return": arr = copy(arr)  # never hand out views of inputs
      if kind == "return":
        owned.add(_memory(arr))
        returned.append(Tensor._wrap(arr, self.device, dtype))
      else:
        p = where()
        if p is None: raise StaleGraph("a parameter the compiled graph updates was freed")
        if p.grad is not None and p.grad._view is arr: p.grad._storage.version += 1  # a replay rewrote it in place
        else: p.grad = Tensor._wrap(arr, self.device, dtype)
    for gen, n in self.rng_advance: gen.offset += n
    return unflatten(self.out_tree, returned)


_DATA = operator.attrgetter("data")


def cuda_graphs_enabled() -> bool:
  """Whether compiled GPU steps replay as CUDA graphs (`BLUTRAIN_CUDA_GRAPHS=0` runs them kernel by kernel)."""
  return os.environ.get("BLUTRAIN_CUDA_GRAPHS", "1") != "0"


COMPILE_THREADS = max(2, min(16, os.cpu_count() or 1))  # Triton compiles side by side (`_compile_ahead`)


def _position(sources: list, source) -> int:
  """Where `source` is in `sources`, by identity: sources compare what they refer to (`list.index` would compare a
  gradient's parameter with others elementwise)."""
  return next(i for i, s in enumerate(sources) if s is source)


class GraphExecutable(Executable):
  """A compiled GPU step replayed as one CUDA graph.

  Its inputs are bound to fixed device buffers: a call's own tensors (the batch) are copied into buffers of the
  executable, dynamic scalars (the learning rate) written into device scalars, and memory that lives across calls
  (parameters, gradients, optimizer state) is used where it is, which each call checks (memory that moved means a
  recapture). The first run goes kernel by kernel on those buffers (compiling every kernel, filling the caches); the
  second captures the step, with the write-backs of updated inputs, into a CUDA graph (`backend.cuda.graphs`) whose
  intermediates come from a private pool; each run after that copies the batch in and launches the graph. Outputs
  that are gradients stay in the graph's buffers, which the next replay overwrites (as gradients are updated in place);
  returned tensors are copied out."""

  def __init__(self, *args):
    super().__init__(*args)
    self.static: list | None = None
    self.channels_last = _conv_images(args[1], args[2])  # positions of the batch's images, bound channels-last
    self.pool = self.graph = None
    self.outs: tuple = ()
    self.bound: tuple = ([], [])  # the storages' weak references of the sources living across calls (Refs), their data
    self.fed: list = []    # (source, buffer) of each other source: what a call copies in or checks
    # found once (`run`): the call's tensors written back and their buffers, the buffers' memories, the storages
    # living across calls that the step updates (weak references), the other outputs' positions in the spec
    self.replay: tuple | None = None

  def _bind(self, leaves: list) -> list:
    from blutrain.backend.cuda import memory, runtime
    if self.static is None:
      self.static = [memory.from_numpy(np.asarray(s.array(leaves))) if hasattr(s, "array") else
                     _copy(s.tensor(leaves)._array(), i in self.channels_last) if isinstance(s, Arg) else
                     s.tensor(leaves)._array() for i, s in enumerate(self.sources)]
      refs = [s.storage for s in self.sources if isinstance(s, Ref)]
      self.bound = (refs, [s.storage_of(leaves).data for s in self.sources if isinstance(s, Ref)])
      self.fed = [(s, buf) for s, buf in zip(self.sources, self.static) if not isinstance(s, Ref)]
      return self.static
    refs, datas = self.bound  # memory living across calls: its layout is the source's own, so only it can move
    try:
      moved = not all(map(operator.is_, map(_DATA, [ref() for ref in refs]), datas))
    except AttributeError:  # a storage was freed (its tensor replaced, as `p.data = ...` does)
      moved = True
    if moved:
      raise StaleGraph("memory a CUDA graph reads moved or was freed (a parameter or optimizer state was replaced)")
    stream = runtime.current_stream(self.static[0].device if self.static else None)
    for s, buf in self.fed:
      if hasattr(s, "array"):
        host = np.ascontiguousarray(s.array(leaves), buf.dtype.np)  # a scalar's float64, a generator's int64
        memory.copy_h2d(buf.ptr, host.ctypes.data, host.nbytes, stream)
      elif isinstance(s, Arg): memory.copy_into(buf, s.tensor(leaves)._array())
      else:
        a = s.tensor(leaves)._array()
        if (a.ptr, a.strides) != (buf.ptr, buf.strides):
          raise StaleGraph("memory a CUDA graph reads moved (a parameter, gradient or optimizer state was replaced)")
    return self.static

  def _step(self) -> tuple:
    """The step on the bound buffers, with the write-backs of updated inputs into them."""
    from blutrain.backend.cuda import memory
    outs = self.fn(*self.static)
    given = {id(a) for a in self.static}
    for (kind, where), arr in zip(self.spec, outs):
      if kind == "write" and id(arr) not in given: memory.copy_into(self.static[_position(self.sources, where)], arr)
    return outs

  def planned_peak(self) -> int:
    """The step's memory by its plan: its bound inputs (parameters, gradients, optimizer state, the batch) and the
    arena of its intermediates, and for a graph run once the copies of the tensors it creates, made out of the arena
    before the arena is given back."""
    inputs = {(a.ptr, a.nbytes) for a in self.static or ()}
    return sum(n for _, n in inputs) + getattr(self.fn, "arena_bytes", 0) + self.info.get("created_bytes", 0)

  def _oom(self, e: OutOfMemoryError, what: str) -> OutOfMemoryError:
    from blutrain.backend.cuda import runtime
    arena, peak = getattr(self.fn, "arena_bytes", 0), self.planned_peak()
    limit = runtime.state(self.static[0].device if self.static else None).allocator.limit
    budget = self.info.get("memory_budget")
    return OutOfMemoryError(
      f"bt.compile: the compiled step does not fit in memory ({what}): its plan's peak is {format_size(peak)} (inputs "
      f"{format_size(peak - arena)}, intermediates {format_size(arena)} in one arena), under "
      + ("no memory limit" if limit is None else f"a limit of {format_size(limit)} (bt.cuda.set_memory_limit, over the "
         "device allocator and the graph pools together)")
      + ("" if budget is None else f" and a memory budget of {format_size(budget)}")
      + ". Pass bt.compile(step, memory_budget=...) (blutrain train --memory-budget) to recompute activations until "
      f"the plan fits, reduce the batch size, or raise the limit. {e}")

  def _run_once(self) -> tuple:
    """Run a graph that creates persistent tensors, the one time it runs: kernel by kernel in a pool holding its
    plan's arena (`self.pool`, given back after the call), the tensors it creates and the gradients it leaves copied
    out of the pool into memory of their own, so that nothing of the call stays beside the next graph's arena."""
    from blutrain.backend.cuda import graphs
    try:
      self.pool = graphs.Pool(self.static[0].device if self.static else None, getattr(self.fn, "arena_bytes", 0))
      self.info["planned_peak_bytes"] = self.planned_peak()
      self._compile_ahead(self.pool)
      outs = self.pool.run(self._step)
      return tuple(_copy(a) if kind in ("new", "grad") else a for (kind, _), a in zip(self.spec, outs))
    except OutOfMemoryError as e:
      if self.pool is not None: self.pool.release()
      raise self._oom(e, "running it once, kernel by kernel, to create its persistent state") from e

  def _compile_ahead(self, pool) -> None:
    """Before the first run, in its pool: a dry run of the step on scratch arrays (`_scratch`), in which no Triton
    kernel launches and each one not compiled yet compiles on one of COMPILE_THREADS threads (`kernels.
    compiling_ahead`), so the first run finds them compiled instead of compiling one after another (GPT-2's first step
    met 40 variants, 10-11 s of compiling on one core). The other work it meets runs, on the scratch memory and the
    pool's arena (which the first run then reuses): GEMMs, copies, and the elementwise, reduction and fill kernels
    compiled before (see `kernels.Spec.kernel`). Skipped for steps with collectives (the ranks' dry runs could disagree)
    and for a step whose code came from the disk cache: its kernels were compiled with it, into the same cache, and
    loading them one by one costs less than the dry run. A failure (the scratch not fitting, say) only leaves the
    compiling to the first run; `info["compile_ahead"]` says what happened."""
    from blutrain.backend.cuda.kernels import compiling_ahead
    if self.collectives or not self.static or "compile_ahead" in self.info: return
    if self.info.get("cache") == "hit":
      self.info["compile_ahead"] = "not needed: the step's code and its kernels came from the disk cache"
      return
    try:
      scratch = _scratch(self.static)
      with compiling_ahead(COMPILE_THREADS) as compiled:
        pool.run(lambda: self.fn(*scratch))
      pool.stream.synchronize()  # the dry run's GEMMs and copies still read and write the scratch memory
      self.info["compile_ahead"] = f"{len(compiled)} kernels on {COMPILE_THREADS} threads"
    except Exception as e:  # noqa: BLE001 (an optimization: the first run compiles what is left)
      self.info["compile_ahead"] = f"skipped: {type(e).__name__}: {e}"

  def run(self, leaves: list) -> Any:
    from blutrain.backend.cuda import graphs, memory, runtime
    t0 = time.perf_counter()
    collective.check(self.collectives)
    static = self._bind(leaves)
    t1 = time.perf_counter()
    if self.once: outs = self._run_once()
    elif self.pool is None:  # kernel by kernel, warming every kernel and cache up, and the pool with what it needs
      pool = None
      try:
        pool = graphs.Pool(static[0].device if static else None, getattr(self.fn, "arena_bytes", 0))
        self._compile_ahead(pool)
        outs = pool.run(self._step)
      except OutOfMemoryError as e:
        if pool is not None: pool.release()
        raise self._oom(e, "running it kernel by kernel before its capture") from e
      self.pool = pool
      self.info["planned_peak_bytes"] = self.planned_peak()
    else:
      if self.graph is None:
        try: self.graph, self.outs = self.pool.capture(self._step)
        except OutOfMemoryError as e: raise self._oom(e, "capturing it into a CUDA graph") from e
        self.info.update(graph_nodes=self.graph.nodes, graph_pool_bytes=self.pool.nbytes(),
                         graph_arena_bytes=self.pool.arena.nbytes if self.pool.arena else 0)
      self.graph.replay()
      outs = self.outs
    collective.watch(self.collectives)
    t2 = time.perf_counter()
    if self.replay is None:  # what every call after a replay does, found once: NOTE: walking the spec (an entry
      # per parameter and optimizer state) and the static buffers' memories each call took a third of the host path
      kept = [i for i, (kind, where) in enumerate(self.spec) if kind == "write" and isinstance(where, Ref)]
      self.replay = ([(where, static[_position(self.sources, where)]) for kind, where in self.spec
                      if kind == "write" and isinstance(where, Arg)], frozenset(_memory(a) for a in static),
                     [self.spec[i][1].storage for i in kept], sorted(set(range(len(self.spec))) - set(kept)))
    arg_writes, owned, updated, entries = self.replay
    for where, buf in arg_writes:  # a call's own tensor updated in place gets its buffer's new value
      memory.copy_into(where.tensor(leaves)._array(), buf)
    for ref in updated: ref().version += 1  # alive: `_bind` checked each of them
    try:
      return self._deliver(leaves, static, outs, replayed=True, owned=set(owned), entries=entries)
    finally:
      self.host_s.update(bind=t1 - t0, run=t2 - t1, deliver=time.perf_counter() - t2)
      if self.once:  # the copies out of the pool are queued: let them finish before its memory is given back
        runtime.current_stream(static[0].device if static else None).synchronize()
        self.pool.release()


def _scratch(arrays: list) -> list:
  """Arrays of the shapes, strides and dtypes of `arrays` (aligned as the allocator aligns), all over one buffer the
  size of the largest span (negative strides included): what a dry run reads and writes instead of the step's real
  inputs, for the memory of one."""
  from blutrain import dtypes
  from blutrain.backend.cuda import memory
  from blutrain.backend.cuda.array import CudaArray
  spans = [memory.span(a.shape, a.strides) if a.size else (0, 0) for a in arrays]
  buf = memory.empty((max([(hi - lo) * a.dtype.itemsize for a, (lo, hi) in zip(arrays, spans)], default=0) or 1,),
                     dtypes.uint8, arrays[0].device)
  return [CudaArray(buf.ptr - lo * a.dtype.itemsize, a.shape, a.strides, a.dtype, a.device, buf)
          for a, (lo, _) in zip(arrays, spans)]


def _copy(a, channels_last: bool = False):
  """A device copy of a CudaArray in its dense layout (a call's tensor's own buffer in a graph: a channels-last batch
  stays channels-last), contiguous when it is not dense; channels-last when asked (`_conv_images`)."""
  from blutrain.backend.cuda import memory
  from blutrain.backend.cuda.kernels import empty_like, empty_ordered
  out = empty_ordered(a.shape, a.dtype, a.device, shapes.channels_last.order(4)) if channels_last else empty_like(a)
  memory.copy_into(out, a)
  return out


def _conv_images(trace: Trace, spec: list) -> frozenset[int]:
  """The positions of a step's 4-D arguments that reach a 2-D convolution's input (through casts), which a GPU step
  binds channels-last: each kernel writes its output in its input's dense layout, so the whole network then runs
  channels-last, the layout cuDNN's Hopper kernels compute in (NCHW operands cost a transpose before and after each
  convolution). Values are the same in any layout; none when a returned tensor or a gradient has 4 dims, whose
  strides the caller would see change."""
  g = trace.graph
  if any(kind in ("return", "grad", "new") and len(v.shape) == 4 for (kind, _), v in zip(spec, g.outputs)):
    return frozenset()
  casts = {e.outs[0]: e.inputs[0] for e in g.equations if e.op == "cast"}
  images = set()
  for e in g.equations:
    if e.op == "conv" and len(e.inputs[0].shape) == 4:
      x = e.inputs[0]
      while x in casts: x = casts[x]
      images.add(x)
  return frozenset(i for i, (s, v) in enumerate(zip(trace.sources, g.inputs)) if isinstance(s, Arg) and v in images)


def held_outside(trace: Trace, leaves: list) -> int:
  """Bytes under the device's memory limit that a step captured on the GPU cannot plan into: what the device allocator
  holds besides the step's inputs that live across calls (parameters, optimizer state: they count as the step's), the
  free memory in its segments that also hold allocations (which the arena cannot take, nor the cache give back), what
  graph pools reserve (other compiled steps), and what the step's own pool makes besides its arena: the cuBLASLt
  workspace for its stream and a segment for kernels' own temporaries (split reductions' partials, a few MiB).
  0 when no limit is set (nothing is then read)."""
  from blutrain.backend.cuda import runtime
  from blutrain.backend.cuda.allocator import MID_SEGMENT
  from blutrain.backend.cuda.kernels.cublaslt import WORKSPACE
  allocator = runtime.state(trace.graph.device.index).allocator
  if allocator.limit is None: return 0
  stats = allocator.memory_stats()
  inputs = {(a.ptr, a.nbytes) for a in (s.tensor(leaves)._array() for s in trace.sources
                                        if not isinstance(s, Arg) and not hasattr(s, "array"))}
  own = sum(n for _, n in inputs)
  return (max(stats["allocated_bytes.all.current"] - own, 0) + stats["inactive_split_bytes.all.current"]
          + stats["pools_reserved_bytes.all.current"] + WORKSPACE + MID_SEGMENT)


# *** compile with a disk cache ***

def build(graph, dump_dir: str | None, written: dict[int, int] | None = None, memory_budget: int | None = None,
          target: str = "cpu") -> tuple[Callable, dict]:
  """Compile a captured graph to a function of the target's arrays, reusing the generated code cached under its
  structural hash and the target (and the memory budget and the remat and fusion switches, which change the code). A
  cache entry that cannot be read or loaded is ignored and rebuilt."""
  from blutrain.nova import hashing, loader
  t0 = time.perf_counter()
  key = hashing.graph_key(graph)
  if os.environ.get("BLUTRAIN_NOVA_REMAT") == "0": key += "-noremat"
  elif memory_budget is not None: key += f"-budget{memory_budget}"
  if os.environ.get("BLUTRAIN_NOVA_FUSE") == "0": key += "-nofuse"
  if os.environ.get("BLUTRAIN_GEMM_PATH"): key += f"-gemm{os.environ['BLUTRAIN_GEMM_PATH']}"
  path = backend.cache_dir("nova", f"v{hashing.FORMAT_VERSION}-{hashing.source_digest()}", target, f"{key}.py")
  info: dict = {"key": key, "hash_s": time.perf_counter() - t0}
  if path.is_file() and not dump_dir:
    try:
      fn = loader.load(path.read_text())
      info.update(cache="hit", source=str(path))
      return fn, info
    except Exception:  # NOTE: any damage to a cache file (truncated, edited) just means a rebuild
      path.unlink(missing_ok=True)
  from blutrain.nova import pipeline  # the compiler (xDSL, the passes) loads only on a cache miss
  compiled = pipeline.compile_graph(graph, dump_dir=Path(dump_dir) / key if dump_dir else None, written=written,
                                    memory_budget=memory_budget, target=target)
  info.update(cache="miss", source=str(path), counts_before=compiled.counts_before, counts_after=compiled.counts_after,
              timings=compiled.timings, arena_bytes=compiled.memory.arena, live_peak_bytes=compiled.memory.lower_bound,
              remat=compiled.remat and compiled.remat.info(), gemms=compiled.gemms)
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(compiled.source)
    os.replace(tmp, path)
  except OSError:
    info["cache"] = "miss (not written)"
  return compiled.fn, info


class Compiled:
  """The callable `bt.compile(fn)` returns. `.info` describes the last capture (timings, op counts, cache) and, in
  `host_s`, the host seconds of its graph's last call (guard, and on the GPU bind, run, deliver)."""

  def __init__(self, fn: Callable, dump_ir: str | None = None, memory_budget: int | str | None = None):
    self.fn, self.dump_ir, self.memory_budget = fn, dump_ir, memory_budget
    if memory_budget is not None:  # a bad size fails here, not at the second call
      from blutrain.nova.budget import parse_size
      parse_size(memory_budget)
    self._entries: dict = {}
    self._found: tuple[list, list] | None = None
    self._walked: tuple | None = None  # (registry version, optimizers' parameter ids, modules, synced, parameters, ids)
    self.captures = 0
    self.info: dict = {}
    functools.update_wrapper(self, fn, updated=())

  def _guard(self, leaves: list, tree: Any) -> tuple:
    """The key of a captured graph: everything that changes what the eager step would compute or which tensors it
    reads (modules' training flags, and DistributedDataParallel's `require_sync`, which `no_sync()` clears). Global
    state among it (grad mode, autocast, float32 matmul precision, the CUDA matmul and convolution engines) is read
    here because a capture bakes it into the graph's ops and attributes. NOTE: the per-parameter and per-state parts
    are built by C-level `map`s: the guard runs at every call, and a step shorter than its host work waits on it."""
    mods, synced, params, ids = self._tree()
    optimizers = self._found[1]
    return (tree, grad_mode.enabled, amp.state(), backends.get_float32_matmul_precision(), backends.matmul,
            backends.conv,
            tuple([(x.shape, x.dtype, x.device, x.requires_grad) if isinstance(x, Tensor) else _hashable(x)
                   for x in leaves]),
            ids, tuple(map(operator.is_, map(_GRAD, params), repeat(None))),
            tuple(map(_TRAINING, mods)), tuple(map(_REQUIRE_SYNC, synced)),
            tuple([(id(g),) + tuple(sorted((k, _hashable(v)) for k, v in g.items() if k not in ("params", "lr")))
                   for o in optimizers for g in o.param_groups]),
            tuple(map(id, _state_tensors(optimizers))))

  def _tree(self) -> tuple[list, list, list[Tensor], tuple[int, ...]]:
    """`_tree` of the step's modules and optimizers (and the modules among them with a `require_sync` flag), and the
    parameters' ids; walked again only when a module registry changed since the last walk
    (`Module.registry_version`) or an optimizer's groups hold other parameters."""
    modules, optimizers = self._found
    version = getattr(modules[0], "registry_version", None) if modules else 0
    held = list(map(id, chain.from_iterable(map(_PARAMS, chain.from_iterable(map(_GROUPS, optimizers))))))
    cached = self._walked
    if cached is None or version is None or cached[0] != version or cached[1] != held:
      mods, params = _tree(modules, optimizers)
      synced = [m for m in mods if "require_sync" in m.__dict__]
      cached = self._walked = (version, held, mods, synced, params, tuple(map(id, params)))
    return cached[2:]

  def __call__(self, *args, **kwargs):
    t0 = time.perf_counter()
    leaves, tree = flatten((args, kwargs))
    if self._found is None: self._found = discover(self.fn, leaves)
    key = self._guard(leaves, tree)
    exe = self._entries.get(key) or self._capture(args, kwargs, leaves, key)
    exe.host_s["guard"] = time.perf_counter() - t0
    try:
      return _run(exe, leaves)
    except StaleGraph:
      self._entries.pop(key, None)
      return _run(self._capture(args, kwargs, leaves, key), leaves)

  def _capture(self, args, kwargs, leaves, key: tuple) -> Executable:
    """Capture and compile the call; its executable is kept under the guard's `key` unless it runs once (it creates
    persistent tensors, which exist by the next call)."""
    modules, optimizers = self._found
    params = self._tree()[2]
    device = next((x.device for x in leaves if isinstance(x, Tensor)), None) or (params[0].device if params else Device("cpu"))
    saved_grads = [(p, p.grad) for p in params]
    persistent = Persistent(modules, optimizers)
    trace = Trace(device, {id(p.grad): p for p in params if p.grad is not None})
    for i, x in enumerate(leaves):
      if isinstance(x, Tensor): trace.bind_arg(i, x)
    t0 = time.perf_counter()
    hooks.trace = trace
    try:
      try:
        out = self.fn(*args, **kwargs)
      finally:
        hooks.trace = None
      out_leaves, out_tree = flatten(out)
      returned = [x for x in out_leaves if isinstance(x, Tensor)]
      if any(x.requires_grad and x._node is not None for x in returned) and not trace.ran_backward:
        raise RuntimeError("bt.compile: the compiled function returns tensors that require grad but runs no backward. "
                           "Nova compiles whole steps: put loss.backward() and the optimizer step inside the compiled "
                           "function, or call it under bt.no_grad() for inference.")
      if len(returned) != len(out_leaves):
        raise TypeError("bt.compile: a compiled function may return tensors (in tuples, lists or dicts) only, got "
                        f"{[type(x).__name__ for x in out_leaves if not isinstance(x, Tensor)]}")
      created = persistent.created()
      spec = trace.finish(returned, created)
    except BaseException:  # the call leaves gradients and state as it found them
      for p, g in saved_grads: p.grad = g
      persistent.restore()
      raise
    for p, g in saved_grads:  # a gradient the capture replaced by a traced one (DDP's bucket views) is an output;
      if p.grad is not None and type(p.grad._storage.data) is Traced: p.grad = g  # the first run reads the old one
    capture_s = time.perf_counter() - t0
    written = {k: _position(trace.sources, where) for k, (kind, where) in enumerate(spec) if kind == "write"}
    from blutrain.nova.budget import step_budget
    # the tensors a graph creates are copied out of its arena at its end (on the GPU): the plan leaves room for them,
    # as the device allocator's segments hold them (GPT-2's 9 MiB moments two to a 20 MiB segment)
    sizes = [t.numel() * t.dtype.itemsize for t in created]
    created_bytes = sum(sizes)
    budget = step_budget(self.memory_budget, device, held_outside(trace, leaves) if device.type == "cuda" else 0)
    if budget is not None:
      from blutrain.backend.cuda.allocator import reserve_for
      budget = max(budget - (reserve_for(sizes) if device.type == "cuda" else created_bytes), 0)
    try:
      fn, info = build(trace.graph, self.dump_ir or os.environ.get("BLUTRAIN_DUMP_IR"), written, budget, device.type)
    except BaseException:
      persistent.restore()
      raise
    info.update(capture="initial: runs once, creating persistent state" if created else "steady",
                created=len(created), created_bytes=created_bytes, memory_budget=budget, capture_s=capture_s,
                equations=len(trace.graph.equations), inputs=len(trace.graph.inputs),
                outputs=len(trace.graph.outputs), total_s=time.perf_counter() - t0)
    self.captures += 1
    self.info = info
    graphed = device.type == "cuda" and cuda_graphs_enabled()
    if device.type == "cuda":
      info["cuda_graph"] = ("off: runs once, in a pool of its own" if created else "on") if graphed else \
        "off: BLUTRAIN_CUDA_GRAPHS=0"
    exe = (GraphExecutable if graphed else Executable)(fn, trace, spec, out_tree, device, info)
    if exe.once: exe.persistent = persistent
    else: self._entries[key] = exe
    return exe


def _run(exe: Executable, leaves: list) -> Any:
  """Run an executable; one that runs once puts the state it was to create back as it was when its run fails (an
  out-of-memory error), so that the next call captures the first call again."""
  try:
    return exe.run(leaves)
  except BaseException:
    if exe.once: exe.persistent.restore()
    raise


def compile(fn: Callable | None = None, *, dump_ir: str | None = None, memory_budget: int | str | None = None):
  """Compile a function (a whole training step, an inference function) or a module's forward with Nova.

  No call runs eagerly. A call with no graph for its guard captures forward, backward and optimizer update into one
  graph, optimizes it and runs it; later calls replay it while the guard (argument shapes, dtypes, devices,
  requires_grad, parameters and their gradients, training flags and DDP's no_sync(), optimizer hyperparameters
  except the learning rate, which is read at each call, and the optimizer's state; grad mode, autocast,
  `bt.set_float32_matmul_precision` and `bt.backends.matmul`) holds, and recapture when it does not. The first
  call's graph creates the persistent tensors a step makes lazily (the optimizer's state, buffers a module makes on
  its first forward) as outputs, runs once (under its own memory plan on the GPU, with no eager step), and leaves
  them as ordinary tensors; the second call captures the steady step (`info["capture"]` says which one a graph is).
  On the GPU the steady step runs kernel by kernel once, then is captured into one CUDA graph whose buffers follow
  the step's memory plan, and replays with one launch (`BLUTRAIN_CUDA_GRAPHS=0` runs it kernel by kernel every
  call). Random ops (dropout) read the generator's
  seed and offset from device memory, which each call sets, so a replay draws new numbers as eager mode would.
  Gradients the step leaves in `.grad` live in the graph's buffers, which the next call overwrites.

  Args:
    fn: the function or module; used as `@bt.compile` or `bt.compile(dump_ir="dir")(fn)`.
    dump_ir: a directory for the MLIR of the graph after capture and after each pass (also $BLUTRAIN_DUMP_IR).
    memory_budget: bytes (an int, or a size such as "10GiB") the step may take: its inputs (parameters, optimizer
      state, batch) plus its arena. Activations are then recomputed in the backward until the planned peak fits;
      `info["remat"]` (and a warning) says how far above it the step stays when it cannot. On a CUDA device the
      limit of `bt.cuda.set_memory_limit`, less the memory under it that is not the step's, also applies (it is the
      budget when none is given). Without either only cheap ops are recomputed (pointwise ops,
      layer norms, dropout masks, within a few percent of the step's FLOPs); `BLUTRAIN_NOVA_REMAT=0` turns
      rematerialization off.

  Example:
    >>> @bt.compile
    ... def train_step(x, y):
    ...   _, loss = model(x, y)
    ...   loss.backward()
    ...   opt.step(); opt.zero_grad()
    ...   return loss
  """
  if fn is None: return lambda f: Compiled(f, dump_ir, memory_budget)
  return Compiled(fn, dump_ir, memory_budget)


__all__ = ["compile", "Compiled", "Executable"]
