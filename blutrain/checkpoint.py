"""Checkpoints: tensors in safetensors files, everything else in JSON, written atomically.

A checkpoint is a directory `step_000500/` holding `model.safetensors`, `optimizer.safetensors` and
`state.json`. It is written into a temporary directory and renamed into place, and the `latest` pointer is
replaced atomically after it, so a crash leaves either the old checkpoint or the new one, never half of one.
`state.json` holds the SHA-256 of both tensor files, checked when the checkpoint is read: bytes changed on disk are
an error naming the file, never silently wrong weights.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

import blutrain as bt

LATEST = "latest"


# *** nested state <-> (JSON, tensors) ***

def _flatten(obj: Any, tensors: dict[str, np.ndarray], path: str) -> Any:
  """JSON-ready copy of obj; its tensors go into `tensors` under their path and leave a reference behind."""
  if isinstance(obj, bt.Tensor):
    tensors[path] = np.ascontiguousarray(obj.detach().cpu().numpy())
    return {"__tensor__": path}
  if isinstance(obj, dict):
    if all(isinstance(k, str) for k in obj): return {k: _flatten(v, tensors, f"{path}.{k}") for k, v in obj.items()}
    return {"__items__": [[k, _flatten(v, tensors, f"{path}.{k}")] for k, v in obj.items()]}
  if isinstance(obj, (list, tuple)):
    return {"__tuple__" if isinstance(obj, tuple) else "__list__": [_flatten(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
  if isinstance(obj, np.generic): return obj.item()
  return obj


def _unflatten(obj: Any, tensors: dict[str, np.ndarray]) -> Any:
  if isinstance(obj, dict):
    if "__tensor__" in obj: return bt.from_numpy(tensors[obj["__tensor__"]])
    if "__items__" in obj: return {k: _unflatten(v, tensors) for k, v in obj["__items__"]}
    if "__tuple__" in obj: return tuple(_unflatten(v, tensors) for v in obj["__tuple__"])
    if "__list__" in obj: return [_unflatten(v, tensors) for v in obj["__list__"]]
    return {k: _unflatten(v, tensors) for k, v in obj.items()}
  return obj


def _sha256(path: Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 24), b""): digest.update(block)
  return digest.hexdigest()


_TENSOR_FILES = ("model.safetensors", "optimizer.safetensors")


def _fsync_write(path: Path, text: str) -> None:
  with open(path, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())


# *** save / load ***

def save_checkpoint(directory: str | os.PathLike, step: int, model_state: dict[str, bt.Tensor],
                    optimizer_state: dict | None = None, state: dict | None = None, keep: int = 2) -> Path:
  """Write checkpoint `step` under `directory` atomically and point `latest` at it; keep the newest `keep`.

  Args:
    model_state: `model.state_dict()`.
    optimizer_state: `optimizer.state_dict()` (tensors and hyperparameters), or None.
    state: JSON-able trainer state (step, RNG states, config, tokenizer, scheduler).
  """
  root = Path(directory)
  root.mkdir(parents=True, exist_ok=True)
  final = root / f"step_{step:06d}"
  tmp = root / f".tmp-{final.name}-{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir()
  save_file({k: np.ascontiguousarray(v.detach().cpu().numpy()) for k, v in model_state.items()}, str(tmp / "model.safetensors"))
  opt_tensors: dict[str, np.ndarray] = {}
  opt_json = _flatten(optimizer_state, opt_tensors, "optimizer") if optimizer_state is not None else None
  save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
  checksums = {name: _sha256(tmp / name) for name in _TENSOR_FILES}
  _fsync_write(tmp / "state.json", json.dumps({"step": step, "state": state or {}, "optimizer": opt_json,
                                               "sha256": checksums}, indent=1))
  if final.exists():
    shutil.rmtree(final)
  os.replace(tmp, final)
  pointer = root / f".{LATEST}.tmp"
  _fsync_write(pointer, final.name)
  os.replace(pointer, root / LATEST)
  # retention: the newest `keep` by step, never the one just written (which `latest` names)
  older = [p for p in sorted(root.glob("step_*")) if p.is_dir() and p != final]
  for old in older[:len(older) - (keep - 1)] if keep > 0 else []:
    shutil.rmtree(old, ignore_errors=True)
  return final


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
  """Delete the temporary directories that interrupted saves left under `directory` (a run's `checkpoints/`);
  returns what was removed. Call it before a run starts writing there."""
  removed = [p for p in Path(directory).glob(".tmp-step_*") if p.is_dir()]
  for p in removed: shutil.rmtree(p, ignore_errors=True)
  return removed


def find_checkpoint(path: str | os.PathLike) -> Path:
  """The checkpoint directory for `path`: a checkpoint itself, or a directory whose `latest` (or a
  `checkpoints/latest` below it) names one."""
  p = Path(path)
  for root in (p, p / "checkpoints"):
    if (root / "state.json").is_file(): return root
    if (root / LATEST).is_file():
      target = root / (root / LATEST).read_text().strip()
      if (target / "state.json").is_file(): return target
      raise FileNotFoundError(f"checkpoint pointer {root / LATEST} names {target}, which is missing or incomplete")
  raise FileNotFoundError(f"no checkpoint found at {p} (looked for state.json and a 'latest' pointer, also under "
                          f"{p / 'checkpoints'}); train first, or pass the directory that `blutrain train` wrote")


def load_checkpoint(path: str | os.PathLike) -> tuple[dict[str, bt.Tensor], dict | None, dict, int]:
  """Read a checkpoint: (model_state, optimizer_state or None, trainer state, step)."""
  ckpt = find_checkpoint(path)
  try:
    meta = json.loads((ckpt / "state.json").read_text())
    for name, want in meta.get("sha256", {}).items():
      if _sha256(ckpt / name) != want:
        raise RuntimeError(f"checkpoint {ckpt}: {name} does not match the checksum written with it (its bytes changed "
                           f"on disk); resume from an earlier checkpoint with `blutrain train --resume PATH`")
    model_state = {k: bt.from_numpy(v) for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    opt_tensors = load_file(str(ckpt / "optimizer.safetensors"))
  except (OSError, ValueError, KeyError, SafetensorError) as e:
    raise RuntimeError(f"checkpoint {ckpt} is corrupt or incomplete ({type(e).__name__}: {e}); "
                       f"delete it or resume from an earlier one") from e
  optimizer_state = _unflatten(meta["optimizer"], opt_tensors) if meta.get("optimizer") is not None else None
  return model_state, optimizer_state, meta.get("state", {}), int(meta["step"])


# *** sharded checkpoints (data-parallel ranks, ZeRO) ***

def save_sharded_checkpoint(directory: str | os.PathLike, step: int, pieces: dict[str, tuple[int, int, bt.Tensor]],
                            rank: int, world_size: int, state: dict | None = None, barrier=None) -> Path:
  """Each rank writes its pieces of flat tensors to `step_NNNNNN/shard_RRRRR.safetensors` (a temporary file renamed
  into place); after `barrier()` rank 0 writes `index.json` (which shard holds which [start, end) of which tensor, and
  `state`) the same way and points `latest` at the step. A checkpoint is complete once its index exists.

  Args:
    pieces: {name: (full_numel, start, 1-D slice)}: ZeroRedundancyOptimizer.shard_state()'s form; a replicated tensor
      is one piece (numel, 0, t.reshape(-1)) written by one rank. Several pieces of one tensor on one rank are told
      apart by a suffix, "name#k"; loading assembles them under "name".
    barrier: a callable every rank calls (blutrain.distributed.barrier); None for one process.
  """
  root = Path(directory)
  final = root / f"step_{step:06d}"
  final.mkdir(parents=True, exist_ok=True)
  name = f"shard_{rank:05d}.safetensors"
  tmp = final / f".tmp-{name}-{os.getpid()}"
  save_file({k: np.ascontiguousarray(t.detach().cpu().numpy().reshape(-1)) for k, (_, _, t) in pieces.items()}, str(tmp))
  os.replace(tmp, final / name)
  entries = {k: [n, start, start + t.numel()] for k, (n, start, t) in pieces.items()}
  _fsync_write(final / f".meta_{rank:05d}.json", json.dumps(entries))
  if barrier: barrier()
  if rank == 0:
    index = {"step": step, "world_size": world_size, "state": state or {}, "shards": {}}
    for r in range(world_size):
      index["shards"][f"shard_{r:05d}.safetensors"] = json.loads((final / f".meta_{r:05d}.json").read_text())
    _fsync_write(final / ".index.json.tmp", json.dumps(index, indent=1))
    os.replace(final / ".index.json.tmp", final / "index.json")
    _fsync_write(root / f".{LATEST}.tmp", final.name)
    os.replace(root / f".{LATEST}.tmp", root / LATEST)
  if barrier: barrier()
  return final


def load_sharded_checkpoint(path: str | os.PathLike) -> tuple[dict[str, bt.Tensor], dict, int]:
  """Read a sharded checkpoint written at any world size: (the full flat tensors, assembled from every shard's
  pieces; the state; the step). Each rank then takes the slices it owns at its own world size."""
  p = Path(path)
  if (p / LATEST).is_file(): p = p / (p / LATEST).read_text().strip()
  if not (p / "index.json").is_file():
    raise FileNotFoundError(f"no complete sharded checkpoint at {p} (index.json is missing: a save was interrupted)")
  index = json.loads((p / "index.json").read_text())
  full: dict[str, np.ndarray] = {}
  for shard, entries in index["shards"].items():
    data = load_file(str(p / shard))
    for k, (n, start, end) in entries.items():
      name = k.split("#")[0]
      if name not in full: full[name] = np.zeros(n, dtype=data[k].dtype)
      full[name][start:end] = data[k]
  return {k: bt.from_numpy(v) for k, v in full.items()}, index["state"], int(index["step"])
