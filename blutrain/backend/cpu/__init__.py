"""The CPU backend: flat numpy buffers, strided numpy views, and the numpy kernels of `kernels.py`."""
from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from blutrain import backend
from blutrain.backend.cpu.kernels import kernels
from blutrain.shapes import contiguous_strides, memory_order


def view(data: np.ndarray, shape, strides, offset: int, dtype) -> np.ndarray:
  """A numpy view of a flat buffer (strides in elements); plain reshape for the common contiguous case."""
  if offset == 0 and data.size == math.prod(shape) and tuple(strides) == contiguous_strides(shape):
    return data.reshape(shape)
  item = data.itemsize
  return as_strided(data[offset:], shape=shape, strides=tuple(s * item for s in strides))


def wrap(array, dtype) -> tuple:
  """A kernel's result as (flat buffer, shape, strides, offset, view), sharing its memory when it is dense in any
  order: numpy's ufuncs lay their output out as their inputs are (a channels-last input gives a channels-last result,
  as PyTorch's kernels keep the memory format); other layouts (gaps, broadcasts, negative strides) are copied
  row-major."""
  arr = np.asarray(array)
  if arr.dtype != dtype.np: arr = arr.astype(dtype.np)
  if arr.flags.c_contiguous: return arr.reshape(-1), arr.shape, contiguous_strides(arr.shape), 0, arr
  strides = tuple(s // arr.itemsize for s in arr.strides)
  if all(s % arr.itemsize == 0 for s in arr.strides) and (order := memory_order(arr.shape, strides)) is not None:
    return arr.transpose(order).reshape(-1), arr.shape, strides, 0, arr
  arr = np.ascontiguousarray(arr)
  return arr.reshape(-1), arr.shape, contiguous_strides(arr.shape), 0, arr


def empty(numel: int, dtype) -> np.ndarray: return np.empty(numel, dtype.np)
def from_numpy(array: np.ndarray) -> np.ndarray: return np.array(array, copy=True)
def to_numpy(array: np.ndarray) -> np.ndarray: return array
def from_dlpack(ext) -> np.ndarray: return np.from_dlpack(ext)
def copy_into(dst: np.ndarray, src: np.ndarray) -> None: np.copyto(dst, src, casting="unsafe")


def to_device(x: np.ndarray, target) -> object:
  """A copy of a host array in the memory of another device's backend (the `to_device` op's kernel)."""
  return x.copy() if target.type == "cpu" else backend.get(target).from_numpy(x, target.index)


kernels["to_device"] = to_device


def data_ptr(array: np.ndarray) -> int:
  """The address of an array's first element."""
  return array.__array_interface__["data"][0]


def dlpack(array: np.ndarray, stream=None, **kw):
  if array.dtype.kind == "V" or array.dtype.name == "bfloat16":
    raise TypeError("DLPack export of bfloat16 CPU tensors is not supported by numpy; convert with .float() first")
  return array.__dlpack__(**kw)
