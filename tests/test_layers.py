"""The layer order of docs/architecture.md, held against every import of the package.

Each module of blutrain belongs to one layer; a module may import its own layer and the layers below, never one above,
and no set of modules may import each other in a circle. Imports are read from the source (ast), wherever they stand
(inside functions too): `from a.b import c` imports the module `a.b.c` when there is one, else the package `a.b`.
The package's face, `blutrain/__init__.py` (the public API), stands above the library and below the app, which uses
it as users do; nothing else may import it.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "blutrain"

# bottom to top; a module's layer is the one whose prefix matches its dotted name most closely
LAYERS: list[tuple[str, tuple[str, ...]]] = [
  ("leaves", ("blutrain.dtypes", "blutrain.device", "blutrain.shapes", "blutrain.backends", "blutrain.configurator")),
  ("backend", ("blutrain.backend",)),
  ("tensor", ("blutrain.tensor",)),
  ("autograd", ("blutrain.autograd",)),
  ("ops", ("blutrain.ops",)),
  ("hooks", ("blutrain.amp", "blutrain.profiler", "blutrain.cuda")),
  ("distributed", ("blutrain.distributed",)),  # process groups: tensors, ops, the CUDA backend's streams and events
  ("nova", ("blutrain.nova",)),
  ("library", ("blutrain.nn", "blutrain.optim", "blutrain.models", "blutrain.utils", "blutrain.serialization")),
  ("face", ("blutrain",)),  # blutrain/__init__.py: the public API, which the app uses as users do
  ("app", ("blutrain.data", "blutrain.checkpoint", "blutrain.train", "blutrain.cli")),
]


def module_name(path: Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
  return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(name: str) -> int:
  matches = [(len(p), rank) for rank, (_, prefixes) in enumerate(LAYERS) for p in prefixes
             if name == p or name.startswith(p + ".") and p != "blutrain"]
  if matches: return max(matches)[1]
  raise AssertionError(f"{name} belongs to no layer of tests/test_layers.py: add it to LAYERS and docs/architecture.md")


def imports(name: str, path: Path, known: set[str]) -> set[str]:
  """The modules of the package that `name` imports."""
  tree, found = ast.parse(path.read_text()), set()
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  for node in ast.walk(tree):
    if isinstance(node, ast.Import): targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level: base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    else: continue
    found.update(t for t in targets if t in known and t != name)
  return found


def graph() -> dict[str, set[str]]:
  mods = modules()
  return {n: imports(n, p, set(mods)) for n, p in mods.items()}


def upward(g: dict[str, set[str]]) -> list[str]:
  """Every import of a higher layer, as `importer (layer) -> imported (layer)`."""
  out = []
  for a, targets in sorted(g.items()):
    for b in sorted(targets):
      if b in g and layer_of(b) > layer_of(a):
        out.append(f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})")
  return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan's algorithm)."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v: str) -> None:
    index[v] = low[v] = counter[0]; counter[0] += 1
    stack.append(v); on.add(v)
    for w in g.get(v, ()):
      if w not in g: continue
      if w not in index: visit(w); low[v] = min(low[v], low[w])
      elif w in on: low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop(); on.discard(w); comp.append(w)
        if w == v: break
      if len(comp) > 1: out.append(sorted(comp))

  for v in sorted(g):
    if v not in index: visit(v)
  return out


def test_every_module_has_a_layer():
  for name in modules(): layer_of(name)


def test_no_import_reaches_a_higher_layer():
  bad = upward(graph())
  assert not bad, "imports from a higher layer (docs/architecture.md):\n" + "\n".join(bad)


def test_no_import_cycles():
  bad = cycles(graph())
  assert not bad, "modules that import each other in a circle:\n" + "\n".join(" -> ".join(c) for c in bad)


def test_a_planted_back_edge_and_cycle_are_caught():
  g = graph()
  assert not upward(g) and not cycles(g)
  planted = {**g, "blutrain.backend.cpu.kernels": g["blutrain.backend.cpu.kernels"] | {"blutrain.ops.core"}}
  assert upward(planted) == ["blutrain.backend.cpu.kernels (backend) -> blutrain.ops.core (ops)"]
  looped = {**g, "blutrain.ops.creation": g["blutrain.ops.creation"] | {"blutrain.ops.nn"}}
  assert any({"blutrain.ops.creation", "blutrain.ops.nn"} <= set(c) for c in cycles(looped))


def test_imports_are_read_with_their_packages(tmp_path):
  src = "from blutrain.ops import creation\nimport blutrain.backend.cuda.runtime\ndef f():\n  from . import core\n"
  path = tmp_path / "mod.py"
  path.write_text(src)
  known = set(modules())
  assert imports("blutrain.ops.fake", path, known) == {"blutrain.ops.creation", "blutrain.ops.core",
                                                       "blutrain.backend.cuda.runtime"}


# blutrain/ops/__init__.py's order: each module imports only those before it
OP_CHAIN = ["core", "creation", "random", "elementwise", "reduce", "movement", "linalg", "nn", "ordering", "optim",
            "collective", "inplace", "methods"]


def test_op_modules_import_only_earlier_ones():
  g, rank = graph(), {f"blutrain.ops.{m}": i for i, m in enumerate(OP_CHAIN)}
  assert set(rank) == {n for n in g if n.startswith("blutrain.ops.")}, "a new op module needs its place in OP_CHAIN"
  bad = [f"{a} -> {b}" for a in rank for b in g[a] if b in rank and rank[b] >= rank[a]]
  assert not bad, "op modules importing a later one (ops/__init__.py's order):\n" + "\n".join(bad)


def test_pytorch_import_paths_of_library_modules_are_reexports():
  """torch.distributed.optim's path reaches ZeRO, which lives in the library (blutrain.optim.zero), through the face."""
  import blutrain.optim.zero as zero
  from blutrain.distributed.optim import ZeroRedundancyOptimizer
  import blutrain.distributed as dist
  assert ZeroRedundancyOptimizer is zero.ZeroRedundancyOptimizer and dist.optim.__all__ == ["ZeroRedundancyOptimizer"]
  assert not (PACKAGE / "distributed" / "optim.py").exists()
