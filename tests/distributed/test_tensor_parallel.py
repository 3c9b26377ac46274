"""Tensor parallelism on 2-4 CPU ranks (mpiexec started here) against one process on the whole model, in float64."""
from pathlib import Path

import pytest

from tests.distributed.test_mpi import mpirun

WORKER = Path(__file__).with_name("parallel_worker.py")


def test_vocab_parallel_cross_entropy_equals_the_whole_one_with_ignore_index():
  (out,) = mpirun(3, "cross_entropy", worker=WORKER)  # three ranks: the vocabulary's thirds
  assert out.pop("world") == 3 and out.pop("case") == "cross_entropy"
  assert out.pop("bf16") < 1e-5 and out.pop("bf16_dtype") == 0.0  # bfloat16 logits: float32 losses
  assert all(v < 1e-12 for v in out.values()), out


@pytest.mark.parametrize("world,mode", [(2, "tp"), (2, "sp"), (4, "sp"), (2, "overlap"), (2, "sp-overlap")])
def test_tensor_parallel_gpt_trains_as_the_whole_model(world, mode):
  (out,) = mpirun(world, "tp_gpt", mode, worker=WORKER)
  assert out["loss"] < 1e-12 and out["grad"] < 1e-12 and out["norm"] < 1e-12 and out["param"] < 1e-10
  assert out["full"] < 1e-10, out
  # the sharded matrices: local parameters are 1/world of them plus the replicated LayerNorms and position embedding
  assert out["local_params"] < out["params"] / world + 1100, out


def test_overlapped_layers_with_chunks_of_unequal_sizes_equal_one_chunk():
  (out,) = mpirun(2, "uneven_chunks", worker=WORKER)
  assert out.pop("world") == 2 and out.pop("case") == "uneven_chunks"
  assert all(v < 1e-12 for v in out.values()), out


def test_data_parallel_over_tensor_parallel_pairs_trains_as_one_process():
  (out,) = mpirun(4, "dp_tp", worker=WORKER)  # the groups from init_device_mesh("cpu", (2, 2))
  assert out.pop("mesh") == 0.0
  assert out["loss"] < 1e-12 and out["grad"] < 1e-12 and out["norm"] < 1e-12 and out["param"] < 1e-10
  assert out["full"] < 1e-10, out


def test_overlapped_layers_launch_each_chunks_collective_next_to_another_chunks_gemm(tmp_path):
  """On the fake GPU at world size 1 (tests/distributed/test_nccl_host_path.py's fake NCCL): each chunk's all-reduce
  (reduce-scatter with SP) goes on the communication stream right after its GEMM, the compute stream waiting for them
  only after the last; with SP the column-parallel layer launches chunk i + 1's all-gather before chunk i's GEMM."""
  pytest.importorskip("cuda.core")
  from tests.distributed.test_nccl_host_path import _run
  _run('''
from blutrain.nn.parallel.tensor_parallel import RowParallelLinear
fake_cuda.FakeLt.matmul = lambda self, *a: log.append(("matmul",))
dist.init_process_group("nccl")
layer = RowParallelLinear(64, 32, overlap_chunks=4).to("cuda")
x = bt.randn(2, 8, 64, device="cuda", requires_grad=True)
log.clear()
y = layer(x)
seen = [e[0] if e[0] != "wait" else "wait_" + ("compute" if e[1] == compute else "comm") for e in log]
seen = [k for k in seen if k in ("matmul", "allreduce", "wait_compute")]
assert seen[:8] == ["matmul", "allreduce"] * 4 and set(seen[8:]) == {"wait_compute"}, seen
assert all(e[1] == comm for e in log if e[0] == "allreduce") and tuple(y.shape) == (2, 8, 32)
y.sum().backward()
assert tuple(x.grad.shape) == (2, 8, 64) and tuple(layer.weight.grad.shape) == (32, 64)
from blutrain.nn.parallel.tensor_parallel import ColumnParallelLinear
def order(layer, x):  # the GEMMs and collectives in launch order, and where the compute stream waits for the comm one
  log.clear()
  layer(x)
  seen = [e[0] if e[0] != "wait" else "wait_" + ("compute" if e[1] == compute else "comm") for e in log]
  return [k for k in seen if k in ("matmul", "allgather", "reduce_scatter", "wait_compute")]
x = bt.randn(3, 8, 64, device="cuda")  # with sequence parallelism: chunks of the batch
seen = order(ColumnParallelLinear(64, 32, sequence_parallel=True, overlap_chunks=3).to("cuda"), x)
assert seen[:2] == ["allgather"] * 2 and seen.index("matmul") < len(seen) - 1 - seen[::-1].index("allgather"), seen
assert seen.count("matmul") == 3 and seen.count("allgather") == 3, seen  # gather i + 1 is launched before GEMM i
seen = order(RowParallelLinear(64, 32, sequence_parallel=True, overlap_chunks=3).to("cuda"), x)
assert seen[:6] == ["matmul", "reduce_scatter"] * 3 and set(seen[6:]) == {"wait_compute"}, seen
''', tmp_path)


def test_bad_arguments_raise_before_any_collective():
  import blutrain as bt
  from blutrain.nn.parallel.tensor_parallel import RowParallelLinear, vocab_parallel_cross_entropy
  with pytest.raises(ValueError, match=r"target of shape \(3,\) does not match logits of shape \(4, 8\)"):
    vocab_parallel_cross_entropy(bt.randn(4, 8), bt.zeros(3, dtype=bt.int64))
  with pytest.raises(ValueError, match="unknown reduction 'avg'"):
    vocab_parallel_cross_entropy(bt.randn(4, 8), bt.zeros(4, dtype=bt.int64), reduction="avg")
  with pytest.raises(ValueError, match="RowParallelLinear: overlap_chunks must be a positive int, got 0"):
    RowParallelLinear(8, 4, overlap_chunks=0)
