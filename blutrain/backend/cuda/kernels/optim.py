"""Multi-tensor fused AdamW and SGD: one launch updates every parameter of a group, PyTorch's update in the same order
of float32 operations as blutrain's per-parameter paths (blutrain/optim/adam.py, sgd.py), so both give the same numbers
(up to the GPU's fused multiply-adds). AdamW:

  step += 1;  bc1 = 1 - beta1^step;  bc2 = 1 - beta2^step                      (float64, as the step tensor)
  p = p * (1 - lr * weight_decay)
  m = m + (1 - beta1) * (g - m);  v = v * beta2 + ((1 - beta2) * g) * g
  p = p + (-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

SGD (g negated first when maximizing; the buffer b rounded to its dtype before the update reads it):

  g = g + p * weight_decay
  b = g (first step) or b * momentum + g * (1 - dampening);  g = g + b * momentum (nesterov) or b
  p = p + g * (-lr)

A table on the device holds each tensor's pointers (param, grad, state...) and size; a second one cuts the tensors
into chunks of CHUNK elements, one program each, so a launch covers any mix of sizes. The chunks' table is uploaded
once per set of sizes, the pointers' once per set of pointers (a step's new gradients often come in other blocks of
the caching allocator than the last step's). Pointers read from a table promise Triton nothing, so its loads and
stores would move 4 bytes at a time; when every pointer a kernel walks is 16-byte aligned and every size a multiple
of 4 (`_vectors`, checked on the host), the VECTORS variant says so (`_at`) and they move 16-byte vectors.
"""
from __future__ import annotations

import functools
import math
from collections import OrderedDict

import numpy as np
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from blutrain import dtypes
from blutrain.backend.cuda import memory
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import TL, dry, empty_like, f64_bits, run, spec, sqrt_rn
from blutrain.backend.cuda.kernels.copy import cat, copy
from blutrain.backend.cuda.kernels.reduce import reduce
from blutrain.configurator import MULTI_TENSOR_CHUNK, multi_tensor_schedule
from blutrain.shapes import is_dense, same_layout

CHUNK = MULTI_TENSOR_CHUNK  # elements per program


@triton.jit
def _row(table, chunks, WIDTH: tl.constexpr, CHUNK: tl.constexpr, VECTORS: tl.constexpr):
  """This program's chunk: its tensor's row of the table (WIDTH entries, pointers then the tensor's size) and the
  chunk's [start, end); with VECTORS the sizes are multiples of 4 (start is one of CHUNK)."""
  pid = tl.program_id(0)
  t = tl.load(chunks + 2 * pid)
  start = tl.load(chunks + 2 * pid + 1)
  row = table + t * WIDTH
  end = tl.minimum(start + CHUNK, tl.load(row + WIDTH - 1))
  if VECTORS:
    start = tl.multiple_of(start, 16)
    end = tl.multiple_of(end, 4)
  return row, start, end


@triton.jit
def _at(ptr, i, VECTORS: tl.constexpr, BLOCK: tl.constexpr):
  """ptr + i for a tile i of BLOCK consecutive indices from a multiple of 16; with VECTORS promised 16-byte aligned
  (the host checked the tensor's pointer), so the tile's loads and stores move 16-byte vectors."""
  p = ptr + i
  if VECTORS:
    p = tl.max_contiguous(tl.multiple_of(p, 16), BLOCK)
  return p


@triton.jit
def _steps_kernel(table, T, BLOCK: tl.constexpr):
  """step += 1 for every tensor of the table."""
  t = tl.arange(0, BLOCK)
  for t0 in range(0, T, BLOCK):
    rows = t0 + t
    p = tl.load(table + rows * 6 + 4, mask=rows < T, other=0).to(tl.pointer_type(tl.float64))
    tl.store(p, tl.load(p, mask=rows < T) + 1.0, mask=rows < T)


@triton.jit
def _learning_rate(lr_bits, lr_ptr, LR_PTR: tl.constexpr):
  """The float64 learning rate: lr_bits's bits, or with LR_PTR read from lr_ptr (so that a replayed CUDA graph reads
  each step's)."""
  if LR_PTR:
    lr = tl.load(lr_ptr)
  else:
    lr = lr_bits.to(tl.float64, bitcast=True)
  return lr


@triton.jit
def _gradient(g_ptrs, mask, clip, G: tl.constexpr, CLIP: tl.constexpr):
  """The gradient at g_ptrs as float32; with CLIP multiplied by the float32 clip as it is read and rounded to G, as
  the scale kernel stores it: by PTX's mul.rn, which is never contracted with the subtraction after it into an FMA
  (libdevice's mul_rn would flush subnormals)."""
  g = tl.load(g_ptrs, mask=mask).to(tl.float32)
  if CLIP:
    g = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [g, tl.broadcast_to(clip, g.shape)],
                                  dtype=tl.float32, is_pure=True, pack=1).to(G).to(tl.float32)
  return g


@triton.jit
def _adamw_kernel(table, chunks, lr_bits, lr_ptr, clip_ptr, beta1_bits, beta2_bits, wd_bits, one_minus_beta1, beta2,
                  one_minus_beta2, eps, P: tl.constexpr, G: tl.constexpr, DECAY: tl.constexpr, LR_PTR: tl.constexpr,
                  CLIP: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, VECTORS: tl.constexpr):
  """AdamW over one chunk; the learning rate and, with CLIP, the gradients' factor at clip_ptr as `_learning_rate` and
  `_gradient` read them."""
  row, start, end = _row(table, chunks, 6, CHUNK, VECTORS)
  p_ptr = tl.load(row).to(tl.pointer_type(P))
  g_ptr = tl.load(row + 1).to(tl.pointer_type(G))
  m_ptr = tl.load(row + 2).to(tl.pointer_type(P))
  v_ptr = tl.load(row + 3).to(tl.pointer_type(P))
  step = tl.load(tl.load(row + 4).to(tl.pointer_type(tl.float64)))
  lr = _learning_rate(lr_bits, lr_ptr, LR_PTR)
  decay = (1.0 - lr * wd_bits.to(tl.float64, bitcast=True)).to(tl.float32)
  bc1 = 1.0 - libdevice.pow(beta1_bits.to(tl.float64, bitcast=True), step)
  bc2 = 1.0 - libdevice.pow(beta2_bits.to(tl.float64, bitcast=True), step)
  step_size = (-lr / bc1).to(tl.float32)
  clip = tl.load(clip_ptr) if CLIP else 0.0
  bc2_sqrt = tl.sqrt(bc2).to(tl.float32)
  for off in range(start, end, BLOCK):
    i = off + tl.arange(0, BLOCK)
    mask = i < end
    ps, ms, vs = _at(p_ptr, i, VECTORS, BLOCK), _at(m_ptr, i, VECTORS, BLOCK), _at(v_ptr, i, VECTORS, BLOCK)
    p = tl.load(ps, mask=mask).to(tl.float32)
    g = _gradient(_at(g_ptr, i, VECTORS, BLOCK), mask, clip, G, CLIP)
    m = tl.load(ms, mask=mask).to(tl.float32)
    v = tl.load(vs, mask=mask).to(tl.float32)
    if DECAY:
      p = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + (one_minus_beta2 * g) * g
    denom = tl.div_rn(sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn(step_size * m, denom)
    tl.store(ps, p.to(P), mask=mask)
    tl.store(ms, m.to(P), mask=mask)
    tl.store(vs, v.to(P), mask=mask)


@functools.lru_cache(maxsize=4096)
def adamw_spec(param, grad, decay: bool, lr_on_device: bool = False, clip: bool = False, vectors: bool = False):
  sig = {"table": "*i64", "chunks": "*i64", "lr_bits": "i64", "lr_ptr": "*fp64", "clip_ptr": "*fp32",
         "beta1_bits": "i64", "beta2_bits": "i64", "wd_bits": "i64", "one_minus_beta1": "fp32", "beta2": "fp32",
         "one_minus_beta2": "fp32", "eps": "fp32"}
  block, warps = multi_tensor_schedule(4)  # param, grad, moments
  return spec(_adamw_kernel, sig, dict(P=TL[param], G=TL[grad], DECAY=decay, LR_PTR=lr_on_device, CLIP=clip,
                                       CHUNK=CHUNK, BLOCK=block, VECTORS=vectors), num_warps=warps)


_STEPS = spec(_steps_kernel, {"table": "*i64", "T": "i32"}, dict(BLOCK=256))
_tables: OrderedDict = OrderedDict()  # (device, width, walked, rows) -> the rows' device table, `_vectors`; newest last
_chunk_tables: OrderedDict = OrderedDict()  # (device, sizes) -> the chunks' table on the device, likewise


def host_tables(rows: list[int], width: int) -> tuple[np.ndarray, np.ndarray]:
  """The int64 table of rows (their flat list, `width` entries a row: pointers ending in the tensor's size) and that of
  (tensor, start) chunks, on the host."""
  return np.array(rows, np.int64).reshape(-1, width), _host_chunks(tuple(rows[width - 1::width]))


@functools.lru_cache(maxsize=64)
def _host_chunks(sizes: tuple[int, ...]) -> np.ndarray:
  counts = -(-np.array(sizes, np.int64) // CHUNK)
  first = np.repeat(np.cumsum(counts) - counts, counts)
  return np.stack([np.repeat(np.arange(len(sizes)), counts), (np.arange(int(counts.sum())) - first) * CHUNK], axis=1)


def _tables_for(rows: list[int], width: int, device: int, walked: int) -> tuple[CudaArray, CudaArray, bool]:
  """The device tables of rows (their flat list, `width` entries a row: pointers ending in the tensor's size) and of
  their (tensor, start) chunks, and whether the kernels may take the tensors in 16-byte vectors (`_vectors`). The
  tables are cached (not in a dry run: its pointers are scratch, and the tables would hold its pool's memory); the
  chunks depend on the sizes only and are kept apart: a step's new gradients change the rows, never the chunks
  (~2,000 for GPT-2 124M)."""
  if dry():
    host, chunks = host_tables(rows, width)
    return memory.from_numpy(host, device), memory.from_numpy(chunks, device), _vectors(host, walked)
  table, vectors = _cached(_tables, (device, width, walked, tuple(rows)),
                           lambda: _device_table(rows, width, device, walked))
  sizes = tuple(rows[width - 1::width])
  return table, _cached(_chunk_tables, (device, sizes), lambda: memory.from_numpy(_host_chunks(sizes), device)), vectors


def _device_table(rows: list[int], width: int, device: int, walked: int) -> tuple[CudaArray, bool]:
  """The table of rows (their flat list) on the device, and `_vectors` of it."""
  host = np.array(rows, np.int64).reshape(-1, width)
  return memory.from_numpy(host, device), _vectors(host, walked)


def _vectors(table: np.ndarray, walked: int) -> bool:
  """Whether the kernels may take a table's tensors in 16-byte vectors: the first `walked` pointers of every row (those
  a kernel walks) 16-byte aligned and every size (a row's last entry) a multiple of 4 elements."""
  return bool((table[:, -1] % 4 == 0).all() and (table[:, :walked] % 16 == 0).all())


def _cached(cache: OrderedDict, key: tuple, make):
  """cache[key], made by `make()` (its device arrays kept) on a miss and kept (the 16 newest)."""
  hit = cache.get(key)
  if hit is not None:
    cache.move_to_end(key)
    return hit
  with memory.kept():
    hit = cache[key] = make()
  if len(cache) > 16: cache.popitem(last=False)
  return hit


def _laid_out_as(g: CudaArray, p: CudaArray) -> CudaArray:
  """g (of p's shape), or a copy of g in p's dense layout when they differ (a channels-last parameter's transposed
  gradient)."""
  if same_layout(p.shape, p.strides, g.strides): return g
  return copy(g, empty_like(p, g.dtype))


def _adamw_rows(params: list[CudaArray], grads: list[CudaArray], exp_avgs: list[CudaArray],
                exp_avg_sqs: list[CudaArray], steps: list[CudaArray], copies: list) -> dict[tuple, list[int]]:
  """`fused_adamw`'s table rows (param, grad, exp_avg, exp_avg_sq and step pointers, then the size; flat), grouped by
  (param dtype, grad dtype, device), one launch each; empty tensors have none. One pass checks each param's operands
  (ValueError naming their shapes, dtypes and strides) and reads a grad laid out unlike its param through a copy,
  appended to `copies`: the caller holds them until the update is queued (a copy freed sooner would give its memory
  to the next one)."""
  groups: dict[tuple, list[int]] = {}
  for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
    shape, strides, dt = p.shape, p.strides, p.dtype
    if not (g.shape == shape == m.shape == v.shape and dt is m.dtype is v.dtype and s.dtype is dtypes.float64
            and (m.strides == strides or same_layout(shape, strides, m.strides))
            and (v.strides == strides or same_layout(shape, strides, v.strides)) and is_dense(shape, strides)):
      raise ValueError(f"fused_adamw: needs a dense param, a grad of its shape and moments of its shape, dtype and "
                       f"layout, and a float64 step; got {p.shape} {p.dtype.name} strides {p.strides}, {g.shape} "
                       f"{g.dtype.name}, {m.shape} {m.dtype.name} strides {m.strides}, {v.shape} {v.dtype.name} "
                       f"strides {v.strides}, step {s.dtype.name}")
    if g.strides != strides: copies.append(g := _laid_out_as(g, p))
    if size := math.prod(shape):
      groups.setdefault((dt, g.dtype, p.device), []).extend((p.ptr, g.ptr, m.ptr, v.ptr, s.ptr, size))
  return groups


def _sgd_rows(params: list[CudaArray], grads: list[CudaArray], bufs: list[CudaArray],
              copies: list) -> dict[tuple, list[int]]:
  """`fused_sgd`'s table rows (param, grad and momentum buffer pointers, then the size; flat), grouped and checked as
  `_adamw_rows` does."""
  groups: dict[tuple, list[int]] = {}
  for p, g, b in zip(params, grads, bufs, strict=True):
    shape, strides = p.shape, p.strides
    if not (g.shape == shape == b.shape and b.dtype is p.dtype
            and (b.strides == strides or same_layout(shape, strides, b.strides)) and is_dense(shape, strides)):
      raise ValueError(f"fused_sgd: needs a dense param, a grad of its shape and a momentum buffer of its shape, dtype "
                       f"and layout; got {p.shape} {p.dtype.name} strides {p.strides}, {g.shape} {g.dtype.name}, "
                       f"{b.shape} {b.dtype.name} strides {b.strides}")
    if g.strides != strides: copies.append(g := _laid_out_as(g, p))
    if size := math.prod(shape): groups.setdefault((p.dtype, g.dtype, p.device), []).extend((p.ptr, g.ptr, b.ptr, size))
  return groups


def fused_adamw(params: list[CudaArray], grads: list[CudaArray], exp_avgs: list[CudaArray], exp_avg_sqs: list[CudaArray],
                steps: list[CudaArray], lr: float | CudaArray, beta1: float, beta2: float, eps: float,
                weight_decay: float, clip: CudaArray | None = None) -> None:
  """AdamW on every (param, grad, exp_avg, exp_avg_sq, step) in place: steps (0-d float64) are incremented first.
  Params are dense (any memory order) and moments share their dtype and layout; grads may have another floating dtype
  and any layout (one unlike its param's is read through a copy in the param's). One launch per (param dtype, grad
  dtype) group, plus one that increments the steps. `lr` is a number, or a 0-d float64 device array read by the
  kernel (no host sync: a CUDA graph captures the read, not the value). `clip`, a float32 device array of one element,
  scales every gradient as it is read (clip_grad_norm_'s factor, folded by Nova)."""
  on_device = isinstance(lr, CudaArray)
  copies: list[CudaArray] = []  # grads laid out as their params, alive until the launches are queued
  for (pd, gd, device), rows in _adamw_rows(params, grads, exp_avgs, exp_avg_sqs, steps, copies).items():
    table, chunks, vectors = _tables_for(rows, 6, device, 4)
    run(_STEPS, (1,), table, len(rows) // 6)
    run(adamw_spec(pd, gd, weight_decay != 0, on_device, clip is not None, vectors), (chunks.shape[0],),
        table, chunks,
        0 if on_device else f64_bits(lr), lr.ptr if on_device else 0, 0 if clip is None else clip.ptr,
        f64_bits(beta1), f64_bits(beta2),
        f64_bits(weight_decay), float(np.float32(1 - beta1)), float(np.float32(beta2)), float(np.float32(1 - beta2)),
        float(np.float32(eps)))


@triton.jit
def _sgd_kernel(table, chunks, lr_bits, lr_ptr, clip_ptr, weight_decay, momentum, one_minus_dampening,
                P: tl.constexpr, G: tl.constexpr, MOMENTUM: tl.constexpr, FIRST: tl.constexpr, DAMPENING: tl.constexpr,
                NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, DECAY: tl.constexpr, LR_PTR: tl.constexpr,
                CLIP: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, VECTORS: tl.constexpr):
  """SGD over one chunk (table rows: param, grad, momentum buffer, size); the learning rate as AdamW's kernel takes
  it, the gradient scaled by clip_ptr's factor as AdamW's scales it. FIRST: the buffer starts as the gradient."""
  row, start, end = _row(table, chunks, 4, CHUNK, VECTORS)
  p_ptr = tl.load(row).to(tl.pointer_type(P))
  g_ptr = tl.load(row + 1).to(tl.pointer_type(G))
  b_ptr = tl.load(row + 2).to(tl.pointer_type(P))
  lr = _learning_rate(lr_bits, lr_ptr, LR_PTR)
  neg_lr = (-lr).to(tl.float32)
  clip = tl.load(clip_ptr) if CLIP else 0.0
  for off in range(start, end, BLOCK):
    i = off + tl.arange(0, BLOCK)
    mask = i < end
    ps, bs = _at(p_ptr, i, VECTORS, BLOCK), _at(b_ptr, i, VECTORS, BLOCK)
    p = tl.load(ps, mask=mask).to(tl.float32)
    g = _gradient(_at(g_ptr, i, VECTORS, BLOCK), mask, clip, G, CLIP)
    if MAXIMIZE:
      g = -g
    if DECAY:
      g = g + p * weight_decay
    if MOMENTUM:
      if FIRST:
        b = g.to(P)
      elif DAMPENING:
        b = (tl.load(bs, mask=mask).to(tl.float32) * momentum + g * one_minus_dampening).to(P)
      else:
        b = (tl.load(bs, mask=mask).to(tl.float32) * momentum + g).to(P)
      tl.store(bs, b, mask=mask)
      if NESTEROV:
        g = g + b.to(tl.float32) * momentum
      else:
        g = b.to(tl.float32)
    tl.store(ps, (p + g * neg_lr).to(P), mask=mask)


@functools.lru_cache(maxsize=4096)
def sgd_spec(param, grad, momentum: bool, first: bool, dampening: bool, nesterov: bool, maximize: bool, decay: bool,
             lr_on_device: bool = False, clip: bool = False, vectors: bool = False):
  sig = {"table": "*i64", "chunks": "*i64", "lr_bits": "i64", "lr_ptr": "*fp64", "clip_ptr": "*fp32",
         "weight_decay": "fp32", "momentum": "fp32", "one_minus_dampening": "fp32"}
  block, warps = multi_tensor_schedule(3)  # param, grad, buffer
  return spec(_sgd_kernel, sig, dict(P=TL[param], G=TL[grad], MOMENTUM=momentum, FIRST=first, DAMPENING=dampening,
                                     NESTEROV=nesterov, MAXIMIZE=maximize, DECAY=decay, LR_PTR=lr_on_device, CLIP=clip,
                                     CHUNK=CHUNK, BLOCK=block, VECTORS=vectors), num_warps=warps)


def fused_sgd(params: list[CudaArray], grads: list[CudaArray], momentum_buffers: list[CudaArray], lr: float | CudaArray,
              momentum: float, dampening: float, weight_decay: float, nesterov: bool, maximize: bool,
              is_first_step: bool, clip: CudaArray | None = None) -> None:
  """SGD on every (param, grad, momentum buffer) in place (no buffers when momentum is 0; with `is_first_step` they
  are written, not read). Params are dense (any memory order) and buffers share their dtype and layout; grads as
  `fused_adamw` takes them. One launch per (param dtype, grad dtype) group; `lr` and `clip` as `fused_adamw` takes
  them."""
  on_device = isinstance(lr, CudaArray)
  bufs = momentum_buffers if momentum != 0 else params  # the rows' third pointer, never read without momentum
  copies: list[CudaArray] = []  # grads laid out as their params, alive until the launches are queued
  for (pd, gd, device), rows in _sgd_rows(params, grads, bufs, copies).items():
    table, chunks, vectors = _tables_for(rows, 4, device, 3)
    run(sgd_spec(pd, gd, momentum != 0, is_first_step, dampening != 0, nesterov, maximize, weight_decay != 0,
                 on_device, clip is not None, vectors), (chunks.shape[0],), table, chunks,
        0 if on_device else f64_bits(lr),
        lr.ptr if on_device else 0, 0 if clip is None else clip.ptr, float(np.float32(weight_decay)),
        float(np.float32(momentum)), float(np.float32(1 - dampening)))


@triton.jit
def _chunk(table, chunks, G: tl.constexpr, CHUNK: tl.constexpr, VECTORS: tl.constexpr):
  """(pointer, start, end) of this program's chunk of a (pointer, numel) table."""
  row, start, end = _row(table, chunks, 2, CHUNK, VECTORS)
  return tl.load(row).to(tl.pointer_type(G)), start, end


@triton.jit
def _sum_squares_kernel(table, chunks, out, G: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                        VECTORS: tl.constexpr):
  """out[pid] = the float32 sum of squares of chunk pid (table rows: pointer, numel)."""
  x, start, end = _chunk(table, chunks, G, CHUNK, VECTORS)
  acc = tl.zeros([BLOCK], tl.float32)
  for off in range(start, end, BLOCK):
    i = off + tl.arange(0, BLOCK)
    v = tl.load(_at(x, i, VECTORS, BLOCK), mask=i < end, other=0).to(tl.float32)
    acc += v * v
  tl.store(out + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _scale_kernel(table, chunks, scale, G: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                  VECTORS: tl.constexpr):
  """x *= scale[0] (float32) over chunk pid, in place."""
  x, start, end = _chunk(table, chunks, G, CHUNK, VECTORS)
  s = tl.load(scale)
  for off in range(start, end, BLOCK):
    i = off + tl.arange(0, BLOCK)
    xs = _at(x, i, VECTORS, BLOCK)
    tl.store(xs, (tl.load(xs, mask=i < end).to(tl.float32) * s).to(G), mask=i < end)


@triton.jit
def _cast_kernel(table, chunks, S: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 VECTORS: tl.constexpr):
  """y = x converted to D over chunk pid (table rows: x's pointer, y's, numel)."""
  row, start, end = _row(table, chunks, 3, CHUNK, VECTORS)
  x, y = tl.load(row).to(tl.pointer_type(S)), tl.load(row + 1).to(tl.pointer_type(D))
  for off in range(start, end, BLOCK):
    i = off + tl.arange(0, BLOCK)
    tl.store(_at(y, i, VECTORS, BLOCK), tl.load(_at(x, i, VECTORS, BLOCK), mask=i < end).to(D), mask=i < end)


@functools.lru_cache(maxsize=64)
def cast_spec(src, dst, vectors: bool = False):
  block, warps = multi_tensor_schedule(1)
  return spec(_cast_kernel, {"table": "*i64", "chunks": "*i64"},
              dict(S=TL[src], D=TL[dst], CHUNK=CHUNK, BLOCK=block, VECTORS=vectors), num_warps=warps)


def cast_many(*xs: CudaArray, dtype) -> tuple:
  """The `cast_many` op: each x converted to dtype in its own dense layout (as `cast`), one launch per source dtype
  and device; a tensor with gaps or overlaps goes through the copy kernel of its own. The results are allocated
  first, in order (a compiled step's memory plan places them so)."""
  outs = [empty_like(x, dtype) for x in xs]
  groups: dict[tuple, list[int]] = {}  # (dtype, device) -> flat table rows
  for x, y in zip(xs, outs):
    if not is_dense(x.shape, x.strides): copy(x, out=y)
    elif size := x.size: groups.setdefault((x.dtype, x.device), []).extend((x.ptr, y.ptr, size))
  for (src, dev), rows in groups.items():
    table, chunks, vectors = _tables_for(rows, 3, dev, 2)
    run(cast_spec(src, dtype, vectors), (chunks.shape[0],), table, chunks)
  return tuple(outs)


@functools.lru_cache(maxsize=64)
def multi_tensor_spec(kernel: str, dtype, vectors: bool = False):
  fn, last = {"sum_squares": (_sum_squares_kernel, "out"), "scale": (_scale_kernel, "scale")}[kernel]
  block, warps = multi_tensor_schedule(1)
  return spec(fn, {"table": "*i64", "chunks": "*i64", last: "*fp32"},
              dict(G=TL[dtype], CHUNK=CHUNK, BLOCK=block, VECTORS=vectors), num_warps=warps)


def _groups(tensors: list[CudaArray], op: str) -> dict[tuple, list[int]]:
  """Flat table rows (pointer, size) of the tensors by (dtype, device), one launch each; empty tensors have none."""
  groups: dict[tuple, list[int]] = {}
  for x in tensors:
    if not is_dense(x.shape, x.strides) or not x.dtype.is_floating_point or x.dtype is dtypes.float64:
      raise ValueError(f"{op}: needs dense float32/float16/bfloat16 tensors, got {x.shape} {x.dtype.name} with "
                       f"strides {x.strides}")
    if size := x.size: groups.setdefault((x.dtype, x.device), []).extend((x.ptr, size))
  return groups


def sum_squares(tensors: list[CudaArray], device: int) -> CudaArray:
  """Partial float32 sums of squares whose total is the squared 2-norm of all the tensors together, from one launch
  per dtype: one partial per chunk of CHUNK elements (a 1-element zero when there are no elements). A tensor with
  gaps or overlaps is read through a contiguous copy."""
  parts = []
  tensors = [x if is_dense(x.shape, x.strides) else copy(x) for x in tensors]
  for (dtype, dev), rows in _groups(tensors, "sum_squares").items():
    table, chunks, vectors = _tables_for(rows, 2, dev, 1)
    out = memory.empty((chunks.shape[0],), dtypes.float32, dev)
    run(multi_tensor_spec("sum_squares", dtype, vectors), (chunks.shape[0],), table, chunks, out)
    parts.append(out)
  if not parts: return memory.from_numpy(np.zeros(1, np.float32), device)
  if len(parts) == 1: return parts[0]
  return cat(*parts, dim=0)


def scale_(tensors: list[CudaArray], scale: CudaArray) -> None:
  """tensors[i] *= scale (a float32 array of one element on their device) in place, one launch per dtype."""
  for (dtype, dev), rows in _groups(tensors, "scale_").items():
    table, chunks, vectors = _tables_for(rows, 2, dev, 1)
    run(multi_tensor_spec("scale", dtype, vectors), (chunks.shape[0],), table, chunks, scale)


def _working(xs, out, like) -> tuple[list[CudaArray], list[tuple[CudaArray, CudaArray]]]:
  """The arrays a multi-tensor op updates in place, each laid out as `like`'s (its parameter; the kernels walk both
  flat): `out` (apply's `into`) holding the values of xs first, or new copies of xs. An out laid out otherwise (a
  compiled step's planned buffer for a channels-last parameter's state) is updated through a copy: returns the
  arrays and the (copy, out) pairs to write back after the update."""
  work, back = [], []
  for x, o, target in zip(xs, out or [None] * len(xs), like, strict=True):
    if o is not None and (o.strides == target.strides or same_layout(target.shape, target.strides, o.strides)):
      if o.ptr != x.ptr: memory.copy_into(o, x)
      work.append(o)
    else:
      work.append(copy(x, empty_like(target, x.dtype)))
      if o is not None: back.append((work[-1], o))
  return work, back


def _updated(work, back, out) -> tuple:
  """The results: out's arrays, and the new ones where out has None (or is None)."""
  for w, o in back: memory.copy_into(o, w)
  return tuple(work if out is None else (w if o is None else o for w, o in zip(work, out)))


def adamw(*xs, n: int, beta1: float, beta2: float, eps: float, weight_decay: float, clip: bool | None = None,
          out=None) -> tuple:
  """The `adamw` op: xs = params, grads, exp_avgs, exp_avg_sqs, steps (n each), lr (and with `clip` the gradients'
  factor); returns (or updates in `out`) params, exp_avgs, exp_avg_sqs and steps, by `fused_adamw`."""
  params, grads, exp_avgs, exp_avg_sqs, steps = (xs[k * n:(k + 1) * n] for k in range(5))
  work, back = _working([*params, *exp_avgs, *exp_avg_sqs, *steps], out, [*params * 3, *steps])
  p, m, v, s = (work[k * n:(k + 1) * n] for k in range(4))
  lr = xs[5 * n]  # a CPU scalar by value, a device scalar (a learning-rate tensor) read by the kernel
  fused_adamw(p, list(grads), m, v, s, float(lr) if isinstance(lr, np.ndarray) else lr, beta1, beta2, eps, weight_decay,
              xs[-1] if clip else None)
  return _updated(work, back, out)


def sgd(*xs, n: int, momentum: float, dampening: float, weight_decay: float, nesterov: bool, maximize: bool,
        is_first_step: bool, clip: bool | None = None, out=None) -> tuple:
  """The `sgd` op: xs = params, grads, momentum buffers (n each, none when momentum is 0), lr (and with `clip` the
  gradients' factor); returns (or updates in `out`) params and buffers, by `fused_sgd`."""
  k = 3 if momentum != 0 else 2
  work, back = _working([*xs[:n], *xs[2 * n:k * n]], out, [*xs[:n]] * (k - 1))
  lr = xs[k * n]  # a CPU scalar by value, a device scalar (a learning-rate tensor) read by the kernel
  fused_sgd(work[:n], list(xs[n:2 * n]), work[n:], float(lr) if isinstance(lr, np.ndarray) else lr, momentum,
            dampening, weight_decay, nesterov, maximize, is_first_step, xs[-1] if clip else None)
  return _updated(work, back, out)


def sum_squares_op(*xs: CudaArray) -> CudaArray:
  """The `sum_squares` op: the float32 0-d sum of squares of every element of every tensor."""
  parts = sum_squares(list(xs), xs[0].device)
  return reduce(parts, (0,), False, "sum", dtypes.float32)


def scale(*xs: CudaArray, out=None) -> tuple:
  """The `scale` op: xs[:-1] times the 0-d float32 xs[-1], each in its dtype (or updated in `out`)."""
  work, back = _working(xs[:-1], out, xs[:-1])
  scale_(work, xs[-1])
  return _updated(work, back, out)


_F32, _BF16 = dtypes.float32, dtypes.bfloat16
# param, grad, (momentum, first step, dampening, nesterov, maximize, decay, lr on device, clip): every branch once
_SGD_VARIANTS = [(_F32, _F32, (True, False, False, False, False, True, False)),
                 (_F32, _F32, (True, False, False, False, False, True, True)),
                 (_F32, _F32, (True, True, False, False, False, True, False)),
                 (_F32, _F32, (False, False, False, False, False, False, False)),
                 (_F32, _F32, (True, False, False, True, False, True, True, True)),
                 (_BF16, _BF16, (True, False, True, False, True, False, False)),
                 (_F32, _BF16, (True, True, False, False, False, True, False, True))]
adamw.writes_out = adamw.host_scalars = sgd.writes_out = sgd.host_scalars = scale.writes_out = True
KERNELS = {"adamw": adamw, "sgd": sgd, "sum_squares": sum_squares_op, "scale": scale, "cast_many": cast_many}
SPECS = [_STEPS] + [adamw_spec(p, g, d, on) for p, g, d in ((dtypes.float32, dtypes.float32, True),
                                                            (dtypes.float32, dtypes.bfloat16, False),
                                                            (dtypes.bfloat16, dtypes.bfloat16, True)) for on in (False, True)] + \
        [adamw_spec(dtypes.float32, g, True, on, True) for g, on in ((dtypes.float32, True), (dtypes.bfloat16, False))] + \
        [multi_tensor_spec(k, d) for k in ("sum_squares", "scale") for d in (dtypes.float32, dtypes.bfloat16)] + \
        [cast_spec(dtypes.float32, d) for d in (dtypes.bfloat16, dtypes.float16)] + \
        [sgd_spec(p, g, *flags) for p, g, flags in _SGD_VARIANTS] + \
        [adamw_spec(dtypes.float32, g, True, True, c, True) for g, c in ((dtypes.float32, True), (dtypes.bfloat16, False))] + \
        [multi_tensor_spec(k, dtypes.float32, True) for k in ("sum_squares", "scale")] + \
        [cast_spec(dtypes.float32, dtypes.bfloat16, True), sgd_spec(_F32, _F32, True, False, False, False, False, True, True,
                                                              False, True)]  # 16-byte vectors
