"""Kernel synthesis: a fused pointwise group (`nova.fused`, made by `passes/fuse_pointwise.py`) becomes one Triton
kernel generated from its body, for the GPU target.

A group is data (`Body`: input dtypes, ops over references, outputs), taken from the IR by `codegen.body_of`; the
generated step holds it as a literal and calls `fused(body, shape, *arrays)`. This module imports no xDSL: a step
served from the disk cache runs it without the compiler. On the first call for a layout of the inputs the host
collapses dims (`kernels.collapse` over the output's contiguous strides and each input's broadcast strides) and
sorts each input into a kind: `flat` (the output's own layout, read at the flat index), `scalar` (one element),
`strided:<pattern>` (read through the collapsed dims' indices; the pattern has one letter per dim: `0` broadcast,
`1` unit stride, `s` a stride passed at run time, so a bias over rows is `strided:01` and reads `j1`) or `value` (a
host scalar passed by value). The kernel's `Variant` is (rank, kinds, 64-bit indexing, 16-byte alignment): the
broadcast pattern; with the body it is the structural hash
(`key`), which names the kernel: identical groups (the blocks of a transformer) share one source, one JIT function
and one compile, which `launch` also caches on disk. With $BLUTRAIN_DUMP_IR each source is written there as
`fused_<key>.py`.

The kernel is 1-D and blocked over the output's elements: full blocks run unmasked (their loads vectorize), the last
one masked. Each input is loaded once and computed in its compute type (halves widen to float32), each op runs the
eager kernels' own float32 formulas (`elementwise._apply`, so the ops' math lives in one place) and is converted to
its result's compute type, casts round for real, and outputs are rounded to their dtypes once, at the store. So a
bfloat16 chain rounds once where eager mode rounds after every op. BLOCK and num_warps come from
`configurator.fused_schedule`.
"""
from __future__ import annotations

import hashlib
import linecache
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from blutrain import dtypes
from blutrain.configurator import fused_schedule
from blutrain.dtypes import DType
from blutrain.nova.graph import literal

HALF = (dtypes.float16, dtypes.bfloat16)
_TL = {dtypes.bool_: "int1", dtypes.uint8: "uint8", dtypes.int8: "int8", dtypes.int16: "int16",
       dtypes.int32: "int32", dtypes.int64: "int64", dtypes.float16: "float16", dtypes.bfloat16: "bfloat16",
       dtypes.float32: "float32", dtypes.float64: "float64"}


@dataclass(frozen=True)
class Body:
  """A fused group as data. A reference is an input's position, or len(inputs) + an op's position.

  Attributes:
    inputs: the dtypes of the group's inputs.
    ops: (name, references of the operands, attributes as sorted (key, value) pairs, result dtype), in order.
    outputs: the references of the group's results, in order.
  """
  inputs: tuple[DType, ...]
  ops: tuple[tuple[str, tuple[int, ...], tuple[tuple[str, Any], ...], DType], ...]
  outputs: tuple[int, ...]

  def dtype(self, ref: int) -> DType:
    """The dtype of a reference."""
    return self.inputs[ref] if ref < len(self.inputs) else self.ops[ref - len(self.inputs)][3]

  def literal(self) -> str:
    """Python source that evaluates to this body (with `Body` and `dtypes` in scope)."""
    return f"Body({literal(self.inputs)}, {literal(self.ops)}, {literal(self.outputs)})"


@dataclass(frozen=True)
class Variant:
  """What a kernel is specialized to besides its body: the collapsed rank, each input's kind (see the module
  docstring), 64-bit indices, and whether the flat operands' addresses are 16-byte aligned."""
  rank: int
  kinds: tuple[str, ...]
  i64: bool
  aligned: bool


def key(body: Body, variant: Variant) -> str:
  """The structural hash of a kernel: its body (dtypes, ops, attributes) and its variant (broadcast pattern)."""
  return hashlib.blake2b(repr((body.literal(), variant)).encode(), digest_size=8).hexdigest()


def _compute(d: DType) -> str:
  """The type a value of dtype d is computed in: halves in float32."""
  return "tl.float32" if d in HALF else f"tl.{_TL[d]}"


def _op_call(name: str, args: list[str], attrs: dict) -> str:
  """An op of the body on computed values, as the eager kernels compute it (`elementwise._apply`)."""
  if name in ("gelu", "gelu_backward"): name += "_tanh" if attrs["approximate"] == "tanh" else ""
  if name == "where": a, b, c = args[1], args[2], args[0]  # _apply reads (x, y, condition)
  else: a, b, c = args[0], args[-1], args[0]
  return f'_apply({a}, {b}, {c}, "{name}")'


def source(body: Body, variant: Variant) -> str:
  """The Triton source of a body's kernel for a variant (see the module docstring)."""
  name = f"fused_{key(body, variant)}"
  n_in, r = len(body.inputs), variant.rank
  strided = [k for k, kind in enumerate(variant.kinds) if kind.startswith("strided")]
  outs = [f"o{j}" for j in range(len(body.outputs))]
  params = [*outs, *(f"i{k}" for k in range(n_in)), "n", *(f"d{d}" for d in range(1, r) if strided),
            *_stride_params(variant)]
  lines = [f"def {name}_block({', '.join(params)}, offs, mask, BLOCK: tl.constexpr):"]
  if strided:  # the index along each collapsed dim, innermost first
    rest = "offs"
    for d in range(r - 1, 0, -1):
      lines += [f"  j{d} = {rest} % d{d}", f"  q{d} = {rest} // d{d}"]
      rest = f"q{d}"
    lines.append(f"  j0 = {rest}")
  consts, names, block = [], [], []  # per reference: its name, whether it is a block (else one value)
  for k, (d, kind) in enumerate(zip(body.inputs, variant.kinds)):
    if kind == "value": load = f"tl.cast(i{k}, {_compute(d)})"  # a tensor, whatever the caller passed
    elif kind == "scalar": load = f"tl.load(i{k})"
    elif kind == "flat": load = f"tl.load(i{k} + offs, mask=mask)"
    else:
      terms = [f"j{i}" if c == "1" else f"j{i} * s{k}_{i}" for i, c in enumerate(kind[8:]) if c != "0"]
      load = f"tl.load(i{k} + {' + '.join(terms)}, mask=mask)"
    lines.append(f"  x{k} = {load}.to({_compute(d)})")
    names.append(f"x{k}")
    block.append(kind in ("flat", "strided"))
  for i, (op, refs, attrs, d) in enumerate(body.ops):
    attrs, args = dict(attrs), [names[j] for j in refs]
    if op == "full":
      value = np.asarray(attrs["value"]).astype(d.np).item()  # rounded to its dtype, as eagerly; exact in compute type
      consts.append(f"C{len(consts)} = tl.constexpr({literal(value)})")
      expr = f"tl.full([], C{len(consts) - 1}, {_compute(d)})"
    elif op == "cast": expr = f"{args[0]}.to(tl.{_TL[d]})"
    else: expr = _op_call(op, args, attrs)
    lines.append(f"  v{i} = {expr}.to({_compute(d)})")
    names.append(f"v{i}")
    block.append(any(block[j] for j in refs))
  for j, ref in enumerate(body.outputs):
    d = body.dtype(ref)
    value = f"{names[ref]}.to(tl.{_TL[d]})"
    if not block[ref]: value = f"tl.broadcast_to({value}, [BLOCK])"
    lines.append(f"  tl.store(o{j} + offs, {value}, mask=mask)")
  index = "tl.program_id(0).to(tl.int64)" if variant.i64 else "tl.program_id(0)"
  args = ", ".join(params)
  kernel = [f"def {name}({args}, BLOCK: tl.constexpr):",
            f"  start = {index} * BLOCK",
            "  offs = start + tl.arange(0, BLOCK)",
            "  if start + BLOCK <= n:",
            f"    {name}_block({args}, offs, None, BLOCK)",
            "  else:",
            f"    {name}_block({args}, offs, offs < n, BLOCK)"]
  head = [f"# {body.literal()}", f"# {variant}",
          "# generated by blutrain.nova.synth; _apply is blutrain.backend.cuda.kernels.elementwise's",
          "import triton", "import triton.language as tl", *([""] + consts if consts else [])]
  return "\n".join(head + ["", "", "@triton.jit", *lines, "", "", "@triton.jit", *kernel]) + "\n"


_functions: dict[str, Any] = {}


def jit_function(body: Body, variant: Variant) -> Any:
  """The JIT function of a body's kernel for a variant, made once per structural hash: its source executed as a
  module registered in linecache (Triton reads a kernel's source back with inspect), written to $BLUTRAIN_DUMP_IR
  when set."""
  k = key(body, variant)
  fn = _functions.get(k)
  if fn is not None: return fn
  from blutrain.backend.cuda.kernels.elementwise import _apply
  text = source(body, variant)
  filename = f"<blutrain-fused {k}>"
  linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
  namespace: dict[str, Any] = {"_apply": _apply, "__name__": f"blutrain_fused_{k}"}
  exec(compile(text, filename, "exec"), namespace)  # noqa: S102 (generated from a Body's fields)
  if dump := os.environ.get("BLUTRAIN_DUMP_IR"):
    Path(dump).mkdir(parents=True, exist_ok=True)
    (Path(dump) / f"fused_{k}.py").write_text(text)
  fn = _functions[k] = namespace[f"fused_{k}"]
  return fn


def signature(body: Body, variant: Variant) -> dict[str, str]:
  """The Triton types of a kernel's parameters, BLOCK excepted: pointers (":16" on the flat ones when aligned),
  host scalars by value, sizes and strides as i32 or i64."""
  from blutrain.backend.cuda.kernels import ptr
  from blutrain.backend.cuda.kernels.elementwise import BY_VALUE
  div = ":16" if variant.aligned else ""
  idx = "i64" if variant.i64 else "i32"
  sig = {f"o{j}": ptr(body.dtype(ref)) + div for j, ref in enumerate(body.outputs)}
  for k, (d, kind) in enumerate(zip(body.inputs, variant.kinds)):
    sig[f"i{k}"] = BY_VALUE[d] if kind == "value" else ptr(d) + (div if kind == "flat" else "")
  sig["n"] = idx
  if any(kind.startswith("strided") for kind in variant.kinds):
    sig.update({f"d{d}": idx for d in range(1, variant.rank)})
  sig.update({p: idx for p in _stride_params(variant)})
  return sig


def _stride_params(variant: Variant) -> list[str]:
  """The stride parameters of a variant: one per dim of a strided input whose stride is neither 0 nor 1."""
  return [f"s{k}_{i}" for k, kind in enumerate(variant.kinds) if kind.startswith("strided")
          for i, c in enumerate(kind[8:]) if c == "s"]


def spec(body: Body, variant: Variant, n: int):
  """The compiled variant (`kernels.Spec`) of a body's kernel for n output elements, scheduled by the configurator."""
  from blutrain.backend.cuda.kernels import spec as make_spec
  itemsize = min(d.itemsize for d in list(body.inputs) + [op[3] for op in body.ops])
  block, warps = fused_schedule(n, itemsize, len(body.inputs) + len(body.outputs))
  return make_spec(jit_function(body, variant), signature(body, variant), {"BLOCK": block}, num_warps=warps)


def plan(body: Body, shape: tuple[int, ...], layouts: list[tuple | None]) -> tuple:
  """(spec, grid, the sizes and strides after the arrays, the outputs' memory order) of a body writing new outputs of
  `shape` in the dense layout of its first input of that shape (`elementwise.output_order`: channels-last stays
  channels-last), for inputs of the given layouts (`CudaArray.key()`, None for a host scalar)."""
  from blutrain.backend.cuda.array import CudaArray
  from blutrain.backend.cuda.kernels import broadcast_strides, collapse, in_memory_order, needs_i64
  from blutrain.backend.cuda.kernels.elementwise import output_order
  from blutrain.shapes import cdiv, strides_in_order
  n = math.prod(shape)
  if n == 0: return None, None, (0,), None
  order = output_order(shape, layouts)
  out_strides = strides_in_order(tuple(shape), order)
  bstrides = [None if lay is None else broadcast_strides(CudaArray(0, lay[0], lay[1], lay[2], 0, None), shape)
              for lay in layouts]
  # the dims in the outputs' memory order: the kernel writes them at its flat index, row-major over the collapsed dims
  pshape, pstrides = in_memory_order(shape, out_strides, *[s for s in bstrides if s is not None])
  cshape, (ost, *ists) = collapse(pshape, *pstrides)
  it = iter(ists)
  ists = [None if s is None else next(it) for s in bstrides]
  kinds = tuple("value" if s is None else "scalar" if not any(s) else "flat" if s == ost else
                "strided:" + "".join("0" if x == 0 else "1" if x == 1 else "s" for x in s) for s in ists)
  aligned = all(lay[3] == 0 for lay, kind in zip(layouts, kinds) if kind == "flat")  # outputs: the allocator's 512 B
  i64 = needs_i64(cshape, ost, *[s for s in ists if s is not None])
  is_strided = any(kind.startswith("strided") for kind in kinds)
  variant = Variant(len(cshape) if is_strided else 1, kinds, i64, aligned)
  s = spec(body, variant, n)
  sizes = list(cshape[1:]) if is_strided else []
  strides = [x for s_, kind in zip(ists, kinds) if kind.startswith("strided") for x in s_ if x not in (0, 1)]
  return s, (cdiv(n, s.constexprs["BLOCK"]),), (n, *sizes, *strides), order


_plans: dict[tuple, tuple] = {}


def fused(body: Body, shape: tuple[int, ...], *xs, out: tuple | None = None) -> tuple:
  """The outputs of a fused group (CudaArrays of `shape`, in the layout `plan` picks) from its inputs (CudaArrays
  broadcasting to `shape`, or host scalars), on the current stream of the first input's device. `out` may give, per
  output, an array to write it into (None: a new one): an input's own buffer, which the kernel reads at the flat
  index before it writes there (a buffer not of that layout gets a new array instead, which the caller copies)."""
  from blutrain.backend.cuda.array import CudaArray
  from blutrain.backend.cuda.kernels import empty_ordered, run
  from blutrain.backend.cuda.runtime import current_stream
  from blutrain.shapes import strides_in_order
  arrays = [x.layout_key or x.key() if x.__class__ is CudaArray else None for x in xs]
  k = (body, shape, *arrays)
  hit = _plans.get(k)
  if hit is None:
    if len(_plans) > 4096: _plans.clear()
    hit = _plans[k] = plan(body, shape, arrays)
  s, grid, scalars, order = hit
  device = next(x.device for x in xs if x.__class__ is CudaArray)
  stream = current_stream(device)
  strides = strides_in_order(tuple(shape), order) if out else None
  outs = tuple(o if o is not None and o.shape == shape and o.dtype is body.dtype(ref) and
               all(a == b for n, a, b in zip(shape, o.strides, strides) if n != 1)
               else empty_ordered(shape, body.dtype(ref), device, order, stream)
               for ref, o in zip(body.outputs, out or (None,) * len(body.outputs)))
  if scalars[0]:
    args = [x if x.__class__ is CudaArray else np.asarray(x).item() for x in xs]
    run(s, grid, *outs, *args, *scalars)
  return outs
