"""The CLI and the trainer: train, resume exactly, sample, info; checkpoints written atomically and read back."""
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import blutrain as bt
from blutrain import checkpoint
from blutrain.cli import main

TINY = ["--preset", "char-tiny", "--batch-size", "4", "--block-size", "16", "--warmup-steps", "2",
        "--eval-interval", "3", "--eval-batches", "2", "--log-interval", "1", "--sample-tokens", "20"]


def _metrics(out: Path) -> list[dict]:
  return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_everything(tmp_path, capsys):
  out = tmp_path / "run"
  assert main(["train", *TINY, "--steps", "6", "--out-dir", str(out)]) == 0
  for name in ("metrics.csv", "metrics.jsonl", "loss.png", "sample.txt", "config.json", "checkpoints/latest"):
    assert (out / name).is_file(), name
  rows = _metrics(out)
  assert [r["step"] for r in rows if "loss" in r] == list(range(1, 7))
  assert sum("val_loss" in r for r in rows) == 2
  assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "--- sample ---" in capsys.readouterr().out
  assert (out / "checkpoints" / "latest").read_text() == "step_000006"
  assert not list((out / "checkpoints").glob(".tmp-*"))


def test_resume_continues_exactly(tmp_path):
  """Resuming from the step-3 checkpoint of a 6-step run reproduces steps 4..6 bit for bit."""
  straight = tmp_path / "straight"
  main(["train", *TINY, "--steps", "6", "--out-dir", str(straight)])
  resumed = tmp_path / "resumed"
  shutil.copytree(straight, resumed)
  shutil.rmtree(resumed / "checkpoints" / "step_000006")
  (resumed / "checkpoints" / "latest").write_text("step_000003")
  main(["train", *TINY, "--steps", "6", "--out-dir", str(resumed), "--resume"])
  a, b = _metrics(straight), _metrics(resumed)
  assert [r["loss"] for r in a if "loss" in r] == [r["loss"] for r in b if "loss" in r]
  assert [r["val_loss"] for r in a if "val_loss" in r] == [r["val_loss"] for r in b if "val_loss" in r]
  sa, oa, _, _ = checkpoint.load_checkpoint(straight)
  sb, ob, _, _ = checkpoint.load_checkpoint(resumed)
  for k in sa: np.testing.assert_array_equal(sa[k].numpy(), sb[k].numpy(), err_msg=k)
  np.testing.assert_array_equal(oa["state"][0]["exp_avg_sq"].numpy(), ob["state"][0]["exp_avg_sq"].numpy())


def test_resume_extends_the_schedule(tmp_path):
  out = tmp_path / "run"
  main(["train", *TINY, "--steps", "3", "--out-dir", str(out)])
  assert main(["train", *TINY, "--steps", "5", "--out-dir", str(out), "--resume"]) == 0
  assert [r["step"] for r in _metrics(out) if "loss" in r] == [1, 2, 3, 4, 5]


def test_amp_follows_float32_and_refuses_low_precision_parameters(tmp_path, capsys):
  """bfloat16 autocast keeps float32 parameters and follows the float32 run's losses to bfloat16 accuracy."""
  fp32, amp = tmp_path / "fp32", tmp_path / "amp"
  main(["train", *TINY, "--steps", "4", "--out-dir", str(fp32)])
  assert main(["train", *TINY, "--steps", "4", "--out-dir", str(amp), "--amp", "bfloat16"]) == 0
  a, b = ([r["loss"] for r in _metrics(out) if "loss" in r] for out in (fp32, amp))
  np.testing.assert_allclose(b, a, rtol=2e-2)
  assert a != b  # the matmuls did run in bfloat16
  assert all(t.dtype == bt.float32 for t in checkpoint.load_checkpoint(amp)[0].values())
  assert main(["train", *TINY, "--steps", "2", "--out-dir", str(tmp_path / "x"), "--amp", "bfloat16",
               "--dtype", "bfloat16"]) == 2
  assert "does not combine" in capsys.readouterr().err


def test_resume_refuses_another_model(tmp_path, capsys):
  out = tmp_path / "run"
  main(["train", *TINY, "--steps", "3", "--out-dir", str(out)])
  assert main(["train", *TINY, "--steps", "6", "--out-dir", str(out), "--resume", "--block-size", "8"]) == 2
  assert "differs" in capsys.readouterr().err


def test_sample_and_info(tmp_path, capsys):
  out = tmp_path / "run"
  main(["train", *TINY, "--steps", "3", "--out-dir", str(out)])
  capsys.readouterr()
  assert main(["sample", "--checkpoint", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "15", "--seed", "1"]) == 0
  first = capsys.readouterr().out
  main(["sample", "--checkpoint", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "15", "--seed", "1"])
  assert first.startswith("ROMEO:") and len(first.strip()) >= len("ROMEO:") and capsys.readouterr().out == first
  assert main(["info"]) == 0
  printed = capsys.readouterr().out
  assert "numpy" in printed and "nvmath-python" in printed
  cuda = next(line for line in printed.splitlines() if line.strip().startswith("cuda "))
  assert "SMs" in cuda or ("unavailable: " in cuda and ("driver" in cuda or "missing" in cuda)), cuda


def test_missing_and_corrupt_checkpoints(tmp_path, capsys):
  assert main(["sample", "--checkpoint", str(tmp_path / "nothing")]) == 2
  assert "no checkpoint found" in capsys.readouterr().err
  out = tmp_path / "run"
  main(["train", *TINY, "--steps", "3", "--out-dir", str(out)])
  latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
  (latest / "model.safetensors").write_bytes(b"not a safetensors file")
  assert main(["sample", "--checkpoint", str(out)]) == 2
  assert "corrupt" in capsys.readouterr().err


def test_checkpoint_round_trip_is_exact(tmp_path):
  rng = np.random.default_rng(0)
  model = {"w": bt.from_numpy(rng.standard_normal((3, 4)).astype(np.float32)),
           "h": bt.from_numpy(rng.standard_normal(5).astype(np.float32)).to(bt.bfloat16),
           "i": bt.arange(6)}
  opt = {"state": {0: {"step": bt.tensor(3.0, dtype=bt.float64), "exp_avg": bt.randn(3, 4)}},
         "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]}
  path = checkpoint.save_checkpoint(tmp_path, 7, model, opt, {"note": [1, 2]})
  assert path.name == "step_000007"
  m, o, state, step = checkpoint.load_checkpoint(tmp_path)
  assert step == 7 and state == {"note": [1, 2]}
  for k, v in model.items():
    assert m[k].dtype == v.dtype and m[k].shape == v.shape
    np.testing.assert_array_equal(m[k].float().numpy(), v.float().numpy())
  assert o["param_groups"][0]["betas"] == (0.9, 0.95) and list(o["state"]) == [0]
  np.testing.assert_array_equal(o["state"][0]["exp_avg"].numpy(), opt["state"][0]["exp_avg"].numpy())
  # keep=2: older checkpoints are pruned, the pointer moves atomically
  for s in (8, 9): checkpoint.save_checkpoint(tmp_path, s, model)
  assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000008", "step_000009"]
  assert (tmp_path / "latest").read_text() == "step_000009"


def test_compile_flag(tmp_path):
  out = tmp_path / "run"
  assert main(["train", *TINY, "--steps", "4", "--out-dir", str(out), "--compile"]) == 0
  eager = tmp_path / "eager"
  main(["train", *TINY, "--steps", "4", "--out-dir", str(eager)])
  a = [r["loss"] for r in _metrics(out) if "loss" in r]
  b = [r["loss"] for r in _metrics(eager) if "loss" in r]
  np.testing.assert_allclose(a, b, rtol=1e-4)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.chdir(tmp_path)
  yield
  os.environ.pop("BLUTRAIN_DEBUG", None)


@pytest.mark.parametrize("flags, message", [
  (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
  (["--steps", "-5"], "argument --steps: must be at least 1, got -5"),
  (["--log-interval", "0"], "argument --log-interval: must be at least 1, got 0"),
  (["--eval-interval", "0"], "argument --eval-interval: must be at least 1, got 0"),
  (["--batch-size", "0"], "argument --batch-size/-b: must be at least 1, got 0"),
  (["--block-size", "0"], "argument --block-size: must be at least 1, got 0"),
  (["--warmup-steps", "-1"], "argument --warmup-steps: must be at least 0, got -1"),
  (["--steps", "ten"], "argument --steps: expected an integer, got 'ten'"),
  (["--device", "tpu"], "argument --device: unknown device 'tpu'"),
])
def test_bad_flags_are_refused_before_any_work(flags, message, tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    main(["train", "--out-dir", str(tmp_path / "run"), *flags])
  assert e.value.code == 2 and message in capsys.readouterr().err
  assert not (tmp_path / "run").exists(), "nothing was prepared or written"


def test_unknown_devices_raise_runtime_error_naming_them():
  with pytest.raises(RuntimeError, match="unknown device type 'tpu'"): bt.device("tpu")
  with pytest.raises(RuntimeError, match="unknown device 'tpu'"): bt.zeros(2, device="tpu")
  with pytest.raises(RuntimeError, match="'tpu' is neither a device"): bt.zeros(2).to("tpu")
  assert bt.zeros(2).to("bf16").dtype is bt.bfloat16 and str(bt.device("cuda", 1)) == "cuda:1"


# *** a run never destroys what it cannot replace ***

def test_a_second_run_into_a_run_is_refused_unless_resumed_or_overwritten(tmp_path, capsys):
  out = tmp_path / "run"
  assert main(["train", *TINY, "--steps", "3", "--out-dir", str(out)]) == 0
  before = (out / "metrics.jsonl").read_text()
  capsys.readouterr()
  assert main(["train", *TINY, "--steps", "3", "--out-dir", str(out)]) == 2
  err = capsys.readouterr().err
  assert "already holds a run" in err and "--resume" in err and "--overwrite" in err
  assert (out / "metrics.jsonl").read_text() == before, "the refused run wrote nothing"
  assert main(["train", *TINY, "--steps", "2", "--out-dir", str(out), "--overwrite"]) == 0
  assert [r["step"] for r in _metrics(out) if "loss" in r] == [1, 2]
  assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000002"]


def test_retention_never_deletes_the_checkpoint_latest_names(tmp_path):
  state = {"w": bt.ones(2)}
  for step in (10, 20): checkpoint.save_checkpoint(tmp_path, step, state)
  final = checkpoint.save_checkpoint(tmp_path, 5, state)  # a lower step than the ones already there
  assert (tmp_path / checkpoint.LATEST).read_text() == "step_000005" and final.is_dir()
  assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000005", "step_000020"]
  assert checkpoint.load_checkpoint(tmp_path)[3] == 5


def test_changed_bytes_in_a_checkpoint_are_detected(tmp_path, capsys):
  out = tmp_path / "run"
  main(["train", *TINY, "--steps", "3", "--out-dir", str(out)])
  latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
  data = bytearray((latest / "model.safetensors").read_bytes())
  data[-8:] = bytes(8 - i for i in range(8))  # weights' bytes: still a valid safetensors file
  (latest / "model.safetensors").write_bytes(bytes(data))
  with pytest.raises(RuntimeError, match="model.safetensors does not match the checksum"):
    checkpoint.load_checkpoint(out)
  capsys.readouterr()
  assert main(["sample", "--checkpoint", str(out)]) == 2
  assert "model.safetensors does not match the checksum" in capsys.readouterr().err


def test_interrupted_saves_are_cleaned_and_resume_takes_a_path(tmp_path):
  out = tmp_path / "run"
  main(["train", *TINY, "--steps", "6", "--out-dir", str(out)])
  stale = out / "checkpoints" / ".tmp-step_000009-4242"
  stale.mkdir()
  (stale / "model.safetensors").write_bytes(b"half written")
  early = out / "checkpoints" / "step_000003"
  assert main(["train", *TINY, "--steps", "7", "--out-dir", str(out), "--resume", str(early)]) == 0
  assert not stale.exists()
  steps = [r["step"] for r in _metrics(out) if "loss" in r]
  assert steps == [1, 2, 3, 4, 5, 6, 7], "history restarts from step 3's, then steps 4..7 run again"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's overflow warnings: this run diverges on purpose
def test_a_non_finite_loss_stops_the_run_before_it_is_saved(tmp_path, capsys):
  out = tmp_path / "run"
  assert main(["train", *TINY, "--steps", "9", "--lr", "1e30", "--out-dir", str(out)]) == 2
  err = capsys.readouterr().err
  assert "the training loss is" in err and "--resume" in err
  for ckpt in (out / "checkpoints").glob("step_*"):
    weights = checkpoint.load_checkpoint(ckpt)[0]
    assert all(np.isfinite(t.float().numpy()).all() for t in weights.values()), ckpt.name


@pytest.mark.parametrize("flags, message", [
  (["--block-size", "200000"], "--block-size 200000: the corpus's validation split has"),
  (["--block-size", "20000", "--batch-size", "4096"], "--block-size 20000: attention on the CPU would hold about"),
])
def test_a_context_the_corpus_or_memory_cannot_hold_is_refused(flags, message, tmp_path, capsys):
  assert main(["train", "--preset", "char-tiny", "--steps", "1", "--device", "cpu", "--out-dir", str(tmp_path / "r"),
               *flags]) == 2
  assert message in capsys.readouterr().err


def test_a_binary_corpus_is_named(tmp_path, capsys):
  corpus = tmp_path / "weights.bin"
  corpus.write_bytes(bytes(range(256)) * 4)
  assert main(["train", *TINY, "--steps", "1", "--corpus", str(corpus), "--out-dir", str(tmp_path / "r")]) == 2
  assert f"{str(corpus)!r} is not UTF-8 text" in capsys.readouterr().err


def test_default_warmup_fits_the_run_and_help_shows_defaults(tmp_path, capsys):
  from blutrain.train import TrainConfig, warmup_steps
  assert warmup_steps(TrainConfig(steps=30)) == 3 and warmup_steps(TrainConfig(steps=5000)) == 100
  assert warmup_steps(TrainConfig(steps=30, warmup_steps=50)) == 30
  out = tmp_path / "run"
  no_warmup = TINY[:TINY.index("--warmup-steps")] + TINY[TINY.index("--warmup-steps") + 2:]
  assert main(["train", *no_warmup, "--steps", "20", "--lr", "1e-2", "--out-dir", str(out)]) == 0
  lrs = [r["lr"] for r in _metrics(out) if "lr" in r]
  peak = lrs.index(max(lrs))
  assert max(lrs) == pytest.approx(1e-2, rel=1e-6) and peak < 5 and lrs[-1] < 0.2 * max(lrs), lrs
  with pytest.raises(SystemExit): main(["train", "--help"])
  assert "--steps STEPS         (default: 1000)" in capsys.readouterr().out


@pytest.mark.parametrize("skip", [False, True])
def test_a_non_finite_step_is_skipped_when_asked(skip, tmp_path, capsys, monkeypatch):
  """One batch gives a NaN loss: the run stops there, or with --skip-nonfinite leaves the weights as they were for
  that step and goes on."""
  from blutrain.models import GPT
  forward, calls, seen = GPT.forward, [0], {}

  def poisoned(self, idx, targets=None):
    logits, loss = forward(self, idx, targets)
    if targets is not None and self.training:
      calls[0] += 1
      if calls[0] == 3:
        seen["before"] = {k: v.detach().clone() for k, v in self.state_dict().items()}
        loss = loss * float("nan")
    return logits, loss
  monkeypatch.setattr(GPT, "forward", poisoned)
  out = tmp_path / "run"
  code = main(["train", *TINY, "--steps", "5", "--out-dir", str(out), *(["--skip-nonfinite"] if skip else [])])
  if not skip:
    assert code == 2 and "step 3: the training loss is nan" in capsys.readouterr().err
    return
  assert code == 0 and {"step": 3, "skipped": "nan"} in _metrics(out)
  after3 = checkpoint.load_checkpoint(out / "checkpoints" / "step_000003")[0]
  for k, v in seen["before"].items():
    np.testing.assert_array_equal(after3[k].numpy(), v.numpy(), err_msg=k)  # step 3 changed nothing
  assert all(np.isfinite(t.numpy()).all() for t in checkpoint.load_checkpoint(out)[0].values())


def test_memory_budget_flag(tmp_path, capsys):
  out = tmp_path / "run"
  assert main(["train", *TINY, "--steps", "2", "--out-dir", str(out), "--compile", "--memory-budget", "10GiB"]) == 0
  assert main(["train", *TINY, "--steps", "1", "--out-dir", str(tmp_path / "r"), "--memory-budget", "1GiB"]) == 2
  assert "add --compile" in capsys.readouterr().err
  assert main(["train", *TINY, "--steps", "1", "--out-dir", str(tmp_path / "s"), "--compile",
               "--memory-budget", "ten gigs"]) == 2
  assert "cannot read 'ten gigs'" in capsys.readouterr().err


def test_skip_nonfinite_and_compile_are_refused_together(tmp_path, capsys):
  assert main(["train", *TINY, "--steps", "1", "--skip-nonfinite", "--compile", "--out-dir", str(tmp_path / "r")]) == 2
  assert "--skip-nonfinite" in capsys.readouterr().err
