"""The CUDA matmul's mapping of row-major tensors onto cuBLASLt, checked on the CPU: `gemm_calls` turns (a, b, out)
into one column-major Problem and its address offsets, and a numpy emulation of cuBLASLt's strided-batch GEMM over a
fake device memory must then produce a @ b, for every transpose, leading dim, batch broadcast and fold."""
import itertools

import numpy as np
import pytest

from blutrain import dtypes
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels.cublaslt import gemm_calls
from blutrain.backend.cuda.kernels.matrix import blas_layout

BASE = 1 << 20  # the fake memory's address 0


class Memory:
  """A float64 host buffer addressed like device memory (float32 items: 4 bytes per element)."""

  def __init__(self, n: int):
    self.buf, self.used = np.zeros(n), 0

  def place(self, x: np.ndarray, mode: str, align: int = 64) -> CudaArray:
    """x stored as `mode`: "n" row-major, "t" transposed in memory, "ld" row-major with padded rows, "bcast" its
    batch dims as stride-0 broadcasts of a single matrix."""
    r, c = x.shape[-2:]
    batch = x.shape[:-2]
    if mode == "bcast":
      src, shape = x.reshape((-1, r, c))[0], x.shape
      strides = (0,) * len(batch) + (c, 1)
    elif mode == "t":
      src = np.ascontiguousarray(np.swapaxes(x, -1, -2))
      st = _contiguous(src.shape)
      strides = st[:-2] + (1, st[-2])
      shape = x.shape
    elif mode == "ld":
      src = np.zeros(batch + (r, c + 3))
      src[..., :c] = x
      shape, strides = x.shape, _contiguous(src.shape)
    else:
      src, shape, strides = x, x.shape, _contiguous(x.shape)
    start = -(-self.used // (align // 4)) * (align // 4)
    self.buf[start:start + src.size] = src.reshape(-1)
    self.used = start + src.size
    return CudaArray(BASE + 4 * start, shape, strides, dtypes.float32, 0, None)

  def empty(self, shape) -> CudaArray:
    return self.place(np.zeros(shape), "n")

  def read(self, a: CudaArray) -> np.ndarray:
    off = (a.ptr - BASE) // 4
    return np.lib.stride_tricks.as_strided(self.buf[off:], a.shape, tuple(8 * s for s in a.strides)).copy()

  def gemm(self, p, pa: int, pb: int, pd: int, bias: np.ndarray | None) -> None:
    """cuBLASLt's D = op(A) op(B) (+ bias[i] per row of D), column-major, `batch` matrices `stride` apart."""
    def mat(ptr, rows, cols, ld, i, stride):
      start = (ptr - BASE) // 4 + i * stride
      return np.lib.stride_tricks.as_strided(self.buf[start:], (rows, cols), (8, 8 * ld))
    for i in range(p.batch):
      A = mat(pa, *((p.k, p.m) if p.trans_a else (p.m, p.k)), p.lda, i, p.stride_a)
      B = mat(pb, *((p.n, p.k) if p.trans_b else (p.k, p.n)), p.ldb, i, p.stride_b)
      D = mat(pd, p.m, p.n, p.ldd, i, p.stride_d)
      D[...] = (A.T if p.trans_a else A) @ (B.T if p.trans_b else B) + (0 if bias is None else bias[:, None])


def _contiguous(shape):
  out, acc = [], 1
  for n in reversed(shape):
    out.append(acc)
    acc *= n
  return tuple(reversed(out))


def _run(a_np, b_np, ma, mb, bias=None):
  mem = Memory(1 << 16)
  a, b = mem.place(a_np, ma), mem.place(b_np, mb)
  batch = np.broadcast_shapes(a_np.shape[:-2], b_np.shape[:-2])
  out = mem.empty(batch + (a_np.shape[-2], b_np.shape[-1]))
  bias_arr = None if bias is None else mem.place(bias.reshape(1, -1), "n")
  p, calls = gemm_calls(a, b, out, bias_arr, (0, 0))
  for ob, oa, od in calls: mem.gemm(p, b.ptr + ob, a.ptr + oa, out.ptr + od, bias)  # cuBLAS's A is our b
  return mem.read(out), p, calls


SHAPES = [((3, 5), (5, 7)), ((1, 4), (4, 6)), ((6, 4), (4, 1)), ((1, 1), (1, 1)), ((5, 1), (1, 3))]


@pytest.mark.parametrize("ma,mb", list(itertools.product(["n", "t", "ld"], repeat=2)))
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_transposes_and_leading_dims(shapes, ma, mb):
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal(shapes[0]), rng.standard_normal(shapes[1])
  got, p, calls = _run(a, b, ma, mb)
  np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-12)
  assert len(calls) == 1 and p.batch == 1


@pytest.mark.parametrize("sa,sb,ma,mb,cublas_batch,loops", [
  ((4, 3, 5), (4, 5, 2), "n", "t", 4, 1),         # plain strided batch
  ((4, 3, 5), (5, 2), "n", "n", 1, 1),            # shared weight: folded into one GEMM of 12 rows
  ((4, 3, 5), (5, 2), "t", "n", 4, 1),            # shared weight, A transposed: batch with B's stride 0
  ((2, 3, 4, 5), (3, 5, 2), "n", "t", 3, 2),      # broadcast outer dim: loops on the host
  ((1, 4, 5), (6, 5, 3), "bcast", "n", 6, 1),     # a broadcast (stride 0) over the batch
  ((2, 1, 4, 5), (2, 3, 5, 2), "ld", "t", 3, 2),
])
def test_batches(sa, sb, ma, mb, cublas_batch, loops):
  rng = np.random.default_rng(1)
  a, b = rng.standard_normal(sa), rng.standard_normal(sb)
  if ma == "bcast": a = np.broadcast_to(a, (6,) + sa[1:])
  got, p, calls = _run(a, b, ma, mb)
  np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-12)
  assert (p.batch, len(calls)) == (cublas_batch, loops)


def test_bias_epilogue_row_vector():
  rng = np.random.default_rng(2)
  a, w, bias = rng.standard_normal((2, 3, 4)), rng.standard_normal((5, 4)), rng.standard_normal(5)
  got, p, _ = _run(a, np.ascontiguousarray(w.T), "n", "t", bias)  # b = w.mT: nn.Linear's layout
  np.testing.assert_allclose(got, a @ w.T + bias, rtol=1e-12, atol=1e-12)
  assert p.epilogue == "bias" and not p.trans_b and p.trans_a  # cuBLAS's A is our w^T stored transposed


def test_layout_rules():
  arr = lambda shape, strides: CudaArray(BASE, shape, strides, dtypes.float32, 0, None)
  assert blas_layout(arr((3, 4), (4, 1))) == (False, 4)
  assert blas_layout(arr((3, 4), (1, 3))) == (True, 3)
  assert blas_layout(arr((3, 4), (8, 1))) == (False, 8)
  assert blas_layout(arr((1, 4), (0, 1))) == (False, 4)       # one row: any row stride
  assert blas_layout(arr((3, 4), (0, 1))) is None              # broadcast rows overlap: copy
  assert blas_layout(arr((3, 4), (8, 2))) is None              # no unit stride: copy


def test_alignment_reaches_the_problem():
  mem = Memory(1 << 12)
  a = mem.place(np.ones((4, 8)), "n", align=256)
  b = mem.place(np.ones((8, 4)), "n", align=256)
  out = mem.empty((4, 4))
  shifted = CudaArray(a.ptr + 4, (4, 7), (8, 1), dtypes.float32, 0, None)  # a view starting one element in
  p, _ = gemm_calls(shifted, CudaArray(b.ptr, (7, 4), (4, 1), dtypes.float32, 0, None), out, None, (0, 0))
  assert p.align[1] == 4 and p.align[0] % 16 == 0
