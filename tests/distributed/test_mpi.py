"""Data-parallel training on 1-4 CPU ranks (mpiexec started here) against one process on the concatenated batch."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "BLUTRAIN_JOB_SECRET")


def mpirun(n: int, *args: str, timeout: float = 60, clean_exit: bool = True, worker: Path = WORKER) -> list[dict]:
  """Run `worker` (worker.py) under `mpiexec -n n`; the JSON lines it printed. `clean_exit=False`: the ranks leave
  without MPI_Finalize, which mpiexec may report as a failure."""
  env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  mpiexec = Path(sys.executable).with_name("mpiexec")
  proc = subprocess.run([str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", str(n), sys.executable, str(worker),
                         *args], env=env, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0 or not clean_exit, f"mpiexec -n {n} worker.py {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
  return [obj for line in proc.stdout.splitlines() if line.startswith("{") for obj in _objects(line)]


def _objects(line: str) -> list[dict]:
  """The JSON objects on a line: mpiexec may join two ranks' lines that arrive at once ('{...}{...}')."""
  decoder, found, i = json.JSONDecoder(), [], 0
  while i < len(line):
    obj, i = decoder.raw_decode(line, i)
    found.append(obj)
    while i < len(line) and line[i] != "{": i += 1
  return found


def test_every_collective_matches_numpy():
  (out,) = mpirun(3, "collectives")
  assert out.pop("all_reduce_bf16") < 2e-2  # the float32 sum rounded to bfloat16
  assert out.pop("world") == 3 and out.pop("case") == "collectives"
  assert all(v < 1e-5 for v in out.values()), out


def test_collective_ops_values_gradients_and_errors():
  (out,) = mpirun(3, "functional")
  assert out.pop("world") == 3 and out.pop("case") == "functional"
  messages = out.pop("messages")
  assert all(v < 1e-5 for v in out.values()), out
  assert messages == [
    "ShapeError: reduce_scatter: dim 0 of the input (7,) must split into 3 equal blocks, one per rank; pad it to a "
    "multiple of the group size",
    "TypeError: all_reduce: the avg reduction needs a floating-point tensor, got int64",
    "ValueError: all_reduce: unknown reduce op 'mean'; expected one of ('sum', 'avg', 'product', 'max', 'min')",
    "RuntimeError: all_reduce: no process group with id 12345 in this process; make the groups with "
    "blutrain.distributed (init_process_group, new_group) before running the op, and in the same order on every rank",
    "RuntimeError: all_reduce: process group 0 has 3 ranks, the op says 4",
    "RuntimeError: all_reduce with reduce_op 'max' has no derivative (only sum and avg do): reduce a detached tensor"]


def test_ddp_gradients_and_parameters_equal_one_process_on_the_whole_batch():
  (out,) = mpirun(2, "ddp")
  assert out["buckets"] > 1  # several buckets, each reduced as its gradients arrive
  assert out["grad"] < 1e-6 and out["param"] < 1e-6, out


def test_no_sync_accumulation_equals_one_large_batch():
  (out,) = mpirun(2, "no_sync")
  assert out["grad"] < 1e-6, out


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_steps_equal_plain_adamw(stage):
  (out,) = mpirun(2, "zero", str(stage))
  assert out["param"] < 1e-6 and out["param_one_bucket"] < 1e-6, out
  assert out["buckets"] > 2 and out["state_numel"] == 2 * out["shard_numel"]  # two moments of this rank's pieces only
  assert out["shard_numel"] <= out["param_numel"] / 2 + out["buckets"]       # half, plus at most one pad per bucket


def test_zero2_accumulates_over_backwards_and_clips_its_sharded_gradients():
  (out,) = mpirun(2, "zero_accumulate")
  assert out["norm"] < 1e-5 and out["param"] < 1e-6, out


def test_sharded_checkpoint_reloads_at_another_world_size(tmp_path):
  mpirun(2, "save", str(tmp_path))
  index = json.loads((tmp_path / "step_000003" / "index.json").read_text())
  assert index["world_size"] == 2 and sorted(index["shards"]) == ["shard_00000.safetensors", "shard_00001.safetensors"]
  assert not list((tmp_path / "step_000003").glob(".tmp-*"))
  for world in (1, 4):
    (out,) = mpirun(world, "load", str(tmp_path))
    assert out["param"] < 1e-6, (world, out)


def test_a_compiled_ddp_step_equals_the_eager_one_and_one_process(tmp_path):
  (out,) = mpirun(2, "compile", str(tmp_path))
  assert out["captures"] == 2 and out["buckets"] > 1 and out["all_reduces"] == out["buckets"], out  # first, steady
  assert out["first_all_reduce"] < out["last_matmul"], out  # the first bucket is reduced while the backward goes on
  assert out["loss"] < 1e-6 and out["eager"] < 1e-6 and out["param"] < 1e-5, out
  assert out["error"].startswith("all_reduce inside a function compiled with bt.compile"), out
  assert out["no_sync_captures"] == 3 and out["no_sync_grad"] < 1e-6, out  # no_sync() is part of the guard


@pytest.mark.parametrize("stage", [1, 2])
def test_compiled_zero_steps_equal_the_eager_ones_and_plain_adamw(stage):
  (out,) = mpirun(2, "zero_compile", str(stage))
  assert out["captures"] == 2 and out["all_gathers"] == 4 and out["all_reduces"] == 1, out  # stage 1: DDP's one bucket
  assert out["reduce_scatters"] == (4 if stage == 2 else 0), out                              # stage 2: the norm's
  assert out["eager"] < 1e-6 and out["param"] < 1e-5, out


def test_a_collective_whose_peer_never_arrives_raises_within_its_timeout():
  outs = mpirun(3, "timeout", timeout=30, clean_exit=False)
  assert sorted(o["rank"] for o in outs) == [0, 2]
  for o in outs:
    assert o["raised"] and o["seconds"] < 8, o  # 1 s timeout, up to 2 s asking the peers, slack for a busy machine
    assert "all_reduce" in o["message"] and "did not arrive: 1." in o["message"], o["message"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cli_trains_data_parallel_on_two_cpu_ranks(tmp_path, compiled):
  env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
  steps = 3 if compiled else 2  # compiled: the first step eager, the second captured, the third replayed
  proc = subprocess.run([sys.executable, "-m", "blutrain.cli", "train", "--preset", "char-tiny", "--steps", str(steps),
                         "--batch-size", "2", "--block-size", "16", "--eval-interval", str(steps),
                         "--eval-batches", "1", "--sample-tokens", "4", "--device", "cpu", "--out-dir", str(tmp_path / "run"),
                         "--nproc-per-node", "2", *(["--compile"] if compiled else [])], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=180)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.count(f"done: step {steps}") == 1  # rank 0 reports; rank 1 trains quietly
  assert (tmp_path / "run" / "checkpoints" / "latest").is_file() and (tmp_path / "run" / "sample.txt").is_file()


def _train_cli(out: Path, *flags: str) -> list[dict]:
  """`blutrain train` for 2 steps of a tiny GPT on the bundled corpus (a byte-level BPE of 258 tokens, which 2 ranks
  split); the metrics it logged."""
  env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
  proc = subprocess.run([sys.executable, "-m", "blutrain.cli", "train", "--preset", "char-tiny", "--tokenizer", "bpe",
                         "--bpe-vocab-size", "258", "--steps", "2", "--batch-size", "2", "--block-size", "16",
                         "--eval-interval", "2", "--eval-batches", "1", "--sample-tokens", "4", "--log-interval", "1",
                         "--device", "cpu", "--out-dir", str(out), *flags], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=180)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process_metrics(tmp_path_factory):
  return _train_cli(tmp_path_factory.mktemp("one") / "run")


@pytest.mark.parametrize("flags", [("--tp", "2"), ("--cp", "2")], ids=["tp", "cp"])
def test_cli_trains_tensor_and_context_parallel_as_one_process(flags, one_process_metrics, tmp_path):
  """--tp 2: Megatron layers and the vocabulary-parallel loss; --cp 2: ring attention over the load-balanced halves
  of each sequence. Both train the same model on the same batches as one process: the same losses (float32 sums in
  another order) and validation loss."""
  got = _train_cli(tmp_path / "run", *flags, "--nproc-per-node", "2")
  assert [sorted(r) for r in got] == [sorted(r) for r in one_process_metrics]
  for mine, ref in zip(got, one_process_metrics):
    for key in ("loss", "val_loss"):
      if key in ref: assert abs(mine[key] - ref[key]) < 1e-4 * abs(ref[key]), (flags, mine, ref)
  assert (tmp_path / "run" / "checkpoints" / "latest").is_file()


def test_cli_refuses_a_parallel_layout_the_job_cannot_hold(tmp_path, capsys):
  from blutrain import cli
  flags = ["train", "--preset", "char-tiny", "--device", "cpu", "--out-dir", str(tmp_path / "run"), "--tp", "2"]
  assert cli.main(flags) == 2
  assert "--tp 2 --cp 1: 2 ranks a model replica do not divide the 1 ranks of this job" in capsys.readouterr().err
  assert not (tmp_path / "run").exists()  # refused before any work
