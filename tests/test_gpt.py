"""GPT: logits, loss and gradients equal to the same model in PyTorch from the same weights; generation; training
lowers the validation loss."""
import numpy as np
import pytest
import torch

import blutrain as bt
from blutrain.models import GPT, GPTConfig
from benchmarks.torch_gpt import GPT as TorchGPT, load_from_blutrain

CFG = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)


def _pair(cfg=CFG, seed=0):
  bt.manual_seed(seed)
  model = GPT(cfg)
  ref = TorchGPT(cfg)
  load_from_blutrain(ref, model.state_dict())
  return model, ref


@pytest.mark.parametrize("bias, gelu", [(True, "none"), (False, "none"), (True, "tanh")])
def test_logits_loss_and_grads_match_torch(bias, gelu):
  cfg = GPTConfig(**{**CFG.to_dict(), "bias": bias, "gelu": gelu})
  model, ref = _pair(cfg)
  rng = np.random.default_rng(1)
  idx, tgt = rng.integers(0, cfg.vocab_size, (3, 12)), rng.integers(0, cfg.vocab_size, (3, 12))
  tgt[0, :4] = -1  # ignored positions
  logits, loss = model(bt.from_numpy(idx), bt.from_numpy(tgt))
  rlogits, rloss = ref(torch.from_numpy(idx), torch.from_numpy(tgt))
  assert logits.shape == tuple(rlogits.shape)
  np.testing.assert_allclose(logits.detach().numpy(), rlogits.detach().numpy(), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(loss.item(), rloss.item(), rtol=1e-5)
  loss.backward()
  rloss.backward()
  ref_grads = dict(ref.named_parameters())
  for name, p in model.named_parameters():
    np.testing.assert_allclose(p.grad.numpy(), ref_grads[name].grad.numpy(), rtol=2e-4, atol=2e-6, err_msg=name)


def test_weights_are_tied_and_initialized_as_gpt2():
  model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=256))
  assert model.transformer.wte.weight is model.lm_head.weight
  assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})
  w = model.transformer.h[0].mlp.c_fc.weight.detach().numpy()
  assert abs(w.std() - 0.02) < 0.002
  proj = model.transformer.h[0].mlp.c_proj.weight.detach().numpy()
  assert abs(proj.std() - 0.02 / np.sqrt(8)) < 0.001
  assert np.all(model.transformer.h[0].mlp.c_fc.bias.detach().numpy() == 0)


def test_presets_and_bad_input():
  assert GPT.from_preset("char-tiny", vocab_size=65).config.n_layer == 2
  with pytest.raises(ValueError, match="unknown preset"): GPT.from_preset("gpt5")
  with pytest.raises(ValueError, match="divisible"): GPT(GPTConfig(n_embd=30, n_head=4, n_layer=1, vocab_size=10))
  model = GPT(CFG)
  with pytest.raises(ValueError, match="longer than block_size"): model(bt.zeros(1, 17, dtype=bt.int64))


def test_generate_shapes_determinism_and_topk():
  model, _ = _pair()
  idx = bt.tensor([[1, 2, 3]])
  a = model.generate(idx, 20, temperature=0.9, top_k=5, generator=bt.Generator().manual_seed(3))
  b = model.generate(idx, 20, temperature=0.9, top_k=5, generator=bt.Generator().manual_seed(3))
  assert a.shape == (1, 23) and a.tolist() == b.tolist()
  assert a[0, :3].tolist() == [1, 2, 3]
  # top_k=1 is greedy decoding: each token is the argmax of the model's next-token logits
  g = model.generate(idx, 5, top_k=1)
  for t in range(3, 8):
    logits, _ = model(g[:, :t])
    assert g[0, t].item() == logits[0, -1].argmax().item()


def test_generate_samples_only_the_tokenizers_ids():
  """A vocabulary padded past the tokenizer's (GPT-2's 50304 over a smaller BPE) never yields the padding's ids, even
  where the model prefers them."""
  bt.manual_seed(0)
  model = GPT(GPTConfig(vocab_size=96, block_size=8, n_layer=1, n_head=2, n_embd=16)).eval()
  with bt.no_grad(): model.transformer.wte.weight[65:] = 5.0  # tied to lm_head: the padding's logits dominate
  idx = bt.zeros(2, 1, dtype=bt.int64)
  free = model.generate(idx, 20, generator=bt.Generator().manual_seed(1))
  assert (free[:, 1:] >= 65).any().item(), "without the bound the padding wins"
  capped = model.generate(idx, 20, generator=bt.Generator().manual_seed(1), vocab_size=65)
  assert capped.shape == (2, 21) and (capped < 65).all().item()


def test_training_lowers_val_loss():
  """A few hundred steps of the tiny char model on the bundled corpus clearly lower the validation loss."""
  from blutrain import data
  text = data.load_text()[:200_000]
  tok = data.CharTokenizer(text)
  ids = np.array(tok.encode(text), dtype=np.int64)
  train, val = ids[:180_000], ids[180_000:]
  bt.manual_seed(0)
  model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=48))
  opt = model.configure_optimizers(0.0, 3e-3, betas=(0.9, 0.99))
  rng = np.random.default_rng(0)

  def batch(split):
    starts = rng.integers(0, len(split) - 33, 16)
    x = np.stack([split[s:s + 32] for s in starts])
    y = np.stack([split[s + 1:s + 33] for s in starts])
    return bt.from_numpy(x), bt.from_numpy(y)

  def val_loss():
    with bt.no_grad():
      return float(np.mean([model(*batch(val))[1].item() for _ in range(8)]))

  before = val_loss()
  for _ in range(250):
    _, loss = model(*batch(train))
    loss.backward()
    opt.step()
    opt.zero_grad()
  after = val_loss()
  assert before > 3.8 and after < 2.7, (before, after)
