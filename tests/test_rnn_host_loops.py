"""The CUDA backend's recurrent time loops (`_lstm_sequence`, `_gru_sequence` and their backwards in
backend/cuda/kernels/rnn.py, which the ops run or replay as CUDA graphs) without a GPU: their host code runs over numpy memory, with the GEMMs, copies, adds,
sums and cell kernels they call replaced by numpy (the cells by the CPU backend's), against the CPU kernels. What this
checks is the loops' bookkeeping: the step order, every view's offset and strides, what each step reads (a
non-contiguous gi, a broadcast gradient) and where it writes. tests/cuda runs the real kernels."""
import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from blutrain import dtypes
from blutrain.backend.cpu.kernels import _gru_cell, _gru_cell_backward, _lstm_cell, _lstm_cell_backward, kernels as cpu
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import rnn

CELLS = {"lstm": _lstm_cell, "lstm_backward": _lstm_cell_backward, "gru": _gru_cell,
         "gru_backward": _gru_cell_backward}


class Memory:
  """Device memory as one numpy byte array; `empty` hands out 256-byte aligned blocks of it, `read` and `write` see
  an array's strided view."""

  def __init__(self):
    self.bytes, self.top = np.zeros(1 << 22, np.uint8), 256

  def empty(self, shape, dtype, device=0, stream=None) -> CudaArray:
    strides, n = [], 1
    for s in reversed(shape): strides.insert(0, n); n *= s
    ptr, self.top = self.top, self.top + (n * dtype.itemsize + 255) // 256 * 256
    return CudaArray(ptr, tuple(shape), tuple(strides), dtype, 0, None)

  def read(self, a: CudaArray) -> np.ndarray:
    flat = np.frombuffer(self.bytes.data, a.dtype.np, (self.bytes.size - a.ptr) // a.dtype.itemsize, a.ptr)
    return as_strided(flat, a.shape, [s * a.dtype.itemsize for s in a.strides]).astype(np.float64)

  def write(self, out: CudaArray, value: np.ndarray) -> CudaArray:
    flat = np.frombuffer(self.bytes.data, out.dtype.np, (self.bytes.size - out.ptr) // out.dtype.itemsize, out.ptr)
    as_strided(flat, out.shape, [s * out.dtype.itemsize for s in out.strides])[...] = value.astype(out.dtype.np)
    return out

  def put(self, a: np.ndarray, dtype) -> CudaArray:
    return self.write(self.empty(a.shape, dtype), a)


def _cell(m: Memory, kind: str, out: CudaArray, H: int, *ins: CudaArray) -> CudaArray:
  """A cell kernel over numpy memory: the CPU backend's cell; the time loops' step kinds also add the later step's
  gradients first (rounded to the output's dtype, as the kernels round them) and write their second output."""
  rounded = lambda a: a.astype(out.dtype.np).astype(np.float64)
  if kind in ("lstm_step", "gru_step"):
    *cell_ins, hb = ins
    m.write(out, CELLS[kind[:-5]](*(m.read(a) for a in cell_ins)))
    return m.write(hb, rounded(m.read(out)[:, :H]))
  if kind == "lstm_step_backward":
    grad, dh_in, dc_in, *cell_ins, dg = ins
    g = m.read(grad)
    total = np.concatenate([rounded(g[:, :H] + m.read(dh_in)), rounded(g[:, H:] + m.read(dc_in))], 1)
    m.write(out, _lstm_cell_backward(total, *(m.read(a) for a in cell_ins)))
    return m.write(dg, m.read(out)[:, :4 * H])
  if kind == "gru_step_backward":
    grad, dh_in, dhd_in, *cell_ins, dg = ins
    total = rounded(rounded(m.read(grad) + m.read(dh_in)) + m.read(dhd_in))
    m.write(out, _gru_cell_backward(total, *(m.read(a) for a in cell_ins)))
    return m.write(dg, m.read(out)[:, 3 * H:6 * H])
  return m.write(out, CELLS[kind](*(m.read(a) for a in ins)))


@pytest.fixture
def mem(monkeypatch) -> Memory:
  m = Memory()
  new = lambda out, shape, dtype: out if out is not None else m.empty(shape, dtype)
  stand_ins = dict(
    empty=m.empty,
    matmul=lambda a, b, tf32=False, out=None: m.write(new(out, (a.shape[0], b.shape[1]), a.dtype),
                                                      m.read(a) @ m.read(b)),
    matmul_bias=lambda a, b, bias, tf32=False, out=None: m.write(new(out, (a.shape[0], b.shape[1]), a.dtype),
                                                                 m.read(a) @ m.read(b) + m.read(bias)),
    cast=lambda x, dtype: m.write(m.empty(x.shape, dtype), m.read(x)),
    copy=lambda x, out=None: m.write(new(out, x.shape, x.dtype), m.read(x)),
    reduce=lambda x, dims, keepdim, op, dtype: m.write(m.empty(x.shape[1:], dtype), m.read(x).sum(0)),
    _launch=lambda kind, out, H, *ins: _cell(m, kind, out, H, *ins))
  for k, v in stand_ins.items(): monkeypatch.setattr(rnn, k, v)
  monkeypatch.setattr(rnn.elementwise, "launch", lambda op, out, a, b: m.write(out, m.read(a) + m.read(b)))
  return m


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("half,bias", [(False, True), (True, True), (False, False)])
def test_sequence_host_loops_match_the_cpu_kernels(mem, kind, reverse, half, bias):
  """Forward and backward against the CPU kernels: gi a transposed view, bf16 weights with float32 states (a
  separate stack of the gates' gradients) or all float32, with and without b_hh, a dense or a broadcast gradient."""
  rng = np.random.default_rng(0)
  (gates, n_states), (L, N, H) = (4, 2) if kind == "lstm" else (3, 1), (5, 3, 4)
  wd = dtypes.bfloat16 if half else dtypes.float32
  gi = mem.put(rng.standard_normal((N, L, gates * H)) * 0.5, wd)
  gi = CudaArray(gi.ptr, (L, N, gates * H), (gates * H, L * gates * H, 1), wd, 0, None)
  args = [gi, *(mem.put(rng.standard_normal((N, H)), dtypes.float32) for _ in range(n_states)),
          mem.put(rng.standard_normal((gates * H, H)) * 0.5, wd), mem.put(rng.standard_normal(gates * H), wd) if bias
          else None]
  host = [None if a is None else mem.read(a).astype(a.dtype.np) for a in args]
  out = getattr(rnn, f"_{kind}_sequence")(*args, reverse=reverse)  # the loop itself (the op may replay it)
  want = cpu[f"{kind}_sequence"](*host, reverse=reverse)
  np.testing.assert_allclose(mem.read(out), want, rtol=1e-2 if half else 1e-5, atol=1e-2 if half else 1e-5)
  dense = mem.put(rng.standard_normal(out.shape), out.dtype)
  scalar = mem.put(np.array([1.5, 99.0]), out.dtype)  # read as a broadcast 1.5; 99 where a view runs past it
  for g in (dense, CudaArray(scalar.ptr, out.shape, (0, 0, 0), out.dtype, 0, None)):
    got = getattr(rnn, f"_{kind}_sequence_backward")(g, *args, out, reverse=reverse, states=True, weights=True)
    expected = cpu[f"{kind}_sequence_backward"](mem.read(g), *host, mem.read(out), reverse=reverse,
                                                         states=True, weights=True)
    for i, (a, b) in enumerate(zip(got, expected)):
      assert (a is None) == (b is None), f"result {i}"
      if a is not None:
        np.testing.assert_allclose(mem.read(a), b, rtol=3e-2 if half else 1e-5, atol=(3e-2 if half else 1e-5) *
                                   max(1.0, np.abs(b).max()), err_msg=f"{kind} backward result {i}")
