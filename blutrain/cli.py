"""`blutrain train | sample | info | launch`."""
from __future__ import annotations

import argparse
import os
import platform
import sys
from dataclasses import fields


def _train(args: argparse.Namespace) -> int:
  from blutrain.distributed import launch, rank_env
  if args.nproc_per_node > 1 and rank_env().world_size == 1:  # start the ranks, which run this command without the flag
    from blutrain.backend.cuda import runtime
    argv, rest = [], iter(args.argv)
    for a in rest:
      if a == "--nproc-per-node": next(rest)
      elif not a.startswith("--nproc-per-node="): argv.append(a)
    job = argparse.Namespace(nproc_per_node=args.nproc_per_node, nnodes=1, node_rank=0, master_addr="127.0.0.1",
                             master_port=None, backend="auto" if runtime.is_available() else "mpi", grace=5.0)
    return launch.launch(job, [sys.executable, "-m", "blutrain.cli", *argv])
  from blutrain.train import Trainer, TrainConfig, config_from_args
  opts = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
  cfg = config_from_args(**opts)
  trainer = Trainer(cfg, resume=args.resume, overwrite=args.overwrite)
  if trainer.rank != 0:
    trainer.fit()
    return 0
  device = trainer.device
  params = trainer.num_params
  print(f"blutrain train: {cfg.preset} ({params / 1e6:.2f}M parameters), {trainer.tokenizer.name} tokenizer with "
        f"{trainer.tokenizer.vocab_size} tokens, batch {cfg.batch_size} x {trainer.block_size}, device {device}, "
        f"{cfg.amp + ' autocast' if cfg.amp else cfg.dtype}, "
        f"steps {trainer.step} -> {cfg.steps}, output {cfg.output}")
  result = trainer.fit()
  print(f"done: step {result['step']}, val loss {result['val_loss']:.4f}; checkpoints, metrics.csv, metrics.jsonl, "
        f"loss.png and sample.txt are in {cfg.output}")
  print("--- sample ---")
  print(result["sample"])
  return 0


def _sample(args: argparse.Namespace) -> int:
  import blutrain as bt
  from blutrain import checkpoint, data
  from blutrain.models import GPT, GPTConfig
  from blutrain.train import default_device, generate_text
  model_state, _, state, step = checkpoint.load_checkpoint(args.checkpoint)
  device = args.device if args.device != "auto" else default_device()
  model = GPT(GPTConfig(**state["model_config"]))
  model.load_state_dict(model_state)
  model.to(device)
  tokenizer = data.tokenizer_from_dict(state["tokenizer"])
  generator = bt.Generator().manual_seed(args.seed)
  for i in range(args.num_samples):
    text = generate_text(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k or None,
                         device, generator)
    print(text if args.num_samples == 1 else f"--- sample {i + 1} (checkpoint step {step}) ---\n{text}")
  return 0


def _info(args: argparse.Namespace) -> int:
  from importlib import metadata
  import blutrain as bt
  from blutrain.train import default_device
  print(f"blutrain {bt.__version__}  python {platform.python_version()}  {platform.system()} {platform.machine()}")
  for pkg in ("numpy", "ml_dtypes", "safetensors", "tokenizers", "tqdm", "matplotlib", "triton", "xdsl",
              "cuda-core", "nvmath-python", "nccl4py", "mpi4py"):
    try: version = metadata.version(pkg)
    except metadata.PackageNotFoundError: version = "not installed"
    print(f"  {pkg:<14} {version}")
  from blutrain.ops import registry
  from blutrain.backend import cpu
  print(f"backends:\n  cpu   {len(cpu.kernels)} kernels for {len(registry)} primitives, {os.cpu_count()} cores")
  try:
    cuda = bt.backend.get(bt.device("cuda", 0))
    print(f"  cuda  {cuda.describe()}")
  except (RuntimeError, AttributeError) as e:
    print(f"  cuda  unavailable: {_why_no_cuda(e)}")
  print(f"default device: {default_device()}")
  return 0


def _count(least: int):
  """An argparse type: an int of at least `least` (the error names the flag: argparse adds it)."""
  def parse(text: str) -> int:
    try: value = int(text)
    except ValueError: raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < least: raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value
  return parse


def _device(text: str) -> str:
  """An argparse type: 'auto' or a device name that blutrain knows."""
  from blutrain.device import to_device
  if text != "auto":
    try: to_device(text)
    except RuntimeError as e: raise argparse.ArgumentTypeError(str(e)) from None
  return text


def _show_defaults(train: argparse.ArgumentParser) -> None:
  """Append TrainConfig's default to each train flag's help (the flags default to None: not given, not overriding)."""
  from blutrain.train import TrainConfig
  defaults = {f.name: f.default for f in fields(TrainConfig)}
  for action in train._actions:
    value = defaults.get(action.dest)
    if action.dest in defaults and value not in ("", None) and "default" not in (action.help or ""):
      action.help = f"{action.help + ' ' if action.help else ''}(default: {value})".replace("%", "%%")


def _why_no_cuda(error: Exception) -> str:
  """Why the CUDA backend does not load, and what to do about it."""
  cause = error.__cause__ or error
  if isinstance(cause, ModuleNotFoundError):
    return (f"the package {cause.name!r} is missing; `python -m pip install -e .` installs NVIDIA's CUDA Python "
            "packages on Linux x86-64")
  return (f"{str(cause).rstrip('.')}. Training runs on the CPU here; for the GPU, this machine needs an NVIDIA GPU "
          "and its driver")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="blutrain", description="Train and sample GPT models with blutrain.")
  sub = p.add_subparsers(dest="command", required=True)

  t = sub.add_parser("train", help="train a GPT on a text corpus (default: char-level GPT on Tiny Shakespeare)")
  t.add_argument("--preset", help="model preset: char-tiny, char-small (default), char-medium, gpt2, gpt2-medium, ...")
  t.add_argument("--corpus", help="'tinyshakespeare' (bundled, default) or a path to a text file")
  t.add_argument("--tokenizer", choices=["char", "bpe"], help="default: char for char-* presets, bpe otherwise")
  t.add_argument("--bpe-vocab-size", type=_count(2))
  t.add_argument("--batch-size", "-b", type=_count(1))
  t.add_argument("--block-size", type=_count(1), help="context length (default: the preset's)")
  t.add_argument("--steps", type=_count(1))
  t.add_argument("--lr", type=float, help="peak learning rate (linear warmup, then cosine decay)")
  t.add_argument("--warmup-steps", type=_count(0), help="linear warmup (default: a tenth of the run, at most 100)")
  t.add_argument("--weight-decay", type=float)
  t.add_argument("--grad-clip", type=float)
  t.add_argument("--dropout", type=float)
  t.add_argument("--device", type=_device, help="auto (default: cuda when available), cpu, cuda, cuda:N")
  t.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
  t.add_argument("--amp", choices=["bfloat16"], help="autocast mixed precision over float32 parameters")
  t.add_argument("--matmul-precision", choices=["highest", "high"], help="float32 matmuls: FP32 (default) or TF32")
  t.add_argument("--seed", type=int)
  t.add_argument("--out-dir", help="output directory (default: runs/<preset>)")
  t.add_argument("--eval-interval", type=_count(1))
  t.add_argument("--eval-batches", type=_count(1))
  t.add_argument("--log-interval", type=_count(1))
  t.add_argument("--sample-tokens", type=_count(0))
  t.add_argument("--compile", action="store_true", default=None,
                 help="compile the whole training step (forward, backward, optimizer) with Nova")
  t.add_argument("--memory-budget", metavar="SIZE",
                 help="with --compile: the memory the step may take (bytes, or e.g. 10GiB); Nova recomputes "
                      "activations in the backward until its plan fits")
  t.add_argument("--resume", nargs="?", const=True, default=False, metavar="PATH",
                 help="continue from the newest checkpoint in the output directory, or from the checkpoint at PATH")
  t.add_argument("--overwrite", action="store_true", help="replace the run the output directory holds")
  t.add_argument("--nproc-per-node", type=_count(1), default=1,
                 help="ranks on this machine (one per GPU; MPI ranks on the CPU): data parallel over what --tp and "
                      "--cp leave")
  t.add_argument("--tp", type=_count(1), help="tensor-parallel ranks per model replica (of --nproc-per-node)")
  t.add_argument("--cp", type=_count(1), help="context-parallel ranks: the sequence split over them, ring attention")
  t.add_argument("--skip-nonfinite", action="store_true", default=None,
                 help="skip steps whose loss or gradient norm is not finite (else such a step stops the run)")
  _show_defaults(t)
  t.set_defaults(func=_train)

  s = sub.add_parser("sample", help="generate text from a checkpoint")
  s.add_argument("--checkpoint", required=True, help="a run's output directory or a checkpoint directory")
  s.add_argument("--prompt", default="\n")
  s.add_argument("--max-new-tokens", type=_count(0), default=300)
  s.add_argument("--temperature", type=float, default=0.8)
  s.add_argument("--top-k", type=_count(0), default=40, help="0 disables top-k filtering")
  s.add_argument("--num-samples", type=_count(1), default=1)
  s.add_argument("--seed", type=int, default=1337)
  s.add_argument("--device", type=_device, default="auto")
  s.set_defaults(func=_sample)

  i = sub.add_parser("info", help="versions, devices and backends")
  i.set_defaults(func=_info)

  from blutrain.distributed import launch
  la = sub.add_parser("launch", help="start the ranks of a distributed job on this node (as torchrun)")
  launch.add_arguments(la)
  la.set_defaults(func=launch.launch)
  return p


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  args.argv = list(sys.argv[1:] if argv is None else argv)
  try:
    return args.func(args)
  except (FileNotFoundError, RuntimeError, ValueError) as e:
    if os.environ.get("BLUTRAIN_DEBUG"): raise
    print(f"blutrain {args.command}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"\nblutrain {args.command}: interrupted", file=sys.stderr)  # on its own line, below a progress bar
    return 130


if __name__ == "__main__":
  sys.exit(main())
