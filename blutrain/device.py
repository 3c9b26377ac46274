"""Devices: `cpu` and `cuda:N`."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
  """Where a tensor's storage lives, as `torch.device`: `Device("cuda", 0)` prints as `cuda:0`."""
  type: str
  index: int | None = None

  def __post_init__(self) -> None:
    if self.type not in ("cpu", "cuda"):
      raise RuntimeError(f"unknown device type {self.type!r}; expected 'cpu' or 'cuda'")
    if self.index is not None and (not isinstance(self.index, int) or self.index < 0):
      raise RuntimeError(f"device index must be a non-negative int, got {self.index!r}")

  def __str__(self) -> str: return self.type if self.index is None else f"{self.type}:{self.index}"
  def __repr__(self) -> str: return f"device(type='{self.type}'" + ("" if self.index is None else f", index={self.index}") + ")"


cpu = Device("cpu")


_parsed: dict[str, Device] = {}  # one Device object per name, so that device checks mostly compare by identity


def to_device(d: str | Device | None) -> Device:
  """Parse 'cpu', 'cuda', 'cuda:1' or a Device; `cuda` means the current GPU, `cuda:0`."""
  if d is None: return cpu
  if isinstance(d, Device): return d
  if isinstance(d, str):
    if (dev := _parsed.get(d)) is not None: return dev
    kind, _, idx = d.partition(":")
    if kind == "cpu" and not idx: return cpu
    if kind == "cuda" and (not idx or idx.isdigit()):
      dev = _parsed[d] = _parsed.setdefault(f"cuda:{int(idx or 0)}", Device("cuda", int(idx or 0)))
      return dev
  raise RuntimeError(f"unknown device {d!r}; expected 'cpu', 'cuda' or 'cuda:N'")  # the type PyTorch raises
