"""Cast fusion (passes/fuse_casts.py): autocast's casts around the cross-entropy fold into its kernels, IR in and IR
out; the folded step computes the same losses and gradients bit for bit; what must not fold does not."""
import numpy as np
import pytest

import blutrain as bt
from blutrain import dtypes
from blutrain.nova import codegen, ir
from blutrain.nova.passes import DCEPass, FuseCastsPass
from blutrain.nova.pipeline import op_counts
from tests.nova.graphs import Builder
from tests.nova.test_passes import check, func

LOGITS = "tensor<8x50xbf16>"


def _loss_and_grad(half=dtypes.bfloat16, grad_dtype=None, reuse_grad=False):
  """The autocast pattern: the half logits cast up, the losses and their gradient in float32, the gradient cast
  back to the logits' dtype (`grad_dtype`); `reuse_grad` also returns the float32 gradient."""
  b = Builder()
  x, t, g = b.input((8, 50), half), b.input((8,), dtypes.int64), b.input((8,))
  up = b("cast", x, dtype=dtypes.float32)
  loss = b("cross_entropy", up, t, ignore_index=3)
  d = b("cross_entropy_backward", g, up, t, ignore_index=3)
  outs = [loss, b("cast", d, dtype=grad_dtype or half)] + ([d] if reuse_grad else [])
  return b.output(*outs)


def test_both_casts_fold_into_the_cross_entropy_ir():
  before = func(f"%x: {LOGITS}, %t: tensor<8xi64>, %g: tensor<8xf32>", f"tensor<8xf32>, {LOGITS}", f"""
    %u = nova.cast %x {{dtype = f32}} : ({LOGITS}) -> tensor<8x50xf32>
    %l = nova.cross_entropy %u, %t {{ignore_index = 3 : i64}} : (tensor<8x50xf32>, tensor<8xi64>) -> tensor<8xf32>
    %d = nova.cross_entropy_backward %g, %u, %t {{ignore_index = 3 : i64}} : (tensor<8xf32>, tensor<8x50xf32>, tensor<8xi64>) -> tensor<8x50xf32>
    %e = nova.cast %d {{dtype = bf16}} : (tensor<8x50xf32>) -> {LOGITS}
    func.return %l, %e : tensor<8xf32>, {LOGITS}""")
  after = func(f"%x: {LOGITS}, %t: tensor<8xi64>, %g: tensor<8xf32>", f"tensor<8xf32>, {LOGITS}", f"""
    %l = nova.cross_entropy %x, %t {{ignore_index = 3 : i64, dtype = f32}} : ({LOGITS}, tensor<8xi64>) -> tensor<8xf32>
    %e = nova.cross_entropy_backward %g, %x, %t {{ignore_index = 3 : i64}} : (tensor<8xf32>, {LOGITS}, tensor<8xi64>) -> {LOGITS}
    func.return %l, %e : tensor<8xf32>, {LOGITS}""")
  check((FuseCastsPass(), DCEPass()), before, after)


@pytest.mark.parametrize("half", [dtypes.bfloat16, dtypes.float16])
def test_folded_step_computes_the_same_bits(half):
  graph = _loss_and_grad(half)
  plain, fused = ir.to_module(graph), ir.to_module(graph)
  for p in (FuseCastsPass(), DCEPass()): p.run(fused)
  assert "cast" in op_counts(plain) and "cast" not in op_counts(fused)
  rng = np.random.default_rng(0)
  args = [(rng.standard_normal((8, 50)) * 4).astype(half.np), rng.integers(0, 50, 8), rng.standard_normal(8).astype(np.float32)]
  want = codegen.load(codegen.generate(plain))(*args)
  got = codegen.load(codegen.generate(fused))(*args)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case", ["grad_used_in_float32", "not_back_to_the_logits_dtype", "not_a_half"])
def test_what_must_not_fold(case):
  if case == "not_a_half":
    b = Builder()
    x, t = b.input((8, 50), dtypes.float32), b.input((8,), dtypes.int64)
    graph = b.output(b("cross_entropy", b("cast", x, dtype=dtypes.float64), t, ignore_index=-100))
  else:
    graph = _loss_and_grad(grad_dtype=dtypes.float16 if case == "not_back_to_the_logits_dtype" else None,
                           reuse_grad=case == "grad_used_in_float32")
  module = ir.to_module(graph)
  FuseCastsPass().run(module)
  DCEPass().run(module)
  backward = [op for op in ir.function(module).body.block.ops if op.name == "nova.cross_entropy_backward"]
  assert all(str(op.logits.type).endswith("xf32>") for op in backward)
  if case == "not_a_half": assert op_counts(module)["cast"] == 1


def test_compiled_autocast_step_equals_eager_and_drops_the_casts(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path))
  from blutrain.models import GPT, GPTConfig
  losses, params = [], []
  for compiled in (False, True):
    bt.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    opt = bt.optim.AdamW(model.parameters(), lr=1e-2)

    def step(x, y):
      with bt.autocast(device_type="cpu", dtype=bt.bfloat16):
        _, loss = model(x, y)
      loss.backward()
      opt.step(); opt.zero_grad()
      return loss
    fn = bt.compile(step) if compiled else step
    rng = np.random.default_rng(1)
    losses.append([fn(*(bt.from_numpy(rng.integers(0, 64, (2, 16))) for _ in range(2))).item() for _ in range(3)])
    params.append([p.detach().numpy() for p in model.parameters()])
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
  for a, b in zip(*params): np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
  assert fn.info["counts_before"]["cast"] - fn.info["counts_after"]["cast"] >= 2


def test_widened_operand_of_an_arithmetic_op_ir():
  X, Y = "tensor<4x8xf32>", "tensor<4x8xbf16>"
  before = func(f"%x: {X}, %y: {Y}", f"{X}, {X}, {X}", f"""
    %w = nova.cast %y {{dtype = f32}} : ({Y}) -> {X}
    %a = nova.add %w, %x : ({X}, {X}) -> {X}
    %s = nova.sub %x, %w : ({X}, {X}) -> {X}
    %t = nova.sub %w, %x : ({X}, {X}) -> {X}
    func.return %a, %s, %t : {X}, {X}, {X}""")
  after = func(f"%x: {X}, %y: {Y}", f"{X}, {X}, {X}", f"""
    %w = nova.cast %y {{dtype = f32}} : ({Y}) -> {X}
    %a = nova.add %x, %y : ({X}, {Y}) -> {X}
    %s = nova.sub %x, %y : ({X}, {Y}) -> {X}
    %t = nova.sub %w, %x : ({X}, {X}) -> {X}
    func.return %a, %s, %t : {X}, {X}, {X}""")
  check((FuseCastsPass(), DCEPass()), before, after)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "maximum", "minimum"])
def test_widened_operands_compute_the_same_bits(op):
  b = Builder()
  x, y = b.input((4, 8)), b.input((8,), dtypes.bfloat16)
  graph = b.output(b(op, x, b("cast", y, dtype=dtypes.float32)), b(op, b("cast", y, dtype=dtypes.float32), x))
  plain, fused = ir.to_module(graph), ir.to_module(graph)
  for p in (FuseCastsPass(), DCEPass()): p.run(fused)
  commutative = op in ("add", "mul", "maximum", "minimum")
  assert op_counts(fused).get("cast", 0) == (0 if commutative else 1)
  rng = np.random.default_rng(2)
  args = [rng.standard_normal((4, 8)).astype(np.float32), (rng.standard_normal(8) * 3).astype(dtypes.bfloat16.np)]
  args[0][0, 0], args[1][1] = np.nan, 0.0
  for a, w in zip(codegen.load(codegen.generate(fused))(*args), codegen.load(codegen.generate(plain))(*args)):
    np.testing.assert_array_equal(a, w)


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_casts_fold_and_compute_the_same_bits(affine):
  """The autocast pattern around a layer norm: its float32 output cast down for a matmul, the matmul's half gradient
  cast up for its backward."""
  b = Builder()
  x, g = b.input((6, 32)), b.input((6, 32), dtypes.bfloat16)
  w, bias = (b.input((32,)), b.input((32,))) if affine else (None, None)
  y = b("layer_norm", x, w, bias, n=1, eps=1e-5)
  h = b("cast", y, dtype=dtypes.bfloat16)
  grads = b("layer_norm_backward", b("cast", g, dtype=dtypes.float32), x, w, None, n=1, eps=1e-5, has_bias=affine)
  graph = b.output(h, *(v for v in grads if v is not None))
  plain, fused = ir.to_module(graph), ir.to_module(graph)
  for p in (FuseCastsPass(), DCEPass()): p.run(fused)
  assert "cast" not in op_counts(fused)
  rng = np.random.default_rng(3)
  args = [(rng.standard_normal((6, 32)) * 3 + 1).astype(np.float32), rng.standard_normal((6, 32)).astype(dtypes.bfloat16.np)]
  if affine: args += [rng.standard_normal(32).astype(np.float32) for _ in range(2)]
  for a, w_ in zip(codegen.load(codegen.generate(fused))(*args), codegen.load(codegen.generate(plain))(*args)):
    assert a.dtype == w_.dtype
    np.testing.assert_array_equal(a, w_)


def test_layer_norm_output_used_in_float32_keeps_its_cast():
  b = Builder()
  x = b.input((6, 32))
  y = b("layer_norm", x, None, None, n=1, eps=1e-5)
  graph = b.output(b("cast", y, dtype=dtypes.bfloat16), b("exp", y))
  module = ir.to_module(graph)
  FuseCastsPass().run(module)
  assert op_counts(module)["cast"] == 1


@pytest.mark.parametrize("update", ["sgd", "adamw"])
def test_widened_gradients_fold_into_the_update_and_compute_the_same_bits(update):
  """Autocast's weight casts leave each weight's gradient widened from bf16 before the optimizer reads it: the update
  reads the bf16 gradient itself (two parameters, one bf16 gradient widened, one float32)."""
  b = Builder()
  p, q, g, h = b.input((4, 8)), b.input((8,)), b.input((4, 8), dtypes.bfloat16), b.input((8,))
  lr, wide = b.full((), 0.1, dtypes.float64), b("cast", g, dtype=dtypes.float32)
  if update == "sgd":
    outs = b("sgd", p, q, wide, h, b.input((4, 8)), b.input((8,)), lr, n=2, momentum=0.9, dampening=0.0,
             weight_decay=0.01, nesterov=True, maximize=False, is_first_step=False)
  else:
    steps = [b.full((), 3.0, dtypes.float64) for _ in range(2)]
    outs = b("adamw", p, q, wide, h, b.input((4, 8)), b.input((8,)), b.input((4, 8)), b.input((8,)), *steps, lr, n=2,
             beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
  graph = b.output(*outs)
  plain, fused = ir.to_module(graph), ir.to_module(graph)
  for pass_ in (FuseCastsPass(), DCEPass()): pass_.run(fused)
  assert "cast" in op_counts(plain) and "cast" not in op_counts(fused)
  rng = np.random.default_rng(5)
  args = [rng.standard_normal(v.shape).astype(v.dtype.np) for v in graph.inputs]
  if update == "adamw": args[-2:] = [np.abs(a) for a in args[-2:]]  # second moments
  for a, w in zip(codegen.load(codegen.generate(fused))(*args), codegen.load(codegen.generate(plain))(*args)):
    assert a.dtype == w.dtype
    np.testing.assert_array_equal(a, w)


@pytest.mark.parametrize("case", ["clipped", "gradient_also_returned"])
def test_widened_gradient_keeps_its_cast(case):
  """A clipped update rounds the scaled gradient to its own dtype, and a returned gradient is read in float32."""
  b = Builder()
  p, g, buf = b.input((4, 8)), b.input((4, 8), dtypes.bfloat16), b.input((4, 8))
  wide, lr = b("cast", g, dtype=dtypes.float32), b.full((), 0.1, dtypes.float64)
  extra = [b.full((), 0.5)] if case == "clipped" else []
  outs = b("sgd", p, wide, buf, lr, *extra, n=1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
           maximize=False, is_first_step=False, clip=case == "clipped")
  module = ir.to_module(b.output(*outs, *([wide] if case == "gradient_also_returned" else [])))
  FuseCastsPass().run(module)
  assert op_counts(module)["cast"] == 1


# *** group_casts: the GPU's casts of the weights in one launch ***

def _weights_step():
  """The input and three weights cast to bf16 for matmuls before the peak (a big product), and one weight cast after
  it, which stays where it is."""
  b = Builder()
  x = b.input((64, 32))
  w1, w2, w3, w4 = (b.input((32, 32)) for _ in range(4))
  h = b("cast", x, dtype=dtypes.bfloat16)
  for w in (w1, w2, w3): h = b("matmul", h, b("cast", w, dtype=dtypes.bfloat16))
  big = b("tanh", b("cast", b("matmul", h, b("permute", h, dims=(1, 0))), dtype=dtypes.float32))  # the peak
  late = b("matmul", h, b("cast", w4, dtype=dtypes.bfloat16))
  return b.output(b("sum", big, dims=(0, 1), keepdim=False, dtype=dtypes.float32), late, h)


def test_the_weights_casts_before_the_peak_become_one_cast_many():
  from blutrain.nova.passes.fuse_casts import group_casts
  module = ir.to_module(_weights_step())
  grouped = module.clone()
  assert group_casts(grouped)
  counts = op_counts(grouped)
  assert counts["cast_many"] == 1 and counts["cast"] == 2, counts  # the product's widening and w4's stay
  ops = list(ir.function(grouped).body.block.ops)
  many = next(op for op in ops if op.name == "nova.cast_many")
  assert ops.index(many) == 0 and len(many.results) == 4
  rng = np.random.default_rng(0)
  args = [rng.standard_normal((64, 32)).astype(np.float32)] + [rng.standard_normal((32, 32)).astype(np.float32)
                                                               for _ in range(4)]
  for got, want in zip(codegen.load(codegen.generate(grouped))(*args), codegen.load(codegen.generate(module))(*args)):
    np.testing.assert_array_equal(got, want)


def test_a_lone_cast_or_a_cast_of_an_intermediate_is_not_grouped():
  from blutrain.nova.passes.fuse_casts import group_casts
  b = Builder()
  x, w = b.input((8, 8)), b.input((8, 8))
  y = b("matmul", b("cast", b("exp", x), dtype=dtypes.bfloat16), b("cast", w, dtype=dtypes.bfloat16))
  module = ir.to_module(b.output(y))
  assert not group_casts(module) and op_counts(module)["cast"] == 2


def test_casts_are_not_grouped_when_the_live_peak_would_grow():
  """The peak (a 20 KB temporary beside an 8 KB weight cast) comes after an early 24 KB temporary: the weight's cast
  moved up to the first cast would be alive beside the early one, 32 KB, above the peak."""
  from blutrain.nova.passes.fuse_casts import group_casts
  b = Builder()
  x, w1, big_w = b.input((8, 8)), b.input((8, 8)), b.input((64, 64))
  early = b("matmul", b("cast", x, dtype=dtypes.bfloat16), b("cast", w1, dtype=dtypes.bfloat16))
  row = b("view", b("cast", early, dtype=dtypes.float32), shape=(1, 64))

  def temporary(rows):  # rows x 64 float32, summed away at once
    return b("sum", b("exp", b("expand", row, shape=(rows, 64))), dims=(0, 1), keepdim=False, dtype=dtypes.float32)
  first = temporary(96)
  cast = b("cast", big_w, dtype=dtypes.bfloat16)
  second = temporary(80)
  weight = b("sum", cast, dims=(0, 1), keepdim=False, dtype=dtypes.float32)
  module = ir.to_module(b.output(b("add", b("add", first, second), weight)))
  assert not group_casts(module) and "cast_many" not in op_counts(module)
