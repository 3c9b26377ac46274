"""The parts of blutrain.distributed that need no MPI job: environments, the store, the launcher, the sampler, hooks."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import blutrain as bt
from blutrain.data import DistributedSampler
from blutrain.distributed import TCPStore, rank_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("environ, want", [
  ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"},
   (3, 8, 1, "10.1.2.3", 29500, "torchrun")),
  ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
   (2, 4, 0, None, None, "openmpi")),
  ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, (1, 2, 1, None, None, "mpich")),
  ({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "5", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.9"},
   (5, 16, 5, "10.0.0.9", None, "slurm")),
  ({"SLURM_PROCID": "0", "SLURM_NTASKS": "16"}, (0, 1, 0, None, None, "single")),  # a batch script, not an srun step
  ({}, (0, 1, 0, None, None, "single")),
])
def test_rank_env_reads_each_launchers_convention(environ, want):
  e = rank_env(environ)
  assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port, e.launcher) == want


def test_rank_env_rejects_a_rank_outside_the_world():
  with pytest.raises(RuntimeError, match="rank 4 is outside the world of 4"): rank_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_store_admits_the_secret_and_refuses_anyone_else():
  server = TCPStore("127.0.0.1", 0, is_master=True, secret="right", timeout=5)
  try:
    client = TCPStore("127.0.0.1", server.port, secret="right", timeout=5)
    client.set("uid", b"\x00\x01id")
    assert server.get("uid") == b"\x00\x01id" and server.add("n", 2) == 2 and client.add("n", 3) == 5
    assert client.check("absent") is None
    with pytest.raises(RuntimeError, match="was not set within"): client.get("absent", timeout=0.2)
    with pytest.raises(PermissionError, match="refused"): TCPStore("127.0.0.1", server.port, secret="wrong", timeout=5)
    with socket.create_connection(("127.0.0.1", server.port)) as raw:  # a stranger answering the challenge badly
      raw.recv(32)
      raw.sendall(b"x" * 32)
      assert raw.recv(1) == b"\x02" and raw.recv(1) == b""  # denied, then closed before any command
    client.close()
  finally:
    server.close()


def test_store_listens_only_on_its_address():
  server = TCPStore("127.0.0.1", 0, is_master=True, secret="s", timeout=5)
  try:
    assert server._server.sock.getsockname()[0] == "127.0.0.1"
  finally:
    server.close()


def test_store_needs_a_secret(monkeypatch):
  monkeypatch.delenv("BLUTRAIN_JOB_SECRET", raising=False)
  with pytest.raises(RuntimeError, match="BLUTRAIN_JOB_SECRET"): TCPStore("127.0.0.1", 0, is_master=True)


def test_launcher_ends_every_rank_when_one_fails_and_reports_it(tmp_path):
  script = tmp_path / "job.py"
  script.write_text("import os, sys, time\n"
                    f"open(os.path.join({str(tmp_path)!r}, 'pid' + os.environ['RANK']), 'w').write(str(os.getpid()))\n"
                    "assert len(os.environ['BLUTRAIN_JOB_SECRET']) == 64\n"
                    "if os.environ['RANK'] == '1': time.sleep(0.5); sys.exit(3)\n"
                    "time.sleep(60)\n")
  start = time.monotonic()
  proc = subprocess.run([sys.executable, "-m", "blutrain.distributed.launch", "--nproc-per-node", "3", str(script)],
                        cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 3 and time.monotonic() - start < 30
  assert "rank 1" in proc.stderr and "exited with code 3" in proc.stderr and "[0, 2]" in proc.stderr, proc.stderr
  for r in (0, 2):
    with pytest.raises(ProcessLookupError): os.kill(int((tmp_path / f"pid{r}").read_text()), 0)


def test_launcher_succeeds_when_every_rank_does(tmp_path):
  script = tmp_path / "ok.py"
  script.write_text("import os, sys\n"  # one write per line: the ranks share the launcher's stdout
                    "sys.stdout.write(f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} {os.environ['LOCAL_RANK']} \"\n"
                    "                 f\"{os.environ.get('OMP_NUM_THREADS')}\\n\")\n")
  env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
  proc = subprocess.run([sys.executable, "-m", "blutrain.cli", "launch", "--nproc-per-node", "2", str(script)],
                        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
  assert proc.returncode == 0, proc.stderr
  assert sorted(proc.stdout.split("\n")[:2]) == ["rank 0 of 2 0 1", "rank 1 of 2 1 1"]  # one BLAS thread a rank
  proc = subprocess.run([sys.executable, "-m", "blutrain.cli", "launch", "--nproc-per-node", "2", str(script)],
                        cwd=ROOT, capture_output=True, text=True, timeout=60, env={**env, "OMP_NUM_THREADS": "3"})
  assert sorted(proc.stdout.split("\n")[:2]) == ["rank 0 of 2 0 3", "rank 1 of 2 1 3"]  # the user's choice stands


def test_distributed_sampler_shards_cover_the_dataset_once_per_epoch():
  shards = [list(DistributedSampler(10, num_replicas=3, rank=r, seed=7)) for r in range(3)]
  assert [len(s) for s in shards] == [4, 4, 4]
  assert set(i for s in shards for i in s) == set(range(10))  # 12 slots: two indices repeat to pad
  again = DistributedSampler(10, num_replicas=3, rank=0, seed=7)
  assert list(again) == shards[0]
  again.set_epoch(1)
  assert list(again) != shards[0]
  exact = [list(DistributedSampler(10, num_replicas=3, rank=r, drop_last=True, shuffle=False)) for r in range(3)]
  assert exact == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
  with pytest.raises(ValueError, match="invalid rank 3"): DistributedSampler(10, num_replicas=3, rank=3)


def test_post_accumulate_grad_hook_fires_once_per_leaf_with_its_gradient_during_backward():
  bt.manual_seed(0)
  net = bt.nn.Sequential(bt.nn.Linear(4, 5), bt.nn.GELU(), bt.nn.Linear(5, 2))
  seen = []
  for name, p in net.named_parameters():
    p.register_post_accumulate_grad_hook(lambda t, name=name: seen.append((name, t.grad.numpy().copy())))
  x = bt.from_numpy(np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32))
  net(x).square().sum().backward()
  names = [n for n, _ in seen]
  assert sorted(names) == sorted(n for n, _ in net.named_parameters())
  assert names.index("2.weight") < names.index("0.weight")  # the last layer's gradient is complete first
  for name, g in seen: np.testing.assert_array_equal(g, net.get_parameter(name).grad.numpy())
  with pytest.raises(RuntimeError, match="leaf"): (net[0].weight * 2).register_post_accumulate_grad_hook(print)


def test_bucket_formula_puts_the_latency_at_its_share_of_a_buckets_all_reduce():
  from blutrain.configurator import IB_NDR, NVLINK_H200, Link, collective_time, ddp_bucket_bytes
  for link in (NVLINK_H200, IB_NDR, Link("test", alpha=5e-6, busbw=100e9)):
    for world in (2, 8, 64):
      b = ddp_bucket_bytes(world, link, latency_share=0.1)
      share = link.alpha / collective_time("all_reduce", b, world, link)
      assert share <= 0.1 and b % (1 << 20) == 0
      smaller = b - (1 << 20)  # the smallest such size in MiB: one MiB less spends more than the share on latency
      if smaller > 0: assert link.alpha / collective_time("all_reduce", smaller, world, link) > 0.1
  assert collective_time("all_reduce", 1 << 30, 1, NVLINK_H200) == 0.0
  t = collective_time("reduce_scatter", 8 << 20, 4, NVLINK_H200)
  assert t == pytest.approx(NVLINK_H200.alpha + 0.75 * (8 << 20) / NVLINK_H200.busbw)


def test_buckets_flatten_and_carve_tensors_of_their_own_storage():
  from blutrain.distributed import buckets
  from blutrain.ops.optim import scale_
  rng = np.random.default_rng(0)
  a = rng.standard_normal((3, 4)).astype(np.float32)
  b = rng.standard_normal((5, 2)).astype(np.float32)
  ts = [bt.from_numpy(a), bt.from_numpy(b).t(), None]  # a transposed (non-contiguous) view is copied, None is zeros
  like = [ts[0], ts[1], bt.empty(2, 3)]
  with bt.no_grad():
    flat = buckets.flatten(ts, like, 31)  # 12 + 10 + 6 elements, padded with zeros to 31
    np.testing.assert_array_equal(flat.numpy(), np.concatenate([a.ravel(), b.T.ravel(), np.zeros(9, np.float32)]))
    v = buckets.flatten([ts[0]], ts[:1], 12)
    assert v._storage is not ts[0]._storage  # a copy: the bucket's memory is its own
    carved = buckets.unflatten(flat, like, [0, 12, 22])
    assert [tuple(t.shape) for t in carved] == [(3, 4), (2, 5), (2, 3)] and all(t.is_contiguous() for t in carved)
    np.testing.assert_array_equal(carved[1].numpy(), b.T)
    assert len({id(t._storage) for t in carved}) == 3  # each its own storage: no aliasing among them to check
    scale_(carved, bt.tensor(2.0))  # clipping's multi-tensor op writes each in place, into the bucket's memory
    np.testing.assert_array_equal(flat.numpy()[12:22], 2 * b.T.ravel())
