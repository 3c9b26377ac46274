"""Synthesized GEMMs (kernels/gemm/) on the CPU (no GPU: fake device addresses, nothing launched): the generated
Triton source of each structure, its dump, the structure and arguments the host plans for each layout (persistent TMA vs pointer
kernels, split-K, the TF32 K-major copy and swapped orientation, batch folding, host loops, int64 offsets, K = 0),
the variants CI compiles, and the `bt.backends.matmul` and `bt.backends.conv` switches. The kernels themselves run in
tests/cuda/test_gemm.py; every variant compiles for sm_90 in tests/test_cuda_kernels_compile.py."""
import importlib
import os
import subprocess
import sys

import pytest

import blutrain as bt
from blutrain import dtypes
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels.matrix import transposed
from blutrain.shapes import contiguous_strides

G = importlib.import_module("blutrain.backend.cuda.kernels.gemm")
S = importlib.import_module("blutrain.backend.cuda.kernels.gemm.source")
f32, bf16, f16 = dtypes.float32, dtypes.bfloat16, dtypes.float16
T = 16384


def arr(shape, dtype, mode="n", ptr=1 << 20) -> CudaArray:
  """A matrix (batch) at a fake address: "n" row-major, "t" stored transposed, "odd" rows padded by one element."""
  shape = tuple(shape)
  if mode == "t": return transposed(arr(shape[:-2] + shape[-2:][::-1], dtype, ptr=ptr))
  if mode == "odd": return CudaArray(ptr, shape, contiguous_strides(shape[:-1] + (shape[-1] + 1,)), dtype, 0, None)
  return CudaArray(ptr, shape, contiguous_strides(shape), dtype, 0, None)


def planned(a, b, prec="", out_dtype=None, **kw):
  shape = tuple(max(x, y) for x, y in zip((1,) * (b.ndim - a.ndim) + a.shape[:-2], (1,) * (a.ndim - b.ndim) + b.shape[:-2]))
  out = kw.pop("out", None) or arr(shape + (a.shape[-2], b.shape[-1]), out_dtype or a.dtype)
  return G.plan(a, b, out, kw.get("bias"), tuple(kw.get("aux", ())), tuple(kw.get("epilogue", ())), prec)


def ints(plan, i=0) -> dict:
  """The scalar arguments of a plan's i-th launch by parameter name."""
  (fn, _, _, _), _, args = plan.launches[i]
  names = [n for n in fn.arg_names if n not in S.CONSTEXPRS]
  return {n: a[1] for n, a in zip(names, args) if a[0] == "i"}


# *** source ***

def test_sources_read_like_kernels_and_are_dumped(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_DUMP_IR", str(tmp_path))
  st = S.Structure("tma", "fp32", "bf16", "tf32", True, True, True, False, "n", ("scale", "bias", "gelu", "residual"),
                   aux=("n",), epi_types=("fp32", "bf16"))
  text = S.source(st)
  main, reduce = S.jit_functions(st)
  assert reduce is None and main.arg_names[:5] == ["A", "B", "C", "BIAS", "R1"]
  assert "tl.make_tensor_descriptor(A, [M, K], [LDA, 1], [BM, BK])" in text and "warp_specialize=WARP_SPEC" in text
  assert "tl.store(C + rm[:, None] * LDC + rn[None, :]" in text and "c_desc" not in text
  assert "c_desc.store([pid_m * BM, pid_n * BN + BN // 2]" in S.source(S.Structure("tma", "bf16", "bf16", "", True, True,
                                                                                      tma_store=True))
  assert "a = round_tf32(a)" in text and 'input_precision="tf32"' in text and "acc.to(tl.bfloat16)" in text
  assert "b = round_tf32(b)" not in text
  epi = text[text.index("_epilogue("):text.index(f"def {st.name}(")]
  assert epi.index("ALPHA") < epi.index("BIAS + rn") < epi.index("gelu(acc, False)") < epi.index("R1 +")
  assert (tmp_path / f"{st.name}.py").read_text() == text
  ptr = S.Structure("ptr", "bf16", "bf16", "", False, False, c_unit="m", epilogue=("gelu_backward_tanh",), aux=("",),
                    epi_types=("fp32",), split=True, batched=True, i64=True)
  text = S.source(ptr)
  assert "tl.load(a_ptrs" in text and "make_tensor_descriptor" not in text and "ra = ra.to(tl.int64)" in text
  assert "store_partial(acc" in text and f"def {ptr.name}_reduce(" in text and "for s in range(SPLITS)" in text
  assert "gelu_backward(acc, tl.load(X1 + rm[:, None] * LDX1M + rn[None, :] * LDX1N" in text
  assert "input_precision" not in text and S.jit_functions(ptr)[1] is not None


def test_structures_are_checked():
  with pytest.raises(ValueError, match="unknown epilogue ops \\['relu'\\]"):
    S.Structure("tma", "bf16", "bf16", "", True, True, epilogue=("relu",))
  with pytest.raises(ValueError, match="reads 1 tensors"):
    S.Structure("tma", "bf16", "bf16", "", True, True, epilogue=("residual",), epi_types=("bf16",))


# *** plans ***

def test_gpt2_bf16_runs_persistent_tma_kernels_as_stored():
  for a, b in ((arr((T, 768), bf16), arr((768, 2304), bf16, "t")),      # y = x W^T
               (arr((T, 2304), bf16), arr((2304, 768), bf16)),           # dx = dy W
               (arr((2304, T), bf16, "t"), arr((T, 768), bf16))):        # dW = dy^T x
    p = planned(a, b)
    assert p.structure.kind == "tma" and not p.copy and not p.schedule.swap and p.steps == 1, p.structure
    assert (p.structure.a_kmajor, p.structure.b_kmajor) == (a.strides[-1] == 1, b.strides[-2] == 1)
    assert all(sig.endswith(":16") for name, sig in p.launches[0][0][1].items() if name in ("A", "B", "LDA", "M"))
    assert p.structure.tma_store  # a row-major output leaves by TMA too, and so do split-K's partial sums
  p = planned(arr((2304, T), bf16, "t"), arr((T, 768), bf16))
  assert p.schedule.split_k > 1 and len(p.launches) == 2 and p.workspace == (p.schedule.split_k, 1, 2304, 768)
  assert "c_desc = tl.make_tensor_descriptor(C, [SPLIT_K * WM, N], [N, 1]" in S.source(p.structure)
  p = planned(arr((2296, T), bf16, "t"), arr((T, 768), bf16))  # partials by TMA: slices of whole tile rows
  assert p.workspace == (p.schedule.split_k, 1, 2304, 768) and ints(p, 1)["WM"] == 2304 and ints(p, 1)["M"] == 2296
  assert ints(p)["K_TILES"] * p.schedule.split_k >= T // 64 and ints(p, 1)["SPLITS"] == p.schedule.split_k


def test_tf32_copies_and_swaps_for_a_kmajor_b():
  p = planned(arr((T, 768), f32), arr((768, 768), f32, "t"), "tf32")          # B copied (and rounded)
  assert p.copy == "b" and p.structure.b_kmajor and p.structure.round_a and not p.structure.round_b
  assert not p.schedule.swap and p.schedule.warp_specialize
  p = planned(arr((T, 768), f32), arr((768, 2304), f32, "t"), "tf32")         # A too: 2304 columns pay for it
  assert p.copy == "ab" and not (p.structure.round_a or p.structure.round_b or p.schedule.warp_specialize)
  assert [sp[0].__name__ for sp, _, _ in p.launches] == [p.structure.name]  # the copies are queued by Plan.launch
  p = planned(arr((T, 2304), f32), arr((2304, 768), f32), "tf32")             # an N-major B: its copy is K-major
  assert p.copy == "b" and (p.structure.a_kmajor, p.structure.b_kmajor) == (True, True)
  p = planned(arr((768, T), f32, "t"), arr((T, 3072), f32), "tf32")           # dW: the smaller operand, then a swap
  assert p.copy == "a" and p.schedule.swap and (p.structure.a_kmajor, p.structure.b_kmajor) == (False, True)
  assert not p.structure.round_b  # the kernel's B is the rounded copy of A: rounding it again would cost 22%
  p = planned(arr((1024, 1024), f32), arr((1024, 1024), f32), "tf32", epilogue=("bias",), bias=arr((1024,), f32))
  assert not p.copy and p.schedule.swap and p.structure.bias_along_m and p.structure.c_unit == "m"
  assert p.structure.round_b and "b = round_tf32(b)" in S.source(p.structure)  # no copy rounded B: the kernel does
  assert not p.structure.tma_store  # C^T is column-major: pointer stores
  assert ints(p)["LDC"] == 1024
  p = planned(arr((2048, 2048), f32), arr((2048, 2048), f32), "tf32x3")
  assert not p.copy and not p.schedule.swap and not p.structure.round_a


def test_batches_fold_loop_and_broadcast():
  p = planned(arr((4, 33, 64), bf16), arr((64, 16), bf16))                   # a shared weight: one GEMM of 132 rows
  assert ints(p)["M"] == 132 and p.steps == 1 and not p.structure.batched
  p = planned(arr((8, 128, 4096), bf16), arr((8, 4096, 64), bf16))           # a batch: pointer kernels
  assert p.structure.kind == "ptr" and p.structure.batched and p.launches[0][1][2] == 8
  assert ints(p)["SAZ"] == 128 * 4096 and ints(p)["SBZ"] == 4096 * 64
  p = planned(arr((2, 3, 9, 16), bf16), arr((3, 16, 5), bf16, "t"))          # broadcast outer dim: a host loop
  assert p.steps == 2 and p.launches[0][1][2] == 3 and ints(p)["SBZ"] == 16 * 5
  a = CudaArray(1 << 20, (6, 5, 8), (0, 8, 1), bf16, 0, None)               # an expanded A: batch stride 0
  p = planned(a, arr((6, 8, 16), bf16))
  assert ints(p)["SAZ"] == 0 and p.structure.batched


def test_misaligned_int64_empty_and_strided_outputs():
  p = planned(arr((200, 1000), bf16, "odd"), arr((1000, 300), bf16))
  assert p.structure.kind == "ptr" and not any(sig.endswith(":16") for sig in p.launches[0][0][1].values())
  assert planned(arr((65536, 768), bf16), arr((768, 50304), bf16, "t")).structure.i64
  p = planned(arr((64, 0), f32), arr((0, 64), f32), "tf32", epilogue=("bias",), bias=arr((64,), f32))
  assert len(p.launches) == 1 and ints(p)["SPLITS"] == 0 and p.workspace is None  # the reduction alone: the bias
  out = transposed(arr((96, 80), bf16))
  assert planned(arr((80, 64), bf16), arr((64, 96), bf16), out=out).structure.c_unit == "m"


def test_plan_refuses_mismatched_shapes():
  with pytest.raises(ValueError, match="cannot contract"):
    planned(arr((8, 5), bf16), arr((6, 3), bf16))


def test_ci_variants_cover_every_structure():
  specs = G.SPECS
  names = {s[0].__name__ for s in specs}
  assert "_rowmajor_kernel" in names and any(n.endswith("_reduce") for n in names)
  structures = [st for st in S._functions if any(s[0] is S.jit_functions(st)[0] for s in specs)]
  assert {st.kind for st in structures} == {"tma", "ptr"} and {st.precision for st in structures} == {"", "tf32", "tf32x3"}
  assert {st.dtype for st in structures} == {"fp32", "bf16", "fp16"} and any(st.i64 for st in structures)
  assert set(G.EPILOGUE) <= {op for st in structures for op in st.epilogue}
  assert any(st.split and st.batched for st in structures) and any(st.bias_along_m for st in structures)
  assert any(st.tma_store for st in structures) and any(st.kind == "tma" and not st.tma_store for st in structures)
  assert {s[2].get("WARP_SPEC") for s in specs if s[0].__name__.startswith("gemm_")} >= {True, False}


# *** the switch ***

@pytest.mark.parametrize("name, bad", [("matmul", "magma"), ("conv", "winograd")])
def test_backends_switches(name, bad):
  """`bt.backends.matmul` and `bt.backends.conv` take their choices only, and their environment variables set them."""
  choices = getattr(bt.backends, name.upper())
  assert getattr(bt.backends, name) in choices
  before = getattr(bt.backends, name)
  try:
    setattr(bt.backends, name, "triton")
    assert getattr(bt.backends, name) == "triton"
    with pytest.raises(ValueError, match=f"bt.backends.{name}: expected one of {', '.join(map(repr, choices))}"):
      setattr(bt.backends, name, bad)
  finally:
    setattr(bt.backends, name, before)
  env = dict(os.environ, **{f"BLUTRAIN_{name.upper()}": "triton"})
  out = subprocess.run([sys.executable, "-c", f"import blutrain as bt; print(bt.backends.{name})"], env=env,
                       capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "triton"
