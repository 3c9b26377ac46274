"""`bt.save` and `bt.load`: nested containers of tensors, numbers and strings in a file that holds no code.

The file is a zip archive of two members: `structure.json`, the object with each tensor replaced by a reference
(and each tensor's dtype, shape, device and requires_grad), and `tensors.safetensors`, every tensor's values, dense
and contiguous. Loading parses JSON and raw bytes only, so it never executes anything the file says; the zip's
CRC-32 of each member catches bytes changed on disk.

Sharing: a tensor object that appears several times is written once and loaded as one object again; distinct tensors
that share storage (a view and its base) are written as independent copies and come back independent, where
PyTorch would keep them sharing. Parameters come back as plain tensors with their requires_grad.
"""
from __future__ import annotations

import json
import os
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np
from safetensors import SafetensorError, deserialize
from safetensors.numpy import save as safetensors_bytes

from blutrain import dtypes
from blutrain.device import Device, to_device
from blutrain.dtypes import DType
from blutrain.ops import from_numpy
from blutrain.tensor import Tensor

FORMAT, VERSION = "blutrain.save", 1
_STRUCTURE, _TENSORS = "structure.json", "tensors.safetensors"

FileLike = str | os.PathLike | BinaryIO
MapLocation = str | Device | dict[str, str] | Callable[[Tensor, str], Tensor] | None


# *** object <-> (JSON, tensors) ***

def _encode(obj: Any, tensors: dict[str, Tensor], memo: dict[int, str], path: str) -> Any:
  """A JSON value for obj: None, bools, numbers and strings as themselves, anything else a one-key object naming
  its kind; tensors go into `tensors`, each object once."""
  if obj is None or isinstance(obj, (bool, int, float, str)): return obj
  if isinstance(obj, Tensor):
    if id(obj) not in memo: memo[id(obj)] = key = f"t{len(tensors)}"; tensors[key] = obj
    return {"tensor": memo[id(obj)]}
  if isinstance(obj, DType): return {"dtype": obj.name}
  if isinstance(obj, Device): return {"device": str(obj)}
  if isinstance(obj, np.generic) and obj.dtype.kind in "biuf": return obj.item()
  if isinstance(obj, dict):
    kind = "odict" if isinstance(obj, OrderedDict) else "dict"
    return {kind: [[_encode(k, tensors, memo, path), _encode(v, tensors, memo, f"{path}[{k!r}]")] for k, v in obj.items()]}
  if isinstance(obj, (list, tuple)):
    return {type(obj).__name__ if type(obj) in (list, tuple) else "list":
            [_encode(v, tensors, memo, f"{path}[{i}]") for i, v in enumerate(obj)]}
  raise TypeError(f"save: cannot save {type(obj).__name__} at {path or 'the top level'}: bt.save writes tensors, "
                  "None, bools, numbers, strings, dtypes, devices and dicts, lists and tuples of them (no pickled objects)")


def _hashable(key: Any) -> Any:
  return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def _decode(obj: Any, tensors: dict[str, Tensor]) -> Any:
  if not isinstance(obj, dict): return obj
  (kind, value), = obj.items()
  if kind == "tensor": return tensors[value]
  if kind == "dtype": return dtypes.to_dtype(value)
  if kind == "device": return to_device(value)
  if kind in ("dict", "odict"):
    items = ((_hashable(_decode(k, tensors)), _decode(v, tensors)) for k, v in value)
    return OrderedDict(items) if kind == "odict" else dict(items)
  if kind == "list": return [_decode(v, tensors) for v in value]
  if kind == "tuple": return tuple(_decode(v, tensors) for v in value)
  raise ValueError(f"unknown entry {kind!r}")


# *** save ***

def save(obj: Any, f: FileLike) -> None:
  """Save `obj` (a state dict, or nested dicts, lists and tuples of tensors, numbers and strings) to `f`.

  Args:
    obj: the object; other types raise TypeError naming where they sit.
    f: a path, written atomically (into a temporary file in the same directory, then renamed over `f`), or a
      writable binary file object.

  Example:
    >>> bt.save({"model": model.state_dict(), "step": 100}, "ckpt.bt")
  """
  tensors: dict[str, Tensor] = {}
  structure = _encode(obj, tensors, {}, "")
  arrays = {k: np.require(t.detach().cpu().numpy(), requirements="C") for k, t in tensors.items()}
  meta = {k: {"dtype": t.dtype.name, "shape": list(t.shape), "device": str(t.device), "requires_grad": t.requires_grad}
          for k, t in tensors.items()}
  header = json.dumps({"format": FORMAT, "version": VERSION, "tensors": meta, "object": structure})
  blob = safetensors_bytes(arrays) if arrays else b""
  if not isinstance(f, (str, os.PathLike)): return _write(f, header, blob)
  path = Path(f)
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  try:
    with open(tmp, "wb") as out:
      _write(out, header, blob)
      out.flush()
      os.fsync(out.fileno())
    os.replace(tmp, path)
  finally:
    if tmp.exists(): tmp.unlink()


def _write(f: BinaryIO, header: str, blob: bytes) -> None:
  with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
    z.writestr(_STRUCTURE, header)
    z.writestr(_TENSORS, blob)


# *** load ***

def load(f: FileLike, map_location: MapLocation = None, weights_only: bool = True) -> Any:
  """Load an object written by `bt.save`.

  Args:
    f: a path or a readable, seekable binary file object.
    map_location: where tensors go: None (the device each was saved from), a device ("cpu", "cuda", "cuda:1",
      a `bt.device`), a dict from saved device names to devices ({"cuda:1": "cuda:0"}; others stay), or a function
      of (the tensor, loaded on the CPU, and its saved device name) returning the tensor to use.
    weights_only: accepted for PyTorch compatibility; the format holds no code whatever its value, so loading
      never executes anything.

  Raises:
    FileNotFoundError: no file at `f`. RuntimeError: not a bt.save file, or a corrupt one (naming what is wrong).

  Example:
    >>> state = bt.load("ckpt.bt", map_location="cpu")
  """
  name = str(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "the file object")
  try:
    with zipfile.ZipFile(f) as z:
      names = z.namelist()
      if _STRUCTURE not in names:
        if any(n.endswith("data.pkl") for n in names):
          raise RuntimeError(f"load: {name} was written by torch.save (a pickle), which bt.load does not execute; "
                             "save a state dict with safetensors (safetensors.torch.save_file) and load it instead")
        raise RuntimeError(f"load: {name} is a zip archive but not a bt.save file (it has no {_STRUCTURE})")
      header, blob = json.loads(z.read(_STRUCTURE)), z.read(_TENSORS)
  except zipfile.BadZipFile as e:
    raise RuntimeError(f"load: {name} is not a bt.save file or is corrupt: {e}") from None
  except (KeyError, json.JSONDecodeError) as e:
    raise RuntimeError(f"load: {name} is corrupt: {e}") from None
  if not isinstance(header, dict) or header.get("format") != FORMAT:
    raise RuntimeError(f"load: {name} is not a bt.save file (its {_STRUCTURE} names no format {FORMAT!r})")
  if header.get("version") != VERSION:
    raise RuntimeError(f"load: {name} has format version {header.get('version')}, this blutrain reads {VERSION}")
  try:
    tensors = _tensors(header["tensors"], blob, map_location)
    return _decode(header["object"], tensors)
  except (SafetensorError, KeyError, ValueError) as e:
    raise RuntimeError(f"load: {name} is corrupt: {e}") from None


def _target(saved: str, map_location: MapLocation) -> Device:
  if map_location is None: return to_device(saved)
  if isinstance(map_location, dict): return to_device(map_location.get(saved, saved))
  if isinstance(map_location, (str, Device)): return to_device(map_location)
  raise TypeError(f"load: map_location must be None, a device, a dict of device names or a function, got "
                  f"{type(map_location).__name__}")


def _placed(t: Tensor, saved: str, map_location: MapLocation) -> Tensor:
  """A loaded CPU tensor moved to the device map_location names for its saved device."""
  device = _target(saved, map_location)
  if device.type == "cpu": return t
  from blutrain import cuda
  if not cuda.is_available():
    raise RuntimeError(f"load: a tensor saved on {saved} is mapped to {device}, but CUDA is not available; "
                       "pass map_location='cpu' to load it on the CPU")
  return t.to(device)


def _tensors(meta: dict[str, dict], blob: bytes, map_location: MapLocation) -> dict[str, Tensor]:
  raw = dict(deserialize(blob)) if blob else {}
  out = {}
  for key, m in meta.items():
    dtype, shape = dtypes.to_dtype(m["dtype"]), tuple(m["shape"])
    data = raw[key]["data"]
    if len(data) != int(np.prod(shape)) * dtype.np.itemsize or list(raw[key]["shape"]) != list(shape):
      raise ValueError(f"tensor {key} holds {len(data)} bytes of shape {raw[key]['shape']}, expected {dtype.name} "
                       f"{shape}")
    t = from_numpy(np.frombuffer(data, dtype=dtype.np).reshape(shape))
    t = map_location(t, m["device"]) if callable(map_location) else _placed(t, m["device"], map_location)
    out[key] = t.requires_grad_(True) if m["requires_grad"] else t
  return out
