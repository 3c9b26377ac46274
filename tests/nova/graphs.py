"""Graphs for the compiler's tests, built by hand the way capture records them: each equation's output shape and
dtype come from the op's own rule in `blutrain.ops`."""
from __future__ import annotations

import math

import numpy as np

import blutrain as bt
from blutrain import dtypes
from blutrain.dtypes import DType
from blutrain.nova.graph import Equation, Graph, Value
from blutrain.ops import registry
from blutrain.autograd.tape import Aval
from tests.loopback import LOOPBACK


RANDOM = ("rand", "randn", "randint", "bernoulli", "dropout")  # ops that draw from a generator state input


class Builder:
  """Records equations into a Graph: `b = Builder(); x = b.input((4, 8)); y = b("exp", x); b.output(y)`."""

  def __init__(self):
    self.graph = Graph()
    self.next_id = 0

  def _value(self, shape, dtype) -> Value:
    v = Value(self.next_id, tuple(shape), dtype)
    self.next_id += 1
    return v

  def input(self, shape, dtype: DType = dtypes.float32) -> Value:
    v = self._value(shape, dtype)
    self.graph.inputs.append(v)
    return v

  def rng(self) -> Value:
    """A generator state input: (seed, base offset) as int64[2]."""
    return self.input((2,), dtypes.int64)

  def __call__(self, op: str, *inputs: Value | None, **attrs) -> Value | tuple[Value | None, ...]:
    """The output of `op` on `inputs`: a value, or a tuple of values for a multi-output op."""
    tensors = inputs[:-1] if op in RANDOM else inputs  # a random op's last input is its generator's state
    args = [None if v is None else Aval(v.shape, v.dtype, None) for v in tensors]
    avals = registry[op].rule(*args, **attrs)
    outs = [None if a is None else self._value(*a) for a in (avals if registry[op].multi else [avals])]
    self.graph.equations.append(Equation(op, list(inputs), dict(attrs), outs))
    return tuple(outs) if registry[op].multi else outs[0]

  def full(self, shape, value, dtype: DType = dtypes.float32) -> Value:
    return self("full", shape=tuple(shape), value=value, dtype=dtype)

  def output(self, *values: Value) -> Graph:
    self.graph.outputs.extend(values)
    return self.graph


def linear(b: Builder, x: Value, w: Value, bias: Value | None = None) -> Value:
  """x @ w.T (+ bias), as nn.Linear records it."""
  out = b("matmul", x, b("permute", w, dims=(1, 0)))
  return b("add", out, bias) if bias is not None else out


def block(b: Builder, x: Value, params: list[Value], n_head: int) -> Value:
  """One pre-LayerNorm transformer block (attention with a causal mask, GELU MLP) and a sum-of-squares loss term's
  backward through the MLP, about 60 equations."""
  ln1_w, ln1_b, attn_w, attn_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, fc2_w, fc2_b = params
  B, T, C = x.shape
  hd = C // n_head
  h = b("layer_norm", x, ln1_w, ln1_b, n=1, eps=1e-5)
  qkv = linear(b, h, attn_w, attn_b)
  heads = []
  for i in range(3):
    part = b("slice", qkv, index=((0, B, 1), (0, T, 1), (i * C, (i + 1) * C, 1)))
    heads.append(b("permute", b("view", part, shape=(B, T, n_head, hd)), dims=(0, 2, 1, 3)))
  q, k, v = heads
  att = b("mul", b("matmul", q, b("permute", k, dims=(0, 1, 3, 2))), b.full((), 1.0 / math.sqrt(hd)))
  rows = b("view", b("arange", start=0, step=1, shape=(T,), dtype=dtypes.int64), shape=(T, 1))
  cols = b("view", b("arange", start=0, step=1, shape=(T,), dtype=dtypes.int64), shape=(1, T))
  mask = b("le", b("sub", cols, rows), b.full((), 0, dtypes.int64))
  att = b("where", mask, att, b.full((), float("-inf")))
  att = b("softmax", att, dim=3)
  y = b("matmul", att, v)
  y = b("view", b("copy", b("permute", y, dims=(0, 2, 1, 3))), shape=(B, T, C))
  x = b("add", x, linear(b, y, proj_w, proj_b))
  h = b("layer_norm", x, ln2_w, ln2_b, n=1, eps=1e-5)
  pre = linear(b, h, fc_w, fc_b)
  act = b("gelu", pre, approximate="tanh")
  out = b("add", x, linear(b, act, fc2_w, fc2_b))
  # a backward fragment: d(sum(out^2))/d(pre), through the second linear and GELU
  g = b("mul", out, b.full((), 2.0))
  g_act = b("matmul", g, fc2_w)
  g_pre = b("gelu_backward", g_act, pre, approximate="tanh")
  g_w = b("sum", b("matmul", b("permute", g_pre, dims=(0, 2, 1)), h), dims=(0,), keepdim=False, dtype=dtypes.float32)
  return b("add", out, b("mul", b("sum", g_w, dims=(0, 1), keepdim=False, dtype=dtypes.float32), b.full((), 0.0)))


def block_params(b: Builder, C: int) -> list[Value]:
  shapes = [(C,), (C,), (3 * C, C), (3 * C,), (C, C), (C,), (C,), (C,), (4 * C, C), (4 * C,), (C, 4 * C), (C,)]
  return [b.input(s) for s in shapes]


def gpt_like(n_layer: int = 2, B: int = 2, T: int = 8, C: int = 16, n_head: int = 2, vocab: int = 32):
  """A GPT-like forward (embeddings, n_layer blocks, LayerNorm, tied head, cross-entropy). Returns the graph and,
  per block, (block input, params, block output) for subgraph hashing."""
  b = Builder()
  idx, targets = b.input((B, T), dtypes.int64), b.input((B * T,), dtypes.int64)
  wte, wpe = b.input((vocab, C)), b.input((T, C))
  pos = b("arange", start=0, step=1, shape=(T,), dtype=dtypes.int64)
  x = b("add", b("embedding", wte, idx), b("embedding", wpe, pos))
  blocks = []
  for _ in range(n_layer):
    params = block_params(b, C)
    y = block(b, x, params, n_head)
    blocks.append((x, params, y))
    x = y
  x = b("layer_norm", x, None, None, n=1, eps=1e-5)
  logits = b("view", b("matmul", x, b("permute", wte, dims=(1, 0))), shape=(B * T, vocab))
  losses = b("cross_entropy", logits, targets, ignore_index=-100)
  loss = b("div", b("sum", losses, dims=(0,), keepdim=False, dtype=dtypes.float32), b.full((), float(B * T)))
  return b.output(loss, logits), blocks


# *** every primitive once ***

def every_op() -> tuple[Graph, list[np.ndarray]]:
  """A graph that applies every primitive of blutrain.ops (but to_device) at least once, every output returned,
  with seeded inputs that keep indices in range and logs finite."""
  rs = np.random.default_rng(0)
  b, arrays = Builder(), []

  def arg(array: np.ndarray) -> Value:
    arrays.append(array)
    return b.input(array.shape, dtypes.to_dtype(array.dtype))

  f32 = dtypes.float32
  x, y, pos = arg(rs.standard_normal((3, 4), np.float32)), arg(rs.standard_normal((4,), np.float32)), \
              arg(rs.uniform(0.5, 2.0, (3, 4)).astype(np.float32))
  mask, other = arg(rs.random((3, 4)) < 0.5), arg(rs.random((3, 4)) < 0.5)
  idx, rows = arg(rs.integers(0, 3, (5,))), arg(rs.integers(0, 3, (2, 4)))
  w, bias, weight = arg(rs.standard_normal((4,), np.float32)), arg(rs.standard_normal((4,), np.float32)), \
                    arg(rs.standard_normal((10, 4), np.float32))
  tokens, target = arg(rs.integers(0, 10, (2, 3))), arg(np.array([1, -100, 3]))
  rng = arg(np.array([1234, 56], np.int64))
  outs = [b.full((2, 3), 1.5), b.full((), True, dtypes.bool_), b.full((2,), 7, dtypes.int32),
          b("arange", start=0, step=2, shape=(5,), dtype=dtypes.int64),
          b("arange", start=0.5, step=0.25, shape=(4,), dtype=f32),
          b("rand", rng, shape=(3, 4), dtype=f32, offset=0), b("randn", rng, shape=(3, 4), dtype=f32, offset=12),
          b("randint", rng, shape=(5,), dtype=dtypes.int64, offset=24, low=-3, high=10),
          b("bernoulli", rng, shape=(3, 4), dtype=dtypes.bool_, offset=29, p=0.3), b("dropout", x, rng, p=0.25, offset=41),
          b("where", mask, x, b("where", mask, b("empty", shape=(3, 4), dtype=f32), x))]  # selects no undefined value
  for name in ("neg", "exp", "sin", "cos", "tanh", "sigmoid", "relu", "erf", "floor", "sign", "abs", "copy", "tan", "asin",
               "acos", "atan", "sinh", "cosh", "asinh", "atanh", "exp2", "expm1", "ceil", "trunc", "round"): outs.append(b(name, x))
  for name in ("log", "sqrt", "rsqrt", "log2", "log10", "log1p", "acosh"): outs.append(b(name, pos))
  outs += [b("gelu", x, approximate="none"), b("gelu", x, approximate="tanh"),
           b("gelu_backward", pos, x, approximate="none"), b("gelu_backward", pos, x, approximate="tanh"),
           b("relu_backward", x, b("sub", pos, x)),
           b("logical_not", mask), b("cast", x, dtype=dtypes.float64), b("cast", x, dtype=dtypes.int32)]
  half, bhalf = b("cast", x, dtype=dtypes.float16), b("cast", x, dtype=dtypes.bfloat16)
  outs += [b("add", half, b("cast", y, dtype=dtypes.float16)), b("exp", bhalf), b("matmul", bhalf, b("permute", bhalf, dims=(1, 0)))]
  for name in ("add", "sub", "mul", "div", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "atan2", "copysign",
               "fmod", "remainder", "floor_divide"): outs.append(b(name, x, y))
  outs.append(b("pow", pos, y))
  for name in ("logical_and", "logical_or", "logical_xor"): outs.append(b(name, mask, other))
  ints = b("cast", b("mul", x, b.full((), 10.0)), dtype=dtypes.int64)
  for name in ("bitwise_and", "bitwise_or", "bitwise_xor"): outs.append(b(name, ints, b("neg", ints)))
  outs += [b("bitwise_not", ints), b("bitwise_left_shift", ints, b.full((), 3, dtypes.int64)),
           b("bitwise_right_shift", ints, b.full((), 2, dtypes.int64))]
  outs += [b("where", mask, x, y),
           b("sum", x, dims=(1,), keepdim=False, dtype=f32), b("sum", mask, dims=(0, 1), keepdim=True, dtype=dtypes.int64),
           b("amax", x, dims=(0,), keepdim=True), b("amin", x, dims=(0, 1), keepdim=False),
           b("argmax", x, dim=1, keepdim=False), b("argmin", x, dim=0, keepdim=True),
           b("cumsum", x, dim=1), b("cumsum", x, dim=0, reverse=True), b("cumprod", x, dim=1),
           b("argsort", x, dim=1, descending=False), b("argsort", x, dim=0, descending=True),
           b("view", x, shape=(2, 6)), b("permute", x, dims=(1, 0)), b("expand", b("view", y, shape=(1, 4)), shape=(2, 3, 4)),
           b("slice", x, index=((0, 3, 2), (1, 4, 1))),
           b("slice_backward", b("slice", x, index=((0, 3, 2), (1, 4, 1))), shape=(3, 4), index=((0, 3, 2), (1, 4, 1))),
           b("cat", x, pos, x, dim=0), b("index", x, idx, positions=(0,)), b("index", x, idx, idx, positions=(0, 1)),
           b("index_backward", b("index", x, idx, positions=(0,)), idx, shape=(3, 4), positions=(0,)),
           b("index_put", x, b.full((5, 4), 2.0), idx, positions=(0,)),
           b("matmul", x, b("permute", pos, dims=(1, 0))), b("linear", x, pos, b("slice", y, index=((0, 3, 1),))),
           b("linear", x, pos, None, tf32=True),
           *b("linear_backward", b("slice", x, index=((0, 3, 1), (0, 3, 1))), x, pos, bias=True, input_grad=True,
              weight_grad=True),
           b("linear_backward", b("slice", pos, index=((0, 3, 1), (1, 4, 1))), x, pos, bias=True, input_grad=False,
             weight_grad=False)[2],
           b("softmax", x, dim=1), b("log_softmax", x, dim=0),
           *b("gemm", x, b("permute", pos, dims=(1, 0)), b("slice", y, index=((0, 3, 1),)), epilogue="bias,save,gelu",
              dtype=f32),
           b("gemm", bhalf, b("permute", bhalf, dims=(1, 0)), b("slice", pos, index=((0, 3, 1), (0, 3, 1))),
             epilogue="residual", dtype=f32)[0],
           *b("cast_many", x, pos, dtype=dtypes.bfloat16),
           *b("weight_grad", b("permute", bhalf, dims=(1, 0)), bhalf, dtype=f32, bias_grad=True),
           b("weight_grad", b("permute", x, dims=(1, 0)), x, dtype=f32, bias_grad=False, tf32=True)[0],
           b("gemm", x, b("permute", x, dims=(1, 0)), b("slice", pos, index=((0, 3, 1), (0, 3, 1))),
             epilogue="gelu_backward_tanh", dtype=f32)[0],
           b("layer_norm", x, w, bias, n=1, eps=1e-5), b("layer_norm", x, None, None, n=2, eps=1e-6),
           b("layer_norm", x, w, None, n=1, eps=1e-5), b("layer_norm", x, None, bias, n=1, eps=1e-5),
           *b("layer_norm_backward", pos, x, w, None, n=1, eps=1e-5, has_bias=True)[:3],
           *b("layer_norm_backward", pos, x, w, pos, n=1, eps=1e-5, has_bias=False, cast=dtypes.bfloat16)[::3],
           b("layer_norm_backward", pos, x, None, None, n=1, eps=1e-5, has_bias=False, bias_grad=True)[4],
           *b("add_layer_norm", x, pos, w, bias, n=1, eps=1e-5), b("add_layer_norm", x, pos, None, None, n=2, eps=1e-6)[1],
           b("layer_norm_backward", pos, x, None, None, n=2, eps=1e-6, has_bias=False)[0],
           b("scatter_add", x, rows, pos, dim=0),
           b("scatter_reduce", x, rows, pos, dim=0, reduce="amax", include_self=False), b("gather", x, rows, dim=0),
           b("embedding", weight, tokens), b("embedding_backward", b("embedding", weight, tokens), tokens, num=10),
           b("cross_entropy", x, target, ignore_index=-100),
           b("cross_entropy_backward", b("exp", b("sum", x, dims=(1,), keepdim=False, dtype=f32)), x, target,
             ignore_index=-100),
           *b("cross_entropy_stats", bhalf, target, start=1),
           *(ce := b("cross_entropy_with_stats", bhalf, target, ignore_index=-100, dtype=f32)),
           b("cross_entropy_backward_with_stats", b("slice", y, index=((0, 3, 1),)), bhalf, target, ce[1], ce[2],
             ignore_index=-100),
           *b("cross_entropy_with_grad", b("slice", y, index=((0, 3, 1),)), bhalf, target, ignore_index=-100,
              dtype=f32),
           b("cross_entropy_lse_backward", b("slice", y, index=((0, 3, 1),)), x, target,
             b("sum", pos, dims=(1,), keepdim=False, dtype=f32), start=1, ignore_index=-100)]
  cell = b("slice", pos, index=((0, 3, 1), (0, 1, 1)))  # (N, H) = (3, 1) beside gates (3, 4)
  outs += [cell_out := b("lstm_cell", x, pos, cell),
           b("lstm_cell_backward", b("slice", pos, index=((0, 3, 1), (0, 2, 1))), x, pos, cell, cell_out)]
  seq_in = [b("view", x, shape=(3, 1, 4)), b("slice", pos, index=((0, 1, 1), (0, 1, 1))),  # L, N, H = 3, 1, 1
            b("slice", pos, index=((1, 2, 1), (0, 1, 1))),
            b("permute", b("slice", pos, index=((2, 3, 1), (0, 4, 1))), dims=(1, 0))]
  seq = b("lstm_sequence", *seq_in, y, reverse=False)
  outs += [seq, b("lstm_sequence", *seq_in, None, reverse=True, tf32=True),
           *b("lstm_sequence_backward", seq, *seq_in, y, seq, reverse=False, states=True, weights=True),
           b("lstm_sequence_backward", seq, *seq_in, None, seq, reverse=True, states=False, weights=False)[0]]
  gru_in = [b("view", b("slice", x, index=((0, 3, 1), (0, 3, 1))), shape=(3, 1, 3)), seq_in[1],  # L, N, H = 3, 1, 1
            b("slice", seq_in[3], index=((0, 3, 1), (0, 1, 1)))]
  gru = b("gru_sequence", *gru_in, b("slice", y, index=((0, 3, 1),)), reverse=True)
  outs += [gru, b("gru_sequence", *gru_in, None, reverse=False, tf32=True),
           *b("gru_sequence_backward", gru, *gru_in, b("slice", y, index=((1, 4, 1),)), gru, reverse=True, states=True,
              weights=True),
           b("gru_sequence_backward", gru, *gru_in, None, gru, reverse=False, states=False, weights=False)[0]]
  gates3 = b("slice", x, index=((0, 3, 1), (0, 3, 1)))  # GRU gates (3, 3H) with H = 1
  outs += [b("gru_cell", gates3, b("slice", pos, index=((0, 3, 1), (1, 4, 1))), cell),
           b("gru_cell_backward", cell, gates3, gates3, cell)]
  image = b("view", x, shape=(1, 1, 3, 4))
  pool = dict(kernel=(2, 2), stride=(1, 2), padding=(1, 0), dilation=(1, 1))
  idx = b("max_pool2d_indices", image, out_size=(4, 2), **pool)
  pooled = b("max_pool2d_values", image, idx, **pool)
  outs += [idx, pooled, b("max_pool2d_backward", pooled, idx, size=(3, 4), **pool),
           *b("max_pool2d_with_indices", image, out_size=(4, 2), **pool)]
  mean, var = b("batch_norm_stats", x)[:2]  # x as (N, C) = (3, 4)
  batches = arg(np.array(7, np.int64))
  outs += [*b("batch_norm_stats", x, b("exp", mean), b("exp", var), momentum=0.25)[:4],
           *b("batch_norm_stats", pos, b("exp", mean), b("exp", var), batches, momentum=0.5)]
  outs += [b("batch_norm", x, mean, var, w, bias, pos, eps=1e-5, training=True, relu=True),  # Nova's epilogue
           *b("batch_norm_backward", pos, x, mean, var, w, b("neg", x), eps=1e-5, training=True, input_grad=True,
              weight_grad=False, bias_grad=False)[:1]]
  outs += [mean, var, b("batch_norm", x, mean, var, w, bias, eps=1e-5, training=True),
           b("batch_norm", x, y, b("exp", y), None, bias, eps=1e-3, training=False),
           *b("batch_norm_backward", pos, x, mean, var, w, eps=1e-5, training=True, input_grad=True, weight_grad=True,
              bias_grad=True),
           b("batch_norm_backward", pos, x, y, b("exp", y), None, eps=1e-3, training=False, input_grad=False,
             weight_grad=True, bias_grad=False)[1]]
  q, k = b("view", x, shape=(1, 3, 4)), b("view", pos, shape=(1, 3, 4))
  att = b("flash_attention", q, k, k, causal=True, scale=0.5)
  outs += [att, b("flash_attention", q, k, q, causal=False, scale=1.0),
           *b("flash_attention_backward", q, q, k, k, att, causal=True, scale=0.5), b("sum_squares", x, pos, w),
           b("flash_attention_backward_packed", *(b("view", t, shape=(1, 1, 3, 4)) for t in (q, q, k, k, att)),
             causal=True, scale=0.5),
           b("flash_attention_transposed", *(b("view", t, shape=(1, 1, 3, 4)) for t in (q, k, k)), causal=False,
             scale=0.5),
           b("flash_attention_lse", q, k, k, causal=False, scale=0.5),
           *b("flash_attention_lse_backward", q, b("sum", q, dims=(2,), keepdim=False, dtype=f32), q, k, k, att,
              causal=True, scale=0.5)]
  step, lr, sq = arg(np.array(3.0)), arg(np.array(1e-3)), arg(rs.uniform(0.1, 1.0, (4,)).astype(np.float32))
  outs += [*b("adamw", x, w, pos, y, pos, bias, pos, sq, step, step, lr, n=2, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.1),
           *b("sgd", x, w, pos, bias, pos, y, lr, n=2, momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False,
              maximize=True, is_first_step=False),
           *b("sgd", w, y, lr, n=1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
              is_first_step=False),
           *b("scale", x, w, b.full((), 0.5))]
  img, ker = b("view", x, shape=(1, 2, 6)), b("view", pos, shape=(2, 2, 3))
  conv = dict(stride=(2,), padding=(1,), dilation=(1,), groups=1)
  outs += [b("conv", img, ker, **conv), b("conv", img, b("view", y, shape=(2, 1, 2)), stride=(1,), padding=(0,),
                                              dilation=(2,), groups=2, tf32=True),
           b("conv_grad_input", b("conv", img, ker, **conv), ker, shape=(1, 2, 6), **conv),
           b("conv_grad_weight", b("conv", img, ker, **conv), img, shape=(2, 2, 3), **conv)]
  outs += [b("all_reduce", x, reduce_op="avg", group=LOOPBACK, size=1),
           b("reduce_scatter", pos, reduce_op="sum", group=LOOPBACK, size=1), b("all_gather", w, group=LOOPBACK, size=1)]
  return b.output(*outs), arrays


# *** the eager reference ***

def evaluate(graph: Graph, arrays: list[np.ndarray]) -> list[np.ndarray]:
  """Run a graph with blutrain's eager ops (views by striding, kernels through `apply`), random ops following
  capture's convention: the input holds (seed, base offset) and `offset` is relative to it. A graph has value
  semantics, so `view` runs as `reshape` (which copies a layout that cannot be viewed, as capture records it)."""
  cpu = bt.device("cpu")
  env = {v: bt.from_numpy(np.array(a)) for v, a in zip(graph.inputs, arrays)}
  with bt.no_grad():
    for eq in graph.equations:
      op = registry[eq.op]
      if eq.op in RANDOM:
        seed, base = (int(s) for s in env[eq.inputs[-1]].numpy())
        out = op(*(env[v] for v in eq.inputs[:-1]), device=cpu,
                 **(eq.attrs | {"seed": seed, "offset": base + eq.attrs["offset"]}))
      elif eq.op == "view":
        out = bt.ops.reshape(env[eq.inputs[0]], eq.attrs["shape"])
      else:
        out = op(*(None if v is None else env[v] for v in eq.inputs), device=cpu, **eq.attrs)
      env.update(zip(eq.outs, out if op.multi else [out]))
  return [env[v].numpy() for v in graph.outputs]
