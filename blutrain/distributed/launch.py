"""`blutrain launch` / `python -m blutrain.distributed.launch`: start the ranks of a data-parallel job on this node.

  python -m blutrain.distributed.launch --nproc-per-node 2 train.py --lr 3e-4
  blutrain launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node 8 train.py   (on each node)

Each rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
the job secret BLUTRAIN_JOB_SECRET, fresh for a one-node job (several nodes must share one: export it on each). SIGINT
and SIGTERM are forwarded to every rank. When a rank exits with an error, the launcher ends the others, says which
rank failed and how, and exits nonzero. `--backend mpi` starts the ranks with mpiexec instead (the MPI backend's ranks
must be MPI's), which ends the others itself when one fails. Several ranks on a node get OMP_NUM_THREADS=1 unless it
is set, as torchrun does: each rank's BLAS would otherwise start a thread per core and the ranks would fight for them.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from blutrain.distributed.store import SECRET_ENV, new_secret


def _free_port(addr: str) -> int:
  with socket.socket() as s:
    s.bind((addr, 0))
    return s.getsockname()[1]


def _describe(code: int) -> str:
  if code < 0:
    try: return f"was killed by {signal.Signals(-code).name}"
    except ValueError: return f"was killed by signal {-code}"
  return f"exited with code {code}"


def rank_envs(nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str, master_port: int,
              secret: str) -> list[dict[str, str]]:
  """The environment of each rank started on this node."""
  world = nproc_per_node * nnodes
  return [{"RANK": str(node_rank * nproc_per_node + i), "WORLD_SIZE": str(world), "LOCAL_RANK": str(i),
           "LOCAL_WORLD_SIZE": str(nproc_per_node), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
           SECRET_ENV: secret} for i in range(nproc_per_node)]


def _run_ranks(cmd: list[str], envs: list[dict[str, str]], grace: float) -> int:
  procs = [subprocess.Popen(cmd, env={**os.environ, **e}) for e in envs]
  ranks = [int(e["RANK"]) for e in envs]

  def forward(signum, _frame):
    for p in procs:
      if p.poll() is None: p.send_signal(signum)
  old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    while True:
      codes = [p.poll() for p in procs]
      failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
      if failed is not None: break
      if all(c == 0 for c in codes): return 0
      time.sleep(0.05)
    ended = [ranks[i] for i, p in enumerate(procs) if p.poll() is None]
    for p in procs:
      if p.poll() is None: p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
      try: p.wait(max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired: p.kill(); p.wait()
    code = codes[failed]
    print(f"blutrain launch: rank {ranks[failed]} (pid {procs[failed].pid}) {_describe(code)}; "
          f"ended the other ranks {ended or 'none (they had exited)'}", file=sys.stderr, flush=True)
    return code if code > 0 else 128 - code
  finally:
    for s, h in old.items(): signal.signal(s, h)


def parser(prog: str = "python -m blutrain.distributed.launch") -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=prog, description="Start the ranks of a distributed job on this node.")
  add_arguments(p)
  return p


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--nproc-per-node", type=int, default=1, help="ranks on this node (one per GPU)")
  p.add_argument("--nnodes", type=int, default=1)
  p.add_argument("--node-rank", type=int, default=0)
  p.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address; its store listens only there")
  p.add_argument("--master-port", type=int, default=None, help="default: a free port (one node) or 29500")
  p.add_argument("--backend", choices=["auto", "mpi"], default="auto",
                 help="mpi: start the ranks with mpiexec (CPU training); auto: plain processes (NCCL)")
  p.add_argument("--grace", type=float, default=5.0, help="seconds the other ranks get to exit after a failure")
  p.add_argument("script", help="the Python script each rank runs")
  p.add_argument("script_args", nargs=argparse.REMAINDER)


def threads_env(nproc_per_node: int) -> dict[str, str]:
  """OMP_NUM_THREADS=1 for several ranks on a node, unless the environment sets it."""
  if nproc_per_node == 1 or "OMP_NUM_THREADS" in os.environ: return {}
  print(f"blutrain launch: OMP_NUM_THREADS=1 for each of the {nproc_per_node} ranks (set it to choose another)",
        file=sys.stderr)
  return {"OMP_NUM_THREADS": "1"}


def launch(args: argparse.Namespace, cmd: list[str] | None = None) -> int:
  """Run the job that `args` describes; returns the exit code (the failed rank's, or 0)."""
  if args.nproc_per_node < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
    raise ValueError(f"launch: need --nproc-per-node >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes, got "
                     f"{args.nproc_per_node}, {args.nnodes}, {args.node_rank}")
  cmd = cmd or [sys.executable, "-u", args.script, *args.script_args]
  if args.backend == "mpi":
    if args.nnodes != 1: raise ValueError("launch --backend mpi: for several nodes run mpiexec/srun yourself")
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")  # the mpich wheel's, in this environment
    mpiexec = beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")
    if mpiexec is None: raise RuntimeError("launch --backend mpi: mpiexec not found; pip install mpi4py mpich")
    code = subprocess.call([mpiexec, "-n", str(args.nproc_per_node), *cmd],
                           env={**os.environ, **threads_env(args.nproc_per_node)})
    if code: print(f"blutrain launch: mpiexec {_describe(code)} (its report above names the failed rank)", file=sys.stderr)
    return code
  secret = os.environ.get(SECRET_ENV)
  if not secret:
    if args.nnodes > 1:
      raise RuntimeError(f"launch: a job of several nodes needs one secret on all of them: export {SECRET_ENV}=$(python "
                         "-c 'import secrets; print(secrets.token_hex(32))') on every node before launching")
    secret = new_secret()
  port = args.master_port or (_free_port(args.master_addr) if args.nnodes == 1 else 29500)
  threads = threads_env(args.nproc_per_node)
  envs = [{**e, **threads} for e in rank_envs(args.nproc_per_node, args.nnodes, args.node_rank, args.master_addr, port,
                                              secret)]
  return _run_ranks(cmd, envs, args.grace)


def main(argv: list[str] | None = None) -> int:
  try:
    return launch(parser().parse_args(argv))
  except (RuntimeError, ValueError) as e:
    print(f"blutrain launch: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
