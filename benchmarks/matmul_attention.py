"""Kernel timings on the GPU, peers in the same run: the CUDA backend's cuBLASLt matmul vs PyTorch's on the GPT-2
124M training shapes and a square, in FP32, TF32 and bf16; flash attention forward and backward vs PyTorch's SDPA
at GPT-2's attention shape. CUDA-event timing, mean of 20 after a warm-up; random inputs.

  python benchmarks/matmul_attention.py
"""
import numpy as np
import torch
import torch.nn.functional as TF

import blutrain as bt
from blutrain import dtypes
from blutrain.backend.cuda import memory, runtime
from blutrain.backend.cuda.array import CudaArray
from blutrain.backend.cuda.kernels import attention as att, cublaslt

def timeit(fn, n=20):
  fn(); runtime.synchronize(); torch.cuda.synchronize()
  s, e = bt.cuda.Event(enable_timing=True), bt.cuda.Event(enable_timing=True)
  s.record(); 
  for _ in range(n): fn()
  e.record(); e.synchronize()
  return s.elapsed_time(e) / n

def ttime(fn, n=20):
  fn(); torch.cuda.synchronize()
  s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  s.record()
  for _ in range(n): fn()
  e.record(); e.synchronize()
  return s.elapsed_time(e) / n

for prec, dt, tdt in (("highest", dtypes.float32, torch.float32), ("high", dtypes.float32, torch.float32), ("highest", dtypes.bfloat16, torch.bfloat16)):
  bt.set_float32_matmul_precision(prec); torch.backends.cuda.matmul.allow_tf32 = prec == "high"
  for (m, k, n) in ((16384, 768, 2304), (16384, 3072, 768), (16384, 768, 50304), (4096, 4096, 4096)):
    a = memory.from_numpy(np.random.standard_normal((m, k)).astype(dt.np))
    wt = memory.from_numpy(np.random.standard_normal((n, k)).astype(dt.np))
    w = CudaArray(wt.ptr, (k, n), (1, k), dt, wt.device, wt.owner)
    ms = timeit(lambda: cublaslt.matmul(a, w, tf32=prec == "high"))
    ta, tw = torch.randn(m, k, device="cuda", dtype=tdt), torch.randn(n, k, device="cuda", dtype=tdt)
    tms = ttime(lambda: ta @ tw.T)
    f = 2 * m * n * k / 1e9
    print(f"matmul {prec:8s} {dt.name:9s} {m}x{k}x{n}: ours {f/ms:7.1f} TFLOP/s  torch {f/tms:7.1f}  ratio {tms/ms:.2f}", flush=True)

bt.set_float32_matmul_precision("highest")
for dt, tdt in ((dtypes.bfloat16, torch.bfloat16), (dtypes.float16, torch.float16), (dtypes.float32, torch.float32)):
  B, H, T, D = 16, 12, 1024, 64
  x = np.random.standard_normal((B, H, T, D)).astype(dt.np)
  q = memory.from_numpy(x)
  out = att.flash_attention(q, q, q, True, 0.125)
  ms_f = timeit(lambda: att.flash_attention(q, q, q, True, 0.125))
  ms_b = timeit(lambda: att.flash_attention_backward(q, q, q, q, out, True, 0.125))
  tq = torch.randn(B, H, T, D, device="cuda", dtype=tdt, requires_grad=True)
  tms_f = ttime(lambda: TF.scaled_dot_product_attention(tq, tq, tq, is_causal=True))
  to = TF.scaled_dot_product_attention(tq, tq, tq, is_causal=True); g = torch.randn_like(to)
  tms_b = ttime(lambda: torch.autograd.grad(to, tq, g, retain_graph=True))
  fl = 4 * B * H * T * T * D / 2 / 1e9
  print(f"attention {dt.name:9s} causal B{B} H{H} T{T} D{D}: fwd ours {ms_f:.3f} ms ({fl/ms_f:.0f} TFLOP/s) torch {tms_f:.3f} | bwd ours {ms_b:.3f} ms torch {tms_b:.3f}", flush=True)
