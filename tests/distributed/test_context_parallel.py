"""Context parallelism (ring attention) on 2-3 CPU ranks against attention and a GPT on the whole sequence (float64)."""
from pathlib import Path

import pytest

from tests.distributed.test_mpi import mpirun

WORKER = Path(__file__).with_name("parallel_worker.py")


@pytest.mark.parametrize("world", [2, 3])
def test_ring_attention_and_its_gradients_equal_attention_on_the_whole_sequence(world):
  (out,) = mpirun(world, "ring_attention", worker=WORKER)
  assert out.pop("world") == world and out.pop("case") == "ring_attention"
  assert out.pop("round_trip") == 0.0 and out.pop("positions") == 0.0
  # bfloat16 inputs: the scores' rounding (their matmul's output, 2^-9 relative, of scores up to ~5) and the output's
  assert out.pop("bf16") < 3e-2 and out.pop("bf16_dtype") == 0.0
  assert all(v < 1e-12 for v in out.values()), out


def test_context_parallel_gpt_trains_as_the_whole_model():
  (out,) = mpirun(2, "cp_gpt", worker=WORKER)
  assert out["loss"] < 1e-12 and out["grad"] < 1e-12 and out["norm"] < 1e-12 and out["param"] < 1e-10
  assert out["full"] < 1e-10, out


def test_data_parallel_over_context_parallel_pairs_trains_as_one_process():
  (out,) = mpirun(4, "dp_cp", worker=WORKER)
  assert out["loss"] < 1e-12 and out["grad"] < 1e-12 and out["norm"] < 1e-12 and out["param"] < 1e-10
  assert out["full"] < 1e-10, out


def test_gradients_all_reduced_in_buckets_are_the_ranks_average():
  (out,) = mpirun(3, "gradient_buckets", worker=WORKER)
  assert out.pop("world") == 3 and out.pop("case") == "gradient_buckets"
  assert all(v < 1 for v in out.values()), out  # the errors in units of each dtype's tolerance


def test_load_balancing_permutation_and_bad_inputs():
  import blutrain as bt
  from blutrain.nn.parallel.context_parallel import load_balance_indices, ring_attention
  assert load_balance_indices(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]  # rank 0: chunks 0 and 3; rank 1: 1 and 2
  with pytest.raises(ValueError, match="2 x 3 equal chunks"): load_balance_indices(8, 3)
  q = bt.randn(1, 2, 6, 4)
  with pytest.raises(RuntimeError, match=r"ring_attention: expected q .* \(1, 2, 6, 3\)"):
    ring_attention(q, bt.randn(1, 2, 6, 3), bt.randn(1, 2, 6, 3))
  with pytest.raises(RuntimeError, match="two equal chunks"):
    ring_attention(bt.randn(1, 2, 5, 4), bt.randn(1, 2, 5, 4), bt.randn(1, 2, 5, 4))


def test_context_parallel_over_tensor_parallel_pairs_trains_as_the_whole_model():
  (out,) = mpirun(4, "tp_cp", worker=WORKER)
  assert out["loss"] < 1e-12 and out["grad"] < 1e-12 and out["norm"] < 1e-12 and out["param"] < 1e-10
  assert out["full"] < 1e-10, out
