"""Python numbers as operands: cached read-only CPU scalars (`ops.creation.scalar_operand`) that kernels of any device
take by value, the device rule that lets 0-d CPU tensors join tensors of another device (checked here on fake CUDA
tensors that never run), and autocast deciding by the other tensors' device."""
import math

import numpy as np
import pytest
import torch

import blutrain as bt
from blutrain import amp
from blutrain.device import Device
from blutrain.ops import core
from blutrain.ops.creation import _scalars, scalar_operand
from blutrain.tensor import Storage, Tensor
from tests.helpers import assert_close

CPU, CUDA = Device("cpu"), Device("cuda", 0)


def _on_cuda(shape, dtype=bt.float32, index: int = 0) -> Tensor:
  """A tensor that says it lives on cuda:index (host memory; only device bookkeeping may look at it)."""
  return Tensor._make(Storage(np.zeros(max(1, math.prod(shape)), dtype.np), Device("cuda", index)), shape,
                      bt.zeros(shape).stride(), 0, dtype)


def test_numbers_become_cached_read_only_cpu_scalars():
  a = scalar_operand(2.0, bt.float32, CPU)
  assert a is scalar_operand(2.0, bt.float32, CUDA)  # one CPU scalar serves every device
  assert a.shape == () and a.device == CPU and a.dtype is bt.float32 and a.item() == 2.0
  assert scalar_operand(2, bt.float32, CPU) is not a and scalar_operand(2.0, bt.bfloat16, CPU) is not a
  assert scalar_operand(True, bt.int64, CPU) is not scalar_operand(1, bt.int64, CPU)
  neg_zero = scalar_operand(-0.0, bt.float32, CPU)
  assert np.signbit(neg_zero.numpy()) and not np.signbit(scalar_operand(0.0, bt.float32, CPU).numpy())
  with pytest.raises(ValueError, match="read-only"): a.add_(1.0)
  with pytest.raises(ValueError, match="read-only"): a.copy_(bt.tensor(3.0))
  assert a.item() == 2.0


def test_scalar_values_round_to_the_operand_dtype_as_torch():
  for dt, tdt in ((bt.bfloat16, torch.bfloat16), (bt.float16, torch.float16), (bt.int32, torch.int32)):
    x, tx = bt.tensor([1.0, -3.0, 7.0]).to(dt), torch.tensor([1.0, -3.0, 7.0]).to(tdt)
    for v in (0.1, 3, 1e-3, -0.0):
      if not dt.is_floating_point and isinstance(v, float): continue
      assert_close(x * v, tx * v, what=f"{dt.name} * {v}")
      assert_close(v - x, v - tx, what=f"{v} - {dt.name}")
  assert np.signbit((bt.ones(2) * -0.0).numpy()).all() and not np.signbit((bt.ones(2) * 0.0).numpy()).any()


def test_scalar_cache_is_bounded():
  x = bt.ones(2)
  for i in range(5000): x * (i + 0.5)
  assert 0 < len(_scalars) <= 4096


def test_cpu_scalars_ride_along_with_another_device():
  add = core.registry["add"]
  s, x = scalar_operand(2.0, bt.float32, CPU), _on_cuda((3, 4))
  assert core._device_of(add, [x, s]) == (CUDA, True)
  assert core._device_of(add, [s, x]) == (CUDA, True)
  assert core._device_of(add, [s, s]) == (CPU, False)
  assert core._device_of(add, [x, x]) == (CUDA, False)
  assert core._device_of(core.registry["where"], [bt.tensor(True), s, x]) == (CUDA, True)  # any 0-d CPU tensor
  for bad in (bt.ones(1), bt.ones(2), bt.tensor(2.0, requires_grad=True)):  # not CPU scalars
    with pytest.raises(RuntimeError, match="add: expected all tensors on one device"): core._device_of(add, [x, bad])
  with pytest.raises(RuntimeError, match="add: expected all tensors on one device"):
    core._device_of(add, [x, s, _on_cuda((3, 4), index=1)])


def test_autocast_decides_by_the_tensor_not_the_cpu_scalar():
  """2.0 ** x under CUDA autocast: pow is on CUDA's float32 list, whichever operand comes first."""
  s, x = scalar_operand(2.0, bt.bfloat16, CPU), _on_cuda((4,), bt.float32)
  with bt.autocast("cuda"):
    cs, cx = amp._cast("pow", (s, x))
  assert cx is x and cs.dtype is bt.float32 and cs.device == CPU and cs.item() == 2.0
  with bt.autocast("cpu"):  # only CPU scalars: the CPU's table (pow is not on it)
    assert amp._cast("pow", (s, s)) == (s, s)


def test_numbers_in_composites_match_torch():
  rng = np.random.default_rng(0)
  a = rng.standard_normal((3, 5)).astype(np.float32)
  x, t = bt.tensor(a), torch.tensor(a)
  assert_close(x.clamp(-0.5, 0.5), t.clamp(-0.5, 0.5))
  assert_close(x.masked_fill(x > 0, 2), t.masked_fill(t > 0, 2))
  assert_close(bt.where(x > 0, 1.0, -1), torch.where(t > 0, 1.0, -1))
  assert_close(2 ** x, 2 ** t)
  assert_close((x > 0) & True, (t > 0) & True)
  i = bt.tensor([1, 2, 3], dtype=bt.int32)
  assert_close(i * 3 + 1, torch.tensor([1, 2, 3], dtype=torch.int32) * 3 + 1)
  assert_close(i / 2, torch.tensor([1, 2, 3], dtype=torch.int32) / 2)


def test_gradients_through_numbers_match_torch():
  a = np.linspace(0.5, 2.0, 6, dtype=np.float32)
  w, tw = bt.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)
  for lib, v in ((bt, w), (torch, tw)):
    (v * 2.0 + 2.0 ** v + v ** 3 + 1.5 / v - (v > 1) * v).sum().backward()
  assert_close(w.grad, tw.grad)
