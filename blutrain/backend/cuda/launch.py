"""Triton as a compiler only: a @triton.jit function becomes an sm_90 cubin, which cuda.core loads and the driver's
cuLaunchKernel launches on our streams. Triton's own launcher (which needs torch) never runs; compiling needs no GPU.

A signature maps each argument to a Triton type: "*fp32" (a pointer), "i32", "i64", "fp32", "bf16", ... or
"constexpr" (arguments named in `constexprs` may be left out). A ":16" suffix ("*fp32:16", "i32:16") promises that
the pointer or integer is a multiple of 16, which lets Triton vectorize memory accesses; the caller must keep the
promise (the allocator's blocks start 512-byte aligned). Compiled kernels are cached in memory and on disk
($BLUTRAIN_CACHE_DIR/triton, default ~/.cache/blutrain/triton), keyed by the function's source (with the
functions it calls), the signature, constexprs, options, target and Triton's version.

Launch: Triton 3.6 kernels take two more pointers after the signature's arguments, a global scratch buffer and a
profiler scratch buffer, each `grid size * size` bytes when the metadata's size is non-zero (else NULL); all of
Triton's shared memory is dynamic, and above 48 KiB the kernel must opt in to it. A launch on its arrays' stream
hands the arguments to the C launcher (`runtime.launch_args_function`, see `launcher`), which packs them by the
parameters' kinds (`_kinds`, made once per kernel) on its stack and calls the driver's cuLaunchKernel with the rest
of its arguments made once per grid; in a training step's launches that packing took 6-10 % off the host
time of a fake-GPU ResNet-18 step. The rest (half-precision scalars, scratch buffers, other streams, values C
refuses) is packed in Python: each Kernel generates one packing function at creation, which writes the arguments
into 8-byte parameter slots with a single `struct` call, in a buffer of the calling thread's own, so threads may
launch one kernel at once. On the H200 machine the driver's own work is 3.8 us of a bare launch.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import struct
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from blutrain import backend
from blutrain.backend.cuda import launcher, runtime
from blutrain.backend.cuda.array import CudaArray

TARGET = ("cuda", 90, 32)  # backend, compute capability, warp size: the H100/H200
SHARED_DEFAULT = 48 << 10   # dynamic shared memory a kernel may use without opting in

# the C type of each scalar argument, as Triton's launcher passes it
_SCALARS: dict[str, Any] = {"i1": np.int8, "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
                            "u1": np.uint8, "u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "u64": np.uint64,
                            "fp16": np.float16, "fp32": np.float32, "f32": np.float32, "fp64": np.float64}
# each parameter's `struct` format in its 8-byte slot (little-endian; the driver copies the parameter's size from the
# slot's start); bf16 goes as its 16 bits
_SLOTS = {"*": "Q", "i1": "b7x", "i8": "b7x", "i16": "h6x", "i32": "i4x", "i64": "q", "u1": "B7x", "u8": "B7x",
          "u16": "H6x", "u32": "I4x", "u64": "Q", "fp16": "e6x", "bf16": "H6x", "fp32": "f4x", "f32": "f4x",
          "fp64": "d"}
_SCRATCH = struct.Struct("<QQ")  # the two scratch pointers after the parameters


def _bf16(v) -> np.uint16:
  """The bits of v rounded to bfloat16: Triton passes a bf16 scalar as 16 bits."""
  return np.array(v, ml_dtypes.bfloat16).view(np.uint16)[()]


def cache_dir() -> Path:
  return backend.cache_dir("triton")


# *** compile ***

@dataclass(frozen=True)
class Compiled:
  """A cubin and what launching it needs; this is what the disk cache holds."""
  name: str
  params: tuple[tuple[str, str], ...]  # (name, type) of the arguments the kernel takes, constexprs removed
  num_warps: int
  num_ctas: int
  shared: int
  global_scratch_size: int
  global_scratch_align: int
  profile_scratch_size: int
  profile_scratch_align: int
  launch_cooperative_grid: bool
  launch_pdl: bool
  cubin: bytes


def _parse_signature(fn, signature: dict[str, str], constexprs: dict[str, Any]) -> tuple[dict, dict]:
  """Triton's signature in argument order and its attrs (tt.divisibility for ":16" types)."""
  names = fn.arg_names
  unknown = (set(signature) | set(constexprs)) - set(names)
  if unknown: raise TypeError(f"{fn.__name__}: signature/constexprs name {sorted(unknown)}, not arguments of {names}")
  sig, attrs = {}, {}
  for i, name in enumerate(names):
    ty = signature.get(name, "constexpr" if name in constexprs else None)
    if ty is None:
      raise TypeError(f"{fn.__name__}: argument {name!r} has no type in the signature and no constexpr value")
    if ty == "constexpr" and name not in constexprs:
      raise TypeError(f"{fn.__name__}: constexpr argument {name!r} needs a value in constexprs")
    base, _, div = ty.partition(":")
    if div:
      if div != "16":
        raise ValueError(f"{fn.__name__}: argument {name!r}: only ':16' divisibility is supported, got {ty!r}")
      attrs[(i,)] = [["tt.divisibility", 16]]
    if base != "constexpr" and base[0] != "*" and base not in _SCALARS and base != "bf16":
      raise TypeError(f"{fn.__name__}: argument {name!r} has type {base!r}; expected a pointer '*T', "
                      f"one of {sorted(_SCALARS) + ['bf16']} or 'constexpr'")
    sig[name] = base
  return sig, attrs


def _const_key(v: Any) -> str:
  return v.cache_key if hasattr(v, "cache_key") else repr(v)


def _disk_key(fn, sig: dict, constexprs: dict, attrs: dict, num_warps: int, num_stages: int) -> str:
  import triton
  parts = [fn.cache_key, repr(list(sig.items())), repr(sorted((k, _const_key(v)) for k, v in constexprs.items())),
           repr(sorted(attrs.items())), f"warps={num_warps},stages={num_stages}", repr(TARGET), triton.__version__]
  return hashlib.sha256("|".join(parts).encode()).hexdigest()


_memory: dict[Any, Compiled] = {}
_lock = threading.Lock()


def compiled(fn, signature: dict[str, str], constexprs: dict[str, Any] | None = None, num_warps: int = 4,
             num_stages: int = 3) -> Compiled:
  """The cubin of `fn` for sm_90 with its launch metadata, from the memory or disk cache or freshly compiled."""
  constexprs = constexprs or {}
  try:
    mem_key = (fn, tuple(signature.items()), tuple(constexprs.items()), num_warps, num_stages)
    hit = _memory.get(mem_key)
  except TypeError:  # an unhashable constexpr value
    mem_key, hit = None, None
  if hit is not None: return hit
  sig, attrs = _parse_signature(fn, signature, constexprs)
  key = _disk_key(fn, sig, constexprs, attrs, num_warps, num_stages)
  path = cache_dir() / key
  c = _read(path)
  if c is None:  # outside the lock: threads compile side by side (Triton's compile releases the GIL for most of it)
    c = _compile(fn, sig, constexprs, attrs, num_warps, num_stages)
    _write(path, c)
  if mem_key is not None:
    with _lock: c = _memory.setdefault(mem_key, c)
  return c


def _compile(fn, sig: dict, constexprs: dict, attrs: dict, num_warps: int, num_stages: int) -> Compiled:
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource
  src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
  k = triton.compile(src, target=GPUTarget(*TARGET), options={"num_warps": num_warps, "num_stages": num_stages})
  md = k.metadata
  return Compiled(md.name, tuple((n, t) for n, t in sig.items() if t != "constexpr"), md.num_warps, md.num_ctas,
                  md.shared, md.global_scratch_size, md.global_scratch_align, md.profile_scratch_size,
                  md.profile_scratch_align, bool(md.launch_cooperative_grid), bool(md.launch_pdl), k.asm["cubin"])


def _read(path: Path) -> Compiled | None:
  try:
    meta = json.loads(path.with_suffix(".json").read_text())
    cubin = path.with_suffix(".cubin").read_bytes()
  except (OSError, ValueError):
    return None
  meta["params"] = tuple(tuple(p) for p in meta["params"])
  return Compiled(**meta, cubin=cubin)


def _write(path: Path, c: Compiled) -> None:
  """Cubin first, metadata last, each by an atomic rename: a reader that finds the .json finds the cubin."""
  meta = asdict(c)
  del meta["cubin"]
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    for suffix, data in ((".cubin", c.cubin), (".json", json.dumps(meta).encode())):
      tmp = path.with_suffix(f"{suffix}.tmp{os.getpid()}.{threading.get_ident()}")
      tmp.write_bytes(data)
      os.replace(tmp, path.with_suffix(suffix))
  except OSError:
    pass  # a read-only cache only costs recompilation


def cubin(fn, signature: dict[str, str], constexprs: dict[str, Any] | None = None, num_warps: int = 4,
          num_stages: int = 3) -> bytes:
  """The sm_90 cubin of `fn` (compiles without a GPU; CI uses it to check that every kernel compiles)."""
  return compiled(fn, signature, constexprs, num_warps, num_stages).cubin


def compile(fn, signature: dict[str, str], constexprs: dict[str, Any] | None = None, num_warps: int = 4,
            num_stages: int = 3) -> Kernel:
  """`fn` compiled for sm_90 as a launchable Kernel (see the module's docstring for the signature's types)."""
  return Kernel(compiled(fn, signature, constexprs, num_warps, num_stages))


# *** launch ***

def _pointer(v: Any, kernel: str, name: str) -> int:
  """The address behind a pointer argument that is not a CudaArray."""
  if v is None: return 0
  if isinstance(v, int): return v
  if hasattr(v, "data_ptr"): return v.data_ptr()
  raise TypeError(f"{kernel}: argument {name!r} is a pointer; got {type(v).__name__} (pass a CudaArray, an int address "
                  f"or None)")


class _Parameters:
  """One thread's parameter buffer of a kernel: an 8-byte slot per parameter (the two scratch pointers last) and the
  array of the slots' addresses, which cuLaunchKernel reads them through (`address`: that array's)."""
  __slots__ = ("slots", "addresses", "address")

  def __init__(self, n: int):
    self.slots = (ctypes.c_uint64 * n)()
    base = ctypes.addressof(self.slots)
    self.addresses = (ctypes.c_void_p * n)(*range(base, base + 8 * n, 8))
    self.address = ctypes.addressof(self.addresses)


class Kernel:
  """A loaded kernel: `kernel(grid, *args, stream=None)` queues it on `stream` (default: the current stream).

  `grid` is an int or a tuple of up to 3 ints (blocks); arguments follow the signature minus constexprs: CudaArrays
  (or int addresses, or None) for pointers, numbers for scalars. A launch packs the arguments into the calling
  thread's parameter buffer with one `struct` call (which also checks their types and ranges) and calls the
  driver's cuLaunchKernel."""

  def __init__(self, c: Compiled):
    if c.num_ctas > 1 or c.launch_cooperative_grid or c.launch_pdl:
      raise NotImplementedError(f"{c.name}: clusters, cooperative and programmatic-dependent launches are not "
                                f"supported (num_ctas={c.num_ctas})")
    if max(c.global_scratch_align, c.profile_scratch_align) > 512:
      raise RuntimeError(f"{c.name}: scratch alignment above the allocator's 512 B")
    self.compiled, self.name, self.num_warps, self.shared = c, c.name, c.num_warps, c.shared
    self._loaded: dict[int, Any] = {}       # device -> cuda.core Kernel, kept alive with its library
    self._launches: dict[Any, tuple] = {}   # grid -> (device, number of programs, the launch's head: the kernel's
    # CUfunction in the device's context, grid, block and shared memory, as ints)
    self._buffers: dict[int, _Parameters] = {}  # thread id -> its parameter buffer
    self._scratch = c.global_scratch_size > 0 or c.profile_scratch_size > 0
    self._n_params = len(c.params)
    self._kinds = None if self._scratch else launcher.kinds([t for _, t in c.params])  # None: pack in Python
    self._launch_args: launcher.LaunchArgs | None = None
    self._pack, self._owners = self._codegen(c)

  def _codegen(self, c: Compiled):
    """Two functions specialized to this signature: one packing the arguments into a parameter buffer, one listing
    the arguments' memory owners (for uses on streams other than the default stream)."""
    names = [name for name, _ in c.params]
    env: dict[str, Any] = {"_CA_": CudaArray, "_ptr_": _pointer, "_bf16_": _bf16,
                           "_pack_into_": struct.Struct("<" + "".join(_SLOTS[ty if ty[0] != "*" else "*"]
                                                                      for _, ty in c.params)).pack_into}
    items, owners = [], []
    for a, ty in c.params:
      if ty[0] == "*":
        items.append(f"{a}.ptr if {a}.__class__ is _CA_ else _ptr_({a}, {c.name!r}, {a!r})")
        owners.append(f"{a}.owner if {a}.__class__ is _CA_ else None")
      else: items.append(f"_bf16_({a})" if ty == "bf16" else a)
    args = ", ".join(names)
    src = (f"def {c.name}(_slots_, {args}):\n  _pack_into_(_slots_, 0, {', '.join(items)})\n"
           f"def _owners_({args}):\n  return ({''.join(x + ', ' for x in owners)})\n")
    exec(src, env)  # noqa: S102 (generated from the signature's types only)
    return env[c.name], env["_owners_"]

  def _pack_checked(self, slots, args: tuple) -> None:
    """Pack arguments that `struct` refused, converted as numpy converts them (a float32 overflows to inf; an
    integer out of its type's range still raises), or raise naming the kernel and the parameter."""
    params = self.compiled.params
    if len(args) != len(params):
      raise TypeError(f"{self.name}: takes {len(params)} arguments {[n for n, _ in params]}, got {len(args)}")
    values = []
    for (name, ty), v in zip(params, args):
      if ty[0] == "*":
        values.append(v.ptr if v.__class__ is CudaArray else _pointer(v, self.name, name))
        continue
      try:
        if ty == "bf16": values.append(_bf16(v))
        else:
          with np.errstate(over="ignore"): values.append(_SCALARS[ty](v).item())
      except (TypeError, ValueError, OverflowError) as e:
        raise type(e)(f"{self.name}: argument {name!r} ({ty}) cannot take {v!r}: {e}") from None
    self._pack(slots, *values)

  def _load(self, device: int) -> Any:
    """The kernel loaded on `device` (once): cuda.core's Kernel, a CUkernel (its library kept alive with it)."""
    fn = self._loaded.get(device)
    if fn is not None: return fn
    from cuda.core import ObjectCode
    st = runtime.state(device)
    fn = ObjectCode.from_cubin(self.compiled.cubin, name=self.name).get_kernel(self.name)
    props, attrs = st.properties, fn.attributes
    if 32 * self.num_warps > attrs.max_threads_per_block:
      raise RuntimeError(f"{self.name}: {32 * self.num_warps} threads ({self.num_warps} warps) exceed the "
                         f"{attrs.max_threads_per_block} this kernel can run per block on cuda:{device} (registers: "
                         f"{attrs.num_regs} per thread); compile it with fewer warps")
    if self.shared > SHARED_DEFAULT:
      limit = props.shared_memory_per_block_optin - attrs.shared_size_bytes
      if self.shared > limit:
        raise RuntimeError(f"{self.name}: needs {self.shared} bytes of shared memory per block, cuda:{device} allows "
                           f"{limit}; compile it with smaller blocks or fewer stages")
      drv = runtime.driver()
      runtime.check(drv.cuKernelSetAttribute(drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                             limit, fn.handle, device), f"{self.name}: opting in to shared memory")
    self._loaded[device] = fn
    return fn

  def _grid_dims(self, grid: Any) -> tuple[int, int, int]:
    """`grid` (an int or up to 3 ints) as CUDA's three grid dims, checked against CUDA's limits."""
    g = (grid,) if isinstance(grid, int) else tuple(grid)
    if not 1 <= len(g) <= 3 or not all(isinstance(n, (int, np.integer)) and n >= 0 for n in g):
      raise ValueError(f"{self.name}: grid must be an int or a tuple of 1 to 3 non-negative ints, got {grid!r}")
    g = tuple(int(n) for n in g) + (1,) * (3 - len(g))
    if g[0] >= 2**31 or g[1] > 65535 or g[2] > 65535:
      raise ValueError(f"{self.name}: grid {g} exceeds CUDA's limits (x < 2^31, y and z <= 65535)")
    return g

  def _prepare(self, grid: Any, device: int) -> tuple:
    """The launch entry of `grid` on `device`: (device, number of programs, the launch's head: the kernel's handle,
    grid, block and shared memory); no programs: nothing to launch."""
    g = self._grid_dims(grid)
    drv = runtime.driver()
    self._launch = runtime.launch_function()
    if self._kinds is not None: self._launch_args = runtime.launch_args_function()
    fn = runtime.check(drv.cuKernelGetFunction(drv.CUkernel(int(self._load(device).handle))),
                       f"{self.name}: cuKernelGetFunction on cuda:{device}")
    head = (int(fn), *g, 32 * self.num_warps, 1, 1, self.shared)
    if len(self._launches) > 4096: self._launches.clear()
    entry = self._launches[grid] = (device, math.prod(g), head)
    return entry

  def _parameters(self) -> _Parameters:
    buf = self._buffers[threading.get_ident()] = _Parameters(self._n_params + 2)
    return buf

  def __call__(self, grid: Any, *args: Any, stream: runtime.Stream | None = None) -> None:
    s = runtime.launch_stream(stream)
    entry = self._launches.get(grid)
    if entry is None or entry[0] != s.device: entry = self._prepare(grid, s.device)
    _, programs, head = entry
    if not programs: return
    err = None
    if self._launch_args is not None and s.is_default:  # packed in C; what it refuses, Python packs or explains
      try: err = self._launch_args(head, s.handle, self._kinds, args)
      except (TypeError, OverflowError): pass
    if err is None: err = self._launch_packed(s, programs, head, args)
    if err: runtime.check((err,), f"launching {self.name} on cuda:{s.device}")

  def _launch_packed(self, s: runtime.Stream, programs: int, head: tuple, args: tuple) -> int:
    """Launch with the arguments packed in Python, into this thread's parameter buffer; arguments' memory used on a
    stream other than its own is recorded there, and scratch buffers are allocated when the kernel has them."""
    buf = self._buffers.get(threading.get_ident()) or self._parameters()
    try: self._pack(buf.slots, *args)
    except (struct.error, TypeError, OverflowError): self._pack_checked(buf.slots, args)
    if not s.is_default:
      for o in self._owners(*args):
        if o is not None and o.stream is not s: o.record_stream(s)
    if self._scratch:  # freed as this returns, into the stream's pool: a reuse is queued behind this launch
      c = self.compiled
      scratch = [s.allocator.malloc(programs * size, s) for size in (c.global_scratch_size, c.profile_scratch_size)]
      _SCRATCH.pack_into(buf.slots, 8 * self._n_params, scratch[0].ptr, scratch[1].ptr)
    return self._launch(head, s.handle, buf.address)

  def __repr__(self) -> str:
    c = self.compiled
    return f"Kernel({self.name}, warps={c.num_warps}, shared={c.shared}, params={[p for p, _ in c.params]})"
