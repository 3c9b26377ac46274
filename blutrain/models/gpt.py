"""GPT-2 (and small presets for the CPU), as nanoGPT writes it: pre-LayerNorm blocks, causal self-attention,
GELU MLP, tied input/output embeddings, GPT-2 initialization."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from blutrain import nn, ops
from blutrain.optim import AdamW
from blutrain.tensor import Tensor
from blutrain.nn import functional as F


@dataclass
class GPTConfig:
  """Model shape. `bias` adds biases to Linear and LayerNorm layers, as GPT-2 has; `gelu` is the MLP's GELU: "none"
  the exact (erf) form, as nanoGPT writes it, or "tanh", the approximation GPT-2 itself was trained with (whose
  forward and backward a compiled step runs in cuBLASLt's GEMM epilogues)."""
  block_size: int = 1024
  vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64
  n_layer: int = 12
  n_head: int = 12
  n_embd: int = 768
  dropout: float = 0.0
  bias: bool = True
  gelu: str = "none"

  def to_dict(self) -> dict: return asdict(self)


PRESETS: dict[str, dict] = {
  "gpt2": dict(n_layer=12, n_head=12, n_embd=768),          # 124M
  "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
  "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),   # 774M
  "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),      # 1558M
  "char-tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=64),
  "char-small": dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
  "char-medium": dict(n_layer=6, n_head=6, n_embd=384, block_size=256),
}


class CausalSelfAttention(nn.Module):
  def __init__(self, config: GPTConfig):
    super().__init__()
    if config.n_embd % config.n_head:
      raise ValueError(f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
    self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
    self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
    self.attn_dropout, self.resid_dropout = config.dropout, nn.Dropout(config.dropout)
    self.n_head, self.n_embd = config.n_head, config.n_embd

  def forward(self, x: Tensor) -> Tensor:
    B, T, C = x.shape
    q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
    q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.attn_dropout if self.training else 0.0)
    return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
  def __init__(self, config: GPTConfig):
    super().__init__()
    self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
    self.gelu = nn.GELU(approximate=config.gelu)
    self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
    self.dropout = nn.Dropout(config.dropout)

  def forward(self, x: Tensor) -> Tensor:
    return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
  def __init__(self, config: GPTConfig):
    super().__init__()
    self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
    self.attn = CausalSelfAttention(config)
    self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
    self.mlp = MLP(config)

  def forward(self, x: Tensor) -> Tensor:
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
  """A GPT language model: `logits, loss = model(idx, targets)`.

  Args:
    config: the model's shape (GPTConfig).

  Shape:
    idx, targets: (B, T) int64 token indices with T <= block_size.
    logits: (B, T, vocab_size) when targets are given, else (B, 1, vocab_size) for the last position only.

  Example:
    >>> model = GPT(GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32))
    >>> logits, loss = model(ops.randint(65, (4, 32)), ops.randint(65, (4, 32)))
  """

  def __init__(self, config: GPTConfig):
    super().__init__()
    self.config = config
    self.transformer = nn.ModuleDict(dict(
      wte=nn.Embedding(config.vocab_size, config.n_embd),
      wpe=nn.Embedding(config.block_size, config.n_embd),
      drop=nn.Dropout(config.dropout),
      h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
      ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
    ))
    self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
    self.transformer.wte.weight = self.lm_head.weight  # weight tying
    self.reset_parameters()

  @classmethod
  def from_preset(cls, name: str, **overrides) -> GPT:
    """A model from a named preset (`gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`, `char-tiny`, `char-small`,
    `char-medium`), with GPTConfig fields overridden by keyword."""
    if name not in PRESETS: raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return cls(GPTConfig(**{**PRESETS[name], **overrides}))

  def reset_parameters(self) -> None:
    """GPT-2's init: N(0, 0.02) weights, zero biases, residual projections at 0.02/sqrt(2 * n_layer)."""
    for name, m in self.named_modules():
      if isinstance(m, (nn.Linear, nn.Embedding)):
        std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj") else 0.02
        nn.init.normal_(m.weight, 0.0, std)
        if getattr(m, "bias", None) is not None: nn.init.zeros_(m.bias)

  def num_params(self, non_embedding: bool = True) -> int:
    """Parameter count; position embeddings excluded by default (token embeddings count, being tied)."""
    n = sum(p.numel() for p in self.parameters())
    return n - self.transformer.wpe.weight.numel() if non_embedding else n

  def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    B, T = idx.shape
    if T > self.config.block_size:
      raise ValueError(f"GPT: sequence of length {T} is longer than block_size {self.config.block_size}")
    pos = ops.arange(T, device=idx.device)
    x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
    for block in self.transformer.h: x = block(x)
    x = self.transformer.ln_f(x)
    if targets is None: return self.lm_head(x[:, -1:, :]), None
    logits = self.lm_head(x)
    return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)

  def configure_optimizers(self, weight_decay: float, learning_rate: float, betas=(0.9, 0.95), fused: bool | None = None):
    """AdamW with weight decay on matrices (2-D and up) only, as nanoGPT does."""
    params = [p for p in self.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return AdamW(groups, lr=learning_rate, betas=betas, fused=fused)

  @ops.no_grad()
  def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
               generator: ops.Generator | None = None, vocab_size: int | None = None) -> Tensor:
    """Append `max_new_tokens` tokens sampled from the model to `idx` (B, T), one at a time; only ids below
    `vocab_size` when given (a vocabulary padded past its tokenizer's, as GPT-2's 50304)."""
    if temperature <= 0: raise ValueError(f"generate: temperature must be positive, got {temperature}")
    for _ in range(max_new_tokens):
      window = idx if idx.shape[1] <= self.config.block_size else idx[:, -self.config.block_size:]
      logits, _ = self(window)
      logits = logits[:, -1, :vocab_size] / temperature
      if top_k is not None:
        kth = _kth_largest(logits, min(top_k, logits.shape[-1]))
        logits = logits.masked_fill(logits < kth, float("-inf"))
      idx = ops.cat([idx, _sample(F.softmax(logits, dim=-1), generator)], dim=1)
    return idx


def _kth_largest(logits: Tensor, k: int) -> Tensor:
  """The k-th largest value of each row, (B, 1), by k rounds of max-and-mask (k is small in sampling)."""
  work = logits
  for _ in range(k - 1):
    work = work.masked_fill(work == work.amax(-1, keepdim=True), float("-inf"))
  return work.amax(-1, keepdim=True)


def _sample(probs: Tensor, generator: ops.Generator | None) -> Tensor:
  """One index per row drawn from the row's distribution, by inverting the cumulative sum."""
  u = ops.rand(probs.shape[0], 1, device=probs.device, generator=generator)
  return (probs.cumsum(-1) < u).sum(-1, keepdim=True).clamp(max=probs.shape[-1] - 1)
