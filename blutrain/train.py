"""The training loop behind `blutrain train`: GPT on a text corpus, with evaluation, checkpoints that resume
exactly, metrics (JSONL and CSV), a loss-curve plot and a sample at the end."""
from __future__ import annotations

import csv
import gc
import json
import os
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

import blutrain as bt
from blutrain import checkpoint, data
from blutrain import distributed as dist
from blutrain.distributed.device_mesh import init_device_mesh
from blutrain.nn.parallel import DistributedDataParallel
from blutrain.nn.parallel.context_parallel import all_reduce_gradients, shard_sequence
from blutrain.models import GPT, GPTConfig, PRESETS
from blutrain.models.parallelize import ParallelGPT, parallelize_gpt


@dataclass
class TrainConfig:
  """Everything a run depends on; saved with each checkpoint. Defaults train the CPU char-level model."""
  preset: str = "char-small"
  corpus: str = "tinyshakespeare"
  tokenizer: str = ""             # "char" or "bpe"; empty: char for char-* presets, bpe otherwise
  bpe_vocab_size: int = 8192
  batch_size: int = 32
  block_size: int = 0             # 0: the preset's
  steps: int = 1000
  lr: float = 2e-3
  min_lr_ratio: float = 0.1
  warmup_steps: int = -1          # -1: a tenth of the run, at most 100 steps
  weight_decay: float = 0.1
  beta2: float = 0.99
  grad_clip: float = 1.0
  dropout: float = 0.0
  device: str = "auto"
  dtype: str = "float32"          # parameter dtype (float32, bfloat16, float16): the whole model in that dtype
  amp: str = ""                   # "bfloat16": autocast mixed precision over float32 parameters; empty: off
  matmul_precision: str = "highest"  # float32 matmuls: "highest" (FP32) or "high" (TF32 on the GPU)
  seed: int = 1337
  out_dir: str = ""               # empty: runs/<preset>
  eval_interval: int = 200
  eval_batches: int = 20
  log_interval: int = 10
  sample_tokens: int = 300
  compile: bool = False
  memory_budget: str = ""         # with compile: bytes or a size ("10GiB") the step may take; empty: no budget
  skip_nonfinite: bool = False    # skip steps whose loss or gradients are not finite instead of stopping
  tp: int = 1                     # tensor-parallel ranks: Megatron layers and the vocabulary-parallel loss
  cp: int = 1                     # context-parallel ranks: ring attention over the load-balanced sequence
  extra: dict = field(default_factory=dict)

  @property
  def output(self) -> Path: return Path(self.out_dir or f"runs/{self.preset}")


def default_device() -> str:
  """cuda when a GPU and the CUDA backend are available, else cpu."""
  try:
    return "cuda" if bt.backend.get(bt.device("cuda", 0)).is_available() else "cpu"
  except (RuntimeError, AttributeError):
    return "cpu"


def training_step(model: GPT, optimizer, grad_clip: float = 1.0, skip_nonfinite: bool = False,
                  parallel: ParallelGPT | None = None):
  """The function of one optimization step on a batch (x, y): forward, backward, gradient clipping, update,
  gradients to None; it returns the loss. Nova compiles it whole (`bt.compile(training_step(...))`).

  With `parallel` (the tensor/context-parallel GPT that `model` is or wraps) each rank takes its part of the batch's
  sequence (context parallelism), the gradients are averaged over the context-parallel group and clipped by the whole
  model's norm, and the loss returned is the whole batch's.

  With `skip_nonfinite`, a step whose loss or gradient norm is not finite leaves the parameters and the optimizer as
  they were (as mixed-precision gradient scaling skips such steps); the check reads both on the host, so such a step
  cannot be compiled."""
  cp = parallel.cp_group if parallel is not None else None
  clip = parallel.clip_grad_norm_ if parallel is not None else \
    lambda max_norm: bt.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

  def step(x: bt.Tensor, y: bt.Tensor) -> bt.Tensor:
    loss = parallel_loss(model, x, y, cp)
    loss.backward()
    if cp is not None: all_reduce_gradients(parallel.parameters(), cp)
    if cp is not None: loss = whole_loss(loss, cp)
    if grad_clip > 0 or skip_nonfinite:
      norm = clip(grad_clip if grad_clip > 0 else float("inf"))
      if skip_nonfinite and not bt.isfinite(loss.detach() + norm.to(loss.device)).item():
        optimizer.zero_grad(set_to_none=True)
        return loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss
  return step


def parallel_loss(model, x: bt.Tensor, y: bt.Tensor, cp_group=None) -> bt.Tensor:
  """The model's loss on (x, y): with a context-parallel group, this rank's load-balanced part of the sequence."""
  if cp_group is not None: x, y = shard_sequence(x, cp_group), shard_sequence(y, cp_group)
  return model(x, y)[1]


def whole_loss(loss: bt.Tensor, cp_group) -> bt.Tensor:
  """The batch's loss from every context-parallel rank's mean over as many tokens of it (a new tensor)."""
  loss = loss.detach().clone()
  dist.all_reduce(loss, dist.ReduceOp.AVG, group=cp_group)
  return loss


def build_model(cfg: TrainConfig, vocab_size: int) -> GPT:
  if cfg.preset not in PRESETS: raise ValueError(f"unknown preset {cfg.preset!r}; choose from {', '.join(PRESETS)}")
  shape = dict(PRESETS[cfg.preset], dropout=cfg.dropout)
  if cfg.block_size: shape["block_size"] = cfg.block_size
  # the vocabulary-parallel embedding splits the rows over --tp ranks: a few padded rows, never a target or a sample
  if not cfg.preset.startswith("gpt2"): shape["vocab_size"] = -(-vocab_size // cfg.tp) * cfg.tp
  elif vocab_size > GPTConfig.vocab_size: shape["vocab_size"] = -(-vocab_size // 64) * 64
  return GPT(GPTConfig(**shape))


class Trainer:
  """One run: `Trainer(cfg).fit()`. `resume=True` continues from the newest checkpoint in the output dir, a path
  from that checkpoint; `overwrite=True` replaces a run the output dir holds (else such a directory is refused)."""

  def __init__(self, cfg: TrainConfig, resume: bool | str = False, quiet: bool = False, overwrite: bool = False):
    self.cfg, self.quiet = cfg, quiet
    self.device = cfg.device if cfg.device != "auto" else default_device()
    # data parallel when a launcher started several ranks (`blutrain train --nproc-per-node N`, blutrain launch, mpiexec)
    job = dist.rank_env()
    self.rank, self.world = job.rank, job.world_size
    if self.world > 1:
      if self.device.startswith("cuda"): self.device = f"cuda:{job.local_rank}"
      dist.init_process_group("nccl" if self.device.startswith("cuda") else "mpi")
      self.quiet = quiet or self.rank != 0
    _check_parallel(cfg, self.world, resume)
    if cfg.amp and cfg.dtype != "float32":
      raise ValueError(f"--amp {cfg.amp} keeps float32 parameters and computes in {cfg.amp}; it does not combine "
                       f"with --dtype {cfg.dtype}: drop one of them")
    self.out = cfg.output
    if self.rank == 0:
      _claim(self.out, resume, overwrite)
      self.out.mkdir(parents=True, exist_ok=True)
      checkpoint.remove_stale_temporaries(self.out / "checkpoints")
    bt.manual_seed(cfg.seed)
    text = data.load_text(cfg.corpus)
    kind = cfg.tokenizer or ("char" if cfg.preset.startswith("char") else "bpe")
    self.tokenizer = data.get_tokenizer(kind, text, vocab_size=cfg.bpe_vocab_size)
    if self.rank == 0: data.prepare(text, self.tokenizer, self.out / "data")
    if self.world > 1: dist.barrier()  # rank 0 wrote the token files; the others read them
    train_path, val_path = data.prepare(text, self.tokenizer, self.out / "data")
    self.train_data, self.val_data = data.load_tokens(train_path), data.load_tokens(val_path)
    _check_context(cfg, self.device, len(self.train_data), len(self.val_data))
    model = build_model(cfg, self.tokenizer.vocab_size).to(self.device, bt.dtypes.to_dtype(cfg.dtype))
    self.num_params, self.model_config = model.num_params(), model.config
    bt.set_float32_matmul_precision(cfg.matmul_precision)
    self.block_size = model.config.block_size
    # the world as (dp, cp, tp): TP ranks consecutive; the ranks of a TP x CP group see the same batches
    self.dp, self.dp_rank, self.cp_group, dp_group = self.world, self.rank, None, None
    self.parallel = None
    if cfg.tp * cfg.cp > 1:
      mesh = init_device_mesh(bt.device(self.device).type, (self.world // (cfg.tp * cfg.cp), cfg.cp, cfg.tp),
                              mesh_dim_names=("dp", "cp", "tp"))
      self.dp, self.dp_rank, dp_group = mesh.size("dp"), mesh.get_local_rank("dp"), mesh.get_group("dp")
      self.cp_group = mesh.get_group("cp") if cfg.cp > 1 else None
      model = self.parallel = parallelize_gpt(model, mesh.get_group("tp"), self.cp_group)
    self.model = model
    # GPT's parameter groups (decay on matrices), also for a ParallelGPT's shards
    self.optimizer = GPT.configure_optimizers(model, cfg.weight_decay, cfg.lr, betas=(0.9, cfg.beta2))
    self.scheduler = bt.optim.lr_scheduler.warmup_cosine(self.optimizer, warmup_steps(cfg), cfg.steps,
                                                          cfg.min_lr_ratio)
    self.batch_rng = np.random.default_rng(cfg.seed + self.dp_rank)  # each data-parallel rank its own batches
    self.ddp = DistributedDataParallel(model, process_group=dp_group) if self.dp > 1 else None
    self.step, self.history = 0, []
    if cfg.skip_nonfinite and cfg.compile:
      raise ValueError("--skip-nonfinite reads each step's loss on the host, which a compiled step cannot: drop one")
    if cfg.memory_budget and not cfg.compile:
      raise ValueError("--memory-budget plans the memory of a compiled step: add --compile")
    update = training_step(self.ddp or self.model, self.optimizer, cfg.grad_clip, cfg.skip_nonfinite, self.parallel)
    self._update = bt.compile(update, memory_budget=cfg.memory_budget or None) if cfg.compile else update
    if resume: self._restore(self.out if resume is True else resume)

  # *** checkpoints ***

  def _state(self) -> dict:
    return {"config": asdict(self.cfg), "model_config": self.model_config.to_dict(),
            "tokenizer": self.tokenizer.to_dict(), "scheduler": self.scheduler.state_dict(),
            "batch_rng": self.batch_rng.bit_generator.state,
            "generator": [bt.default_generator.seed, bt.default_generator.offset], "history": self.history}

  def model_state(self) -> dict:
    """The whole GPT's state_dict; gathered from the shards of a tensor-parallel run (every rank calls it then)."""
    return self.parallel.full_state_dict() if self.parallel is not None else self.model.state_dict()

  def save(self) -> Path | None:
    """Write a checkpoint (rank 0 alone: data-parallel ranks hold the same weights). A tensor/context-parallel run
    writes the whole model and rank 0's optimizer state (its shards under --tp), which resume refuses."""
    state = self.model_state()
    if self.rank != 0: return None
    return checkpoint.save_checkpoint(self.out / "checkpoints", self.step, state, self.optimizer.state_dict(),
                                      self._state())

  def _restore(self, path: str | Path) -> None:
    model_state, opt_state, state, step = checkpoint.load_checkpoint(path)
    if state.get("model_config") != self.model_config.to_dict():
      raise RuntimeError(f"--resume: the checkpoint's model {state.get('model_config')} differs from this run's "
                         f"{self.model_config.to_dict()}; use the same preset and flags, or another --out-dir")
    saved = state.get("config", {})
    if saved.get("tp", 1) * saved.get("cp", 1) > 1:
      raise RuntimeError(f"--resume: {path} was written by a run with --tp {saved.get('tp', 1)} --cp "
                         f"{saved.get('cp', 1)}, whose optimizer state is not gathered; resuming it is not supported "
                         "(its model can be sampled: blutrain sample --checkpoint ...)")
    self.model.load_state_dict(model_state)
    self.optimizer.load_state_dict(opt_state)
    self.scheduler.step(state["scheduler"]["last_epoch"])  # this run's schedule (--steps may have grown), at the saved step
    self.batch_rng.bit_generator.state = state["batch_rng"]
    bt.default_generator.seed, bt.default_generator.offset = state["generator"]
    self.step, self.history = step, state["history"]
    # metrics logged after the checkpoint belong to a run that did not survive: the files restart from its history
    (self.out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in self.history))

  # *** loop ***

  def batch(self, split: str = "train"):
    return data.get_batch(self.train_data if split == "train" else self.val_data, self.cfg.batch_size,
                          self.block_size, self.batch_rng, self.device)

  @bt.no_grad()
  def evaluate(self) -> float:
    self.model.eval()
    with self._autocast():
      losses = [self._whole(parallel_loss(self.model, x, y, self.cp_group)).item() for x, y in
                data.iterate_eval_batches(self.val_data, self.cfg.batch_size, self.block_size, self.cfg.eval_batches,
                                          self.device)]
    self.model.train()
    return float(np.mean(losses))

  def _whole(self, loss: bt.Tensor) -> bt.Tensor:
    return whole_loss(loss, self.cp_group) if self.cp_group is not None else loss

  def _autocast(self):
    return bt.autocast(device_type=bt.device(self.device).type, dtype=bt.dtypes.to_dtype(self.cfg.amp)) \
      if self.cfg.amp else nullcontext()

  def train_step(self) -> float:
    with self._autocast(): loss = self._update(*self.batch())
    self.scheduler.step()
    value = loss.item()
    if not np.isfinite(value) and self.cfg.skip_nonfinite:
      self._log({"step": self.step + 1, "skipped": str(value)})
    elif not np.isfinite(value):
      last = (self.out / "checkpoints" / checkpoint.LATEST)
      saved = f"the last checkpoint, {last.read_text().strip()}, holds finite weights" if last.is_file() else \
              "no checkpoint was written yet"
      raise RuntimeError(f"step {self.step + 1}: the training loss is {value}; stopped before saving anything from "
                         f"it ({saved}). Lower --lr, raise --warmup-steps or keep --grad-clip on, and resume with "
                         "--resume")
    return value

  def fit(self) -> dict:
    """Train to `cfg.steps`; returns the final metrics."""
    from tqdm import tqdm
    cfg, tokens_per_step = self.cfg, self.cfg.batch_size * self.block_size * self.dp
    if self.rank == 0: (self.out / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
    # NOTE: a slow smoothing keeps the ETA from swinging after each evaluation's pause
    bar = tqdm(total=cfg.steps, initial=self.step, disable=self.quiet, unit="step", dynamic_ncols=True, smoothing=0.02)
    shown_tok_s = None  # the bar's tokens/s, an exponential average over logging windows (metrics keep each window's)
    window_start, window_steps = time.perf_counter(), 0
    gc.collect()
    gc.freeze()  # the model, optimizer and data stay: full collections then scan only what the steps make
    while self.step < cfg.steps:
      loss = self.train_step()
      self.step += 1
      window_steps += 1
      if self.step % cfg.log_interval == 0 or self.step == cfg.steps:
        elapsed = time.perf_counter() - window_start
        tok_s = window_steps * tokens_per_step / max(elapsed, 1e-9)
        self._log({"step": self.step, "loss": loss, "lr": self.scheduler.get_last_lr()[0], "tokens_per_s": tok_s,
                   "step_ms": 1e3 * elapsed / window_steps})
        shown_tok_s = tok_s if shown_tok_s is None else 0.8 * shown_tok_s + 0.2 * tok_s
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{shown_tok_s:,.0f}")
        window_start, window_steps = time.perf_counter(), 0
      if self.step % cfg.eval_interval == 0 or self.step == cfg.steps:
        val = self.evaluate()
        self._log({"step": self.step, "val_loss": val})
        if self.rank == 0: bar.write(f"step {self.step}: train loss {loss:.4f}, val loss {val:.4f}")
        self.save()
        window_start = time.perf_counter()
      bar.update(1)
    bar.close()
    gc.unfreeze()
    sample = self.sample("\n", cfg.sample_tokens)
    if self.rank == 0:
      self._plot()
      (self.out / "sample.txt").write_text(sample)
    vals = [r["val_loss"] for r in self.history if "val_loss" in r]
    return {"step": self.step, "val_loss": vals[-1] if vals else None, "sample": sample}

  def sample(self, prompt: str, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 40) -> str:
    model = self.model
    if self.parallel is not None:  # a whole GPT from the gathered shards
      model = GPT(self.model_config).to(self.device, bt.dtypes.to_dtype(self.cfg.dtype))
      model.load_state_dict(self.model_state())
    return generate_text(model, self.tokenizer, prompt, max_new_tokens, temperature, top_k, self.device)

  # *** metrics ***

  def _log(self, row: dict) -> None:
    row = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}
    self.history.append(row)
    if self.rank != 0: return
    with open(self.out / "metrics.jsonl", "a") as f: f.write(json.dumps(row) + "\n")
    columns = ["step", "loss", "val_loss", "lr", "tokens_per_s", "step_ms"]
    with open(self.out / "metrics.csv", "w", newline="") as f:
      w = csv.DictWriter(f, columns)
      w.writeheader()
      w.writerows({k: r.get(k, "") for k in columns} for r in self.history)

  def _plot(self) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["loss"]) for r in self.history if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in self.history if "val_loss" in r]
    if train: ax.plot(*zip(*train), label="train", lw=1)
    if val: ax.plot(*zip(*val), "o-", label="val")
    ax.set(xlabel="step", ylabel="loss", title=f"{self.cfg.preset} on {self.cfg.corpus}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(self.out / "loss.png", dpi=120)
    plt.close(fig)


def warmup_steps(cfg: TrainConfig) -> int:
  """The run's warmup: as configured, or by default a tenth of the run, at most 100 steps (so a short run still
  reaches its peak learning rate and decays)."""
  return min(cfg.warmup_steps, cfg.steps) if cfg.warmup_steps >= 0 else min(100, cfg.steps // 10)


def _check_context(cfg: TrainConfig, device: str, n_train: int, n_val: int) -> None:
  """Refuse a context length the corpus cannot fill, or whose attention would not fit the CPU's memory (the CPU
  kernel holds the (T, T) weights of every head), before any model is built."""
  shape = {**asdict(GPTConfig()), **PRESETS.get(cfg.preset, {})}
  T, flag = cfg.block_size or shape["block_size"], "--block-size" if cfg.block_size else "the preset's block size"
  if T >= min(n_train, n_val):
    raise ValueError(f"{flag} {T}: the corpus's {'validation' if n_val <= n_train else 'training'} split has "
                     f"{min(n_train, n_val)} tokens and a window needs {T + 1}; use a shorter context")
  if device == "cpu":
    need = 3 * cfg.batch_size * shape["n_head"] * T * T * 4  # scores, weights and their gradient, float32
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have // 2:
      raise ValueError(f"{flag} {T}: attention on the CPU would hold about {need / 2**30:.0f} GiB ({cfg.batch_size} x "
                       f"{shape['n_head']} heads x {T}^2 scores), more than half of this machine's "
                       f"{have / 2**30:.0f} GiB; use a shorter context or a smaller --batch-size")


def _check_parallel(cfg: TrainConfig, world: int, resume: bool | str) -> None:
  """Refuse a tensor/context-parallel layout the job cannot hold, before any work."""
  if cfg.tp * cfg.cp == 1: return
  flags = f"--tp {cfg.tp} --cp {cfg.cp}"
  if world % (cfg.tp * cfg.cp):
    raise ValueError(f"{flags}: {cfg.tp * cfg.cp} ranks a model replica do not divide the {world} ranks of this job; "
                     f"start a multiple of {cfg.tp * cfg.cp} with --nproc-per-node")
  if cfg.compile: raise ValueError(f"{flags}: the tensor- and context-parallel layers run eagerly; drop --compile")
  if resume: raise ValueError(f"{flags}: resuming a tensor/context-parallel run is not supported")
  shape = {**asdict(GPTConfig()), **PRESETS.get(cfg.preset, {})}
  T = cfg.block_size or shape["block_size"]
  if T % (2 * cfg.cp):
    raise ValueError(f"{flags}: the context of {T} tokens must split into 2 x {cfg.cp} equal chunks (ring "
                     f"attention's load balancing); make --block-size a multiple of {2 * cfg.cp}")
  if shape["n_head"] % cfg.tp or shape["n_embd"] % cfg.tp:
    raise ValueError(f"{flags}: {shape['n_head']} heads and width {shape['n_embd']} must divide by the "
                     f"tensor-parallel size {cfg.tp}")


def _claim(out: Path, resume: bool | str, overwrite: bool) -> None:
  """Refuse to start a new run in a directory that holds one (it would mix both runs' metrics and checkpoints),
  unless resuming it, or replacing it when asked to."""
  held = [p for p in (out / "checkpoints" / checkpoint.LATEST, out / "metrics.jsonl") if p.exists()]
  if not held or resume: return
  if not overwrite:
    raise RuntimeError(f"{out} already holds a run ({', '.join(str(p) for p in held)}); pass --resume to continue it, "
                       "--out-dir for a new one, or --overwrite to replace it")
  for name in ("checkpoints", "metrics.jsonl", "metrics.csv", "loss.png", "sample.txt", "config.json"):
    p = out / name
    if p.is_dir(): shutil.rmtree(p)
    elif p.exists(): p.unlink()


def generate_text(model: GPT, tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.8,
                  top_k: int | None = 40, device="cpu", generator: bt.Generator | None = None) -> str:
  """Continue `prompt` by `max_new_tokens` sampled tokens and decode the whole text."""
  ids = tokenizer.encode(prompt) or [0]
  idx = bt.tensor([ids], dtype=bt.int64, device=device)
  model.eval()
  out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator,
                       vocab_size=tokenizer.vocab_size)
  model.train()
  return tokenizer.decode(out[0].tolist())


def config_from_args(**kwargs) -> TrainConfig:
  """A TrainConfig from keyword arguments, ignoring None (flags not given)."""
  names = {f.name for f in fields(TrainConfig)}
  unknown = set(kwargs) - names
  if unknown: raise TypeError(f"unknown training options {sorted(unknown)}")
  return TrainConfig(**{k: v for k, v in kwargs.items() if v is not None})


