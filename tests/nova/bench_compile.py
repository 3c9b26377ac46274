"""Compile-time benchmark of Nova's CPU pipeline on a synthetic GPT-like graph (run: python -m tests.nova.bench_compile
[n_equations]). Prints the import time, the structural hash the runtime keys its cache by, each phase of
`compile_graph` and one run of the compiled step."""
import sys
import time

t0 = time.perf_counter()
import numpy as np  # noqa: E402

from blutrain import dtypes  # noqa: E402
from blutrain.nova.hashing import graph_key  # noqa: E402
from blutrain.nova.pipeline import compile_graph  # noqa: E402
from tests.nova.graphs import gpt_like  # noqa: E402

t_import = time.perf_counter() - t0


def main(target: int = 8000) -> None:
  per_layer = len(gpt_like(2)[0].equations) - len(gpt_like(1)[0].equations)
  n_layer = max(1, target // per_layer)
  t = time.perf_counter()
  graph, _ = gpt_like(n_layer)
  t_graph = time.perf_counter() - t
  t = time.perf_counter()
  graph_key(graph)
  t_hash = time.perf_counter() - t
  t = time.perf_counter()
  compiled = compile_graph(graph)
  total = time.perf_counter() - t
  print(f"{len(graph.equations)} equations ({n_layer} blocks): {sum(compiled.counts_after.values())} ops after passes")
  print(f"import nova {t_import:.3f}s, build the graph {t_graph:.3f}s, hash {t_hash:.3f}s, compile_graph {total:.3f}s")
  print("  " + ", ".join(f"{k} {v:.3f}s" for k, v in compiled.timings.items()))
  rs = np.random.default_rng(0)
  arrays = [rs.integers(0, 32, v.shape) if v.dtype is dtypes.int64 else rs.standard_normal(v.shape).astype(np.float32)
            for v in graph.inputs]
  t = time.perf_counter()
  compiled.fn(*arrays)
  print(f"one run of the compiled step {time.perf_counter() - t:.3f}s")


if __name__ == "__main__":
  main(*(int(a) for a in sys.argv[1:]))
