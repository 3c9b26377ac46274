"""Test helpers: run an op on blutrain and on PyTorch with the same inputs (`helper_test_op`, after tinygrad's),
and check a VJP against float64 central finite differences (`check_vjp`, after JAX's)."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

import blutrain as bt

# (atol, rtol) per dtype, for values and gradients alike; tests scale them only where an op sums many terms
TOLS = {
  bt.float64: (1e-10, 1e-7),
  bt.float32: (1e-5, 1e-4),
  bt.float16: (2e-3, 2e-3),
  bt.bfloat16: (2e-2, 2e-2),
}

TORCH_DTYPES = {bt.bool: torch.bool, bt.uint8: torch.uint8, bt.int8: torch.int8, bt.int16: torch.int16, bt.int32: torch.int32, bt.int64: torch.int64, bt.float16: torch.float16,
                bt.bfloat16: torch.bfloat16, bt.float32: torch.float32, bt.float64: torch.float64}


@dataclass(frozen=True)
class Int:
  """An integer input of `shape` drawn uniformly from [low, high) (int64 unless `dtype` says otherwise)."""
  shape: tuple
  low: int
  high: int
  dtype: Any = bt.int64


@dataclass(frozen=True)
class Bool:
  """A bool input of `shape`, True with probability p."""
  shape: tuple
  p: float = 0.5


def to_numpy(t) -> np.ndarray:
  """Values of a blutrain or torch tensor as a numpy array (half types widened to float32)."""
  if isinstance(t, torch.Tensor):
    t = t.detach()
    return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()
  t = t.detach()
  return (t.float() if t.dtype in (bt.bfloat16, bt.float16) else t).numpy()


def dtype_name(t) -> str:
  return str(t.dtype).split(".")[-1] if isinstance(t, torch.Tensor) else t.dtype.name


def assert_close(got, want, dtype=bt.float32, what: str = "values", atol=None, rtol=None) -> None:
  """Shape and dtype first, then values, with the tolerance of `dtype` (or of the tensors' own float dtype)."""
  if isinstance(want, torch.Tensor) and isinstance(got, bt.Tensor):
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != torch's {tuple(want.shape)}"
    assert dtype_name(got) == dtype_name(want), f"{what}: dtype {dtype_name(got)} != torch's {dtype_name(want)}"
    if got.dtype.is_floating_point: dtype = got.dtype
  g, w = (x if isinstance(x, np.ndarray) else to_numpy(x) for x in (got, want))
  assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
  a, r = TOLS[dtype]
  wide = lambda v: v if v.dtype == bool else v.astype(np.float64)
  np.testing.assert_allclose(wide(g), wide(w), atol=a if atol is None else atol, rtol=r if rtol is None else rtol,
                             err_msg=what)


def make_inputs(specs: Sequence, dtype=bt.float32, layout: str = "contiguous", low: float = -2.0, high: float = 2.0,
                seed: int = 0) -> list[np.ndarray]:
  """Seeded numpy inputs: a shape tuple gives a float array in [low, high); `Int`/`Bool` give integer/bool arrays;
  arrays and Python numbers pass through. `layout` picks how float inputs are stored (see `_stored`)."""
  rng = np.random.default_rng(seed)
  out = []
  for s in specs:
    if isinstance(s, Int): out.append(np.asarray(rng.integers(s.low, s.high, s.shape), dtype=s.dtype.np))
    elif isinstance(s, Bool): out.append(np.asarray(rng.random(s.shape) < s.p))
    elif isinstance(s, tuple): out.append(np.asarray(rng.uniform(low, high, s), dtype=np.float64))
    else: out.append(s)
  return out


def _stored(arr: np.ndarray, layout: str) -> tuple[np.ndarray, Callable]:
  """The array a leaf holds for `layout`, and the view (same for both libraries) that gives back `arr`:
  'transposed' stores the last two dims swapped, 'strided' stores every other element of the last dim."""
  if layout == "transposed" and arr.ndim >= 2:
    return np.ascontiguousarray(np.swapaxes(arr, -1, -2)), lambda t: t.transpose(-1, -2)
  if layout == "strided" and arr.ndim >= 1:
    wide = np.repeat(arr, 2, axis=-1)
    wide[..., 1::2] = 7.0
    return wide, lambda t: t[..., ::2]
  return arr, lambda t: t


def helper_test_op(specs: Sequence, torch_fn: Callable, bt_fn: Callable | None = None, *, dtype=bt.float32,
                   layouts: Sequence[str] = ("contiguous",), low: float = -2.0, high: float = 2.0, grad: bool = True,
                   tol_scale: float = 1.0, seed: int = 0) -> None:
  """Run `bt_fn` (default: `torch_fn`, for code that reads the same in both) on blutrain tensors and `torch_fn`
  on torch tensors made from the same seeded inputs; compare output shape, dtype, values, then the gradients of
  a random-weighted sum of the (float) outputs with respect to every float input.

  Args:
    specs: one entry per input: a shape (float input of `dtype`), `Int(...)`, `Bool(...)` or a numpy array.
    layouts: the storage variants to run float inputs in: 'contiguous', 'transposed', 'strided'.
  """
  bt_fn = bt_fn or torch_fn
  for layout in layouts:
    arrays = make_inputs(specs, dtype, layout, low, high, seed)
    tleaves, bleaves, targs, bargs = [], [], [], []
    for spec, arr in zip(specs, arrays):
      floating = isinstance(spec, tuple) or (isinstance(arr, np.ndarray) and arr.dtype.kind == "f")
      if not isinstance(arr, np.ndarray): targs.append(arr); bargs.append(arr); continue
      if not floating:
        targs.append(torch.from_numpy(arr.copy())); bargs.append(bt.tensor(arr)); continue
      stored, view = _stored(arr, layout)
      tl = torch.tensor(stored, dtype=TORCH_DTYPES[dtype], requires_grad=grad)
      bl = bt.tensor(stored, dtype=dtype, requires_grad=grad)
      tleaves.append(tl); bleaves.append(bl)
      targs.append(view(tl)); bargs.append(view(bl))
    tout, bout = torch_fn(*targs), bt_fn(*bargs)
    touts = list(tout) if isinstance(tout, (tuple, list)) else [tout]
    bouts = list(bout) if isinstance(bout, (tuple, list)) else [bout]
    assert len(touts) == len(bouts), f"{len(bouts)} outputs, torch gives {len(touts)}"
    a, r = TOLS[dtype]
    for i, (b, t) in enumerate(zip(bouts, touts)):
      assert_close(b, t, dtype, f"output {i} ({layout})", atol=a * tol_scale, rtol=r * tol_scale)
    if not grad or not tleaves: continue
    rng = np.random.default_rng(seed + 1)
    tloss, bloss = 0, 0
    for b, t in zip(bouts, touts):
      if not t.dtype.is_floating_point or not t.requires_grad: continue
      w = rng.standard_normal(tuple(t.shape))
      tloss = tloss + (t * torch.tensor(w, dtype=t.dtype)).sum()
      bloss = bloss + (b * bt.tensor(w, dtype=b.dtype)).sum()
    if isinstance(tloss, int): continue
    tloss.backward()
    if bloss.requires_grad: bloss.backward()  # else it must not depend on the inputs: torch's grads must be zeros
    for i, (bl, tl) in enumerate(zip(bleaves, tleaves)):
      tg = tl.grad if tl.grad is not None else torch.zeros_like(tl)
      bg = bl.grad if bl.grad is not None else bt.zeros_like(bl)
      assert_close(bg, tg, dtype, f"gradient of input {i} ({layout})", atol=a * tol_scale, rtol=r * tol_scale)


def check_vjp(fn: Callable, specs: Sequence, *, low: float = -2.0, high: float = 2.0, eps: float = 1e-6,
              atol: float = 1e-7, rtol: float = 1e-6, seed: int = 0) -> None:
  """The VJP of `fn` in float64 along one random direction against central finite differences:
  <vjp(u), v> == (<u, f(x + eps v)> - <u, f(x - eps v)>) / (2 eps) for random u (output) and v (float inputs)."""
  arrays = make_inputs(specs, bt.float64, "contiguous", low, high, seed)
  floats = [i for i, s in enumerate(specs) if isinstance(s, tuple)]

  def tensors(xs) -> list:
    return [bt.tensor(a, dtype=bt.float64) if i in floats else bt.tensor(a) if isinstance(a, np.ndarray) else a
            for i, a in enumerate(xs)]

  args = tensors(arrays)
  leaves = [args[i].requires_grad_() for i in floats]
  out = fn(*args)
  rng = np.random.default_rng(seed + 1)
  u = bt.tensor(rng.standard_normal(out.shape), dtype=bt.float64)
  vs = {i: rng.standard_normal(arrays[i].shape) for i in floats}
  grads = bt.autograd.grad((out * u).sum(), leaves, allow_unused=True)
  vjp_dot = sum(float((g.numpy() * vs[i]).sum()) for g, i in zip(grads, floats) if g is not None)

  def shifted(sign: float) -> float:
    with bt.no_grad():
      moved = [a + sign * eps * vs[i] if i in vs else a for i, a in enumerate(arrays)]
      return float((fn(*tensors(moved)) * u).sum().item())

  fd = (shifted(1.0) - shifted(-1.0)) / (2 * eps)
  np.testing.assert_allclose(vjp_dot, fd, atol=atol, rtol=rtol, err_msg="VJP vs central finite differences")


def assert_as_accurate(got: np.ndarray, other: np.ndarray, exact: np.ndarray, what: str = "", slack: float = 2.0) -> None:
  """`got` and `other` approximate `exact` with rounding of their own (two bf16 runs against a float32 run): `got`'s
  error must be no more than `slack` times `other`'s (in the 2-norm), and a wrong result is far beyond that."""
  err = lambda a: float(np.linalg.norm(np.asarray(a, np.float64) - exact))
  scale = float(np.linalg.norm(np.asarray(exact, np.float64)))
  assert err(got) <= slack * err(other) + 1e-6 * scale, \
    f"{what}: error {err(got):.3g} against the exact run, {err(other):.3g} for the other run, over a norm of {scale:.3g}"


def assert_adam_close(got: np.ndarray, want: np.ndarray, lr: float, rtol: float, atol: float, what: str = "",
                      outliers: float = 0.05) -> None:
  """Parameters after a few Adam steps from runs that round differently (bf16, fused kernels): Adam normalizes each
  update, so an element whose gradient is near rounding noise may move by up to lr per step either way. Most elements
  must agree within (rtol, atol); at most `outliers` of them may differ, and by no more than lr per element."""
  bad = ~np.isclose(got, want, rtol=rtol, atol=atol)
  diff = np.abs(np.asarray(got, np.float64) - want)
  assert bad.mean() <= outliers and diff.max(initial=0.0) <= lr, \
    f"{what}: {bad.sum()} of {bad.size} elements beyond rtol={rtol}, atol={atol}; largest difference {diff.max():.3g}"


def run_under_triton_interpreter(module: str) -> None:
  """Run `python -m module` (a test module's `main`, which prints "ok" last) with TRITON_INTERPRET=1, in a subprocess
  since the variable must be set before Triton is imported: Triton kernels' values without a GPU."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  r = subprocess.run([sys.executable, "-m", module], cwd=root, capture_output=True, text=True,
                     env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
  assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


def channel_layout(a: np.ndarray, layout: str, make: Callable, dtype, **kw):
  """A leaf tensor (`make` is bt.tensor or torch.tensor, given `dtype` and keywords such as device) holding the
  (N, C, *) array `a` in `layout`, and its (N, C, *) view: "channels_last" stores dim 1 innermost, "strided" every
  other element of a twice-wider last dim, "contiguous" as it is."""
  nd = a.ndim
  if layout == "channels_last":
    leaf = make(np.ascontiguousarray(np.moveaxis(a, 1, -1)), dtype=dtype, requires_grad=True, **kw)
    return leaf, leaf.permute(0, nd - 1, *range(1, nd - 1))
  if layout == "strided":
    leaf = make(np.stack([a, a], -1).reshape(*a.shape[:-1], 2 * a.shape[-1]), dtype=dtype, requires_grad=True, **kw)
    return leaf, leaf[..., ::2]
  leaf = make(a, dtype=dtype, requires_grad=True, **kw)
  return leaf, leaf


def patch_interpreter_loop_bounds() -> None:
  """Triton 3.6's interpreter reads loop bounds with int() of a 1-element array, which numpy 2 refuses: take the
  element (a patch of the interpreter's tensor, test-only; call it in the interpreter's subprocess)."""
  import triton.runtime.interpreter as interp
  original = interp._patch_lang_tensor

  def patched(tensor, scope):
    original(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
  interp._patch_lang_tensor = patched


def compiled(s):
  """A kernel variant (fn, signature, constexprs, options) compiled for sm_90 without a GPU, as Triton returns it
  (its PTX in .asm["ptx"], its shared memory in .metadata.shared)."""
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource
  from blutrain.backend.cuda import launch
  fn, signature, constexprs, opts = s
  sig, attrs = launch._parse_signature(fn, signature, constexprs)
  src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
  return triton.compile(src, target=GPUTarget(*launch.TARGET), options=opts)


def ptx(s) -> str:
  """The sm_90 PTX of a kernel variant (see `compiled`)."""
  return compiled(s).asm["ptx"]
