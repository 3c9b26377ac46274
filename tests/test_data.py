"""blutrain.data: the bundled corpus, char and byte-level BPE tokenizers, prepared token files and batches.

References: nanoGPT's published shakespeare_char numbers (vocab 65, 1,003,854 / 111,540 tokens), the
`tokenizers` library reading our files directly, and token files whose values are their own offsets."""
import json

import numpy as np
import pytest
import tokenizers

import blutrain as bt
from blutrain.data import (EOT, BPETokenizer, CharTokenizer, Tokenizer, TokenDataset, bundled_corpora, get_batch,
                           get_tokenizer, iterate_eval_batches, load_text, load_tokens, prepare, token_dtype,
                           tokenizer_from_dict, train_bpe)


@pytest.fixture(scope="module")
def text():
  return load_text()


@pytest.fixture(scope="module")
def bpe(text):
  return train_bpe(text[:200_000], 512)


def offsets_dataset(tmp_path, n: int) -> TokenDataset:
  """A token file whose token at position i is i, so a window's first token is its offset."""
  path = tmp_path / "tokens.bin"
  np.arange(n, dtype=np.uint16).tofile(path)
  return TokenDataset(path, block_size=1, dtype="uint16")


# *** corpus ***

def test_load_text_bundled(text):
  assert "tinyshakespeare" in bundled_corpora()
  assert len(text) == 1_115_394 and text.startswith("First Citizen:\nBefore we proceed any further")
  assert load_text("tinyshakespeare") == text


def test_load_text_path(tmp_path):
  p = tmp_path / "corpus.txt"
  p.write_text("to be, or not to be\n", encoding="utf-8")
  assert load_text(p) == load_text(str(p)) == "to be, or not to be\n"
  with pytest.raises(FileNotFoundError, match="missing.txt"):
    load_text(tmp_path / "missing.txt")
  with pytest.raises(FileNotFoundError, match="bundled: tinyshakespeare"):
    load_text("no_such_corpus")


# *** char tokenizer ***

def test_char_round_trip_whole_corpus(text):
  tok = CharTokenizer(text)
  assert tok.name == "char" and tok.vocab_size == 65 and tok.chars == sorted(set(text))
  ids = tok.encode(text)
  assert len(ids) == len(text) and min(ids) == 0 and max(ids) == 64
  assert ids[:5] == [18, 47, 56, 57, 58]  # "First", as nanoGPT's shakespeare_char encodes it
  assert tok.decode(ids) == text
  assert tok.decode(np.array(ids[:100])) == tok.decode(bt.tensor(ids[:100])) == text[:100]


def test_char_errors_name_the_culprits():
  tok = CharTokenizer("abc")
  with pytest.raises(ValueError, match=r"'z', 'é'"):
    tok.encode("abézc")
  with pytest.raises(ValueError, match=r"\[-1, 3\] out of range \[0, 3\)"):
    tok.decode([0, 3, -1])


# *** BPE tokenizer ***

def test_bpe_train_and_round_trip(text, bpe):
  assert bpe.name == "bpe" and bpe.vocab_size == 512
  assert bpe.token_to_id(EOT) == 0
  unseen = text[200_000:300_000]
  ids = bpe.encode(unseen)
  assert 0 <= min(ids) and max(ids) < 512
  assert len(ids) < 0.6 * len(unseen)  # merges learned on one slice compress another
  assert bpe.decode(ids) == unseen
  odd = f"héllo — wörld 日本\n\n  {EOT}tabs\tand  spaces "  # bytes never seen in training round-trip too
  assert bpe.decode(bpe.encode(odd)) == odd
  assert bpe.encode(EOT) == [0]
  with pytest.raises(ValueError, match="out of range"):
    bpe.decode([512])


def test_bpe_training_is_deterministic(text, bpe):
  assert train_bpe(text[:200_000], 512).to_dict() == bpe.to_dict()
  with pytest.raises(ValueError, match="vocab_size 100"):
    train_bpe(text[:1000], 100)


def test_get_tokenizer(text):
  assert isinstance(get_tokenizer("char", text), CharTokenizer)
  tok = get_tokenizer("bpe", text[:50_000], vocab_size=300)
  assert isinstance(tok, BPETokenizer) and tok.vocab_size == 300
  with pytest.raises(ValueError, match="'wordpiece'"):
    get_tokenizer("wordpiece", text)


# *** serialization ***

@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_save_load_and_dict_identity(kind, text, bpe, tmp_path):
  tok = CharTokenizer(text) if kind == "char" else bpe
  sample = text[500_000:520_000]
  d = json.loads(json.dumps(tok.to_dict()))  # survives JSON, as inside a checkpoint
  for restored in (tokenizer_from_dict(d), type(tok).from_dict(d), Tokenizer.from_dict(d)):
    assert type(restored) is type(tok) and restored.to_dict() == tok.to_dict()
    assert restored.vocab_size == tok.vocab_size and restored.encode(sample) == tok.encode(sample)
  path = tmp_path / "tokenizer.json"
  tok.save(path)
  for loaded in (type(tok).load(path), Tokenizer.load(path)):
    assert type(loaded) is type(tok) and loaded.to_dict() == tok.to_dict()


def test_bpe_file_is_a_tokenizers_json(bpe, text, tmp_path):
  bpe.save(tmp_path / "bpe.json")
  ref = tokenizers.Tokenizer.from_file(str(tmp_path / "bpe.json"))
  assert ref.encode(text[:10_000]).ids == bpe.encode(text[:10_000])


def test_from_dict_errors(bpe):
  with pytest.raises(TypeError, match="BPETokenizer"):
    CharTokenizer.from_dict(bpe.to_dict())
  with pytest.raises(ValueError, match="'unigram'"):
    tokenizer_from_dict({"kind": "unigram"})


# *** prepare ***

def test_prepare_writes_nanogpt_split(text, tmp_path):
  tok = CharTokenizer(text)
  train_path, val_path = prepare(text, tok, tmp_path / "char")
  meta = json.loads((tmp_path / "char" / "meta.json").read_text())
  counts = meta["dtype"], meta["vocab_size"], meta["train_tokens"], meta["val_tokens"]
  assert counts == ("uint16", 65, 1_003_854, 111_540)
  assert tokenizer_from_dict(meta["tokenizer"]).to_dict() == tok.to_dict()
  train, val = np.fromfile(train_path, np.uint16), np.fromfile(val_path, np.uint16)
  np.testing.assert_array_equal(np.concatenate([train, val]), tok.encode(text))
  assert tok.decode(val[:20]) == text[1_003_854:1_003_874]


def test_prepare_reuses_matching_cache(text, bpe, tmp_path, monkeypatch):
  small = text[:300_000]
  paths = prepare(small, bpe, tmp_path)
  stamps = [p.stat().st_mtime_ns for p in paths]

  def no_encode(_):
    raise AssertionError("prepare re-encoded a cached corpus")
  monkeypatch.setattr(bpe, "encode", no_encode)
  assert prepare(small, bpe, tmp_path) == paths and [p.stat().st_mtime_ns for p in paths] == stamps
  monkeypatch.undo()

  for t, tok in ((small, CharTokenizer(text)), (small[:-1], bpe)):  # another tokenizer, another text: a new key
    train_path, val_path = prepare(t, tok, tmp_path)
    stored = np.concatenate([np.fromfile(train_path, np.uint16), np.fromfile(val_path, np.uint16)])
    np.testing.assert_array_equal(stored, tok.encode(t))
  with open(paths[1], "r+b") as f:  # a truncated file is not reused either
    f.truncate(10)
  prepare(small[:-1], bpe, tmp_path)
  assert json.loads((tmp_path / "meta.json").read_text())["val_tokens"] * 2 == paths[1].stat().st_size


def test_prepare_uint32_for_large_vocab(tmp_path):
  class WideChars(CharTokenizer):
    vocab_size = 70_000
    def encode(self, text): return [69_000 + i for i in super().encode(text)]
  assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32
  train_path, _ = prepare("abcdefghij" * 10, WideChars("abcdefghij"), tmp_path)
  ds = TokenDataset(train_path, 4)
  assert ds.data.dtype == np.uint32 and ds.data[:3].tolist() == [69_000, 69_001, 69_002]


def test_prepare_rejects_bad_split(tmp_path):
  with pytest.raises(ValueError, match="val_fraction"):
    prepare("abc" * 10, CharTokenizer("abc"), tmp_path, val_fraction=1.0)
  with pytest.raises(ValueError, match="1 tokens"):
    prepare("a", CharTokenizer("a"), tmp_path)


# *** datasets and batches ***

def test_token_dataset(text, tmp_path):
  train_path, _ = prepare(text[:10_000], CharTokenizer(text), tmp_path)
  ds = TokenDataset(train_path, 32)
  assert isinstance(ds.data, np.memmap) and len(ds) == 9_000 - 32
  tokens = load_tokens(train_path)
  assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16 and (tokens == ds.data).all()
  x, y = ds[5]
  assert x.shape == y.shape == (32,) and x.dtype == bt.int64
  np.testing.assert_array_equal(x.numpy(), ds.data[5:37])
  np.testing.assert_array_equal(y.numpy(), ds.data[6:38])
  with pytest.raises(IndexError):
    ds[len(ds)]
  with pytest.raises(ValueError, match="block_size"):
    TokenDataset(train_path, 9_000)
  with pytest.raises(FileNotFoundError, match="prepare"):
    TokenDataset(tmp_path / "nope.bin", 8)
  (tmp_path / "meta.json").unlink()
  with pytest.raises(FileNotFoundError, match="dtype="):
    TokenDataset(train_path, 8)


@pytest.mark.parametrize("B,T", [(1, 1), (4, 8), (12, 64)])
@pytest.mark.parametrize("gen", ["blutrain", "numpy"])
def test_get_batch_windows(tmp_path, B, T, gen):
  ds = offsets_dataset(tmp_path, 5_000)
  g = bt.Generator().manual_seed(7) if gen == "blutrain" else np.random.default_rng(7)
  for _ in range(3):
    x, y = get_batch(ds, B, T, g, "cpu")
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == bt.int64 and x.device == bt.device("cpu")
    xs, ys = x.numpy(), y.numpy()
    starts = xs[:, 0]
    assert ((0 <= starts) & (starts <= 5_000 - T - 1)).all()
    np.testing.assert_array_equal(xs, starts[:, None] + np.arange(T))
    np.testing.assert_array_equal(ys, xs + 1)


@pytest.mark.parametrize("gen", ["blutrain", "numpy"])
def test_get_batch_offsets_reach_both_ends(tmp_path, gen):
  ds = offsets_dataset(tmp_path, 8)
  g = bt.Generator().manual_seed(3) if gen == "blutrain" else np.random.default_rng(3)
  x, _ = get_batch(ds.data, 200, 5, g)
  assert set(x.numpy()[:, 0].tolist()) == {0, 1, 2}  # windows of 6 tokens start at 0..2
  with pytest.raises(ValueError, match="block_size"):
    get_batch(ds, 2, 8, g)


def test_get_batch_deterministic_for_a_seed(text, tmp_path):
  ds = TokenDataset(prepare(text[:20_000], CharTokenizer(text), tmp_path)[0], 16)
  def draws(g): return [t.numpy() for _ in range(3) for t in get_batch(ds, 8, 16, g)]
  for make in (lambda s: bt.Generator().manual_seed(s), np.random.default_rng):
    a, b, c = draws(make(1)), draws(make(1)), draws(make(2))
    assert all((u == v).all() for u, v in zip(a, b)) and not all((u == v).all() for u, v in zip(a, c))
  bt.manual_seed(5)
  a = get_batch(ds, 8, 16)[0].numpy()
  bt.manual_seed(5)
  np.testing.assert_array_equal(get_batch(ds, 8, 16)[0].numpy(), a)


def test_eval_batches_fixed_and_spread(tmp_path):
  ds = offsets_dataset(tmp_path, 1_000)
  first = [(x.numpy(), y.numpy()) for x, y in iterate_eval_batches(ds, 4, 10, max_batches=5)]
  again = [(x.numpy(), y.numpy()) for x, y in iterate_eval_batches(ds.data, 4, 10, max_batches=5)]
  assert len(first) == 5 and all(x.shape == (4, 10) for x, _ in first)
  for (x, y), (x2, y2) in zip(first, again):
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_array_equal(y, x + 1)
  starts = np.concatenate([x[:, 0] for x, _ in first])
  assert starts[0] == 0 and starts[-1] == 1_000 - 11 and (np.diff(starts) > 0).all()


def test_eval_batches_short_split_gives_each_window_once(tmp_path):
  ds = offsets_dataset(tmp_path, 20)
  batches = [x.numpy() for x, _ in iterate_eval_batches(ds, 4, 10, max_batches=100)]
  assert [len(x) for x in batches] == [4, 4, 2]
  assert np.concatenate([x[:, 0] for x in batches]).tolist() == list(range(10))


@pytest.mark.cuda
def test_get_batch_on_cuda(tmp_path):
  x, y = get_batch(offsets_dataset(tmp_path, 100), 2, 8, bt.Generator().manual_seed(0), "cuda")
  assert x.device == y.device == bt.device("cuda", 0)
  np.testing.assert_array_equal(y.cpu().numpy(), x.cpu().numpy() + 1)
