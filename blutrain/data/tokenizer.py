"""Tokenizers: characters, or byte-level BPE trained locally with the `tokenizers` library.

Both share one small interface (`encode`, `decode`, `vocab_size`, `name`, `save`, `load`, `to_dict`), and
`to_dict()` / `tokenizer_from_dict()` carry a tokenizer inside a checkpoint so sampling restores it exactly.
"""
from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer as _HFTokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"


class Tokenizer(ABC):
  """The interface every tokenizer has: text <-> token ids in `[0, vocab_size)`."""
  name: str

  @property
  @abstractmethod
  def vocab_size(self) -> int: ...
  @abstractmethod
  def encode(self, text: str) -> list[int]: ...
  @abstractmethod
  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids` (a list, numpy array or 1-D tensor of ints)."""
  @abstractmethod
  def to_dict(self) -> dict[str, Any]:
    """A JSON-able dict that `tokenizer_from_dict` turns back into an equal tokenizer."""

  def save(self, path: str | os.PathLike) -> None:
    """Write the tokenizer as JSON; `load(path)` reads it back."""
    Path(path).write_text(json.dumps(self.to_dict()), encoding="utf-8")

  @classmethod
  def load(cls, path: str | os.PathLike) -> Tokenizer:
    """Read a tokenizer written by `save` (or, for BPE, any `tokenizers` JSON file); `Tokenizer.load` reads any."""
    return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> Tokenizer:
    tok = tokenizer_from_dict(d)
    if not isinstance(tok, cls): raise TypeError(f"{cls.__name__}.from_dict: got a {type(tok).__name__}'s dict")
    return tok

  def __repr__(self) -> str: return f"{type(self).__name__}(vocab_size={self.vocab_size})"

  def _check_ids(self, ids) -> list[int]:
    ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
    bad = sorted({i for i in ids if not 0 <= i < self.vocab_size})
    if bad: raise ValueError(f"{type(self).__name__}.decode: ids {bad[:20]} out of range [0, {self.vocab_size})")
    return ids


class CharTokenizer(Tokenizer):
  """One token per character; the vocabulary is the sorted set of the characters of `text`.

  Example:
    >>> tok = CharTokenizer("hello world")
    >>> tok.vocab_size, tok.encode("hello")
    (8, [3, 2, 4, 4, 5])
  """
  name = "char"

  def __init__(self, text: str):
    self.chars = sorted(set(text))
    self.stoi = {c: i for i, c in enumerate(self.chars)}

  @property
  def vocab_size(self) -> int: return len(self.chars)

  def encode(self, text: str) -> list[int]:
    try: return [self.stoi[c] for c in text]
    except KeyError:
      unknown = sorted(set(text) - self.stoi.keys())
      raise ValueError(f"CharTokenizer.encode: characters not in the vocabulary of {self.vocab_size}: "
                       f"{', '.join(map(repr, unknown[:20]))}{' ...' if len(unknown) > 20 else ''}; "
                       f"build the tokenizer from a text that contains them") from None

  def decode(self, ids: Sequence[int]) -> str: return "".join([self.chars[i] for i in self._check_ids(ids)])

  def to_dict(self) -> dict[str, Any]: return {"kind": "char", "chars": "".join(self.chars)}


class BPETokenizer(Tokenizer):
  """Byte-level BPE (as GPT-2's): any text round-trips, since every byte is in the base alphabet.

  Wraps a `tokenizers.Tokenizer`; build one with `train_bpe`. Special tokens (`<|endoftext|>`) in the text
  encode to their single id and decode back to their text.
  """
  name = "bpe"

  def __init__(self, tokenizer: _HFTokenizer):
    self.tokenizer = tokenizer

  @property
  def vocab_size(self) -> int: return self.tokenizer.get_vocab_size()
  def encode(self, text: str) -> list[int]: return self.tokenizer.encode(text).ids
  def decode(self, ids: Sequence[int]) -> str:
    return self.tokenizer.decode(self._check_ids(ids), skip_special_tokens=False)
  def token_to_id(self, token: str) -> int | None:
    """The id of a token string such as `<|endoftext|>`, or None."""
    return self.tokenizer.token_to_id(token)
  def to_dict(self) -> dict[str, Any]: return {"kind": "bpe", "tokenizer_json": self.tokenizer.to_str()}

  def save(self, path: str | os.PathLike) -> None:
    """Write the `tokenizers` JSON file, readable by `tokenizers.Tokenizer.from_file` too."""
    self.tokenizer.save(os.fspath(path))


def train_bpe(text: str, vocab_size: int, special_tokens: Sequence[str] = (EOT,)) -> BPETokenizer:
  """Train a byte-level BPE tokenizer on `text`, locally (no downloads); deterministic for a text.

  Args:
    vocab_size: at least 256 + len(special_tokens) (the byte alphabet); fewer tokens result if the text is
      too small to find that many merges.
    special_tokens: tokens that are never split, with the first ids.
  """
  if vocab_size < 256 + len(special_tokens):
    raise ValueError(f"train_bpe: vocab_size {vocab_size} < 256 bytes + {len(special_tokens)} special tokens")
  tok = _HFTokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([text], trainer)
  return BPETokenizer(tok)


def get_tokenizer(kind: str, text: str, vocab_size: int = 4096) -> Tokenizer:
  """A tokenizer built from `text`: `"char"` (vocab_size ignored) or `"bpe"` (trained to vocab_size)."""
  if kind == "char": return CharTokenizer(text)
  if kind == "bpe": return train_bpe(text, vocab_size)
  raise ValueError(f"get_tokenizer: unknown kind {kind!r}; expected 'char' or 'bpe'")


def tokenizer_from_dict(d: dict[str, Any]) -> Tokenizer:
  """The tokenizer that `to_dict()` described (a plain `tokenizers` JSON dict is read as BPE)."""
  kind = d.get("kind", "bpe" if "model" in d else None)
  if kind == "char": return CharTokenizer(d["chars"])
  if kind == "bpe": return BPETokenizer(_HFTokenizer.from_str(d["tokenizer_json"] if "kind" in d else json.dumps(d)))
  raise ValueError(f"tokenizer_from_dict: unknown tokenizer kind {kind!r}; expected 'char' or 'bpe'")
