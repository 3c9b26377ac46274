"""Text corpora: the bundled ones (package data) or any text file."""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path


def _assets():
  # importlib.resources finds package data both in a source checkout and in an installed wheel or zip
  return resources.files("blutrain.data") / "assets"


def bundled_corpora() -> list[str]:
  """Names of the corpora shipped in `blutrain/data/assets` (each `<name>.txt`)."""
  return sorted(p.name[:-4] for p in _assets().iterdir() if p.name.endswith(".txt"))


def load_text(name_or_path: str | os.PathLike = "tinyshakespeare") -> str:
  """The text of a bundled corpus (e.g. "tinyshakespeare", 1.1 MB) or of a UTF-8 text file.

  A bundled name wins over a file of the same name in the working directory.

  Example:
    >>> text = load_text()                  # tiny Shakespeare, bundled with blutrain
    >>> text = load_text("data/my_corpus.txt")
  """
  name = os.fspath(name_or_path)
  asset = _assets() / f"{name}.txt"
  if "/" not in name and os.sep not in name and asset.is_file(): return asset.read_text(encoding="utf-8")
  path = Path(name).expanduser()
  if not path.is_file():
    raise FileNotFoundError(f"load_text: no text file at {str(path.resolve())!r} and no bundled corpus named {name!r} "
                            f"(bundled: {', '.join(bundled_corpora())})")
  try:
    return path.read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"load_text: {str(path.resolve())!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                     f"{e.start}); pass a text file as the corpus") from None
