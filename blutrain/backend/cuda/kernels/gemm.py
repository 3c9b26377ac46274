"""GEMM synthesis: `C = epilogue(A @ B)` as Triton source generated per structure, scheduled by Nova's Analytic
Configurator (blutrain/configurator.py) and compiled through `launch`, with no autotuning.

A `Structure` says what a kernel is: operand and output types, the dot's input precision ("tf32", "tf32x3" for
float32; 16-bit operands multiply in their own type), each operand's layout (K-major or not), which of the output's
strides is the unit one, the epilogue ops in order, and the kernel kind:

- "tma": persistent (a program per SM walks tiles in L2-friendly groups of GROUP_M tile rows), operands read by TMA
  descriptors built once per program (tl.make_tensor_descriptor; the launcher provides their global scratch). Out of
  bounds reads return zeros, so no load is masked. With WARP_SPEC (the configurator's `warp_specialized`) the tile
  loop is warp-specialized: Triton gives the loads a producer warpgroup and splits the tile's rows between two
  consumer warpgroups. Needs 16-byte aligned bases and row strides and no batch. A
  row-major, aligned output is stored by a descriptor too (`tma_store`), and so are split-K's partial sums.
- "ptr": one program per (tile, split, batch entry), operands read by pointers with any row stride: batched,
  broadcast (batch stride 0) and misaligned operands.

With `split`, programs cover K in SPLIT_K slices and store float32 partial sums; a second generated kernel adds them
and runs the epilogue (also the K = 0 case, with no slices). The epilogue works on the float32 accumulator: `scale`
(times alpha), `bias` (a vector along N, or along M when the problem was transposed), `gelu`/`gelu_tanh`,
`residual` (+ a tensor of C's shape), `gelu_backward`/`gelu_backward_tanh` (times gelu'(x) of a saved tensor), then
the cast to the output type. GELU's math is the elementwise kernels' (`_gelu`, `_gelu_backward`).

TF32: tensor cores truncate float32 operands; the kernels round the register operand A to nearest, and B is rounded
by the K-major copy the configurator asks for when it is cheap (`configurator.operand_copy`). Source of every kernel:
`source(structure)`, and with $BLUTRAIN_DUMP_IR each generated kernel is written there as gemm_<key>.py.

Host side: `gemm(a, b, ...)` takes CudaArrays whose last two dims have a unit stride in either dim (others are
copied), broadcasts batch dims (a shared B folds the batch into A's rows), and computes C^T = B^T A^T when the
configurator asks (TF32 wants a K-major B): operands, output and epilogue tensors are then transposed views.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import linecache
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import triton
import triton.language as tl

from blutrain import dtypes
from blutrain.backend.cuda import launch, runtime
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import (TY, Spec, broadcast_shape, broadcast_strides, cdiv, collapse,
                                           contiguous_strides, empty, needs_i64, run, spec)
from blutrain.backend.cuda.kernels.copy import copy
from blutrain.backend.cuda.kernels.elementwise import _gelu, _gelu_backward
from blutrain.backend.cuda.kernels.matmul import layout
from blutrain.dtypes import DType
from blutrain import configurator as cfg

EPILOGUE = ("scale", "bias", "gelu", "gelu_tanh", "residual", "gelu_backward", "gelu_backward_tanh")
_AUX = {"residual": "R", "gelu_backward": "X", "gelu_backward_tanh": "X"}  # ops reading a tensor of C's shape
PRECISIONS = ("tf32", "tf32x3")
DTYPES = (dtypes.float32, dtypes.bfloat16, dtypes.float16)


@triton.jit
def _round_tf32(x):
  """float32 rounded to the nearest TF32 (10 mantissa bits, ties away from zero, as cvt.rna.tf32.f32): add half a
  unit of the 13 dropped bits and clear them; infinities and NaNs pass unchanged."""
  bits = x.to(tl.int32, bitcast=True)
  r = ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)
  return tl.where((bits & 0x7F800000) == 0x7F800000, x, r)


@triton.jit
def _store_partial(acc, rm, rn, W, M, N, split):
  """Split-K: a slice's float32 partial sum into the (SPLIT_K, batch, M, N) workspace W, by pointers."""
  w = W + ((split * tl.num_programs(2) + tl.program_id(2)).to(tl.int64) * M + rm[:, None]) * N
  tl.store(w + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


# *** structure and source ***

@dataclass(frozen=True)
class Structure:
  """What a synthesized GEMM kernel is; equal structures share one kernel (its name is a hash of the fields).
  `aux` is, per tensor the epilogue reads (residual, gelu input): "n" (unit stride along N), "m" or "" (neither)."""
  kind: str                      # "tma" | "ptr"
  dtype: str                     # operands: "fp32", "bf16", "fp16"
  out: str                       # output type
  precision: str                 # "tf32" | "tf32x3" for fp32 operands, "" for 16-bit ones
  a_kmajor: bool
  b_kmajor: bool
  round_a: bool = False
  round_b: bool = False
  c_unit: str = "n"              # which of C's strides is 1
  epilogue: tuple[str, ...] = ()
  bias_along_m: bool = False
  aux: tuple[str, ...] = ()
  epi_types: tuple[str, ...] = ()  # element types of the epilogue's tensors, in order (bias first when present)
  split: bool = False
  tma_store: bool = False        # "tma" kernels store C (row-major, aligned) or split-K's partials by a TMA descriptor
  batched: bool = False          # "ptr" kernels: grid axis 2 runs over batch entries with batch strides
  i64: bool = False              # element offsets may pass 2^31

  def __post_init__(self):
    bad = [op for op in self.epilogue if op not in EPILOGUE]
    if bad: raise ValueError(f"gemm: unknown epilogue ops {bad}; expected some of {EPILOGUE}")
    n = sum(op in _AUX for op in self.epilogue)
    if len(self.aux) != n or len(self.epi_types) != n + ("bias" in self.epilogue):
      raise ValueError(f"gemm: {self.epilogue} reads {n} tensors (and a bias when listed), got layouts {self.aux} and "
                       f"types {self.epi_types}")

  @property
  def name(self) -> str:
    return "gemm_" + hashlib.blake2b(repr(self).encode(), digest_size=6).hexdigest()


def _aux_names(st: Structure) -> list[str]:
  """Pointer names of the epilogue's tensors in order: BIAS for the bias, R1/X1, R2/X2, ... for the others."""
  names, i = [], 0
  for op in st.epilogue:
    if op == "bias": names.append("BIAS")
    elif op in _AUX:
      i += 1
      names.append(f"{_AUX[op]}{i}")
  return names


def _offsets(unit: str, stride: str, rn: str = "rn") -> str:
  """Element offsets of the (rm, rn) tile in a matrix whose unit stride is along `unit` ("n", "m" or "")."""
  if unit == "n": return f"rm[:, None] * {stride} + {rn}[None, :]"
  if unit == "m": return f"rm[:, None] + {rn}[None, :] * {stride}"
  return f"rm[:, None] * {stride}M + {rn}[None, :] * {stride}N"


def _matrix_args(unit: str, stride: str) -> list[str]:
  return [stride] if unit else [f"{stride}M", f"{stride}N"]


def _params(st: Structure, main: bool) -> list[str]:
  """Runtime parameters of the main (`main`) or split-K reduction kernel, in order."""
  out = ["A", "B", "C"] if main else ["W", "C"]
  epi = not (main and st.split)
  aux = _aux_names(st) if epi else []
  out += aux + (["M", "N", "K", "LDA", "LDB"] if main else ["M", "N"])
  if epi:
    out += _matrix_args(st.c_unit, "LDC")
    for name, unit in zip([n for n in aux if n != "BIAS"], st.aux): out += _matrix_args(unit, "LD" + name)
    if "scale" in st.epilogue: out.append("ALPHA")
  out += (["K_TILES", "GROUP_M"] + (["SPLIT_K"] if st.split and st.kind == "tma" else [])) if main else ["SPLITS", "WM"]
  if st.batched:
    out += (["SAZ", "SBZ"] if main else []) + (["SCZ"] if epi else []) + [f"S{n}Z" for n in aux if n != "BIAS"]
  return out


def _epilogue_params(st: Structure) -> list[str]:
  """Parameters of the epilogue helper after (acc, rm, rn): the epilogue's tensors, sizes, their strides."""
  aux = _aux_names(st)
  out = aux + ["M", "N"]
  for name, unit in zip([n for n in aux if n != "BIAS"], st.aux): out += _matrix_args(unit, "LD" + name)
  return out + (["ALPHA"] if "scale" in st.epilogue else [])


def _epilogue_source(st: Structure) -> list[str]:
  """The helper finishing `acc` (rows rm, columns rn of C): the epilogue ops, then the cast to C's type."""
  lines = [f"def {st.name}_epilogue(acc, rm, rn, {', '.join(_epilogue_params(st))}):"]
  if st.aux: lines.append("  mask = (rm[:, None] < M) & (rn[None, :] < N)")
  aux = iter([n for n in _aux_names(st) if n != "BIAS"])
  units = iter(st.aux)
  for op in st.epilogue:
    if op == "scale": lines.append("  acc = acc * ALPHA")
    elif op == "bias":
      r, ax, bound = ("rm", "[:, None]", "M") if st.bias_along_m else ("rn", "[None, :]", "N")
      lines.append(f"  acc += tl.load(BIAS + {r}, mask={r} < {bound}, other=0.0).to(tl.float32){ax}")
    elif op in ("gelu", "gelu_tanh"): lines.append(f"  acc = _gelu(acc, {op == 'gelu_tanh'})")
    else:
      name = next(aux)
      x = f"tl.load({name} + {_offsets(next(units), 'LD' + name)}, mask=mask, other=0.0).to(tl.float32)"
      lines.append(f"  acc += {x}" if op == "residual" else f"  acc = _gelu_backward(acc, {x}, {op.endswith('tanh')})")
  lines.append(f"  return acc.to(tl.{_TL[st.out]})")
  return lines


def _store(st: Structure, acc: str, rn: str, split: str | None, col: str = "") -> str:
  """The statement storing a tile: the float32 partial sum of split-K slice `split`, or (None) the epilogue's
  result, by C's TMA descriptor at column `col` or by pointers."""
  if split is not None and st.tma_store: return f"c_desc.store([{split} * WM + pid_m * BM, {col}], {acc})"
  if split is not None: return f"_store_partial({acc}, rm, {rn}, C, M, N, {split})"
  value = f"{st.name}_epilogue({acc}, rm, {rn}, {', '.join(_epilogue_params(st))})"
  if st.tma_store and not st.split: return f"c_desc.store([pid_m * BM, {col}], {value})"
  mask = f"(rm[:, None] < M) & ({rn}[None, :] < N)"
  return f"tl.store(C + {_offsets(st.c_unit, 'LDC', rn)}, {value}, mask={mask})"


_TL = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _tile_index(indent: str, t: str) -> list[str]:
  """pid_m, pid_n of tile t in groups of GROUP_M tile rows (consecutive tiles share B columns within a group)."""
  return [indent + s for s in (f"first_m = {t} // per_group * GROUP_M",
                               "group_m = tl.minimum(tiles_m - first_m, GROUP_M)",
                               f"pid_m = first_m + {t} % per_group % group_m",
                               f"pid_n = {t} % per_group // group_m")]


def _dot(st: Structure, indent: str) -> list[str]:
  lines = []
  if st.round_a: lines.append("a = _round_tf32(a)")
  if st.round_b: lines.append("b = _round_tf32(b)")
  prec = f", input_precision=\"{st.precision}\"" if st.precision else ""
  lines.append(f"acc = tl.dot(a, b, acc{prec})")
  return [indent + line for line in lines]


def _tma_source(st: Structure) -> list[str]:
  sig = ", ".join(_params(st, True))
  a_desc = "[M, K], [LDA, 1], [BM, BK]" if st.a_kmajor else "[K, M], [LDA, 1], [BK, BM]"
  b_desc = "[N, K], [LDB, 1], [BN, BK]" if st.b_kmajor else "[K, N], [LDB, 1], [BK, BN]"
  a_load = "a_desc.load([pid_m * BM, kt * BK])" if st.a_kmajor else "a_desc.load([kt * BK, pid_m * BM]).T"
  b_load = "b_desc.load([pid_n * BN, kt * BK]).T" if st.b_kmajor else "b_desc.load([kt * BK, pid_n * BN])"
  src = [f"def {st.name}({sig},",
         "    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EPI_SUBTILE: tl.constexpr,"
         " WARP_SPEC: tl.constexpr):",
         f"  a_desc = tl.make_tensor_descriptor(A, {a_desc})",
         f"  b_desc = tl.make_tensor_descriptor(B, {b_desc})"]
  width = "BN // 2 if EPI_SUBTILE else BN"
  if st.tma_store and st.split:  # the float32 workspace: SPLIT_K slices of whole tile rows, (SPLIT_K, WM, N)
    src += ["  WM = tl.cdiv(M, BM) * BM",
            f"  c_desc = tl.make_tensor_descriptor(C, [SPLIT_K * WM, N], [N, 1], [BM, {width}])"]
  elif st.tma_store:
    src += [f"  c_desc = tl.make_tensor_descriptor(C, [M, N], [LDC, 1], [BM, {width}])"]
  src += [
         "  tiles_m = tl.cdiv(M, BM)",
         "  tiles_n = tl.cdiv(N, BN)",
         "  k_tiles = tl.cdiv(K, BK)",
         "  per_group = GROUP_M * tiles_n",
         f"  for tile in tl.range(tl.program_id(0), tiles_m * tiles_n{' * SPLIT_K' if st.split else ''}, tl.num_programs(0),"
         " flatten=not WARP_SPEC, warp_specialize=WARP_SPEC):"]
  if st.split:
    src += ["    split = tile // (tiles_m * tiles_n)", "    t = tile % (tiles_m * tiles_n)"]
    src += _tile_index("    ", "t")
    src += ["    k_lo = split * K_TILES", "    k_hi = tl.minimum(k_lo + K_TILES, k_tiles)"]
  else:
    src += _tile_index("    ", "tile")
    src += ["    k_lo = 0", "    k_hi = k_tiles"]
  src += ["    acc = tl.zeros([BM, BN], dtype=tl.float32)",
          "    for kt in range(k_lo, k_hi):",
          f"      a = {a_load}",
          f"      b = {b_load}"]
  src += _dot(st, "      ")
  i64 = ".to(tl.int64)" if st.i64 else ""
  split = "split" if st.split else None
  src += [f"    rm = (pid_m * BM + tl.arange(0, BM)){i64}",
          "    if EPI_SUBTILE:  # two halves of BN / 2 columns: half the shared memory for the output's layout change",
          "      acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))",
          f"      rn = (pid_n * BN + tl.arange(0, BN // 2)){i64}",
          f"      {_store(st, 'acc0', 'rn', split, 'pid_n * BN')}",
          f"      {_store(st, 'acc1', '(rn + BN // 2)', split, 'pid_n * BN + BN // 2')}",
          "    else:",
          f"      rn = (pid_n * BN + tl.arange(0, BN)){i64}",
          f"      {_store(st, 'acc', 'rn', split, 'pid_n * BN')}"]
  return src


def _ptr_source(st: Structure) -> list[str]:
  sig = ", ".join(_params(st, True))
  a_off = "ra[:, None] * LDA + rk[None, :]" if st.a_kmajor else "ra[:, None] + rk[None, :] * LDA"
  b_off = "rb[None, :] * LDB + rk[:, None]" if st.b_kmajor else "rb[None, :] + rk[:, None] * LDB"
  a_step, b_step = ("BK" if st.a_kmajor else "BK * LDA"), ("BK" if st.b_kmajor else "BK * LDB")
  src = [f"def {st.name}({sig},",
         "    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):",
         "  tiles_m = tl.cdiv(M, BM)",
         "  tiles_n = tl.cdiv(N, BN)",
         "  per_group = GROUP_M * tiles_n"]
  src += _tile_index("  ", "tl.program_id(0)")
  src += ["  rm = pid_m * BM + tl.arange(0, BM)",
          "  rn = pid_n * BN + tl.arange(0, BN)",
          "  rk = tl.arange(0, BK)",
          "  ra = tl.where(rm < M, rm, 0)  # rows past M (and columns past N) read row 0; they are never stored",
          "  rb = tl.where(rn < N, rn, 0)"]
  if st.i64: src += [f"  {r} = {r}.to(tl.int64)" for r in ("ra", "rb", "rm", "rn", "rk")]
  if st.batched:
    z = "tl.program_id(2).to(tl.int64)"
    src += [f"  A += {z} * SAZ", f"  B += {z} * SBZ"]
    if not st.split:
      src += [f"  C += {z} * SCZ"] + [f"  {n} += {z} * S{n}Z" for n in _aux_names(st) if n != "BIAS"]
  k_lo = ("split * K_TILES" + (".to(tl.int64)" if st.i64 else "")) if st.split else "0"
  if st.split: src += ["  split = tl.program_id(1)"]
  src += [f"  k_lo = {k_lo}",
          "  k_hi = tl.minimum(k_lo + K_TILES, tl.cdiv(K, BK))" if st.split else "  k_hi = tl.cdiv(K, BK)",
          f"  a_ptrs = A + {a_off} + k_lo * {a_step}",
          f"  b_ptrs = B + {b_off} + k_lo * {b_step}",
          "  acc = tl.zeros([BM, BN], dtype=tl.float32)",
          "  for kt in range(k_lo, k_hi):",
          "    if EVEN_K:",
          "      a = tl.load(a_ptrs)",
          "      b = tl.load(b_ptrs)",
          "    else:",
          "      a = tl.load(a_ptrs, mask=rk[None, :] < K - kt * BK, other=0.0)",
          "      b = tl.load(b_ptrs, mask=rk[:, None] < K - kt * BK, other=0.0)"]
  src += _dot(st, "    ")
  src += [f"    a_ptrs += {a_step}", f"    b_ptrs += {b_step}"]
  return src + ["  " + _store(st, "acc", "rn", "split" if st.split else None)]


def _reduce_source(st: Structure) -> list[str]:
  """Split-K's second kernel: acc = the sum of the SPLITS partial slices (of WM rows: M, or M rounded up to whole
  tiles where the partials were stored by TMA), then the epilogue."""
  sig = ", ".join(_params(st, False))
  src = [f"def {st.name}_reduce({sig},", "    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):",
         "  rm = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)",
         "  rn = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)"]
  if st.i64: src += ["  rm = rm.to(tl.int64)", "  rn = rn.to(tl.int64)"]
  if st.batched:
    z = "tl.program_id(2).to(tl.int64)"
    src += [f"  C += {z} * SCZ"] + [f"  {n} += {z} * S{n}Z" for n in _aux_names(st) if n != "BIAS"]
  src += ["  w = W + (tl.program_id(2).to(tl.int64) * WM + rm[:, None]) * N + rn[None, :]",
          "  slice_size = tl.num_programs(2).to(tl.int64) * WM * N",
          "  acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)",
          "  for s in range(SPLITS):",
          "    acc += tl.load(w + s * slice_size, mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0)"]
  return src + ["  " + _store(st, "acc", "rn", None)]


def source(st: Structure) -> str:
  """The Triton source of a structure's kernels (the main kernel, and the split-K reduction when `split`)."""
  head = (f"# {st}\n# generated by blutrain.backend.cuda.kernels.gemm; helpers _round_tf32, _gelu and _gelu_backward "
          f"are the library's\nimport triton\nimport triton.language as tl\n")
  main = _tma_source(st) if st.kind == "tma" else _ptr_source(st)
  fns = [_epilogue_source(st), main]
  if st.split: fns.append(_reduce_source(st))
  parts = ["@triton.jit\n" + "\n".join(f) + "\n" for f in fns]
  return head + "\n\n" + "\n\n".join(parts)


_jitted: dict[Structure, tuple[Any, Any]] = {}


def kernels(st: Structure) -> tuple[Any, Any]:
  """(main, reduce or None) JIT functions of a structure: its source executed as a module registered in linecache
  (Triton reads a kernel's source back with inspect), written to $BLUTRAIN_DUMP_IR when set."""
  hit = _jitted.get(st)
  if hit is not None: return hit
  text = source(st)
  filename = f"<nova-gemm {st.name}>"
  linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
  namespace: dict[str, Any] = {"_round_tf32": _round_tf32, "_gelu": _gelu, "_gelu_backward": _gelu_backward,
                               "_store_partial": _store_partial,
                               "__name__": f"blutrain_gemm_{st.name}"}
  exec(compile(text, filename, "exec"), namespace)  # noqa: S102 (generated from a Structure's fields)
  if dump := os.environ.get("BLUTRAIN_DUMP_IR"):
    Path(dump).mkdir(parents=True, exist_ok=True)
    (Path(dump) / f"{st.name}.py").write_text(text)
  hit = _jitted[st] = (namespace[st.name], namespace.get(f"{st.name}_reduce"))
  return hit


# *** variants ***

_CONSTS = ("BM", "BN", "BK", "EVEN_K", "EPI_SUBTILE", "WARP_SPEC", "BLOCK_R", "BLOCK_C")
_FREE = ("K_TILES", "SPLITS", "WM", "GROUP_M", "SPLIT_K")  # integer arguments with no divisibility promise


def _signature(st: Structure, fn, aligned: bool, partial: bool) -> dict[str, str]:
  """Types of a kernel's runtime parameters (`partial`: C is split-K's float32 workspace); `aligned` promises
  16-divisible pointers (the bias excepted), sizes and strides, which lets Triton vectorize."""
  div = ":16" if aligned else ""
  aux = dict(zip(_aux_names(st), st.epi_types))
  sig = {}
  for name in fn.arg_names:
    if name in _CONSTS: continue
    if name in ("A", "B"): sig[name] = f"*{st.dtype}{div}"
    elif name == "W" or name == "C" and partial: sig[name] = f"*fp32{div}"
    elif name == "C": sig[name] = f"*{st.out}{div}"
    elif name in aux: sig[name] = f"*{aux[name]}" + ("" if name == "BIAS" else div)
    elif name == "ALPHA": sig[name] = "fp32"
    elif name.endswith("Z"): sig[name] = f"i64{div}"
    else: sig[name] = "i32" if name in _FREE else f"i32{div}"
  return sig


def main_spec(st: Structure, s: cfg.GemmSchedule, aligned: bool, even_k: bool = True) -> Spec:
  """The main kernel's variant for a schedule (`even_k`: K is a multiple of BK, so "ptr" kernels need no K mask)."""
  fn = kernels(st)[0]
  consts = dict(BM=s.BM, BN=s.BN, BK=s.BK)
  if st.kind == "tma": consts |= {"EPI_SUBTILE": s.epi_subtile, "WARP_SPEC": s.warp_specialize}
  else: consts["EVEN_K"] = even_k
  return spec(fn, _signature(st, fn, aligned, st.split), consts, num_warps=s.num_warps, num_stages=s.num_stages)


def reduce_spec(st: Structure, M: int, N: int, aligned: bool) -> Spec:
  """The split-K reduction's variant: 2-D elementwise tiles over (M, N) from the configurator."""
  fn = kernels(st)[1]
  br, bc, warps = cfg.tile_schedule(M, N)
  return spec(fn, _signature(st, fn, aligned, False), dict(BLOCK_R=br, BLOCK_C=bc), num_warps=warps)


# *** operand layouts ***

@triton.jit
def _rowmajor_kernel(X, Y, R, C, LDX, SXZ, UNIT_R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                     ROUND: tl.constexpr):
  """Y[z] (R x C, row-major) = X[z], whose unit stride runs along R (UNIT_R; the column stride is LDX) or along C
  (the row stride is LDX): a transposing copy reads down the columns and writes along the rows, Triton turning the
  tile through shared memory. ROUND rounds float32 to TF32 on the way."""
  rr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
  rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
  z = tl.program_id(2).to(tl.int64)
  mask = (rr[:, None] < R) & (rc[None, :] < C)
  if UNIT_R:
    x = tl.load(X + z * SXZ + rr[:, None] + rc[None, :].to(tl.int64) * LDX, mask=mask)
  else:
    x = tl.load(X + z * SXZ + rr[:, None].to(tl.int64) * LDX + rc[None, :], mask=mask)
  if ROUND:
    x = _round_tf32(x)
  tl.store(Y + z * R * C + rr[:, None].to(tl.int64) * C + rc[None, :], x, mask=mask)


def rowmajor_spec(dtype: DType, rows: int, cols: int, unit_r: bool, round_tf32: bool) -> Spec:
  br, bc, warps = cfg.copy_schedule(rows, cols)
  return spec(_rowmajor_kernel, {"X": "*" + TY[dtype], "Y": "*" + TY[dtype], "R": "i32", "C": "i32", "LDX": "i32",
                                 "SXZ": "i64"}, dict(UNIT_R=unit_r, BLOCK_R=br, BLOCK_C=bc, ROUND=round_tf32),
              num_warps=warps)


def _rowmajor_layout(x: CudaArray) -> tuple[tuple[int, ...], int, int]:
  """(strides, batch size, batch stride) of x's row-major copy: broadcast batch dims (stride 0) stay broadcast, the
  others are stored in order, collapsed into one (a layout they do not collapse into is copied by `copy`, whole)."""
  keep = [d for d in range(x.ndim - 2) if x.strides[d] != 0 and x.shape[d] != 1]
  zs, (zst,) = collapse([x.shape[d] for d in keep], [x.strides[d] for d in keep])
  if len(zs) > 1 or zs[0] > 65535: return contiguous_strides(x.shape), 0, 0
  R, C = x.shape[-2:]
  strides, acc = [0] * (x.ndim - 2), R * C
  for d in reversed(keep):
    strides[d] = acc
    acc *= x.shape[d]
  return tuple(strides) + (C, 1), zs[0], zst[0]


def _rowmajor_spec_of(x: CudaArray, round_tf32: bool) -> Spec:
  """The copy kernel's variant for x: reading down its columns when their stride is the unit one."""
  R, C = x.shape[-2:]
  return rowmajor_spec(x.dtype, R, C, x.strides[-1] != 1 and C > 1, round_tf32)


def _rowmajor(x: CudaArray, round_tf32: bool) -> CudaArray:
  """A row-major copy of x (a unit stride in one of its last two dims), rounded to TF32 when asked."""
  strides, Z, sz = _rowmajor_layout(x)
  if not Z: return copy(x)
  R, C = x.shape[-2:]
  y = empty((Z * R * C,), x.dtype, x.device)
  s = _rowmajor_spec_of(x, round_tf32)
  unit_r = s[2]["UNIT_R"]
  run(s, (cdiv(R, s[2]["BLOCK_R"]), cdiv(C, s[2]["BLOCK_C"]), Z), x, y, R, C, x.strides[-1 if unit_r else -2], sz)
  return CudaArray(y.ptr, x.shape, strides, x.dtype, x.device, y.owner)


def _mT(x: CudaArray) -> CudaArray:
  return CudaArray(x.ptr, x.shape[:-2] + x.shape[-2:][::-1], x.strides[:-2] + x.strides[-2:][::-1], x.dtype, x.device,
                   x.owner)


def _ld(x: CudaArray, rowmajor: bool) -> int:
  """The leading stride of the matrix in x's last two dims read row-major (unit stride along its columns) or
  column-major; a dim of size 1 has no stride of its own, and the other's extent stands in for it."""
  (r, c), (s0, s1) = x.shape[-2:], x.strides[-2:]
  if rowmajor: return s0 if r > 1 else max(c, 1)
  return s1 if c > 1 else max(r, 1)


def _unit(x: CudaArray) -> tuple[str, list[int]]:
  """("n" | "m" | "", leading strides) of the matrix in x's last two dims as the epilogue addresses it."""
  (r, c), (sr, sc) = x.shape[-2:], x.strides[-2:]
  if sc == 1 or c == 1: return "n", [sr if r > 1 else max(c, 1)]
  if sr == 1 or r == 1: return "m", [sc if c > 1 else max(r, 1)]
  return "", [sr, sc]


# *** host side ***

def precision_of(dtype: DType, precision: str | None = None) -> str:
  """The dot's input precision for operands of `dtype`: for float32 `precision` when given, else "tf32x3"
  (float32-level error; a matmul op whose `tf32` attribute is set passes "tf32"); "" for 16-bit operands, which
  multiply in their own type."""
  if dtype is not dtypes.float32: return ""
  if precision is None: return "tf32x3"
  if precision not in PRECISIONS:
    raise ValueError(f"gemm: precision must be one of {PRECISIONS} for float32 operands, got {precision!r}")
  return precision


class _Plan:
  """The launches of one problem layout: (kernel, grid, arguments) where a pointer argument names the array it comes
  from ("a", "b", "out", "bias", "x0", "x1" for the epilogue's tensors, "ws" for split-K's workspace) with a byte
  offset per host-loop step; `copy` names the operands first copied K-major (the offsets are the copies')."""

  def __init__(self, copy: str, steps: int, launches: list, workspace: tuple[int, ...] | None,
               schedule: cfg.GemmSchedule, structure: Structure):
    self.copy, self.steps, self.launches, self.workspace = copy, steps, launches, workspace
    self.schedule, self.structure = schedule, structure

  @functools.cached_property
  def kernels(self) -> list[launch.Kernel]:
    """The launches' compiled kernels (compiled on first use: planning needs no compiler)."""
    return [sp.kernel for sp, _, _ in self.launches]


def _args(fn, ptrs: dict[str, tuple[str, list[int]]], ints: dict[str, int]) -> list[tuple]:
  """A kernel's runtime arguments in order: ("p", source, offsets) for pointers, ("i", value) or ("alpha",)."""
  out = []
  for name in fn.arg_names:
    if name in _CONSTS: continue
    if name in ptrs: out.append(("p",) + ptrs[name])
    elif name == "ALPHA": out.append(("alpha",))
    else: out.append(("i", ints[name]))
  return out


def _matrices(a: CudaArray, b: CudaArray, out: CudaArray, aux: list[CudaArray]):
  """The 2-D matrices of a, b, out and the epilogue's tensors, their batch strides, and their rows: a weight shared
  by the batch (b without batch strides) folds the batch into the rows of A, C and the others when their strides
  allow; the remaining batch dims are collapsed, the innermost run by the kernel (Z entries, strides `zst`) and the
  outer ones by host-loop steps (byte `offsets`)."""
  batch = out.shape[:-2]
  mats = {"a": a, "b": b, "out": out, **{f"x{i}": x for i, x in enumerate(aux)}}
  bst = {k: broadcast_strides(CudaArray(0, x.shape[:-2], x.strides[:-2], x.dtype, 0, None), batch)
         for k, x in mats.items()}
  mats = {k: CudaArray(x.ptr, x.shape[-2:], x.strides[-2:], x.dtype, x.device, None) for k, x in mats.items()}
  if batch and not any(bst["b"]):
    keys = [k for k in mats if k != "b"]
    shape, sts = collapse(batch + (a.shape[-2],), *[bst[k] + (mats[k].strides[0],) for k in keys])
    folded = {k: CudaArray(x.ptr, (shape[0], x.shape[1]), (st[0] if shape[0] > 1 else x.strides[0], x.strides[1]),
                           x.dtype, x.device, None) for k, st in zip(keys, sts) for x in (mats[k],)}
    if len(shape) == 1 and layout(folded["a"]) is not None:
      mats |= folded
      batch, bst = (), {k: () for k in mats}
  if not batch: return mats, 1, {k: 0 for k in mats}, {k: [0] for k in mats}
  dims, sts = collapse(batch, *bst.values())
  steps = list(itertools.product(*(range(d) for d in dims[:-1])))
  offsets = {k: [sum(i * s for i, s in zip(idx, st[:-1])) * mats[k].dtype.itemsize for idx in steps]
             for k, st in zip(bst, sts)}
  return mats, dims[-1], {k: st[-1] for k, st in zip(bst, sts)}, offsets


def _planned_copy(x: CudaArray) -> CudaArray:
  """The layout of x's row-major copy, at an address as aligned as the allocator's."""
  return CudaArray(0, x.shape, _rowmajor_layout(x)[0], x.dtype, x.device, None)


def _build(a: CudaArray, b: CudaArray, out: CudaArray, bias: CudaArray | None, aux: list[CudaArray],
           epilogue: tuple[str, ...], prec: str) -> _Plan:
  """The plan of gemm(a, b) into out, for these shapes, layouts, dtypes and pointer alignments (its cache key)."""
  M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
  i64 = any(needs_i64(x.shape, x.strides) for x in (a, b, out, *aux))
  a_k, b_k = (not layout(a)[0], layout(b)[0]) if K else (True, True)  # K = 0: nothing is read
  copied = cfg.operand_copy(prec, M, N, a_k, b_k, runtime.hardware(out.device))
  if "a" in copied: a, a_k = _planned_copy(a), True  # plan on the K-major copies' layouts
  if "b" in copied: b, b_k = _mT(_planned_copy(_mT(b))), True
  mats, Z, zst, offsets = _matrices(a, b, out, aux)
  item, rows = a.dtype.itemsize, mats["a"].shape[0]
  lda, ldb = _ld(mats["a"], a_k), _ld(mats["b"], not b_k)
  tma = Z == 1 and all(mats[k].ptr % 16 == 0 and ld > 0 and ld * item % 16 == 0 and all(o % 16 == 0 for o in offsets[k])
                       for k, ld in (("a", lda), ("b", ldb)))
  c_unit, c_ld = _unit(mats["out"])
  c_aligned = mats["out"].ptr % 16 == 0 and c_ld[0] * out.dtype.itemsize % 16 == 0 and \
    all(o % 16 == 0 for o in offsets["out"])
  s = cfg.gemm_schedule(cfg.GemmProblem(rows, N, K, Z, item, out.dtype.itemsize, prec, a_k, b_k, tma, copied,
                                        c_unit if c_aligned else ""), runtime.hardware(out.device))
  src = {"A": "a", "B": "b"}
  if s.swap:  # C^T = B^T A^T: every matrix transposed, the bias now runs along M
    mats = {k: _mT(x) for k, x in mats.items()}
    mats["a"], mats["b"], src = mats["b"], mats["a"], {"A": "b", "B": "a"}
    rows, N = N, rows
  lda, ldb = _ld(mats["a"], s.a_kmajor), _ld(mats["b"], not s.b_kmajor)
  c_unit, c_ld = _unit(mats["out"])
  units = [_unit(mats[f"x{i}"]) for i in range(len(aux))]
  split = s.split_k > 1 or K == 0
  st = Structure("tma" if s.persistent else "ptr", TY[a.dtype], TY[out.dtype], prec, s.a_kmajor, s.b_kmajor,
                 s.round_a, s.round_b, c_unit, epilogue, s.swap, tuple(u for u, _ in units),
                 tuple(TY[x.dtype] for x in ([bias] if bias is not None else []) + aux), split, s.tma_store,
                 not s.persistent and Z > 1, i64)
  aux_names = [n for n in _aux_names(st) if n != "BIAS"]
  k_tiles = cdiv(K, s.BK)
  wm = cdiv(rows, s.BM) * s.BM if s.tma_store and split else rows  # TMA-stored partials: whole tile rows per slice
  ints = {"M": rows, "N": N, "K": K, "LDA": lda, "LDB": ldb, "SAZ": zst[src["A"]], "SBZ": zst[src["B"]],
          "SCZ": zst["out"], "K_TILES": cdiv(k_tiles, s.split_k), "SPLITS": s.split_k if K else 0,
          "GROUP_M": s.group_m, "SPLIT_K": s.split_k, "WM": wm}
  for name, (unit, lds) in [("LDC", (c_unit, c_ld))] + [("LD" + n, u) for n, u in zip(aux_names, units)]:
    ints |= {name: lds[0]} if unit else {name + "M": lds[0], name + "N": lds[1]}
  names = {"A": src["A"], "B": src["B"], "BIAS": "bias"} | {n: f"x{i}" for i, n in enumerate(aux_names)}
  for i, n in enumerate(aux_names): ints[f"S{n}Z"] = zst[f"x{i}"]
  offsets |= {"bias": [0] * len(offsets["a"]), "ws": [0] * len(offsets["a"])}
  aligned = all(v % 16 == 0 for k, v in ints.items() if k not in _FREE) and \
    all(x.ptr % 16 == 0 for x in mats.values()) and all(o % 16 == 0 for offs in offsets.values() for o in offs)
  ptrs = {n: (v, offsets[v]) for n, v in names.items()}
  launches = []
  if K:
    sp = main_spec(st, s, aligned, K % s.BK == 0)
    ptrs_main = ptrs | {"C": ("ws", offsets["ws"]) if split else ("out", offsets["out"])}
    launches.append((sp, s.grid if s.persistent else (s.tiles, s.split_k, Z), _args(sp[0], ptrs_main, ints)))
  if split:
    sp = reduce_spec(st, rows, N, aligned)
    ptrs_reduce = ptrs | {"W": ("ws", offsets["ws"]), "C": ("out", offsets["out"])}
    grid = (cdiv(rows, sp[2]["BLOCK_R"]), cdiv(N, sp[2]["BLOCK_C"]), Z)
    launches.append((sp, grid, _args(sp[0], ptrs_reduce, ints)))
  return _Plan(copied, len(offsets["a"]), launches, (s.split_k, Z, wm, N) if split and K else None, s, st)


def _check(a: CudaArray, b: CudaArray, epilogue: tuple[str, ...], bias, residual, gelu_input, out, out_dtype) -> None:
  if a.dtype not in DTYPES or b.dtype is not a.dtype or a.device != b.device:
    raise TypeError(f"gemm: operands must share a dtype among {[d.name for d in DTYPES]} and a device, got "
                    f"{a.dtype.name} on cuda:{a.device} and {b.dtype.name} on cuda:{b.device}")
  if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
    raise ValueError(f"gemm: cannot contract {a.shape} with {b.shape} ({a.dtype.name}, cuda:{a.device})")
  bad = [op for op in epilogue if op not in EPILOGUE]
  if bad: raise ValueError(f"gemm: unknown epilogue ops {bad}; expected some of {EPILOGUE}")
  for what, x, ops in (("bias", bias, ("bias",)), ("residual", residual, ("residual",)),
                       ("gelu_input", gelu_input, ("gelu_backward", "gelu_backward_tanh"))):
    listed = sum(op in ops for op in epilogue)
    if listed > 1 or (x is None) != (listed == 0):
      raise ValueError(f"gemm: {what} must be given exactly when the epilogue lists one of {ops} once; epilogue "
                       f"{epilogue}, {what} {'absent' if x is None else 'given'}")
    if x is not None and (x.device != a.device or not x.dtype.is_floating_point):
      raise TypeError(f"gemm: {what} must be a floating tensor on cuda:{a.device}, got {x.dtype.name} on cuda:{x.device}")
  shape = broadcast_shape(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
  if bias is not None and bias.shape != (b.shape[-1],):
    raise ValueError(f"gemm: bias of shape {bias.shape} for an output with {b.shape[-1]} columns")
  for what, x in (("residual", residual), ("gelu_input", gelu_input)):
    if x is not None and broadcast_shape(x.shape, shape) != shape:
      raise ValueError(f"gemm: {what} of shape {x.shape} does not broadcast to the output's {shape}")
  if out is not None and (out.shape != shape or out.dtype is not (out_dtype or a.dtype) or out.device != a.device):
    raise ValueError(f"gemm: out is {out.shape} {out.dtype.name} on cuda:{out.device}; expected {shape} "
                     f"{(out_dtype or a.dtype).name} on cuda:{a.device}")


_plans: dict[tuple, _Plan] = {}


def _key(x: CudaArray | None) -> tuple:
  return () if x is None else (x.shape, x.strides, x.dtype, x.ptr % 16 == 0)


def plan(a: CudaArray, b: CudaArray, out: CudaArray, bias: CudaArray | None = None, aux: tuple[CudaArray, ...] = (),
         epilogue: tuple[str, ...] = (), precision: str = "") -> _Plan:
  """The cached plan of a problem (its schedule and structure, for inspection: `plan(...).schedule`)."""
  if a.shape[-1] != b.shape[-2] or out.shape[-2:] != (a.shape[-2], b.shape[-1]):
    raise ValueError(f"gemm: cannot contract {a.shape} with {b.shape} into {out.shape}")
  key = (_key(a), _key(b), _key(out), _key(bias), tuple(_key(x) for x in aux), epilogue, precision, out.device)
  hit = _plans.get(key)
  if hit is None: hit = _plans[key] = _build(a, b, out, bias, list(aux), epilogue, precision)
  return hit


def gemm(a: CudaArray, b: CudaArray, *, out: CudaArray | None = None, epilogue: tuple[str, ...] = (),
         bias: CudaArray | None = None, residual: CudaArray | None = None, gelu_input: CudaArray | None = None,
         alpha: float = 1.0, precision: str | None = None, out_dtype: DType | None = None) -> CudaArray:
  """C = epilogue(a @ b) over broadcast batch dims, by a synthesized Triton kernel scheduled by the configurator.

  Args:
    a, b: (*, M, K) and (*, K, N) float32, bfloat16 or float16; each matrix needs a unit stride in one of its last
      two dims (others are copied); batch dims broadcast (stride 0 is fine).
    out: where to write C (any strides; one with no unit stride in its last two dims gets a copy).
    epilogue: ops applied in order to the float32 accumulator, from EPILOGUE: "scale" (times alpha), "bias" (+ a
      vector of N), "gelu"/"gelu_tanh", "residual" (+ a tensor broadcasting to C), "gelu_backward"/"_tanh" (times
      gelu'(gelu_input)); then the cast to the output dtype.
    precision: float32 operands only: "tf32" or "tf32x3" (default: from `set_float32_matmul_precision`).
    out_dtype: the output dtype (default a's).
  """
  epilogue = tuple(epilogue)
  prec = precision_of(a.dtype, precision)
  key = (_key(a), _key(b), _key(out), _key(bias), _key(residual), _key(gelu_input), epilogue, prec, out_dtype, a.device)
  hit = _calls.get(key)
  if hit is not None:  # a layout seen before, with nothing to copy: straight to the launches
    p, shape, dtype = hit
    if out is None: out = empty(shape, dtype, a.device)
    _launch(p, a, b, out, bias, [x.ptr for op in epilogue if op in _AUX
                                 for x in ((residual if op == "residual" else gelu_input),)], alpha, prec)
    return out
  _check(a, b, epilogue, bias, residual, gelu_input, out, out_dtype)
  shape = broadcast_shape(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
  target = out
  if out is None or not _unit(out)[0]: out = empty(shape, out_dtype or a.dtype, a.device)
  if out.size:
    a2, b2 = _operand(a), _operand(b)
    bias2 = copy(bias) if bias is not None and bias.strides != (1,) else bias
    aux = tuple(x for op in epilogue if op in _AUX for x in ((residual if op == "residual" else gelu_input),))
    aux = tuple(CudaArray(x.ptr, shape, broadcast_strides(x, shape), x.dtype, x.device, x.owner) for x in aux)
    p = plan(a2, b2, out, bias2, aux, epilogue, prec)
    if a2 is a and b2 is b and bias2 is bias and target in (None, out): _calls[key] = (p, shape, out.dtype)
    _launch(p, a2, b2, out, bias2, [x.ptr for x in aux], alpha, prec)
  if target is not None and target is not out:
    copy(out, out=target)
    return target
  return out


_calls: dict[tuple, tuple[_Plan, tuple[int, ...], DType]] = {}  # a call's layouts -> plan, output shape and dtype


def _launch(p: _Plan, a: CudaArray, b: CudaArray, out: CudaArray, bias: CudaArray | None, aux: list[int], alpha: float,
            prec: str) -> None:
  """Queue a plan's kernels (and the K-major copy and workspace it asks for) on the current stream."""
  ptrs = {"a": a.ptr, "b": b.ptr, "out": out.ptr, "bias": 0 if bias is None else bias.ptr, "ws": 0}
  for i, x in enumerate(aux): ptrs[f"x{i}"] = x
  keep = []
  for op in p.copy:  # the operands' K-major copies (rounded to TF32), alive until the launches are queued
    keep.append(_rowmajor(a if op == "a" else _mT(b), prec == "tf32"))
    ptrs[op] = keep[-1].ptr
  if p.workspace:
    keep.append(empty(p.workspace, dtypes.float32, a.device))
    ptrs["ws"] = keep[-1].ptr
  for step in range(p.steps):
    for kernel, (_, grid, args) in zip(p.kernels, p.launches):
      kernel(grid, *[ptrs[x[1]] + x[2][step] if x[0] == "p" else alpha if x[0] == "alpha" else x[1] for x in args])


def _operand(x: CudaArray) -> CudaArray:
  return x if x.size == 0 or layout(x) is not None else copy(x)


def _specs() -> list[Spec]:
  """What CI compiles: the kernels planned for layouts that reach every structure the host picks (persistent TMA
  and pointer kernels, split-K and its reduction, the K-major copy, the swapped orientation, batches, misaligned and
  int64-indexed operands, K = 0) in every precision, and each epilogue op; planned without a GPU (fake addresses)."""
  f32, bf16, f16 = dtypes.float32, dtypes.bfloat16, dtypes.float16

  def arr(shape, dtype, mode="n"):
    """A matrix (batch) at a fake 512-aligned address: "n" row-major, "t" stored transposed, "odd" rows padded by 1."""
    shape = tuple(shape)
    if mode == "t": return _mT(arr(shape[:-2] + shape[-2:][::-1], dtype))
    if mode == "odd":
      st = contiguous_strides(shape[:-1] + (shape[-1] + 1,))
      return CudaArray(1 << 20, shape, st, dtype, 0, None)
    return CudaArray(1 << 20, shape, contiguous_strides(shape), dtype, 0, None)

  def launches(a, b, prec="", epilogue=(), bias=None, aux=(), out_dtype=None):
    shape = broadcast_shape(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    p = plan(a, b, arr(shape, out_dtype or a.dtype), bias, tuple(aux), tuple(epilogue), prec)
    copied = [_rowmajor_spec_of(a if op == "a" else _mT(b), prec == "tf32") for op in p.copy]
    return copied + [sp for sp, _, _ in p.launches]

  T, M = 16384, 768
  out = []
  for dt, prec in ((bf16, ""), (f32, "tf32")):
    out += launches(arr((T, M), dt), arr((M, 2304), dt, "t"), prec)                  # y = x W^T
    out += launches(arr((T, 2304), dt), arr((2304, M), dt), prec)                    # dx = dy W
    out += launches(arr((3072, T), dt, "t"), arr((T, M), dt), prec)                  # dW = dy^T x: split-K
    out += launches(arr((2304, T), dt, "t"), arr((T, M), dt), prec)
    out += launches(arr((1024, 1024), dt), arr((1024, 1024), dt), prec)              # squares: TF32 swaps, rounds B
    out += launches(arr((8, 128, 4096), dt), arr((8, 4096, 64), dt), prec)           # batched split-K
    out += launches(arr((2, 12, 64, 64), dt, "t"), arr((2, 12, 64, 128), dt), prec)  # batched, both MN-major
    out += launches(arr((200, 1000), dt, "odd"), arr((1000, 300), dt, "odd"), prec)  # misaligned
  out += launches(arr((T, M), f32), arr((M, 2304), f32, "t"), "tf32x3")
  out += launches(arr((4, 33, 65), f32), arr((4, 65, 17), f32, "t"), "tf32x3")
  out += launches(arr((T, M), bf16), arr((M, 3072), bf16), out_dtype=f32)
  out += launches(arr((T, M), f16), arr((M, 3072), f16, "t"), "", ("bias", "gelu_tanh"), arr((3072,), f16))
  out += launches(arr((T, 3072), bf16), arr((3072, M), bf16, "t"), "", ("scale", "bias", "gelu", "residual"),
                  arr((M,), f32), [CudaArray(1 << 20, (T, M), (0, 1), bf16, 0, None)])
  out += launches(arr((T, M), bf16), arr((M, 3072), bf16), "", ("gelu_backward_tanh",), None, [arr((T, 3072), bf16)])
  out += launches(arr((2048, 2048), f32), arr((2048, 2048), f32), "tf32", ("bias", "gelu"), arr((2048,), f32))
  out += launches(arr((3, 100, 96), f16, "odd"), arr((96, 80), f16), "", ("residual", "gelu_backward"), None,
                  [arr((3, 100, 80), f16, "t"), arr((3, 100, 80), f32)])
  out += launches(arr((65536, M), bf16), arr((M, 50304), bf16, "t"))                 # int64 offsets
  out += launches(arr((64, 0), f32), arr((0, 64), f32), "tf32", ("bias",), arr((64,), f32))  # K = 0
  return out


def __getattr__(name: str):
  if name == "SPECS": return _specs()  # planned when CI asks, not at every import (about 0.7 s)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


KERNELS: dict = {}  # no op of its own: matmul dispatches to `gemm` (bt.backends.matmul = "triton")
