"""The benchmarks' plots draw from their results files (a missing run or precision is left out, not an error)."""
import pytest

from benchmarks.plot_gpt2 import plot


def test_gpt2_chart_draws_every_run_of_a_results_file(tmp_path):
  pytest.importorskip("matplotlib")
  run = lambda tps, gib: {"tokens_per_s": tps, "peak_bytes": gib * 2**30}
  result = {"batch": 16, "block": 1024, "gpu": "a GPU", "date": "2026-12-03",
            "runs": {"blutrain_compile/bf16": run(519e3, 8.0), "torch_compile/bf16": run(479e3, 8.4),
                     "torch_eager/tf32": run(161e3, 22.8), "jax_xla/tf32": {"error": "not installed"}}}
  path = tmp_path / "chart.png"
  plot(result, path)
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
