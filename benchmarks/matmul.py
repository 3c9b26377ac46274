"""Matmuls on the GPU: blutrain's synthesized Triton GEMMs (kernels/gemm/, configurator-scheduled, no autotuning)
against cuBLASLt (blutrain's nvmath binding), PyTorch's matmul, XLA (jax.jit) and Triton's tutorial matmul autotuned over its own configs, on
GPT-2 124M's training GEMMs (16384 tokens, every linear in the forward, input-gradient and weight-gradient
orientations, operands in the layouts training produces: no copies) and squares 1024-8192, in TF32 and bf16.

Timing: device time per call. For the CUDA-stream peers a spin kernel first holds the stream, so the host queues
all repeats before the start event runs and launch overhead never shows; XLA is timed by wall clock over many
repeats ending in block_until_ready. Relative error against float64 (Frobenius, on 256 sampled rows x 256 sampled
columns of C); inputs are random normal (weights scaled by 0.05). The configurator's time and cold compile time
are reported per kernel. Writes benchmarks/results/matmul.json and matmul.png and prints a markdown table.

  python benchmarks/matmul.py [--precisions tf32,bf16] [--shapes gpt2,squares] [--peers cublas,torch,xla,triton]
                              [--explore] [--fused]

--fused (the GEMM choice's hit rate) times instead both paths of Nova's gemm op (cuBLASLt and the separate kernels,
one synthesized GEMM with the whole epilogue) on the fused GEMMs of GPT-2's training step, against the configurator's
predicted times (`configurator.gemm_choice`), and writes benchmarks/results/gemm_choice.json.

--explore (calibration, off by default) times a few alternative schedules of three problems beside the
configurator's choice: TF32 operand rounding off, one stage less or more, the other epilogue split, 128x128 tiles.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# cold caches, so that compile times are real; XLA must not take the whole GPU
os.environ["BLUTRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="bt-matmul-")
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-matmul-")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.utils.dlpack  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import blutrain as bt  # noqa: E402
from blutrain import dtypes  # noqa: E402
from blutrain.backend.cuda import launch, runtime  # noqa: E402
from blutrain.backend.cuda.array import CudaArray  # noqa: E402
from blutrain.backend.cuda.kernels.gemm.operand_copy import rowmajor_copy  # noqa: E402
from blutrain.backend.cuda.kernels.gemm.source import main_spec  # noqa: E402
from blutrain.backend.cuda.kernels.matrix import transposed  # noqa: E402
from blutrain.backend.cuda.memory import empty as bt_empty  # noqa: E402
from blutrain import configurator as cfg  # noqa: E402

G = importlib.import_module("blutrain.backend.cuda.kernels.gemm")
MM = importlib.import_module("blutrain.backend.cuda.kernels.cublaslt")

TOKENS = 16384
LINEARS = {"qkv": (2304, 768), "proj": (768, 768), "fc": (3072, 768), "fc2": (768, 3072), "lm_head": (50304, 768)}
TARGET_MS = 20.0   # device time per measurement
SPIN_MS = 10.0     # a spin longer than the host needs to queue every repeat (at most 50, tens of us each)


# *** problems ***

@dataclasses.dataclass
class Problem:
  """C (M x N) = A (M x K) @ B (K x N): A and B are views of row-major base tensors (`a_t`/`b_t`: the base is the
  transpose), as training stores them."""
  name: str
  M: int
  N: int
  K: int
  a_t: bool
  b_t: bool

  @property
  def flop(self) -> float: return 2.0 * self.M * self.N * self.K


def problems(kinds: list[str]) -> list[Problem]:
  out = []
  if "gpt2" in kinds:
    for name, (n, k) in LINEARS.items():
      out += [Problem(f"{name} fwd", TOKENS, n, k, False, True),     # y = x W^T, W stored (n, k)
              Problem(f"{name} dX", TOKENS, k, n, False, False),     # dx = dy W
              Problem(f"{name} dW", n, k, TOKENS, True, False)]      # dW = dy^T x, dy stored (T, n)
  if "squares" in kinds:
    out += [Problem(f"square {n}", n, n, n, False, False) for n in (1024, 2048, 4096, 8192)]
  return out


def operands(p: Problem, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
  """Row-major base tensors on the GPU and the (M, K), (K, N) views of them."""
  g = torch.Generator(device="cuda").manual_seed(seed)
  a = torch.randn((p.K, p.M) if p.a_t else (p.M, p.K), device="cuda", generator=g).to(dtype)
  b = torch.randn((p.N, p.K) if p.b_t else (p.K, p.N), device="cuda", generator=g).to(dtype) * 0.05
  return (a.T if p.a_t else a), (b.T if p.b_t else b)


def array(t: torch.Tensor) -> CudaArray:
  """A blutrain view of a torch tensor's memory (zero-copy; the tensor stays the owner)."""
  dt = {torch.float32: dtypes.float32, torch.bfloat16: dtypes.bfloat16}[t.dtype]
  return CudaArray(t.data_ptr(), tuple(t.shape), tuple(t.stride()), dt, t.device.index or 0, t)


def as_torch(x: CudaArray) -> torch.Tensor:
  """A torch view of a blutrain array (after blutrain's work is done)."""
  runtime.synchronize()
  return torch.utils.dlpack.from_dlpack(bt.backend.get(bt.device("cuda", x.device)).dlpack(x))


# *** timing ***

@triton.jit
def _spin(ns):
  start = tl.extra.cuda.globaltimer()
  while tl.extra.cuda.globaltimer() - start < ns:
    pass


_SPIN = None


def device_ms(fn, repeats: int, stream: str) -> float:
  """Device milliseconds per call of `fn` queued `repeats` times behind a spin kernel on blutrain's ("bt") or
  PyTorch's ("torch") current stream."""
  global _SPIN
  fn()
  if stream == "bt":
    if _SPIN is None: _SPIN = launch.compile(_spin, {"ns": "i64"}, num_warps=1)
    s, e = bt.cuda.Event(enable_timing=True), bt.cuda.Event(enable_timing=True)
    _SPIN((1,), int(SPIN_MS * 1e6))
  else:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(SPIN_MS * 2e6))  # cycles, at about 2 GHz
  s.record()
  for _ in range(repeats): fn()
  e.record()
  e.synchronize()
  return s.elapsed_time(e) / repeats


def wall_ms(fn, repeats: int) -> float:
  """Wall milliseconds per call over `repeats` asynchronous calls ending in one synchronization (XLA)."""
  fn().block_until_ready()
  t0 = time.perf_counter()
  for _ in range(repeats): out = fn()
  out.block_until_ready()
  return (time.perf_counter() - t0) * 1e3 / repeats


def repeats_for(p: Problem, tf32: bool) -> int:
  guess_ms = p.flop / (350e12 if tf32 else 650e12) * 1e3
  return int(min(50, max(5, TARGET_MS / guess_ms)))


# *** accuracy ***

def sample(p: Problem, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
  g = torch.Generator().manual_seed(seed)
  return (torch.randperm(p.M, generator=g)[:256].cuda(), torch.randperm(p.N, generator=g)[:256].cuda())


def rel_err(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows, cols) -> float:
  """||C - C64|| / ||C64|| on the sampled block, C64 = the float64 product of the same (rounded) inputs."""
  ref = a[rows].double() @ b[:, cols].double()
  got = c[rows][:, cols].double()
  return float(torch.linalg.norm(got - ref) / torch.linalg.norm(ref))


# *** the peers ***

def _tutorial_configs() -> list:
  """Triton's tutorial autotuning space for CUDA (03-matrix-multiplication)."""
  shapes = [(128, 256, 64, 3, 8), (64, 256, 32, 4, 4), (128, 128, 32, 4, 4), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4),
            (128, 32, 32, 4, 4), (64, 32, 32, 5, 2), (32, 64, 32, 5, 2)]
  return [triton.Config({"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "GROUP_SIZE_M": 8}, num_stages=s,
                        num_warps=w) for m, n, k, s, w in shapes]


@triton.autotune(configs=_tutorial_configs(), key=["M", "N", "K"],
                 do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles))
@triton.jit
def _tutorial_matmul(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                     BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
                     GROUP_SIZE_M: tl.constexpr):
  """The tutorial's kernel: grouped tile order, pointer loads with a K mask, float32 accumulation (TF32 dots for
  float32 inputs, Triton's default), the output in the inputs' type."""
  pid = tl.program_id(axis=0)
  num_pid_m = tl.cdiv(M, BLOCK_SIZE_M)
  num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
  num_pid_in_group = GROUP_SIZE_M * num_pid_n
  group_id = pid // num_pid_in_group
  first_pid_m = group_id * GROUP_SIZE_M
  group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
  pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
  pid_n = (pid % num_pid_in_group) // group_size_m
  offs_am = (pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)) % M
  offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)) % N
  offs_k = tl.arange(0, BLOCK_SIZE_K)
  a_ptrs = a_ptr + (offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak)
  b_ptrs = b_ptr + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)
  accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
  for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
    a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_SIZE_K, other=0.0)
    b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_SIZE_K, other=0.0)
    accumulator = tl.dot(a, b, accumulator)
    a_ptrs += BLOCK_SIZE_K * stride_ak
    b_ptrs += BLOCK_SIZE_K * stride_bk
  c = accumulator.to(c_ptr.dtype.element_ty)
  offs_cm = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
  offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
  c_ptrs = c_ptr + stride_cm * offs_cm[:, None] + stride_cn * offs_cn[None, :]
  tl.store(c_ptrs, c, mask=(offs_cm[:, None] < M) & (offs_cn[None, :] < N))


def tutorial(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
  (M, K), N = a.shape, b.shape[1]
  c = torch.empty((M, N), device=a.device, dtype=a.dtype)
  grid = lambda meta: (triton.cdiv(M, meta["BLOCK_SIZE_M"]) * triton.cdiv(N, meta["BLOCK_SIZE_N"]),)
  _tutorial_matmul[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
  return c


def xla_fn(p: Problem, tf32: bool):
  """A jitted matmul of the base tensors' layouts (transposes inside, where XLA plans its own layouts)."""
  import jax
  import jax.numpy as jnp
  prec = "tensorfloat32" if tf32 else None

  def f(a, b):
    with jax.default_matmul_precision(prec) if prec else contextlib.nullcontext():
      return jnp.matmul(a.T if p.a_t else a, b.T if p.b_t else b)
  return jax.jit(f)


# *** runs ***

def run_synthesized(p: Problem, a: torch.Tensor, b: torch.Tensor, prec: str, n: int) -> tuple[dict, torch.Tensor]:
  da, db = array(a), array(b)
  item = a.element_size()
  problem = cfg.GemmProblem(p.M, p.N, p.K, 1, item, item, prec, not p.a_t, p.b_t, True)
  t0 = time.perf_counter()
  for _ in range(100): cfg.gemm_schedule(problem)
  cfg_us = (time.perf_counter() - t0) * 1e4
  c = torch.empty((p.M, p.N), device="cuda", dtype=a.dtype)
  out = array(c)
  t0 = time.perf_counter()
  plan = G.plan(da, db, out, precision=prec)
  plan_ms = (time.perf_counter() - t0) * 1e3
  t0 = time.perf_counter()
  compiled = [k.compiled for k in plan.kernels]
  fn = lambda: G.gemm(da, db, out=out, precision=prec or None)
  fn()  # loads the kernels (and compiles the TF32 operand copy's)
  runtime.synchronize()
  compile_s = time.perf_counter() - t0
  ms = device_ms(fn, n, "bt")
  runtime.synchronize()
  s, st = plan.schedule, plan.structure
  info = {"ms": ms, "configurator_us": cfg_us, "plan_ms": plan_ms, "compile_s": compile_s,
          "schedule": f"{st.kind} {s.BM}x{s.BN}x{s.BK} w{s.num_warps} s{s.num_stages} g{s.group_m} split{s.split_k}"
                      f"{' copy ' + plan.copy if plan.copy else ''}{' swap' if s.swap else ''}"
                      f"{' sub' if s.epi_subtile else ''}{' ws' if s.warp_specialize else ''}", "shared_bytes": [k.shared for k in compiled],
          "utilization": s.utilization}
  return info, c


def run_cublas(p: Problem, a: torch.Tensor, b: torch.Tensor, tf32: bool, n: int) -> tuple[dict, torch.Tensor]:
  da, db = array(a), array(b)
  bt.backends.matmul = "cublas"
  bt.set_float32_matmul_precision("high" if tf32 else "highest")
  holder = {}
  def fn(): holder["c"] = MM.matmul(da, db, tf32=tf32)
  ms = device_ms(fn, n, "bt")
  return {"ms": ms}, as_torch(holder["c"])


def run_torch(p: Problem, a: torch.Tensor, b: torch.Tensor, tf32: bool, n: int) -> tuple[dict, torch.Tensor]:
  torch.backends.cuda.matmul.allow_tf32 = tf32
  c = torch.empty((p.M, p.N), device="cuda", dtype=a.dtype)
  ms = device_ms(lambda: torch.matmul(a, b, out=c), n, "torch")
  return {"ms": ms}, c


def run_triton(p: Problem, a: torch.Tensor, b: torch.Tensor, tf32: bool, n: int) -> tuple[dict, torch.Tensor]:
  t0 = time.perf_counter()
  c = tutorial(a, b)
  torch.cuda.synchronize()
  tune_s = time.perf_counter() - t0
  ms = device_ms(lambda: tutorial(a, b), n, "torch")
  return {"ms": ms, "autotune_s": tune_s, "config": str(_tutorial_matmul.best_config)}, c


def run_xla(p: Problem, a: torch.Tensor, b: torch.Tensor, tf32: bool, n: int) -> tuple[dict, torch.Tensor]:
  import jax
  base_a, base_b = (a.T if p.a_t else a).contiguous(), (b.T if p.b_t else b).contiguous()  # views of the bases
  ja, jb = jax.dlpack.from_dlpack(base_a), jax.dlpack.from_dlpack(base_b)
  f = xla_fn(p, tf32)
  t0 = time.perf_counter()
  f(ja, jb).block_until_ready()
  compile_s = time.perf_counter() - t0
  ms = wall_ms(lambda: f(ja, jb), 4 * n)
  return {"ms": ms, "compile_s": compile_s}, torch.from_dlpack(f(ja, jb))


PEERS = {"cublas": run_cublas, "torch": run_torch, "xla": run_xla, "triton": run_triton}


def explore(prec_name: str) -> list[dict]:
  """Alternative schedules of three problems, for calibrating the configurator (not used by it)."""
  rows = []
  for p in [Problem("qkv fwd", TOKENS, 2304, 768, False, True), Problem("square 4096", 4096, 4096, 4096, False, False),
            Problem("fc dW", 3072, 768, TOKENS, True, False)]:
    tf32 = prec_name == "tf32"
    a, b = operands(p, torch.float32 if tf32 else torch.bfloat16, 7)
    da, db = array(a), array(b)
    out = bt_empty((p.M, p.N), da.dtype, 0)
    prec = "tf32" if tf32 else ""
    plan = G.plan(da, db, out, precision=prec)
    s, st = plan.schedule, plan.structure
    spec, grid, args = plan.launches[0]  # the main kernel (K > 0)
    variants = {"configurator": (st, s), "stages-1": (st, dataclasses.replace(s, num_stages=s.num_stages - 1)),
                "stages+1": (st, dataclasses.replace(s, num_stages=s.num_stages + 1)),
                "epilogue split flipped": (st, dataclasses.replace(s, epi_subtile=not s.epi_subtile)),
                "128x128": (st, dataclasses.replace(s, BM=128, BN=128, num_warps=4, warp_specialize=False,
                                                      BK=128 // a.element_size()))}
    if tf32: variants["no TF32 rounding"] = (dataclasses.replace(st, round_a=False), s)
    ptrs = {"a": da.ptr, "b": db.ptr, "out": out.ptr, "bias": 0, "ws": 0}
    keep = []
    for op in plan.copy:
      keep.append(rowmajor_copy(da if op == "a" else transposed(db), tf32))
      ptrs[op] = keep[-1].ptr
    if plan.workspace:
      keep.append(bt_empty(plan.workspace, dtypes.float32, 0))
      ptrs["ws"] = keep[-1].ptr
    values = [ptrs[x[1]] + x[2][0] if x[0] == "p" else 1.0 if x[0] == "alpha" else x[1] for x in args]
    for name, (vst, vs) in variants.items():
      try:
        if vs.BM * vs.BN != s.BM * s.BN and (st.kind != "tma" or s.split_k > 1): continue  # grid would change
        k = main_spec(vst, vs, spec[1]["A"].endswith(":16")).kernel
        ms = device_ms(lambda: k(grid, *values), repeats_for(p, tf32), "bt")
        rows.append({"precision": prec_name, "problem": p.name, "variant": name, "tflops": p.flop / ms / 1e9})
      except Exception as e:  # a variant that does not fit (shared memory) is reported, not fatal
        rows.append({"precision": prec_name, "problem": p.name, "variant": name, "error": str(e).splitlines()[0][:80]})
      print(rows[-1], flush=True)
  return rows


# *** the GEMM choice: predicted against measured, on the GEMMs Nova's fuse-gemm pass makes of GPT-2's step ***

FUSED = (("qkv fwd", "bias"), ("proj fwd", "bias,residual"), ("fc fwd", "bias,save,gelu"),
         ("fc2 fwd", "bias,residual"), ("fc2 dX", "gelu_backward"))  # (problem, epilogue); residuals in float32


def fused_choice(precisions: list[str]) -> None:
  by_name = {p.name: p for p in problems(["gpt2"])}
  rows = []
  for prec_name in precisions:
    tf32 = prec_name == "tf32"
    tdt, dt = (torch.float32, dtypes.float32) if tf32 else (torch.bfloat16, dtypes.bfloat16)
    for i, (name, epilogue) in enumerate(FUSED):
      p, steps = by_name[name], tuple(epilogue.split(","))
      a, b = operands(p, tdt, i)
      g = torch.Generator(device="cuda").manual_seed(100 + i)
      xs, out = [], dt
      for step in steps:
        if step == "bias": xs.append(torch.randn(p.N, device="cuda", generator=g).to(tdt))
        elif step == "residual":
          xs.append(torch.randn(p.M, p.N, device="cuda", generator=g))
          out = dtypes.float32
        elif step.startswith("gelu_backward"): xs.append(torch.randn(p.M, p.N, device="cuda", generator=g).to(tdt))
      A, B, X = array(a), array(b), [array(x) for x in xs]
      n = repeats_for(p, tf32)
      measured = {path: device_ms(lambda path=path: MM.fused_gemm(A, B, *X, epilogue=epilogue, dtype=out, tf32=tf32,
                                                                  path=path), n, "bt") for path in ("cublas", "nova")}
      problem = cfg.GemmProblem(p.M, p.N, p.K, 1, dt.itemsize, out.itemsize, "tf32" if tf32 else "", not p.a_t, p.b_t)
      c = cfg.gemm_choice(problem, steps, [X[j].dtype.itemsize for j in range(len(X))], runtime.hardware())
      faster = min(measured, key=measured.get)
      rows.append({"precision": prec_name, "problem": name, "epilogue": epilogue, "M": p.M, "N": p.N, "K": p.K,
                   "predicted_us": {"cublas": c.cublas_s * 1e6, "nova": c.nova_s * 1e6},
                   "measured_us": {k: v * 1e3 for k, v in measured.items()}, "chosen": c.path, "faster": faster,
                   "hit": c.path == faster, "separate": list(c.separate)})
      print(json.dumps(rows[-1]), flush=True)
      del a, b, xs, A, B, X
      torch.cuda.empty_cache()
  out_dir = ROOT / "benchmarks" / "results"
  out_dir.mkdir(parents=True, exist_ok=True)
  hits = sum(r["hit"] for r in rows)
  (out_dir / "gemm_choice.json").write_text(json.dumps({"device": runtime.hardware().name, "date": str(date.today()),
                                                        "hit_rate": hits / len(rows), "rows": rows}, indent=1))
  print("\n| precision | problem | epilogue | cuBLASLt + kernels (us) predicted / measured | synthesized (us) "
        "predicted / measured | chosen | faster |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for r in rows:
    pr, me = r["predicted_us"], r["measured_us"]
    print(f"| {r['precision']} | {r['problem']} | {r['epilogue']} | {pr['cublas']:.0f} / {me['cublas']:.0f} | "
          f"{pr['nova']:.0f} / {me['nova']:.0f} | {r['chosen']} | {r['faster']} |")
  print(f"\nhit rate: {hits}/{len(rows)}")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--precisions", default="tf32,bf16")
  ap.add_argument("--shapes", default="gpt2,squares")
  ap.add_argument("--peers", default="cublas,torch,xla,triton")
  ap.add_argument("--explore", action="store_true")
  ap.add_argument("--fused", action="store_true", help="the GEMM choice's hit rate on GPT-2's fused GEMMs")
  args = ap.parse_args()
  if args.fused: return fused_choice(args.precisions.split(","))
  peers = [x for x in args.peers.split(",") if x]
  if "xla" in peers:
    try: import jax  # noqa: F401
    except ImportError: peers.remove("xla"); print("jax is not installed: no XLA column", flush=True)
  t_start = time.perf_counter()
  results = []
  for prec_name in args.precisions.split(","):
    tf32 = prec_name == "tf32"
    tdt = torch.float32 if tf32 else torch.bfloat16
    for i, p in enumerate(problems(args.shapes.split(","))):
      a, b = operands(p, tdt, i)
      rows, cols = sample(p, i)
      torch.cuda.synchronize()
      n = repeats_for(p, tf32)
      row = {"precision": prec_name, "problem": p.name, "M": p.M, "N": p.N, "K": p.K, "repeats": n}
      info, c = run_synthesized(p, a, b, "tf32" if tf32 else "", n)
      row["synthesized"] = info | {"tflops": p.flop / info["ms"] / 1e9, "rel_err": rel_err(c, a, b, rows, cols)}
      del c
      for peer in peers:
        info, c = PEERS[peer](p, a, b, tf32, n)
        row[peer] = info | {"tflops": p.flop / info["ms"] / 1e9, "rel_err": rel_err(c, a, b, rows, cols)}
        del c
      if "cublas" in peers: row["ratio"] = row["cublas"]["ms"] / row["synthesized"]["ms"]
      results.append(row)
      print(json.dumps({k: (round(v["tflops"], 1) if isinstance(v, dict) else v) for k, v in row.items()}), flush=True)
      del a, b
      torch.cuda.empty_cache()
  explored = [r for prec_name in args.precisions.split(",") for r in explore(prec_name)] if args.explore else []
  report(results, explored, peers, time.perf_counter() - t_start)


def report(results: list[dict], explored: list[dict], peers: list[str], total_s: float) -> None:
  out_dir = ROOT / "benchmarks" / "results"
  out_dir.mkdir(parents=True, exist_ok=True)
  env = {"date": str(date.today()), "gpu": runtime.get_device_properties(0).name, "python": platform.python_version(),
         "torch": torch.__version__, "triton": triton.__version__, "total_s": total_s}
  try:
    import jax
    env["jax"] = jax.__version__
  except ImportError:
    pass
  summary = {}
  for prec in sorted({r["precision"] for r in results}):
    ratios = [r["ratio"] for r in results if r["precision"] == prec and "ratio" in r]
    errs = [r["synthesized"]["rel_err"] for r in results if r["precision"] == prec]
    if ratios: summary[prec] = {"median_ratio": statistics.median(ratios), "min_ratio": min(ratios),
                                "max_rel_err": max(errs)}
  (out_dir / "matmul.json").write_text(json.dumps({"env": env, "summary": summary, "results": results,
                                                   "explore": explored}, indent=1))
  cols = ["synthesized"] + peers
  print(f"\n{env['gpu']}, {env['date']}: TFLOP/s (device time per call), relative error vs float64; "
        f"{total_s:.0f} s in all\n")
  print("| precision | problem | M x N x K | " + " | ".join(cols) + " | synthesized / cuBLAS | synthesized error | cuBLAS error "
        "| synthesized schedule | configurator (us) + compile (s) |")
  print("|" + " --- |" * (len(cols) + 8))
  for r in results:
    tf = " | ".join(f"{r[c]['tflops']:.0f}" for c in cols)
    ratio = f"{r['ratio']:.2f}" if "ratio" in r else "-"
    cerr = f"{r['cublas']['rel_err']:.1e}" if "cublas" in r else "-"
    print(f"| {r['precision']} | {r['problem']} | {r['M']} x {r['N']} x {r['K']} | {tf} | {ratio} | "
          f"{r['synthesized']['rel_err']:.1e} | {cerr} | {r['synthesized']['schedule']} | "
          f"{r['synthesized']['configurator_us']:.0f} + {r['synthesized']['compile_s']:.1f} |")
  for prec, s in summary.items():
    print(f"\n{prec}: median synthesized/cuBLAS {s['median_ratio']:.3f}, lowest {s['min_ratio']:.3f}, "
          f"largest synthesized error {s['max_rel_err']:.1e}")
  plot(results, cols, out_dir / "matmul.png")


def plot(results: list[dict], cols: list[str], path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  precs = sorted({r["precision"] for r in results})
  fig, axes = plt.subplots(len(precs), 1, figsize=(16, 5 * len(precs)), squeeze=False)
  for ax, prec in zip(axes[:, 0], precs):
    rows = [r for r in results if r["precision"] == prec]
    x = np.arange(len(rows))
    width = 0.8 / len(cols)
    for i, c in enumerate(cols):
      ax.bar(x + (i - (len(cols) - 1) / 2) * width, [r[c]["tflops"] for r in rows], width, label=c)
    ax.set_xticks(x, [r["problem"] for r in rows], rotation=45, ha="right")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"{prec} matmuls on {runtime.get_device_properties(0).name}")
    ax.legend(ncol=len(cols))
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  main()
