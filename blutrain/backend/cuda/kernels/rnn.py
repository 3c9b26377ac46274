"""Recurrent cells: one LSTM or GRU step after its matmuls (`lstm_cell`, `gru_cell`) and their backwards, each one
pass over the (N, H) elements of the step, in float32 math; and a direction's whole time loop (`lstm_sequence`,
`gru_sequence` and their backwards), host loops of the backend's GEMMs and these kernels on the current stream,
which eager mode replays as one CUDA graph from the second call with the same shapes on (`graphs.replayed`: a loop of
256 steps was ~1,000 launches of host work each way).

An element (n, j) of an LSTM step reads its four gate pre-activations a_k = gi[n, k H + j] + gh[n, k H + j]
(k = i, f, g, o) and c[n, j]; the forward writes h' and c' into out[n, j] and out[n, H + j]. The backward reads the
gradient of [h', c'], the same inputs and c' (from the forward's output), and writes the gates' gradients and c's into
d[n, k H + j] and d[n, 4 H + j]. A GRU step reads r's, z's and n's pre-activations the same way (gh's n block times r)
and h, and writes h', or [d gi, d gh, d h] (N, 7H). Operands are rows of unit column stride (a row stride of their
own: nn.LSTM passes a slice of each step's input projection and a view of the previous output); others are copied
first. The block size is the configurator's `fused_schedule`, as for a synthesized pointwise group of as many
operands.
"""
from __future__ import annotations

import functools

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from blutrain import dtypes
from blutrain.backend.cuda import graphs
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import elementwise, empty, needs_i64, ptr, run, spec, view
from blutrain.backend.cuda.kernels.copy import cast, copy
from blutrain.backend.cuda.kernels.cublaslt import matmul, matmul_bias
from blutrain.backend.cuda.kernels.matrix import transposed
from blutrain.backend.cuda.kernels.reduce import reduce
from blutrain.configurator import fused_schedule
from blutrain.dtypes import DType
from blutrain.shapes import cdiv


@triton.jit
def _element(n, H, BLOCK: tl.constexpr, IDX64: tl.constexpr):
  """This program's flat element indices, their rows and columns, and which are inside the n = N * H elements."""
  start = tl.program_id(0)
  if IDX64: start = start.to(tl.int64)
  idx = start * BLOCK + tl.arange(0, BLOCK)
  return idx // H, idx % H, idx < n


@triton.jit
def _gates(gi, gh, row, col, H, gi_s, gh_s, ok):
  """sigmoid(i), sigmoid(f), tanh(g), sigmoid(o) of the pre-activations gi + gh, in float32."""
  a_i = tl.load(gi + row * gi_s + col, mask=ok, other=0.0).to(tl.float32) + \
      tl.load(gh + row * gh_s + col, mask=ok, other=0.0).to(tl.float32)
  a_f = tl.load(gi + row * gi_s + H + col, mask=ok, other=0.0).to(tl.float32) + \
      tl.load(gh + row * gh_s + H + col, mask=ok, other=0.0).to(tl.float32)
  a_g = tl.load(gi + row * gi_s + 2 * H + col, mask=ok, other=0.0).to(tl.float32) + \
      tl.load(gh + row * gh_s + 2 * H + col, mask=ok, other=0.0).to(tl.float32)
  a_o = tl.load(gi + row * gi_s + 3 * H + col, mask=ok, other=0.0).to(tl.float32) + \
      tl.load(gh + row * gh_s + 3 * H + col, mask=ok, other=0.0).to(tl.float32)
  return 1.0 / (1.0 + libdevice.exp(-a_i)), 1.0 / (1.0 + libdevice.exp(-a_f)), libdevice.tanh(a_g), \
      1.0 / (1.0 + libdevice.exp(-a_o))


@triton.jit
def _lstm_forward(out, gi, gh, c, row, col, ok, H, gi_s, gh_s, c_s, out_s):
  """Store [h', c'] of the elements into out's rows; returns h'."""
  i, f, g, o = _gates(gi, gh, row, col, H, gi_s, gh_s, ok)
  c2 = f * tl.load(c + row * c_s + col, mask=ok, other=0.0).to(tl.float32) + i * g
  h2 = o * libdevice.tanh(c2)
  tl.store(out + row * out_s + col, h2.to(out.dtype.element_ty), mask=ok)
  tl.store(out + row * out_s + H + col, c2.to(out.dtype.element_ty), mask=ok)
  return h2


@triton.jit
def _lstm_cell_kernel(out, gi, gh, c, n, H, gi_s, gh_s, c_s, out_s, BLOCK: tl.constexpr, IDX64: tl.constexpr):
  row, col, ok = _element(n, H, BLOCK, IDX64)
  _lstm_forward(out, gi, gh, c, row, col, ok, H, gi_s, gh_s, c_s, out_s)


@triton.jit
def _lstm_step_kernel(out, gi, gh, c, hb, n, H, gi_s, gh_s, c_s, hb_s, out_s, BLOCK: tl.constexpr,
                      IDX64: tl.constexpr):
  """The cell, and h' once more in hb's dtype (the next step's GEMM operand)."""
  row, col, ok = _element(n, H, BLOCK, IDX64)
  h2 = _lstm_forward(out, gi, gh, c, row, col, ok, H, gi_s, gh_s, c_s, out_s)
  tl.store(hb + row * hb_s + col, h2.to(out.dtype.element_ty).to(hb.dtype.element_ty), mask=ok)


@triton.jit
def _lstm_backward(d, dg, gi, gh, c, out, dh, dc_out, row, col, ok, H, gi_s, gh_s, c_s, out_s, d_s, dg_s):
  """[d gates, d c] of the elements from the gradients dh, dc_out of [h', c'] into d's rows, and the gates' again in
  dg's dtype into dg's unless dg has d's (then dg is d itself)."""
  i, f, g, o = _gates(gi, gh, row, col, H, gi_s, gh_s, ok)
  tc = libdevice.tanh(tl.load(out + row * out_s + H + col, mask=ok, other=0.0).to(tl.float32))
  dc = dc_out + dh * o * (1.0 - tc * tc)
  c_old = tl.load(c + row * c_s + col, mask=ok, other=0.0).to(tl.float32)
  ty = d.dtype.element_ty
  da_i = (dc * g * i * (1.0 - i)).to(ty)
  da_f = (dc * c_old * f * (1.0 - f)).to(ty)
  da_g = (dc * i * (1.0 - g * g)).to(ty)
  da_o = (dh * tc * o * (1.0 - o)).to(ty)
  d_row = d + row * d_s + col
  tl.store(d_row, da_i, mask=ok)
  tl.store(d_row + H, da_f, mask=ok)
  tl.store(d_row + 2 * H, da_g, mask=ok)
  tl.store(d_row + 3 * H, da_o, mask=ok)
  tl.store(d_row + 4 * H, (dc * f).to(ty), mask=ok)
  if dg.dtype.element_ty != ty:
    gty = dg.dtype.element_ty
    dg_row = dg + row * dg_s + col
    tl.store(dg_row, da_i.to(gty), mask=ok)
    tl.store(dg_row + H, da_f.to(gty), mask=ok)
    tl.store(dg_row + 2 * H, da_g.to(gty), mask=ok)
    tl.store(dg_row + 3 * H, da_o.to(gty), mask=ok)


@triton.jit
def _lstm_cell_backward_kernel(d, grad, gi, gh, c, out, n, H, grad_s, gi_s, gh_s, c_s, out_s, d_s,
                               BLOCK: tl.constexpr, IDX64: tl.constexpr):
  row, col, ok = _element(n, H, BLOCK, IDX64)
  dh = tl.load(grad + row * grad_s + col, mask=ok, other=0.0).to(tl.float32)
  dc_out = tl.load(grad + row * grad_s + H + col, mask=ok, other=0.0).to(tl.float32)
  _lstm_backward(d, d, gi, gh, c, out, dh, dc_out, row, col, ok, H, gi_s, gh_s, c_s, out_s, d_s, d_s)


@triton.jit
def _lstm_step_backward_kernel(d, grad, dh_in, dc_in, gi, gh, c, out, dg, n, H, grad_s, dh_in_s, dc_in_s, gi_s, gh_s,
                               c_s, out_s, dg_s, d_s, BLOCK: tl.constexpr, IDX64: tl.constexpr):
  """A time step back: the cell's backward with the later step's gradients of h (dh_in, from its GEMM) and c (dc_in)
  added to the output's (grad), and the gates' gradient also in dg's dtype (the next GEMM's operand)."""
  row, col, ok = _element(n, H, BLOCK, IDX64)
  ty = d.dtype.element_ty  # the sums rounded as the separate adds stored them
  dh = (tl.load(grad + row * grad_s + col, mask=ok, other=0.0).to(tl.float32) +
        tl.load(dh_in + row * dh_in_s + col, mask=ok, other=0.0).to(tl.float32)).to(ty).to(tl.float32)
  dc_out = (tl.load(grad + row * grad_s + H + col, mask=ok, other=0.0).to(tl.float32) +
            tl.load(dc_in + row * dc_in_s + col, mask=ok, other=0.0).to(tl.float32)).to(ty).to(tl.float32)
  _lstm_backward(d, dg, gi, gh, c, out, dh, dc_out, row, col, ok, H, gi_s, gh_s, c_s, out_s, d_s, dg_s)


@triton.jit
def _gru_gates(gi, gh, h, row, col, H, gi_s, gh_s, h_s, ok):
  """r, z, n of a GRU step in float32, with gh_n and h."""
  a_r = tl.load(gi + row * gi_s + col, mask=ok, other=0.0).to(tl.float32) + \
      tl.load(gh + row * gh_s + col, mask=ok, other=0.0).to(tl.float32)
  a_z = tl.load(gi + row * gi_s + H + col, mask=ok, other=0.0).to(tl.float32) + \
      tl.load(gh + row * gh_s + H + col, mask=ok, other=0.0).to(tl.float32)
  hn = tl.load(gh + row * gh_s + 2 * H + col, mask=ok, other=0.0).to(tl.float32)
  r, z = 1.0 / (1.0 + libdevice.exp(-a_r)), 1.0 / (1.0 + libdevice.exp(-a_z))
  n = libdevice.tanh(tl.load(gi + row * gi_s + 2 * H + col, mask=ok, other=0.0).to(tl.float32) + r * hn)
  return r, z, n, hn, tl.load(h + row * h_s + col, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _gru_forward(out, gi, gh, h, row, col, ok, H, gi_s, gh_s, h_s, out_s):
  """Store h' of the elements into out's rows; returns it."""
  _, z, g, _, h_old = _gru_gates(gi, gh, h, row, col, H, gi_s, gh_s, h_s, ok)
  h2 = (1.0 - z) * g + z * h_old
  tl.store(out + row * out_s + col, h2.to(out.dtype.element_ty), mask=ok)
  return h2


@triton.jit
def _gru_cell_kernel(out, gi, gh, h, n, H, gi_s, gh_s, h_s, out_s, BLOCK: tl.constexpr, IDX64: tl.constexpr):
  row, col, ok = _element(n, H, BLOCK, IDX64)
  _gru_forward(out, gi, gh, h, row, col, ok, H, gi_s, gh_s, h_s, out_s)


@triton.jit
def _gru_step_kernel(out, gi, gh, h, hb, n, H, gi_s, gh_s, h_s, hb_s, out_s, BLOCK: tl.constexpr,
                     IDX64: tl.constexpr):
  """The cell, and h' once more in hb's dtype (the next step's GEMM operand)."""
  row, col, ok = _element(n, H, BLOCK, IDX64)
  h2 = _gru_forward(out, gi, gh, h, row, col, ok, H, gi_s, gh_s, h_s, out_s)
  tl.store(hb + row * hb_s + col, h2.to(out.dtype.element_ty).to(hb.dtype.element_ty), mask=ok)


@triton.jit
def _gru_backward(d, dg, gi, gh, h, dh, row, col, ok, H, gi_s, gh_s, h_s, d_s, dg_s):
  """[d gi, d gh, d h] of the elements from the gradient dh of h' into d's rows, and d gh again in dg's dtype into
  dg's unless dg has d's (then dg is d's d gh columns)."""
  r, z, g, hn, h_old = _gru_gates(gi, gh, h, row, col, H, gi_s, gh_s, h_s, ok)
  dn = dh * (1.0 - z) * (1.0 - g * g)
  dr, dz = dn * hn * r * (1.0 - r), dh * (h_old - g) * z * (1.0 - z)
  ty = d.dtype.element_ty
  dr, dz, dn, dnr = dr.to(ty), dz.to(ty), dn.to(ty), (dn * r).to(ty)
  d_row = d + row * d_s + col
  tl.store(d_row, dr, mask=ok)
  tl.store(d_row + H, dz, mask=ok)
  tl.store(d_row + 2 * H, dn, mask=ok)
  tl.store(d_row + 3 * H, dr, mask=ok)
  tl.store(d_row + 4 * H, dz, mask=ok)
  tl.store(d_row + 5 * H, dnr, mask=ok)
  tl.store(d_row + 6 * H, (dh * z).to(ty), mask=ok)
  if dg.dtype.element_ty != ty:
    gty = dg.dtype.element_ty
    dg_row = dg + row * dg_s + col
    tl.store(dg_row, dr.to(gty), mask=ok)
    tl.store(dg_row + H, dz.to(gty), mask=ok)
    tl.store(dg_row + 2 * H, dnr.to(gty), mask=ok)


@triton.jit
def _gru_cell_backward_kernel(d, grad, gi, gh, h, n, H, grad_s, gi_s, gh_s, h_s, d_s, BLOCK: tl.constexpr,
                              IDX64: tl.constexpr):
  row, col, ok = _element(n, H, BLOCK, IDX64)
  dh = tl.load(grad + row * grad_s + col, mask=ok, other=0.0).to(tl.float32)
  _gru_backward(d, d, gi, gh, h, dh, row, col, ok, H, gi_s, gh_s, h_s, d_s, d_s)


@triton.jit
def _gru_step_backward_kernel(d, grad, dh_in, dhd_in, gi, gh, h, dg, n, H, grad_s, dh_in_s, dhd_in_s, gi_s, gh_s, h_s,
                              dg_s, d_s, BLOCK: tl.constexpr, IDX64: tl.constexpr):
  """A time step back: the cell's backward with the later step's gradients of h through its GEMM (dh_in) and
  directly (dhd_in) added to the output's (grad), and d gh also in dg's dtype (the next GEMM's operand)."""
  row, col, ok = _element(n, H, BLOCK, IDX64)
  ty = d.dtype.element_ty  # the sums rounded as the separate adds stored them
  dh = (tl.load(grad + row * grad_s + col, mask=ok, other=0.0).to(tl.float32) +
        tl.load(dh_in + row * dh_in_s + col, mask=ok, other=0.0).to(tl.float32)).to(ty).to(tl.float32)
  dh = (dh + tl.load(dhd_in + row * dhd_in_s + col, mask=ok, other=0.0).to(tl.float32)).to(ty).to(tl.float32)
  _gru_backward(d, dg, gi, gh, h, dh, row, col, ok, H, gi_s, gh_s, h_s, d_s, dg_s)


# per kernel: the function, its array parameters in order (the output first) and the elements it loads and stores per
# (n, j), which fused_schedule sizes registers by
_CELLS = {"lstm": (_lstm_cell_kernel, ("out", "gi", "gh", "c"), 11),
          "lstm_step": (_lstm_step_kernel, ("out", "gi", "gh", "c", "hb"), 12),
          "lstm_backward": (_lstm_cell_backward_kernel, ("d", "grad", "gi", "gh", "c", "out"), 17),
          "lstm_step_backward": (_lstm_step_backward_kernel,
                                 ("d", "grad", "dh_in", "dc_in", "gi", "gh", "c", "out", "dg"), 23),
          "gru": (_gru_cell_kernel, ("out", "gi", "gh", "h"), 8),
          "gru_step": (_gru_step_kernel, ("out", "gi", "gh", "h", "hb"), 9),
          "gru_backward": (_gru_cell_backward_kernel, ("d", "grad", "gi", "gh", "h"), 14),
          "gru_step_backward": (_gru_step_backward_kernel,
                                ("d", "grad", "dh_in", "dhd_in", "gi", "gh", "h", "dg"), 19)}


@functools.lru_cache(maxsize=4096)
def cell_spec(kind: str, out: DType, inputs: tuple[DType, ...], n: int, i64: bool):
  """The variant of kernel `kind` (a key of _CELLS) writing `out` from `inputs` of these dtypes."""
  fn, names, operands = _CELLS[kind]
  block, warps = fused_schedule(n, min(t.itemsize for t in (out, *inputs)), operands)
  it = "i64" if i64 else "i32"
  sig = {**{k: ptr(t) for k, t in zip(names, (out, *inputs))}, "n": it, "H": it,
         **{f"{k}_s": it for k in names[1:] + names[:1]}}
  return spec(fn, sig, dict(BLOCK=block, IDX64=i64), num_warps=warps)


def _rows(a: CudaArray) -> CudaArray:
  return a if a.strides[1] == 1 else copy(a)


def _launch(kind: str, out: CudaArray, H: int, *inputs: CudaArray) -> CudaArray:
  n = out.shape[0] * H
  if n == 0: return out
  inputs = tuple(_rows(a) for a in inputs)
  i64 = needs_i64(out.shape, out.strides) or any(needs_i64(a.shape, a.strides) for a in inputs)
  s = cell_spec(kind, out.dtype, tuple(a.dtype for a in inputs), n, i64)
  run(s, (cdiv(n, s.constexprs["BLOCK"]),), out.ptr, *(a.ptr for a in inputs), n, H,
      *(a.strides[0] for a in inputs), out.strides[0])
  return out


def lstm_cell(gi: CudaArray, gh: CudaArray, c: CudaArray) -> CudaArray:
  """[h', c'] (N, 2H) of one LSTM step from its gate pre-activations gi + gh (N, 4H) and cell state c (N, H)."""
  dtype = dtypes.promote_types(dtypes.promote_types(gi.dtype, gh.dtype), c.dtype)
  return _launch("lstm", empty((c.shape[0], 2 * c.shape[1]), dtype, c.device), c.shape[1], gi, gh, c)


def lstm_cell_backward(grad: CudaArray, gi: CudaArray, gh: CudaArray, c: CudaArray, out: CudaArray) -> CudaArray:
  """[d gates, d c] (N, 5H) from the gradient of the forward's [h', c'] (N, 2H), its inputs and its output."""
  return _launch("lstm_backward", empty((c.shape[0], 5 * c.shape[1]), out.dtype, c.device), c.shape[1], grad, gi,
                 gh, c, out)


def gru_cell(gi: CudaArray, gh: CudaArray, h: CudaArray) -> CudaArray:
  """h' (N, H) of one GRU step from its gate pre-activations gi and gh (N, 3H) and hidden state h (N, H)."""
  dtype = dtypes.promote_types(dtypes.promote_types(gi.dtype, gh.dtype), h.dtype)
  return _launch("gru", empty(h.shape, dtype, h.device), h.shape[1], gi, gh, h)


def gru_cell_backward(grad: CudaArray, gi: CudaArray, gh: CudaArray, h: CudaArray) -> CudaArray:
  """[d gi, d gh, d h] (N, 7H) from the gradient of the forward's h' and its inputs."""
  return _launch("gru_backward", empty((h.shape[0], 7 * h.shape[1]), grad.dtype, h.device), h.shape[1], grad, gi, gh,
                 h)


# *** a direction's whole time loop (LSTM, GRU) ***

def _step(a: CudaArray, t: int) -> CudaArray:
  """Step t of a (L, N, X) array: the (N, X) rows (a view)."""
  return view(a, a.shape[1:], a.strides[1:], t * a.strides[0])


def _recurrent(h: CudaArray, w_t: CudaArray, b: CudaArray | None, tf32: bool,
               out: CudaArray | None = None) -> CudaArray:
  """h W^T + b in w's dtype (h cast to it) through the backend's matmul, into `out` when given."""
  if h.dtype is not w_t.dtype: h = cast(h, w_t.dtype)
  return matmul(h, w_t, tf32, out) if b is None else matmul_bias(h, w_t, b, tf32, out)


def _steps(L: int, reverse: bool) -> list[int]:
  return list(range(L - 1, -1, -1) if reverse else range(L))


def _h_before(hs: CudaArray, h0: CudaArray, dtype: DType, reverse: bool) -> CudaArray:
  """The h each step read (L, N, H), in time order and `dtype`, from every step's h and h0: two copies."""
  L, N, H = hs.shape
  h_prev = empty((L, N, H), dtype, hs.device)
  copy(h0, out=_step(h_prev, L - 1 if reverse else 0))
  if L > 1:
    src, dst = (1, 0) if reverse else (0, 1)  # forward: step t read hs[t - 1]; reverse: hs[t + 1]
    copy(view(hs, (L - 1, N, H), hs.strides, src * hs.strides[0]),
         out=view(h_prev, (L - 1, N, H), h_prev.strides, dst * h_prev.strides[0]))
  return h_prev


def _results(*arrays: tuple | None) -> list:
  """The backward's results as (shape, dtype, device) say, None where absent, allocated before any temporary: a step
  replayed on a static memory plan then gets each at its planned offset (see `graphs.PlannedAllocator`)."""
  return [None if a is None else empty(*a) for a in arrays]


def _weight_grads(dw: CudaArray, dgh: CudaArray, h_prev: CudaArray, b_hh: CudaArray | None, tf32: bool) -> tuple:
  """d w_hh into dw (one GEMM over all steps: d gh^T (G, L N) @ h (L N, H)) and d b_hh (a sum of d gh), from the
  gradients of every step's gh (L N, G) and the h's they multiplied."""
  L, N, H = h_prev.shape
  matmul(transposed(dgh), view(h_prev, (L * N, H), (H, 1)), tf32, dw)
  return dw, None if b_hh is None else reduce(dgh, (0,), False, "sum", b_hh.dtype)


def _lstm_sequence(gi: CudaArray, h0: CudaArray, c0: CudaArray, w_hh: CudaArray, b_hh: CudaArray | None, *,
                  reverse: bool, tf32: bool = False) -> CudaArray:
  """Every step's [h, c] (L, N, 2H): per step one GEMM of the previous h into a (N, 4H) buffer that all steps reuse,
  then the cell kernel, which reads the step's slice of gi and writes its slice of the output (and, when the GEMM
  takes another dtype than the state, h' in that dtype into a reused (N, H) buffer, so no step casts); all on the
  current stream, so a CUDA graph captures the whole loop."""
  L, N, G = gi.shape
  H = G // 4
  dtype = dtypes.promote_types(dtypes.promote_types(gi.dtype, w_hh.dtype), c0.dtype)
  out, gh = empty((L, N, 2 * H), dtype, gi.device), empty((N, G), w_hh.dtype, gi.device)
  hb = None if dtype is w_hh.dtype else empty((N, H), w_hh.dtype, gi.device)
  w_t, h, c = transposed(w_hh), h0, c0
  for t in _steps(L, reverse):
    gates, o = _recurrent(h, w_t, b_hh, tf32, gh), _step(out, t)
    if hb is None: _launch("lstm", o, H, _step(gi, t), gates, c)
    else: _launch("lstm_step", o, H, _step(gi, t), gates, c, hb)
    h, c = view(o, (N, H), o.strides) if hb is None else hb, view(o, (N, H), o.strides, H)
  return out


def _lstm_sequence_backward(g: CudaArray, gi: CudaArray, h0: CudaArray, c0: CudaArray, w_hh: CudaArray,
                           b_hh: CudaArray | None, out: CudaArray, *, reverse: bool, states: bool, weights: bool,
                           tf32: bool = False) -> tuple:
  """(d gi, d h0, d c0, d w_hh, d b_hh): every step's h before it (in w_hh's dtype) and one GEMM of them for every
  step's gh first, then per step back in time the cell's backward kernel (into that step's rows of a (L, N, 5H)
  buffer; after the last step it adds the later step's gradients of h and c to the output's itself, and writes the
  gates' gradient in w_hh's dtype into a stack too) and one GEMM with w_hh for the previous h; one GEMM and one sum of
  the stack at the end."""
  L, N, G = gi.shape
  H, dev, wd, steps = G // 4, gi.device, w_hh.dtype, _steps(L, reverse)
  state = lambda s: (s.shape, s.dtype, dev) if states else None
  dgi, dh0, dc0, dw = _results((gi.shape, gi.dtype, dev), state(h0), state(c0),
                               (w_hh.shape, wd, dev) if weights else None)
  h_prev = _h_before(view(out, (L, N, H), out.strides), h0, wd, reverse)
  gh = _recurrent(view(h_prev, (L * N, H), (H, 1)), transposed(w_hh), b_hh, tf32)  # (L N, 4H)
  d = empty((L, N, 5 * H), out.dtype, dev)
  dgates = d if wd is out.dtype else empty((L, N, G), wd, dev)  # the GEMMs' operand
  grad = empty((N, 2 * H), out.dtype, dev)
  dh = None
  for i in range(L - 1, -1, -1):
    t = steps[i]
    g_t, d_t = _step(g, t), _step(d, t)
    c = c0 if i == 0 else view(_step(out, steps[i - 1]), (N, H), (out.strides[1], 1), H)
    cell = (_step(gi, t), view(gh, (N, G), (G, 1), t * N * G), c, _step(out, t))
    dg_t = view(_step(dgates, t), (N, G), _step(dgates, t).strides)
    if dh is None:
      _launch("lstm_backward", d_t, H, copy(g_t, out=grad), *cell)  # g may be broadcast (stride 0)
      if dgates is not d: copy(view(d_t, (N, G), d_t.strides), out=dg_t)
    else:
      _launch("lstm_step_backward", d_t, H, g_t, dh, view(_step(d, steps[i + 1]), (N, H), d_t.strides, G), *cell, dg_t)
    if i or states: dh = matmul(dg_t, w_hh, tf32)
  copy(view(d, (L, N, G), d.strides), out=dgi)
  if states:
    copy(dh, out=dh0)
    copy(view(_step(d, steps[0]), (N, H), d.strides[1:], G), out=dc0)
  db = None
  if weights: dw, db = _weight_grads(dw, view(dgates, (L * N, G), (dgates.strides[1], 1)), h_prev, b_hh, tf32)
  return dgi, dh0, dc0, dw, db


def _gru_sequence(gi: CudaArray, h0: CudaArray, w_hh: CudaArray, b_hh: CudaArray | None, *, reverse: bool,
                 tf32: bool = False) -> CudaArray:
  """Every step's h (L, N, H), as lstm_sequence's loop: per step one GEMM into a reused (N, 3H) buffer and the cell
  kernel into the step's rows of the output (and h' in the GEMM's dtype, when it differs, into a reused buffer)."""
  L, N, G = gi.shape
  H = G // 3
  dtype = dtypes.promote_types(dtypes.promote_types(gi.dtype, w_hh.dtype), h0.dtype)
  out, gh = empty((L, N, H), dtype, gi.device), empty((N, G), w_hh.dtype, gi.device)
  hb = None if dtype is w_hh.dtype else empty((N, H), w_hh.dtype, gi.device)
  w_t, h, h_gemm = transposed(w_hh), h0, h0
  for t in _steps(L, reverse):
    gates, o = _recurrent(h_gemm, w_t, b_hh, tf32, gh), _step(out, t)
    if hb is None: _launch("gru", o, H, _step(gi, t), gates, h)
    else: _launch("gru_step", o, H, _step(gi, t), gates, h, hb)
    h, h_gemm = o, o if hb is None else hb
  return out


def _gru_sequence_backward(g: CudaArray, gi: CudaArray, h0: CudaArray, w_hh: CudaArray, b_hh: CudaArray | None,
                          out: CudaArray, *, reverse: bool, states: bool, weights: bool, tf32: bool = False) -> tuple:
  """(d gi, d h0, d w_hh, d b_hh), as lstm_sequence_backward's: gh of every step by one GEMM, then per step back the
  cell's backward kernel into the step's rows of a (L, N, 7H) buffer ([d gi, d gh, d h]; after the last step it adds
  the later step's d gh times w_hh and d h to the output's gradient itself, and writes d gh in w_hh's dtype into a
  stack too), and d gh times w_hh for the previous h."""
  L, N, G = gi.shape
  H, dev, wd, steps = G // 3, gi.device, w_hh.dtype, _steps(L, reverse)
  dgi, dh0, dw = _results((gi.shape, gi.dtype, dev), (h0.shape, h0.dtype, dev) if states else None,
                          (w_hh.shape, wd, dev) if weights else None)
  h_prev = _h_before(out, h0, wd, reverse)
  gh = _recurrent(view(h_prev, (L * N, H), (H, 1)), transposed(w_hh), b_hh, tf32)  # (L N, 3H)
  d = empty((L, N, 7 * H), out.dtype, dev)
  dgh, at = (d, G) if wd is out.dtype else (empty((L, N, G), wd, dev), 0)  # the GEMMs' operand, at column `at`
  grad = empty((N, H), out.dtype, dev)
  dh = None
  for i in range(L - 1, -1, -1):
    t = steps[i]
    g_t, d_t = _step(g, t), _step(d, t)
    h = h0 if i == 0 else _step(out, steps[i - 1])
    cell = (_step(gi, t), view(gh, (N, G), (G, 1), t * N * G), h)
    dgh_t = view(_step(dgh, t), (N, G), (dgh.strides[1], 1), at)
    if dh is None:
      _launch("gru_backward", d_t, H, copy(g_t, out=grad), *cell)
      if dgh is not d: copy(view(d_t, (N, G), d_t.strides, G), out=dgh_t)
    else:
      _launch("gru_step_backward", d_t, H, g_t, dh, view(_step(d, steps[i + 1]), (N, H), d_t.strides, 2 * G), *cell,
              dgh_t)
    if i or states: dh = matmul(dgh_t, w_hh, tf32)
  copy(view(d, (L, N, G), d.strides), out=dgi)
  if states: elementwise.launch("add", dh0, view(_step(d, steps[0]), (N, H), d.strides[1:], 2 * G), dh)
  db = None
  if weights: dw, db = _weight_grads(dw, view(dgh, (L * N, G), (dgh.strides[1], 1), at), h_prev, b_hh, tf32)
  return dgi, dh0, dw, db


def _replayed(name: str, fn, *arrays: CudaArray | None, **attrs) -> tuple:
  """fn(*arrays, **attrs) as `graphs.replayed` runs it (a CUDA graph of the whole loop from the second call with the
  same layouts and settings on), keyed by the arrays' layouts, their device and the settings."""
  key = (name, next(a.device for a in arrays if a is not None), tuple(None if a is None else a.key() for a in arrays),
         tuple(sorted(attrs.items())))
  return graphs.replayed(key, functools.partial(fn, **attrs), *arrays)


def lstm_sequence(gi: CudaArray, h0: CudaArray, c0: CudaArray, w_hh: CudaArray, b_hh: CudaArray | None, *,
                  reverse: bool, tf32: bool = False) -> CudaArray:
  """The `lstm_sequence` op: `_lstm_sequence`'s loop, replayed as one CUDA graph when its shapes come again."""
  loop = lambda *xs, **kw: (_lstm_sequence(*xs, **kw),)
  return _replayed("lstm_sequence", loop, gi, h0, c0, w_hh, b_hh, reverse=reverse, tf32=tf32)[0]


def lstm_sequence_backward(g: CudaArray, gi: CudaArray, h0: CudaArray, c0: CudaArray, w_hh: CudaArray,
                           b_hh: CudaArray | None, out: CudaArray, *, reverse: bool, states: bool, weights: bool,
                           tf32: bool = False) -> tuple:
  """The `lstm_sequence_backward` op: `_lstm_sequence_backward`'s loop, replayed as `lstm_sequence`'s."""
  return _replayed("lstm_sequence_backward", _lstm_sequence_backward, g, gi, h0, c0, w_hh, b_hh, out,
                   reverse=reverse, states=states, weights=weights, tf32=tf32)


def gru_sequence(gi: CudaArray, h0: CudaArray, w_hh: CudaArray, b_hh: CudaArray | None, *, reverse: bool,
                 tf32: bool = False) -> CudaArray:
  """The `gru_sequence` op: `_gru_sequence`'s loop, replayed as `lstm_sequence`'s."""
  loop = lambda *xs, **kw: (_gru_sequence(*xs, **kw),)
  return _replayed("gru_sequence", loop, gi, h0, w_hh, b_hh, reverse=reverse, tf32=tf32)[0]


def gru_sequence_backward(g: CudaArray, gi: CudaArray, h0: CudaArray, w_hh: CudaArray, b_hh: CudaArray | None,
                          out: CudaArray, *, reverse: bool, states: bool, weights: bool, tf32: bool = False) -> tuple:
  """The `gru_sequence_backward` op: `_gru_sequence_backward`'s loop, replayed as `lstm_sequence`'s."""
  return _replayed("gru_sequence_backward", _gru_sequence_backward, g, gi, h0, w_hh, b_hh, out, reverse=reverse,
                   states=states, weights=weights, tf32=tf32)


KERNELS = {"lstm_cell": lstm_cell, "lstm_cell_backward": lstm_cell_backward, "gru_cell": gru_cell,
           "gru_cell_backward": gru_cell_backward, "lstm_sequence": lstm_sequence,
           "lstm_sequence_backward": lstm_sequence_backward, "gru_sequence": gru_sequence,
           "gru_sequence_backward": gru_sequence_backward}

_F32, _BF16 = dtypes.float32, dtypes.bfloat16
_MIXED = {"lstm": (_BF16, _BF16, _F32), "lstm_backward": (_F32, _BF16, _BF16, _F32, _F32),  # bf16 gates, float32 states
          "lstm_step": (_BF16, _BF16, _F32, _BF16),
          "lstm_step_backward": (_F32, _BF16, _F32, _BF16, _BF16, _F32, _F32, _BF16),
          "gru": (_BF16, _BF16, _F32), "gru_backward": (_F32, _BF16, _BF16, _F32),
          "gru_step": (_BF16, _BF16, _F32, _BF16), "gru_step_backward": (_F32, _BF16, _F32, _BF16, _BF16, _F32, _BF16)}
SPECS = [s for kind, mixed in _MIXED.items() for s in (
  cell_spec(kind, _F32, mixed, 32 * 1024, False), cell_spec(kind, _F32, (_F32,) * len(mixed), 64, False),
  cell_spec(kind, _BF16, (_BF16,) * len(mixed), 32 * 1024, True))]
