"""Containers: Sequential, ModuleList, ModuleDict. Their children are registered under "0", "1", ... or their keys,
which is what makes state_dict names like "transformer.h.0.attn.c_attn.weight"."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable, Iterator, Mapping

from blutrain.nn.module import Module, _indent


def _index(idx: int, n: int, kind: str) -> int:
  idx = int(idx)
  if not -n <= idx < n: raise IndexError(f"{kind}: index {idx} is out of range for length {n}")
  return idx % n


class Sequential(Module):
  """Runs its modules in order, each on the previous one's output.

  Example:
    >>> nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    >>> nn.Sequential(OrderedDict(fc=nn.Linear(4, 8), act=nn.GELU()))
  """

  def __init__(self, *args: Module) -> None:
    super().__init__()
    if len(args) == 1 and isinstance(args[0], OrderedDict):
      for name, module in args[0].items(): self.add_module(name, module)
    else:
      for i, module in enumerate(args): self.add_module(str(i), module)

  def __getitem__(self, idx: int | slice) -> Module | Sequential:
    items = list(self._modules.items())
    if isinstance(idx, slice): return Sequential(OrderedDict(items[idx]))
    return items[_index(idx, len(items), "Sequential")][1]

  def __setitem__(self, idx: int, module: Module) -> None:
    key = list(self._modules)[_index(idx, len(self), "Sequential")]
    setattr(self, key, module)

  def __delitem__(self, idx: int | slice) -> None:
    keys = list(self._modules)
    for key in (keys[idx] if isinstance(idx, slice) else [keys[_index(idx, len(keys), "Sequential")]]):
      del self._modules[key]

  def __len__(self) -> int: return len(self._modules)
  def __iter__(self) -> Iterator[Module]: return iter(self._modules.values())

  def append(self, module: Module) -> Sequential:
    self.add_module(str(len(self)), module)
    return self

  def forward(self, input: Any) -> Any:
    for module in self: input = module(input)
    return input


class ModuleList(Module):
  """A list of modules, each registered (so its parameters are the model's); indexable like a list.

  Example:
    >>> self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
  """

  def __init__(self, modules: Iterable[Module] | None = None) -> None:
    super().__init__()
    if modules is not None: self.extend(modules)

  def __getitem__(self, idx: int | slice) -> Module | ModuleList:
    values = list(self._modules.values())
    if isinstance(idx, slice): return ModuleList(values[idx])
    return values[_index(idx, len(values), "ModuleList")]

  def __setitem__(self, idx: int, module: Module) -> None:
    setattr(self, str(_index(idx, len(self), "ModuleList")), module)

  def __delitem__(self, idx: int | slice) -> None:
    values = list(self._modules.values())
    del values[idx if isinstance(idx, slice) else _index(idx, len(values), "ModuleList")]
    self._modules.clear()
    self.extend(values)  # renumber, keeping names "0".."n-1"

  def __len__(self) -> int: return len(self._modules)
  def __iter__(self) -> Iterator[Module]: return iter(self._modules.values())

  def __iadd__(self, modules: Iterable[Module]) -> ModuleList: return self.extend(modules)
  def __add__(self, other: Iterable[Module]) -> ModuleList: return ModuleList(list(self) + list(other))

  def append(self, module: Module) -> ModuleList:
    self.add_module(str(len(self)), module)
    return self

  def extend(self, modules: Iterable[Module]) -> ModuleList:
    for module in modules: self.append(module)
    return self

  def insert(self, index: int, module: Module) -> None:
    values = list(self._modules.values())
    values.insert(index, module)
    self._modules.clear()
    self.extend(values)

  def __repr__(self) -> str:
    """Runs of identical children print once, as "(0-11): 12 x Block(...)", like PyTorch's."""
    runs: list[list] = []  # [first index, last index, repr]
    for i, module in enumerate(self):
      r = repr(module)
      if runs and runs[-1][2] == r: runs[-1][1] = i
      else: runs.append([i, i, r])
    if not runs: return self._get_name() + "()"
    lines = [_indent(f"({a}): {r}" if a == b else f"({a}-{b}): {b - a + 1} x {r}") for a, b, r in runs]
    return self._get_name() + "(\n  " + "\n  ".join(lines) + "\n)"


class ModuleDict(Module):
  """A dict of modules, each registered under its key, in insertion order.

  Example:
    >>> self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(V, C), h=nn.ModuleList(blocks), ln_f=nn.LayerNorm(C)))
  """

  def __init__(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]] | None = None) -> None:
    super().__init__()
    if modules is not None: self.update(modules)

  def __getitem__(self, key: str) -> Module: return self._modules[key]
  def __setitem__(self, key: str, module: Module) -> None: self.add_module(key, module)
  def __delitem__(self, key: str) -> None: del self._modules[key]
  def __len__(self) -> int: return len(self._modules)
  def __iter__(self) -> Iterator[str]: return iter(self._modules)
  def __contains__(self, key: str) -> bool: return key in self._modules

  def keys(self) -> Iterable[str]: return self._modules.keys()
  def items(self) -> Iterable[tuple[str, Module]]: return self._modules.items()
  def values(self) -> Iterable[Module]: return self._modules.values()

  def pop(self, key: str) -> Module:
    module = self[key]
    del self[key]
    return module

  def clear(self) -> None: self._modules.clear()

  def update(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]]) -> None:
    for key, module in (modules.items() if isinstance(modules, Mapping) else modules): self[key] = module
