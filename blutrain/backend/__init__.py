"""Backends hold storage and kernels, never math. `get(device)` finds the one for a device.

A backend module provides:
  kernels: dict[str, Callable]        op name -> kernel(*arrays, **attrs) -> array
  empty(numel, dtype) -> data          a flat buffer
  from_numpy(array) -> data            a flat copy of a host array
  view(data, shape, strides, offset, dtype) -> array   what kernels take (strides in elements)
  to_numpy(array) -> np.ndarray        host copy of a kernel array
  wrap(array, dtype) -> (data, shape, strides, offset, view)   a kernel result as storage, layout and view
and optionally require(), which raises ImportError when the module imports but this machine cannot run it.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

from blutrain.device import Device

_loaded: dict[str, ModuleType] = {}


def get(device: Device) -> ModuleType:
  if (mod := _loaded.get(device.type)) is None:
    try:
      mod = importlib.import_module(f"blutrain.backend.{device.type}")
      if hasattr(mod, "require"): mod.require()
      _loaded[device.type] = mod
    except ImportError as e:
      raise RuntimeError(f"device {device} is not available: the {device.type} backend could not load ({e}). "
                         f"Use device='cpu', or a machine with an NVIDIA GPU and its driver (`blutrain info` says more).") from e
  return mod


def cache_dir(*parts: str) -> Path:
  """Where compiled code is kept (Triton cubins, Nova's generated code): $BLUTRAIN_CACHE_DIR, else ~/.cache/blutrain."""
  return Path(os.environ.get("BLUTRAIN_CACHE_DIR") or Path.home() / ".cache" / "blutrain", *parts)
