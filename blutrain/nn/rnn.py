"""Recurrent layers (LSTM, GRU; multi-layer, bidirectional, batch_first) and MultiheadAttention, as composites over
matmuls: each layer projects the whole sequence's inputs in one matmul, then runs its time loop. A direction is one
`lstm_sequence` or `gru_sequence` primitive (the loop of recurrent matmuls and cells inside its kernel, one op eagerly
and in a compiled graph, and one op backward); an LSTM with proj_size loops in Python, one matmul of the hidden state
and one `lstm_cell` primitive per step (unrolled under `bt.compile`)."""
from __future__ import annotations

import math

from blutrain import dtypes, ops
from blutrain.nn import functional as F, init
from blutrain.nn.layers import Linear
from blutrain.nn.module import Module, Parameter
from blutrain.tensor import Tensor


class _RNNBase(Module):
  """Parameters and the layer/direction loop shared by LSTM and GRU; a subclass defines `_sequence` (one direction's
  time loop, a primitive) and, with projections, `_cell` (one step).

  Parameter names and shapes are PyTorch's: weight_ih_l{k}{suffix} (gates * hidden_size, input size of layer k),
  weight_hh_l{k}{suffix} (gates * hidden_size, hidden_size), bias_ih_l{k}{suffix} and bias_hh_l{k}{suffix}, suffix
  "_reverse" for the backward direction; with proj_size (LSTM), weight_hr_l{k}{suffix} (proj_size, hidden_size)
  projects each step's h, which then has proj_size entries; all from U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)).
  """
  gates: int    # gate blocks in each weight (LSTM 4, GRU 3)
  _states: int  # state tensors carried (LSTM h and c, GRU h)

  def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
               batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, proj_size: int = 0,
               device=None, dtype=None) -> None:
    super().__init__()
    if not isinstance(hidden_size, int) or hidden_size <= 0: raise ValueError("hidden_size must be greater than zero")
    if not isinstance(num_layers, int) or num_layers <= 0: raise ValueError("num_layers must be greater than zero")
    if not 0 <= dropout <= 1:
      raise ValueError("dropout should be a number in range [0, 1] representing the probability of an element being zeroed")
    self.input_size, self.hidden_size, self.num_layers, self.bias = input_size, hidden_size, num_layers, bias
    if not isinstance(proj_size, int) or proj_size < 0:
      raise ValueError("proj_size should be a positive integer or zero to disable projections")
    if proj_size >= hidden_size: raise ValueError("proj_size has to be smaller than hidden_size")
    if proj_size and self.gates != 4: raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")
    self.batch_first, self.dropout, self.bidirectional = batch_first, float(dropout), bidirectional
    self.proj_size, out_size = proj_size, proj_size or hidden_size
    dirs = 2 if bidirectional else 1
    self._flat_weights_names = []
    for layer in range(num_layers):
      for d in range(dirs):
        sfx = f"_l{layer}" + ("_reverse" if d else "")
        size_in = input_size if layer == 0 else out_size * dirs
        shapes = [("weight_ih", (self.gates * hidden_size, size_in)), ("weight_hh", (self.gates * hidden_size, out_size))]
        if bias: shapes += [("bias_ih", (self.gates * hidden_size,)), ("bias_hh", (self.gates * hidden_size,))]
        if proj_size: shapes.append(("weight_hr", (proj_size, hidden_size)))
        for name, shape in shapes:
          setattr(self, name + sfx, Parameter(ops.empty(*shape, device=device, dtype=dtype)))
          self._flat_weights_names.append(name + sfx)
    self.reset_parameters()

  def reset_parameters(self) -> None:
    bound = 1.0 / math.sqrt(self.hidden_size)
    for p in self.parameters(): init.uniform_(p, -bound, bound)

  def _weights(self, layer: int, d: int) -> tuple:
    sfx = f"_l{layer}" + ("_reverse" if d else "")
    get = lambda n: getattr(self, n + sfx) if self.bias or n.startswith("weight") else None
    return get("weight_ih"), get("weight_hh"), get("bias_ih"), get("bias_hh"), get("weight_hr") if self.proj_size else None

  def _initial(self, input: Tensor, hx, batch: int, unbatched: bool):
    """The initial states, each (layers * directions, N, hidden) (h: proj_size with projections): zeros, or the given
    ones checked."""
    lead = (self.num_layers * (2 if self.bidirectional else 1), batch)
    states = [hx] if isinstance(hx, Tensor) else list(hx) if hx is not None else [None] * self._states
    if len(states) != self._states:
      raise RuntimeError(f"{type(self).__name__}: expected {self._states} initial state tensors, got {len(states)}")
    out = []
    for i, s in enumerate(states):
      shape = lead + ((self.proj_size or self.hidden_size) if i == 0 else self.hidden_size,)
      if s is None: out.append(ops.zeros(shape, dtype=input.dtype, device=input.device)); continue
      if unbatched: s = s.unsqueeze(1)
      if tuple(s.shape) != shape:
        raise RuntimeError(f"Expected hidden size {shape}, got {list(s.shape if not unbatched else s.squeeze(1).shape)}")
      out.append(s)
    return out

  def forward(self, input: Tensor, hx=None):
    if input.ndim not in (2, 3):
      raise ValueError(f"{type(self).__name__}: Expected input to be 2D or 3D, got {input.ndim}D instead")
    unbatched = input.ndim == 2
    x = input.unsqueeze(1) if unbatched else input.transpose(0, 1) if self.batch_first else input  # (L, N, H_in)
    if x.shape[-1] != self.input_size:
      raise RuntimeError(f"input.size(-1) must be equal to input_size. Expected {self.input_size}, got {x.shape[-1]}")
    states = self._initial(x, hx, x.shape[1], unbatched)
    dirs = 2 if self.bidirectional else 1
    finals = [[] for _ in states]
    for layer in range(self.num_layers):
      outs = []
      for d in range(dirs):
        k = layer * dirs + d
        seq, last = self._run(x, [s[k] for s in states], self._weights(layer, d), reverse=bool(d))
        outs.append(seq)
        for f, v in zip(finals, last): f.append(v)
      x = outs[0] if dirs == 1 else ops.cat(outs, -1)
      if self.dropout and self.training and layer < self.num_layers - 1: x = F.dropout(x, self.dropout, True)
    out = x.squeeze(1) if unbatched else x.transpose(0, 1) if self.batch_first else x
    finals = [ops.stack(f, 0) for f in finals]
    if unbatched: finals = [f.squeeze(1) for f in finals]
    return out, (finals[0] if self._states == 1 else tuple(finals))

  def _run(self, x: Tensor, state: list, weights: tuple, reverse: bool) -> tuple[Tensor, list]:
    """One direction of one layer over (L, N, H_in): the outputs (L, N, hidden) and the final states."""
    w_ih, w_hh, b_ih, b_hh, w_hr = weights
    gi = F.linear(x, w_ih, b_ih)  # every step's input projection in one matmul
    if w_hr is None: return self._sequence(gi, state, w_hh, b_hh, reverse)  # the whole loop is one primitive
    outs = []
    for t in (range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])):
      state = self._cell(gi[t], state, w_hh, b_hh)
      if w_hr is not None: state = [F.linear(state[0], w_hr)] + state[1:]
      outs.append(state[0])
    if reverse: outs.reverse()
    return ops.stack(outs, 0), state

  def extra_repr(self) -> str:
    s = f"{self.input_size}, {self.hidden_size}"
    if self.num_layers != 1: s += f", num_layers={self.num_layers}"
    if not self.bias: s += ", bias=False"
    if self.batch_first: s += ", batch_first=True"
    if self.dropout: s += f", dropout={self.dropout}"
    if self.bidirectional: s += ", bidirectional=True"
    if self.proj_size: s += f", proj_size={self.proj_size}"
    return s


class LSTM(_RNNBase):
  """Long short-term memory, as `torch.nn.LSTM`: per step, with gates from x W_ih^T + b_ih + h W_hh^T + b_hh,

    i, f, o = sigmoid(...), g = tanh(...);  c' = f * c + i * g;  h' = o * tanh(c')

  Args: input_size, hidden_size, num_layers (1), bias (True), batch_first (False), dropout (0, between layers),
  bidirectional (False), proj_size (0: none; else h' = (o * tanh(c')) W_hr^T, of proj_size entries).
  Shape: input (L, N, input_size) ((N, L, input_size) with batch_first, or (L, input_size)); h_0 (layers *
  directions, N, proj_size or hidden_size) and c_0 (layers * directions, N, hidden_size), zeros by default. Returns
  output (L, N, directions * (proj_size or hidden_size)) and (h_n, c_n).
  """
  gates, _states = 4, 2

  def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
               batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False, proj_size: int = 0,
               device=None, dtype=None) -> None:
    super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional, proj_size, device,
                     dtype)

  @staticmethod
  def _sequence(gi: Tensor, state: list, w_hh: Tensor, b_hh: Tensor | None, reverse: bool) -> tuple[Tensor, list]:
    hs, c = ops.lstm_sequence(gi, state[0], state[1], w_hh, b_hh, reverse)
    return hs, [hs[0 if reverse else -1], c]

  @staticmethod
  def _cell(gi: Tensor, state: list, w_hh: Tensor, b_hh: Tensor | None) -> list:
    h, c = state
    return list(ops.lstm_cell(gi, F.linear(h, w_hh, b_hh), c))


class GRU(_RNNBase):
  """Gated recurrent unit, as `torch.nn.GRU`: per step, with gi = x W_ih^T + b_ih and gh = h W_hh^T + b_hh,

    r = sigmoid(gi_r + gh_r), z = sigmoid(gi_z + gh_z), n = tanh(gi_n + r * gh_n);  h' = (1 - z) * n + z * h

  Arguments and shapes as LSTM's, with one state h (no c).
  """
  gates, _states = 3, 1

  @staticmethod
  def _sequence(gi: Tensor, state: list, w_hh: Tensor, b_hh: Tensor | None, reverse: bool) -> tuple[Tensor, list]:
    hs = ops.gru_sequence(gi, state[0], w_hh, b_hh, reverse)
    return hs, [hs[0 if reverse else -1]]


class MultiheadAttention(Module):
  """Multi-head attention, as `torch.nn.MultiheadAttention`: softmax(q k^T / sqrt(head_dim) + mask) v per head,
  with q, k, v projected by in_proj (one (3E, E) weight, or q/k/v_proj_weight when kdim or vdim differ from E) and
  the heads joined by out_proj.

  Args: embed_dim, num_heads, dropout (on the attention weights), bias, kdim, vdim, batch_first.
  forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None, average_attn_weights=True,
  is_causal=False): masks as PyTorch's (bool True = not attended; float = added). Returns the output
  (L, N, E) ((N, L, E) with batch_first) and, with need_weights, the attention weights (averaged over heads).
  """

  def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
               add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
               vdim: int | None = None, batch_first: bool = False, device=None, dtype=None) -> None:
    super().__init__()
    if embed_dim <= 0 or num_heads <= 0:
      raise ValueError(f"embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} and "
                       f"num_heads={num_heads} instead")
    if embed_dim % num_heads: raise AssertionError("embed_dim must be divisible by num_heads")
    if add_bias_kv or add_zero_attn:
      raise NotImplementedError("MultiheadAttention: add_bias_kv and add_zero_attn are not supported")
    self.embed_dim, self.num_heads, self.dropout, self.batch_first = embed_dim, num_heads, dropout, batch_first
    self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
    self.head_dim = embed_dim // num_heads
    self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
    empty = lambda *s: Parameter(ops.empty(*s, device=device, dtype=dtype))
    if self._qkv_same_embed_dim:
      self.in_proj_weight = empty(3 * embed_dim, embed_dim)
      for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight"): self.register_parameter(n, None)
    else:
      self.q_proj_weight, self.k_proj_weight = empty(embed_dim, embed_dim), empty(embed_dim, self.kdim)
      self.v_proj_weight = empty(embed_dim, self.vdim)
      self.register_parameter("in_proj_weight", None)
    if bias: self.in_proj_bias = empty(3 * embed_dim)
    else: self.register_parameter("in_proj_bias", None)
    self.out_proj = Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
    self._reset_parameters()

  def _reset_parameters(self) -> None:
    for w in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
      if w is not None: init.xavier_uniform_(w)
    if self.in_proj_bias is not None:
      init.zeros_(self.in_proj_bias)
      init.zeros_(self.out_proj.bias)

  def _mask(self, attn_mask, key_padding_mask, n: int, L: int, S: int, dtype, is_causal: bool, device):
    """One additive float mask (N, heads, L, S) or (1, 1, L, S), or None."""
    to_float = lambda m: ops.where(m, float("-inf"), 0.0).to(dtype) if m.dtype is dtypes.bool_ else m.to(dtype)
    mask = None
    if is_causal and attn_mask is None:
      attn_mask = ops.triu(ops.ones(L, S, dtype=dtypes.bool_, device=device), 1)
    if attn_mask is not None:
      if tuple(attn_mask.shape) == (L, S): mask = to_float(attn_mask).reshape(1, 1, L, S)
      elif tuple(attn_mask.shape) == (n * self.num_heads, L, S): mask = to_float(attn_mask).reshape(n, self.num_heads, L, S)
      else:
        raise RuntimeError(f"The shape of the attn_mask is {tuple(attn_mask.shape)}, but should be {(L, S)} or "
                           f"{(n * self.num_heads, L, S)}.")
    if key_padding_mask is not None:
      if tuple(key_padding_mask.shape) != (n, S):
        raise RuntimeError(f"expected key_padding_mask of shape {(n, S)}, but got {tuple(key_padding_mask.shape)}")
      kpm = to_float(key_padding_mask).reshape(n, 1, 1, S)
      mask = kpm if mask is None else mask + kpm
    return mask

  def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
              need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
              is_causal: bool = False):
    unbatched = query.ndim == 2
    if query.ndim not in (2, 3) or key.ndim != query.ndim or value.ndim != query.ndim:
      raise AssertionError(f"query, key and value should be all 2-D (unbatched) or all 3-D (batched), got "
                           f"{query.ndim}-D, {key.ndim}-D and {value.ndim}-D")
    if unbatched:
      query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
      if key_padding_mask is not None: key_padding_mask = key_padding_mask.unsqueeze(0)
    elif self.batch_first:
      query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    (L, n, e), S = query.shape, key.shape[0]
    if e != self.embed_dim:
      raise AssertionError(f"was expecting embedding dimension of {self.embed_dim}, but got {e}")
    b = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
    ws = self.in_proj_weight.chunk(3) if self._qkv_same_embed_dim else (self.q_proj_weight, self.k_proj_weight,
                                                                        self.v_proj_weight)
    heads = lambda t, m: t.reshape(m, n, self.num_heads, self.head_dim).permute(1, 2, 0, 3)  # (N, heads, len, hd)
    q, k, v = (heads(F.linear(t, w, bb), m) for t, w, bb, m in zip((query, key, value), ws, b, (L, S, S)))
    mask = self._mask(attn_mask, key_padding_mask, n, L, S, q.dtype, is_causal, q.device)
    p = self.dropout if self.training else 0.0
    weights = None
    if need_weights:
      scores = ops.matmul(q, k.mT) * (1.0 / math.sqrt(self.head_dim))
      weights = F.softmax(scores if mask is None else scores + mask, -1)
      out = ops.matmul(F.dropout(weights, p, True) if p else weights, v)
      if average_attn_weights: weights = weights.mean(1)
      if unbatched: weights = weights.squeeze(0)
    else:
      out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
    out = self.out_proj(out.permute(2, 0, 1, 3).reshape(L, n, e))
    out = out.squeeze(1) if unbatched else out.transpose(0, 1) if self.batch_first else out
    return out, weights
