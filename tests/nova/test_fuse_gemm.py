"""The fuse-gemm pass: which ops fold into a GEMM and which do not (and why), compiled == eager for models with and
without biases, exact and tanh GELU, float32 and bfloat16 autocast, and the configurator's choice per gemm."""
import dataclasses

import numpy as np
import pytest

import blutrain as bt
from blutrain import configurator as cfg
from blutrain import dtypes, nn
from blutrain.models import GPT, GPTConfig
from blutrain.nn import functional as F
from blutrain.nova import codegen, ir, remat
from blutrain.nova.dialect import GemmOp, WeightGradOp
from blutrain.shapes import ShapeError
from blutrain.nova.passes import DCEPass, FuseBiasGradientsPass, FuseGemmPass, FuseWeightGradientsPass
from blutrain.nova.passes.fuse_gemm import gemm_choice, gemm_report
from blutrain.nova.pipeline import compile_graph, op_counts, optimize
from blutrain.nova.remat import rematerialize
from tests.nova.graphs import Builder, evaluate, linear

F32, BF16 = dtypes.float32, dtypes.bfloat16


@pytest.fixture(autouse=True)
def _every_fold(monkeypatch):
  """The pass as it folds for the synthesized GEMM (`auto`): under the default `cublas` path residual adds stay."""
  monkeypatch.setenv("BLUTRAIN_GEMM_PATH", "auto")


def _fused(graph):
  """The module after fuse-gemm and dce, and its gemms' epilogues in order."""
  module = ir.to_module(graph)
  FuseGemmPass().run(module)
  DCEPass().run(module)
  module.verify()
  ops = [op for op in ir.function(module).body.block.ops if isinstance(op, GemmOp)]
  return module, [op.attrs()["epilogue"] for op in ops]


def _arrays(graph, seed=0):
  rs = np.random.default_rng(seed)
  return [rs.standard_normal(v.shape).astype(v.dtype.np) if v.dtype.is_floating_point else
          rs.integers(-3, 4, v.shape).astype(v.dtype.np) for v in graph.inputs]


def _same_as_eager(graph, exact=True):
  arrays = _arrays(graph)
  got = compile_graph(graph, verify=True).fn(*arrays)
  for g, e in zip(got, evaluate(graph, arrays)):
    assert g.dtype == e.dtype and g.shape == e.shape
    if exact: np.testing.assert_array_equal(g.astype(np.float64), e.astype(np.float64))
    else: np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=1e-5, atol=1e-6)


def _mlp(dtype=F32, bias=True, approximate="none", read_pre=False, residual=False):
  """x -> linear -> gelu -> linear (-> + x); with `read_pre` the pre-activation is also an output (as the backward
  reads it)."""
  b = Builder()
  x, w1, w2 = b.input((2, 5, 8), dtype), b.input((16, 8), dtype), b.input((8, 16), dtype)
  b1, b2 = (b.input((16,), dtype), b.input((8,), dtype)) if bias else (None, None)
  h = linear(b, x, w1, b1)
  y = linear(b, b("gelu", h, approximate=approximate), w2, b2)
  if residual: y = b("add", x, y)
  return b.output(y, *([h] if read_pre else []))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_mlp_folds_bias_gelu_and_residual(dtype, approximate):
  graph = _mlp(dtype, approximate=approximate, residual=True)
  gelu = "gelu_tanh" if approximate == "tanh" else "gelu"
  module, epilogues = _fused(graph)
  assert epilogues == [f"bias,{gelu}", "bias,residual"]
  assert set(op_counts(module)) == {"gemm", "permute"}
  _same_as_eager(graph)


def test_without_bias_the_gelu_folds_into_the_bare_matmul():
  graph = _mlp(bias=False)
  assert _fused(graph)[1] == ["gelu"]
  _same_as_eager(graph)


def test_a_pre_activation_read_later_is_saved():
  graph = _mlp(read_pre=True)
  module, epilogues = _fused(graph)
  assert epilogues == ["bias,save,gelu", "bias"]
  ret = list(ir.function(module).body.block.ops)[-1]
  first = next(op for op in ir.function(module).body.block.ops if isinstance(op, GemmOp))
  assert ret.operands[1] is first.results[1], "the pre-activation output is the gemm's saved result"
  _same_as_eager(graph)


def test_a_pre_activation_read_before_the_gelu_is_not_folded():
  b = Builder()
  x, w = b.input((4, 8)), b.input((16, 8))
  h = b("matmul", x, b("permute", w, dims=(1, 0)))
  e = b("exp", h)  # read between the product and the GELU: a gemm in the GELU's place would come too late
  graph = b.output(b("gelu", h, approximate="none"), e)
  module, epilogues = _fused(graph)
  assert epilogues == [] and op_counts(module)["matmul"] == 1
  _same_as_eager(graph)


def test_a_product_read_elsewhere_keeps_its_bias_add():
  b = Builder()
  x, w, bias = b.input((4, 8)), b.input((16, 8)), b.input((16,))
  p = b("matmul", x, b("permute", w, dims=(1, 0)))
  graph = b.output(b("add", p, bias), b("exp", p))
  assert _fused(graph)[1] == []
  _same_as_eager(graph)


@pytest.mark.parametrize("shape", [(4, 1), (1, 1), (1, 16), (2, 4, 16)], ids=["column", "one", "row-2d", "batch"])
def test_an_add_that_is_neither_bias_nor_residual_is_not_folded(shape):
  """Only a bias of shape (N,) or a residual of the output's shape fold: a column, a 1 x 1, a (1, N) row and an add
  that broadcasts the output up do not."""
  b = Builder()
  x, w, v = b.input((4, 8)), b.input((16, 8)), b.input(shape)
  graph = b.output(b("add", b("matmul", x, b("permute", w, dims=(1, 0))), v))
  assert _fused(graph)[1] == []
  _same_as_eager(graph)


def test_a_bias_add_that_changes_the_dtype_is_not_folded():
  b = Builder()
  x, w, bias = b.input((4, 8), BF16), b.input((16, 8), BF16), b.input((16,))
  p = b("matmul", x, b("permute", w, dims=(1, 0)))
  widened = b.output(b("add", bias, p))  # float32 first: a float32 sum of a bfloat16 product
  assert _fused(widened)[1] == []
  b = Builder()
  x, w, bias = b.input((4, 8), BF16), b.input((16, 8), BF16), b.input((16,))
  kept = b.output(b("add", b("matmul", x, b("permute", w, dims=(1, 0))), bias))  # bfloat16 sum of a float32 bias
  assert _fused(kept)[1] == ["bias"]
  _same_as_eager(kept)


@pytest.mark.parametrize("dtype", [dtypes.float64, dtypes.int32], ids=["f64", "i32"])
def test_products_the_gpu_gemm_does_not_multiply_stay_matmuls(dtype):
  b = Builder()
  x, w, bias = b.input((4, 8), dtype), b.input((8, 16), dtype), b.input((16,), dtype)
  assert _fused(b.output(b("add", b("matmul", x, w), bias)))[1] == []


def test_residual_takes_the_first_operands_dtype_and_ends_the_epilogue():
  b = Builder()
  x, w, r = b.input((4, 8), BF16), b.input((8, 16), BF16), b.input((4, 16))
  y = b("add", r, b("matmul", x, w))  # float32 + bfloat16 -> float32
  graph = b.output(b("gelu", y, approximate="none"))
  module, epilogues = _fused(graph)
  assert epilogues == ["residual"] and op_counts(module)["gelu"] == 1, "nothing folds after a residual"
  gemm = next(op for op in ir.function(module).body.block.ops if isinstance(op, GemmOp))
  assert gemm.attrs()["dtype"] is F32
  _same_as_eager(graph)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_gelu_backward_folds_into_the_gemm_of_its_incoming_gradient(approximate, dtype):
  b = Builder()
  d, w, h = b.input((6, 8), dtype), b.input((8, 16), dtype), b.input((6, 16), dtype)
  graph = b.output(b("gelu_backward", b("matmul", d, w), h, approximate=approximate))
  suffix = "_tanh" if approximate == "tanh" else ""
  assert _fused(graph)[1] == [f"gelu_backward{suffix}"]
  _same_as_eager(graph)


def test_the_gemm_rule_checks_its_operands():
  b = Builder()
  x, w, v = b.input((4, 8)), b.input((8, 16)), b.input((4,))
  with pytest.raises(ValueError, match="bias step reads a floating tensor of shape \\(16,\\)"):
    b("gemm", x, w, v, epilogue="bias", dtype=F32)
  with pytest.raises(ValueError, match="reads 1 tensors, got 0"):
    b("gemm", x, w, epilogue="residual", dtype=F32)
  with pytest.raises(ValueError, match="unknown epilogue steps \\['relu'\\]"):
    b("gemm", x, w, epilogue="relu", dtype=F32)
  with pytest.raises(ValueError, match="only a final residual or gelu_backward step may change the dtype"):
    b("gemm", x, w, epilogue="gelu", dtype=BF16)


# *** whole models: compiled == eager on the CPU ***

def _train(make, compiled: bool, autocast: bool, steps=3):
  bt.manual_seed(0)
  model = make()
  opt = bt.optim.AdamW(model.parameters(), lr=1e-2)

  def step(x, y):
    with bt.autocast("cpu", dtype=bt.bfloat16, enabled=autocast):
      out = model(x, y)[1] if isinstance(model, GPT) else F.cross_entropy(model(x), y)
    out.backward()
    opt.step()
    opt.zero_grad()
    return out
  fn = bt.compile(step) if compiled else step
  rng = np.random.default_rng(1)
  losses = []
  for _ in range(steps):
    if isinstance(model, GPT): x, y = (bt.from_numpy(rng.integers(0, 48, (2, 16))) for _ in range(2))
    else: x, y = bt.from_numpy(rng.standard_normal((6, 12)).astype(np.float32)), bt.from_numpy(rng.integers(0, 5, 6))
    losses.append(fn(x, y).item())
  return losses, [p.detach().numpy().copy() for p in model.parameters()], getattr(fn, "info", None)


def _gpt(bias):
  return lambda: GPT(GPTConfig(vocab_size=48, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=bias))


def _mlp_model(bias, approximate):
  return lambda: nn.Sequential(nn.Linear(12, 32, bias=bias), nn.GELU(approximate), nn.Linear(32, 5, bias=bias))


@pytest.mark.parametrize("autocast", [False, True], ids=["f32", "bf16-autocast"])
@pytest.mark.parametrize("make", [_gpt(True), _gpt(False), _mlp_model(True, "none"), _mlp_model(False, "tanh")],
                         ids=["gpt", "gpt-nobias", "mlp", "mlp-nobias-tanh"])
def test_models_compiled_equal_eager(make, autocast, tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path))
  eager_losses, eager_params, _ = _train(make, False, autocast)
  losses, params, info = _train(make, True, autocast)
  np.testing.assert_allclose(losses, eager_losses, rtol=1e-6)
  for a, b in zip(eager_params, params): np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
  assert info["counts_after"].get("gemm", 0) >= 2, info["counts_after"]


# *** the choice ***

def test_the_choice_is_the_faster_prediction_and_cublas_keeps_what_its_epilogue_does():
  gpt2 = [(16384, 3072, 768, "fwd"), (16384, 768, 3072, "fwd"), (16384, 3072, 768, "dx"), (768, 768, 16384, "dw")]
  for M, N, K, lay in gpt2:
    for item, prec in ((2, ""), (4, "tf32"), (4, "tf32x3")):
      a_k, b_k = lay != "dw", lay == "fwd"
      p = cfg.GemmProblem(M, N, K, 1, item, item, prec, a_k, b_k)
      for steps, sizes in (((), []), (("bias",), [item]), (("bias", "save", "gelu"), [item]),
                           (("bias", "residual"), [item, 4]), (("gelu_backward",), [item])):
        c = cfg.gemm_choice(p, steps, sizes)
        faster = "nova" if c.nova_s < c.cublas_s and prec != "tf32x3" else "cublas"  # float32: eager's SGEMM
        assert c.path == faster and c.cublas_s > 0 and c.nova_s > 0
        assert c.cublas_epilogue == (("bias",) if steps[:1] == ("bias",) else ())
        assert "save" not in c.separate and len(c.separate) == len(steps) - len(c.cublas_epilogue) - steps.count("save")
      bare = cfg.gemm_choice(p, (), [])
      added = {s: cfg.gemm_choice(p, s, [4] if s == ("residual",) else []) for s in (("residual",), ("gelu",))}
      extra = {s: (c.cublas_s - bare.cublas_s, c.nova_s - bare.nova_s) for s, c in added.items()}
      # as measured (NOVA_STEP_S): a residual read in the epilogue costs less than a kernel of its own; on a large
      # output an exact GELU's arithmetic on the accumulator tile costs more than a GELU kernel streaming it
      assert extra["residual",][0] > extra["residual",][1]
      assert (extra["gelu",][0] < extra["gelu",][1]) == (M * N >= 1 << 22)


def test_cublas_does_a_tanh_gelu_and_its_backward_in_its_epilogue_on_half_operands():
  fwd, dx = cfg.GemmProblem(16384, 3072, 768), cfg.GemmProblem(16384, 3072, 768, b_kmajor=False)
  for steps in cfg.CUBLAS_GELU_EPILOGUES:
    c = cfg.gemm_choice(dx if steps[0].startswith("gelu_backward") else fwd, steps,
                        [2] * sum(s in cfg.GEMM_TENSOR_STEPS for s in steps))
    assert c.cublas_epilogue == steps and c.separate == () and c.path == "cublas", (steps, c)
  tanh, exact = (cfg.gemm_choice(fwd, ("bias", "save", g), [2]) for g in ("gelu_tanh", "gelu"))
  assert tanh.cublas_s < exact.cublas_s and exact.separate == ("gelu",)
  summed = cfg.gemm_choice(dx, ("gelu_backward_tanh", "bias_grad"), [2])  # DGELU_BGRAD measured slower
  assert summed.cublas_epilogue == () and summed.separate == ("gelu_backward_tanh",)
  tf32 = cfg.GemmProblem(16384, 3072, 768, 1, 4, 4, "tf32")  # float32 operands: a GELU kernel of its own
  assert cfg.gemm_choice(tf32, ("bias", "save", "gelu_tanh"), [4]).separate == ("gelu_tanh",)


def test_codegen_for_the_gpu_passes_the_choice_and_the_report_names_it():
  pytest.importorskip("blutrain.backend.cuda", reason="the CUDA backend's packages are not installed")
  module = ir.to_module(_mlp(BF16, read_pre=True, residual=True))
  FuseGemmPass().run(module)
  DCEPass().run(module)
  gemms = [op for op in ir.function(module).body.block.ops if isinstance(op, GemmOp)]
  assert "path=" not in codegen.generate(module, target="cpu")
  source = codegen.generate(module, target="cuda")
  lines = gemm_report(module)
  assert len(lines) == len(gemms) == 2
  for op, line in zip(gemms, lines):
    c = gemm_choice(op)
    assert line.endswith(str(c)) and f"[{op.attrs()['epilogue']}]" in line
    assert f"epilogue={op.attrs()['epilogue']!r}, dtype=dtypes.{op.attrs()['dtype'].name}, path={c.path!r})" in source


def test_remat_remakes_a_fused_gelu_output_from_the_saved_pre_activation(monkeypatch):
  """The forward's gemm {bias,save,gelu} keeps the pre-activation for the backward; its GELU output, read again after
  the peak, is recomputed there as gelu(pre-activation) (a gemm is never cloned), with the same values."""
  monkeypatch.setattr(remat, "DEFAULT_TIME_SHARE", 0.2)  # a graph of a few small ops: a launch is a tenth of the step
  S = 64
  b = Builder()
  x, w, bias = b.input((S, S)), b.input((S, S)), b.input((S,))
  pre = linear(b, x, w, bias)
  act = b("gelu", pre, approximate="none")
  y = b("matmul", act, w)                                              # the forward's last read of act
  peak = b("matmul", b("tanh", y), w)                                  # act alive across here, unread
  graph = b.output(b("add", b("mul", peak, act), pre))                 # the backward reads act and pre
  module = ir.to_module(graph)
  FuseGemmPass().run(module)
  DCEPass().run(module)
  assert [op.attrs()["epilogue"] for op in ir.function(module).body.block.ops if isinstance(op, GemmOp)] == \
    ["bias,save,gelu"]
  report = rematerialize(module)
  assert [r.ops for r in report.recomputed] == [["gelu"]], report.report()
  assert report.peak_after < report.peak_before
  gemm = next(op for op in ir.function(module).body.block.ops if isinstance(op, GemmOp))
  users = [u.operation for u in gemm.results[1].uses]
  assert len(users) == 2 and all(op.parent_block() is not None for op in users), "no template stays a user"
  module.verify()
  arrays = _arrays(graph)
  got = codegen.load(codegen.generate(module))(*arrays)
  np.testing.assert_array_equal(got[0], evaluate(graph, arrays)[0])


def test_the_rule_saves_once_and_never_last():
  b = Builder()
  x, w = b.input((4, 8)), b.input((8, 16))
  for epilogue in ("save,gelu,save", "save,save,gelu", "gelu,save"):
    with pytest.raises(ValueError, match="saves at most one value"): b("gemm", x, w, epilogue=epilogue, dtype=F32)


def test_dead_readers_left_by_earlier_passes_do_not_block_a_fold():
  """fuse-casts leaves its replaced casts to dce: a dead cast of the product is no reader."""
  b = Builder()
  x, w, bias = b.input((4, 8), BF16), b.input((16, 8), BF16), b.input((16,), BF16)
  p = b("matmul", x, b("permute", w, dims=(1, 0)))
  b("exp", b("cast", p, dtype=F32))  # a dead chain
  graph = b.output(b("add", p, bias))
  assert _fused(graph)[1] == ["bias"]


def test_a_gpt_step_under_autocast_has_its_five_gemms_per_block(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))
  bt.manual_seed(0)
  model = GPT(GPTConfig(vocab_size=48, block_size=16, n_layer=2, n_head=2, n_embd=32))
  opt = bt.optim.AdamW(model.parameters(), lr=1e-3)

  def step(x, y):
    with bt.autocast("cpu", dtype=bt.bfloat16):
      loss = model(x, y)[1]
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss
  fn = bt.compile(step, dump_ir=str(tmp_path / "ir"))
  rng = np.random.default_rng(0)
  for _ in range(2): fn(*(bt.from_numpy(rng.integers(0, 48, (2, 16))) for _ in range(2)))
  module = ir.parse_module(next((tmp_path / "ir").rglob("*-dce.mlir")).read_text())
  gemms = [(op.attrs()["epilogue"], op.attrs()["dtype"]) for op in ir.function(module).body.block.ops
           if isinstance(op, GemmOp)]
  assert not list((tmp_path / "ir").rglob("*-fuse-wgrad.mlir")), "the CPU's compiled steps stay exact"
  block = [("bias", BF16), ("bias,residual", F32), ("bias,save,gelu", BF16), ("bias,residual", F32)]
  # and in the backward: GELU's backward twice, and the tied embedding's gradient: the output head's weight gradient
  # (a bias-free matmul) plus the embedding's backward
  want = block * 2 + [("gelu_backward", BF16)] * 2 + [("residual", F32)]
  assert sorted(gemms, key=str) == sorted(want, key=str)


def test_the_gemm_path_can_be_imposed(monkeypatch):
  b = Builder()
  x, w, bias = b.input((64, 32)), b.input((48, 32)), b.input((48,))
  module = optimize(ir.to_module(b.output(linear(b, x, w, bias))))
  (op,) = [o for o in ir.function(module).body.block.ops if isinstance(o, GemmOp)]
  monkeypatch.setenv("BLUTRAIN_GEMM_PATH", "auto")
  auto = gemm_choice(op)
  monkeypatch.delenv("BLUTRAIN_GEMM_PATH")
  assert gemm_choice(op) == dataclasses.replace(auto, path="cublas"), "cuBLASLt is the default"
  for path in ("cublas", "nova"):
    monkeypatch.setenv("BLUTRAIN_GEMM_PATH", path)
    assert gemm_choice(op) == dataclasses.replace(auto, path=path)
  monkeypatch.setenv("BLUTRAIN_GEMM_PATH", "fastest")
  with pytest.raises(ValueError, match="BLUTRAIN_GEMM_PATH"): gemm_choice(op)


def test_under_the_cublas_path_a_residual_add_is_left_to_the_layer_norm(monkeypatch):
  """cuBLASLt adds no residual, so folding the add would only move it into a kernel of its own: it stays an add,
  which fuse-norms folds into the layer norm that reads the sum."""
  b = Builder()
  x, w, bias = b.input((64, 32)), b.input((32, 32)), b.input((32,))
  h = b("add", x, linear(b, x, w, bias))
  graph = b.output(h, b("layer_norm", h, None, None, n=1, eps=1e-5))
  monkeypatch.setenv("BLUTRAIN_GEMM_PATH", "cublas")
  module, epilogues = _fused(graph)
  assert epilogues == ["bias"] and op_counts(module)["add"] == 1
  monkeypatch.setenv("BLUTRAIN_GEMM_PATH", "auto")
  assert _fused(graph)[1] == ["bias,residual"]


# *** fuse-wgrad: the GPU's weight gradients ***

def _linear_grads(dtype=BF16, widen=True, bias=True, bias_keepdim=True):
  """A linear layer's weight and bias gradients from its output gradient g (4, 16, 16) and input x (64, 8), as
  autograd records them under autocast: dW = cast(g^T x), db = cast(sum(g over rows))."""
  b = Builder()
  g, x = b.input((4, 16, 16), dtype), b.input((4, 16, 8), dtype)
  gt = b("permute", b("view", g, shape=(64, 16)), dims=(1, 0))
  dw = b("matmul", gt, b("view", x, shape=(64, 8)))
  outs = [b("cast", dw, dtype=F32) if widen else dw]
  if bias:
    s = b("sum", g, dims=(0, 1), keepdim=bias_keepdim, dtype=dtype)
    s = b("view", s, shape=(16,)) if bias_keepdim else s
    outs.append(b("cast", s, dtype=F32) if widen else s)
  return b.output(*outs)


def _wgrad(graph):
  module = ir.to_module(graph)
  plain = module.clone()
  FuseWeightGradientsPass().run(module)
  module.verify()
  return plain, module, op_counts(module)


@pytest.mark.parametrize("keepdim", [True, False])
def test_a_weight_gradient_takes_its_widening_cast_and_the_bias_gradient(keepdim):
  plain, module, counts = _wgrad(_linear_grads(bias_keepdim=keepdim))
  assert counts["weight_grad"] == 1 and not {"matmul", "sum", "cast"} & set(counts), counts
  wg = next(op for op in ir.function(module).body.block.ops if isinstance(op, WeightGradOp))
  assert wg.attrs()["dtype"] is F32 and wg.attrs()["bias_grad"]
  rs = np.random.default_rng(0)
  args = [rs.standard_normal(s).astype(BF16.np) for s in ((4, 16, 16), (4, 16, 8))]
  got = codegen.load(codegen.generate(module))(*args)
  eager = codegen.load(codegen.generate(plain))(*args)
  g64, x64 = (a.astype(np.float64).reshape(64, -1) for a in args)
  for out, e, want in zip(got, eager, (g64.T @ x64, g64.sum(0))):
    assert out.dtype == np.float32
    # float32 straight from the accumulator: closer to the float64 truth than eager's bf16 rounding, and within one
    # bf16 rounding of eager's value
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, e, rtol=2 ** -8, atol=1e-6)


def test_without_autocast_only_the_bias_gradient_folds():
  """float32 (TF32) training: no cast to take, the bias gradient still comes out of the GEMM."""
  _, module, counts = _wgrad(_linear_grads(F32, widen=False))
  assert counts == {**counts, "weight_grad": 1} and "sum" not in counts and "matmul" not in counts
  wg = next(op for op in ir.function(module).body.block.ops if isinstance(op, WeightGradOp))
  assert wg.attrs()["dtype"] is F32 and wg.attrs()["bias_grad"]


def test_a_half_weight_gradient_without_a_cast_or_bias_is_left_alone():
  _, _, counts = _wgrad(_linear_grads(widen=False, bias=False))
  assert counts.get("weight_grad", 0) == 0 and counts["matmul"] == 1


def test_a_bias_gradient_read_before_the_weight_gradient_is_not_folded():
  """The weight_grad takes the matmul's place: a bias gradient read before it stays a sum."""
  b = Builder()
  g, x = b.input((64, 16), BF16), b.input((64, 8), BF16)
  db = b("cast", b("sum", g, dims=(0,), keepdim=False, dtype=BF16), dtype=F32)
  early = b("exp", db)
  dw = b("cast", b("matmul", b("permute", g, dims=(1, 0)), x), dtype=F32)
  _, module, counts = _wgrad(b.output(dw, db, early))
  wg = next(op for op in ir.function(module).body.block.ops if isinstance(op, WeightGradOp))
  assert not wg.attrs()["bias_grad"] and counts["sum"] == 1


def test_a_sum_over_other_dims_is_no_bias_gradient():
  b = Builder()
  g, x = b.input((64, 16), BF16), b.input((64, 8), BF16)
  dw = b("cast", b("matmul", b("permute", g, dims=(1, 0)), x), dtype=F32)
  rows = b("cast", b("sum", g, dims=(1,), keepdim=False, dtype=BF16), dtype=F32)
  _, module, counts = _wgrad(b.output(dw, rows))
  assert counts["weight_grad"] == 1 and counts["sum"] == 1


# *** fuse-bias-grads: bias gradients from the kernels writing the output gradients ***

def _bias_grads(graph):
  """The module after fuse-bias-grads, then fuse-wgrad (as the GPU's pipeline runs them), and the op counts."""
  module = ir.to_module(graph)
  plain = module.clone()
  FuseBiasGradientsPass().run(module)
  module.verify()
  FuseWeightGradientsPass().run(module)
  module.verify()
  return plain, module, op_counts(module)


def _norm_then_linear(cast=True, widen=True, dims=(0, 1), x_dtype=F32, sum_float=False):
  """A layer norm's backward whose gradient (autocast's bf16 copy of it when `cast`) is a linear layer's output
  gradient: its weight gradient and its bias gradient (a sum over `dims`, through a view, widened to float32; of the
  float32 gradient with `sum_float`)."""
  b = Builder()
  g, x, w, h = b.input((4, 16, 32), BF16), b.input((4, 16, 32), x_dtype), b.input((32,), x_dtype), \
    b.input((4, 16, 8), BF16 if cast else x_dtype)
  back = b("layer_norm_backward", g, x, w, None, n=1, eps=1e-5, has_bias=True, cast=BF16 if cast else None)
  d = back[3] if cast else back[0]
  dw = b("matmul", b("permute", b("view", d, shape=(64, 32)), dims=(1, 0)), b("view", h, shape=(64, 8)))
  summed = back[0] if sum_float else d
  s = b("view", b("sum", summed, dims=dims, keepdim=True, dtype=summed.dtype),
        shape=(32,) if dims == (0, 1) else (4, 32))
  return b.output(back[0], back[1], back[2], b("cast", dw, dtype=F32) if cast else dw,
                  b("cast", s, dtype=F32) if widen else s)


def _run(module, graph_inputs):
  return codegen.load(codegen.generate(module))(*graph_inputs)


@pytest.mark.parametrize("cast", [True, False])
def test_a_norm_backward_sums_the_bias_gradient_of_the_linear_layer_after_it(cast):
  """The sum goes into the norm's backward (its float32 column sums of the gradient as stored), fuse-wgrad then
  finds no bias gradient to take; the sums equal the float64 sums of the stored gradient, and eager's to one bf16
  rounding (eager rounds its sum to bf16 before the widening cast)."""
  plain, module, counts = _bias_grads(_norm_then_linear(cast))
  assert "sum" not in counts and counts["layer_norm_backward"] == 1, counts
  back = next(op for op in ir.function(module).body.block.ops if op.name == "nova.layer_norm_backward")
  assert back.attrs()["bias_grad"] and back.dx_sum is not None
  wgs = [op for op in ir.function(module).body.block.ops if isinstance(op, WeightGradOp)]
  assert [op.attrs()["bias_grad"] for op in wgs] == ([False] if cast else []), "float32 leaves the matmul alone"
  rs = np.random.default_rng(1)
  args = [rs.standard_normal(s).astype(d.np) for s, d in (((4, 16, 32), BF16), ((4, 16, 32), F32), ((32,), F32),
                                                          ((4, 16, 8), BF16 if cast else F32))]
  got, eager = _run(module, args), _run(plain, args)
  stored = eager[0].astype(BF16.np) if cast else eager[0]
  assert got[-1].dtype == np.float32 and got[-1].shape == (32,)
  np.testing.assert_allclose(got[-1], stored.astype(np.float64).sum((0, 1)), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[-1], eager[-1], rtol=2 ** -7 if cast else 1e-5, atol=1e-4)
  for a, e in zip(got[:3], eager[:3]): np.testing.assert_array_equal(a, e)


def test_a_float64_norm_backward_sums_in_float64():
  _, module, counts = _bias_grads(_norm_then_linear(cast=False, widen=False, x_dtype=dtypes.float64))
  assert "sum" not in counts, counts


def test_a_bias_gradient_left_in_bf16_is_rounded_from_the_sums():
  """An update that reads bf16 gradients (fuse-casts took the widening cast): the norm's float32 sums, rounded once,
  as eager's sum rounds its float32 accumulator."""
  plain, module, counts = _bias_grads(_norm_then_linear(widen=False))
  assert "sum" not in counts and counts["cast"] == 1, counts
  rs = np.random.default_rng(2)
  args = [rs.standard_normal(s).astype(d.np) for s, d in (((4, 16, 32), BF16), ((4, 16, 32), F32), ((32,), F32),
                                                          ((4, 16, 8), BF16))]
  got, eager = _run(module, args), _run(plain, args)
  assert got[-1].dtype == BF16.np
  np.testing.assert_allclose(got[-1].astype(np.float64), eager[-1].astype(np.float64), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("case", ["rows of another shape", "the float32 gradient beside its copy"])
def test_a_sum_the_norm_backward_cannot_make_is_left_to_fuse_wgrad(case):
  graph = {"rows of another shape": lambda: _norm_then_linear(dims=(1,)),
           "the float32 gradient beside its copy": lambda: _norm_then_linear(sum_float=True)}[case]()
  _, module, counts = _bias_grads(graph)
  back = next(op for op in ir.function(module).body.block.ops if op.name == "nova.layer_norm_backward")
  assert not back.attrs().get("bias_grad") and back.dx_sum is None


def _gelu_backward_then_sum(widen=True, epilogue="gelu_backward"):
  """An MLP's backward through its GELU as fuse-gemm leaves it (the GELU backward in the next layer's data-gradient
  gemm), and its first layer's bias gradient: a sum over (B, L) of the gemm's output."""
  b = Builder()
  g, w, h = b.input((4, 8, 16), BF16), b.input((16, 32), BF16), b.input((4, 8, 32), BF16)
  (d,) = b("gemm", g, w, h, epilogue=epilogue, dtype=BF16)
  s = b("sum", d, dims=(0, 1), keepdim=False, dtype=BF16)
  return b.output(d, b("cast", s, dtype=F32) if widen else s)


@pytest.mark.parametrize("widen", [True, False])
def test_the_gelu_backward_gemm_sums_the_bias_gradient_of_the_layer_before(widen):
  plain, module, counts = _bias_grads(_gelu_backward_then_sum(widen))
  assert "sum" not in counts and counts.get("cast", 0) == (not widen), counts
  (g,) = [op for op in ir.function(module).body.block.ops if isinstance(op, GemmOp)]
  assert g.attrs()["epilogue"] == "gelu_backward,bias_grad" and len(g.results) == 2
  rs = np.random.default_rng(4)
  args = [rs.standard_normal(s).astype(BF16.np) for s in ((4, 8, 16), (16, 32), (4, 8, 32))]
  got, eager = _run(module, args), _run(plain, args)
  np.testing.assert_array_equal(got[0], eager[0])
  np.testing.assert_allclose(got[-1].astype(np.float64), eager[0].astype(np.float64).sum((0, 1)),
                             rtol=1e-5 if widen else 2 ** -7, atol=1e-5 if widen else 1e-3)
  np.testing.assert_allclose(got[-1].astype(np.float64), eager[-1].astype(np.float64), rtol=2 ** -7, atol=1e-3)


def test_a_gemm_without_a_gelu_backward_leaves_its_bias_gradient_to_fuse_wgrad():
  _, module, counts = _bias_grads(_gelu_backward_then_sum(epilogue="residual"))
  assert counts["sum"] == 1 and [op.attrs()["epilogue"] for op in ir.function(module).body.block.ops
                                 if isinstance(op, GemmOp)] == ["residual"]


def test_the_bias_grad_step_ends_an_epilogue():
  b = Builder()
  g, w, h = b.input((8, 16), BF16), b.input((16, 32), BF16), b.input((8, 32), BF16)
  with pytest.raises(ShapeError, match="bias_grad may only end"):
    b("gemm", g, w, h, epilogue="bias_grad,gelu_backward", dtype=BF16)
  assert [(v.shape, v.dtype) for v in b("gemm", g, w, h, epilogue="gelu_backward,bias_grad", dtype=BF16)] == \
         [((8, 32), BF16), ((32,), F32)]


def test_the_configurator_prices_the_summed_gelu_backward_below_a_reduction():
  """On cuBLASLt's path the GELU backward's kernel sums as it stores (a launch for its partial sums); after the
  synthesized GEMM, or any other last step, the sums cost a reduction over the output."""
  p = cfg.GemmProblem(16384, 3072, 768, 1, 2, 2, "", True, False)
  plain = cfg.gemm_choice(p, ("gelu_backward",), [2])
  summed = cfg.gemm_choice(p, ("gelu_backward", "bias_grad"), [2])
  assert summed.cublas_s - plain.cublas_s == pytest.approx(cfg.LAUNCH_S)
  reduction = 16384 * 3072 * 2 / (cfg.H200.hbm_bandwidth * cfg.STREAM_SHARE) + cfg.LAUNCH_S
  assert summed.nova_s - plain.nova_s == pytest.approx(reduction)
  assert cfg.gemm_choice(p, ("bias_grad",)).cublas_s - cfg.gemm_choice(p, ()).cublas_s == pytest.approx(reduction)
