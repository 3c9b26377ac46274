"""The same GPT in PyTorch, parameter for parameter (names match blutrain.models.GPT's state_dict): the peer in
benchmarks and the oracle in tests. Test and benchmark code only; the package never imports torch."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
  def __init__(self, cfg):
    super().__init__()
    self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
    self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
    self.resid_dropout = nn.Dropout(cfg.dropout)
    self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout

  def forward(self, x):
    B, T, C = x.shape
    q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
    q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
    return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class MLP(nn.Module):
  def __init__(self, cfg):
    super().__init__()
    self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
    self.gelu = nn.GELU(approximate=getattr(cfg, "gelu", "none"))
    self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
    self.dropout = nn.Dropout(cfg.dropout)

  def forward(self, x): return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
  def __init__(self, cfg):
    super().__init__()
    self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
    self.attn = CausalSelfAttention(cfg)
    self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
    self.mlp = MLP(cfg)

  def forward(self, x):
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
  def __init__(self, cfg):
    super().__init__()
    self.config = cfg
    self.transformer = nn.ModuleDict(dict(
      wte=nn.Embedding(cfg.vocab_size, cfg.n_embd), wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
      drop=nn.Dropout(cfg.dropout), h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
      ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias)))
    self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
    self.transformer.wte.weight = self.lm_head.weight
    for name, m in self.named_modules():
      if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj") else 0.02)
        if getattr(m, "bias", None) is not None: nn.init.zeros_(m.bias)

  def forward(self, idx, targets=None):
    T = idx.shape[1]
    x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(torch.arange(T, device=idx.device)))
    for block in self.transformer.h: x = block(x)
    logits = self.lm_head(self.transformer.ln_f(x))
    loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
    return logits, loss

  def configure_optimizers(self, weight_decay, learning_rate, betas=(0.9, 0.95), fused=None):
    params = [p for p in self.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)


def load_from_blutrain(torch_model: GPT, state: dict) -> None:
  """Copy a blutrain state_dict (name -> blutrain Tensor) into the torch model."""
  with torch.no_grad():
    for name, p in torch_model.state_dict().items():
      p.copy_(torch.from_numpy(state[name].detach().numpy().copy()))


def training_step(model: GPT, opt: torch.optim.Optimizer, precision: str):
  """The benchmarks' PyTorch step: forward (under bf16 autocast when precision is "bf16"), backward, clipping to 1.0,
  the optimizer's step, gradients set to None; returns the loss."""
  device = next(model.parameters()).device.type

  def step(x, y):
    with torch.autocast(device, torch.bfloat16) if precision == "bf16" else contextlib.nullcontext():
      _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss
  return step
