"""Nova's Analytic Configurator on the CPU: its GEMM decisions on GPT-2 124M's training shapes and squares (tiles fit
shared memory and registers, the grid fills the SMs, the last wave is well used, split-K only for small outputs with
a long K, TF32 layouts and copies), its formulas at hand-computed points, determinism, and the reduction and
elementwise block shapes the kernel library takes from it. The shared-memory model is checked against what Triton
actually allocates for the largest schedules (compiled for sm_90, no GPU)."""
import importlib
import math

import pytest
from hypothesis import given, strategies as st

from blutrain import configurator as C
from blutrain.configurator import H200, GemmProblem, gemm_schedule
from blutrain.shapes import cdiv

T = 16384  # GPT-2 124M training tokens per step (B=16, T=1024)
LINEARS = ((2304, 768), (768, 768), (3072, 768), (768, 3072), (50304, 768))  # (out, in) features


def gpt2_problems(itemsize: int, precision: str):
  """(name, problem) for every linear in the forward, input-gradient and weight-gradient orientations."""
  for n, k in LINEARS:
    yield f"fwd {n}x{k}", GemmProblem(T, n, k, 1, itemsize, itemsize, precision, True, True)      # x W^T
    yield f"dX {n}x{k}", GemmProblem(T, k, n, 1, itemsize, itemsize, precision, True, False)      # dy W
    yield f"dW {n}x{k}", GemmProblem(n, k, T, 1, itemsize, itemsize, precision, False, False)     # dy^T x


def squares(itemsize: int, precision: str):
  for n in (1024, 2048, 4096, 8192):
    yield f"square {n}", GemmProblem(n, n, n, 1, itemsize, itemsize, precision, True, False)


ALL = [(name, p) for itemsize, prec in ((4, "tf32"), (2, "")) for name, p in
       list(gpt2_problems(itemsize, prec)) + list(squares(itemsize, prec))]
IDS = [f"{'tf32' if p.itemsize == 4 else 'bf16'} {name}" for name, p in ALL]


@pytest.mark.parametrize("name,p", ALL, ids=IDS)
def test_gemm_schedule_fits_the_h200(name, p):
  s = gemm_schedule(p)
  assert s.smem <= H200.smem_per_block - C.SMEM_RESERVE and 2 <= s.num_stages <= C.MAX_STAGES, s
  assert s.BM * s.BN // (32 * s.mma_warps) <= C.ACC_REGS and s.num_warps % 4 == 0 and s.BM % 64 == 0, s
  assert s.BK * p.itemsize == (64 if s.warp_specialize else 128) and s.persistent and s.grid[0] <= H200.sms * C.occupancy(s.smem, s.block_warps, H200)


@pytest.mark.parametrize("name,p", ALL, ids=IDS)
def test_grid_fills_the_sms_and_the_last_wave(name, p):
  """Every GPT-2 GEMM and square >= 2048 keeps >= 90% of the SMs busy over all rounds (split-K where needed); the
  persistent grid is the whole GPU once there is a wave of tiles."""
  s = gemm_schedule(p)
  total = s.tiles * s.split_k
  assert s.utilization == pytest.approx(total / (math.ceil(total / H200.sms) * H200.sms))
  if p.M * p.N >= 2048 * 2048: assert s.utilization >= 0.9, s
  if total >= H200.sms: assert s.grid == (H200.sms * C.occupancy(s.smem, s.block_warps, H200),), s


@pytest.mark.parametrize("name,p", ALL, ids=IDS)
def test_split_k_only_for_small_outputs_with_long_k(name, p):
  s = gemm_schedule(p)
  if s.split_k > 1: assert s.tiles < H200.sms and p.K > 2 * C.SPLIT_MIN_KTILES * s.BK, s
  if name.startswith(("fwd", "dX")) or p.K <= 1024: assert s.split_k == 1, s
  if name.startswith("dW") and p.M * p.N <= 3072 * 768:
    assert s.split_k > 1, s  # 768x768 .. 3072x768, K = 16384
  assert math.ceil(math.ceil(p.K / s.BK) / s.split_k) * (s.split_k - 1) < math.ceil(p.K / s.BK)  # no empty slice


def test_a_callers_copy_decides_which_operand_arrives_rounded():
  """The GEMM host copies first and passes `copied`: the schedule then rounds in the kernel exactly the B no copy
  rounded, never deciding a second copy on the copy's layout."""
  swapped = GemmProblem(768, 3072, T, 1, 4, 4, "tf32", True, False, copied="a")  # dW: A copied, then swapped
  s = gemm_schedule(swapped)
  assert (s.copy, s.swap, s.round_b) == ("a", True, False)  # the kernel's B is A's rounded copy
  assert gemm_schedule(GemmProblem(16384, 768, 768, 1, 4, 4, "tf32", True, True, copied="")).round_b  # none copied
  assert gemm_schedule(GemmProblem(16384, 768, 768, 1, 4, 4, "tf32", True, True)).copy == "b"  # None: decided here


def test_tf32_split_k_through_tma_keeps_two_stages():
  """3 stages of a split TF32 TMA kernel gave wrong sums on the H200 (see gemm_schedule); split ones keep 2 unless
  warp-specialized (measured right at 4 stages of BK = 16)."""
  for p in (GemmProblem(512, 512, 8192, 1, 4, 4, "tf32"), GemmProblem(3072, 766, T, 1, 4, 4, "tf32", False, True)):
    s = gemm_schedule(p)
    assert s.persistent and s.split_k > 1 and not s.warp_specialize and s.num_stages == 2, s
  s = gemm_schedule(GemmProblem(3072, 768, T, 1, 4, 4, "tf32", False, True))
  assert s.split_k > 1 and s.warp_specialize and (s.BK, s.num_stages) == (16, 4), s
  assert gemm_schedule(GemmProblem(3072, 768, T, 1, 2, 2, "", False, True)).num_stages > 2  # bf16 is unaffected


def test_tma_stores_and_warp_specialization():
  """The tile leaves by TMA when its destination allows (C row-major and aligned in the kernel's orientation, or
  split-K's float32 workspace with N a multiple of 4); TF32 128x256 kernels stored by TMA that round A in registers
  and read B as a rounded copy run warp-specialized (a producer and two consumer warpgroups of 4 warps), nothing
  else does."""
  problems = dict(gpt2_problems(4, "tf32"))
  fwd, dx, dw = (gemm_schedule(problems[name]) for name in ("fwd 768x768", "dX 2304x768", "dW 2304x768"))
  for s in (fwd, dx, dw):
    assert s.tma_store and s.warp_specialize and (s.num_warps, s.mma_warps, s.block_warps) == (4, 8, 12), s
    assert not s.epi_subtile and (s.BK, s.num_stages) == (16, 4) and s.copy == "b", s  # `pipeline_bk`
  assert dw.split_k > 1  # split-K's partial sums leave by TMA: warp-specialized too
  assert not gemm_schedule(GemmProblem(T, 2304, 768, 1, 4, 4, "tf32", c_layout="")).warp_specialize  # pointer stores
  assert gemm_schedule(GemmProblem(T, 2304, 768, 1, 4, 4, "tf32", c_layout="m")).tma_store is False
  swapped = gemm_schedule(GemmProblem(1024, 1024, 4096, 1, 4, 4, "tf32", True, False, c_layout="m"))
  assert swapped.swap and swapped.round_b and swapped.tma_store and not swapped.warp_specialize  # B rounded in-kernel
  odd = gemm_schedule(GemmProblem(768, 766, T, 1, 2, 2, "", False, False))
  assert odd.split_k > 1 and not odd.tma_store  # 766 float32 columns: rows of the workspace not 16-byte aligned
  for _, p in ALL:
    s = gemm_schedule(p)
    assert s.warp_specialize == (p.precision == "tf32" and (s.BM, s.BN) == (128, 256) and s.tma_store and
                                 s.round_a and not s.round_b), s
  both = gemm_schedule(problems["fwd 2304x768"])  # both operands copied: wgmma reads them from shared memory
  assert both.copy == "ab" and not (both.round_a or both.round_b or both.warp_specialize), both
  assert not any(gemm_schedule(p).warp_specialize for _, p in gpt2_problems(4, "tf32x3"))


def test_tf32_layout_decisions():
  """Only TF32 copies, swaps or rounds B: a K-major B for wgmma; B rounded always, by a copy when that costs less
  than rounding in the kernel (M >= 1.9K); dW (both MN-major) copies its smaller operand; 16-bit and 3xTF32 problems
  run as given."""
  fwd, dx, dw = (p for _, p in list(gpt2_problems(4, "tf32"))[:3])
  assert [gemm_schedule(p).copy for p in (fwd, dx, dw)] == ["ab", "b", "b"]  # A's copy pays from N = 2.2K
  s = gemm_schedule(GemmProblem(768, 3072, T, 1, 4, 4, "tf32", False, False))
  assert s.copy == "a" and s.swap and (s.a_kmajor, s.b_kmajor) == (False, True)
  s = gemm_schedule(GemmProblem(1024, 1024, 4096, 1, 4, 4, "tf32", True, False))  # too few rows to copy B
  assert s.copy == "" and s.swap and (s.a_kmajor, s.b_kmajor) == (False, True) and s.round_a and s.round_b
  s = gemm_schedule(GemmProblem(4096, 1024, 4096, 1, 4, 4, "tf32", True, False))  # too few columns to copy A
  assert s.copy == "b" and not s.swap and s.round_a and not s.round_b
  s = gemm_schedule(GemmProblem(4096, 4096, 4096, 1, 4, 4, "tf32", True, False))
  assert s.copy == "ab" and not s.swap and not s.round_a and not s.round_b
  for p in (GemmProblem(4096, 4096, 4096, 1, 2, 2, "", True, False), GemmProblem(768, 768, T, 1, 2, 2, "", False, False),
            GemmProblem(4096, 4096, 4096, 1, 4, 4, "tf32x3", True, False)):
    s = gemm_schedule(p)
    assert (s.copy, s.swap, s.round_a, s.round_b, s.a_kmajor, s.b_kmajor) == ("", False, False, False, p.a_kmajor,
                                                                              p.b_kmajor)
  assert C.orientation("tf32", True, False) and not C.orientation("tf32", False, True)
  assert C.operand_copy("tf32", 1900, 768, True, True) == "b" and C.operand_copy("tf32", 1850, 768, True, True) == ""
  assert C.operand_copy("tf32", 768, 2200, True, True) == "a" and C.operand_copy("tf32", 768, 2100, True, True) == ""
  assert C.operand_copy("tf32", 1900, 2200, True, True) == "ab" and C.operand_copy("", 1900, 2200, True, True) == ""
  assert C.operand_copy("tf32", 100, 200, False, False) == "a" and C.operand_copy("tf32", 300, 200, False, False) == "b"


def test_formulas_at_hand_computed_points():
  assert C.intensity(16384, 2304, 768, 2) == pytest.approx(2 * 16384 * 2304 * 768 / ((16384 * 768 + 768 * 2304 + 16384 * 2304) * 2))
  assert C.tile_intensity(128, 256) == pytest.approx(2 * 128 * 256 / 384) and C.tile_intensity(128, 128) == 128
  assert C.utilization(132, 132) == 1 and C.utilization(133, 132) == pytest.approx(133 / 264)
  assert C.gemm_warps(128, 256) == 8 and C.gemm_warps(128, 128) == 4 and C.gemm_warps(64, 64) == 4
  assert C.gemm_warps(128, 256, "tf32x3") == 16
  assert C.group_m(128, 256, 1000, H200) == 16 and C.group_m(128, 128, 1000, H200) == 11 and C.group_m(128, 256, 3, H200) == 3
  assert C.split_cost(1, 16384, 1e15, H200) == 0 and C.split_cost(4, 16384, 1e15, H200) == pytest.approx(16e15 / (16384 * 4.8e12))
  # stages: persistent bf16 128x256x64 with a bf16 output: 4 with the epilogue in halves; TF32 with a float32 output: 3
  assert C.gemm_stages(128, 256, 64, 2, 2, True, H200) == (4, True)
  assert C.gemm_stages(128, 256, 32, 4, 4, True, H200) == (3, True)
  assert C.gemm_stages(128, 256, 64, 2, 2, False, H200) == (4, False)  # one tile per program: buffers reused
  assert C.gemm_smem(128, 256, 64, 3, 2, 2, True, False) == 3 * 384 * 64 * 2 + 128 * 256 * 2 + C.SMEM_BARRIERS
  bf16 = gemm_schedule(GemmProblem(T, 2304, 768))
  assert (bf16.BM, bf16.BN, bf16.BK, bf16.num_warps, bf16.num_stages, bf16.group_m) == (128, 256, 64, 8, 4, 16)
  tf32 = gemm_schedule(GemmProblem(T, 2304, 768, 1, 4, 4, "tf32"))
  assert (tf32.BM, tf32.BN, tf32.BK, tf32.num_warps, tf32.num_stages, tf32.epi_subtile) == (128, 256, 32, 8, 3, True)
  assert C.pipeline_bk(32, True) == 16 and C.pipeline_bk(64, False) == 64
  ws = gemm_schedule(GemmProblem(T, 768, 768, 1, 4, 4, "tf32"))  # A rounded in registers: warp-specialized
  assert (ws.BM, ws.BN, ws.BK, ws.mma_warps, ws.block_warps, ws.num_stages, ws.epi_subtile) == \
    (128, 256, 16, 8, 12, 4, False)  # DESIGN.md's best tile: a whole epilogue, 4 stages of BK 16
  assert not bf16.warp_specialize and not tf32.warp_specialize and ws.warp_specialize and ws.num_warps == 4
  small = gemm_schedule(GemmProblem(1024, 1024, 1024))
  assert (small.BM, small.BN, small.tiles) == (64, 128, 128)  # 128 tiles: one wave instead of 32 big tiles


def test_batched_and_unaligned_problems_get_a_tile_grid():
  s = gemm_schedule(GemmProblem(128, 64, 4096, 8, 2, 2, "", True, True, tma=False))
  assert not s.persistent and s.grid == (s.tiles, s.split_k, 8) and s.tiles * s.split_k * 8 >= H200.sms // 2
  s = gemm_schedule(GemmProblem(100, 100, 100, 1, 2, 2, "", True, True, tma=False))
  assert not s.persistent and s.grid == (s.tiles, 1, 1) and s.smem <= H200.smem_per_block


@given(st.integers(1, 70000), st.integers(1, 70000), st.integers(0, 70000), st.integers(1, 64),
       st.sampled_from([(4, "tf32"), (4, "tf32x3"), (2, "")]), st.booleans(), st.booleans(), st.booleans())
def test_any_problem_gets_a_valid_deterministic_schedule(M, N, K, batch, dt, a_k, b_k, tma):
  p = GemmProblem(M, N, K, batch, dt[0], dt[0], dt[1], a_k, b_k, tma)
  s = gemm_schedule(p)
  assert s == gemm_schedule(p)  # a pure function
  assert s.smem <= H200.smem_per_block - C.SMEM_RESERVE and s.num_stages >= 2 and 1 <= s.split_k <= C.MAX_SPLIT
  assert s.persistent == (tma and batch == 1) and 0 < s.utilization <= 1 and 1 <= s.group_m
  assert all(0 < g for g in s.grid) and (s.grid[0] <= s.tiles * s.split_k)


def test_hardware_defaults_without_a_gpu():
  from blutrain.backend.cuda.runtime import hardware
  assert hardware() == H200 or hardware().name != H200.name  # a GPU machine reads its own
  assert H200.sms == 132 and H200.smem_per_block == 227 * 1024


def test_reduction_and_elementwise_schedules():
  assert C.flat_schedule(10**8, 4) == (4096, 8) and C.flat_schedule(10**4, 4) == (512, 4)
  assert C.flat_schedule(10**8, 2) == (8192, 8)
  assert C.tile_schedule(4096, 768) == (16, 256, 8) and C.tile_schedule(10, 7) == (512, 8, 8)
  assert C.reduce_schedule(16384, 768, False) == (4, 1024, 8) and C.reduce_schedule(1, 10**6, False) == (1, 4096, 8)
  assert C.reduce_schedule(768, 16384, True) == (256, 16, 8)
  assert C.split_rule(1, 10**7, 1024) == 2 * H200.sms and C.split_rule(1000, 10**7, 1024) == 1
  assert C.row_schedule(16384, 768) == (4, 1024, 8, True) and C.row_schedule(8, 50304) == (1, 4096, 8, False)
  assert C.index_schedule(16384, 768) == (4, 512, 4)
  gpt2 = C.norm_backward_schedule(16384, 768, H200.sms)  # 256 programs of 64 rows (the rows' tiles split evenly)
  assert gpt2 == (4, 1024, 4, True, 64, 3)
  long_rows = C.norm_backward_schedule(8, 50304, H200.sms)
  assert long_rows.rows == 1 and long_rows.stages == 1 and not long_rows.one_pass
  assert C.copy_schedule(16384, 768) == (64, 64, 4) and C.copy_schedule(5, 3) == (16, 16, 4)
  assert C.multi_tensor_schedule(4) == C.multi_tensor_schedule(1) == (4096, 8) and C.multi_tensor_schedule(6)[0] == 2048


def test_conv_schedules():
  """ResNet's 3x3 64-channel layer at 56x56, batch 128, in bf16; the channels-last tiles stop at a kernel position."""
  M, K = 128 * 56 * 56, 64 * 9
  assert C.conv_schedule(M, 64, K, 2) == (128, 64, 64, 4, 4, 1) == C.conv_schedule(M, 64, K, 2, k_run=64)
  assert C.conv_schedule(M, 64, K, 2, k_run=16)[2] == 16 and C.conv_schedule(M, 64, K, 4, k_run=48)[2] == 32
  assert C.conv_schedule(64, K, M, 2)[:2] == (64, 128) and C.conv_schedule(64, K, M, 2, n_run=64)[:2] == (64, 64)
  for M, N, K, item, k_run, n_run in ((M, 64, K, 2, 0, 0), (64, K, M, 2, 0, 64), (M, 48, 48 * 9, 4, 48, 0),
                                      (16, 144, 10**6, 2, 0, 16), (10, 3, 27, 8, 0, 0)):
    bm, bn, bk, warps, stages, split = C.conv_schedule(M, N, K, item, H200, k_run, n_run)
    assert (bm + bn) * bk * item * stages <= H200.smem_per_block and bk >= 16 and warps in (4, 8)
    assert bk <= max(16, k_run or K) * 2 and (not n_run or bn < 2 * n_run)
    assert split == 1 or cdiv(cdiv(K, bk), split) >= 8  # each part at least 8 steps


def test_kernel_library_takes_its_schedules_from_the_configurator():
  """One place per decision: the CUDA kernels' schedule functions are the configurator's."""
  K = "blutrain.backend.cuda.kernels"
  mods = {n: importlib.import_module(f"{K}.{n}")
          for n in ("elementwise", "reduce", "norm", "index", "attention", "random", "optim")}
  assert mods["elementwise"].flat_schedule is C.flat_schedule and mods["elementwise"].tile_schedule is C.tile_schedule
  assert mods["random"].flat_schedule is C.flat_schedule
  assert mods["reduce"].reduce_schedule is C.reduce_schedule and mods["reduce"].split_rule is C.split_rule
  assert mods["norm"].row_schedule is C.row_schedule and mods["index"].index_schedule is C.index_schedule
  assert mods["attention"].attention_schedule is C.attention_schedule
  assert mods["optim"].multi_tensor_schedule is C.multi_tensor_schedule and mods["optim"].CHUNK == C.MULTI_TENSOR_CHUNK


def test_smem_model_bounds_what_triton_allocates(tmp_path, monkeypatch):
  """The largest schedules, compiled for sm_90 (no GPU): Triton's shared memory stays within the model and the
  H200's 227 KiB, also for 3xTF32, whose operand splits Triton stages in shared memory of their own."""
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path))
  G = importlib.import_module("blutrain.backend.cuda.kernels.gemm")
  from blutrain.backend.cuda import launch
  from blutrain import dtypes
  from blutrain.backend.cuda.array import CudaArray

  def planned(a_shape, b_shape, dtype, prec, b_t=True):
    a = CudaArray(1 << 20, a_shape, (a_shape[1], 1), dtype, 0, None)
    b = CudaArray(1 << 20, b_shape, (1, b_shape[0]) if b_t else (b_shape[1], 1), dtype, 0, None)
    return G.plan(a, b, CudaArray(1 << 20, (a_shape[0], b_shape[1]), (b_shape[1], 1), dtype, 0, None), precision=prec)

  for p in (planned((T, 768), (768, 2304), dtypes.bfloat16, ""), planned((T, 768), (768, 2304), dtypes.float32, "tf32"),
            planned((T, 768), (768, 2304), dtypes.float32, "tf32x3")):
    (fn, sig, consts, opts), _, _ = p.launches[0]
    c = launch.compiled(fn, sig, consts, opts["num_warps"], opts["num_stages"])
    assert c.shared <= p.schedule.smem <= H200.smem_per_block - C.SMEM_RESERVE, (c.shared, p.schedule)
