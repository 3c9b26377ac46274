"""What a synthesized GEMM kernel is (`Structure`), its Triton source, and its compiled variants.

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
`residual` (+ a tensor of C's shape), `gelu_backward`/`gelu_backward_tanh` (times gelu'(x) of a saved tensor),
`round` (to the operands' type and back: where the unfused ops rounded, so a fused epilogue rounds as they did),
`save` (the accumulator so far stored, in its tensor's type, into a second output of C's shape), then the cast to the
output type. GELU's math is the elementwise kernels' (`elementwise.gelu`, `elementwise.gelu_backward`).

TF32: tensor cores truncate float32 operands; the kernels round the register operand A to nearest (`round_tf32`),
and B is rounded by the K-major copy the configurator asks for when it is cheap (operand_copy.py). With
$BLUTRAIN_DUMP_IR each generated kernel is written there as gemm_<key>.py.
"""
from __future__ import annotations

import hashlib
import linecache
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import triton
import triton.language as tl

from blutrain import configurator as cfg
from blutrain.backend.cuda.kernels import Spec, spec
from blutrain.backend.cuda.kernels.elementwise import gelu, gelu_backward

EPILOGUE = ("scale", "bias", "gelu", "gelu_tanh", "residual", "gelu_backward", "gelu_backward_tanh", "round", "save")
TENSOR_OPERANDS = {"residual": "R", "gelu_backward": "X", "gelu_backward_tanh": "X", "save": "S"}  # epilogue ops
# reading (or, "save", writing) a tensor of C's shape -> the name of its pointer parameter
CONSTEXPRS = ("BM", "BN", "BK", "EVEN_K", "EPI_SUBTILE", "WARP_SPEC", "BLOCK_R", "BLOCK_C")
UNALIGNED_INTS = ("K_TILES", "SPLITS", "WM", "GROUP_M", "SPLIT_K")  # integer parameters with no divisibility promise
_TL_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # the output's type in triton.language


@triton.jit
def round_tf32(x):
  """float32 rounded to the nearest TF32 (10 mantissa bits, ties away from zero, as cvt.rna.tf32.f32): add half a
  unit of the 13 dropped bits and clear them; infinities and NaNs pass unchanged."""
  bits = x.to(tl.int32, bitcast=True)
  r = ((bits + 0x1000) & -8192).to(tl.float32, bitcast=True)
  return tl.where((bits & 0x7F800000) == 0x7F800000, x, r)


@triton.jit
def store_partial(acc, rm, rn, W, M, N, split):
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
    n = sum(op in TENSOR_OPERANDS for op in self.epilogue)
    if len(self.aux) != n or len(self.epi_types) != n + ("bias" in self.epilogue):
      raise ValueError(f"gemm: {self.epilogue} reads {n} tensors (and a bias when listed), got layouts {self.aux} and "
                       f"types {self.epi_types}")

  @property
  def name(self) -> str:
    return "gemm_" + hashlib.blake2b(repr(self).encode(), digest_size=6).hexdigest()


def epilogue_pointers(st: Structure) -> list[str]:
  """Pointer names of the epilogue's tensors in order: BIAS for the bias, R1/X1, R2/X2, ... for the others."""
  names, i = [], 0
  for op in st.epilogue:
    if op == "bias": names.append("BIAS")
    elif op in TENSOR_OPERANDS:
      i += 1
      names.append(f"{TENSOR_OPERANDS[op]}{i}")
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
  aux = epilogue_pointers(st) if epi else []
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
  aux = epilogue_pointers(st)
  out = aux + ["M", "N"]
  for name, unit in zip([n for n in aux if n != "BIAS"], st.aux): out += _matrix_args(unit, "LD" + name)
  return out + (["ALPHA"] if "scale" in st.epilogue else [])


def _epilogue_source(st: Structure) -> list[str]:
  """The helper finishing `acc` (rows rm, columns rn of C): the epilogue ops, then the cast to C's type."""
  lines = [f"def {st.name}_epilogue(acc, rm, rn, {', '.join(_epilogue_params(st))}):"]
  if st.aux: lines.append("  mask = (rm[:, None] < M) & (rn[None, :] < N)")
  aux = iter([n for n in epilogue_pointers(st) if n != "BIAS"])
  units = iter(st.aux)
  for op in st.epilogue:
    if op == "scale": lines.append("  acc = acc * ALPHA")
    elif op == "bias":
      r, ax, bound = ("rm", "[:, None]", "M") if st.bias_along_m else ("rn", "[None, :]", "N")
      lines.append(f"  acc += tl.load(BIAS + {r}, mask={r} < {bound}, other=0.0).to(tl.float32){ax}")
    elif op in ("gelu", "gelu_tanh"): lines.append(f"  acc = gelu(acc, {op == 'gelu_tanh'})")
    elif op == "round": lines.append(f"  acc = acc.to(tl.{_TL_NAMES[st.dtype]}).to(tl.float32)")
    elif op == "save":
      name = next(aux)
      lines.append(f"  tl.store({name} + {_offsets(next(units), 'LD' + name)}, acc.to({name}.dtype.element_ty), "
                   "mask=mask)")
    else:
      name = next(aux)
      x = f"tl.load({name} + {_offsets(next(units), 'LD' + name)}, mask=mask, other=0.0).to(tl.float32)"
      lines.append(f"  acc += {x}" if op == "residual" else f"  acc = gelu_backward(acc, {x}, {op.endswith('tanh')})")
  lines.append(f"  return acc.to(tl.{_TL_NAMES[st.out]})")
  return lines


def _store(st: Structure, acc: str, rn: str, split: str | None, col: str = "") -> str:
  """The statement storing a tile: the float32 partial sum of split-K slice `split`, or (None) the epilogue's
  result, by C's TMA descriptor at column `col` or by pointers."""
  if split is not None and st.tma_store: return f"c_desc.store([{split} * WM + pid_m * BM, {col}], {acc})"
  if split is not None: return f"store_partial({acc}, rm, {rn}, C, M, N, {split})"
  value = f"{st.name}_epilogue({acc}, rm, {rn}, {', '.join(_epilogue_params(st))})"
  if st.tma_store and not st.split: return f"c_desc.store([pid_m * BM, {col}], {value})"
  mask = f"(rm[:, None] < M) & ({rn}[None, :] < N)"
  return f"tl.store(C + {_offsets(st.c_unit, 'LDC', rn)}, {value}, mask={mask})"



def _tile_index(indent: str, t: str) -> list[str]:
  """pid_m, pid_n of tile t in groups of GROUP_M tile rows (consecutive tiles share B columns within a group)."""
  return [indent + s for s in (f"first_m = {t} // per_group * GROUP_M",
                               "group_m = tl.minimum(tiles_m - first_m, GROUP_M)",
                               f"pid_m = first_m + {t} % per_group % group_m",
                               f"pid_n = {t} % per_group // group_m")]


def _dot(st: Structure, indent: str) -> list[str]:
  lines = []
  if st.round_a: lines.append("a = round_tf32(a)")
  if st.round_b: lines.append("b = round_tf32(b)")
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
      src += [f"  C += {z} * SCZ"] + [f"  {n} += {z} * S{n}Z" for n in epilogue_pointers(st) if n != "BIAS"]
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
    src += [f"  C += {z} * SCZ"] + [f"  {n} += {z} * S{n}Z" for n in epilogue_pointers(st) if n != "BIAS"]
  src += ["  w = W + (tl.program_id(2).to(tl.int64) * WM + rm[:, None]) * N + rn[None, :]",
          "  slice_size = tl.num_programs(2).to(tl.int64) * WM * N",
          "  acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)",
          "  for s in range(SPLITS):",
          "    acc += tl.load(w + s * slice_size, mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0)"]
  return src + ["  " + _store(st, "acc", "rn", None)]


def source(st: Structure) -> str:
  """The Triton source of a structure's kernels (the main kernel, and the split-K reduction when `split`)."""
  head = (f"# {st}\n# generated by blutrain.backend.cuda.kernels.gemm; helpers round_tf32, gelu, gelu_backward and "
          f"store_partial are the library's\nimport triton\nimport triton.language as tl\n")
  main = _tma_source(st) if st.kind == "tma" else _ptr_source(st)
  fns = [_epilogue_source(st), main]
  if st.split: fns.append(_reduce_source(st))
  parts = ["@triton.jit\n" + "\n".join(f) + "\n" for f in fns]
  return head + "\n\n" + "\n\n".join(parts)


_functions: dict[Structure, tuple[Any, Any]] = {}


def jit_functions(st: Structure) -> tuple[Any, Any]:
  """(main, reduce or None) JIT functions of a structure: its source executed as a module registered in linecache
  (Triton reads a kernel's source back with inspect), written to $BLUTRAIN_DUMP_IR when set."""
  hit = _functions.get(st)
  if hit is not None: return hit
  text = source(st)
  filename = f"<blutrain-gemm {st.name}>"
  linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
  namespace: dict[str, Any] = {"round_tf32": round_tf32, "gelu": gelu, "gelu_backward": gelu_backward,
                               "store_partial": store_partial, "__name__": f"blutrain_gemm_{st.name}"}
  exec(compile(text, filename, "exec"), namespace)  # noqa: S102 (generated from a Structure's fields)
  if dump := os.environ.get("BLUTRAIN_DUMP_IR"):
    Path(dump).mkdir(parents=True, exist_ok=True)
    (Path(dump) / f"{st.name}.py").write_text(text)
  hit = _functions[st] = (namespace[st.name], namespace.get(f"{st.name}_reduce"))
  return hit


# *** variants ***

def _signature(st: Structure, fn, aligned: bool, partial: bool) -> dict[str, str]:
  """Types of a kernel's runtime parameters (`partial`: C is split-K's float32 workspace); `aligned` promises
  16-divisible pointers (the bias excepted), sizes and strides, which lets Triton vectorize."""
  div = ":16" if aligned else ""
  aux = dict(zip(epilogue_pointers(st), st.epi_types))
  sig = {}
  for name in fn.arg_names:
    if name in CONSTEXPRS: continue
    if name in ("A", "B"): sig[name] = f"*{st.dtype}{div}"
    elif name == "W" or name == "C" and partial: sig[name] = f"*fp32{div}"
    elif name == "C": sig[name] = f"*{st.out}{div}"
    elif name in aux: sig[name] = f"*{aux[name]}" + ("" if name == "BIAS" else div)
    elif name == "ALPHA": sig[name] = "fp32"
    elif name.endswith("Z"): sig[name] = f"i64{div}"
    else: sig[name] = "i32" if name in UNALIGNED_INTS else f"i32{div}"
  return sig


def main_spec(st: Structure, s: cfg.GemmSchedule, aligned: bool, even_k: bool = True) -> Spec:
  """The main kernel's variant for a schedule (`even_k`: K is a multiple of BK, so "ptr" kernels need no K mask)."""
  fn = jit_functions(st)[0]
  consts = dict(BM=s.BM, BN=s.BN, BK=s.BK)
  if st.kind == "tma": consts |= {"EPI_SUBTILE": s.epi_subtile, "WARP_SPEC": s.warp_specialize}
  else: consts["EVEN_K"] = even_k
  return spec(fn, _signature(st, fn, aligned, st.split), consts, num_warps=s.num_warps, num_stages=s.num_stages)


def reduce_spec(st: Structure, M: int, N: int, aligned: bool) -> Spec:
  """The split-K reduction's variant: 2-D elementwise tiles over (M, N) from the configurator."""
  fn = jit_functions(st)[1]
  br, bc, warps = cfg.tile_schedule(M, N)
  return spec(fn, _signature(st, fn, aligned, False), dict(BLOCK_R=br, BLOCK_C=bc), num_warps=warps)


