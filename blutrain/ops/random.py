"""Random numbers: a counter-based generator and the draws from it (rand, randn, randint, bernoulli), and dropout."""
from __future__ import annotations

import math

from blutrain import dtypes
from blutrain.device import to_device as parse_device
from blutrain.ops.core import op
from blutrain.ops.creation import laid_out_like, shape_from, tensor
from blutrain.dtypes import DTypeError
from blutrain.shapes import ShapeError, broadcast_shapes, memory_format, preserve_format
from blutrain.tensor import Tensor


class Generator:
  """A counter-based (Philox) random generator, as PyTorch's CUDA one: a seed and an offset that every draw
  advances. The same (seed, offset) gives the same numbers on every backend and under Nova's capture."""

  def __init__(self, device=None):
    self.device = parse_device(device)
    self.seed, self.offset = 67280421310721, 0

  def manual_seed(self, seed: int) -> Generator:
    self.seed, self.offset = int(seed) & (2**64 - 1), 0
    return self

  def initial_seed(self) -> int: return self.seed
  def get_state(self) -> Tensor: return tensor([self.seed, self.offset], dtype=dtypes.int64)
  def set_state(self, state: Tensor) -> None: self.seed, self.offset = (int(v) for v in state.tolist())

  def _take(self, n: int) -> tuple[int, int]:
    """Reserve n numbers: return (seed, offset) for the draw and advance past it."""
    seed, offset = self.seed, self.offset
    self.offset += n
    return seed, offset


default_generator = Generator()


def manual_seed(seed: int) -> Generator:
  """Seed the default generator (and so every random op without an explicit generator)."""
  return default_generator.manual_seed(seed)


def _random_rule(*, shape, dtype, **_): return shape, dtype


rand_op = op("rand", _random_rule, inputs="", attrs="shape:ints dtype:dtype seed:int offset:int")  # uniform [0, 1)
randn_op = op("randn", _random_rule, inputs="", attrs="shape:ints dtype:dtype seed:int offset:int")  # standard normal
randint_op = op("randint", _random_rule, inputs="", attrs="shape:ints dtype:dtype low:int high:int seed:int offset:int")
bernoulli_op = op("bernoulli", _random_rule, inputs="", attrs="shape:ints dtype:dtype p:float seed:int offset:int")


def _draw(op_, shape, dtype, device, generator, **attrs) -> Tensor:
  gen = generator or default_generator
  seed, offset = gen._take(math.prod(shape))
  return op_(device=parse_device(device), rng=gen, shape=shape, dtype=dtype, seed=seed, offset=offset, **attrs)


def _dropout_rule(x, **_):
  if not x.dtype.is_floating_point: raise DTypeError(f"dropout: expected a floating tensor, got {x.dtype.name}")
  return x.shape, x.dtype


# Each element of x kept where the draw bernoulli would make (rand(seed, offset + i) < 1 - p, i the element's index in
# row-major order) and scaled by 1 / (1 - p), else 0. Its VJP is the op again on the gradient, with the same draws:
# backward regenerates the mask from the generator's seed and offset (the tape keeps them and the generator) instead of
# saving it.
dropout_op = op("dropout", _dropout_rule, lambda g, out, x, p, seed, offset, rng=None: (
  dropout_op(g, rng=rng, p=p, seed=seed, offset=offset),), inputs="x", attrs="p:float seed:int offset:int", saves=())


def dropout(x: Tensor, p: float = 0.5, training: bool = True, generator: Generator | None = None) -> Tensor:
  """Zero each element with probability p and scale the rest by 1/(1-p) (identity when not training): one kernel,
  and backward keeps nothing of it but the generator's seed and offset."""
  if not 0.0 <= p <= 1.0: raise ValueError(f"dropout: probability must be in [0, 1], got {p}")
  if not training or p == 0.0: return x
  if p == 1.0: return x * 0.0
  gen = generator or default_generator
  seed, offset = gen._take(x.numel())
  return dropout_op(x, rng=gen, p=float(p), seed=seed, offset=offset)


def rand(*shape, size=None, dtype=None, device=None, generator: Generator | None = None,
         requires_grad: bool = False) -> Tensor:
  """Uniform samples on [0, 1)."""
  t = _draw(rand_op, shape_from(shape, size), dtypes.to_dtype(dtype or dtypes.default_float), device, generator)
  return t.requires_grad_(requires_grad) if requires_grad else t


def randn(*shape, size=None, dtype=None, device=None, generator: Generator | None = None,
          requires_grad: bool = False) -> Tensor:
  """Standard normal samples."""
  t = _draw(randn_op, shape_from(shape, size), dtypes.to_dtype(dtype or dtypes.default_float), device, generator)
  return t.requires_grad_(requires_grad) if requires_grad else t


def randint(low: int, high: int | None = None, size=(), *, dtype=None, device=None,
            generator: Generator | None = None) -> Tensor:
  """Integers uniform on [low, high): `bt.randint(10, (3,))` or `bt.randint(2, 10, (3,))`."""
  if isinstance(high, (tuple, list)): high, size = None, high  # randint(high, size), as torch.randint
  if high is None: low, high = 0, low
  if high <= low: raise ShapeError(f"randint: empty range [{low}, {high})")
  return _draw(randint_op, shape_from((size,) if isinstance(size, int) else tuple(size)),
               dtypes.to_dtype(dtype or dtypes.int64), device, generator, low=int(low), high=int(high))


def bernoulli_mask(shape, p: float, *, device=None, generator: Generator | None = None) -> Tensor:
  """A bool tensor whose entries are True with probability p."""
  return _draw(bernoulli_op, tuple(shape), dtypes.bool_, device, generator, p=float(p))


def _drawn_like(draw, x: Tensor, dtype, device, generator, requires_grad: bool, memory_format) -> Tensor:
  t = laid_out_like(x, memory_format, lambda shape: draw(shape, dtype=dtype or x.dtype, device=device or x.device,
                                                         generator=generator))
  return t.requires_grad_(requires_grad) if requires_grad else t


def rand_like(x: Tensor, *, dtype=None, device=None, generator=None, requires_grad: bool = False,
              memory_format: memory_format = preserve_format) -> Tensor:
  """Uniform [0, 1) samples of x's shape in x's dense layout (`laid_out_like`), drawn in memory order."""
  return _drawn_like(rand, x, dtype, device, generator, requires_grad, memory_format)


def randn_like(x: Tensor, *, dtype=None, device=None, generator=None, requires_grad: bool = False,
               memory_format: memory_format = preserve_format) -> Tensor:
  """Standard normal samples of x's shape in x's dense layout (`laid_out_like`), drawn in memory order."""
  return _drawn_like(randn, x, dtype, device, generator, requires_grad, memory_format)


def bernoulli(input: Tensor, p: float | None = None, *, generator: Generator | None = None) -> Tensor:
  """0/1 samples (in input's dtype), 1 with probability input (or `p`) elementwise."""
  probs = input if p is None else p
  return (rand(input.shape, dtype=dtypes.float32, device=input.device, generator=generator) < probs).to(input.dtype)


def normal(mean=0.0, std=1.0, size=None, *, generator: Generator | None = None, dtype=None, device=None) -> Tensor:
  """Normal samples of mean `mean` and standard deviation `std` (numbers, or tensors that broadcast; `size` when both
  are numbers)."""
  like = next((t for t in (mean, std) if isinstance(t, Tensor)), None)
  if like is None:
    if size is None: raise TypeError("normal: give size= when mean and std are both numbers")
    return randn(size=size, dtype=dtype, device=device, generator=generator) * std + mean
  shape = tuple(size) if size is not None else broadcast_shapes(*(t.shape for t in (mean, std) if isinstance(t, Tensor)),
                                                                 op="normal")
  return randn(size=shape, dtype=dtype or like.dtype, device=like.device, generator=generator) * std + mean
