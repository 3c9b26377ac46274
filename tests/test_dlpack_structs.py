"""The CUDA backend's DLPack structs and capsule ownership, checked on the CPU against PyTorch's own DLPack
producer and consumer (device type kDLCPU, so no GPU is needed; the CUDA path differs only in the device field)."""
import gc

import numpy as np
import pytest
import torch

from blutrain import dtypes
from blutrain.backend.cuda import interop as dl

kDLCPU = (1, 0)


@pytest.mark.parametrize("versioned", [False, True])
def test_torch_consumes_our_capsule_sharing_memory(versioned):
  a = np.arange(24, dtype=np.float32).reshape(4, 6)
  view = a[:, 1::2]
  n = len(dl._exports)
  strides = [s // 4 for s in view.strides]
  cap = dl.make_capsule(view.ctypes.data, view.shape, strides, dtypes.float32, kDLCPU, a, versioned)
  t = torch.from_dlpack(cap)
  assert t.shape == (4, 3) and t.stride() == (6, 2) and t.dtype == torch.float32
  np.testing.assert_array_equal(t.numpy(), view)
  t[0, 0] = 100.0
  assert a[0, 1] == 100.0
  del cap
  assert len(dl._exports) == n + 1   # the consumer holds it
  del t
  gc.collect()
  assert len(dl._exports) == n       # torch called our deleter


@pytest.mark.parametrize("versioned", [False, True])
def test_unconsumed_capsule_releases_its_owner(versioned):
  a = np.ones(5, np.float32)
  n = len(dl._exports)
  cap = dl.make_capsule(a.ctypes.data, a.shape, (1,), dtypes.float32, kDLCPU, a, versioned)
  assert len(dl._exports) == n + 1
  del cap
  gc.collect()
  assert len(dl._exports) == n


@pytest.mark.parametrize("versioned", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool,
                                   torch.float64])
def test_we_read_torch_capsules(dtype, versioned):
  base = (torch.randn(6, 8) * 5).to(dtype)
  t = base[1:, ::2].t()                                  # strided, with an offset
  cap = t.__dlpack__(max_version=(1, 0)) if versioned else t.__dlpack__()
  a = dl.import_capsule(cap)
  assert a.ptr == t.data_ptr() and a.shape == tuple(t.shape) and a.strides == t.stride()
  assert a.dtype is dtypes.to_dtype(str(dtype).removeprefix("torch.").replace("bool", "bool_"))
  assert a.device == 0
  del a
  gc.collect()                                           # the producer's deleter ran without error
  assert torch.equal(t, base[1:, ::2].t())


def test_unsupported_types_are_named():
  cap = torch.zeros(3, dtype=torch.uint16).__dlpack__()
  with pytest.raises(TypeError, match="uint16x1 has no blutrain dtype"):
    dl.import_capsule(cap)
  with pytest.raises(TypeError, match="neither"):
    dl.import_capsule(object())
