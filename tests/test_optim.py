"""optim: SGD, Adam, AdamW, RMSprop and Adagrad step by step against torch.optim from the same init and gradients; state_dict round
trips (own and PyTorch's); the Optimizer base's checks; LR schedules against torch.optim.lr_scheduler."""
import itertools
import math

import numpy as np
import pytest
import torch
from torch.optim.sgd import sgd as torch_sgd

import blutrain as bt
from blutrain import nn, optim
from blutrain.optim import lr_scheduler

SHAPES = [(4, 3), (5,), (2, 3, 2)]


def make_params(seed: int = 0):
  """The same random parameters as blutrain Parameters and torch Parameters."""
  rng = np.random.default_rng(seed)
  arrays = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
  return [nn.Parameter(bt.tensor(a)) for a in arrays], [torch.nn.Parameter(torch.tensor(a)) for a in arrays]


def set_grads(bparams, tparams, rng, skip: int | None = None) -> None:
  """Random gradients, the same on both sides; parameter `skip` gets none (the optimizer must leave it alone)."""
  for i, (b, t) in enumerate(zip(bparams, tparams)):
    if i == skip:
      b.grad, t.grad = None, None
      continue
    g = rng.standard_normal(b.shape).astype(np.float32)
    b.grad, t.grad = bt.tensor(g), torch.tensor(g)


def assert_params_equal(bparams, tparams, what: str, rtol=1e-6, atol=1e-7) -> None:
  for i, (b, t) in enumerate(zip(bparams, tparams)):
    np.testing.assert_allclose(b.detach().numpy(), t.detach().numpy(), rtol=rtol, atol=atol, err_msg=f"{what}, param {i}")


def run_against_torch(bt_cls, torch_cls, kwargs, steps: int = 5, torch_kwargs=None) -> tuple:
  bparams, tparams = make_params()
  bopt, topt = bt_cls(bparams, **kwargs), torch_cls(tparams, **(torch_kwargs or kwargs))
  rng = np.random.default_rng(1)
  for step in range(steps):
    set_grads(bparams, tparams, rng, skip=1 if step == 2 else None)
    bopt.step(); topt.step()
    assert_params_equal(bparams, tparams, f"step {step}")
  return bopt, topt


SGD_CONFIGS = [dict(lr=0.1), dict(lr=0.1, momentum=0.9), dict(lr=0.05, momentum=0.9, dampening=0.3),
               dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01), dict(lr=0.1, weight_decay=0.1, maximize=True),
               dict(lr=0.1, momentum=0.5, maximize=True, weight_decay=0.05)]


@pytest.mark.parametrize("kwargs", SGD_CONFIGS)
def test_sgd_matches_torch(kwargs):
  bopt, topt = run_against_torch(optim.SGD, torch.optim.SGD, kwargs)
  if kwargs.get("momentum"):
    for b, t in zip(bopt.param_groups[0]["params"], topt.param_groups[0]["params"]):
      np.testing.assert_allclose(bopt.state[b]["momentum_buffer"].numpy(), topt.state[t]["momentum_buffer"].numpy(),
                                 rtol=1e-6, atol=1e-7)


ADAM_CONFIGS = [dict(lr=1e-2), dict(lr=1e-2, amsgrad=True), dict(lr=1e-2, weight_decay=0.1),
                dict(lr=1e-2, betas=(0.8, 0.9), eps=1e-6, maximize=True), dict(lr=0.1, weight_decay=0.05, amsgrad=True)]


def assert_adam_state(bopt, topt) -> None:
  for b, t in zip(bopt.param_groups[0]["params"], topt.param_groups[0]["params"]):
    bs, ts = bopt.state[b], topt.state[t]
    assert set(bs) == set(ts)
    assert bs["step"] == int(ts["step"].item())
    for key in set(bs) - {"step"}:
      np.testing.assert_allclose(bs[key].numpy(), ts[key].numpy(), rtol=1e-6, atol=1e-7, err_msg=key)


@pytest.mark.parametrize("kwargs", ADAM_CONFIGS)
def test_adam_matches_torch(kwargs):
  assert_adam_state(*run_against_torch(optim.Adam, torch.optim.Adam, kwargs))


@pytest.mark.parametrize("kwargs", [dict(), dict(lr=1e-2, weight_decay=0.1), dict(lr=0.1, amsgrad=True),
                                    dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, maximize=True, fused=None)])
def test_adamw_matches_torch(kwargs):
  assert_adam_state(*run_against_torch(optim.AdamW, torch.optim.AdamW, kwargs, steps=6))


RMSPROP_CONFIGS = [dict(), dict(lr=1e-3, alpha=0.9, eps=1e-6), dict(lr=1e-2, momentum=0.9), dict(lr=1e-2, centered=True),
                   dict(lr=1e-2, momentum=0.5, centered=True, weight_decay=0.1, maximize=True)]
ADAGRAD_CONFIGS = [dict(), dict(lr=0.1, lr_decay=0.05), dict(lr=0.1, weight_decay=0.1, initial_accumulator_value=0.5),
                   dict(lr=0.05, eps=1e-6, maximize=True, lr_decay=0.01)]


def assert_same_state(bopt, topt, rtol=1e-6, atol=1e-7) -> None:
  for b, t in zip(bopt.param_groups[0]["params"], topt.param_groups[0]["params"]):
    bs, ts = bopt.state[b], topt.state[t]
    assert set(bs) == set(ts) and bs["step"] == int(ts["step"].item())
    for key in set(bs) - {"step"}:
      np.testing.assert_allclose(bs[key].numpy(), ts[key].numpy(), rtol=rtol, atol=atol, err_msg=key)


@pytest.mark.parametrize("kwargs", RMSPROP_CONFIGS)
def test_rmsprop_matches_torch(kwargs):
  # g / sqrt(v) reaches ~30 in the momentum buffer, whose small entries are differences of such terms
  assert_same_state(*run_against_torch(optim.RMSprop, torch.optim.RMSprop, kwargs, steps=6), atol=1e-5)


@pytest.mark.parametrize("kwargs", ADAGRAD_CONFIGS)
def test_adagrad_matches_torch(kwargs):
  bopt, topt = run_against_torch(optim.Adagrad, torch.optim.Adagrad, kwargs, steps=6)
  assert_same_state(bopt, topt)
  fresh = optim.Adagrad(make_params()[0], initial_accumulator_value=0.25)
  assert len(fresh.state_dict()["state"]) == 3 and float(fresh.state_dict()["state"][0]["sum"].numpy().max()) == 0.25


@pytest.mark.parametrize("cls,kwargs,match", [
  (optim.RMSprop, dict(alpha=-0.1), "alpha"), (optim.RMSprop, dict(momentum=-1.0), "momentum"),
  (optim.RMSprop, dict(lr=-1.0), "learning rate"), (optim.Adagrad, dict(lr_decay=-1.0), "lr_decay"),
  (optim.Adagrad, dict(initial_accumulator_value=-1.0), "initial_accumulator_value"), (optim.Adagrad, dict(eps=-1.0), "epsilon")])
def test_rmsprop_adagrad_invalid_hyperparameters(cls, kwargs, match):
  with pytest.raises(ValueError, match=match): cls(make_params()[0], **kwargs)
  with pytest.raises(ValueError, match=match): getattr(torch.optim, cls.__name__)(make_params()[1], **kwargs)


def test_adam_decoupled_is_adamw():
  run_against_torch(optim.Adam, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
                    torch_kwargs=dict(lr=1e-2, weight_decay=0.1))


def test_param_groups_match_torch():
  """nanoGPT's two groups (decay on matrices only) with a per-group lr."""
  bparams, tparams = make_params()

  def groups(ps):
    return [{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1, "lr": 3e-2},
            {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}]
  bopt = optim.AdamW(groups(bparams), lr=1e-2, betas=(0.9, 0.95))
  topt = torch.optim.AdamW(groups(tparams), lr=1e-2, betas=(0.9, 0.95))
  assert [g["lr"] for g in bopt.param_groups] == [3e-2, 1e-2] and bopt.param_groups[1]["betas"] == (0.9, 0.95)
  rng = np.random.default_rng(2)
  for step in range(5):
    set_grads(bparams, tparams, rng)
    bopt.step(); topt.step()
    assert_params_equal(bparams, tparams, f"step {step}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_multi_tensor_adamw_equals_the_per_parameter_update(dtype):
  """`ops.adamw_` (AdamW with fused unset: one op for the group) against fused=False (one composite update per
  parameter, the reference), on float32 and bfloat16 parameters with float32 gradients, in place."""
  dt = getattr(bt, dtype)
  runs = []
  for fused in (None, False):
    params = [nn.Parameter(p.detach().to(dt)) for p in make_params(3)[0]]
    opt = optim.AdamW(params, lr=3e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    rng, versions = np.random.default_rng(4), [p._storage.version for p in params]
    for _ in range(4):
      for p in params: p.grad = bt.tensor(rng.standard_normal(p.shape).astype(np.float32))
      opt.step()
    assert all(p._storage.version > v for p, v in zip(params, versions)), "the update is in place, versions bumped"
    runs.append((params, opt))
  (fused_params, fused_opt), (ref_params, ref_opt) = runs
  # bfloat16: the multi-tensor op rounds once per step, the composite after each of its ops (a few ulps of 2^-8)
  tol = dict(rtol=1e-6, atol=1e-7) if dtype == "float32" else dict(rtol=4 * 4 * 2**-8, atol=1e-2)
  for p, q in zip(fused_params, ref_params):
    np.testing.assert_allclose(p.detach().float().numpy(), q.detach().float().numpy(), **tol)
    for key in ("exp_avg", "exp_avg_sq"):
      np.testing.assert_allclose(fused_opt.state[p][key].float().numpy(), ref_opt.state[q][key].float().numpy(), **tol)
    assert fused_opt.state[p]["step"].item() == ref_opt.state[q]["step"].item() == 4


SGD_OPTIONS = [dict(lr=0.07, momentum=m, dampening=d, nesterov=n, weight_decay=wd, maximize=mx)
               for m, d, n, wd, mx in itertools.product((0.0, 0.9), (0.0, 0.3), (False, True), (0.0, 0.05),
                                                        (False, True))
               if not n or (m and not d)]
MIXED_SHAPES = [(4, 3), (5,), (), (2, 3, 2), (0, 3), (1,)]


def _sgd_runs(kwargs, dtype, fused_values, steps=4, strided=False):
  """Parameters and optimizers after `steps` SGD steps from the same init and gradients, one run per `fused` value
  (None: the multi-tensor op, False: the per-parameter update) plus torch's; parameter 1 gets its first gradient at
  step 1 (a group of params with and without a momentum buffer), strided gradients when `strided`."""
  rng = np.random.default_rng(7)
  init = [rng.standard_normal(s).astype(np.float32) for s in MIXED_SHAPES]
  grads = [[rng.standard_normal(s[::-1] if strided else s).astype(np.float32) for s in MIXED_SHAPES]
           for _ in range(steps)]
  tdt = getattr(torch, dtype)
  tparams = [torch.nn.Parameter(torch.tensor(a, dtype=tdt)) for a in init]
  topt = torch.optim.SGD(tparams, **kwargs)
  runs = []
  for fused in fused_values:
    params = [nn.Parameter(bt.tensor(a).to(getattr(bt, dtype))) for a in init]
    runs.append((params, optim.SGD(params, **kwargs, fused=fused)))
  for k, step in enumerate(grads):
    for i, g in enumerate(step):
      if k == 0 and i == 1: continue
      tparams[i].grad = torch.tensor(g.T if strided else g, dtype=tdt)
      for params, _ in runs:
        params[i].grad = bt.tensor(g).to(getattr(bt, dtype))
        if strided: params[i].grad = params[i].grad.permute(*reversed(range(g.ndim)))
    topt.step()
    for _, opt in runs: opt.step()
  return runs, (tparams, topt)


@pytest.mark.parametrize("kwargs", SGD_OPTIONS, ids=lambda k: ",".join(f"{a}={v}" for a, v in k.items() if v))
def test_multi_tensor_sgd_matches_torch_and_the_per_parameter_update(kwargs, monkeypatch):
  """`ops.sgd_` (SGD with foreach and fused unset) on float32 parameters of mixed shapes against torch.optim.SGD and
  against the per-parameter update (fused=False), which it equals bit for bit: the same float32 operations."""
  calls, sgd_ = [], bt.ops.sgd_
  monkeypatch.setattr(bt.ops, "sgd_", lambda *a, **kw: calls.append(kw.get("is_first_step")) or sgd_(*a, **kw))
  (fused, ref), (tparams, topt) = _sgd_runs(kwargs, "float32", (None, False))
  # one op a step; with momentum, at step 1 a second one starts parameter 1's buffer
  assert calls == ([True, False, True, False, False] if kwargs["momentum"] else [None] * 4)
  for (p, q, t) in zip(fused[0], ref[0], tparams):
    assert p.shape == tuple(t.shape) and p.dtype is bt.float32
    np.testing.assert_array_equal(p.detach().numpy(), q.detach().numpy())
    np.testing.assert_allclose(p.detach().numpy(), t.detach().numpy(), rtol=1e-6, atol=1e-6)
    if kwargs["momentum"]:
      b, want = fused[1].state[p]["momentum_buffer"], topt.state[t]["momentum_buffer"]
      assert b.dtype is bt.float32 and b.is_contiguous()
      np.testing.assert_array_equal(b.numpy(), ref[1].state[q]["momentum_buffer"].numpy())
      np.testing.assert_allclose(b.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)
    else: assert not fused[1].state[p] and not topt.state[t]


def test_multi_tensor_sgd_float64_and_strided_gradients():
  """float64 parameters take the per-parameter update (the op is for float32/16), and both match torch; strided
  gradients (transposed views) go to the op as they are."""
  kwargs = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)
  (run,), (tparams, _) = _sgd_runs(kwargs, "float64", (None,))
  for p, t in zip(run[0], tparams):
    np.testing.assert_allclose(p.detach().numpy(), t.detach().numpy(), rtol=1e-12, atol=1e-12)
  (fused, ref), (tparams, _) = _sgd_runs(kwargs, "float32", (None, False), strided=True)
  assert not fused[0][0].grad.is_contiguous()
  for p, q, t in zip(fused[0], ref[0], tparams):
    np.testing.assert_array_equal(p.detach().numpy(), q.detach().numpy())
    np.testing.assert_allclose(p.detach().numpy(), t.detach().numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls,kwargs,state", [
  (optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01), "momentum_buffer"),
  (optim.AdamW, dict(lr=0.01, weight_decay=0.1), "exp_avg_sq")], ids=("SGD", "AdamW"))
def test_multi_tensor_updates_leave_a_group_they_cannot_walk_to_the_per_parameter_one(cls, kwargs, state, monkeypatch):
  """A group with a state laid out unlike its parameter (a contiguous buffer of a channels-last parameter, as a
  loaded state may be) or a parameter with gaps takes the per-parameter update, with its results: no multi-tensor
  op (`multi_tensor_ready`)."""
  rng = np.random.default_rng(3)
  init = [rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 4, 5), (4, 6), (7,))]
  grads = [[rng.standard_normal(a.shape).astype(np.float32) for a in init] for _ in range(3)]
  calls = []
  for name in ("sgd_", "adamw_"):
    op = getattr(bt.ops, name)
    monkeypatch.setattr(bt.ops, name, lambda *a, op=op, **kw: calls.append(len(a[0])) or op(*a, **kw))
  for case in ("state", "gaps"):
    runs = []
    for fused in (None, False):
      params = [nn.Parameter(bt.tensor(init[0]).contiguous(memory_format=bt.channels_last)),
                nn.Parameter(bt.tensor(init[1])[:, ::2] if case == "gaps" else bt.tensor(init[1])),
                nn.Parameter(bt.tensor(init[2]))]
      opt = cls(params, **kwargs, fused=fused)
      for k, step in enumerate(grads):
        for p, g in zip(params, step): p.grad = bt.tensor(g[:, ::2] if p.shape != g.shape else g)
        del calls[:]
        opt.step()
        if k == 0 and case == "state": opt.state[params[0]][state] = opt.state[params[0]][state].contiguous()
        assert calls == ([3] if fused is None and case == "state" and k == 0 else []), (case, k, calls)
      runs.append(params)
    for p, q in zip(*runs): np.testing.assert_array_equal(p.detach().numpy(), q.detach().numpy(), err_msg=case)


def test_multi_tensor_sgd_bfloat16():
  """bfloat16 parameters: the op computes in float32 and rounds each result once, the per-parameter update after each
  of its ops (within a few ulps of 2^-8); buffers in bfloat16 either way."""
  kwargs = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
  (fused, ref), (tparams, _) = _sgd_runs(kwargs, "bfloat16", (None, False))
  for p, q, t in zip(fused[0], ref[0], tparams):
    assert p.dtype is bt.bfloat16 and fused[1].state[p]["momentum_buffer"].dtype is bt.bfloat16
    for other in (q.detach().float().numpy(), t.detach().float().numpy()):
      np.testing.assert_allclose(p.detach().float().numpy(), other, rtol=4 * 2**-8, atol=2e-2)


def test_sgd_op_with_a_tensor_learning_rate_and_a_scheduler():
  """`ops.sgd_` with lr a 0-d tensor, in place (versions bumped), and SGD under StepLR and with a tensor lr, against
  torch."""
  bparams, tparams = make_params(11)
  bufs = [bt.zeros(p.shape) for p in bparams]
  tbufs = [None] * len(tparams)
  rng = np.random.default_rng(12)
  for k in range(3):
    set_grads(bparams, tparams, rng)
    versions = [t._storage.version for t in bparams + bufs]
    lr = bt.tensor(0.1 / (k + 1), dtype=bt.float32 if k == 1 else bt.float64)  # float32 is widened, exactly
    bt.ops.sgd_(bparams, [p.grad for p in bparams], bufs, lr, momentum=0.8, dampening=0.2, weight_decay=0.0,
                nesterov=False, maximize=False, is_first_step=k == 0)
    assert all(t._storage.version > v for t, v in zip(bparams + bufs, versions))
    with torch.no_grad():
      torch_sgd(tparams, [t.grad for t in tparams], tbufs, lr=0.1 / (k + 1), momentum=0.8, dampening=0.2,
                weight_decay=0.0, nesterov=False, maximize=False, foreach=False)
    assert_params_equal(bparams, tparams, f"step {k}")
    for b, t in zip(bufs, tbufs): np.testing.assert_allclose(b.numpy(), t.numpy(), rtol=1e-6, atol=1e-7)
  bparams, tparams = make_params(13)
  bopt, topt = optim.SGD(bparams, lr=0.1, momentum=0.9), torch.optim.SGD(tparams, lr=0.1, momentum=0.9)
  bsched = lr_scheduler.StepLR(bopt, step_size=2, gamma=0.5)
  tsched = torch.optim.lr_scheduler.StepLR(topt, step_size=2, gamma=0.5)
  for step in range(5):
    set_grads(bparams, tparams, rng)
    bopt.step(); topt.step(); bsched.step(); tsched.step()
    assert_params_equal(bparams, tparams, f"scheduled step {step}")
  bparams, tparams = make_params(14)
  bopt = optim.SGD(bparams, lr=bt.tensor(0.2), momentum=0.5)
  topt = torch.optim.SGD(tparams, lr=torch.tensor(0.2), momentum=0.5)
  for step in range(3):
    set_grads(bparams, tparams, rng)
    bopt.step(); topt.step()
    assert_params_equal(bparams, tparams, f"tensor lr step {step}")


def test_sgd_op_errors():
  p, g = bt.randn(3), bt.randn(3)
  kw = dict(momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
  with pytest.raises(ValueError, match=r"sgd: a parameter float32\[3\] needs .* got float32\[3\], bfloat16\[3\]"):
    bt.ops.sgd_([p], [g], [bt.zeros(3, dtype=bt.bfloat16)], 0.1, **kw)
  with pytest.raises(ValueError, match=r"sgd: a parameter float32\[3\] needs a gradient of its shape.*float32\[4\]"):
    bt.ops.sgd_([p], [bt.randn(4)], [bt.zeros(3)], 0.1, **kw)
  with pytest.raises(ValueError, match=r"sgd: the learning rate must be a 0-d float64 tensor, got float64\[2\]"):
    bt.ops.sgd_([p], [g], [bt.zeros(3)], bt.tensor([0.1, 0.2]), **kw)
  with pytest.raises(ValueError, match="sgd_: momentum 0.9 needs a buffer per parameter, got 0 for 1"):
    bt.ops.sgd_([p], [g], [], 0.1, **kw)
  with pytest.raises(TypeError, match="sgd: expected float32, bfloat16 or float16 tensors on one device, got float64"):
    bt.ops.sgd_([p.double()], [g.double()], [bt.zeros(3, dtype=bt.float64)], 0.1, **kw)


def test_sum_squares_and_scale_against_numpy():
  rng = np.random.default_rng(5)
  arrays = [rng.standard_normal(s).astype(np.float32) for s in ((3, 4), (7,), (2, 2, 2))]
  xs = [bt.tensor(a) for a in arrays] + [bt.tensor(arrays[0]).bfloat16()]
  want = sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays)
  want += float(np.sum(np.square(xs[-1].float().numpy(), dtype=np.float64)))
  got = bt.ops.sum_squares(xs)
  assert got.dtype is bt.float32 and got.shape == ()
  np.testing.assert_allclose(got.item(), want, rtol=1e-6)
  factor, before = bt.tensor(0.37), [x.float().numpy().copy() for x in xs]
  bt.ops.scale_(xs, factor)
  for x, b in zip(xs, before):
    np.testing.assert_allclose(x.float().numpy(), b * np.float32(0.37), rtol=1e-6 if x.dtype is bt.float32 else 1e-2)
  with pytest.raises(TypeError, match="sum_squares: expected float32, bfloat16 or float16"):
    bt.ops.sum_squares([bt.tensor([1, 2])])
  with pytest.raises(ValueError, match="scale: the factor must be a 0-d float32 tensor"):
    bt.ops.scale_(xs, bt.tensor([1.0, 2.0]))


def test_fused_and_foreach_flags():
  bparams, _ = make_params()
  assert optim.AdamW(bparams, fused=True).param_groups[0]["fused"] is True
  assert optim.SGD(bparams, foreach=False).param_groups[0]["foreach"] is False
  with pytest.raises(RuntimeError, match="cannot be `True` together"): optim.Adam(bparams, fused=True, foreach=True)


@pytest.mark.parametrize("kwargs,match", [(dict(lr=-1.0), "learning rate"), (dict(betas=(1.0, 0.9)), "beta parameter at index 0"),
                                          (dict(betas=(0.9, -0.1)), "index 1"), (dict(eps=-1.0), "epsilon"),
                                          (dict(weight_decay=-0.1), "weight_decay")])
def test_adam_invalid_hyperparameters(kwargs, match):
  with pytest.raises(ValueError, match=match): optim.Adam(make_params()[0], **kwargs)


def test_sgd_invalid_hyperparameters():
  ps = make_params()[0]
  with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
    optim.SGD(ps, lr=0.1, nesterov=True)
  with pytest.raises(ValueError, match="Nesterov"): optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)
  with pytest.raises(ValueError, match="momentum value"): optim.SGD(ps, momentum=-0.5)
  with pytest.raises(ValueError, match="learning rate"): optim.SGD(ps, lr=-0.5)


# *** state_dict ***

def test_state_dict_format_matches_torch():
  bopt, topt = run_against_torch(optim.AdamW, torch.optim.AdamW, dict(lr=1e-2, amsgrad=True), steps=2)
  bsd, tsd = bopt.state_dict(), topt.state_dict()
  assert set(bsd) == {"state", "param_groups"}
  assert list(bsd["state"]) == list(tsd["state"]) == [0, 1, 2]
  assert [g["params"] for g in bsd["param_groups"]] == [g["params"] for g in tsd["param_groups"]] == [[0, 1, 2]]
  assert set(bsd["param_groups"][0]) <= set(tsd["param_groups"][0])
  assert {k: v for k, v in bsd["param_groups"][0].items()} == {k: tsd["param_groups"][0][k] for k in bsd["param_groups"][0]}
  for i in range(3): assert set(bsd["state"][i]) == set(tsd["state"][i])
  sgd = optim.SGD(make_params()[0], lr=0.1)
  assert sgd.state_dict()["state"] == {}


@pytest.mark.parametrize("cls,kwargs", [(optim.AdamW, dict(lr=1e-2, weight_decay=0.1)), (optim.Adam, dict(lr=1e-2, amsgrad=True)),
                                        (optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
                                        (optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
                                        (optim.Adagrad, dict(lr=0.1, lr_decay=0.01))])
def test_state_dict_round_trip_resumes_exactly(cls, kwargs):
  """Save after 3 steps, load into a fresh optimizer over a copy of the parameters, go on: identical to the
  uninterrupted run, bit for bit."""
  params, _ = make_params()
  opt = cls(params, **kwargs)
  rng = np.random.default_rng(5)
  grads = [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(6)]

  def step(o, ps, gs):
    for p, g in zip(ps, gs): p.grad = bt.tensor(g)
    o.step()
  for gs in grads[:3]: step(opt, params, gs)
  saved = opt.state_dict()
  # what a checkpoint does: tensors leave as numpy arrays and come back as new tensors
  saved = {"state": {i: {k: (bt.tensor(v.numpy()) if isinstance(v, bt.Tensor) else v) for k, v in s.items()}
                     for i, s in saved["state"].items()}, "param_groups": saved["param_groups"]}
  resumed_params = [nn.Parameter(bt.tensor(p.detach().numpy())) for p in params]
  resumed = cls(resumed_params, lr=123.0)
  resumed.load_state_dict(saved)
  assert resumed.param_groups[0]["lr"] == kwargs["lr"] and resumed.param_groups[0]["params"][0] is resumed_params[0]
  for gs in grads[3:]:
    step(opt, params, gs)
    step(resumed, resumed_params, gs)
  for a, b in zip(params, resumed_params): np.testing.assert_array_equal(a.detach().numpy(), b.detach().numpy())


def test_load_state_dict_copies_state():
  """Loading one optimizer's live state_dict into another must not make them share moment tensors."""
  bparams, _ = make_params()
  a = optim.Adam(bparams, lr=1e-2)
  set_grads(bparams, make_params()[1], np.random.default_rng(0))
  a.step()
  b = optim.Adam(make_params()[0], lr=1e-2)
  b.load_state_dict(a.state_dict())
  pa, pb = a.param_groups[0]["params"][0], b.param_groups[0]["params"][0]
  assert b.state[pb]["exp_avg"]._storage is not a.state[pa]["exp_avg"]._storage
  assert b.state[pb]["step"] == 1


def test_load_torch_state_dict_continues_like_torch():
  """A PyTorch optimizer's state_dict (0-d tensor `step`), converted tensor by tensor, resumes as torch does."""
  bparams, tparams = make_params()
  topt = torch.optim.AdamW(tparams, lr=1e-2, weight_decay=0.1)
  rng = np.random.default_rng(3)
  for _ in range(3):
    set_grads(bparams, tparams, rng)
    topt.step()
  with torch.no_grad():
    for b, t in zip(bparams, tparams): b.data = bt.tensor(t.numpy())
  tsd = topt.state_dict()
  bopt = optim.AdamW(bparams)
  bopt.load_state_dict({"state": {i: {k: bt.tensor(v.numpy()) for k, v in s.items()} for i, s in tsd["state"].items()},
                        "param_groups": tsd["param_groups"]})
  assert bopt.state[bparams[0]]["step"] == 3
  for step in range(3):
    set_grads(bparams, tparams, rng)
    bopt.step(); topt.step()
    assert_params_equal(bparams, tparams, f"resumed step {step}")


def test_load_state_dict_mismatch_errors():
  bparams, _ = make_params()
  opt = optim.SGD([{"params": bparams[:2]}, {"params": bparams[2:]}], lr=0.1)
  with pytest.raises(ValueError, match="different number of parameter groups: 1 in the state dict, 2 in the optimizer"):
    opt.load_state_dict(optim.SGD(bparams, lr=0.1).state_dict())
  other = optim.SGD([{"params": bparams[:1]}, {"params": bparams[1:]}], lr=0.1)
  with pytest.raises(ValueError, match="doesn't match the size of optimizer's group: group 0 has 1 parameters in the "
                                       "state dict, 2 in the optimizer"):
    opt.load_state_dict(other.state_dict())
  with pytest.raises(KeyError, match="parameter 7"):
    opt.load_state_dict({"state": {7: {}}, "param_groups": opt.state_dict()["param_groups"]})


# *** the Optimizer base ***

def test_optimizer_construction_checks():
  ps = make_params()[0]
  with pytest.raises(ValueError, match="empty parameter list"): optim.SGD([], lr=0.1)
  with pytest.raises(TypeError, match="iterable of Tensors or dicts"): optim.SGD(ps[0], lr=0.1)
  with pytest.raises(TypeError, match="ordered collections"): optim.SGD([{"params": set(ps)}], lr=0.1)
  with pytest.raises(ValueError, match="more than one parameter group"): optim.SGD([{"params": ps}, {"params": ps[:1]}], lr=0.1)
  with pytest.raises(ValueError, match="non-leaf"): optim.SGD([ps[0] * 2], lr=0.1)
  with pytest.raises(TypeError, match="only optimize Tensors"): optim.SGD([1.0], lr=0.1)
  with pytest.warns(UserWarning, match="duplicate parameters"): optim.SGD([ps[0], ps[0]], lr=0.1)
  opt = optim.SGD(iter(ps[:2]), lr=0.1)  # a generator, like model.parameters()
  opt.add_param_group({"params": ps[2], "lr": 0.5})
  assert opt.param_groups[1]["lr"] == 0.5 and opt.param_groups[1]["momentum"] == 0 and opt.param_groups[1]["params"] == [ps[2]]
  assert "SGD (\nParameter Group 0\n" in repr(opt) and "    lr: 0.5" in repr(opt)


def test_zero_grad_and_closure():
  ps = make_params()[0]
  opt = optim.SGD(ps, lr=0.1)
  for p in ps: p.grad = bt.ones(p.shape)
  opt.zero_grad(set_to_none=False)
  assert all(float(p.grad.abs().sum()) == 0 for p in ps)
  opt.zero_grad()
  assert all(p.grad is None for p in ps)
  before = [p.detach().numpy().copy() for p in ps]

  def closure():
    assert bt.is_grad_enabled()
    loss = sum((p * p).sum() for p in ps)
    loss.backward()
    return loss
  loss = opt.step(closure)
  assert isinstance(loss, bt.Tensor) and bt.is_grad_enabled()
  for b, p in zip(before, ps): np.testing.assert_allclose(p.detach().numpy(), b - 0.1 * 2 * b, rtol=1e-6)


def test_optimizer_follows_module_load_and_to():
  """load_state_dict and Module.to change parameters in place, so the optimizer still updates the model's."""
  model = nn.Linear(3, 2)
  opt = optim.SGD(model.parameters(), lr=1.0)
  model.load_state_dict(nn.Linear(3, 2).state_dict())
  model.to(bt.float64)
  model(bt.randn(4, 3, dtype=bt.float64)).sum().backward()
  before = model.weight.detach().numpy().copy()
  opt.step()
  np.testing.assert_allclose(model.weight.detach().numpy(), before - model.weight.grad.numpy())


def test_train_a_regression_to_convergence():
  """End to end: Linear + AdamW + clip + warmup_cosine fit a noiseless linear map."""
  rng = np.random.default_rng(0)
  w_true = rng.standard_normal((2, 4)).astype(np.float32)
  x = rng.standard_normal((64, 4)).astype(np.float32)
  X, Y = bt.tensor(x), bt.tensor(x @ w_true.T)
  model = nn.Linear(4, 2)
  opt = optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
  sched = lr_scheduler.warmup_cosine(opt, warmup_steps=5, total_steps=150, min_lr_ratio=0.01)
  for _ in range(150):
    loss = nn.functional.mse_loss(model(X), Y)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(); opt.zero_grad(); sched.step()
  assert loss.item() < 1e-4


# *** LR schedules against torch.optim.lr_scheduler ***

SCHEDULES = {
  "lambda": lambda lib, o: lib.LambdaLR(o, lambda e: 0.95 ** e),
  "lambda_per_group": lambda lib, o: lib.LambdaLR(o, [lambda e: 1 / (e + 1), lambda e: 0.5 + 0.1 * (e % 3)]),
  "step": lambda lib, o: lib.StepLR(o, step_size=3, gamma=0.5),
  "cosine": lambda lib, o: lib.CosineAnnealingLR(o, T_max=10, eta_min=1e-3),
  "linear": lambda lib, o: lib.LinearLR(o, start_factor=0.25, total_iters=4),
  "linear_decay": lambda lib, o: lib.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=8),
  "sequential": lambda lib, o: lib.SequentialLR(o, [lib.LinearLR(o, start_factor=0.1, total_iters=5),
                                                    lib.CosineAnnealingLR(o, T_max=12, eta_min=1e-4)], milestones=[5]),
  "sequential3": lambda lib, o: lib.SequentialLR(o, [lib.LinearLR(o, start_factor=0.5, total_iters=3),
                                                     lib.StepLR(o, step_size=2, gamma=0.9),
                                                     lib.CosineAnnealingLR(o, T_max=6)], milestones=[3, 9]),
}


def two_group_optimizers():
  bparams, tparams = make_params()
  return (optim.SGD([{"params": bparams[:2]}, {"params": bparams[2:], "lr": 0.01}], lr=0.1),
          torch.optim.SGD([{"params": tparams[:2]}, {"params": tparams[2:], "lr": 0.01}], lr=0.1))


@pytest.mark.parametrize("name", SCHEDULES)
def test_scheduler_matches_torch(name):
  bopt, topt = two_group_optimizers()
  bsched, tsched = SCHEDULES[name](lr_scheduler, bopt), SCHEDULES[name](torch.optim.lr_scheduler, topt)
  for step in range(25):
    np.testing.assert_allclose(bsched.get_last_lr(), tsched.get_last_lr(), rtol=1e-9, atol=1e-12, err_msg=f"step {step}")
    assert [g["lr"] for g in bopt.param_groups] == bsched.get_last_lr()
    topt.step(); bopt.step()
    bsched.step(); tsched.step()
  assert [g["initial_lr"] for g in bopt.param_groups] == [0.1, 0.01]


@pytest.mark.parametrize("name", ["step", "cosine", "sequential", "lambda"])
def test_scheduler_state_dict_round_trip(name):
  bopt, _ = two_group_optimizers()
  sched = SCHEDULES[name](lr_scheduler, bopt)
  for _ in range(7): sched.step()
  saved = sched.state_dict()
  assert "optimizer" not in saved and saved["last_epoch"] == 7
  other_opt, _ = two_group_optimizers()
  other = SCHEDULES[name](lr_scheduler, other_opt)
  other.load_state_dict(saved)
  for _ in range(10):
    sched.step(); other.step()
    assert other.get_last_lr() == sched.get_last_lr()
    assert [g["lr"] for g in other_opt.param_groups] == sched.get_last_lr()


def test_warmup_cosine_values():
  bopt, _ = two_group_optimizers()
  sched = lr_scheduler.warmup_cosine(bopt, warmup_steps=4, total_steps=20, min_lr_ratio=0.1)
  factors = []
  for _ in range(25):
    factors.append(sched.get_last_lr()[0] / 0.1)
    assert sched.get_last_lr()[1] == pytest.approx(0.01 * factors[-1], rel=1e-12)
    sched.step()
  np.testing.assert_allclose(factors[:5], [0.25, 0.5, 0.75, 1.0, 1.0], rtol=1e-12)
  for step in range(4, 20):
    want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 4) / 16))
    assert factors[step] == pytest.approx(want, rel=1e-12)
  assert all(a >= b for a, b in zip(factors[3:], factors[4:])) and factors[20:] == [pytest.approx(0.1)] * 5
  with pytest.raises(ValueError, match="warmup_steps <= total_steps"): lr_scheduler.warmup_cosine(bopt, 10, 5)


def test_warmup_cosine_state_dict_keeps_its_shape():
  """The multiplier is an object, so LambdaLR's state_dict carries warmup and total steps into a new scheduler."""
  bopt, _ = two_group_optimizers()
  sched = lr_scheduler.warmup_cosine(bopt, warmup_steps=3, total_steps=30)
  for _ in range(6): sched.step()
  other_opt, _ = two_group_optimizers()
  other = lr_scheduler.warmup_cosine(other_opt, warmup_steps=1, total_steps=2)
  other.load_state_dict(sched.state_dict())
  for _ in range(5):
    sched.step(); other.step()
    assert other.get_last_lr() == sched.get_last_lr()


ONE_CYCLE = {
  "sgd_cos": (lambda lib_opt, ps: lib_opt.SGD(ps, lr=0.1, momentum=0.9), dict(max_lr=1.0, total_steps=20)),
  "sgd_linear_three_phase": (lambda lib_opt, ps: lib_opt.SGD(ps, lr=0.1, momentum=0.9),
                             dict(max_lr=[0.5, 2.0, 1.0], epochs=3, steps_per_epoch=7, anneal_strategy="linear",
                                  three_phase=True, pct_start=0.25)),
  "adam_betas": (lambda lib_opt, ps: lib_opt.Adam(ps, lr=0.1), dict(max_lr=0.01, total_steps=15, div_factor=10.0,
                                                                    base_momentum=0.8, max_momentum=0.9)),
  "no_momentum": (lambda lib_opt, ps: lib_opt.SGD(ps, lr=0.1), dict(max_lr=0.3, total_steps=12, cycle_momentum=False)),
}


@pytest.mark.parametrize("name", ONE_CYCLE)
def test_one_cycle_matches_torch(name):
  make, kwargs = ONE_CYCLE[name]
  bparams, tparams = make_params()
  split = lambda ps: [{"params": [p]} for p in ps] if isinstance(kwargs["max_lr"], list) else ps
  bopt, topt = make(optim, split(bparams)), make(torch.optim, split(tparams))
  bs, ts = lr_scheduler.OneCycleLR(bopt, **kwargs), torch.optim.lr_scheduler.OneCycleLR(topt, **kwargs)
  total = kwargs.get("total_steps") or kwargs["epochs"] * kwargs["steps_per_epoch"]
  for step in range(total):
    np.testing.assert_allclose(bs.get_last_lr(), ts.get_last_lr(), rtol=1e-12, err_msg=f"step {step}")
    for bg, tg in zip(bopt.param_groups, topt.param_groups):
      for key in ("momentum", "betas", "initial_lr", "max_lr", "min_lr"):
        if key in tg: assert bg[key] == pytest.approx(tg[key], rel=1e-12), (step, key)
    bopt.step(); topt.step(); bs.step(); ts.step()
  with pytest.raises(ValueError, match="Tried to step"): bs.step()
  with pytest.raises(ValueError, match="total_steps OR"): lr_scheduler.OneCycleLR(bopt, max_lr=1.0)
  if name == "no_momentum":
    with pytest.raises(ValueError, match="momentum or beta1"):
      lr_scheduler.OneCycleLR(optim.Adagrad(make_params()[0]), max_lr=1.0, total_steps=5)


@pytest.mark.parametrize("kwargs", [dict(), dict(mode="max", factor=0.5, patience=1, threshold=0.1),
                                    dict(patience=2, cooldown=2, threshold_mode="abs", threshold=0.05, min_lr=[0.02, 0.0])])
def test_reduce_lr_on_plateau_matches_torch(kwargs):
  bopt, topt = two_group_optimizers()
  bs, ts = lr_scheduler.ReduceLROnPlateau(bopt, **kwargs), torch.optim.lr_scheduler.ReduceLROnPlateau(topt, **kwargs)
  metrics = np.concatenate([np.linspace(1.0, 0.5, 5), np.full(30, 0.5), np.linspace(0.5, 0.45, 5), np.full(20, 0.6)])
  for step, m in enumerate(metrics):
    bs.step(float(m)); ts.step(float(m))
    assert [g["lr"] for g in bopt.param_groups] == pytest.approx([g["lr"] for g in topt.param_groups], rel=1e-12), step
    assert bs.get_last_lr() == pytest.approx(ts.get_last_lr(), rel=1e-12)
  assert bopt.param_groups[0]["lr"] < 0.1
  state = bs.state_dict()
  other = lr_scheduler.ReduceLROnPlateau(two_group_optimizers()[0], **kwargs)
  other.load_state_dict(state)
  assert other.best == bs.best and other.num_bad_epochs == bs.num_bad_epochs
  with pytest.raises(ValueError, match="Factor should be < 1.0"): lr_scheduler.ReduceLROnPlateau(bopt, factor=1.0)
  with pytest.raises(ValueError, match="mode avg is unknown"): lr_scheduler.ReduceLROnPlateau(bopt, mode="avg")


def test_scheduler_checks():
  bopt, _ = two_group_optimizers()
  with pytest.raises(KeyError, match="initial_lr"): lr_scheduler.StepLR(bopt, 2, last_epoch=4)
  with pytest.raises(ValueError, match="Expected 2 lr_lambdas, but got 1"): lr_scheduler.LambdaLR(bopt, [lambda e: 1.0])
  with pytest.raises(ValueError, match="Starting multiplicative factor"): lr_scheduler.LinearLR(bopt, start_factor=0)
  with pytest.raises(ValueError, match="number of milestone"):
    lr_scheduler.SequentialLR(bopt, [lr_scheduler.StepLR(bopt, 2)], milestones=[3])
  with pytest.raises(TypeError, match="not an Optimizer"): lr_scheduler.StepLR(object(), 2)
  lr_scheduler.StepLR(bopt, step_size=2, gamma=0.5)  # records each group's initial_lr
  resumed = lr_scheduler.StepLR(bopt, step_size=2, gamma=0.5, last_epoch=4)
  assert resumed.last_epoch == 5 and resumed.get_last_lr() == [0.1 * 0.25, 0.01 * 0.25]
