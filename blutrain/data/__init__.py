"""Text data: corpora, tokenizers (char, byte-level BPE), token files and batch loading.

Example:
  >>> from blutrain.data import load_text, get_tokenizer, prepare, TokenDataset, get_batch
  >>> text = load_text("tinyshakespeare")
  >>> tok = get_tokenizer("char", text)
  >>> train_path, val_path = prepare(text, tok, "data/shakespeare_char")
  >>> x, y = get_batch(TokenDataset(train_path, 256), 64, 256, bt.Generator().manual_seed(0), "cuda")
"""
from blutrain.data.corpus import bundled_corpora, load_text
from blutrain.data.tokenizer import (EOT, BPETokenizer, CharTokenizer, Tokenizer, get_tokenizer, tokenizer_from_dict,
                                     train_bpe)
from blutrain.data.sampler import DistributedSampler
from blutrain.data.dataset import TokenDataset, get_batch, iterate_eval_batches, load_tokens, prepare, token_dtype

__all__ = ["bundled_corpora", "load_text", "EOT", "Tokenizer", "CharTokenizer", "BPETokenizer", "train_bpe",
           "get_tokenizer", "tokenizer_from_dict", "TokenDataset", "get_batch", "iterate_eval_batches", "load_tokens",
           "prepare", "token_dtype", "DistributedSampler"]
