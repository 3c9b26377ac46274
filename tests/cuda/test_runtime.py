"""The CUDA runtime on a real GPU: host <-> device copies of every dtype and layout, streams and events, the
caching allocator on the device, out of memory under a limit, DLPack with PyTorch / CuPy / JAX, Triton launch,
the per-launch overhead, and differentiable Tensor.to('cuda') / .cpu()."""
import gc
import os
import threading
import time

import ml_dtypes
import numpy as np
import pytest
import triton
import triton.language as tl

import blutrain as bt
from blutrain import dtypes
from blutrain.backend import cuda as be
from blutrain.backend.cuda import interop, launch, memory, runtime
from blutrain.backend.cuda.allocator import format_size
from blutrain.backend.cuda.array import CudaArray

pytestmark = pytest.mark.cuda
MiB = 1 << 20


def rand(shape, dtype, seed=0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if dtype is dtypes.bool_: return rng.random(shape) < 0.5
  if dtype.category == 1: return rng.integers(-(2**30), 2**30, shape).astype(dtype.np)
  return (rng.standard_normal(shape) * 10).astype(dtype.np)


def same(a: np.ndarray, b: np.ndarray) -> None:
  assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
  np.testing.assert_array_equal(a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a,
                                b.view(np.uint16) if b.dtype == ml_dtypes.bfloat16 else b)


def strided(base: CudaArray, shape, strides, offset=0) -> CudaArray:
  return be.view(base.owner, shape, strides, offset, base.dtype)


# *** host <-> device ***

@pytest.mark.parametrize("dtype", dtypes.all_dtypes, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5, 17), (0, 4), (1 << 20,)])
def test_round_trip_every_dtype(dtype, shape):
  x = rand(shape, dtype)
  a = memory.from_numpy(x)
  assert a.shape == x.shape and a.dtype is dtype and a.is_contiguous() and a.device == 0
  same(memory.to_numpy(a), x)


def test_round_trip_larger_than_the_staging_buffers():
  x = rand((5 * memory.CHUNK // 4 + 123,), dtypes.float32)   # pieces through both pinned buffers
  same(memory.to_numpy(memory.from_numpy(x)), x)


def test_from_non_contiguous_host_arrays():
  x = rand((8, 12), dtypes.float32)
  for v in (x[::2, ::-3], x.T, x[:, 5]):
    same(memory.to_numpy(memory.from_numpy(v)), np.ascontiguousarray(v))


@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.bfloat16, dtypes.int64, dtypes.bool_], ids=lambda d: d.name)
def test_strided_to_numpy(dtype):
  x = rand((6, 8, 10), dtype)
  base = memory.from_numpy(x)
  item = x.dtype.itemsize
  cases = [((8, 6, 10), (10, 80, 1), 0), ((3, 4, 5), (160, 20, 2), 11), ((6, 10), (80, 1), 7),
           ((4, 3), (0, 1), 5), ((2, 8, 10), (240, 10, 1), 0), ((10, 8, 6), (1, 10, 80), 0)]
  for shape, st, off in cases:
    want = np.lib.stride_tricks.as_strided(x.reshape(-1)[off:], shape, tuple(s * item for s in st))
    same(memory.to_numpy(strided(base, shape, st, off)), np.ascontiguousarray(want))


def test_sparse_view_of_a_large_buffer():
  x = rand((2048, 2048), dtypes.float32)
  base = memory.from_numpy(x)
  col = strided(base, (2048,), (2048,), 3)   # a column: spans the whole 16 MiB buffer
  same(memory.to_numpy(col), x[:, 3].copy())


def test_tensor_transfer_is_differentiable():
  x = bt.tensor(rand((4, 5), dtypes.float32), requires_grad=True)
  y = x.to("cuda")
  assert y.device == bt.device("cuda", 0) and y.is_cuda and y.requires_grad
  z = y.cpu()
  np.testing.assert_array_equal(z.detach().numpy(), x.detach().numpy())
  (z * bt.tensor(rand((4, 5), dtypes.float32, seed=1))).sum().backward()
  np.testing.assert_array_equal(x.grad.numpy(), rand((4, 5), dtypes.float32, seed=1))
  for dtype in dtypes.all_dtypes:
    h = rand((3, 7), dtype)
    same(bt.from_numpy(h).cuda().cpu().numpy(), h)
    same(bt.from_numpy(h)[:, ::2].to("cuda").numpy(), h[:, ::2].copy())


def test_copy_bandwidth(torch_cuda):
  """Host <-> device throughput of 256 MiB through the pinned staging buffers, beside PyTorch's (printed)."""
  torch = torch_cuda
  x = rand((64 * MiB,), dtypes.float32)
  a = memory.from_numpy(x)
  runtime.synchronize()
  t = time.perf_counter(); a = memory.from_numpy(x); runtime.synchronize(); h2d = time.perf_counter() - t
  t = time.perf_counter(); y = memory.to_numpy(a); d2h = time.perf_counter() - t
  same(y, x)
  tx = torch.from_numpy(x)
  tx.cuda(); torch.cuda.synchronize()
  t = time.perf_counter(); g = tx.cuda(); torch.cuda.synchronize(); th2d = time.perf_counter() - t
  t = time.perf_counter(); g.cpu(); td2h = time.perf_counter() - t
  gb = x.nbytes / 1e9
  print(f"\n256 MiB: H2D {gb / h2d:.1f} GB/s (torch {gb / th2d:.1f}), D2H {gb / d2h:.1f} GB/s (torch {gb / td2h:.1f})")


def test_tensor_ops_run_through_the_backend():
  """Kernel results become tensors (wrap), tensors become kernel inputs (view), in-place writes (copy_into)."""
  if not {"full", "mul", "add"} <= set(be.kernels): pytest.skip("the kernel library lacks full/mul/add")
  x = rand((5, 6), dtypes.float32)
  t = bt.from_numpy(x).cuda()
  np.testing.assert_allclose(((t * 2 + bt.ones(5, 6, device="cuda")).cpu()).numpy(), x * 2 + 1, rtol=1e-6)
  np.testing.assert_allclose((t.T[1:] * 3).cpu().numpy(), x.T[1:] * 3, rtol=1e-6)
  with bt.no_grad():
    t.add_(1.0)
  np.testing.assert_allclose(t.numpy(), x + 1, rtol=1e-6)


# *** device -> device ***

def test_copy_into_same_layout_is_a_memcpy():
  x, y = rand((64, 33), dtypes.float32), rand((64, 33), dtypes.float32, seed=1)
  dst, src = memory.from_numpy(x), memory.from_numpy(y)
  be.copy_into(dst, src)
  same(memory.to_numpy(dst), y)
  src2 = memory.from_numpy(x)
  be.copy_into(strided(dst, (33, 64), (1, 33)), strided(src2, (33, 64), (1, 33)))  # both transposed: one memcpy
  same(memory.to_numpy(dst), x)


def test_copy_into_strided_destination_uses_the_copy_kernel():
  if "copy" not in be.kernels: pytest.skip("the kernel library has no 'copy' kernel yet")
  x, y = rand((16, 20), dtypes.float32), rand((16, 10), dtypes.float32, seed=1)
  dst = memory.from_numpy(x)
  be.copy_into(strided(dst, (16, 10), (20, 2), 1), memory.from_numpy(y))   # dst[:, 1::2] = y (needs copy(out=))
  x[:, 1::2] = y
  same(memory.to_numpy(dst), x)


# *** streams and events ***

@triton.jit
def _spin_then_store(out_ptr, value, n_iter):
  """Keep one thread busy for n_iter dependent steps, then store `value` (the result depends on the loop, so
  the compiler cannot drop it)."""
  acc = tl.program_id(0).to(tl.float32)
  for _ in range(n_iter):
    acc = acc * 0.5 + 1.0
  tl.store(out_ptr, value + (acc > 100.0).to(tl.float32))


@triton.jit
def _add(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
  offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
  m = offs < n
  tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + alpha * tl.load(y_ptr + offs, mask=m), mask=m)


SPIN = {"out_ptr": "*fp32", "value": "fp32", "n_iter": "i32"}
ADD = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "alpha": "fp32"}


def test_current_stream_context_is_per_thread_and_nests():
  d = runtime.default_stream()
  assert bt.cuda.current_stream() is d and d.handle != 0  # not the legacy NULL stream
  s1, s2 = bt.cuda.Stream(), bt.cuda.Stream()
  seen = []
  with bt.cuda.stream(s1):
    assert bt.cuda.current_stream() is s1
    with bt.cuda.stream(s2):
      assert bt.cuda.current_stream() is s2
      t = threading.Thread(target=lambda: seen.append(bt.cuda.current_stream()))
      t.start(); t.join()
    assert bt.cuda.current_stream() is s1
  assert bt.cuda.current_stream() is d and seen == [d]


def test_events_order_streams_and_time_work():
  spin = launch.compile(_spin_then_store, SPIN)
  s1, s2 = bt.cuda.Stream(), bt.cuda.Stream()
  out = memory.empty((1,), dtypes.float32, stream=s1)
  copy = memory.empty((1,), dtypes.float32, stream=s2)
  start, end = bt.cuda.Event(enable_timing=True), bt.cuda.Event(enable_timing=True)
  start.record(s1)
  spin((1,), out, 42.0, 20_000_000, stream=s1)   # tens of milliseconds
  end.record(s1)
  assert not end.query() and not s1.query()
  s2.wait_event(end)
  with bt.cuda.stream(s2):
    memory.copy_d2d(copy.ptr, out.ptr, 4, s2)
    assert memory.to_numpy(copy)[0] == 42.0     # s2 waited for s1's kernel on the device
  assert end.query() and s1.query()
  ms = start.elapsed_time(end)
  print(f"\nspin kernel of 20M steps: {ms:.1f} ms")
  assert 1.0 < ms < 10_000, ms
  e = s1.record_event()
  e.synchronize()
  assert e.query()
  s2.wait_stream(s1)
  bt.cuda.synchronize()
  with pytest.raises(RuntimeError, match="enable_timing"):
    e.elapsed_time(end)


def test_cross_stream_use_defers_reuse():
  spin = launch.compile(_spin_then_store, SPIN)
  alloc = runtime.state().allocator
  bt.cuda.empty_cache()
  s = bt.cuda.Stream()
  a = memory.empty((11 * MiB,), dtypes.bool_)       # on the compute stream: a segment of its own (12 MiB) or, when
  ptr = a.ptr                                        # earlier tests left a large free block, 11 MiB split from it
  spin((1,), a, 7.0, 100_000_000, stream=s)          # the launch records the use on s
  del a                                              # (no gc.collect(): it could outlast the kernel)
  b = memory.empty((11 * MiB,), dtypes.bool_)
  assert b.ptr != ptr                                # s still uses it
  assert 11 * MiB <= alloc.memory_stats()["pending_free_bytes.all.current"] <= 12 * MiB
  s.synchronize()
  assert alloc.memory_stats()["pending_free_bytes.all.current"] == 0  # the completed event was seen
  assert memory.empty((11 * MiB,), dtypes.bool_).ptr == ptr


# *** allocator on the device ***

def test_allocator_reuse_and_stats():
  gc.collect()
  bt.cuda.empty_cache()
  bt.cuda.reset_peak_memory_stats()
  s0 = bt.cuda.memory_stats()
  a = memory.empty((3 * MiB,), dtypes.float32)       # 12 MiB: a segment of exactly that size
  ptr = a.ptr
  assert bt.cuda.memory_allocated() == s0["allocated_bytes.all.current"] + 12 * MiB
  assert bt.cuda.memory_reserved() == s0["reserved_bytes.all.current"] + 12 * MiB
  del a
  b = memory.empty((2 * MiB,), dtypes.float32)       # 8 MiB from the cached 12 MiB block, split
  assert b.ptr == ptr
  s = bt.cuda.memory_stats()
  assert s["num_device_alloc"] == s0["num_device_alloc"] + 1
  assert bt.cuda.max_memory_allocated() == s0["allocated_bytes.all.current"] + 12 * MiB
  t = bt.from_numpy(rand((1 << 20,), dtypes.float32)).cuda()  # 4 MiB: from the cache (that segment's rest, or
  assert bt.cuda.memory_stats()["num_device_alloc"] == s0["num_device_alloc"] + 1  # an equal kept block): no malloc
  assert bt.cuda.memory_allocated() == s0["allocated_bytes.all.current"] + 12 * MiB
  del t, b
  gc.collect()
  assert bt.cuda.memory_allocated() == s0["allocated_bytes.all.current"]
  bt.cuda.empty_cache()
  assert bt.cuda.memory_stats()["num_device_free"] > s0["num_device_free"]


def test_out_of_memory_under_a_limit_and_on_the_device():
  bt.cuda.empty_cache()
  base = bt.cuda.memory_reserved()
  bt.cuda.set_memory_limit(base + 64 * MiB)
  try:
    keep = memory.empty((40 * MiB,), dtypes.bool_)
    held = format_size(bt.cuda.memory_allocated())
    with pytest.raises(bt.cuda.OutOfMemoryError) as e:
      memory.empty((32 * MiB // 4,), dtypes.float32)
    msg = str(e.value)
    assert "tried to allocate 32.00 MiB" in msg and "set_memory_limit" in msg and f"{held} is allocated" in msg, msg
    assert "free of" in msg and "Hint" in msg, msg
    del keep
  finally:
    bt.cuda.set_memory_limit(None)
  with pytest.raises(bt.cuda.OutOfMemoryError, match=r"tried to allocate 4096\.00 GiB .* the device has .* free of"):
    memory.empty((1 << 40,), dtypes.float32)
  stats = bt.cuda.memory_stats()
  assert stats["num_ooms"] >= 2 and stats["num_alloc_retries"] >= 2
  x = memory.from_numpy(np.arange(10, dtype=np.float32))  # still usable
  same(memory.to_numpy(x), np.arange(10, dtype=np.float32))


# *** launch ***

def test_launch_matches_numpy():
  add = launch.compile(_add, ADD, {"BLOCK": 1024})
  for n in (1, 1000, 1 << 20, 3_000_001):
    x, y = rand((n,), dtypes.float32), rand((n,), dtypes.float32, seed=1)
    dx, dy = memory.from_numpy(x), memory.from_numpy(y)
    out = memory.empty_like(dx)
    add((triton.cdiv(n, 1024),), dx, dy, out, n, 0.5)
    np.testing.assert_allclose(memory.to_numpy(out), x + np.float32(0.5) * y, rtol=1e-6)
  add((0,), dx, dy, out, 0, 1.0)  # an empty grid launches nothing


@triton.jit
def _matmul(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
  pm, pn = tl.program_id(0), tl.program_id(1)
  rm, rn, rk = pm * BM + tl.arange(0, BM), pn * BN + tl.arange(0, BN), tl.arange(0, BK)
  acc = tl.zeros((BM, BN), tl.float32)
  for k in range(0, K, BK):
    a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
    b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :])
    acc += tl.dot(a, b)
  tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc)


def test_launch_with_more_than_48k_of_shared_memory():
  k = launch.compile(_matmul, {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32", "M": "i32", "N": "i32",
                               "K": "i32"}, {"BM": 128, "BN": 128, "BK": 64}, num_warps=8, num_stages=4)
  assert k.shared > 48 * 1024, k.shared                 # the opt-in path
  m, n, kk = 256, 384, 512
  a, b = rand((m, kk), dtypes.float16) / 10, rand((kk, n), dtypes.float16) / 10
  c = memory.empty((m, n), dtypes.float32)
  k((m // 128, n // 128), memory.from_numpy(a), memory.from_numpy(b), c, m, n, kk)
  np.testing.assert_allclose(memory.to_numpy(c), a.astype(np.float64) @ b.astype(np.float64), rtol=2e-2, atol=2e-2)


@triton.jit
def _tma_double(x_ptr, out_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
  """A device-side tensor descriptor (TMA) load: Triton places the descriptor in the global scratch buffer."""
  desc = tl.make_tensor_descriptor(x_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
  pm, pn = tl.program_id(0), tl.program_id(1)
  tile = desc.load([pm * BM, pn * BN])
  rm, rn = pm * BM + tl.arange(0, BM), pn * BN + tl.arange(0, BN)
  tl.store(out_ptr + rm[:, None] * N + rn[None, :], tile * 2, mask=(rm[:, None] < M) & (rn[None, :] < N))


def test_launch_fills_the_global_scratch_buffer():
  k = launch.compile(_tma_double, {"x_ptr": "*fp32", "out_ptr": "*fp32", "M": "i32", "N": "i32"},
                     {"BM": 64, "BN": 64}, num_stages=1)
  assert k.compiled.global_scratch_size > 0
  m, n = 200, 192
  x = rand((m, n), dtypes.float32)
  out = memory.empty((m, n), dtypes.float32)
  k((triton.cdiv(m, 64), triton.cdiv(n, 64)), memory.from_numpy(x), out, m, n)
  same(memory.to_numpy(out), x * 2)


def test_per_launch_overhead(torch_cuda):
  """Microseconds per launch of a tiny kernel, host-bound (printed: run with -s)."""
  torch = torch_cuda
  add = launch.compile(_add, ADD, {"BLOCK": 128})
  x = memory.from_numpy(rand((128,), dtypes.float32))
  for _ in range(100): add((1,), x, x, x, 128, 0.0)
  n = 5000
  runtime.synchronize()
  t = time.perf_counter()
  for _ in range(n): add((1,), x, x, x, 128, 0.0)
  ours = (time.perf_counter() - t) / n * 1e6
  runtime.synchronize()
  tx = torch.randn(128, device="cuda")
  for _ in range(100): tx.add_(tx, alpha=0.0)
  torch.cuda.synchronize()
  t = time.perf_counter()
  for _ in range(n): tx.add_(tx, alpha=0.0)
  theirs = (time.perf_counter() - t) / n * 1e6
  torch.cuda.synchronize()
  print(f"\nper-launch overhead: blutrain Kernel {ours:.1f} us, torch.Tensor.add_ {theirs:.1f} us")
  assert ours < 100


# *** DLPack ***

TORCH = {dtypes.bool_: "bool", dtypes.uint8: "uint8", dtypes.int8: "int8", dtypes.int16: "int16", dtypes.int32: "int32",
         dtypes.int64: "int64", dtypes.float16: "float16", dtypes.bfloat16: "bfloat16", dtypes.float32: "float32",
         dtypes.float64: "float64"}


@pytest.mark.parametrize("dtype", dtypes.all_dtypes, ids=lambda d: d.name)
def test_dlpack_to_torch_shares_memory(torch_cuda, dtype):
  torch = torch_cuda
  x = rand((6, 8), dtype)
  t = bt.from_numpy(x).cuda()
  tt = torch.from_dlpack(t)
  assert tt.device.type == "cuda" and tt.dtype == getattr(torch, TORCH[dtype]) and tuple(tt.shape) == (6, 8)
  assert tt.data_ptr() == t.data_ptr()
  same(tt.cpu().view(torch.int16).numpy().view(x.dtype) if dtype is dtypes.bfloat16 else tt.cpu().numpy(), x)
  v = t[1:, ::2]
  tv = torch.from_dlpack(v)
  assert tv.data_ptr() == v.data_ptr() and tv.stride() == v.stride() and tuple(tv.shape) == v.shape
  if dtype is dtypes.float32:
    tt.add_(1.0)
    torch.cuda.synchronize()
    same(t.numpy(), x + 1)
    n = len(interop._exports)
    del tt, tv
    gc.collect()
    assert len(interop._exports) == n - 2  # torch called our deleters


@pytest.mark.parametrize("dtype", dtypes.all_dtypes, ids=lambda d: d.name)
def test_dlpack_from_torch_shares_memory(torch_cuda, dtype):
  torch = torch_cuda
  tt = torch.from_numpy(rand((5, 9), dtype).view(np.int16) if dtype is dtypes.bfloat16 else rand((5, 9), dtype))
  tt = (tt.view(torch.bfloat16) if dtype is dtypes.bfloat16 else tt).cuda()
  tv = tt[1:, 2::3]
  b = bt.from_dlpack(tv)
  assert b.device == bt.device("cuda", 0) and b.dtype is dtype and b.shape == tuple(tv.shape)
  assert b.stride() == tv.stride() and b.data_ptr() == tv.data_ptr()
  want = tv.cpu()
  same(b.numpy(), want.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if dtype is dtypes.bfloat16 else want.numpy())
  if dtype is dtypes.float32:
    del want
    gc.collect()
    before = torch.cuda.memory_allocated()
    del tt, tv
    gc.collect()
    assert torch.cuda.memory_allocated() == before   # blutrain's view keeps torch's memory
    b.numpy()
    del b
    gc.collect()
    assert torch.cuda.memory_allocated() < before    # the deleter released it


def test_dlpack_orders_the_consumer_stream(torch_cuda):
  torch = torch_cuda
  spin = launch.compile(_spin_then_store, SPIN)
  t = bt.from_numpy(np.zeros(1, np.float32)).cuda()
  spin((1,), t._array(), 5.0, 20_000_000)            # our compute stream is busy writing t
  tt = torch.from_dlpack(t)                          # torch's stream now waits for ours
  assert tt.clone().item() == 5.0
  tt.fill_(9.0)                                      # torch writes on its stream
  b = bt.from_dlpack(tt)                             # our stream waits for torch's
  assert b.numpy()[0] == 9.0


def test_dlpack_with_cupy():
  cp = pytest.importorskip("cupy")
  x = rand((4, 6), dtypes.float32)
  c = cp.asarray(x)
  b = bt.from_dlpack(c)
  assert b.data_ptr() == c.data.ptr
  same(b.numpy(), x)
  c2 = cp.from_dlpack(b)
  assert c2.data.ptr == b.data_ptr()
  same(cp.asnumpy(c2), x)


def test_dlpack_with_jax():
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX must not take the GPU's memory
  jax = pytest.importorskip("jax")
  x = rand((4, 6), dtypes.float32)
  j = jax.device_put(jax.numpy.asarray(x), jax.devices("gpu")[0])
  b = bt.from_dlpack(j)
  same(b.numpy(), x)
  same(np.asarray(jax.dlpack.from_dlpack(b)), x)


def test_dlpack_errors():
  t = bt.from_numpy(np.ones(3, np.float32)).cuda()
  with pytest.raises(BufferError, match="copy=True"):
    t.__dlpack__(copy=True)
  with pytest.raises(BufferError, match="cuda:0; it cannot be exported"):
    t.__dlpack__(dl_device=(1, 0))
  with pytest.raises(TypeError, match="not CUDA"):
    be.from_dlpack(np.ones(3))


# *** device facts ***

def test_properties_and_describe():
  p = bt.cuda.get_device_properties(0)
  assert p.multi_processor_count > 0 and p.total_memory > 1 << 30 and p.shared_memory_per_block_optin >= 48 * 1024
  assert bt.cuda.get_device_capability() == (p.major, p.minor) and bt.cuda.get_device_name() == p.name
  assert bt.cuda.device_count() >= 1 and bt.cuda.is_available()
  text = be.describe()
  assert p.name in text and f"sm_{p.major}{p.minor}" in text
  print("\n" + text)
