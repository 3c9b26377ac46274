"""Tests on a real GPU. Every test in this folder is skipped, with the reason, when the CUDA backend cannot run here
(no GPU, driver or cuda.core), so test modules must not touch the GPU at import time.

After each test the device is synchronized, so that an asynchronous kernel fault is reported by the test that
caused it."""
from pathlib import Path

import pytest

from blutrain.backend.cuda import runtime

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
  if runtime.is_available(): return
  skip = pytest.mark.skip(reason=f"the CUDA backend cannot run here: {runtime.unavailable_reason()}")
  for item in items:
    if HERE in Path(str(item.fspath)).parents: item.add_marker(skip)


@pytest.fixture(autouse=True)
def _synchronize():
  yield
  if runtime.is_available(): runtime.synchronize()


@pytest.fixture
def torch_cuda():
  """PyTorch on the GPU (an oracle and a DLPack peer)."""
  torch = pytest.importorskip("torch")
  if not torch.cuda.is_available(): pytest.skip("PyTorch here has no CUDA")
  return torch
