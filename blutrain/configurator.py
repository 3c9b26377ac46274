"""The Analytic Configurator: every kernel's schedule, derived by formula from the problem and the device's limits.

A schedule is a pure function of shapes, dtypes, layouts and a `Hardware` record (the device's own properties on a
GPU, read by the CUDA backend's `runtime.hardware`; H200 defaults for offline compilation). This module is a leaf: it
imports nothing of blutrain but shape arithmetic, so the kernels of every backend and Nova call the same formulas.
Nothing is timed, nothing is searched, no candidate is run: what varies between problems is decided by the formulas
below, each derived in its docstring; docs/configurator.md collects them.

GEMM (`gemm_schedule`): orientation and TF32 rounding from the operand layouts, BK from the 128-byte shared-memory
swizzle line, the tile (BM, BN) and split-K as the argmax of a closed-form throughput model (tile intensity x
last-wave utilization / split-K traffic), warps from the accumulator's register budget, stages from shared memory,
GROUP_M from the L2 footprint of a wave, persistence from TMA. Reductions, row kernels (softmax, norms, losses),
elementwise and indexing kernels take their block shapes from the functions of the last section, which the CUDA
kernel library calls; flash attention's tiles (a measured table) live here too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from blutrain.shapes import cdiv, next_pow2


# *** hardware ***

@dataclass(frozen=True)
class Hardware:
  """What schedules depend on. Peak rates are dense tensor-core figures; only their ratios enter the formulas."""
  name: str
  sms: int                   # streaming multiprocessors
  smem_per_block: int        # bytes of shared memory one block may use (opt-in maximum)
  smem_per_sm: int           # bytes of shared memory per SM
  regs_per_sm: int           # 32-bit registers per SM
  threads_per_sm: int
  l2_bytes: int
  hbm_bandwidth: float       # bytes/s
  tf32_flops: float          # FLOP/s of TF32 tensor cores
  half_flops: float          # FLOP/s of bf16/fp16 tensor cores (float32 accumulation)


H200 = Hardware("NVIDIA H200", sms=132, smem_per_block=227 << 10, smem_per_sm=228 << 10, regs_per_sm=65536,
                threads_per_sm=2048, l2_bytes=50 << 20, hbm_bandwidth=4.8e12, tf32_flops=494.7e12,
                half_flops=989.4e12)


# *** GEMM ***

@dataclass(frozen=True)
class GemmProblem:
  """C (batch x M x N) = A (M x K) @ B (K x N). `a_kmajor`: A's unit stride runs along K (row-major A); `b_kmajor`:
  B's runs along K (B stored N x K, as nn.Linear's weight). `precision` is "tf32" or "tf32x3" for float32 operands,
  "" for 16-bit ones. `tma`: the operands meet TMA's alignment (16-byte base and row strides) and there is no batch.
  `copied`: None lets the schedule decide the TF32 operand copy; "a", "b" or "" is a caller's decision already
  applied (the layouts are then the copy's), so the schedule knows which operand arrives rounded. `c_layout`: "n"
  when C is row-major with a 16-byte aligned base and row stride (a TMA store can write it), "m" the same
  column-major, "" otherwise. `aux_itemsize`: bytes per element of the tensors the epilogue reads or writes by
  pointer besides C (a residual, a saved pre-activation), each of which changes layout through shared memory."""
  M: int
  N: int
  K: int
  batch: int = 1
  itemsize: int = 2
  out_itemsize: int = 2
  precision: str = ""
  a_kmajor: bool = True
  b_kmajor: bool = True
  tma: bool = True
  copied: str | None = None
  c_layout: str = "n"
  aux_itemsize: int = 0


@dataclass(frozen=True)
class GemmSchedule:
  """How a GemmProblem runs. `copy` ("a", "b", "ab" or "") names the operands to copy into a K-major layout first. With
  `swap` the kernel computes C^T = B^T A^T: M and N, the operands and their layouts (`a_kmajor`, `b_kmajor` describe
  the kernel's own operands, after the copy) are exchanged. `tma_store`: the kernel stores its tile by a TMA
  descriptor (C, or split-K's float32 partial sums), not by pointers. TF32 rounds the register operand A in the kernel
  (`round_a`), and B there too (`round_b`) when no copy rounded it. With `warp_specialize` a producer warpgroup
  feeds two consumer warpgroups of `num_warps` each (`mma_warps` in all). `split_k` > 1 writes float32
  partial sums that a second kernel adds and finishes with the epilogue. Diagnostics: `tiles` (per split and batch
  entry), `utilization` of the SMs over all rounds, `smem` (modelled bytes per block), `intensity` (the problem's
  FLOP per byte of compulsory traffic)."""
  BM: int
  BN: int
  BK: int
  num_warps: int
  num_stages: int
  group_m: int
  split_k: int
  persistent: bool
  epi_subtile: bool
  tma_store: bool
  warp_specialize: bool
  copy: str
  swap: bool
  a_kmajor: bool
  b_kmajor: bool
  round_a: bool
  round_b: bool
  grid: tuple[int, ...]
  tiles: int
  utilization: float
  smem: int
  intensity: float

  @property
  def mma_warps(self) -> int:
    """Warps that hold the accumulator: `num_warps`, or both consumer warpgroups of a warp-specialized kernel."""
    return self.num_warps * (2 if self.warp_specialize else 1)

  @property
  def block_warps(self) -> int: return block_warps(self.num_warps, self.warp_specialize)


ACC_REGS = 128        # accumulator registers per thread: half of the 255 a thread may hold, the rest for operands
ACC_REGS_X3 = 64      # 3xTF32 also keeps the high and low parts of both operands in registers
TILES = ((128, 256), (128, 128), (64, 256), (64, 128), (128, 64), (64, 64))  # wgmma: BM in 64s, BN in 64s to 256
MAX_STAGES = 4        # past 4 tiles in flight a TMA pipeline gains nothing (latency covered), it only costs smem
SPLIT_MIN_KTILES = 8  # each split-K slice runs at least 8 k-steps, so the pipeline's fill stays a small fraction
MAX_SPLIT = 16
SMEM_RESERVE = 1024   # bytes per block the runtime keeps (CUDA's reserved shared memory)
SMEM_BARRIERS = 512   # bytes of a pipeline's mbarriers and Triton's small scratch (measured: 24-56, 376 warp-specialized)
ROUND_B_COST = 0.22   # share of a TF32 GEMM's time that rounding B in the kernel costs (see `operand_copy`)
ROUND_A_COST = 0.19   # and rounding A through registers, against A read by wgmma from shared memory as stored


def intensity(M: int, N: int, K: int, itemsize: int) -> float:
  """Arithmetic intensity 2MNK / ((MK + KN + MN) * itemsize): FLOP per byte of the compulsory traffic."""
  return 2 * M * N * K / ((M * K + K * N + M * N) * itemsize)


def tile_intensity(BM: int, BN: int) -> float:
  """FLOP per element of operand loads of one tile's k-step, 2*BM*BN*BK / ((BM + BN)*BK): what each byte fetched
  through L2 buys. The largest wgmma tile, 128x256, has the most (85.3); a tile's efficiency is its share of it."""
  return 2 * BM * BN / (BM + BN)


def utilization(tiles: int, sms: int) -> float:
  """Busy share of the SMs over all rounds of a grid: tiles / (ceil(tiles / sms) * sms). The last wave is what
  loses: 133 tiles on 132 SMs take two rounds at 50%."""
  return tiles / (cdiv(tiles, sms) * sms) if tiles else 0.0


def orientation(precision: str, a_kmajor: bool, b_kmajor: bool) -> bool:
  """Whether to compute C^T = B^T A^T. TF32 wgmma reads its B operand from shared memory only K-major, while A may
  come from registers in any layout (DESIGN.md: with B stored K x N a TF32 sweep topped at 121-135 TFLOP/s, with B
  stored N x K at 264-294). A K-major A with an N-major B (C = X W, the backward's dX = dY W) is therefore swapped:
  B^T (N-major) becomes the register operand and A^T the K-major shared one. 16-bit wgmma transposes either operand
  in hardware, and 3xTF32 splits both operands in registers anyway, so neither swaps."""
  return precision == "tf32" and a_kmajor and not b_kmajor


def block_warps(num_warps: int, warp_specialize: bool) -> int:
  """Warps of a block: `num_warps`, or a warp-specialized kernel's producer and two consumer warpgroups."""
  return num_warps * (3 if warp_specialize else 1)


def gemm_warps(BM: int, BN: int, precision: str = "") -> int:
  """Warps so that each thread holds at most ACC_REGS float32 accumulators: max(4, BM*BN / (32*ACC_REGS)); 4 is one
  warpgroup, the unit of wgmma. 128x256 -> 8 warps (128 registers each), 128x128 -> 4."""
  regs = ACC_REGS_X3 if precision == "tf32x3" else ACC_REGS
  return max(4, BM * BN // (32 * regs))


def gemm_smem(BM: int, BN: int, BK: int, stages: int, itemsize: int, out_itemsize: int, persistent: bool,
              subtile: bool, precision: str = "", aux_itemsize: int = 0) -> int:
  """Shared memory of a block: `stages` buffers of an A and a B tile, (BM + BN)*BK*itemsize each, and the
  epilogue's layout change of the output tile, BM*BN*out_itemsize (half with `subtile`: two halves of BN/2 columns).
  A persistent loop keeps the pipeline's buffers while a tile's epilogue runs, so the two add up; a kernel of one
  tile reuses the buffers (max). 3xTF32 adds one unpipelined A tile and two B tiles, (BM + 2*BN)*BK*itemsize: Triton
  stages the operands' high and low TF32 parts there (128x256x32: 80 KiB). Plus SMEM_BARRIERS. An upper bound of
  what Triton 3.6 allocates (checked against compiled kernels). The epilogue's other tensors by pointer add their
  own BM*BN*aux_itemsize (a bf16 128x256 GEMM saving its pre-activation asked for 256 KiB at 3 stages, on the H200
  2026-12-01)."""
  pipeline = stages * (BM + BN) * BK * itemsize
  epilogue = BM * BN * out_itemsize // (2 if subtile else 1) + BM * BN * aux_itemsize
  parts = (BM + 2 * BN) * BK * itemsize if precision == "tf32x3" else 0
  return (pipeline + epilogue if persistent else max(pipeline, epilogue)) + parts + SMEM_BARRIERS


def gemm_stages(BM: int, BN: int, BK: int, itemsize: int, out_itemsize: int, persistent: bool,
                hw: Hardware, precision: str = "", warp_specialize: bool = False,
                aux_itemsize: int = 0) -> tuple[int, bool]:
  """(stages, subtile): as many pipeline stages as fit the block's shared memory, at most MAX_STAGES, 0 when not
  even 2 fit; the epilogue is subtiled only when that buys a stage, and never in a warp-specialized kernel (Triton
  3.6's partitioner rejects the split). Persistent, bf16 128x256x64 with a bf16 output: (227 KiB - 64 KiB) / 48 KiB
  -> 3 stages whole, (227 - 32) / 48 -> 4 subtiled; TF32 128x256x32 with a float32 output: 2 whole, 3 subtiled."""
  def fit(subtile: bool) -> int:
    return max((s for s in range(2, MAX_STAGES + 1) if gemm_smem(BM, BN, BK, s, itemsize, out_itemsize, persistent,
                                                               subtile, precision, aux_itemsize)
                <= hw.smem_per_block - SMEM_RESERVE),
               default=0)
  whole, halves = fit(False), (fit(True) if persistent and not warp_specialize else 0)
  return (halves, True) if halves > whole else (whole, False)


def operand_copy(precision: str, M: int, N: int, a_kmajor: bool, b_kmajor: bool, hw: Hardware = H200) -> str:
  """The operands ("a", "b", both or neither) a TF32 GEMM first copies into a K-major layout, rounded to TF32 on the
  way.

  TF32 wgmma truncates what it reads from shared memory, and Triton reads B from there K-major only; A may come from
  registers, where the kernel rounds it. Relative error against float64 on random normal inputs: 2.9e-4 with both
  rounded, 4.7e-4 to 5.5e-4 with one truncated (truncation shrinks every product toward zero, a bias of about
  3.4e-4 that no K averages out), 7.7e-4 with both truncated. So both are always rounded, each by the cheaper of:
  - a K-major copy rounded on the way: for B, 8*K*N bytes against 2*M*N*K FLOP, a fraction 4*peak / (bandwidth*M)
    of the GEMM's time, independent of N and K (2.5% at GPT-2's M = 16384 tokens), which also makes an N-major B
    K-major without swapping; for A, 4*peak / (bandwidth*N);
  - rounding in the kernel: B's tiles through registers back to shared memory every k-step, ROUND_B_COST of the
    GEMM's time (measured on the H200 over four GPT-2 shapes at M = 16384: 19-28%); A on its way to the registers
    wgmma then reads it from, ROUND_A_COST (measured: 14-28%, median 19%, over the benchmark's shapes, against the
    same kernel reading A from shared memory).
  B's copy wins from M = 4*peak / (bandwidth*ROUND_B_COST) = 1.9K rows on an H200, A's from N = 2.2K columns. With
  both operands MN-major (the weight gradient dW = dY^T X, both contracting over their rows) one copy is needed
  whatever it costs: no orientation gives wgmma its K-major B, and Triton then moves B through registers with no
  pipelining (TMA) or in 4-byte copies (cp.async; 0.4x of the K-major rate in DESIGN.md's sweep); when neither copy
  is cheap the smaller operand is copied (A when M <= N)."""
  if precision != "tf32": return ""
  copy = ("a" if 4 * hw.tf32_flops / (hw.hbm_bandwidth * N) <= ROUND_A_COST else "") + \
         ("b" if 4 * hw.tf32_flops / (hw.hbm_bandwidth * M) <= ROUND_B_COST else "")
  if not copy and not a_kmajor and not b_kmajor: return "a" if M <= N else "b"
  return copy


def warp_specialized(precision: str, BM: int, BN: int, persistent: bool, tma_store: bool, round_a: bool,
                     round_b: bool) -> bool:
  """Whether a persistent TF32 kernel of 128x256 tiles runs warp-specialized (Triton's Hopper partitioner: a
  producer warpgroup issues the TMA loads, two consumer warpgroups of 4 warps each own 64 rows of the tile).
  A kernel that rounds A reads it through registers: in one warpgroup those shared-memory loads wait on the wgmma
  before them, while with a producer of its own the next stage's loads overlap the rounding and the MMAs. Reading
  both operands from shared memory (A copied rounded), the unspecialized kernel was faster (331 against 282 TFLOP/s).
  Measured on the H200 (Triton 3.6, every benchmark shape): TF32 +10-45% (the split-K weight gradients the most), at
  the price of the subtiled epilogue (the whole float32 tile takes 128 KiB: see `pipeline_bk`); bf16, whose operands
  go straight from shared memory to wgmma, 0-10% slower, so it stays as it is.
  NOTE: only where it was measured right. On exact TF32 inputs, warp-specialized kernels that stored split-K's
  partial sums by pointers, or rounded B in the kernel (BK 32 x 2 stages), or used 128x128 tiles (BK 32 x 3) gave
  wrong elements that changed from run to run, and bf16 ones at BK 32 x 6 stages NaNs; those stored by TMA with B
  copied were exact and bitwise reproducible (Triton 3.6, 2026-11-30). A race in Triton's partitioning is
  suspected; benchmarks/triton_faults.py reruns each failing kernel, to check after a Triton upgrade."""
  return persistent and precision == "tf32" and (BM, BN) == (128, 256) and tma_store and round_a and not round_b


def pipeline_bk(BK: int, warp_specialize: bool) -> int:
  """The k-step of a kernel's pipeline: BK, or BK / 2 warp-specialized. There the whole float32 epilogue tile
  (128 KiB at 128x256) leaves 96 KiB for the operands: 2 stages of BK = 32 float32, so the producer can run only one
  stage ahead of the MMAs, or 4 stages of 16, three ahead. Measured on the H200 over the non-split TF32 benchmark
  shapes: 4 x 16 was 1-8% faster than 2 x 32, 3 x 16 10% slower."""
  return BK // 2 if warp_specialize else BK


def group_m(BM: int, BN: int, tiles_m: int, hw: Hardware) -> int:
  """Tile rows per L2 group. A wave of S = SMs tiles in g rows of tiles touches g*BM rows of A and (S/g)*BN columns
  of B per k-step; g*BM + S*BN/g is least at g = sqrt(S*BN/BM): 16 for 128x256 tiles on 132 SMs, 11 for squares."""
  return max(1, min(tiles_m, round(math.sqrt(hw.sms * BN / BM))))


def split_cost(split: int, K: int, flops: float, hw: Hardware) -> float:
  """Time of split-K's extra traffic relative to the GEMM's math: each split writes and the second kernel reads an
  M x N float32 slice, 8*s*MN bytes against 2MNK FLOP: 4*s*peak / (K*bandwidth). Zero without a split."""
  return 4 * split * flops / (K * hw.hbm_bandwidth) if split > 1 else 0.0


def occupancy(smem: int, warps: int, hw: Hardware) -> int:
  """Blocks resident per SM, limited by shared memory and threads (registers at up to 255 per thread)."""
  threads = 32 * warps
  return max(1, min(hw.smem_per_sm // (smem + SMEM_RESERVE), hw.threads_per_sm // threads,
                    hw.regs_per_sm // (threads * 255) or 1))


def gemm_schedule(p: GemmProblem, hw: Hardware = H200) -> GemmSchedule:
  """The schedule of a GEMM, by formula.

  1. TF32 layout and rounding: `operand_copy` (a K-major copy rounded to TF32 of each operand for which that is
     cheaper than rounding it in the kernel, and of one when both are MN-major), then `orientation` (swap M and N
     when only the swapped problem has a K-major B). The kernel rounds whichever of its operands no copy rounded.
     3xTF32 splits both operands exactly (relative error 8e-8).
  3. BK = 128 bytes / itemsize: one row of the 128-byte shared-memory swizzle (32 float32, 64 bf16), so every
     k-step of wgmma reads whole swizzle lines. A warp-specialized kernel halves it (`pipeline_bk`).
  4. Tile (BM, BN) and split s: the argmax over the wgmma tiles TILES (those whose stages fit, `gemm_stages`) and
     s in 1..min(MAX_SPLIT, k_tiles / SPLIT_MIN_KTILES) (only when one split leaves SMs idle) of the modelled
     fraction of peak
         tile_intensity(BM, BN) / tile_intensity(128, 256)          the tile's rate, by its operand intensity
         * utilization(tiles * s * batch)                           the busy share of the SMs over all rounds
         * M*N / (tiles*BM*BN)                                      the share of tile area inside C
         / (1 + split_cost(s))                                      split-K's extra traffic.
     Ties go to the larger tile and the smaller split (the order of the candidates); s is then evened out so that
     every slice has the same number of k-steps.
  5. Warps `gemm_warps`, stages `gemm_stages`, GROUP_M `group_m`. The tile is stored by TMA when persistent and its
     destination allows: C row-major and aligned in the kernel's orientation, or split-K's float32 workspace
     ((split, M, N), row-major: N a multiple of 4). TF32 128x256 tiles stored by TMA with B copied run
     warp-specialized (`warp_specialized`: 4 warps per consumer warpgroup, the epilogue whole).
  6. Persistent with TMA: programs = min(tiles * s, SMs * occupancy) each walk tiles with a stride of the grid, so
     TMA descriptors are built once per program and a tile's epilogue overlaps the next tile's loads. Without TMA
     (misaligned or batched operands) one program per tile: grid (tiles, s, batch).
  """
  if min(p.M, p.N) <= 0 or p.K < 0 or p.batch <= 0:
    raise ValueError(f"gemm_schedule: needs M, N, batch > 0 and K >= 0, got {p}")
  copy = operand_copy(p.precision, p.M, p.N, p.a_kmajor, p.b_kmajor, hw) if p.copied is None else p.copied
  a_k, b_k = p.a_kmajor or "a" in copy, p.b_kmajor or "b" in copy
  swap = orientation(p.precision, a_k, b_k)
  M, N, a_k, b_k = (p.N, p.M, b_k, a_k) if swap else (p.M, p.N, a_k, b_k)
  tf32 = p.precision == "tf32"
  kernel_a, kernel_b = ("b", "a") if swap else ("a", "b")  # which operand each of the kernel's is
  round_a, round_b = tf32 and kernel_a not in copy, tf32 and kernel_b not in copy
  BK = 128 // p.itemsize
  k_tiles = cdiv(p.K, BK)
  flops = hw.tf32_flops if p.itemsize == 4 else hw.half_flops
  persistent = p.tma and p.batch == 1
  c_unit = {"n": "m", "m": "n"}.get(p.c_layout, "") if swap else p.c_layout
  best, best_score = None, -1.0
  for BM, BN in TILES:
    tiles = cdiv(M, BM) * cdiv(N, BN)
    can_split = tiles * p.batch < hw.sms
    splits = range(1, max(1, min(MAX_SPLIT, k_tiles // SPLIT_MIN_KTILES)) + 1) if can_split else (1,)
    for s in splits:
      tma_store = persistent and (N % 4 == 0 if s > 1 else c_unit == "n")
      ws = warp_specialized(p.precision, BM, BN, persistent, tma_store, round_a, round_b)
      warps = gemm_warps(BM, BN, p.precision) // (2 if ws else 1)
      out_itemsize = 4 if s > 1 else p.out_itemsize  # split-K stores float32 partial sums
      bk = pipeline_bk(BK, ws)
      stages, subtile = gemm_stages(BM, BN, bk, p.itemsize, out_itemsize, persistent, hw, p.precision, ws,
                                    p.aux_itemsize)
      if not stages: continue
      if s > 1 and persistent and p.itemsize == 4 and not ws:
        # NOTE: TF32 split-K through TMA at 3 stages gave wrong sums on the H200 (relative error 0.07-0.09 at
        # 128x256x32 with B from shared memory unrounded; Triton 3.6, 2026-11-30); 2 stages, or B rounded in the
        # kernel, or no split were right. Suspected in Triton's pipeliner; the cap keeps the measured-right kernel
        # (benchmarks/triton_faults.py reruns the failing one).
        stages = min(stages, 2)
      score = tile_intensity(BM, BN) / tile_intensity(*TILES[0]) * utilization(tiles * s * p.batch, hw.sms)
      score *= M * N / (tiles * BM * BN) / (1 + split_cost(s, p.K, flops, hw))
      if score > best_score + 1e-9:
        best, best_score = (BM, BN, bk, warps, stages, subtile, tma_store, ws, tiles, s), score
  if best is None: raise ValueError(f"gemm_schedule: no tile fits {hw.smem_per_block} bytes of shared memory for {p}")
  BM, BN, BK, warps, stages, subtile, tma_store, ws, tiles, split = best
  if split > 1:  # slices of equal k-steps, none empty
    k_steps = cdiv(p.K, BK)
    split = cdiv(k_steps, cdiv(k_steps, split))
  smem = gemm_smem(BM, BN, BK, stages, p.itemsize, 4 if split > 1 else p.out_itemsize, persistent, subtile,
                   p.precision)
  if persistent: grid = (min(tiles * split, hw.sms * occupancy(smem, block_warps(warps, ws), hw)),)
  else: grid = (tiles, split, p.batch)
  return GemmSchedule(BM, BN, BK, warps, stages, group_m(BM, BN, cdiv(M, BM), hw), split, persistent, subtile,
                      tma_store, ws, copy, swap, a_k, b_k, round_a, round_b, grid, tiles,
                      utilization(tiles * split * p.batch, hw.sms), smem,
                      intensity(p.M, p.N, p.K, p.itemsize) if p.K else 0.0)


def copy_schedule(rows: int, cols: int) -> tuple[int, int, int]:
  """(BLOCK_R, BLOCK_C, num_warps) of a GEMM operand's K-major copy: 64 x 64 tiles (16 KiB of float32) at 4 warps,
  read along the source's unit stride and written along the rows in 128-byte lines (a transposing copy turns
  through shared memory); smaller dims shrink to their next power of two (at least 16)."""
  return min(64, max(16, next_pow2(rows))), min(64, max(16, next_pow2(cols))), 4


# *** the GEMM choice: cuBLASLt and separate kernels, or one synthesized GEMM with the whole epilogue ***

CUBLAS_EFFICIENCY = {"": 0.71, "tf32": 0.65, "fp32": 0.80}  # cuBLASLt's share of the tensor-core peak (fp32: of
# FP32_FLOPS, its float32 GEMMs without TF32), the medians of BENCHMARKS.md "Nova's synthesized GEMMs against cuBLAS"
# over GPT-2's GEMMs (fp32: not measured, the usual share of a CUDA-core SGEMM)
NOVA_VS_CUBLAS = {("", "fwd"): 0.96, ("", "dx"): 0.95, ("", "dw"): 0.84,        # the synthesized GEMM's rate over
                  ("tf32", "fwd"): 0.78, ("tf32", "dx"): 0.92, ("tf32", "dw"): 1.19}  # cuBLAS's, same table, medians
# per layout class: "fwd" (A and B K-major: X W^T), "dx" (B N-major: dY W), "dw" (A M-major: dY^T X)
FP32_FLOPS = 67e12      # FLOP/s of the H200's CUDA cores in float32 (cuBLASLt's float32 GEMMs without TF32)
LAUNCH_S = 2e-6         # seconds a kernel adds in a CUDA graph beyond its work (launch, fill and drain)
STREAM_SHARE = 0.85     # share of the HBM bandwidth an elementwise kernel or an epilogue's extra traffic reaches
GEMM_TENSOR_STEPS = ("bias", "residual", "gelu_backward", "gelu_backward_tanh")  # epilogue steps that read a tensor
CUBLAS_GELU_EPILOGUES = {  # epilogue steps (half operands and output) -> the cuBLASLt epilogue doing them all; GELU's
  ("gelu_tanh",): "gelu", ("save", "gelu_tanh"): "gelu_aux",  # tanh form only, its input saved as the aux matrix
  ("bias", "gelu_tanh"): "gelu_bias", ("bias", "save", "gelu_tanh"): "gelu_aux_bias",
  ("gelu_backward_tanh",): "dgelu"}  # reads the aux matrix. Not with a final "bias_grad": DGELU_BGRAD took 462-526
# us for GPT-2's MLP backward on the H200 (16384 x 3072 x 768, bf16, its bias gradient in bf16; float32 refused)
# against 203 for the GEMM and the GELU backward's summing kernel (BENCHMARKS.md, sixteenth session)
# seconds per output element that a step adds to the synthesized GEMM beyond its traffic: the epilogue's arithmetic
# on the accumulator tile (an exact GELU's erf, its backward's erf and exp), which the next tile's loads hide only in
# part. Fitted to `benchmarks/matmul.py --fused` on the H200 (2026-12-02, BENCHMARKS.md, eleventh session): the
# synthesized GEMM's measured time beyond its prediction on GPT-2's fused GEMMs, bf16 and TF32 alike (a GELU 1.9-2.7
# ps an element, its backward 4.7-5.1, a residual 0.2-1.3 beyond its read)
NOVA_STEP_S = {"gelu": 2.3e-12, "gelu_tanh": 2.3e-12, "gelu_backward": 4.9e-12, "gelu_backward_tanh": 4.9e-12,
               "residual": 0.7e-12}


def kernel_seconds(flops: int, moved: int, hw: Hardware = H200) -> float:
  """A kernel's predicted time on its own, the roofline with a launch: max(FLOPs / the half tensor-core peak, bytes
  read and written / the streaming bandwidth) + LAUNCH_S. Rough for GEMMs (no efficiency), right for the memory-bound
  kernels it prices (what rematerialization recomputes) and for the share of a step they take."""
  return max(flops / hw.half_flops, moved / (hw.hbm_bandwidth * STREAM_SHARE)) + LAUNCH_S


@dataclass(frozen=True)
class GemmChoice:
  """How a fused GEMM runs on the GPU (`path`: "cublas" or "nova") and why: the predicted seconds of cuBLASLt with
  the epilogue steps it does (`cublas_epilogue`) plus a kernel per other step (`separate`), and of the synthesized
  GEMM doing every step."""
  path: str
  cublas_s: float
  nova_s: float
  cublas_epilogue: tuple[str, ...]
  separate: tuple[str, ...]

  def __str__(self) -> str:
    sep = f" + {' '.join(self.separate)}" if self.separate else ""
    epi = f" [{' '.join(self.cublas_epilogue)}]" if self.cublas_epilogue else ""
    return f"{self.path}: cublas{epi}{sep} {self.cublas_s * 1e6:.1f} us, nova {self.nova_s * 1e6:.1f} us"


def layout_class(a_kmajor: bool, b_kmajor: bool) -> str:
  """GPT's three GEMMs by operand layout: "fwd" (X W^T), "dx" (dY W, B N-major), "dw" (dY^T X, A M-major)."""
  return "dw" if not a_kmajor else "fwd" if b_kmajor else "dx"


def gemm_choice(p: GemmProblem, steps: tuple[str, ...], extra_itemsizes: list[int] = (),
                hw: Hardware = H200) -> GemmChoice:
  """cuBLASLt or the synthesized GEMM for C = epilogue(A @ B), by predicted time, with no search.

  The epilogue steps are those of `ops.linalg.gemm_op` ("bias", "gelu", "save", "residual", ...); `extra_itemsizes`
  are the item sizes of the tensors the steps read, in order. With E = batch*M*N output elements:
    GEMM(rate)  = max(2*batch*M*N*K / rate, compulsory bytes / bandwidth)
    cuBLASLt    = GEMM(peak * CUBLAS_EFFICIENCY[precision]) + LAUNCH_S
                  + per step it cannot do: its kernel's E*(reads + write) bytes / (bandwidth * STREAM_SHARE) + LAUNCH_S
    synthesized = GEMM(that rate * NOVA_VS_CUBLAS[precision, layout class]; a third of it for 3xTF32) + LAUNCH_S
                  + the epilogue's extra traffic (tensors read, values saved) / (bandwidth * STREAM_SHARE)
                  + E * NOVA_STEP_S[step] per step (its arithmetic, measured)
  cuBLASLt's epilogue does the bias (rounding once, with half operands, where eager mode rounds twice) and, on half
  operands and output, a tanh GELU after it with its input saved, or a tanh GELU's backward without its bias
  gradient (`CUBLAS_GELU_EPILOGUES`: the aux matrix written or read is the epilogue's only extra traffic); every
  other step is a kernel of its own. A final "bias_grad" (the output's column sums) costs a reduction over the output
  (E * out / bandwidth + a launch), but on cuBLASLt's path after a GELU backward, whose kernel sums as it stores (a
  launch for its partial sums). A saved pre-activation costs cuBLASLt's separate path nothing extra: it is the GEMM's
  own output, which the GELU kernel then reads.
  Float32 products without TF32 stay on cuBLASLt whatever the times say: its SGEMM is eager mode's float32
  arithmetic, which the synthesized 3xTF32 GEMM only approximates (to float32's error).
  """
  E = p.batch * p.M * p.N
  out, item = p.out_itemsize, p.itemsize
  bw = hw.hbm_bandwidth * STREAM_SHARE
  flops = 2 * E * p.K
  compulsory = (p.batch * (p.M + p.N) * p.K * item + E * out) / hw.hbm_bandwidth
  kind = "fp32" if p.precision == "tf32x3" else p.precision
  peak = FP32_FLOPS if kind == "fp32" else hw.tf32_flops if item == 4 else hw.half_flops
  cublas_rate = peak * CUBLAS_EFFICIENCY[kind]
  lay = layout_class(p.a_kmajor, p.b_kmajor)
  nova_rate = (hw.tf32_flops * CUBLAS_EFFICIENCY["tf32"] * NOVA_VS_CUBLAS["tf32", lay] / 3 if kind == "fp32" else
               cublas_rate * NOVA_VS_CUBLAS[kind, lay])
  sums = steps[-1:] == ("bias_grad",)
  steps = steps[:-1] if sums else steps
  gelu_epi = steps in CUBLAS_GELU_EPILOGUES and kind == "" and out == item and not sums
  cublas_epi = steps if gelu_epi else ("bias",) if steps[:1] == ("bias",) else ()
  separate = tuple(s for s in steps[len(cublas_epi):] if s != "save")
  sizes = dict(zip([s for s in steps if s in GEMM_TENSOR_STEPS], extra_itemsizes))
  kernels = 0.0
  for s in separate:
    reads = item + (sizes.get(s, item) if s in ("residual", "gelu_backward", "gelu_backward_tanh") else 0)
    kernels += E * (reads + (out if s == separate[-1] else item)) / bw + LAUNCH_S
  epilogue = sum(E * sizes[s] for s in sizes if s != "bias") + E * item * steps.count("save")
  reduction = (E * out / bw + LAUNCH_S) * sums
  summed = sums and separate[-1:] in (("gelu_backward",), ("gelu_backward_tanh",))
  if gelu_epi:  # one kernel: the aux matrix is its extra traffic
    cublas = max(flops / cublas_rate, compulsory + E * item / hw.hbm_bandwidth) + LAUNCH_S
  else:
    cublas = max(flops / cublas_rate, compulsory) + LAUNCH_S + kernels + (LAUNCH_S * sums if summed else reduction)
  nova = max(flops / nova_rate, compulsory) + LAUNCH_S + epilogue / bw + E * sum(NOVA_STEP_S.get(s, 0.0) for s in steps)
  nova += reduction
  faster = "nova" if nova < cublas and kind != "fp32" else "cublas"  # float32 without TF32: eager's SGEMM arithmetic
  return GemmChoice(faster, cublas, nova, cublas_epi, separate)


# *** reductions, row kernels, elementwise, indexing ***

def flat_schedule(n: int, itemsize: int, hw: Hardware = H200) -> tuple[int, int]:
  """(BLOCK, num_warps) of a flat elementwise kernel, two tiers: each thread moves four 16-byte vectors per operand at
  8 warps (BLOCK = 4096 float32, 8192 bfloat16), enough bytes in flight to saturate HBM, once that still gives a
  program to every SM; below, one vector per thread at 4 warps (512 float32), so mid-sized inputs spread over the
  SMs. Two tiers keep the number of compiled variants small."""
  vec = max(1, 16 // itemsize)
  return (4 * vec * 256, 8) if n >= hw.sms * 4 * vec * 256 else (vec * 128, 4)


FUSED_REGS = 64  # registers per thread for the elements a fused kernel holds at once (a quarter of the 255)


def fused_schedule(n: int, itemsize: int, operands: int, hw: Hardware = H200) -> tuple[int, int]:
  """(BLOCK, num_warps) of a synthesized pointwise kernel (`nova/synth.py`) over n elements whose narrowest operand
  has `itemsize` bytes and that loads and stores `operands` arrays: `flat_schedule`'s tiers, then the elements per
  thread halved while operands * elements (each held in a 32-bit register at once, halves widened) would pass
  FUSED_REGS, so a wide group keeps its registers (and occupancy) at the cost of fewer bytes in flight per thread.
  bfloat16 in and out keeps 32 elements per thread; float32 with three inputs and an output 16, with four 8."""
  block, warps = flat_schedule(n, itemsize, hw)
  per_thread = block // (32 * warps)
  while per_thread > 1 and per_thread * operands > FUSED_REGS: per_thread //= 2
  return per_thread * 32 * warps, warps


MULTI_TENSOR_CHUNK = 65536  # elements of one tensor per program of a multi-tensor kernel


def multi_tensor_schedule(operands: int, hw: Hardware = H200) -> tuple[int, int]:
  """(BLOCK, num_warps) of a multi-tensor kernel (the optimizer's updates and gradient clipping, kernels/optim.py)
  that loads `operands` arrays of each tensor: `fused_schedule`'s upper tier at float32, whatever the dtypes (one
  table mixes tensors of every size, so the block cannot follow each one's), BLOCK = 4096 at 8 warps for up to four
  (AdamW's param, grad and moments: 64 registers of elements per thread). Each program takes MULTI_TENSOR_CHUNK
  elements, 16 such tiles: its fixed cost (its table row, the learning rate, AdamW's bias corrections) is spread over
  a megabyte or more of traffic, and a model still gives the SMs many programs (GPT-2 124M ~1900, 14 waves of 132;
  ResNet-18 ~240 of its 11.7M parameters' chunks and small tensors)."""
  return fused_schedule(hw.sms * MULTI_TENSOR_CHUNK, 4, operands, hw)


def tile_schedule(n_rows: int, n_cols: int) -> tuple[int, int, int]:
  """(BLOCK_R, BLOCK_C, num_warps) of a 2-D elementwise kernel: tiles of 4096 elements at 8 warps (16 per thread and
  operand). BLOCK_C is the largest power of two dividing n_cols, up to 1024, so columns need no mask and rows stay
  16-byte aligned; below 32 it is next_pow2(n_cols) and masked. BLOCK_R fills the tile whatever n_rows is (a small
  input masks rows instead of compiling a variant of its own)."""
  p2 = n_cols & -n_cols
  bc = min(p2, 1024) if p2 >= 32 else min(next_pow2(n_cols), 1024)
  return 4096 // bc, bc, 8


def reduce_schedule(M: int, N: int, along_m: bool) -> tuple[int, int, int]:
  """(BLOCK_M, BLOCK_N, num_warps) of a reduction of M outputs over N: tiles of up to 4096 elements (16 per thread at
  8 warps). Loading along N (the usual case) BLOCK_N covers N up to 1024 (up to 4096 when M < 4, as in a full
  reduction, so each program keeps 16 KB in flight) and BLOCK_M takes the rest of the tile; loading along M
  (reductions over leading dims) BLOCK_M covers M up to 256, wide enough for full 128-byte lines, and BLOCK_N the
  rest."""
  if along_m:
    bm = min(next_pow2(M), 256)
    bn = max(1, min(next_pow2(N), 4096 // bm))
  else:
    bn = min(next_pow2(N), 4096 // min(next_pow2(M), 4))
    bm = max(1, min(next_pow2(M), 4096 // bn))
  return bm, bn, 8 if bm * bn >= 4096 else 4


REDUCE_STAGES = 3  # tiles in flight in a reduction's loop (Triton's pipelined loads), measured: docs/configurator.md


def split_rule(m_blocks: int, N: int, block_n: int, hw: Hardware = H200) -> int:
  """How many pieces a reduction's N is cut into: enough programs for two waves over the SMs, each piece at least 8
  tiles long (so partial results stay a small fraction of the traffic); 1 when M alone fills the GPU."""
  if m_blocks >= hw.sms: return 1
  return max(1, min(cdiv(2 * hw.sms, m_blocks), N // (8 * block_n)))


class ColumnSums(NamedTuple):
  """A pointwise kernel that also sums its output's columns: its tile, warps, rows per program, tiles in flight."""
  block_m: int
  block_n: int
  warps: int
  rows: int
  stages: int


def column_sums_schedule(M: int, N: int, sms: int) -> ColumnSums:
  """The schedule of a pointwise op over M rows of N that also writes the column sums of its result (GELU's backward
  with a bias gradient): tiles of 4096 elements at 8 warps (16 a thread), up to 256 columns wide; each program walks
  one column block down an equal run of rows, keeping a [BLOCK_M, BLOCK_N] float32 accumulator it reduces once at the
  end (a cross-thread sum per tile would cost more than the tile's arithmetic), and writes one partial row. The rows
  are split so that about four programs run per SM, which keeps the partial rows (programs x N floats, summed by a
  reduction) under 1 % of the traffic. GPT-2's 16384 x 3072: 12 column blocks of 256, 44 runs of 384 rows."""
  bn = min(next_pow2(N), 256)
  bm = max(1, 4096 // bn)
  runs = max(1, cdiv(4 * sms, cdiv(N, bn)))
  rows = cdiv(cdiv(M, runs), bm) * bm
  return ColumnSums(bm, bn, 8, rows, REDUCE_STAGES)


def partial_sums_schedule(P: int, N: int, sms: int) -> tuple[int, int]:
  """(BLOCK_P, BLOCK_N) of the kernel adding up P partial rows of N (the per-program sums that the norm backward and
  the column-sum kernels leave): a tile of up to 2048 elements at 4 warps takes up to 256 rows at once, so a program
  issues one load per array instead of a chain of dependent ones, and its columns are as narrow as it takes to give
  about one program per SM. GPT-2's 256 x 768 partials of the norm backward: 96 programs of 256 x 8; the GELU
  backward's 43 x 3072: 96 programs of 64 x 32."""
  bp = min(next_pow2(P), 256)
  return bp, max(1, min(64, 2048 // bp, next_pow2(cdiv(N, sms))))


ONE_PASS_MAX = 8192  # elements of a row held in registers at once (32 per thread at 8 warps)


def row_schedule(M: int, N: int) -> tuple[int, int, int, bool]:
  """(BLOCK_M, BLOCK_N, num_warps, one_pass) of a row kernel (softmax, norms, losses). Rows up to ONE_PASS_MAX are
  one tile wide and several short rows share a program (tiles of up to 4096 elements, so short rows still fill the
  warps); longer rows are walked in tiles of 4096, one row per program. Warps grow with the tile: 16 elements per
  thread, 1 to 8 warps."""
  if N <= ONE_PASS_MAX:
    bn = next_pow2(N)
    bm = max(1, min(next_pow2(M), 4096 // bn))
    return bm, bn, max(1, min(8, bm * bn // 512)), True
  return 1, 4096, 8, False


NORM_BACKWARD_PROGRAMS_PER_SM = 2  # measured: benchmarks/row_kernels.py (docs/configurator.md)
NORM_BACKWARD_STAGES = 3  # row tiles in flight per program (cp.async into shared memory), measured likewise
NORM_BACKWARD_ELEMENTS_PER_THREAD = 32  # of a one-pass row tile, measured likewise (row kernels' default: 16)


class NormBackward(NamedTuple):
  """layer_norm backward's schedule: its row tile and warps, rows per program, and how many row tiles a program's
  loop keeps in flight (Triton's software pipeline; 1: none)."""
  block_m: int
  block_n: int
  warps: int
  one_pass: bool
  rows: int
  stages: int


def norm_backward_schedule(M: int, N: int, sms: int) -> NormBackward:
  """layer_norm backward's schedule: row_schedule's tile at 32 elements a thread; the M rows split evenly, in whole
  tiles, over two programs per SM, and three tiles in flight in each. A program's loop over its tiles is serial
  (loads, four row reductions, the store), so without the pipeline an SM waits on each tile's loads; with it, two
  programs a SM keep enough bytes in flight and leave the per-program partial sums of dw and db (programs x N floats,
  summed by a second kernel) under 1 % of the traffic. GPT-2's 16384 x 768 rows on 132 SMs: 64 rows (16 tiles of 4)
  in each of 256 programs of 4 warps."""
  bm, bn, warps, one = row_schedule(M, N)
  if one: warps = max(1, min(8, bm * bn // NORM_BACKWARD_ELEMENTS_PER_THREAD // 32))
  rows = cdiv(cdiv(M, bm), NORM_BACKWARD_PROGRAMS_PER_SM * sms) * bm
  return NormBackward(bm, bn, warps, one, rows, NORM_BACKWARD_STAGES if one else 1)


def index_schedule(n_rows: int, n_cols: int) -> tuple[int, int, int]:
  """(BLOCK_R, BLOCK_C, num_warps) of gather/scatter kernels: tiles of up to 2048 elements at 4 warps (16 per
  thread), BLOCK_C covering the innermost dim up to 512 (a 768-wide embedding row takes two column blocks of 512,
  the second masked)."""
  bc = min(next_pow2(n_cols), 512)
  br = max(1, min(next_pow2(n_rows), 2048 // bc))
  return br, bc, 4


def attention_schedule(kernel: str, itemsize: int, block_d: int) -> tuple[int, int, int, int]:
  """(BLOCK_M, BLOCK_N, num_warps, num_stages) of flash attention's "fwd", "dq" and "dkdv" kernels by element size
  and padded head width: tiles that keep the accumulators in registers and the pipelined K/V (or Q/dO) tiles within
  shared memory. NOTE: a measured table, not a formula: the D <= 64 tiles are the fastest of a sweep on the H200
  (GPT-2's attention); wider heads halve the tiles to stay within registers."""
  wide = itemsize == 4
  if kernel == "fwd":
    if block_d <= 64: return (128, 64, 8, 2) if wide else (64, 64, 4, 3)
    if block_d <= 128: return (64, 32, 4, 2) if wide else (128, 64, 8, 3)
    return (32, 32, 4, 1) if wide else (64, 32, 4, 2)
  if kernel == "dq":
    if block_d <= 64: return (64, 32, 4, 2) if wide else (64, 64, 4, 3)
    if block_d <= 128: return (32, 32, 4, 2) if wide else (64, 32, 4, 2)
    return (16, 32, 4, 1) if wide else (32, 32, 4, 1)
  if block_d <= 64: return (32, 64, 4, 2) if wide else (32, 64, 4, 3)
  if block_d <= 128: return (32, 32, 4, 2) if wide else (32, 64, 4, 2)
  return (16, 32, 4, 1) if wide else (16, 64, 4, 1)


# *** convolution (implicit GEMM) ***

def conv_schedule(M: int, N: int, K: int, itemsize: int, hw: Hardware = H200, k_run: int = 0,
                  n_run: int = 0) -> tuple[int, int, int, int, int, int]:
  """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, split) of an implicit-GEMM convolution kernel computing an
  (M, N) result over a reduction of K (forward: M = N*OH*OW, N = C_out/groups, K = C_in/groups*KH*KW; dgrad and
  wgrad likewise, see backend/cuda/kernels/conv.py). The tile is the largest of 128 that the GEMM's N (the channels,
  often 64) fills, as GEMM tiles are; BLOCK_K holds 128 bytes of a row's reduction (32 float32, 64 halves), at most
  the padded K. The channels-last kernels' tiles do not cross a kernel position: `k_run` (fwd, dgrad) is the
  channels a reduction tile runs along, `n_run` (wgrad) those of a column tile, and the tile is at most their padded
  count. Stages are as many as shared memory holds for the A and B tiles, up to 4. When the tiles cannot fill the
  SMs twice over (wgrad: small C_out x C_in, huge N*OH*OW), K is split into `split` parts of at least 8 BLOCK_K steps
  each, summed afterwards (only wgrad splits; the others ignore `split`)."""
  cap = 32 if itemsize == 8 else 128  # float64 has no tensor cores: its tile is a broadcast product in registers
  bm = min(cap, max(16, next_pow2(M)))
  bn = min(cap, 128 if N > 64 else max(16, next_pow2(N)), max(16, next_pow2(n_run)) if n_run else cap)
  bk = max(16, min(128 // itemsize, next_pow2(min(K, k_run or K))))
  warps = 8 if bm * bn >= 128 * 128 else 4
  tile_bytes = (bm + bn) * bk * itemsize
  stages = max(1, min(4, hw.smem_per_block // max(tile_bytes, 1) - 1))
  tiles = cdiv(M, bm) * ((N // n_run) * cdiv(n_run, bn) if n_run else cdiv(N, bn))
  split = 1
  if tiles < 2 * hw.sms: split = max(1, min(cdiv(2 * hw.sms, tiles), K // (8 * bk)))
  return bm, bn, bk, warps, stages, split


# *** collectives (the alpha-beta model of docs/distributed.md) ***

@dataclass(frozen=True)
class Link:
  """A collective's cost model over one kind of link: `alpha` seconds of fixed latency per collective and `busbw`
  bytes/s of bus bandwidth, as nccl-tests reports it (algorithm bandwidth times the collective's traffic factor)."""
  name: str
  alpha: float
  busbw: float


# NOTE: published, approximate figures, not measured here: NVLink 4 carries 450 GB/s per direction per H100/H200 and
# NCCL's ring all-reduce reaches about 360 GB/s of bus bandwidth on 8 GPUs without NVLink SHARP (which stays off on
# the lent machines); a 400 Gb/s NDR InfiniBand NIC per GPU gives 50 GB/s, of which rings reach about 45. Latencies are
# NCCL's small-message figures (~10 us in a node, ~30 us across nodes). Replace them with nccl-tests measurements.
NVLINK_H200 = Link("NVLink 4, 8x H100/H200 (published)", alpha=10e-6, busbw=360e9)
IB_NDR = Link("InfiniBand NDR 400 Gb/s per GPU (published)", alpha=30e-6, busbw=45e9)

_TRAFFIC = {"all_reduce": lambda p: 2 * (p - 1) / p, "reduce_scatter": lambda p: (p - 1) / p,
            "all_gather": lambda p: (p - 1) / p, "broadcast": lambda p: 1.0}


def collective_time(kind: str, nbytes: int, world: int, link: Link) -> float:
  """Seconds of one collective on `nbytes` (the full tensor: all_reduce's buffer, all_gather's output,
  reduce_scatter's input) over `world` ranks: alpha + traffic(p) * nbytes / busbw, where a ring moves
  2(p-1)/p of the buffer through each rank for all_reduce and (p-1)/p for reduce_scatter and all_gather."""
  if world == 1: return 0.0
  return link.alpha + _TRAFFIC[kind](world) * nbytes / link.busbw


def ddp_bucket_bytes(world: int, link: Link, latency_share: float = 0.1) -> int:
  """The smallest gradient bucket whose all-reduce spends at most `latency_share` of its time on the fixed latency:
  alpha <= share * (alpha + 2(p-1)/p * b / busbw) gives b >= alpha * busbw * (1 - share) / (share * 2(p-1)/p).
  Larger buckets overlap less of the backward (the last one is exposed whole), so this lower bound is the choice,
  rounded up to a MiB: 18 MiB for 8 GPUs on NVLINK_H200 (7 MiB on IB_NDR). DDP keeps PyTorch's 25 MB default, where
  the latency is 7 % of a bucket's all-reduce on NVLink and the exposed last bucket costs 0.14 ms."""
  if world == 1: return 1 << 20
  b = link.alpha * link.busbw * (1 - latency_share) / (latency_share * _TRAFFIC["all_reduce"](world))
  return max(1, math.ceil(b / (1 << 20))) << 20
