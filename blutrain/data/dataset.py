"""Token files and batches: encode a text once into `.bin` files, memory-map them, draw (x, y) batches.

Layout of a prepared directory (as nanoGPT's `prepare.py`): `train.bin` (the first 90 % of the tokens),
`val.bin` (the last 10 %), both flat arrays of uint16 (uint32 if the vocabulary needs it), and `meta.json`
with the dtype, the counts and the tokenizer's dict.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from blutrain.data.tokenizer import Tokenizer
from blutrain.ops import Generator, from_numpy, randint
from blutrain.tensor import Tensor

META = "meta.json"


def token_dtype(vocab_size: int) -> np.dtype:
  """The smallest unsigned dtype holding ids `< vocab_size`: uint16 up to 65536 tokens, else uint32."""
  return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def prepare(text: str, tokenizer: Tokenizer, out_dir: str | os.PathLike,
            val_fraction: float = 0.1) -> tuple[Path, Path]:
  """Encode `text` once and write `train.bin`, `val.bin` and `meta.json` into `out_dir`; return the two paths.

  Files already there are reused when their key (hash of the text, the tokenizer's dict and val_fraction)
  matches, so a second run with the same corpus and tokenizer skips encoding.
  """
  if not 0 < val_fraction < 1: raise ValueError(f"prepare: val_fraction must be in (0, 1), got {val_fraction}")
  out = Path(out_dir)
  train_path, val_path, meta_path = out / "train.bin", out / "val.bin", out / META
  h = hashlib.sha256(text.encode("utf-8"))
  h.update(json.dumps([tokenizer.to_dict(), val_fraction], sort_keys=True).encode("utf-8"))
  key = h.hexdigest()
  if meta_path.is_file() and _matches(json.loads(meta_path.read_text(encoding="utf-8")), key, train_path, val_path):
    return train_path, val_path
  dtype = token_dtype(tokenizer.vocab_size)
  ids = np.asarray(tokenizer.encode(text), dtype=dtype)
  n_train = int(len(ids) * (1 - val_fraction))
  if n_train == 0 or n_train == len(ids):
    raise ValueError(f"prepare: {len(ids)} tokens cannot be split with val_fraction={val_fraction}; give more text")
  out.mkdir(parents=True, exist_ok=True)
  # write to temporary names and rename, meta last: an interrupted run never leaves a matching but partial cache
  for path, part in ((train_path, ids[:n_train]), (val_path, ids[n_train:])):
    part.tofile(f"{path}.tmp")
    os.replace(f"{path}.tmp", path)
  meta = {"key": key, "dtype": dtype.name, "vocab_size": tokenizer.vocab_size, "tokenizer": tokenizer.to_dict(),
          "val_fraction": val_fraction, "train_tokens": n_train, "val_tokens": len(ids) - n_train}
  Path(f"{meta_path}.tmp").write_text(json.dumps(meta), encoding="utf-8")
  os.replace(f"{meta_path}.tmp", meta_path)
  return train_path, val_path


def _matches(meta: dict[str, Any], key: str, train_path: Path, val_path: Path) -> bool:
  if meta.get("key") != key: return False
  size = np.dtype(meta["dtype"]).itemsize
  return all(p.is_file() and p.stat().st_size == meta[n] * size
             for p, n in ((train_path, "train_tokens"), (val_path, "val_tokens")))


def load_tokens(path: str | os.PathLike, dtype: str | np.dtype | None = None) -> np.memmap:
  """The tokens of a `.bin` file, memory-mapped read-only; the dtype by default from the `meta.json` beside it."""
  path = Path(path)
  if not path.is_file(): raise FileNotFoundError(f"load_tokens: no token file at {str(path)!r}; run prepare() first")
  if dtype is None:
    meta_path = path.parent / META
    if not meta_path.is_file():
      raise FileNotFoundError(f"load_tokens: no {META} beside {str(path)!r} to read the dtype from; pass dtype=")
    dtype = json.loads(meta_path.read_text(encoding="utf-8"))["dtype"]
  return np.memmap(path, dtype=np.dtype(dtype), mode="r")


class TokenDataset:
  """A memory-mapped token file: `len(ds)` windows of `block_size + 1` tokens; `ds[i]` is the pair (x, y).

  Args:
    path: a `.bin` file written by `prepare`.
    block_size: the context length T.
    dtype: the file's dtype; by default read from the `meta.json` beside it.

  Attributes:
    data (np.memmap): the tokens, read-only; pass `ds` or `ds.data` to `get_batch`.
  """

  def __init__(self, path: str | os.PathLike, block_size: int, dtype: str | np.dtype | None = None):
    self.path, self.block_size, self.data = Path(path), block_size, load_tokens(path, dtype)
    _check_len(self.data, block_size, "TokenDataset")

  def __len__(self) -> int: return len(self.data) - self.block_size

  def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
    if not -len(self) <= i < len(self):
      raise IndexError(f"TokenDataset: index {i} out of range for {len(self)} windows")
    x, y = _gather(self.data, np.array([i % len(self)]), self.block_size, None)
    return x[0], y[0]


def _check_len(data: np.ndarray, block_size: int, where: str) -> None:
  if block_size < 1 or len(data) <= block_size:
    raise ValueError(f"{where}: {len(data)} tokens hold no window of block_size + 1 = {block_size + 1}; "
                     f"use a smaller block_size or more text")


def _tokens(data: np.ndarray | TokenDataset) -> np.ndarray:
  return data.data if isinstance(data, TokenDataset) else data


def _gather(data: np.ndarray, starts: np.ndarray, block_size: int, device) -> tuple[Tensor, Tensor]:
  # one fancy-indexed read of (B, T+1) tokens from the memmap; x and y are its two overlapping slices
  buf = data[starts[:, None] + np.arange(block_size + 1)].astype(np.int64)
  x, y = from_numpy(np.ascontiguousarray(buf[:, :-1])), from_numpy(np.ascontiguousarray(buf[:, 1:]))
  return (x, y) if device is None else (x.to(device), y.to(device))


def get_batch(split_data: np.ndarray | TokenDataset, batch_size: int, block_size: int,
              generator: Generator | np.random.Generator | None = None, device=None) -> tuple[Tensor, Tensor]:
  """A random batch of windows: `x = data[i : i+T]`, `y = data[i+1 : i+T+1]` for B offsets i.

  Offsets are uniform on `[0, len(data) - T)`, drawn from `generator`: a `bt.Generator` (None means
  `bt.default_generator`, seeded by `bt.manual_seed`), whose state (seed, offset) a checkpoint can save and
  whose draws are the same on every backend; or a `numpy.random.Generator`. Both give the same batches for
  the same seed and the same sequence of calls.

  Shape:
    x, y: (B, T), int64, on `device` (CPU when None).

  Example:
    >>> g = bt.Generator().manual_seed(1337)
    >>> x, y = get_batch(TokenDataset("data/train.bin", 256), 64, 256, g, "cuda")
  """
  data = _tokens(split_data)
  _check_len(data, block_size, "get_batch")
  high = len(data) - block_size
  if isinstance(generator, np.random.Generator): starts = generator.integers(0, high, size=batch_size, dtype=np.int64)
  else: starts = randint(0, high, (batch_size,), generator=generator).numpy()
  return _gather(data, starts, block_size, device)


def iterate_eval_batches(data: np.ndarray | TokenDataset, batch_size: int, block_size: int, max_batches: int,
                         device=None) -> Iterator[tuple[Tensor, Tensor]]:
  """Up to `max_batches` batches at fixed offsets, spread evenly over the split, for validation loss.

  The offsets depend only on the split's length, batch_size, block_size and max_batches, so the loss is
  comparable across runs and steps. A split too short for `batch_size * max_batches` distinct windows gives
  every window once (the last batch may be smaller).
  """
  data = _tokens(data)
  _check_len(data, block_size, "iterate_eval_batches")
  starts = np.unique(np.linspace(0, len(data) - block_size - 1, batch_size * max_batches).round().astype(np.int64))
  for b in range(0, len(starts), batch_size):
    yield _gather(data, starts[b:b + batch_size], block_size, device)
