"""Norm fusion (passes/fuse_norms.py): residual adds fold into the layer norms and their backward, IR in and IR out;
the fused graph computes the same bits as the unfused one; what must not fold does not; a compiled GPT step with the
fusions computes what eager mode does."""
import numpy as np
import pytest

import blutrain as bt
from blutrain import dtypes
from blutrain.nova import codegen, ir
from blutrain.nova.passes import DCEPass, FuseNormsPass
from blutrain.nova.pipeline import op_counts
from blutrain.ops import registry
from blutrain.shapes import ShapeError
from tests.nova.graphs import Builder
from tests.nova.test_passes import check, func

X, W = "tensor<4x32xf32>", "tensor<32xf32>"
LN = "{n = 1 : i64, eps = 1.000000e-05 : f64}"


def test_residual_add_and_norm_fold_ir():
  before = func(f"%x: {X}, %y: tensor<4x32xbf16>, %w: {W}, %b: {W}", f"{X}, {X}", f"""
    %h = nova.add %x, %y : ({X}, tensor<4x32xbf16>) -> {X}
    %n = nova.layer_norm %h weight %w : {W} bias %b : {W} {LN} : {X} -> {X}
    %e = nova.exp %h : ({X}) -> {X}
    func.return %n, %e : {X}, {X}""")
  after = func(f"%x: {X}, %y: tensor<4x32xbf16>, %w: {W}, %b: {W}", f"{X}, {X}", f"""
    %h, %n = nova.add_layer_norm %x, %y weight %w : {W} bias %b : {W} {LN} : {X}, tensor<4x32xbf16> -> {X}, {X}
    %e = nova.exp %h : ({X}) -> {X}
    func.return %n, %e : {X}, {X}""")
  check((FuseNormsPass(),), before, after)


@pytest.mark.parametrize("first", [True, False])
def test_residual_gradient_folds_into_the_norm_backward_ir(first):
  add = "%r, %d" if first else "%d, %r"
  before = func(f"%g: {X}, %x: {X}, %w: {W}, %r: {X}", f"{X}, {W}", f"""
    %d, %dw = nova.layer_norm_backward %g, %x weight %w : {W} {{n = 1 : i64, eps = 1.000000e-05 : f64, has_bias = false}} : {X}, {X} -> {X} dweight {W}
    %s = nova.add {add} : ({X}, {X}) -> {X}
    func.return %s, %dw : {X}, {W}""")
  after = func(f"%g: {X}, %x: {X}, %w: {W}, %r: {X}", f"{X}, {W}", f"""
    %s, %dw = nova.layer_norm_backward %g, %x weight %w : {W} residual %r : {X} {{n = 1 : i64, eps = 1.000000e-05 : f64, has_bias = false}} : {X}, {X} -> {X} dweight {W}
    func.return %s, %dw : {X}, {W}""")
  check((FuseNormsPass(),), before, after)


def _residual_block(half=None, affine=True, reuse_h=True, later_residual=False, cast=None):
  """A pre-norm block's pattern: h = x + y, n = layer_norm(h) (h read again, by the norm's backward, when reuse_h), and
  in the backward the residual gradient r plus the norm's input gradient (r made after the norm's backward when
  later_residual), that sum also cast to `cast` (autocast's cast for the next matmul) when given."""
  b = Builder()
  x, y, g, r = b.input((6, 32)), b.input((6, 32), half or dtypes.float32), b.input((6, 32)), b.input((6, 32))
  w, bias = (b.input((32,)), b.input((32,))) if affine else (None, None)
  h = b("add", x, y)
  n = b("layer_norm", h, w, bias, n=1, eps=1e-5)
  dx, dw, db, _, _ = b("layer_norm_backward", g, h if reuse_h else x, w, None, n=1, eps=1e-5, has_bias=affine)
  if later_residual: r = b("exp", r)
  s = b("add", r, dx)
  return b.output(n, s, *(v for v in (dw, db) if v is not None), *([b("cast", s, dtype=cast)] if cast else []))


def _same_bits(graph, args):
  plain, fused = ir.to_module(graph), ir.to_module(graph)
  FuseNormsPass().run(fused)
  fused.verify()
  for got, want in zip(codegen.load(codegen.generate(fused))(*args), codegen.load(codegen.generate(plain))(*args)):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
  return op_counts(fused)


def _args(half=None, affine=True):
  rng = np.random.default_rng(4)
  a = [(rng.standard_normal((6, 32)) * 3 + 1).astype(np.float32),
       rng.standard_normal((6, 32)).astype((half or dtypes.float32).np),
       *(rng.standard_normal((6, 32)).astype(np.float32) for _ in range(2))]
  return a + ([rng.standard_normal(32).astype(np.float32) for _ in range(2)] if affine else [])


@pytest.mark.parametrize("half, affine, later_residual", [(None, True, False), (dtypes.bfloat16, True, True),
                                                          (dtypes.float16, False, False)])
def test_fused_graph_computes_the_same_bits(half, affine, later_residual):
  counts = _same_bits(_residual_block(half, affine, later_residual=later_residual), _args(half, affine))
  assert counts == {"add_layer_norm": 1, "layer_norm_backward": 1, **({"exp": 1} if later_residual else {})}


@pytest.mark.parametrize("cast", [dtypes.bfloat16, dtypes.float16])
def test_the_half_copy_of_the_residual_gradient_comes_out_of_the_norms_backward(cast):
  graph = _residual_block(dtypes.bfloat16, cast=cast)
  counts = _same_bits(graph, _args(dtypes.bfloat16))
  assert counts == {"add_layer_norm": 1, "layer_norm_backward": 1}, counts  # no add, no cast
  module = ir.to_module(graph)
  FuseNormsPass().run(module)
  (back,) = [op for op in ir.function(module).body.block.ops if op.name == "nova.layer_norm_backward"]
  assert back.attrs()["cast"] is cast and back.residual is not None and back.dx_cast is not None


def test_a_cast_to_float64_or_of_a_half_gradient_stays_a_cast():
  for x_dtype, cast in ((dtypes.float32, dtypes.float64), (dtypes.bfloat16, dtypes.float32)):
    b = Builder()
    g, x = b.input((6, 32), x_dtype), b.input((6, 32), x_dtype)
    dx = b("layer_norm_backward", g, x, None, None, n=1, eps=1e-5, has_bias=False)[0]
    module = ir.to_module(b.output(b("cast", dx, dtype=cast)))
    FuseNormsPass().run(module)
    assert op_counts(module) == {"layer_norm_backward": 1, "cast": 1}


def test_a_sum_used_by_the_norm_alone_keeps_its_add():
  counts = _same_bits(_residual_block(reuse_h=False), _args())
  assert counts["add"] == 1 and counts["layer_norm"] == 1 and "add_layer_norm" not in counts


@pytest.mark.parametrize("case", ["broadcast", "expand", "float64", "half_stream", "grad_used_twice", "double_grad"])
def test_what_must_not_fold(case):
  b = Builder()
  if case in ("broadcast", "expand", "float64", "half_stream"):
    dt = {"float64": dtypes.float64, "half_stream": dtypes.bfloat16}.get(case, dtypes.float32)
    x = b.input((6, 32), dt)
    y = b.input((32,)) if case == "broadcast" else \
        b("expand", b.input((1, 32)), shape=(6, 32)) if case == "expand" else b.input((6, 32), dt)
    h = b("add", x, y)
    graph = b.output(b("layer_norm", h, None, None, n=1, eps=1e-5), b("neg", h))
  else:
    dt = dtypes.float64 if case == "double_grad" else dtypes.float32
    g, x, r = b.input((6, 32), dt), b.input((6, 32), dt), b.input((6, 32), dt)
    dx = b("layer_norm_backward", g, x, None, None, n=1, eps=1e-5, has_bias=False)[0]
    graph = b.output(b("add", r, dx), *([b("neg", dx)] if case == "grad_used_twice" else []))
  module = ir.to_module(graph)
  assert not FuseNormsPass().run(module)


def test_the_op_checks_its_operands():
  P = registry["add_layer_norm"]
  with pytest.raises(ShapeError, match="does not match x"):
    bt.ops.core.apply(P, bt.randn(4, 8), bt.randn(8), None, None, n=1, eps=1e-5)
  with pytest.raises(TypeError, match="float32 x"):
    bt.ops.core.apply(P, bt.randn(4, 8).double(), bt.randn(4, 8).double(), None, None, n=1, eps=1e-5)
  with pytest.raises(ShapeError, match="residual gradient"):
    bt.ops.core.apply(registry["layer_norm_backward"], bt.randn(4, 8), bt.randn(4, 8), None, bt.randn(8), n=1,
                      eps=1e-5, has_bias=False)


def test_eager_ops_equal_the_unfused_ones():
  x, y, w, b = bt.randn(5, 16), bt.randn(5, 16).to(bt.bfloat16), bt.randn(16), bt.randn(16)
  h, n = bt.ops.core.apply(registry["add_layer_norm"], x, y, w, b, n=1, eps=1e-5)
  want = x + y.float()
  np.testing.assert_array_equal(h.numpy(), want.numpy())
  np.testing.assert_array_equal(n.numpy(), bt.nn.functional.layer_norm(want, (16,), w, b).numpy())
  g, r = bt.randn(5, 16), bt.randn(5, 16)
  plain = bt.ops.core.apply(registry["layer_norm_backward"], g, x, w, None, n=1, eps=1e-5, has_bias=True)
  fused = bt.ops.core.apply(registry["layer_norm_backward"], g, x, w, r, n=1, eps=1e-5, has_bias=True)
  np.testing.assert_array_equal(fused[0].numpy(), (r + plain[0]).numpy())
  for a, c in zip(fused[1:3], plain[1:3]): np.testing.assert_array_equal(a.numpy(), c.numpy())
  assert fused[3] is None and plain[3] is None  # no cast asked for


def _cross_entropy_pair(half=None, g_from=None):
  """A loss and its gradient, as autograd records them: cross_entropy(x, t) and cross_entropy_backward(g, x, t). g is
  an input, or computed after the loss: from the loss itself (`g_from="loss"`, a loss of the loss), or from the
  targets as a mean's 1/count (`g_from="targets"`)."""
  b = Builder()
  x, t, g = b.input((9, 40), half or dtypes.float32), b.input((9,), dtypes.int64), b.input((9,))
  x = b("neg", x)  # made by the step, as logits are: the gradient may take their buffer
  loss = b("cross_entropy", x, t, ignore_index=-100, dtype=dtypes.float32 if half else None)
  if g_from == "loss": g = b("mul", g, b("exp", loss))
  if g_from == "targets":
    count = b("cast", b("sum", b("ne", t, b("full", shape=(), value=-100, dtype=dtypes.int64)), dims=(0,),
                        keepdim=False, dtype=dtypes.int64), dtype=dtypes.float32)
    g = b("expand", b("view", b("div", b("full", shape=(), value=1.0, dtype=dtypes.float32), count), shape=(1,)),
          shape=(9,))
  return b.output(loss, b("cross_entropy_backward", g, x, t, ignore_index=-100))


def _ce_args(half=None):
  rng = np.random.default_rng(5)
  t = rng.integers(0, 40, 9)
  t[4] = -100
  return [(rng.standard_normal((9, 40)) * 4).astype((half or dtypes.float32).np), t,
          rng.standard_normal(9).astype(np.float32)]


def _fused_module(graph):
  module = ir.to_module(graph)
  FuseNormsPass().run(module)
  DCEPass().run(module)
  return module, list(ir.function(module).body.block.ops)


@pytest.mark.parametrize("half", [None, dtypes.bfloat16])
def test_the_cross_entropy_keeps_its_row_statistics_for_a_backward_that_needs_its_loss(half):
  counts = _same_bits(_cross_entropy_pair(half, "loss"), _ce_args(half))
  assert counts == {"neg": 1, "cross_entropy_with_stats": 1, "cross_entropy_backward_with_stats": 1, "exp": 1,
                    "mul": 1}, counts
  module, ops = _fused_module(_cross_entropy_pair(half, "loss"))
  from blutrain.nova.memory import reused_in_place
  back = next(op for op in ops if op.name == "nova.cross_entropy_backward_with_stats")
  assert reused_in_place(module)[back.result] is back.logits, "the gradient is still written over the logits"


@pytest.mark.parametrize("half", [None, dtypes.bfloat16])
@pytest.mark.parametrize("g_from", [None, "targets"])
def test_a_cross_entropy_whose_gradient_is_known_ahead_becomes_one_op(half, g_from):
  """g from an input, or from the targets after the loss (the ops computing it move ahead): one
  cross_entropy_with_grad at the loss's place, the same bits, its gradient written over the logits."""
  counts = _same_bits(_cross_entropy_pair(half, g_from), _ce_args(half))
  assert counts["cross_entropy_with_grad"] == 1 and not {"cross_entropy", "cross_entropy_with_stats",
                                                         "cross_entropy_backward_with_stats"} & set(counts), counts
  module, ops = _fused_module(_cross_entropy_pair(half, g_from))
  from blutrain.nova.memory import reused_in_place
  fused = next(op for op in ops if op.name == "nova.cross_entropy_with_grad")
  assert reused_in_place(module)[fused.dlogits] is fused.logits
  if g_from == "targets":  # the ops computing g moved ahead of it (the generated code above ran them in order)
    assert ops.index(fused.g.owner) < ops.index(fused) and counts["div"] == 1 and counts["expand"] == 1


@pytest.mark.parametrize("case", ["another_target", "another_ignore_index"])
def test_a_backward_of_another_loss_keeps_its_own_statistics(case):
  b = Builder()
  x, t, g = b.input((9, 40)), b.input((9,), dtypes.int64), b.input((9,))
  loss = b("cross_entropy", x, t, ignore_index=-100)
  target = b("neg", t) if case == "another_target" else t
  index = -100 if case == "another_target" else -1
  graph = b.output(loss, b("cross_entropy_backward", g, x, target, ignore_index=index))
  assert not FuseNormsPass().run(ir.to_module(graph))


def _attention_gradient(dq_also_returned=False, order=(0, 1, 2)):
  """A self-attention's backward as autograd records it: q, k, v's gradients permuted back to (B, L, H, E) and
  concatenated (in `order`) into the projection's gradient (B, L, 3, H, E)."""
  b = Builder()
  q, k, v, g = (b.input((2, 3, 8, 4)) for _ in range(4))
  o = b("flash_attention", q, k, v, causal=True, scale=0.5)
  grads = b("flash_attention_backward", g, q, k, v, o, causal=True, scale=0.5)
  parts = [b("view", b("permute", grads[i], dims=(0, 2, 1, 3)), shape=(2, 8, 1, 3, 4)) for i in order]
  return b.output(o, b("cat", *parts, dim=2), *([grads[0]] if dq_also_returned else []))


def test_attention_gradients_are_written_packed():
  rng = np.random.default_rng(6)
  args = [rng.standard_normal((2, 3, 8, 4)).astype(np.float32) for _ in range(4)]
  counts = _same_bits(_attention_gradient(), args)
  assert counts == {"flash_attention": 1, "flash_attention_backward_packed": 1}, counts


@pytest.mark.parametrize("case", ["dq_also_returned", "another_order"])
def test_attention_gradients_read_elsewhere_stay_apart(case):
  graph = _attention_gradient(dq_also_returned=case == "dq_also_returned",
                              order=(1, 0, 2) if case == "another_order" else (0, 1, 2))
  assert not FuseNormsPass().run(ir.to_module(graph))


def _attention_output(other_reader=False):
  """A transformer's attention output as autograd records it: y.transpose(1, 2).contiguous(), y read again by the
  backward; with other_reader the transposed view is also read by another op than the copy."""
  b = Builder()
  q, k, v, g = (b.input((2, 3, 8, 4)) for _ in range(4))
  o = b("flash_attention", q, k, v, causal=True, scale=0.5)
  p = b("permute", o, dims=(0, 2, 1, 3))
  y = b("view", b("copy", p), shape=(2, 8, 12))
  grads = b("flash_attention_backward", g, q, k, v, o, causal=True, scale=0.5)
  return b.output(b("exp", y), *grads, *([b("neg", p)] if other_reader else []))


def test_the_attention_output_is_written_transposed():
  rng = np.random.default_rng(7)
  args = [rng.standard_normal((2, 3, 8, 4)).astype(np.float32) for _ in range(4)]
  counts = _same_bits(_attention_output(), args)
  # the permute is the backward's view of the new output (no copy left)
  assert counts == {"flash_attention_transposed": 1, "permute": 1, "view": 1, "flash_attention_backward": 1,
                    "exp": 1}, counts


def test_an_attention_output_read_transposed_elsewhere_keeps_its_copy():
  assert not FuseNormsPass().run(ir.to_module(_attention_output(other_reader=True)))


def _clip_then_adamw(grad_dtype=dtypes.float32, return_grads=False, unscaled_grad=False):
  """clip_grad_norm_'s scale of two gradients, then one AdamW update of their parameters (a third, unscaled gradient
  and parameter in the same update when unscaled_grad)."""
  b = Builder()
  k = 3 if unscaled_grad else 2
  shapes = [(4, 8), (8,), (3,)][:k]
  params, grads = [b.input(s) for s in shapes], [b.input(s, grad_dtype) for s in shapes]
  moments = [b.input(s) for s in shapes for _ in range(2)]
  steps, lr, c = [b.input((), dtypes.float64) for _ in shapes], b.input((), dtypes.float64), b.input(())
  scaled = list(b("scale", *grads[:2], c))
  outs = b("adamw", *params, *scaled, *grads[2:], *moments[0::2], *moments[1::2], *steps, lr, n=k, beta1=0.9,
           beta2=0.95, eps=1e-8, weight_decay=0.1)
  return b.output(*outs, *(scaled if return_grads else []))


def _clip_args(grad_dtype=dtypes.float32, k=2):
  rng = np.random.default_rng(5)
  shapes = [(4, 8), (8,), (3,)][:k]
  return [*(rng.standard_normal(s).astype(np.float32) for s in shapes),
          *(rng.standard_normal(s).astype(grad_dtype.np) for s in shapes),
          *(a for s in shapes for a in (rng.standard_normal(s).astype(np.float32),
                                        np.abs(rng.standard_normal(s)).astype(np.float32))),
          *(np.array(3.0) for _ in shapes), np.array(1e-2), np.array(0.37, np.float32)]


@pytest.mark.parametrize("grad_dtype", [dtypes.float32, dtypes.bfloat16])
def test_clip_folds_into_adamw_and_computes_the_same_bits(grad_dtype):
  counts = _same_bits(_clip_then_adamw(grad_dtype), _clip_args(grad_dtype))
  assert counts == {"adamw": 1}


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_clip_folds_into_sgd_and_computes_the_same_bits(momentum):
  b = Builder()
  shapes = [(4, 8), (8,)]
  params, grads = [b.input(s) for s in shapes], [b.input(s, dtypes.bfloat16) for s in shapes]
  bufs = [b.input(s) for s in shapes] if momentum else []
  lr, c = b.input((), dtypes.float64), b.input(())
  outs = b("sgd", *params, *b("scale", *grads, c), *bufs, lr, n=2, momentum=momentum, dampening=0.1,
           weight_decay=0.01, nesterov=False, maximize=False, is_first_step=False)
  rng = np.random.default_rng(6)
  args = [*(rng.standard_normal(s).astype(np.float32) for s in shapes),
          *(rng.standard_normal(s).astype(dtypes.bfloat16.np) for s in shapes),
          *(rng.standard_normal(s).astype(np.float32) for s in shapes if momentum), np.array(0.1),
          np.array(0.37, np.float32)]
  assert _same_bits(b.output(*outs), args) == {"sgd": 1}


@pytest.mark.parametrize("case", ["grads_read_after_the_step", "an_unscaled_gradient_in_the_update"])
def test_clip_stays_where_the_scaled_gradients_are_read_or_not_all_are_scaled(case):
  read = case == "grads_read_after_the_step"
  graph = _clip_then_adamw(return_grads=read, unscaled_grad=not read)
  module = ir.to_module(graph)
  assert not FuseNormsPass().run(module)


def _train(compiled: bool, amp: bool, clip: bool, steps: int = 3):
  from blutrain.models import GPT, GPTConfig
  bt.manual_seed(0)
  model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
  opt = model.configure_optimizers(0.1, 1e-2, betas=(0.9, 0.95))  # two groups: two adamw ops read the clipped grads

  def step(x, y):
    with bt.autocast(device_type="cpu", dtype=bt.bfloat16, enabled=amp):
      _, loss = model(x, y)
    loss.backward()
    if clip: bt.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step(); opt.zero_grad()
    return loss
  fn = bt.compile(step) if compiled else step
  rng = np.random.default_rng(1)
  losses = [fn(*(bt.from_numpy(rng.integers(0, 64, (2, 16))) for _ in range(2))).item() for _ in range(steps)]
  return losses, [p.detach().numpy() for p in model.parameters()], fn


@pytest.mark.parametrize("amp, clip", [(False, False), (False, True), (True, False), (True, True)])
def test_compiled_gpt_step_with_fused_norms_equals_eager(amp, clip, tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path))
  eager_losses, eager_params, _ = _train(False, amp, clip)
  losses, params, fn = _train(True, amp, clip)
  np.testing.assert_allclose(losses, eager_losses, rtol=1e-5)
  for a, b in zip(params, eager_params): np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  source = open(fn.info["source"]).read()
  # 5 norms (2 per block and the final one): all but the first, whose sum adds a broadcast position embedding, have
  # their add folded, here into the GEMM before it (fuse-gemm runs first: a residual epilogue writes the sum as it
  # writes the product), else into the norm; the 4 that feed a residual stream's gradient take it into their backward
  assert source.count('kernels["add_layer_norm"]') + source.count("epilogue='bias,residual'") == 4
  backward = [line for line in source.splitlines() if 'kernels["layer_norm_backward"]' in line]
  assert sum(", None, n=" not in line for line in backward) == 4
  # the step ends with zero_grad, so the clipped gradients are read by AdamW alone and it scales them as it reads them
  assert 'kernels["scale"]' not in source and source.count("clip=True") == (2 if clip else 0)
  assert source.count('kernels["cross_entropy_with_grad"]') == 1 and 'kernels["cross_entropy' not in source.replace(
    'kernels["cross_entropy_with_grad"]', "")  # the mean's 1/count moved ahead of the loss: one kernel for both
  assert source.count('kernels["flash_attention_backward_packed"]') == 2 and 'kernels["cat"]' not in source
  assert source.count('kernels["flash_attention_transposed"]') == 2 and 'kernels["copy"]' not in source


# *** batch norm: the residual add and the ReLU after it ***

BN_X, BN_C = "tensor<4x8x6x6xf32>", "tensor<8xf32>"
BN = "{eps = 1.000000e-05 : f64, training = true}"


def test_residual_add_and_relu_fold_into_the_batch_norm_ir():
  before = func(f"%x: {BN_X}, %m: {BN_C}, %v: {BN_C}, %w: {BN_C}, %b: {BN_C}, %r: {BN_X}", BN_X, f"""
    %n = nova.batch_norm %x, %m, %v weight %w : {BN_C} bias %b : {BN_C} {BN} : {BN_X}, {BN_C}, {BN_C} -> {BN_X}
    %e = nova.exp %r : ({BN_X}) -> {BN_X}
    %s = nova.add %e, %n : ({BN_X}, {BN_X}) -> {BN_X}
    %y = nova.relu %s : ({BN_X}) -> {BN_X}
    func.return %y : {BN_X}""")
  after = func(f"%x: {BN_X}, %m: {BN_C}, %v: {BN_C}, %w: {BN_C}, %b: {BN_C}, %r: {BN_X}", BN_X, f"""
    %e = nova.exp %r : ({BN_X}) -> {BN_X}
    %y = nova.batch_norm %x, %m, %v weight %w : {BN_C} bias %b : {BN_C} residual %e : {BN_X} {{eps = 1.000000e-05 : f64, training = true, relu = true}} : {BN_X}, {BN_C}, {BN_C} -> {BN_X}
    func.return %y : {BN_X}""")
  check((FuseNormsPass(),), before, after)


def _bn_block(dt, bias=True, residual=True, later_residual=True, relu=True):
  """A ResNet block's ends: n = batch_norm(x) (training form, its statistics from x), then + r (r made after the norm
  when later_residual, as a downsample branch is) and relu, each when asked for; and the backward: relu's (which
  reads the relu's output; with a residual, its result is also the residual branch's gradient, an output), then the
  norm's (which reads x and not n)."""
  b = Builder()
  x, r, g = b.input((4, 8, 6, 6), dt), b.input((4, 8, 6, 6), dt), b.input((4, 8, 6, 6), dt)
  w, bb = b.input((8,)), b.input((8,)) if bias else None
  mean, var = b("batch_norm_stats", x)[:2]
  out = b("batch_norm", x, mean, var, w, bb, eps=1e-5, training=True)
  if residual: out = b("add", out, b("neg", r) if later_residual else r)
  if relu: out = b("relu", out)
  d = b("relu_backward", g, out) if relu else g
  back = b("batch_norm_backward", d, x, mean, var, w, eps=1e-5, training=True, input_grad=True, weight_grad=True,
           bias_grad=bias)
  return b.output(out, *(v for v in back if v is not None), *([d] if relu and residual else []))


def _bn_args(dt):
  rng = np.random.default_rng(6)
  big = [(rng.standard_normal((4, 8, 6, 6)) * 3 - 1).astype(dt.np) for _ in range(3)]
  return big + [rng.standard_normal(8).astype(np.float32) for _ in range(2)]


@pytest.mark.parametrize("dt", [dtypes.float32, dtypes.bfloat16, dtypes.float64])
@pytest.mark.parametrize("residual, relu", [(True, True), (False, True), (True, False)])
def test_fused_batch_norm_computes_the_same_bits(dt, residual, relu):
  """relu's backward folds into the norm's when its result is read there alone (not also as a residual gradient)."""
  counts = _same_bits(_bn_block(dt, residual=residual, relu=relu), _bn_args(dt))
  assert counts == {"batch_norm_stats": 1, "batch_norm": 1, "batch_norm_backward": 1,
                    **({"neg": 1} if residual else {}), **({"relu_backward": 1} if residual and relu else {})}, counts


@pytest.mark.parametrize("case", ["no_bias", "norm_read_twice", "broadcast", "other_dtype"])
def test_what_must_not_fold_into_the_batch_norm(case):
  """Without a bias the residual stays an add (the relu after it too: it reads the add); a norm output read besides
  the add keeps both; a residual that broadcasts, or of another dtype, stays an add."""
  b = Builder()
  x, w = b.input((4, 8, 6, 6)), b.input((8,))
  mean, var = b("batch_norm_stats", x)[:2]
  n = b("batch_norm", x, mean, var, w, None if case == "no_bias" else b.input((8,)), eps=1e-5, training=True)
  r = b.input((8, 1, 1)) if case == "broadcast" else b.input((4, 8, 6, 6), dtypes.float64 if case == "other_dtype"
                                                             else dtypes.float32)
  outs = [b("relu", b("add", n, r))] + ([b("neg", n)] if case == "norm_read_twice" else [])
  module = ir.to_module(b.output(*outs))
  assert not FuseNormsPass().run(module)


class _Block(bt.nn.Module):
  """A ResNet basic block with a downsample branch, whose add reads two batch norms."""
  def __init__(self):
    super().__init__()
    nn = bt.nn
    self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8)
    self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8)
    self.down, self.bn3 = nn.Conv2d(3, 8, 1, 2, bias=False), nn.BatchNorm2d(8)
    self.fc = nn.Linear(8, 4)

  def forward(self, x):
    out = bt.nn.functional.relu(self.bn1(self.conv1(x)))
    out = bt.nn.functional.relu(self.bn2(self.conv2(out)) + self.bn3(self.down(x)))
    return self.fc(out.mean((2, 3)))


@pytest.mark.parametrize("amp", [False, True])
def test_compiled_resnet_block_with_fused_batch_norms_equals_eager(amp, tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))
  runs = []
  for compiled in (False, True):
    bt.manual_seed(0)
    model = _Block()
    opt = bt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, y):
      with bt.autocast(device_type="cpu", dtype=bt.bfloat16, enabled=amp):
        loss = bt.nn.functional.cross_entropy(model(x), y)
      loss.backward()
      opt.step(); opt.zero_grad()
      return loss
    fn = bt.compile(step) if compiled else step
    rng = np.random.default_rng(2)
    losses = [fn(bt.tensor(rng.standard_normal((4, 3, 8, 8)).astype(np.float32)),
                 bt.tensor(rng.integers(0, 4, 4))).item() for _ in range(3)]
    runs.append((losses, [p.detach().numpy() for p in model.parameters()], fn))
  (eager_losses, eager_params, _), (losses, params, fn) = runs
  np.testing.assert_allclose(losses, eager_losses, rtol=1e-5)
  for a, b in zip(params, eager_params): np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  source = open(fn.info["source"]).read()
  forward = [line for line in source.splitlines() if 'kernels["batch_norm"]' in line]
  assert len(forward) == 3 and sum("relu=True" in line for line in forward) == 2, forward
  # the first block's relu backward folds into bn1's backward; the second's result is read by two norms' backwards
  assert 'kernels["relu"]' not in source and source.count("relu_backward") == 1, source


# *** max pooling: the window search stores the maxima ***

POOL = dict(kernel=(3, 3), stride=(2, 2), padding=(1, 1), dilation=(1, 1))


def test_max_pool_values_come_out_of_the_window_search():
  b = Builder()
  x = b.input((2, 4, 9, 8))
  idx = b("max_pool2d_indices", x, **POOL, out_size=(5, 4))
  graph = b.output(b("max_pool2d_values", x, idx, **POOL), idx)
  a = np.random.default_rng(8).standard_normal((2, 4, 9, 8)).round(1).astype(np.float32)  # rounding: ties
  a.flat[[3, 40]] = np.nan
  assert _same_bits(graph, [a]) == {"max_pool2d_with_indices": 1}


@pytest.mark.parametrize("case", ["other_input", "other_geometry"])
def test_max_pool_values_of_other_indices_stay_a_gather(case):
  b = Builder()
  x, y = b.input((2, 4, 9, 8)), b.input((2, 4, 9, 8))
  idx = b("max_pool2d_indices", y if case == "other_input" else x, **POOL, out_size=(5, 4))
  geometry = {**POOL, "dilation": (1, 2)} if case == "other_geometry" else POOL
  module = ir.to_module(b.output(b("max_pool2d_values", x, idx, **geometry)))
  assert not FuseNormsPass().run(module)
