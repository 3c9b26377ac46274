"""GEMM epilogue fusion: the ops that follow a matmul folded into one `nova.gemm` (ops.linalg.gemm_op), which a GPU
step runs as one GEMM with the ops in its epilogue (or as cuBLASLt and the kernels its epilogue cannot do, whichever
the configurator predicts faster: `configurator.gemm_choice`, `gemm_choice` below).

  add(matmul(a, b), bias)             ->  gemm(a, b, bias) {epilogue = "bias"}       bias of shape (N,), over rows
  gelu(gemm(...))                     ->  gemm(...) {epilogue = "...,gelu"}          (or gelu_tanh)
  gelu(h = gemm(...)), h read later   ->  gemm(...) {epilogue = "...,save,gelu"}     h becomes a second result
  add(gemm(...), r), add(r, gemm(...)) ->  gemm(..., r) {epilogue = "...,residual"}  r of the output's shape
  gelu_backward(matmul(a, b), x)      ->  gemm(a, b, x) {epilogue = "gelu_backward"} (the incoming gradient's GEMM)

Every rewrite is exact: the gemm computes what the ops computed, rounding where each of them rounded (to the
matmul's dtype after the product, the bias and the GELU; to the last op's dtype at the end), so a compiled step
equals eager mode on the CPU, and the GPU's fused epilogue rounds the float32 accumulator at the same places. What
does not fuse, and why:
- a matmul or gemm whose output is read elsewhere too (except a GELU's input: "save" keeps it), since its value
  before the epilogue is needed (dead readers do not count: fuse-casts leaves the casts it replaced to dce); also
  when a saved value is read before the op being folded in, whose place the gemm takes;
- an add whose other operand is neither a bias (shape (N,)) nor of the output's shape (a column (M, 1), a broadcast
  batch): that is neither epilogue;
- a bias or GELU that would change the dtype, or anything after a residual or GELU backward (they end an epilogue);
- integer and float64 products (the GPU's synthesized GEMMs multiply float32, bfloat16 and float16).

On the GPU a second pass, fuse-wgrad (run after remat and fuse-norms), folds a linear layer's weight gradient
dW = g^T x with what eager mode does around it: autocast's widening cast of the half product to the float32
parameter's dtype, and the bias gradient, the column sums of g, which cuBLASLt's BGRADB epilogue computes in the same
GEMM from the tiles of g it loads anyway (instead of a reduction reading g again):

  c = cast(matmul(permute(view(g)), x): half -> f32);  d = cast(view(sum(g, all dims but the last)): half -> f32)
    ->  c, d = weight_grad(permute(view(g)), x) {dtype = f32, bias_grad = true}

This one is not exact: the product is stored in float32 straight from the accumulator, where eager mode rounds it to
the half dtype first, and the bias gradient is summed in the GEMM's order, so both differ from eager mode by at most
one rounding of the half dtype (they are the more accurate). That is why it runs on the GPU only: a compiled step on
the CPU stays equal to eager mode.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from xdsl.ir import SSAValue
from xdsl.pattern_rewriter import PatternRewriter, RewritePattern
from xdsl.rewriter import InsertPoint

from blutrain import configurator as cfg
from blutrain import dtypes
from blutrain.nova.dialect import (AddOp, CastOp, GeluBackwardOp, GeluOp, GemmOp, LayerNormBackwardOp, MatmulOp, NovaOp,
                                   PermuteOp, SumOp, ViewOp, WeightGradOp, aval, tensor_type)
from blutrain.nova.ir import function
from blutrain.nova.passes.base import PatternPass, op_type_rewrite_pattern
from blutrain.ops.linalg import gemm_steps

_FLOATS = (dtypes.float32, dtypes.bfloat16, dtypes.float16)
_FINAL = ("residual", "gelu_backward", "gelu_backward_tanh")  # steps that end an epilogue (they may change the dtype)


@dataclass
class _Gemm:
  """A matmul or gemm as the start of a longer gemm: its operands, steps, attributes and results."""
  op: MatmulOp | GemmOp
  inputs: list[SSAValue]
  steps: tuple[str, ...]
  tf32: bool | None

  @property
  def out(self) -> SSAValue: return self.op.results[0]

  @property
  def saved(self) -> list[SSAValue]: return list(self.op.results[1:])


def _gemm(v: SSAValue) -> _Gemm | None:
  """The matmul or gemm whose output v is, when its operands are float32, bfloat16 or float16."""
  op = v.owner
  if not isinstance(op, (MatmulOp, GemmOp)) or v is not op.results[0]: return None
  if aval(op.a.type).dtype not in _FLOATS: return None
  attrs = op.attrs()
  steps = gemm_steps(attrs["epilogue"]) if isinstance(op, GemmOp) else ()
  return _Gemm(op, [op.a, op.b, *(op.xs if isinstance(op, GemmOp) else ())], steps, attrs.get("tf32"))


def _dead(op, depth: int = 4) -> bool:
  """Whether nothing reads op's results but ops as dead (earlier passes leave dead ops to dce: fuse-casts' casts),
  looking `depth` readers deep (a longer dead chain counts as live: no fold, never a wrong one)."""
  return depth > 0 and isinstance(op, NovaOp) and all(_dead(u.operation, depth - 1) for r in op.results for u in r.uses)


def _reads(v: SSAValue) -> list:
  """The live ops reading v."""
  return [u.operation for u in v.uses if not _dead(u.operation)]


def _read_after(g: _Gemm, consumer, values: list[SSAValue]) -> bool:
  """Whether every live read of `values` other than the consumer's comes after the consumer (whose place the new gemm
  takes), in its block."""
  others = [op for v in values for op in _reads(v) if op is not consumer]
  if not others: return True  # NOTE: positions cost a walk of the block, so they are looked up only when needed
  block = consumer.parent_block()
  at = block.get_operation_index(consumer)
  return all(op.parent_block() is block and block.get_operation_index(op) > at for op in others)


def _fold(rewriter: PatternRewriter, consumer, g: _Gemm, steps: tuple[str, ...], x: SSAValue | None,
          keep_out: bool = False) -> None:
  """Replace `consumer` by g's gemm extended with `steps` (reading x, when given); g's saved values, and with
  `keep_out` its output (saved by the new "save" step), are read from the new gemm's extra results."""
  attrs = {"epilogue": ",".join(g.steps + steps), "dtype": aval(consumer.results[0].type).dtype}
  if g.tf32 is not None: attrs["tf32"] = g.tf32
  old = g.saved + ([g.out] if keep_out else [])
  new = GemmOp.make(g.inputs + ([x] if x is not None else []), attrs,
                    [consumer.results[0].type] + [v.type for v in old])
  rewriter.insert(new, InsertPoint.before(consumer))
  for v, r in zip(old, new.results[1:]): rewriter.replace_all_uses_with(v, r)
  rewriter.replace(consumer, [], [new.results[0]])


def _single(g: _Gemm, consumer) -> bool:
  """g's output is read by the consumer alone, and its saved values only after the consumer."""
  return _reads(g.out) == [consumer] and _read_after(g, consumer, g.saved)


class BiasPattern(RewritePattern):
  """add(matmul(a, b), bias) -> gemm(a, b, bias) {epilogue = "bias"}, bias of shape (N,) (either operand order),
  when the sum keeps the product's dtype.

    %p = nova.matmul %x, %wt : (tensor<8x16xf32>, tensor<16x4xf32>) -> tensor<8x4xf32>
    %y = nova.add %p, %bias : (tensor<8x4xf32>, tensor<4xf32>) -> tensor<8x4xf32>
      =>   %y = nova.gemm %x, %wt, %bias {epilogue = "bias", dtype = f32} : (...) -> tensor<8x4xf32>
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: AddOp, rewriter: PatternRewriter):
    for y, bias in ((op.x, op.y), (op.y, op.x)):
      g = _gemm(y)
      if g is None or g.steps or not _single(g, op): continue
      p, bv, r = aval(y.type), aval(bias.type), aval(op.result.type)
      if bv.shape == (p.shape[-1],) and bv.dtype.is_floating_point and r.dtype is p.dtype:
        return _fold(rewriter, op, g, ("bias",), bias)


class GeluPattern(RewritePattern):
  """gelu(gemm(...)) -> gemm(...) with the GELU in its epilogue; when the pre-activation is read later (by the
  backward's gelu_backward), a "save" step keeps it as an extra result.

    %h = nova.gemm %x, %wt, %b {epilogue = "bias", dtype = bf16} : (...) -> tensor<8x64xbf16>
    %y = nova.gelu %h {approximate = "none"} : (tensor<8x64xbf16>) -> tensor<8x64xbf16>
    ... nova.gelu_backward %g, %h ...
      =>   %y, %h2 = nova.gemm %x, %wt, %b {epilogue = "bias,save,gelu", dtype = bf16} : (...) -> (..., ...)
           ... nova.gelu_backward %g, %h2 ...
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: GeluOp, rewriter: PatternRewriter):
    g = _gemm(op.x)
    if g is None or g.steps not in ((), ("bias",)): return
    step = "gelu_tanh" if op.attrs()["approximate"] == "tanh" else "gelu"
    if _single(g, op): return _fold(rewriter, op, g, (step,), None)
    if _read_after(g, op, [g.out, *g.saved]): _fold(rewriter, op, g, ("save", step), None, keep_out=True)


class ResidualPattern(RewritePattern):
  """add(gemm(...), r) or add(r, gemm(...)) -> gemm(..., r) with "residual" last, r of the output's shape; the sum's
  dtype (the first operand's, as add's rule says) becomes the gemm's.

    %p = nova.gemm %h, %wt, %b {epilogue = "bias", dtype = bf16} : (...) -> tensor<8x16xbf16>
    %y = nova.add %x, %p : (tensor<8x16xf32>, tensor<8x16xbf16>) -> tensor<8x16xf32>
      =>   %y = nova.gemm %h, %wt, %b, %x {epilogue = "bias,residual", dtype = f32} : (...) -> tensor<8x16xf32>
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: AddOp, rewriter: PatternRewriter):
    if gemm_path() == "cublas": return  # cuBLASLt adds no residual: the add is left to fuse-norms' add_layer_norm
    for y, r in ((op.x, op.y), (op.y, op.x)):
      g = _gemm(y)
      if g is None or (g.steps and g.steps[-1] in _FINAL) or not _single(g, op): continue
      rv = aval(r.type)
      if rv.shape == aval(y.type).shape and rv.dtype.is_floating_point:
        return _fold(rewriter, op, g, ("residual",), r)


class GeluBackwardPattern(RewritePattern):
  """gelu_backward(matmul(a, b), x) -> gemm(a, b, x) {epilogue = "gelu_backward"}: GELU's backward in the epilogue of
  the GEMM that makes its incoming gradient (cuBLASLt's DGELU, which is the tanh form only).

    %g = nova.matmul %d, %w : (tensor<8x16xf32>, tensor<16x64xf32>) -> tensor<8x64xf32>
    %dx = nova.gelu_backward %g, %h {approximate = "none"} : (...) -> tensor<8x64xf32>
      =>   %dx = nova.gemm %d, %w, %h {epilogue = "gelu_backward", dtype = f32} : (...) -> tensor<8x64xf32>
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: GeluBackwardOp, rewriter: PatternRewriter):
    g = _gemm(op.g)
    if g is None or g.steps or not _single(g, op) or aval(op.x.type).shape != aval(op.g.type).shape: return
    _fold(rewriter, op, g, ("gelu_backward_tanh" if op.attrs()["approximate"] == "tanh" else "gelu_backward",), op.x)


@dataclass(frozen=True)
class FuseGemmPass(PatternPass):
  """Biases, GELUs, residual adds and GELU backwards folded into the GEMMs before them."""
  name = "fuse-gemm"
  PATTERNS = (BiasPattern(), GeluPattern(), ResidualPattern(), GeluBackwardPattern())


# *** weight gradients (the GPU's) ***

def _base(v: SSAValue) -> SSAValue:
  """The value v is a view of (through `view` ops, which keep the row-major order), or v."""
  while isinstance(v.owner, ViewOp): v = v.owner.x
  return v


def _widened(v: SSAValue) -> CastOp | None:
  """The one live reader of v when it is a cast widening v (a half) to float32."""
  readers = _reads(v)
  if len(readers) == 1 and isinstance(readers[0], CastOp) and aval(v.type).dtype in _FLOATS[1:]:
    if aval(readers[0].result.type).dtype is dtypes.float32: return readers[0]
  return None


def _chain(op, dtype) -> list | None:
  """From a sum, the ops up to the bias gradient: the sum, then views and a widening cast, each the previous one's
  only live reader, ending in a vector of `dtype`; None when they do not."""
  chain = [op]
  while True:
    readers = _reads(chain[-1].results[0])
    if len(readers) != 1 or not isinstance(readers[0], (ViewOp, CastOp)): break
    if isinstance(readers[0], CastOp) and _widened(chain[-1].results[0]) is None: break
    chain.append(readers[0])
  end = aval(chain[-1].results[0].type)
  return chain if len(end.shape) == 1 and end.dtype is dtype else None


def _bias_gradient(a: SSAValue, dtype, at) -> list | None:
  """The ops computing the sums of a's rows in `dtype` (a = permute(g), the bias gradient from g's columns, g a view
  of the output gradient), read only after `at`."""
  if not isinstance(a.owner, PermuteOp) or tuple(a.owner.attrs()["dims"]) != (1, 0): return None
  rows, base = aval(a.type).shape[0], _base(a.owner.x)
  views, found = [base], None
  while views:
    for op in _reads(views.pop()):
      if isinstance(op, ViewOp): views.append(op.result)
      elif isinstance(op, SumOp) and found is None:
        x = aval(op.x.type)
        if x.shape[-1:] == (rows,) and tuple(op.attrs()["dims"]) == tuple(range(len(x.shape) - 1)):
          found = _chain(op, dtype)
  if found is None: return None
  block = at.parent_block()
  return found if all(r.parent_block() is block and at.is_before_in_block(r) for r in _reads(found[-1].results[0])) \
    else None


def _column_sums(op: SumOp, stored: SSAValue, dtypes_: tuple) -> list | None:
  """The ops from sum `op` to a bias gradient in one of `dtypes_` (as `_chain`) when op sums the columns of `stored`
  (through row-major views whose last dim is stored's last), None otherwise."""
  x, row = aval(op.x.type), aval(stored.type).shape[-1]
  if _base(op.x) is not stored or x.shape[-1:] != (row,): return None
  if tuple(op.attrs()["dims"]) != tuple(range(len(x.shape) - 1)): return None
  return next((c for d in dtypes_ if (c := _chain(op, d)) is not None), None)


def _sums_as(rewriter: PatternRewriter, sums: SSAValue, chain: list, at) -> None:
  """The chain's bias gradient replaced by float32 `sums` (made by `at`), rounded after it when the chain ends in a
  half dtype (eager mode's sum rounds once too), and the chain erased."""
  end = chain[-1].results[0]
  if aval(end.type).dtype is not aval(sums.type).dtype:
    cast = CastOp.make([sums], {"dtype": aval(end.type).dtype}, [end.type])
    rewriter.insert(cast, InsertPoint.after(at))
    sums = cast.result
  rewriter.replace_all_uses_with(end, sums)
  for dead in reversed(chain): rewriter.erase(dead)


class NormBiasGradientPattern(RewritePattern):
  """The bias gradient of the linear layer whose output gradient a layer norm's backward writes (the residual stream's
  gradient, or autocast's half copy of it), summed by that backward kernel from the values it stores.

    %s, %dw, %db, %c = nova.layer_norm_backward %g, %x weight %w : ... {..., cast = bf16} : ... cast tensor<4x8x32xbf16>
    %t = nova.sum %c {dims = array<i64: 0, 1>, keepdim = false, dtype = bf16} : (...) -> tensor<32xbf16>
    %d = nova.cast %t {dtype = f32} : (tensor<32xbf16>) -> tensor<32xf32>
      =>   %s, %dw, %db, %c, %d = nova.layer_norm_backward ... {..., cast = bf16, bias_grad = true}
                                  : ... cast tensor<4x8x32xbf16> sum tensor<32xf32>
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: SumOp, rewriter: PatternRewriter):
    back = _base(op.x).owner
    if not isinstance(back, LayerNormBackwardOp) or back.dx_sum is not None or back.attrs()["n"] != 1: return
    stored = back.dx_cast or back.dx
    acc = dtypes.float64 if aval(back.x.type).dtype is dtypes.float64 else dtypes.float32
    chain = _column_sums(op, stored, (acc, aval(stored.type).dtype))
    if chain is None: return
    types = [None if v is None else v.type for v in back.graph_outputs()[:4]]
    new = LayerNormBackwardOp.make(back.graph_inputs(), {**back.attrs(), "bias_grad": True},
                                   types + [tensor_type(aval(stored.type).shape[-1:], acc)])
    rewriter.insert(new, InsertPoint.before(back))
    rewriter.replace(back, [], list(new.results[:len(back.results)]))
    _sums_as(rewriter, new.dx_sum, chain, new)


class GeluBackwardBiasGradientPattern(RewritePattern):
  """The bias gradient of an MLP's first linear layer, whose output gradient the GELU backward in the next layer's
  data-gradient GEMM writes: the gemm's epilogue gains a final "bias_grad" step (on cuBLASLt's path the GELU backward's
  kernel sums the columns it stores; after the synthesized GEMM a reduction does).

    %d = nova.gemm %g, %w, %h {epilogue = "gelu_backward", dtype = bf16} : (...) -> tensor<4x8x64xbf16>
    %t = nova.sum %d {dims = array<i64: 0, 1>, keepdim = false, dtype = bf16} : (...) -> tensor<64xbf16>
    %b = nova.cast %t {dtype = f32} : (tensor<64xbf16>) -> tensor<64xf32>
      =>   %d, %b = nova.gemm %g, %w, %h {epilogue = "gelu_backward,bias_grad", dtype = bf16}
                    : (...) -> (tensor<4x8x64xbf16>, tensor<64xf32>)
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: SumOp, rewriter: PatternRewriter):
    g = _base(op.x).owner
    if not isinstance(g, GemmOp) or not g.attrs()["epilogue"].endswith(("gelu_backward", "gelu_backward_tanh")): return
    out = aval(g.results[0].type)
    acc = dtypes.float64 if out.dtype is dtypes.float64 else dtypes.float32
    chain = _column_sums(op, g.results[0], (acc, out.dtype))
    if chain is None: return
    attrs = {**g.attrs(), "epilogue": g.attrs()["epilogue"] + ",bias_grad"}
    new = GemmOp.make([g.a, g.b, *g.xs], attrs, [r.type for r in g.results] + [tensor_type(out.shape[-1:], acc)])
    rewriter.insert(new, InsertPoint.before(g))
    rewriter.replace(g, [], list(new.results[:-1]))
    _sums_as(rewriter, new.results[-1], chain, new)


@dataclass(frozen=True)
class FuseBiasGradientsPass(PatternPass):
  """Bias gradients summed by the kernels that write the output gradients they sum (the GPU's; before fuse-wgrad,
  which would otherwise take them into cuBLASLt's BGRADB epilogue, a second pass over the gradient)."""
  name = "fuse-bias-grads"
  PATTERNS = (NormBiasGradientPattern(), GeluBackwardBiasGradientPattern())


class WeightGradientPattern(RewritePattern):
  """A weight gradient's matmul, with the cast widening it and the bias gradient from the same output gradient, as one
  weight_grad (module docstring).

    %a = nova.permute %g2 {dims = array<i64: 1, 0>} : (tensor<64x16xbf16>) -> tensor<16x64xbf16>
    %w = nova.matmul %a, %x : (tensor<16x64xbf16>, tensor<64x8xbf16>) -> tensor<16x8xbf16>
    %c = nova.cast %w {dtype = f32} : (tensor<16x8xbf16>) -> tensor<16x8xf32>
    %s = nova.sum %g {dims = array<i64: 0, 1>, keepdim = false, dtype = bf16} : (tensor<4x16x16xbf16>) -> tensor<16xbf16>
    %d = nova.cast %s {dtype = f32} : (tensor<16xbf16>) -> tensor<16xf32>
      =>   %c, %d = nova.weight_grad %a, %x {dtype = f32, bias_grad = true} : (...) -> (tensor<16x8xf32>, tensor<16xf32>)
  """
  @op_type_rewrite_pattern
  def match_and_rewrite(self, op: MatmulOp, rewriter: PatternRewriter):
    a, b, out = aval(op.a.type), aval(op.b.type), aval(op.result.type)
    if len(a.shape) != 2 or len(b.shape) != 2 or a.dtype not in _FLOATS or b.dtype is not a.dtype: return
    cast = _widened(op.result)
    dtype = dtypes.float32 if cast is not None else out.dtype
    bias = _bias_gradient(op.a, dtype, op)
    if cast is None and bias is None: return
    attrs = {"dtype": dtype, "bias_grad": bias is not None}
    if op.attrs().get("tf32") is not None: attrs["tf32"] = op.attrs()["tf32"]
    ends = [cast or op] + ([bias[-1]] if bias else [])
    new = WeightGradOp.make([op.a, op.b], attrs, [e.results[0].type for e in ends])
    rewriter.insert(new, InsertPoint.before(op))
    for end, r in zip(ends, new.results): rewriter.replace_all_uses_with(end.results[0], r)
    for dead in reversed([op] + ([cast] if cast else []) + (bias or [])):
      if all(not r.uses for r in dead.results): rewriter.erase(dead)


@dataclass(frozen=True)
class FuseWeightGradientsPass(PatternPass):
  """Weight gradients stored in float32 from the GEMM's accumulator, with their bias gradients from its epilogue
  (the GPU's; not exact: the module docstring)."""
  name = "fuse-wgrad"
  PATTERNS = (WeightGradientPattern(),)


# *** the GPU's choice per gemm ***

def _kmajor(v: SSAValue, a: bool) -> bool:
  """Whether an operand's unit stride runs along K, as far as the IR says: a transposed view (nn.Linear's weight.mT)
  flips the row-major default."""
  flipped = isinstance(v.owner, PermuteOp) and tuple(v.owner.attrs()["dims"][-2:]) == (len(aval(v.type).shape) - 1,
                                                                                     len(aval(v.type).shape) - 2)
  return a != flipped


GEMM_PATHS = ("auto", "cublas", "nova")
# NOTE: "auto" (the configurator's prediction) made the bf16 GPT-2 124M step slower on the H200 (46.8 ms against
# 44.1 ms before fuse-gemm, 2026-12-01: it picked the synthesized GEMM for every bf16 gemm), so cuBLASLt stays the
# default until `benchmarks/matmul.py --fused` has measured the prediction's hit rate
DEFAULT_GEMM_PATH = "cublas"


def gemm_path() -> str:
  """`BLUTRAIN_GEMM_PATH`: "auto" (the predicted faster path per gemm), "cublas" (the default) or "nova"."""
  path = os.environ.get("BLUTRAIN_GEMM_PATH", DEFAULT_GEMM_PATH)
  if path not in GEMM_PATHS:
    raise ValueError(f"BLUTRAIN_GEMM_PATH: expected one of {', '.join(GEMM_PATHS)}, got {path!r}")
  return path


def gemm_choice(op: GemmOp, hw: cfg.Hardware = cfg.H200) -> cfg.GemmChoice:
  """The configurator's choice for a gemm on the GPU: cuBLASLt and separate kernels, or one synthesized GEMM
  (`BLUTRAIN_GEMM_PATH`: "auto" takes the predicted faster path, "cublas" (the default) or "nova" imposes one path
  on every gemm; the predictions are reported either way)."""
  a, b = aval(op.a.type), aval(op.b.type)
  out = aval(op.results[0].type)
  M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
  rows = M * (math.prod(a.shape[:-2]) if len(b.shape) == 2 else 1)  # a shared weight folds the batch into rows
  batch = 1 if len(b.shape) == 2 else math.prod(out.shape[:-2])
  attrs = op.attrs()
  prec = ("tf32" if attrs.get("tf32") else "tf32x3") if a.dtype is dtypes.float32 else ""
  extra = [aval(x.type).dtype.itemsize for x in op.xs]
  aux = sum(aval(x.type).dtype.itemsize for x in (*op.xs, *op.results[1:]) if aval(x.type).shape == out.shape)
  p = cfg.GemmProblem(rows, N, K, batch, a.dtype.itemsize, out.dtype.itemsize, prec, _kmajor(op.a, True),
                      _kmajor(op.b, False), aux_itemsize=aux)
  choice = cfg.gemm_choice(p, gemm_steps(attrs["epilogue"]), extra, hw)
  forced = gemm_path()
  return choice if forced == "auto" else dataclasses.replace(choice, path=forced)


def gemm_report(module) -> list[str]:
  """One line per gemm of the module's function: its problem, epilogue and the GPU's choice with predicted times."""
  lines = []
  for op in function(module).body.block.ops:
    if not isinstance(op, GemmOp): continue
    a, b = aval(op.a.type), aval(op.b.type)
    attrs = op.attrs()
    lines.append(f"gemm {a.dtype.name}{list(a.shape)} @ {list(b.shape)} [{attrs['epilogue']}] -> "
                 f"{attrs['dtype'].name}: {gemm_choice(op)}")
  return lines
