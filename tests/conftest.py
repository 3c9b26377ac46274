"""Shared pytest setup: seeds, the `cuda` marker's skip, and hypothesis profiles."""
import os
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import blutrain as bt

# "ci" keeps property tests short and free of timing flakiness; "dev" searches harder (HYPOTHESIS_PROFILE=dev)
settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=300)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _cuda_available() -> bool:
  """True when blutrain's cuda backend loads; it refuses to without cuda.core, a driver and a GPU."""
  try:
    bt.backend.get(bt.device("cuda", 0))
    return True
  except Exception:
    return False


def pytest_collection_modifyitems(config, items):
  if any("cuda" in item.keywords for item in items) and not _cuda_available():
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and blutrain's cuda backend")
    for item in items:
      if "cuda" in item.keywords: item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
  """Every test starts from the same random state in blutrain, numpy, random and (when loaded) torch."""
  bt.manual_seed(0)
  np.random.seed(0)
  random.seed(0)
  try:
    import torch
    torch.manual_seed(0)
  except ImportError:
    pass
