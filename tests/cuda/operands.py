"""Matmul operands on the GPU in the layouts the GEMM tests draw, and results back as float64."""
import numpy as np

from blutrain.backend.cuda import memory
from blutrain.backend.cuda.array import CudaArray


def place(x: np.ndarray, dtype, mode: str) -> CudaArray:
  """x on the GPU: "n" row-major, "t" stored transposed (`w.mT` of a contiguous w), "ld" rows padded by 8,
  "odd" rows padded by 1 (misaligned for TMA)."""
  if mode == "t":
    dev = memory.from_numpy(np.ascontiguousarray(np.swapaxes(x, -1, -2)).astype(dtype.np))
    return CudaArray(dev.ptr, x.shape, dev.strides[:-2] + (1, dev.strides[-2]), dtype, dev.device, dev.owner)
  if mode in ("ld", "odd"):
    pad = np.zeros(x.shape[:-1] + (x.shape[-1] + (8 if mode == "ld" else 1),))
    pad[..., :x.shape[-1]] = x
    dev = memory.from_numpy(pad.astype(dtype.np))
    return CudaArray(dev.ptr, x.shape, dev.strides, dtype, dev.device, dev.owner)
  return memory.from_numpy(x.astype(dtype.np))


def linear_on_both(seed: int = 15) -> dict[str, list[np.ndarray]]:
  """y = linear(x, w) and the gradients of sum(y * y) for x and w, on "cpu" and "cuda" from the same random inputs,
  as float64: [y, dx, dw] per device."""
  import blutrain as bt
  rng = np.random.default_rng(seed)
  x_np, w_np = rng.standard_normal((4, 32, 48)).astype(np.float32), rng.standard_normal((24, 48)).astype(np.float32)
  results = {}
  for device in ("cpu", "cuda"):
    x = bt.tensor(x_np).to(device).requires_grad_()
    w = bt.tensor(w_np).to(device).requires_grad_()
    y = bt.nn.functional.linear(x, w)
    (y * y).sum().backward()
    results[device] = [t.detach().cpu().numpy().astype(np.float64) for t in (y, x.grad, w.grad)]
  return results


def stride_zero_batch() -> tuple[CudaArray, CudaArray, np.ndarray]:
  """A (5, 7) float32 matrix expanded to a batch of 6 by a zero batch stride, a (6, 7, 3) batch to multiply it by,
  and their float64 product."""
  from blutrain import dtypes
  a = np.random.default_rng(10).standard_normal((5, 7)).astype(np.float32).astype(np.float64)
  b = np.random.default_rng(11).standard_normal((6, 7, 3)).astype(np.float32).astype(np.float64)
  dev = place(a, dtypes.float32, "n")
  expanded = CudaArray(dev.ptr, (6, 5, 7), (0, 7, 1), dtypes.float32, dev.device, dev.owner)
  return expanded, place(b, dtypes.float32, "n"), a @ b


def host(a: CudaArray) -> np.ndarray: return memory.to_numpy(a).astype(np.float64)
