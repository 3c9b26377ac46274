"""GPT-2 in plain JAX (no flax, no optax): the JAX/XLA peer of benchmarks/train_gpt2.py and loss_parity.py. The same
model as blutrain.models.GPT (pre-LayerNorm blocks, exact (erf) GELU as nn.GELU(), tied token embedding and head,
biases, no dropout), its parameters named as that model's state_dict, and the same step as blutrain.train.training_step
with the benchmarks' fused AdamW: gradients clipped to a joint norm of 1.0, PyTorch's AdamW update (eps 1e-8, betas
(0.9, 0.95)), weight decay 0.1 on matrices only. Benchmark code only: the package never imports jax.

Precisions as the other peers run them: "fp32" (float32 matmuls), "tf32" (float32 parameters and activations, TF32
matmuls), "bf16" (float32 parameters, matmuls and attention in bfloat16, cast at use as autocast does; LayerNorm,
the residual stream, the logits' softmax and the loss in float32). Attention is jax.nn.dot_product_attention, cuDNN's
fused kernel for bf16 on a GPU (XLA's when cuDNN refuses it, noted in the result), XLA's otherwise.

  python benchmarks/jax_gpt.py --inputs run.npz --n-head 12 --precision bf16 --warmup 3 --out result.json

runs one timed training run (train_gpt2.run_jax writes the inputs and starts it): a process per run, because JAX's
allocator keeps what it took until its process ends and its peak cannot be reset.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # as needed, not 75 % of the GPU at start
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TIED = "lm_head.weight"  # the same array as transformer.wte.weight: one parameter here
MATMUL_PRECISION = {"fp32": "float32", "tf32": "tensorfloat32", "bf16": "tensorfloat32"}


def _layer_norm(p: dict, name: str, x):
  x = x.astype(jnp.float32)
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p[name + ".weight"] + p[name + ".bias"]


def loss_fn(p: dict, idx, targets, *, n_head: int, dtype, attention: str, tanh: bool = False):
  """The mean cross-entropy of the next token: blutrain's GPT.forward(idx, targets)[1]."""
  B, T = idx.shape
  C = p["transformer.wte.weight"].shape[1]

  def linear(x, name):  # autocast's linear: input, weight and bias in the compute dtype
    return x.astype(dtype) @ p[name + ".weight"].astype(dtype).T + p[name + ".bias"].astype(dtype)
  x = p["transformer.wte.weight"][idx] + p["transformer.wpe.weight"][:T]
  for i in range(sum(k.endswith(".ln_1.weight") for k in p)):
    h = f"transformer.h.{i}."
    qkv = linear(_layer_norm(p, h + "ln_1", x), h + "attn.c_attn").reshape(B, T, 3, n_head, C // n_head)
    y = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True, implementation=attention)
    x = x + linear(y.reshape(B, T, C), h + "attn.c_proj")
    u = linear(_layer_norm(p, h + "ln_2", x), h + "mlp.c_fc")
    x = x + linear(jax.nn.gelu(u.astype(jnp.float32), approximate=tanh).astype(dtype), h + "mlp.c_proj")
  logits = _layer_norm(p, "transformer.ln_f", x).astype(dtype) @ p["transformer.wte.weight"].astype(dtype).T
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def train_step(p: dict, opt: dict, x, y, lr, *, n_head: int, dtype, attention: str, tanh: bool = False,
               weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, max_norm: float = 1.0):
  """One step: loss and gradients, clipping to `max_norm`, AdamW (torch.optim.AdamW's update, decay on matrices).
  Returns (parameters, optimizer state, loss)."""
  loss, g = jax.value_and_grad(loss_fn)(p, x, y, n_head=n_head, dtype=dtype, attention=attention, tanh=tanh)
  norm = jnp.sqrt(sum(jnp.sum(jnp.square(t)) for t in jax.tree.leaves(g)))
  scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
  (b1, b2), step = betas, opt["step"] + 1
  bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
  new_p, new_m, new_v = {}, {}, {}
  for k, w in p.items():
    gk = g[k] * scale
    m = opt["m"][k] + (1 - b1) * (gk - opt["m"][k])
    v = b2 * opt["v"][k] + (1 - b2) * jnp.square(gk)
    w = w * (1 - lr * (weight_decay if w.ndim >= 2 else 0.0))
    new_p[k] = w - lr / bc1 * m / (jnp.sqrt(v) / jnp.sqrt(bc2) + eps)
    new_m[k], new_v[k] = m, v
  return new_p, {"m": new_m, "v": new_v, "step": step}, loss


def make_step(state: dict[str, np.ndarray], n_head: int, precision: str, gelu: str = "none"):
  """A training run from blutrain's initial state dict (name -> numpy array): `step(x, y, lr)` trains on one batch
  and returns the loss (a device scalar); the parameters and optimizer state live in the closure, donated to each
  step. The first call compiles. Also returns `info`, which holds the attention implementation used."""
  if precision not in MATMUL_PRECISION: raise ValueError(f"precision {precision!r}: expected fp32, tf32 or bf16")
  p = {k: jnp.asarray(v) for k, v in state.items() if k != TIED}
  held = {"p": p, "opt": {"m": jax.tree.map(jnp.zeros_like, p), "v": jax.tree.map(jnp.zeros_like, p),
                          "step": jnp.zeros((), jnp.float32)}, "fn": None}
  dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
  gpu = jax.default_backend() == "gpu"
  info = {"attention": "cudnn" if precision == "bf16" and gpu else "xla"}

  def compile_(args):
    fn = jax.jit(functools.partial(train_step, n_head=n_head, dtype=dtype, attention=info["attention"],
                                   tanh=gelu == "tanh"),
                 donate_argnums=(0, 1))
    with jax.default_matmul_precision(MATMUL_PRECISION[precision]): return fn.lower(*args).compile()

  def step(x, y, lr: float):
    args = (held["p"], held["opt"], x, y, jnp.float32(lr))
    if held["fn"] is None:
      try:
        held["fn"] = compile_(args)
      except Exception as e:  # cuDNN's attention refused (shape, dtype, version): XLA's
        if info["attention"] != "cudnn": raise
        info["attention"], info["cudnn_refused"] = "xla", f"{type(e).__name__}: {str(e)[:300]}"
        print(f"jax_gpt: cuDNN attention refused, using XLA's ({info['cudnn_refused']})", file=sys.stderr)
        held["fn"] = compile_(args)
    held["p"], held["opt"], loss = held["fn"](*args)
    return loss
  return step, info


def main() -> None:
  from benchmarks.train_gpt2 import _timed
  ap = argparse.ArgumentParser()
  ap.add_argument("--inputs", required=True, help="an .npz of the state dict's arrays, x and y (N, B, T), lr (N,)")
  ap.add_argument("--n-head", type=int, required=True)
  ap.add_argument("--precision", default="bf16")
  ap.add_argument("--gelu", choices=("none", "tanh"), default="none")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  z = np.load(args.inputs)
  state = {k: z[k] for k in z.files if k not in ("x", "y", "lr")}
  step, info = make_step(state, args.n_head, args.precision, args.gelu)
  lrs = iter(z["lr"].tolist())
  batches = [(jnp.asarray(x.astype(np.int32)), jnp.asarray(y.astype(np.int32))) for x, y in zip(z["x"], z["y"])]
  out = _timed(lambda x, y: step(x, y, next(lrs)), batches, args.warmup, lambda: None)
  stats = jax.devices()[0].memory_stats() or {}
  out.update(info, peak_bytes=stats.get("peak_bytes_in_use"), device=str(jax.devices()[0]), jax=jax.__version__)
  Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
  main()
