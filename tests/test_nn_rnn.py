"""LSTM, GRU and MultiheadAttention against torch.nn with the same weights: outputs, final states, input and weight
gradients (multi-layer, bidirectional, batch_first, unbatched, given initial states, masks), a float64
finite-difference check, errors, and an LSTM's compiled training step equal to eager."""
import numpy as np
import pytest
import torch

import blutrain as bt
from blutrain import nn
from blutrain.nn import functional as F
from tests.helpers import assert_close, check_vjp

RNG = np.random.default_rng(0)


def twins(bcls, tcls, *args, **kwargs):
  """The same layer in both libraries, with torch's random weights copied over."""
  tm = tcls(*args, **kwargs)
  bm = bcls(*args, **kwargs)
  assert [(k, tuple(v.shape)) for k, v in bm.state_dict().items()] == [(k, tuple(v.shape)) for k, v in tm.state_dict().items()]
  bm.load_state_dict({k: bt.tensor(v.numpy()) for k, v in tm.state_dict().items()})
  return bm, tm


def compare(bouts, touts, bleaves, tleaves, bm, tm, atol=1e-5, rtol=1e-4):
  """Outputs equal; then gradients of a random projection of every output, for inputs and parameters."""
  bflat, tflat = [], []
  for b, t in zip(bouts, touts):
    if isinstance(t, tuple): bflat += list(b); tflat += list(t)
    elif t is not None: bflat.append(b); tflat.append(t)
  bloss, tloss = 0, 0
  for i, (b, t) in enumerate(zip(bflat, tflat)):
    assert_close(b, t, what=f"output {i}", atol=atol, rtol=rtol)
    u = RNG.standard_normal(tuple(t.shape)).astype(np.float32)
    bloss, tloss = bloss + (b * bt.tensor(u)).sum(), tloss + (t * torch.tensor(u)).sum()
  bloss.backward(); tloss.backward()
  for i, (b, t) in enumerate(zip(bleaves, tleaves)): assert_close(b.grad, t.grad, what=f"input grad {i}", atol=atol, rtol=rtol)
  bp = dict(bm.named_parameters())
  for name, p in tm.named_parameters(): assert_close(bp[name].grad, p.grad, what=f"grad of {name}", atol=atol, rtol=rtol)


def leaf(*shape, transposed=False):
  a = RNG.standard_normal(shape).astype(np.float32)
  if transposed:  # a non-contiguous view of the same values
    b = bt.tensor(np.ascontiguousarray(a.swapaxes(0, 1)), requires_grad=True)
    t = torch.tensor(np.ascontiguousarray(a.swapaxes(0, 1)), requires_grad=True)
    return b, t, b.transpose(0, 1), t.transpose(0, 1)
  b, t = bt.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)
  return b, t, b, t


CONFIGS = [dict(), dict(num_layers=2), dict(bidirectional=True), dict(num_layers=3, bidirectional=True, batch_first=True),
           dict(bias=False, batch_first=True), dict(num_layers=2, dropout=0.5)]


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_rnn_matches_torch(kind, cfg):
  bm, tm = twins(getattr(nn, kind), getattr(torch.nn, kind), 5, 6, **cfg)
  if cfg.get("dropout"): bm.eval(); tm.eval()
  shape = (3, 4, 5)  # (L, N, H) or (N, L, H) with batch_first
  bx, tx, bv, tv = leaf(*shape, transposed=True)
  compare(bm(bv), tm(tv), [bx], [tx], bm, tm)


@pytest.mark.parametrize("cfg", [dict(), dict(num_layers=2, bidirectional=True, batch_first=True)])
def test_lstm_proj_size_matches_torch(cfg):
  bm, tm = twins(nn.LSTM, torch.nn.LSTM, 5, 6, proj_size=3, **cfg)
  assert "weight_hr_l0" in bm.state_dict() and "proj_size=3" in repr(bm)
  bx, tx, _, _ = leaf(4, 2, 5)
  compare(bm(bx), tm(tx), [bx], [tx], bm, tm)
  bm.zero_grad(); tm.zero_grad()
  layers = 2 * cfg.get("num_layers", 1) if cfg.get("bidirectional") else cfg.get("num_layers", 1)
  (bh, th, _, _), (bc, tc, _, _) = leaf(layers, 4 if cfg else 2, 3), leaf(layers, 4 if cfg else 2, 6)
  compare(bm(bx, (bh, bc)), tm(tx, (th, tc)), [bx, bh, bc], [tx, th, tc], bm, tm)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_rnn_with_initial_states_and_unbatched(kind):
  bm, tm = twins(getattr(nn, kind), getattr(torch.nn, kind), 4, 3, num_layers=2, bidirectional=True)
  bx, tx, _, _ = leaf(5, 2, 4)
  states = [leaf(4, 2, 3) for _ in range(2 if kind == "LSTM" else 1)]
  bh = tuple(s[0] for s in states) if kind == "LSTM" else states[0][0]
  th = tuple(s[1] for s in states) if kind == "LSTM" else states[0][1]
  compare(bm(bx, bh), tm(tx, th), [bx] + [s[0] for s in states], [tx] + [s[1] for s in states], bm, tm)
  bm.zero_grad(); tm.zero_grad()
  ux, tux, _, _ = leaf(5, 4)
  compare(bm(ux), tm(tux), [ux], [tux], bm, tm)


def test_rnn_vjp_against_finite_differences():
  bt.manual_seed(0)
  m = nn.GRU(3, 2, num_layers=2, bidirectional=True).double()
  check_vjp(lambda x: m(x)[0], [(4, 2, 3)])
  lstm = nn.LSTM(3, 2).double()
  check_vjp(lambda x: lstm(x)[1][1], [(3, 2, 3)])


def _torch_lstm_cell(gi, gh, c):
  i, f, g, o = (gi + gh).chunk(4, 1)
  c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
  return torch.sigmoid(o) * torch.tanh(c), c


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_lstm_cell_matches_torch(layout):
  """The fused step against PyTorch's composite: both halves and every input's gradient, in float64, from inputs
  that are rows of wider tensors (as nn.LSTM passes them) or contiguous."""
  rng = np.random.default_rng(0)
  N, H = 5, 3
  arrays = [rng.standard_normal(shape) for shape in ((N, 4 * H), (N, 4 * H), (N, H))]
  pad = (lambda a: np.concatenate([a, rng.standard_normal(a.shape)], 1)) if layout == "strided" else (lambda a: a)
  ours = [bt.tensor(pad(a), requires_grad=True) for a in arrays]
  theirs = [torch.tensor(pad(a), requires_grad=True) for a in arrays]
  cut = (lambda t, a: t[:, :a.shape[1]]) if layout == "strided" else (lambda t, a: t)
  got = bt.ops.lstm_cell(*(cut(t, a) for t, a in zip(ours, arrays)))
  want = _torch_lstm_cell(*(cut(t, a) for t, a in zip(theirs, arrays)))
  w = [rng.standard_normal((N, H)) for _ in range(2)]
  for g, t in zip(got, want): assert_close(g, t, bt.float64)
  sum((g * bt.tensor(u)).sum() for g, u in zip(got, w)).backward()
  sum((t * torch.tensor(u)).sum() for t, u in zip(want, w)).backward()
  for o, t in zip(ours, theirs): assert_close(o.grad, t.grad, bt.float64, "gradient")


def _torch_gru_cell(gi, gh, h):
  (ir, iz, in_), (hr, hz, hn) = gi.chunk(3, 1), gh.chunk(3, 1)
  r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
  n = torch.tanh(in_ + r * hn)
  return (1 - z) * n + z * h


def test_gru_cell_matches_torch():
  """The fused GRU step against PyTorch's composite in float64, on a hidden state that is a view of a wider tensor:
  h' and the gradients of both gates and h (the n block of gh's differs from gi's)."""
  rng = np.random.default_rng(1)
  N, H = 4, 3
  gi, gh, wide = rng.standard_normal((N, 3 * H)), rng.standard_normal((N, 3 * H)), rng.standard_normal((N, 2 * H))
  ours = [bt.tensor(a, requires_grad=True) for a in (gi, gh, wide)]
  theirs = [torch.tensor(a, requires_grad=True) for a in (gi, gh, wide)]
  got, want = bt.ops.gru_cell(ours[0], ours[1], ours[2][:, :H]), _torch_gru_cell(theirs[0], theirs[1], theirs[2][:, :H])
  assert_close(got, want, bt.float64)
  w = rng.standard_normal((N, H))
  (got * bt.tensor(w)).sum().backward()
  (want * torch.tensor(w)).sum().backward()
  for o, t in zip(ours, theirs): assert_close(o.grad, t.grad, bt.float64, "gradient")
  with pytest.raises(RuntimeError, match=r"gru_cell: expected .* \[4, 9\], \[4, 9\] and \[4, 2\]"):
    bt.ops.gru_cell(ours[0], ours[1], bt.randn(4, 2, dtype=bt.float64))


def test_lstm_cell_vjp_against_finite_differences():
  check_vjp(lambda gi, gh, c: bt.ops.lstm_cell(gi, gh, c)[0] * 2 + bt.ops.lstm_cell(gi, gh, c)[1],
            [(4, 8), (4, 8), (4, 2)])


def test_lstm_cell_dtypes_and_errors():
  gi, c = bt.randn(2, 8, dtype=bt.bfloat16), bt.randn(2, 2)
  h, c2 = bt.ops.lstm_cell(gi, gi, c)
  assert h.dtype is c2.dtype is bt.float32 and h.shape == c2.shape == (2, 2)
  with pytest.raises(RuntimeError, match=r"lstm_cell: expected .* \[2, 8\], \[2, 8\] and \[2, 3\]"):
    bt.ops.lstm_cell(gi, gi, bt.randn(2, 3))
  with pytest.raises(TypeError, match="lstm_cell: expected floating"):
    bt.ops.lstm_cell(gi, gi, bt.ones(2, 2, dtype=bt.int64))


def test_lstm_matches_torch_in_float64():
  """nn.LSTM on lstm_sequence in float64 (two bidirectional layers, batch_first, given states): outputs, final states
  and every gradient to float64's tolerance."""
  bm, tm = twins(nn.LSTM, torch.nn.LSTM, 5, 6, num_layers=2, bidirectional=True, batch_first=True)
  bm, tm = bm.double(), tm.double()
  arrays = [RNG.standard_normal(shape) for shape in ((3, 4, 5), (4, 3, 6), (4, 3, 6))]
  bl, tl = [bt.tensor(a, requires_grad=True) for a in arrays], [torch.tensor(a, requires_grad=True) for a in arrays]
  compare(bm(bl[0], tuple(bl[1:])), tm(tl[0], tuple(tl[1:])), bl, tl, bm, tm, atol=1e-10, rtol=1e-8)


def _torch_sequence(kind, gi, states, w_hh, b_hh, reverse):
  """PyTorch's per-step composite of lstm_sequence (every h and the last c) or gru_sequence (every h)."""
  state, hs = list(states), []
  for t in (range(gi.shape[0] - 1, -1, -1) if reverse else range(gi.shape[0])):
    gh = torch.nn.functional.linear(state[0], w_hh, b_hh)
    state = list(_torch_lstm_cell(gi[t], gh, state[1])) if kind == "lstm" else [_torch_gru_cell(gi[t], gh, state[0])]
    hs.append(state[0])
  hs = torch.stack(hs[::-1] if reverse else hs)
  return (hs, state[1]) if kind == "lstm" else (hs,)


def _sequence(kind, gi, states, w_hh, b_hh, reverse):
  """bt.ops.lstm_sequence or gru_sequence, its results as a tuple."""
  if kind == "lstm": return bt.ops.lstm_sequence(gi, *states, w_hh, b_hh, reverse=reverse)
  return (bt.ops.gru_sequence(gi, *states, w_hh, b_hh, reverse=reverse),)


GATES = {"lstm": (4, 2), "gru": (3, 1)}  # gate blocks, initial states


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("dtype", [bt.float64, bt.float32])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_sequence_matches_torch(kind, dtype, reverse, bias):
  """The whole loop against PyTorch's per-step composite: every h (and the LSTM's last c), and the gradients of gi (a
  non-contiguous view), the initial states, w_hh and b_hh."""
  rng = np.random.default_rng(1)
  (gates, n_states), (L, N, H) = GATES[kind], (6, 3, 4)
  shapes = [(N, L, gates * H)] + [(N, H)] * n_states + [(gates * H, H), (gates * H,)]
  arrays = [(rng.standard_normal(s) * 0.7).astype(dtype.np) for s in shapes[:len(shapes) - (not bias)]]
  ours = [bt.tensor(a, requires_grad=True) for a in arrays]
  theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
  split = lambda ts: (ts[0].transpose(0, 1), ts[1:1 + n_states], ts[1 + n_states], ts[2 + n_states] if bias else None)
  got, want = _sequence(kind, *split(ours), reverse), _torch_sequence(kind, *split(theirs), reverse)
  us = [rng.standard_normal(tuple(t.shape)).astype(dtype.np) for t in want]
  for g, t in zip(got, want): assert_close(g, t, dtype)
  sum((g * bt.tensor(u)).sum() for g, u in zip(got, us)).backward()
  sum((t * torch.tensor(u)).sum() for t, u in zip(want, us)).backward()
  for i, (o, t) in enumerate(zip(ours, theirs)): assert_close(o.grad, t.grad, dtype, f"gradient of input {i}")


def test_sequence_backward_skips_what_needs_no_gradient():
  """With the initial states (or the weights) needing no gradient the backward op is asked for none: their results
  are None."""
  gi, h0, c0, w, b = (bt.randn(*s) for s in ((3, 2, 8), (2, 2), (2, 2), (8, 2), (8,)))
  out = bt.ops.nn.lstm_sequence_op(gi, h0, c0, w, b, reverse=False)
  vjp = lambda *needs: bt.ops.nn.lstm_sequence_op.vjp(bt.randn(3, 2, 4), out, gi, h0, c0, w, b, reverse=False,
                                                       needs=needs)
  dgi, dh0, dc0, dw, db = vjp(True, False, False, True, True)
  assert dh0 is None and dc0 is None and dgi.shape == gi.shape and dw.shape == w.shape and db.shape == b.shape
  dgi, dh0, dc0, dw, db = vjp(True, True, True, False, False)
  assert dw is None and db is None and dh0.shape == dc0.shape == (2, 2)
  gi, w, b = gi[..., :6], w[:6], b[:6]
  out = bt.ops.nn.gru_sequence_op(gi, h0, w, b, reverse=True)
  vjp = lambda *needs: bt.ops.nn.gru_sequence_op.vjp(bt.randn(3, 2, 2), out, gi, h0, w, b, reverse=True, needs=needs)
  dgi, dh0, dw, db = vjp(True, False, True, True)
  assert dh0 is None and dgi.shape == gi.shape and dw.shape == w.shape and db.shape == b.shape
  dgi, dh0, dw, db = vjp(True, True, False, False)
  assert dw is None and db is None and dh0.shape == (2, 2)


def _per_step(kind):
  """nn.LSTM's or nn.GRU's loop as it was: one linear and one cell per step (the composite a sequence stands for)."""
  def run(gi, *args):
    *states, w_hh, b_hh, reverse = args
    hs = []
    for t in (range(gi.shape[0] - 1, -1, -1) if reverse else range(gi.shape[0])):
      gh = F.linear(states[0], w_hh, b_hh)
      states = bt.ops.lstm_cell(gi[t], gh, states[1]) if kind == "LSTM" else [bt.ops.gru_cell(gi[t], gh, states[0])]
      hs.append(states[0])
    hs = bt.stack(hs[::-1] if reverse else hs, 0)
    return (hs, states[1]) if kind == "LSTM" else hs
  return run


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("half", ["autocast", "bfloat16"])
def test_half_sequences_equal_the_per_step_ops(kind, half, monkeypatch):
  """bf16 under autocast (float32 states, bf16 matmuls) and a bf16 model: the outputs equal the per-step ops' bit for
  bit; the gradients (the sequence sums d w_hh in float32 once, the steps in bf16 per step) to bf16's tolerance."""
  results = []
  for seq in (True, False):
    if not seq: monkeypatch.setattr(bt.ops, f"{kind.lower()}_sequence", _per_step(kind))
    bt.manual_seed(0)
    m = getattr(nn, kind)(5, 8, num_layers=2, bidirectional=True)
    x = bt.tensor(np.random.default_rng(2).standard_normal((7, 3, 5)).astype(np.float32))
    if half == "bfloat16": m, x = m.to(bt.bfloat16), x.to(bt.bfloat16)
    x.requires_grad_()
    with bt.autocast("cpu", dtype=bt.bfloat16, enabled=half == "autocast"):
      out, state = m(x)
    outs = [out, *(state if kind == "LSTM" else (state,))]
    sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs)).backward()
    results.append(outs + [x.grad] + [p.grad for p in m.parameters()])
  n = 3 if kind == "LSTM" else 2
  for i, (a, b) in enumerate(zip(*results)):
    assert a.dtype is b.dtype and a.shape == b.shape
    if i < n:
      np.testing.assert_array_equal(a.detach().float().numpy(), b.detach().float().numpy(), err_msg=f"output {i}")
    else:  # both sum bf16 roundings of the same terms: compared at bf16's tolerance relative to the largest entry
      want = b.detach().float().numpy()
      assert_close(a, want, bt.bfloat16, f"gradient {i}", atol=2e-2 * max(1.0, float(np.abs(want).max())), rtol=3e-2)


def test_sequence_errors_name_the_op():
  gi, h, w = bt.randn(3, 2, 8), bt.randn(2, 2), bt.randn(8, 2)
  with pytest.raises(RuntimeError, match=r"lstm_sequence: expected .* got \[3, 2, 8\], \[2, 2\], \[2, 3\], \[8, 2\]"):
    bt.ops.lstm_sequence(gi, h, bt.randn(2, 3), w)
  with pytest.raises(RuntimeError, match=r"lstm_sequence: expected input gates \(L, N, 4H\)"):
    bt.ops.lstm_sequence(bt.randn(2, 8), h, h, w)
  with pytest.raises(RuntimeError, match=r"lstm_sequence: .* and \[4\]"):
    bt.ops.lstm_sequence(gi, h, h, w, bt.randn(4))
  with pytest.raises(TypeError, match="lstm_sequence: expected a floating h0 and w_hh, and b_hh of w_hh's dtype"):
    bt.ops.lstm_sequence(gi, h, h, w, bt.randn(8, dtype=bt.float64))
  with pytest.raises(TypeError, match="lstm_sequence: expected floating"):
    bt.ops.lstm_sequence(gi, h, bt.ones(2, 2, dtype=bt.int64), w)
  with pytest.raises(RuntimeError, match=r"gru_sequence: expected input gates \(L, N, 3H\), h0 \(N, H\), w_hh "
                                         r"\(3H, H\) and b_hh \(3H,\), got \[3, 2, 8\], \[2, 2\], \[8, 2\]"):
    bt.ops.gru_sequence(gi, h, w)
  with pytest.raises(TypeError, match="gru_sequence: expected a floating h0"):
    bt.ops.gru_sequence(gi[..., :6], bt.ones(2, 2, dtype=bt.int64), w[:6])


def test_rnn_errors_and_training_dropout():
  m = nn.LSTM(4, 3, num_layers=2, dropout=0.5)
  with pytest.raises(RuntimeError, match="input_size. Expected 4, got 5"): m(bt.randn(2, 3, 5))
  with pytest.raises(ValueError, match="2D or 3D"): m(bt.randn(2, 3, 4, 1))
  with pytest.raises(RuntimeError, match="Expected hidden size"): m(bt.randn(2, 3, 4), (bt.zeros(1, 3, 3), bt.zeros(1, 3, 3)))
  with pytest.raises(ValueError, match="proj_size has to be smaller than hidden_size"): nn.LSTM(4, 3, proj_size=3)
  with pytest.raises(ValueError, match="only supported for LSTM"): nn.GRU(4, 3, proj_size=2)
  with pytest.raises(RuntimeError, match=r"Expected hidden size \(1, 3, 2\)"):
    nn.LSTM(4, 3, proj_size=2)(bt.randn(2, 3, 4), (bt.zeros(1, 3, 3), bt.zeros(1, 3, 3)))
  x = bt.randn(5, 2, 4)
  assert not np.array_equal(m(x)[0].detach().numpy(), m(x)[0].detach().numpy())  # dropout draws anew in training
  m.eval()
  np.testing.assert_array_equal(m(x)[0].detach().numpy(), m(x)[0].detach().numpy())


# *** MultiheadAttention ***

MHA = [dict(), dict(batch_first=True), dict(bias=False), dict(kdim=3, vdim=5)]


@pytest.mark.parametrize("cfg", MHA)
@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
def test_multihead_attention_matches_torch(cfg, need_weights, average):
  bm, tm = twins(nn.MultiheadAttention, torch.nn.MultiheadAttention, 8, 2, **cfg)
  L, S, N = 4, 6, 3
  lead = (lambda n, s: (n, s)) if cfg.get("batch_first") else (lambda n, s: (s, n))
  bq, tq, _, _ = leaf(*lead(N, L), 8)
  bk, tk, _, _ = leaf(*lead(N, S), cfg.get("kdim", 8))
  bv, tv, _, _ = leaf(*lead(N, S), cfg.get("vdim", 8))
  pad = RNG.random((N, S)) < 0.3
  pad[:, 0] = False  # every query sees at least one key
  kw = dict(need_weights=need_weights, average_attn_weights=average)
  compare(bm(bq, bk, bv, key_padding_mask=bt.tensor(pad), **kw), tm(tq, tk, tv, key_padding_mask=torch.tensor(pad), **kw),
          [bq, bk, bv], [tq, tk, tv], bm, tm)


def test_multihead_attention_masks_causal_and_unbatched():
  bm, tm = twins(nn.MultiheadAttention, torch.nn.MultiheadAttention, 6, 3)
  bq, tq, _, _ = leaf(5, 2, 6)
  float_mask = RNG.standard_normal((5, 5)).astype(np.float32)
  compare(bm(bq, bq, bq, attn_mask=bt.tensor(float_mask)), tm(tq, tq, tq, attn_mask=torch.tensor(float_mask)), [bq], [tq], bm, tm)
  bm.zero_grad(); tm.zero_grad()
  causal = np.triu(np.ones((5, 5), bool), 1)
  bx, tx, _, _ = leaf(5, 6)
  compare(bm(bx, bx, bx, attn_mask=bt.tensor(causal), is_causal=True),
          tm(tx, tx, tx, attn_mask=torch.tensor(causal), is_causal=True), [bx], [tx], bm, tm)
  with pytest.raises(RuntimeError, match="attn_mask"): bm(bq, bq, bq, attn_mask=bt.zeros(4, 4, dtype=bt.bool))
  with pytest.raises(AssertionError, match="divisible by num_heads"): nn.MultiheadAttention(7, 2)


# *** compiled == eager ***

class CharRNN(nn.Module):
  def __init__(self):
    super().__init__()
    self.emb, self.lstm, self.head = nn.Embedding(11, 6), nn.LSTM(6, 8, num_layers=2, batch_first=True), nn.Linear(8, 11)

  def forward(self, x):
    return self.head(self.lstm(self.emb(x))[0])


def test_lstm_training_step_compiled_equals_eager(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))
  pairs = []
  for _ in range(2):
    bt.manual_seed(0)
    m = CharRNN()
    pairs.append((m, bt.optim.Adam(m.parameters(), lr=1e-2)))

  def make_step(model, opt):
    def step(x, y):
      loss = F.cross_entropy(model(x).reshape(-1, 11), y.reshape(-1))
      loss.backward()
      opt.step()
      opt.zero_grad()
      return loss
    return step
  eager, compiled = make_step(*pairs[0]), bt.compile(make_step(*pairs[1]))
  for _ in range(3):
    x, y = (bt.tensor(RNG.integers(0, 11, (2, 5))) for _ in range(2))
    np.testing.assert_allclose(compiled(x, y).item(), eager(x, y).item(), rtol=1e-5)
  for (name, p), q in zip(pairs[0][0].state_dict().items(), pairs[1][0].state_dict().values()):
    np.testing.assert_allclose(q.numpy(), p.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
