"""Convolutions through cuDNN's graph API (`nvidia-cudnn-frontend`, raw pointers), the path of
`bt.backends.conv = "cudnn"`: one handle per device, one graph per problem (kind, dtype, layouts, geometry) built once
with cuDNN's heuristics and cached, a workspace from our allocator on the current stream for each call.

It takes bfloat16, float16, and float32 under TF32 (the op's `tf32` attribute), with one group and every size
non-zero; conv.py's implicit-GEMM kernels take the rest (float64, float32 in full precision, grouped convolutions,
empty tensors) and everything when the frontend or libcudnn does not load. cuDNN reads the operands in their own
layouts (NCHW, channels-last, any dense order); others are copied contiguous first, as are operands off 16 bytes.
The output and the input gradient are new arrays in the layout of the input and of the output gradient (PyTorch's
outputs keep their inputs' memory format; cuDNN's Hopper kernels are channels-last and reach any other layout by
transposing kernels around them), the weight gradient channels-last for a channels-last input and contiguous
otherwise (PyTorch's rule; cuDNN's wgrad wrote other dense orders wrong). 1-D convolutions run as 2-D ones of height 1.
Engines cuDNN marks nondeterministic are left out when any other engine takes the problem, so a step gives the same
bits run after run (compiled and eager alike).
"""
from __future__ import annotations

import functools
import threading
from typing import Any

from blutrain import backends, dtypes
from blutrain.backend.cuda import runtime
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import empty, empty_like, empty_suggested
from blutrain.backend.cuda.kernels.copy import copy
from blutrain.backend.cuda.memory import is_dense
from blutrain.dtypes import DType

_frontend: Any = None  # the cudnn module, or False when it or libcudnn does not load
_handles: dict[int, int] = {}  # device -> cudnnHandle_t
_streams: dict[int, int] = {}  # handle -> the stream it was last set to
_lock = threading.Lock()


def _cudnn() -> Any:
  """The frontend module, imported on first use (the package imports and runs without it)."""
  global _frontend
  if _frontend is None:
    try:
      import cudnn
      cudnn.backend_version()  # raises when no libcudnn was found
      _frontend = cudnn
    except Exception:
      _frontend = False
  return _frontend


def available() -> bool:
  """Whether cuDNN's frontend and library load here."""
  return bool(_cudnn())


def takes(dtype: DType, groups: int, tf32: bool, *arrays: CudaArray) -> bool:
  """Whether a convolution of `dtype` runs on cuDNN: `bt.backends.conv` says so, cuDNN loads, the dtype is a half or
  float32 allowed TF32, one group, and no operand is empty."""
  return backends.conv == "cudnn" and (dtype in (dtypes.bfloat16, dtypes.float16) or
                                       dtype is dtypes.float32 and tf32) and groups == 1 and \
    all(a.size for a in arrays) and available()


def _handle(device: int) -> int:
  h = _handles.get(device)
  if h is None:
    runtime.state(device)  # the device's context current
    with _lock:
      h = _handles.get(device)
      if h is None: h = _handles[device] = _cudnn().create_handle()
  return h


def _as4d(shape, strides) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """A 1-D convolution's (N, C, L) operand as (N, C, 1, L); 2-D and 3-D ones as they are."""
  if len(shape) != 3: return tuple(shape), tuple(strides)
  return (*shape[:2], 1, shape[2]), (*strides[:2], shape[2] * strides[2], strides[2])


def _readable(a: CudaArray) -> bool:
  """Whether cuDNN reads a as it is: dense (no gap or overlap) and 16-byte aligned; others are copied contiguous."""
  return a.ptr % 16 == 0 and is_dense(a)


@functools.lru_cache(maxsize=1024)
def _graph(kind: str, dtype: DType, a_shape: tuple, a_strides: tuple, b_shape: tuple, b_strides: tuple,
           out_shape: tuple, out_strides: tuple, stride: tuple, padding: tuple, dilation: tuple,
           device: int) -> tuple[Any, tuple[int, int, int], int]:
  """(graph, uids of a, b and out, workspace bytes) of one problem: operands a, b, out by shape and strides (1-D
  convolutions as 2-D ones of height 1, `_as4d`). fwd: a = x, b = w, out = y; dgrad: a = g, b = w, out = dx; wgrad:
  a = x, b = g, out = dw."""
  if len(out_shape) == 3: stride, padding, dilation = (1, *stride), (0, *padding), (1, *dilation)
  a, b, out = (_as4d(*t) for t in ((a_shape, a_strides), (b_shape, b_strides), (out_shape, out_strides)))
  cudnn = _cudnn()
  io = {dtypes.bfloat16: cudnn.data_type.BFLOAT16, dtypes.float16: cudnn.data_type.HALF,
        dtypes.float32: cudnn.data_type.FLOAT}[dtype]
  last = None
  for deterministic in (True, False):
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=_handle(device))
    ta, tb = (g.tensor(name=n, dim=list(t[0]), stride=list(t[1]), data_type=io) for n, t in (("a", a), ("b", b)))
    geometry = dict(padding=list(padding), stride=list(stride), dilation=list(dilation))
    if kind == "fwd": y = g.conv_fprop(image=ta, weight=tb, **geometry)
    elif kind == "dgrad": y = g.conv_dgrad(loss=ta, filter=tb, **geometry)
    else: y = g.conv_wgrad(image=ta, loss=tb, **geometry)
    y.set_output(True).set_data_type(io).set_dim(list(out[0])).set_stride(list(out[1]))
    try:
      g.validate()
      g.build_operation_graph()
      if deterministic: g.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC])
      g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
      g.check_support()
      g.build_plans()
    except Exception as e:  # no deterministic engine: take any
      last = e
      continue
    return g, (ta.get_uid(), tb.get_uid(), y.get_uid()), g.get_workspace_size()
  raise RuntimeError(f"cuDNN conv {kind}: no engine for {dtype.name} {a[0]} and {b[0]} -> {out[0]} "
                     f"(stride {stride}, padding {padding}, dilation {dilation}): {last}; "
                     f"set bt.backends.conv = 'triton' to run blutrain's own kernels") from last


_problems: dict[tuple, tuple] = {}  # (kind, the operands' layout keys, geometry) -> `_graph`'s answer


def _run(kind: str, a: CudaArray, b: CudaArray, out: CudaArray, stride, padding, dilation) -> CudaArray:
  """Run one problem into `out` on the current stream. A problem whose operands cuDNN reads as they are finds its
  graph by their layout keys (one dict lookup; `_graph`'s key is a dozen tuples). The graph's C++ `_execute` is
  called with the uids' pointers directly (the frontend's Python `execute` maps tensors to uids first)."""
  key = (kind, a.layout_key or a.key(), b.layout_key or b.key(), out.layout_key or out.key(), stride, padding,
         dilation, out.device)
  found = _problems.get(key)
  if found is None:
    cached = _readable(a) and _readable(b)
    if not cached: a, b = (x if _readable(x) else copy(x) for x in (a, b))
    found = _graph(kind, a.dtype, a.shape, a.strides, b.shape, b.strides, out.shape, out.strides, tuple(stride),
                   tuple(padding), tuple(dilation), out.device)
    if cached:
      if len(_problems) >= 4096: _problems.clear()  # layouts of a long-gone model
      _problems[key] = found
  g, (ua, ub, uo), ws_bytes = found
  h, stream = _handle(out.device), runtime.launch_stream()
  if _streams.get(h) != stream.handle:  # cudnnSetStream queries the driver: only when the stream changes
    _cudnn().set_stream(h, stream.handle)
    _streams[h] = stream.handle
  ws = empty((ws_bytes,), dtypes.uint8, out.device) if ws_bytes else None  # kept until the call is queued
  g._execute({ua: a.ptr, ub: b.ptr, uo: out.ptr}, ws.ptr if ws is not None else 0, h)
  return out


def conv(x: CudaArray, w: CudaArray, stride, padding, dilation) -> CudaArray:
  """The convolution of x (N, C, *spatial) with w (C_out, C, *kernel), a new array in x's dense layout (channels-last
  stays channels-last, which cuDNN's kernels read and write without transposing)."""
  out_sp = [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in zip(x.shape[2:], w.shape[2:], stride, padding,
                                                                               dilation)]
  return _run("fwd", x, w, empty_like(x, shape=(x.shape[0], w.shape[0], *out_sp)), stride, padding, dilation)


def conv_grad_input(g: CudaArray, w: CudaArray, shape, stride, padding, dilation) -> CudaArray:
  """conv's gradient for an input of `shape`, a new array in g's dense layout."""
  return _run("dgrad", g, w, empty_like(g, shape=shape), stride, padding, dilation)


def conv_grad_weight(g: CudaArray, x: CudaArray, shape, stride, padding, dilation) -> CudaArray:
  """conv's gradient for a weight of `shape`, a new array channels-last for a channels-last x (as cuDNN's kernels
  write it: a row-major one cost a transpose) and contiguous otherwise, as PyTorch returns it; a leaf of another
  layout takes it through autograd's copy into its own."""
  return _run("wgrad", x, g, empty_suggested(x, g.dtype, shape), stride, padding, dilation)
