"""nn.functional's activations, losses, normalization, padding and interpolation, and their modules, against PyTorch
CPU (values and gradients, contiguous and strided inputs, broadcasting), float64 finite differences for a few, and
bad inputs raising PyTorch's exception types."""
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import blutrain as bt
from blutrain import nn
from blutrain.nn import functional as F
from tests.helpers import Int, assert_close, check_vjp, helper_test_op

ACTIVATIONS = [
  ("elu", lambda x: TF.elu(x, 0.7), lambda x: F.elu(x, 0.7)),
  ("selu", TF.selu, F.selu),
  ("celu", lambda x: TF.celu(x, 1.3), lambda x: F.celu(x, 1.3)),
  ("relu6", TF.relu6, F.relu6),
  ("hardsigmoid", TF.hardsigmoid, F.hardsigmoid),
  ("hardtanh", lambda x: TF.hardtanh(x, -2.0, 3.0), lambda x: F.hardtanh(x, -2.0, 3.0)),
  ("hardswish", TF.hardswish, F.hardswish),
  ("silu", TF.silu, F.silu),
  ("mish", TF.mish, F.mish),
  ("softplus", TF.softplus, F.softplus),
  ("softplus_beta", lambda x: TF.softplus(x, 2.0, 5.0), lambda x: F.softplus(x, 2.0, 5.0)),
  ("softsign", TF.softsign, F.softsign),
  ("logsigmoid", TF.logsigmoid, F.logsigmoid),
  ("leaky_relu", lambda x: TF.leaky_relu(x, 0.2), lambda x: F.leaky_relu(x, 0.2)),
  ("softmin", lambda x: TF.softmin(x, 1), lambda x: F.softmin(x, 1)),
  ("log_softmax", lambda x: TF.log_softmax(x, 0), lambda x: F.log_softmax(x, 0)),
]


@pytest.mark.parametrize("name,tfn,bfn", ACTIVATIONS, ids=[a[0] for a in ACTIVATIONS])
def test_activations_match_torch(name, tfn, bfn):
  helper_test_op([(4, 9)], tfn, bfn, layouts=("contiguous", "strided"), low=-8, high=8)


def test_activations_far_out_stay_finite():
  x = np.array([[-120.0, -30.0, -1e-9], [0.5, 30.0, 120.0]], np.float32)
  for name, tfn, bfn in ACTIVATIONS:
    helper_test_op([x], tfn, bfn)


@pytest.mark.parametrize("fn", [F.elu, F.selu, F.celu, F.mish, F.softplus, F.logsigmoid, F.softsign, F.hardswish])
def test_activation_vjps_against_finite_differences(fn):
  check_vjp(fn, [(3, 5)], low=-4, high=4)


MODULES = [(nn.LeakyReLU(0.3), torch.nn.LeakyReLU(0.3)), (nn.ELU(0.5), torch.nn.ELU(0.5)), (nn.SELU(), torch.nn.SELU()),
           (nn.CELU(2.0), torch.nn.CELU(2.0)), (nn.ReLU6(), torch.nn.ReLU6()), (nn.Hardtanh(-0.5, 0.5), torch.nn.Hardtanh(-0.5, 0.5)),
           (nn.Hardsigmoid(), torch.nn.Hardsigmoid()), (nn.Hardswish(), torch.nn.Hardswish()), (nn.Mish(), torch.nn.Mish()),
           (nn.Softplus(2.0, 3.0), torch.nn.Softplus(2.0, 3.0)), (nn.Softsign(), torch.nn.Softsign()),
           (nn.LogSigmoid(), torch.nn.LogSigmoid()), (nn.SiLU(), torch.nn.SiLU()), (nn.Softmax(-1), torch.nn.Softmax(-1)),
           (nn.LogSoftmax(1), torch.nn.LogSoftmax(1)), (nn.Softmin(0), torch.nn.Softmin(0)), (nn.Identity(3), torch.nn.Identity(3)),
           (nn.Flatten(), torch.nn.Flatten()), (nn.Flatten(0, 1), torch.nn.Flatten(0, 1)),
           (nn.Unflatten(1, (2, 2)), torch.nn.Unflatten(1, (2, 2)))]


@pytest.mark.parametrize("bmod,tmod", MODULES, ids=[type(m[0]).__name__ for m in MODULES])
def test_activation_and_shape_modules_match_torch(bmod, tmod):
  helper_test_op([(3, 4, 5)], tmod, bmod, low=-4, high=4)
  assert repr(bmod) == repr(tmod).replace(", inplace=False", "")


def test_module_errors():
  with pytest.raises(TypeError, match="unflattened_size"): nn.Unflatten(1, 4)
  with pytest.raises(ValueError, match="min_val"): F.hardtanh(bt.zeros(2), 1.0, -1.0)


# *** losses ***

REDUCTIONS = ["mean", "sum", "none"]


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_regression_losses_match_torch(reduction):
  for tfn, bfn in [(TF.mse_loss, F.mse_loss), (TF.l1_loss, F.l1_loss),
                   (lambda a, b, **k: TF.smooth_l1_loss(a, b, beta=0.5, **k), lambda a, b, **k: F.smooth_l1_loss(a, b, beta=0.5, **k)),
                   (lambda a, b, **k: TF.smooth_l1_loss(a, b, beta=0.0, **k), lambda a, b, **k: F.smooth_l1_loss(a, b, beta=0.0, **k)),
                   (lambda a, b, **k: TF.huber_loss(a, b, delta=0.7, **k), lambda a, b, **k: F.huber_loss(a, b, delta=0.7, **k))]:
    helper_test_op([(5, 6), (5, 6)], lambda a, b: tfn(a, b, reduction=reduction), lambda a, b: bfn(a, b, reduction=reduction),
                   layouts=("contiguous", "transposed"))


def test_losses_broadcast_and_match_finite_differences():
  helper_test_op([(5, 6), (6,)], lambda a, b: TF.l1_loss(a, b.expand(5, 6)), lambda a, b: F.l1_loss(a, b))
  helper_test_op([(5, 1), (5, 6)], lambda a, b: TF.mse_loss(a.expand(5, 6), b), lambda a, b: F.mse_loss(a, b))
  t = bt.tensor(np.random.default_rng(5).uniform(0.1, 0.9, (3, 4)), dtype=bt.float64)
  check_vjp(lambda x: F.binary_cross_entropy_with_logits(x, t, pos_weight=t[0] * 3), [(3, 4)], low=-5, high=5)
  check_vjp(lambda x: F.kl_div(x.log_softmax(-1), t.softmax(-1), reduction="batchmean"), [(3, 4)])
  check_vjp(lambda x: F.smooth_l1_loss(x, t, beta=0.5) + F.huber_loss(x, t, delta=0.3), [(3, 4)])
  check_vjp(lambda x: F.nll_loss(x, bt.tensor([0, 3, 1]), t[0]), [(3, 4)])


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_binary_cross_entropy_matches_torch(reduction):
  helper_test_op([(4, 5), (4, 5)], lambda p, t: TF.binary_cross_entropy(p, t, reduction=reduction),
                 lambda p, t: F.binary_cross_entropy(p, t, reduction=reduction), low=0.02, high=0.98)
  helper_test_op([(4, 5), (4, 5), (5,)], lambda p, t, w: TF.binary_cross_entropy(p, t, w.detach(), reduction=reduction),
                 lambda p, t, w: F.binary_cross_entropy(p, t, w.detach(), reduction=reduction), low=0.02, high=0.98)
  edge = np.array([0.0, 1.0, 0.5], np.float32)
  assert_close(F.binary_cross_entropy(bt.tensor(edge), bt.tensor([1.0, 0.0, 1.0]), reduction="none"),
               TF.binary_cross_entropy(torch.tensor(edge), torch.tensor([1.0, 0.0, 1.0]), reduction="none"))


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_binary_cross_entropy_with_logits_matches_torch(reduction):
  kw = dict(reduction=reduction)
  helper_test_op([(4, 5), (4, 5)], lambda x, t: TF.binary_cross_entropy_with_logits(x, t, **kw),
                 lambda x, t: F.binary_cross_entropy_with_logits(x, t, **kw), low=-6, high=6)
  helper_test_op([(4, 5), (4, 5), (4, 1), (5,)],
                 lambda x, t, w, pw: TF.binary_cross_entropy_with_logits(x, t.sigmoid(), w.detach(), pos_weight=pw.detach().abs(), **kw),
                 lambda x, t, w, pw: F.binary_cross_entropy_with_logits(x, t.sigmoid(), w.detach(), pos_weight=pw.detach().abs(), **kw),
                 layouts=("contiguous", "strided"))
  far = np.array([-200.0, -30.0, 30.0, 200.0], np.float32)
  helper_test_op([far, (4,)], lambda x, t: TF.binary_cross_entropy_with_logits(x, t.sigmoid(), **kw),
                 lambda x, t: F.binary_cross_entropy_with_logits(x, t.sigmoid(), **kw))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 5), (4,)])
def test_nll_loss_with_weights_and_ignore_index(reduction, shape):
  tshape = shape[:1] + shape[2:] if len(shape) > 1 else ()
  for weighted in (False, True):
    specs = [shape, Int(tshape, -1, 4)] + ([np.random.default_rng(3).uniform(0.2, 2, 4).astype(np.float32)] if weighted else [])
    helper_test_op(specs, lambda x, t, *w: TF.nll_loss(x, t, *(v.detach() for v in w), ignore_index=-1, reduction=reduction),
                   lambda x, t, *w: F.nll_loss(x, t, *(v.detach() for v in w), ignore_index=-1, reduction=reduction), seed=1)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 5), (4,)])
def test_cross_entropy_weights_smoothing_ignore_index(reduction, smoothing, shape):
  tshape = shape[:1] + shape[2:] if len(shape) > 1 else ()
  ignore = -1 if len(shape) > 1 else -100
  w = np.random.default_rng(3).uniform(0.2, 2, 4).astype(np.float32)
  kw = dict(ignore_index=ignore, reduction=reduction, label_smoothing=smoothing)
  for extra in ([], [w]):
    helper_test_op([shape, Int(tshape, -1 if ignore == -1 else 0, 4)] + extra,
                   lambda x, t, *w: TF.cross_entropy(x, t, *(v.detach() for v in w), **kw),
                   lambda x, t, *w: F.cross_entropy(x, t, *(v.detach() for v in w), **kw),
                   layouts=("contiguous", "strided"), seed=2)
  helper_test_op([shape, shape] + [w], lambda x, p, w: TF.cross_entropy(x, p.softmax(0 if len(shape) == 1 else 1), w.detach(), **kw),
                 lambda x, p, w: F.cross_entropy(x, p.softmax(0 if len(shape) == 1 else 1), w.detach(), **kw))


def test_cross_entropy_module_and_vjp():
  tm = torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]), ignore_index=1, label_smoothing=0.1)
  bm = nn.CrossEntropyLoss(weight=bt.tensor([1.0, 2.0, 0.5]), ignore_index=1, label_smoothing=0.1)
  helper_test_op([(5, 3), Int((5,), 0, 3)], tm, bm)
  assert list(bm.state_dict()) == ["weight"]
  check_vjp(lambda x: F.cross_entropy(x, bt.tensor([0, 2, 1, 2]), bt.tensor([1.0, 2.0, 0.5], dtype=bt.float64),
                                      label_smoothing=0.3), [(4, 3)])


@pytest.mark.parametrize("reduction", REDUCTIONS + ["batchmean"])
@pytest.mark.parametrize("log_target", [False, True])
def test_kl_div_matches_torch(reduction, log_target):
  tgt = (lambda t: t.log_softmax(-1)) if log_target else (lambda t: t.softmax(-1))
  helper_test_op([(3, 5), (3, 5)], lambda x, t: TF.kl_div(x.log_softmax(-1), tgt(t), reduction=reduction, log_target=log_target),
                 lambda x, t: F.kl_div(x.log_softmax(-1), tgt(t), reduction=reduction, log_target=log_target))
  zeros = np.array([[0.0, 0.5, 0.5]], np.float32)
  assert_close(F.kl_div(bt.tensor([[-1.0, -2.0, -0.5]]), bt.tensor(zeros), reduction="sum"),
               TF.kl_div(torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor(zeros), reduction="sum"))


LOSS_MODULES = [(nn.L1Loss(), torch.nn.L1Loss()), (nn.MSELoss(reduction="sum"), torch.nn.MSELoss(reduction="sum")),
                (nn.SmoothL1Loss(beta=0.3), torch.nn.SmoothL1Loss(beta=0.3)), (nn.HuberLoss(delta=2.0), torch.nn.HuberLoss(delta=2.0)),
                (nn.BCEWithLogitsLoss(pos_weight=bt.tensor([2.0] * 4)), torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor([2.0] * 4))),
                (nn.KLDivLoss(reduction="batchmean"), torch.nn.KLDivLoss(reduction="batchmean")),
                (nn.MSELoss(size_average=False), torch.nn.MSELoss(size_average=False))]


@pytest.mark.parametrize("bmod,tmod", LOSS_MODULES, ids=[type(m[0]).__name__ for m in LOSS_MODULES])
def test_loss_modules_match_torch(bmod, tmod):
  helper_test_op([(3, 4), (3, 4)], lambda x, t: tmod(x, t.sigmoid()), lambda x, t: bmod(x, t.sigmoid()))


def test_bce_and_nll_modules_match_torch():
  helper_test_op([(3, 4), (3, 4)], lambda p, t: torch.nn.BCELoss(reduction="sum")(p, t),
                 lambda p, t: nn.BCELoss(reduction="sum")(p, t), low=0.05, high=0.95)
  helper_test_op([(5, 3), Int((5,), 0, 3)], torch.nn.NLLLoss(torch.tensor([0.3, 1.0, 2.0])),
                 nn.NLLLoss(bt.tensor([0.3, 1.0, 2.0])))


def test_loss_errors_use_torchs_types():
  x, t = bt.randn(4, 3), bt.tensor([0, 1, 2, 0])
  for bad in [lambda: F.binary_cross_entropy(bt.rand(3), bt.rand(4)),
              lambda: F.binary_cross_entropy_with_logits(bt.rand(3), bt.rand(4)),
              lambda: F.mse_loss(x, x, reduction="avg"), lambda: F.cross_entropy(x, t, label_smoothing=1.5)]:
    with pytest.raises(ValueError): bad()
  with pytest.raises(ValueError): TF.binary_cross_entropy_with_logits(torch.rand(3), torch.rand(4))
  with pytest.raises(RuntimeError, match=r"\(2,\)"): F.cross_entropy(x, t, bt.ones(2))
  with pytest.raises(RuntimeError): TF.cross_entropy(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]), torch.ones(2))
  with pytest.raises(RuntimeError, match=r"\(4, 3\)"): F.nll_loss(x, bt.tensor([0, 1]))
  with pytest.raises(RuntimeError, match="beta"): F.smooth_l1_loss(x, x, beta=-1.0)


# *** normalize, cosine similarity ***

@pytest.mark.parametrize("p,dim", [(2.0, 1), (1.0, 0), (3.0, -1), (float("inf"), 1)])
def test_normalize_matches_torch(p, dim):
  helper_test_op([(4, 5)], lambda x: TF.normalize(x, p, dim), lambda x: F.normalize(x, p, dim),
                 layouts=("contiguous", "transposed"))


def test_cosine_similarity_matches_torch_with_broadcasting():
  helper_test_op([(4, 5), (1, 5)], lambda a, b: TF.cosine_similarity(a, b), lambda a, b: F.cosine_similarity(a, b))
  helper_test_op([(2, 3, 4), (3, 4)], lambda a, b: TF.cosine_similarity(a, b, dim=-1),
                 lambda a, b: F.cosine_similarity(a, b, dim=-1), layouts=("contiguous", "strided"))
  check_vjp(lambda a, b: F.cosine_similarity(a, b, dim=0), [(4, 3), (4, 3)])


# *** pad, interpolate ***

@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
@pytest.mark.parametrize("shape,pad", [((2, 3, 5), (2, 1)), ((1, 2, 4, 5), (1, 3, 2, 0)), ((2, 2, 3, 4), (0, 0, 1, 2)),
                                        ((1, 2, 5), (-1, 2))])
def test_pad_modes_match_torch(mode, shape, pad):
  helper_test_op([shape], lambda x: TF.pad(x, pad, mode=mode), lambda x: F.pad(x, pad, mode=mode),
                 layouts=("contiguous", "transposed"))


def test_pad_errors():
  with pytest.raises(RuntimeError, match="less than the corresponding input dimension"):
    F.pad(bt.zeros(1, 2, 3), (3, 0), mode="reflect")
  with pytest.raises(RuntimeError): TF.pad(torch.zeros(1, 2, 3), (3, 0), mode="reflect")
  with pytest.raises(NotImplementedError, match="mode 'wrap'"): F.pad(bt.zeros(1, 2, 3), (1, 1), mode="wrap")
  with pytest.raises(ValueError, match="even number"): F.pad(bt.zeros(2, 2), (1,))


@pytest.mark.parametrize("shape,kw", [
  ((2, 3, 4, 5), dict(size=(7, 3))), ((2, 3, 4, 5), dict(scale_factor=2)), ((1, 2, 6, 6), dict(scale_factor=0.5)),
  ((1, 2, 5, 7), dict(size=(3, 10))), ((2, 3, 7), dict(size=4)), ((2, 3, 4), dict(scale_factor=2.5))])
@pytest.mark.parametrize("mode,align", [("nearest", None), ("linear", False), ("linear", True)])
def test_interpolate_matches_torch(shape, kw, mode, align):
  if mode == "linear" and len(shape) == 4: mode = "bilinear"
  helper_test_op([shape], lambda x: TF.interpolate(x, mode=mode, align_corners=align, **kw),
                 lambda x: F.interpolate(x, mode=mode, align_corners=align, **kw), layouts=("contiguous", "strided"))


@pytest.mark.parametrize("kw", [dict(size=(7, 3)), dict(scale_factor=2), dict(scale_factor=0.5), dict(size=(9, 1)),
                                dict(scale_factor=(1.7, 0.6), recompute_scale_factor=True)])
@pytest.mark.parametrize("align", [False, True])
def test_interpolate_bicubic_matches_torch(kw, align):
  helper_test_op([(2, 3, 6, 5)], lambda x: TF.interpolate(x, mode="bicubic", align_corners=align, **kw),
                 lambda x: F.interpolate(x, mode="bicubic", align_corners=align, **kw),
                 layouts=("contiguous", "strided"), tol_scale=2)
  helper_test_op([(1, 2, 4, 3)], lambda x: TF.interpolate(x, mode="bicubic", align_corners=align, **kw),
                 lambda x: F.interpolate(x, mode="bicubic", align_corners=align, **kw), dtype=bt.float64)


def test_interpolate_errors():
  x = bt.zeros(1, 2, 4, 4)
  with pytest.raises(ValueError, match="only one of size or scale_factor"): F.interpolate(x, size=2, scale_factor=2)
  with pytest.raises(ValueError, match="either size or scale_factor"): F.interpolate(x)
  with pytest.raises(NotImplementedError, match="bilinear mode needs 4D input"):
    F.interpolate(bt.zeros(1, 2, 4), size=3, mode="bilinear")
  with pytest.raises(NotImplementedError, match="bicubic mode needs 4D input"):
    F.interpolate(bt.zeros(1, 2, 4), size=3, mode="bicubic")
  with pytest.raises(NotImplementedError): TF.interpolate(torch.zeros(1, 2, 4), size=3, mode="bilinear")
  with pytest.raises(ValueError, match="align_corners"): F.interpolate(x, size=2, align_corners=True)
