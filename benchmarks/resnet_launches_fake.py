"""Kernel launches, ops and casts of one eager ResNet-18 training step (`resnet_lstm.resnet18`, SGD with momentum and
weight decay) on the fake GPU (tests/fakegpu/fake_cuda.py: nothing computes, everything on the host runs), under bf16
autocast and in float32: counts that need no GPU and that noise does not move, after one warm-up step.

  python benchmarks/resnet_launches_fake.py [--batch 4] [--size 64]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "fakegpu"), str(ROOT)]
import fake_cuda  # noqa: E402

fake_cuda.install()
import blutrain as bt  # noqa: E402
from benchmarks.resnet_lstm import resnet18  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--size", type=int, default=64, help="image height and width")
  args = ap.parse_args()
  bt.manual_seed(0)
  net = resnet18(bt.nn, 10).to("cuda").train()
  opt = bt.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
  x, y = bt.randn(args.batch, 3, args.size, args.size).to("cuda"), bt.randint(10, (args.batch,)).to("cuda")

  def step(bf16: bool) -> None:
    with bt.autocast(device_type="cuda", dtype=bt.bfloat16, enabled=bf16):
      loss = bt.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

  for bf16 in (True, False):
    step(bf16)
    before = fake_cuda.launches[0]
    with bt.profiler.profile() as prof: step(bf16)
    ops = sum(r.calls for r in prof.rows)
    casts = sum(r.calls for r in prof.rows if r.name == "cast")
    print(f"{'bf16 autocast' if bf16 else 'float32'}: {fake_cuda.launches[0] - before} launches, {ops} ops, "
          f"{casts} casts")


if __name__ == "__main__":
  main()
