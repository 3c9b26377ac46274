"""A stand-in for nvidia-cudnn-frontend's `cudnn` module on the fake GPU (fake_cuda.py): graphs that keep what they
were built with and what each `_execute` was given, and compute nothing, so that the cuDNN convolution path's host
code (kernels/cudnn_conv.py: problems, graphs, workspaces, the stream) runs without a GPU.

  import fake_cudnn; fake_cudnn.install()   # after fake_cuda.install()
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

_uids = itertools.count(1)
graphs: list[Graph] = []       # every graph built, in order
executed: list[tuple] = []     # (graph, {uid: pointer}, workspace pointer, handle) of every _execute
WORKSPACE = {"fwd": 0, "dgrad": 0, "wgrad": 1 << 20}  # bytes a graph of each kind asks for

data_type = SimpleNamespace(BFLOAT16="bf16", HALF="f16", FLOAT="f32")
numerical_note = SimpleNamespace(NONDETERMINISTIC="nondeterministic")
heur_mode = SimpleNamespace(A="a", FALLBACK="fallback")


class Tensor:
  def __init__(self, **attrs):
    self.uid, self.attrs = next(_uids), attrs

  def get_uid(self) -> int: return self.uid

  def set_output(self, value: bool) -> Tensor:
    self.attrs["output"] = value
    return self

  def set_data_type(self, value) -> Tensor:
    self.attrs["data_type"] = value
    return self

  def set_dim(self, value) -> Tensor:
    self.attrs["dim"] = value
    return self

  def set_stride(self, value) -> Tensor:
    self.attrs["stride"] = value
    return self


class Graph:
  def __init__(self, **attrs):
    self.attrs, self.tensors, self.kind, self.geometry = attrs, [], None, None
    graphs.append(self)

  def tensor(self, **attrs) -> Tensor:
    self.tensors.append(t := Tensor(**attrs))
    return t

  def _op(self, kind: str, geometry: dict) -> Tensor:
    self.kind, self.geometry = kind, geometry
    return self.tensor()

  def conv_fprop(self, image, weight, **geometry): return self._op("fwd", geometry)
  def conv_dgrad(self, loss, filter, **geometry): return self._op("dgrad", geometry)
  def conv_wgrad(self, image, loss, **geometry): return self._op("wgrad", geometry)
  def validate(self): pass
  def build_operation_graph(self): pass
  def deselect_numeric_notes(self, notes): pass
  def create_execution_plans(self, modes): pass
  def check_support(self): pass
  def build_plans(self): pass
  def get_workspace_size(self) -> int: return WORKSPACE[self.kind]
  def _execute(self, pack: dict, workspace: int, handle) -> None: executed.append((self, dict(pack), workspace, handle))


pygraph = Graph
streams: dict = {}  # handle -> the stream last set


def backend_version() -> int: return 91000
def create_handle() -> int: return 7
def set_stream(handle, stream) -> None: streams[handle] = stream


def install() -> None:
  """Make the cuDNN convolution path use this module (fake_cuda.install() first)."""
  from blutrain.backend.cuda.kernels import cudnn_conv
  import sys
  sys.modules["cudnn"] = sys.modules[__name__]
  cudnn_conv._frontend = sys.modules[__name__]
