"""Tensor parallelism on 2-4 CPU ranks (mpiexec started here) against one process on the whole model, in float64."""
from pathlib import Path

import pytest

from tests.distributed.test_mpi import mpirun

WORKER = Path(__file__).with_name("parallel_worker.py")


def test_vocab_parallel_cross_entropy_equals_the_whole_one_with_ignore_index():
  (out,) = mpirun(3, "cross_entropy", worker=WORKER)  # three ranks: the vocabulary's thirds
  assert out.pop("world") == 3 and out.pop("case") == "cross_entropy"
  assert all(v < 1e-12 for v in out.values()), out


@pytest.mark.parametrize("world,sequence_parallel", [(2, "0"), (2, "1"), (4, "1")])
def test_tensor_parallel_gpt_trains_as_the_whole_model(world, sequence_parallel):
  (out,) = mpirun(world, "tp_gpt", sequence_parallel, worker=WORKER)
  assert out["loss"] < 1e-12 and out["grad"] < 1e-12 and out["param"] < 1e-10, out
  # the sharded matrices: local parameters are 1/world of them plus the replicated LayerNorms and position embedding
  assert out["local_params"] < out["params"] / world + 1100, out


def test_data_parallel_over_tensor_parallel_pairs_trains_as_one_process():
  (out,) = mpirun(4, "dp_tp", worker=WORKER)
  assert out["loss"] < 1e-12 and out["grad"] < 1e-12 and out["param"] < 1e-10, out
