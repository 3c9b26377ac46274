"""Every kernel of the CUDA kernel library against the CPU backend: the same primitive (`apply` on the op of the
registry) runs on CPU tensors and on CUDA tensors holding the same values, in several shapes, dtypes and layouts
(contiguous, transposed, strided, offset, broadcast), and the results must agree within the dtype's tolerance.
Random ops are checked by their statistics and reproducibility, fused AdamW against the per-parameter update.

A failure names the op, the input shapes, strides and dtypes, and the largest error with its position."""
import math

import numpy as np
import pytest

import blutrain as bt
from blutrain import dtypes
from blutrain.ops.core import apply, registry as P

pytestmark = pytest.mark.cuda

# (atol, rtol) of a result of each dtype; the GPU computes half types in float32 as the CPU does, so they differ by
# the last bit of a rounding at most
TOL = {bt.float64: (1e-12, 1e-10), bt.float32: (2e-6, 2e-5), bt.float16: (1e-3, 2e-3), bt.bfloat16: (1e-2, 1e-2)}
FLOATS = (bt.float32, bt.float16, bt.bfloat16, bt.float64)
LAYOUTS = ("contiguous", "transposed", "strided", "offset", "broadcast")
NAME = lambda dtype: dtype.name  # noqa: E731  (test ids)


def rand(shape, dtype, low=-3.0, high=3.0, seed=0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if dtype is bt.bool_: return np.asarray(rng.random(shape) < 0.5)
  if not dtype.is_floating_point: return np.asarray(rng.integers(int(low), int(high), shape)).astype(dtype.np)
  return np.asarray(rng.uniform(low, high, shape)).astype(dtype.np)


def pair(shape, dtype, layout="contiguous", low=-3.0, high=3.0, seed=0, prep=None):
  """(cpu, cuda) tensors with equal values of `shape`, both views of one layout over a base buffer (whose random
  values `prep` may rework on the host)."""
  shape = tuple(shape)
  if layout == "contiguous" or not shape:
    base, view = shape, lambda t: t
  elif layout == "transposed":
    base, view = shape[::-1], lambda t: t.permute(*range(len(shape) - 1, -1, -1))
  elif layout == "strided":
    base, view = shape[:-1] + (2 * shape[-1] + 1,), lambda t: t[..., 1::2]
  elif layout == "offset":
    base, view = (shape[0] + 3,) + shape[1:], lambda t: t[3:]
  else:  # broadcast: the first dim (or the last, when the first is 1) grows from 1
    d = 0 if shape[0] != 1 else len(shape) - 1
    base, view = shape[:d] + (1,) + shape[d + 1:], lambda t: t.expand(shape)
  values = rand(base, dtype, low, high, seed)
  cpu = bt.from_numpy(values if prep is None else prep(values).astype(dtype.np))
  a, b = view(cpu), view(cpu.to("cuda"))
  assert a.shape == b.shape == shape
  return a, b


def describe(*ts) -> str:
  return ", ".join(f"{tuple(t.shape)} strides {t.stride()} {t.dtype.name}" for t in ts if isinstance(t, bt.Tensor))


def check(what: str, got: bt.Tensor, want: bt.Tensor, tol=None) -> None:
  """got (CUDA) == want (CPU): shape and dtype first, then values within (atol, rtol), NaNs in the same places."""
  assert got.device.type == "cuda", f"{what}: result on {got.device}"
  assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, CPU gives {tuple(want.shape)}"
  assert got.dtype is want.dtype, f"{what}: dtype {got.dtype.name}, CPU gives {want.dtype.name}"
  g, w = got.numpy(), want.numpy()
  if got.dtype in (bt.float16, bt.bfloat16): g, w = g.astype(np.float32), w.astype(np.float32)
  if not got.dtype.is_floating_point:
    bad = np.argwhere(g != w)
    first = tuple(int(k) for k in bad[0]) if bad.size else ()
    assert bad.size == 0, f"{what}: {len(bad)} of {g.size} differ, first at {first}: {g[first]} != {w[first]}"
    return
  atol, rtol = tol or TOL[got.dtype]
  nan = np.isnan(w)
  assert (np.isnan(g) == nan).all(), f"{what}: NaN at {tuple(np.argwhere(np.isnan(g) != nan)[0])} in one result only"
  same_inf = np.isinf(w) & (g == w)
  with np.errstate(invalid="ignore"):
    err = np.where(nan | same_inf, 0.0, np.abs(g.astype(np.float64) - w.astype(np.float64)))
  bound = atol + rtol * np.abs(np.where(np.isinf(w), 0, w).astype(np.float64))
  if (err > bound).any():
    i = np.unravel_index(np.argmax(err - bound), err.shape)
    raise AssertionError(f"{what}: max error {err[i]:.3g} at {tuple(int(k) for k in i)} (got {g[i]}, want {w[i]}; "
                         f"atol {atol}, rtol {rtol}); {(err > bound).sum()} of {err.size} outside")


def run(name: str, *inputs, tol=None, **attrs):
  """Run primitive `name` on the CPU and the CUDA halves of `inputs` (pairs, or None) and compare."""
  cpu = apply(P[name], *(None if x is None else x[0] for x in inputs), **attrs)
  gpu = apply(P[name], *(None if x is None else x[1] for x in inputs), **attrs)
  check(f"{name}({describe(*(x[1] for x in inputs if x is not None))}; {attrs})", gpu, cpu, tol)
  return cpu, gpu


# *** elementwise ***

UNARY_DOMAIN = {"log": (0.01, 5), "sqrt": (0, 5), "rsqrt": (0.01, 5), "exp": (-10, 10),  # exp(11) > float16's max
                "log2": (0.01, 5), "log10": (0.01, 5), "log1p": (-0.99, 5), "asin": (-1, 1), "acos": (-1, 1),
                "atanh": (-0.99, 0.99), "acosh": (1, 6), "tan": (-1.5, 1.5), "exp2": (-10, 10)}
UNARY = ("neg", "exp", "log", "sqrt", "rsqrt", "abs", "sin", "cos", "tanh", "sigmoid", "relu", "erf", "floor", "sign",
         "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "exp2", "log2", "log10", "log1p",
         "expm1", "ceil", "trunc", "round")


@pytest.mark.parametrize("name", UNARY)
@pytest.mark.parametrize("dtype", FLOATS, ids=NAME)
def test_unary(name, dtype):
  low, high = UNARY_DOMAIN.get(name, (-6, 6))
  for shape, layout in (((1000,), "contiguous"), ((7, 33, 5), "transposed"), ((4, 300), "strided"), ((5, 6), "offset"),
                        ((3, 129), "broadcast"), ((), "contiguous"), ((0, 3), "contiguous"), ((3 << 20,), "contiguous")):
    run(name, pair(shape, dtype, layout, low, high))


@pytest.mark.parametrize("name", ("neg", "abs", "relu", "sign"))
@pytest.mark.parametrize("dtype", (bt.int32, bt.int64), ids=NAME)
def test_unary_integers(name, dtype):
  run(name, pair((17, 9), dtype, "transposed", -100, 100))


def test_unary_special_values():
  x = bt.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30, 88.0, -104.0])
  for name in ("exp", "log", "sqrt", "tanh", "sigmoid", "relu", "abs", "erf", "floor", "sign", "neg", "tan", "asin",
               "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "exp2", "log2", "log10", "log1p", "expm1",
               "ceil", "trunc", "round"):
    run(name, (x, x.to("cuda")))


def test_logical_not():
  run("logical_not", pair((100, 3), bt.bool_, "transposed"))


@pytest.mark.parametrize("approximate", ("none", "tanh"))
@pytest.mark.parametrize("dtype", FLOATS, ids=NAME)
def test_gelu_and_backward(approximate, dtype):
  for shape, layout in (((4096,), "contiguous"), ((16, 48), "transposed"), ((8, 100), "strided")):
    x = pair(shape, dtype, layout, -6, 6)
    run("gelu", x, approximate=approximate)
    run("gelu_backward", pair(shape, dtype, "contiguous", seed=1), x, approximate=approximate)


BINARY = ("add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq", "ne", "lt", "le", "gt", "ge", "fmod", "remainder",
          "floor_divide")
SHAPES2 = (((1000,), (1000,)), ((3, 1, 5), (1, 4, 5)), ((2, 3, 4, 65), (65,)), ((5000,), ()), ((), (7, 3)),
           ((64, 768), (768,)), ((6, 1), (1, 9)), ((2, 1, 3, 1, 4, 1, 5), (1, 2, 1, 3, 1, 4, 1)))


@pytest.mark.parametrize("name", BINARY)
@pytest.mark.parametrize("dtype", FLOATS + (bt.uint8, bt.int8, bt.int16, bt.int32, bt.int64), ids=NAME)
def test_binary_broadcast(name, dtype):
  fl = dtype.is_floating_point
  domains = {"pow": ((0.5, 3), (-2, 3)) if fl else ((-3, 4), (0, 5)), "div": ((-5, 6), (1, 5)),
             **dict.fromkeys(("fmod", "remainder", "floor_divide"), ((-20, 21), (1, 5)))}  # + and - divisors below
  x_dom, y_dom = domains.get(name, ((-5, 6), (-5, 6)))
  for (s1, s2), layout in zip(SHAPES2, LAYOUTS * 2):
    run(name, pair(s1, dtype, layout, *x_dom), pair(s2, dtype, "contiguous", *y_dom, seed=1))


@pytest.mark.parametrize("name,dtype", [(n, d) for n in ("bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not")
                                        for d in (bt.uint8, bt.int8, bt.int32, bt.int64, bt.bool_)] +
                         [(n, d) for n in ("bitwise_left_shift", "bitwise_right_shift")
                          for d in (bt.uint8, bt.int8, bt.int16, bt.int32, bt.int64)])
def test_bitwise(name, dtype):
  x = pair((33, 7), dtype, "transposed", -1000, 1000)
  shifts = "shift" in name  # amounts past the width and negative ones too
  y = pair((7,), dtype, "contiguous", -3 if shifts else -1000, 70 if shifts else 1000, seed=1)
  run(name, *((x,) if name == "bitwise_not" else (x, y)))


@pytest.mark.parametrize("name", ("atan2", "copysign"))
@pytest.mark.parametrize("dtype", FLOATS, ids=NAME)
def test_float_binary(name, dtype):
  for (s1, s2), layout in zip(SHAPES2, LAYOUTS * 2):
    run(name, pair(s1, dtype, layout), pair(s2, dtype, "contiguous", seed=1))


@pytest.mark.parametrize("name", ("fmod", "remainder", "floor_divide"))
@pytest.mark.parametrize("dtype", FLOATS + (bt.int32, bt.int64), ids=NAME)
def test_division_signs(name, dtype):
  """Every sign of dividend and divisor, exact and inexact quotients; floats also at 0, inf and nan."""
  a, b = np.meshgrid([-7, -6, -1, 0, 1, 5, 6, 7], [-3, -2, -1, 1, 2, 3])
  x, y = bt.tensor(a.ravel(), dtype=dtype), bt.tensor(b.ravel(), dtype=dtype)
  run(name, (x, x.to("cuda")), (y, y.to("cuda")))
  if dtype.is_floating_point:
    s = bt.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 2.5, -2.5, 1e-30], dtype=dtype)
    u, v = s.reshape(-1, 1).expand(8, 8), s.reshape(1, -1).expand(8, 8)
    run(name, (u, u.to("cuda")), (v, v.to("cuda")))


@pytest.mark.parametrize("name", ("eq", "ne", "lt", "maximum", "minimum", "add", "mul", "atan2", "copysign"))
def test_binary_nan_and_ties(name):
  a = bt.tensor([1.0, float("nan"), 2.0, float("nan"), -0.0, float("inf")])
  b = bt.tensor([1.0, 3.0, float("nan"), float("nan"), 0.0, float("inf")])
  run(name, (a, a.to("cuda")), (b, b.to("cuda")))


@pytest.mark.parametrize("name", ("logical_and", "logical_or", "logical_xor", "add", "mul", "maximum", "minimum", "eq"))
def test_bool_ops(name):
  run(name, pair((33, 7), bt.bool_, "transposed"), pair((7,), bt.bool_, seed=1))


def test_integer_pow():
  x = pair((200,), bt.int64, "contiguous", -4, 5)
  for e in (0, 1, 2, 7, 13):
    run("pow", x, (bt.full((), e, dtype=bt.int64), bt.full((), e, dtype=bt.int64, device="cuda")))


@pytest.mark.parametrize("dtype", FLOATS + (bt.int64, bt.bool_), ids=NAME)
def test_where(dtype):
  for (sc, sx, sy), layout in zip((((1000,), (1000,), (1000,)), ((4, 1, 6), (1, 5, 6), (6,)), ((), (3, 4), (3, 1)),
                                  ((64, 300), (64, 300), ())), LAYOUTS):
    run("where", pair(sc, bt.bool_, "contiguous"), pair(sx, dtype, layout), pair(sy, dtype, "contiguous", seed=1))


@pytest.mark.parametrize("src", dtypes.all_dtypes, ids=NAME)
def test_cast_every_pair(src):
  # floats: quarters and zeros, exact in every float dtype, truncated alike toward zero by every integer cast
  quarters = lambda v: np.floor(v.astype(np.float32) * 4) / 4 * (np.abs(v.astype(np.float32)) > 10)  # noqa: E731
  prep = quarters if src.is_floating_point else None
  for dst in dtypes.all_dtypes:
    # a negative float into uint8 is undefined in C (and in PyTorch): those casts take magnitudes
    p = (lambda v: np.abs(prep(v))) if dst is bt.uint8 and prep is not None else prep  # noqa: E731
    for layout in ("contiguous", "transposed"):
      run("cast", pair((31, 17), src, layout, -100, 100, prep=p), dtype=dst)


def test_cast_rounding_to_half():
  x = pair((4096,), bt.float32, "contiguous", -1000, 1000)
  for dst in (bt.float16, bt.bfloat16):
    run("cast", x, dtype=dst, tol=(0, 0))


@pytest.mark.parametrize("dtype", dtypes.all_dtypes, ids=NAME)
def test_copy_layouts(dtype):
  for shape, layout in (((1000,), "strided"), ((5, 7, 9), "transposed"), ((11, 4), "offset"), ((6, 128), "broadcast")):
    run("copy", pair(shape, dtype, layout))
  x = bt.from_numpy(rand((2,) * 8, dtype)).permute(7, 2, 5, 0, 3, 6, 1, 4)  # 8 dims that no collapse can merge
  run("copy", (x, x.to("cuda")))


def test_copy_into_strided_and_overlapping():
  for dtype in (bt.float32, bt.bfloat16, bt.int64):
    base = bt.from_numpy(rand((8, 10), dtype))
    a, b = base.clone(), base.to("cuda")
    for t in (a, b):
      t[:, 1::3] = t[:, 2::3]                              # strided source and destination
      t.transpose(0, 1)[2:5] = t.transpose(0, 1)[3:6]      # overlapping source and destination
      t[0] = 7                                             # a broadcast scalar
      t[1, 1:] = t[1, :-1]                                 # overlapping and dense: a memmove
    check(f"setitem {dtype.name}", b, a, (0, 0))
  x, y = bt.zeros(4, 6, device="cuda"), bt.arange(6, dtype=bt.int64, device="cuda")
  x.copy_(y)  # int64 into float32, broadcast over rows
  check("copy_ int64 -> float32 broadcast", x, bt.arange(6).to(bt.float32).expand(4, 6).contiguous())


def test_cat():
  for dtype in (bt.float32, bt.bool_, bt.bfloat16):
    for dim in (0, 1, 2):
      xs = [pair((3, 4, 5)[:dim] + (k,) + (3, 4, 5)[dim + 1:], dtype, layout, seed=k)
            for k, layout in zip((2, 1, 4), ("contiguous", "transposed", "strided"))]
      run("cat", *xs, dim=dim)


def test_full_and_arange():
  for dtype in dtypes.all_dtypes:
    for value in (0, 1, -3, 2.5, True, float("inf")):
      if not dtype.is_floating_point and value == float("inf") or dtype is dtypes.uint8 and value < 0: continue
      want = apply(P["full"], device=bt.device("cpu"), shape=(3, 1000), value=value, dtype=dtype)
      got = apply(P["full"], device=bt.device("cuda"), shape=(3, 1000), value=value, dtype=dtype)
      check(f"full {value} {dtype.name}", got, want)
  for start, end, step, dtype in ((0, 10, 1, None), (1, 2, 0.1, None), (-5, 100000, 3, bt.int32), (0.5, 1e5, 0.25, bt.float64),
                                  (10, -10, -0.5, bt.bfloat16), (0, 7, 2, bt.float16)):
    check(f"arange({start}, {end}, {step}, {dtype})", bt.arange(start, end, step, dtype=dtype, device="cuda"),
          bt.arange(start, end, step, dtype=dtype))


def test_index_width_past_int32():
  """A tensor of more than 2^31 elements takes the int64 index variants."""
  n = 2**31 + 77
  x = bt.full((n,), True, dtype=bt.bool_, device="cuda")
  y = apply(P["logical_not"], x)
  assert not y[-100:].numpy().any() and not y[:10].numpy().any()
  assert apply(P["sum"], x, dims=(0,), keepdim=False, dtype=bt.int64).item() == n
  del x, y


# *** reductions ***

RED_CASES = (((1000,), (0,)), ((64, 768), (1,)), ((64, 768), (0,)), ((4, 5, 6), (0, 2)), ((3, 1, 7), (1,)),
             ((2, 3, 4, 5), (1, 3)), ((16384, 8), (0,)), ((8, 300000), (1,)), ((5, 6), ()), ((0, 4), (0,)),
             ((2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3), (0, 2, 4, 6, 8, 10)))


@pytest.mark.parametrize("name", ("sum", "amax", "amin"))
@pytest.mark.parametrize("dtype", FLOATS + (bt.uint8, bt.int8, bt.int16, bt.int32, bt.int64, bt.bool_), ids=NAME)
def test_reductions(name, dtype):
  for (shape, dims), layout in zip(RED_CASES, LAYOUTS * 3):
    if name != "sum" and 0 in shape: continue
    dims = dims or tuple(range(len(shape)))
    for keepdim in (False, True):
      x = pair(shape, dtype, layout if len(shape) < 10 else "contiguous")
      n = math.prod(shape[d] for d in dims)
      if name == "sum":
        out = dtype if dtype.is_floating_point else bt.int64
        atol, rtol = TOL[out] if out.is_floating_point else (0, 0)
        tol = (atol * 3 * math.sqrt(n), rtol * 4) if out.is_floating_point else None
        run("sum", x, dims=dims, keepdim=keepdim, dtype=out, tol=tol)
      else:
        run(name, x, dims=dims, keepdim=keepdim)


def test_sum_into_other_dtype_and_nan_extremes():
  x = pair((37, 100), bt.bfloat16, "transposed")
  run("sum", x, dims=(1,), keepdim=False, dtype=bt.float32, tol=(1e-4, 1e-5))
  v = bt.tensor([[1.0, float("nan"), 3.0], [float("-inf"), -1.0, 2.0]])
  for name in ("amax", "amin"):
    run(name, (v, v.to("cuda")), dims=(1,), keepdim=False)


@pytest.mark.parametrize("name", ("argmax", "argmin"))
@pytest.mark.parametrize("dtype", (bt.float32, bt.bfloat16, bt.float64, bt.int64, bt.bool_), ids=NAME)
def test_arg_reductions(name, dtype):
  for (shape, dim), layout in zip((((1000,), 0), ((64, 50304), 1), ((300, 7), 0), ((4, 5, 6), 1), ((9, 33), 1)), LAYOUTS):
    for keepdim in (False, True):
      run(name, pair(shape, dtype, layout, -3, 3), dim=dim, keepdim=keepdim)  # few distinct values: many ties
  v = bt.tensor([[1.0, float("nan"), 3.0, float("nan")], [2.0, 2.0, -1.0, -1.0]])
  run(name, (v, v.to("cuda")), dim=1, keepdim=False)


@pytest.mark.parametrize("dtype", (bt.float32, bt.bfloat16, bt.float64, bt.int64), ids=NAME)
def test_cumsum(dtype):
  for (shape, dim), layout in zip((((1000,), 0), ((16, 5000), 1), ((3000, 5), 0), ((4, 5, 6), 1), ((9, 33), 0),
                                   ((2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3), 5)), LAYOUTS + ("contiguous",)):
    for reverse in (False, True):
      n = shape[dim]
      atol, rtol = TOL.get(dtype, (0, 0))
      run("cumsum", pair(shape, dtype, layout, -3, 3), dim=dim, reverse=reverse,
          tol=(atol * 3 * math.sqrt(n), rtol * 4) if dtype.is_floating_point else None)


@pytest.mark.parametrize("dtype", (bt.float32, bt.float64, bt.int64), ids=NAME)
def test_cumprod(dtype):
  for (shape, dim), layout in zip((((1000,), 0), ((16, 3000), 1), ((3000, 5), 0), ((4, 5, 6), 1), ((9, 33), 0)), LAYOUTS):
    # values near +-1 keep long products finite; zeros and a nan show they propagate
    prep = lambda v: np.where(np.abs(v) < 0.05, 0, 1 + v / 1000) if dtype.is_floating_point else np.sign(v)
    run("cumprod", pair(shape, dtype, layout, -3, 3, prep=prep), dim=dim,
        tol=(1e-5, 1e-4) if dtype is bt.float32 else None)


@pytest.mark.parametrize("dtype", (bt.float32, bt.bfloat16, bt.float16, bt.float64, bt.int64, bt.int32), ids=NAME)
def test_argsort(dtype):
  # few distinct values make many ties: the order of equal values shows the sort is stable
  special = lambda v: np.where(v > 2.5, np.nan, np.where(v < -2.6, -np.inf, np.round(v))) if dtype.is_floating_point \
    else v
  for (shape, dim), layout in zip((((1000,), 0), ((16, 50304), 1), ((300, 5), 0), ((4, 5, 6), 1), ((9, 33), 0),
                                   ((1, 1), 0), ((3, 0), 1)), LAYOUTS + ("contiguous", "contiguous")):
    for descending in (False, True):
      run("argsort", pair(shape, dtype, layout, -3, 3, prep=special), dim=dim, descending=descending)


def test_integer_pow_negative_exponents():
  base, exp = pair((300,), bt.int64, "contiguous", -3, 4), pair((300,), bt.int64, "contiguous", -4, 3, seed=1)
  run("pow", base, exp)


# *** softmax, layer_norm, cross-entropy ***

@pytest.mark.parametrize("name", ("softmax", "log_softmax"))
@pytest.mark.parametrize("dtype", FLOATS, ids=NAME)
def test_softmax(name, dtype):
  for (shape, dim), layout in zip((((64, 1024), 1), ((8, 50304), 1), ((4, 7, 33), 1), ((300, 5), 0), ((3, 20000), 1),
                                   ((2, 3, 4, 5, 6, 7, 8), 3), ((1, 1), 0)), LAYOUTS + ("contiguous", "contiguous")):
    run(name, pair(shape, dtype, layout, -10, 10), dim=dim)
  v = bt.tensor([[float("-inf"), 0.0, 1.0], [float("nan"), 0.0, 1.0], [-1e30, 1e30, 0.0]])
  run(name, (v, v.to("cuda")), dim=1)


@pytest.mark.parametrize("dtype", FLOATS, ids=NAME)
def test_layer_norm(dtype):
  for shape, n, layout in (((4, 64, 768), 1, "contiguous"), ((16, 33), 1, "transposed"), ((3, 5, 20000), 1, "contiguous"),
                           ((6, 4, 10), 2, "strided"), ((2, 3, 4, 5), 3, "offset"), ((9, 128), 1, "broadcast")):
    x = pair(shape, dtype, layout)
    w, b = pair(shape[-n:], dtype, seed=1), pair(shape[-n:], dtype, seed=2)
    tol = tuple(3 * t for t in TOL[dtype])
    for weight, bias in ((w, b), (None, None), (w, None), (None, b)):
      run("layer_norm", x, weight, bias, n=n, eps=1e-5, tol=tol)
  big = pair((8, 512), dtype, "contiguous", 1000, 1001)  # a large mean over a small spread: variance in two passes
  run("layer_norm", big, None, None, n=1, eps=1e-5, tol=(5e-3, 5e-3) if dtype is bt.float32 else None)


@pytest.mark.parametrize("dtype", FLOATS, ids=NAME)
def test_layer_norm_backward(dtype):
  """dx, dw and db against the CPU kernel in float64 (a half-precision CPU reference would be the less exact one)."""
  for shape, n, layout in (((4, 64, 768), 1, "contiguous"), ((16, 33), 1, "transposed"), ((3, 5, 20000), 1, "strided"),
                           ((6, 4, 10), 2, "offset"), ((1000, 3), 1, "contiguous"), ((0, 8), 1, "contiguous")):
    x, g = pair(shape, dtype, layout), pair(shape, dtype, "contiguous", seed=3)
    w = pair(shape[-n:], dtype, seed=1)
    for weight, has_bias in ((w, True), (None, False), (w, False), (None, True)):
      args = (g, x, weight)
      want = apply(P["layer_norm_backward"], *(a and a[0].double() for a in args), n=n, eps=1e-5, has_bias=has_bias)
      got = apply(P["layer_norm_backward"], *(a and a[1] for a in args), n=n, eps=1e-5, has_bias=has_bias)
      rows = max(1, math.prod(shape[:len(shape) - n]))  # dw and db sum over the rows
      atol, rtol = TOL[dtype]
      assert [t is None for t in got] == [t is None for t in want] == [False, weight is None, not has_bias, True, True]
      for part, got_part, want_part in zip(("dx", "dw", "db"), got, want):
        if got_part is None: continue
        check(f"layer_norm_backward {part}({describe(*(a[1] for a in args if a is not None))}; has_bias={has_bias})",
              got_part, want_part.to(dtype), (atol * 10 * math.sqrt(rows), rtol * 10))


@pytest.mark.parametrize("stages", (1, 2, 3))
def test_layer_norm_backward_schedules(stages):
  """Every schedule computes the same backward: row tiles of 1 and 4 rows, several tiles per program and a last
  program with fewer, `stages` tiles in flight (Triton's pipelined loads), a bf16 gradient and a residual gradient,
  against float64 on the CPU."""
  from blutrain.backend.cuda.kernels import norm
  from blutrain.configurator import norm_backward_schedule
  M, N = 1000, 768
  (gc, g), (xc, x), (wc, w), (rc, r) = (pair(s, d, seed=k) for k, (s, d) in enumerate(
    (((M, N), bt.bfloat16), ((M, N), bt.float32), ((N,), bt.float32), ((M, N), bt.float32))))
  dx, dw, db, _, _ = apply(P["layer_norm_backward"], gc.double(), xc.double(), wc.double(), n=1, eps=1e-5,
                           has_bias=True)
  base = norm_backward_schedule(M, N, 132)
  for bm, warps, tiles in ((1, 2, 7), (4, 8, 3)):
    s = base._replace(block_m=bm, warps=warps, rows=bm * tiles, stages=stages)
    got = norm.layer_norm_backward(g._array(), x._array(), w._array(), r._array(), n=1, eps=1e-5, has_bias=True,
                                   bias_grad=True, schedule=s)
    stored = bt.Tensor._wrap(got[0], g.device, got[0].dtype).cpu().double()
    for part, a, want in zip(("dx", "dw", "db", "", "dx's column sums"), got, (dx + rc.double(), dw, db, None,
                                                                            stored.sum(0))):
      if want is None: continue
      check(f"layer_norm_backward {part} under {s}", bt.Tensor._wrap(a, g.device, a.dtype), want.float(),
            (2e-4 * math.sqrt(M), 2e-4))


@pytest.mark.parametrize("dtype", (bt.float32, bt.bfloat16, bt.float64), ids=NAME)
def test_cross_entropy(dtype):
  for (n, c), layout in zip(((64, 10), (128, 1000), (256, 50304), (33, 5000)), ("contiguous", "transposed", "contiguous",
                                                                                "strided")):
    logits = pair((n, c), dtype, layout, -8, 8)
    t = rand((n,), bt.int64, 0, c, seed=3)
    t[::7] = -100
    target = (bt.from_numpy(t), bt.from_numpy(t).to("cuda"))
    tol = (2e-5 * math.log(c), 2e-5) if dtype is bt.float32 else None
    run("cross_entropy", logits, target, ignore_index=-100, tol=tol)
    g = pair((n,), dtype, "contiguous", 0.5, 2, seed=4)
    run("cross_entropy_backward", g, logits, target, ignore_index=-100)
    g = (bt.full((), 0.25, dtype=dtype).expand(n), bt.full((), 0.25, dtype=dtype, device="cuda").expand(n))
    run("cross_entropy_backward", g, logits, target, ignore_index=-100)


@pytest.mark.parametrize("dtype", (bt.float32, bt.bfloat16, bt.float64), ids=NAME)
def test_cross_entropy_with_kept_statistics_equals_the_plain_kernels(dtype):
  """The forward's row statistics, read by the backward in place of its own: the same losses and gradients as the
  backward that computes them, to float32's rounding (the two kernels may add a row's terms in another order: one
  rounding of the result's dtype apart at most); a bad target's row is NaN either way."""
  rtol = {bt.float64: 1e-13, bt.float32: 1e-6, bt.bfloat16: 2 ** -7}[dtype]
  for (n, c), layout in zip(((64, 10), (256, 50304), (33, 5000)), ("contiguous", "contiguous", "strided")):
    x = pair((n, c), dtype, layout, -8, 8)[1]
    t = rand((n,), bt.int64, 0, c, seed=3)
    t[::7], t[3] = -100, c + 5
    target = bt.from_numpy(t).to("cuda")
    g = bt.from_numpy(rand((n,), dtype, 0.5, 2, seed=4)).to("cuda")
    loss = apply(P["cross_entropy"], x, target, ignore_index=-100).float().numpy()
    kept, row_max, sum_exp = apply(P["cross_entropy_with_stats"], x, target, ignore_index=-100)
    np.testing.assert_allclose(kept.float().numpy(), loss, rtol=rtol, atol=rtol * 1e-3)
    want = apply(P["cross_entropy_backward"], g, x, target, ignore_index=-100).double().numpy()
    got = apply(P["cross_entropy_backward_with_stats"], g, x, target, row_max, sum_exp, ignore_index=-100)
    got = got.double().numpy()
    assert np.isnan(got[3]).all() and np.isnan(want[3]).all(), "a bad target's row is NaN"
    got, want = np.delete(got, 3, 0), np.delete(want, 3, 0)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * 1e-3 / c,
                               err_msg=f"{(n, c)} {layout}: {(got != want).sum()} of {got.size} differ")


@pytest.mark.parametrize("dtype", (bt.float32, bt.bfloat16, bt.float64), ids=NAME)
def test_cross_entropy_with_grad_is_the_plain_loss_and_gradient(dtype):
  """Nova's one-kernel loss and gradient: the backward's gradient to the bit (the same kernel, which also stores the
  losses), written over its logits or not, and the forward's losses to float32's rounding (the forward's kernel may
  add a row's terms in another order); a bad target's row is NaN, an ignored one 0."""
  from blutrain.backend.cuda.kernels.loss import cross_entropy_with_grad
  rtol = {bt.float64: 1e-13, bt.float32: 1e-6, bt.bfloat16: 1e-6}[dtype]
  for (n, c), layout in zip(((64, 10), (256, 50304), (33, 5000)), ("contiguous", "contiguous", "strided")):
    x = pair((n, c), dtype, layout, -8, 8)[1]
    t = rand((n,), bt.int64, 0, c, seed=3)
    t[::7], t[3] = -100, c + 5
    target = bt.from_numpy(t).to("cuda")
    g = bt.full((), 0.25, device="cuda").expand(n)  # a mean's 1/count, broadcast
    want_loss = apply(P["cross_entropy"], x, target, ignore_index=-100, dtype=bt.float32).numpy()
    want = apply(P["cross_entropy_backward"], g, x, target, ignore_index=-100).float().numpy()
    for over_logits in (False, True):
      logits = x.clone() if over_logits else x  # (clone: contiguous)
      out = logits._array() if over_logits else None
      losses, grad = cross_entropy_with_grad(g._array(), logits._array(), target._array(), -100, dtypes.float32,
                                             out=out)
      grad = bt.Tensor._wrap(grad, x.device, x.dtype).float().numpy()
      np.testing.assert_array_equal(np.nan_to_num(grad, nan=7.0), np.nan_to_num(want, nan=7.0))
      got_loss = bt.Tensor._wrap(losses, x.device, bt.float32).numpy()
      assert np.isnan(got_loss[3]) and (got_loss[::7] == 0).all()
      np.testing.assert_allclose(np.delete(got_loss, 3), np.delete(want_loss, 3), rtol=rtol, atol=rtol * 1e-3)


def test_cross_entropy_bad_target_is_nan():
  logits = bt.randn(3, 5, device="cuda")
  loss = apply(P["cross_entropy"], logits, bt.tensor([1, 7, -3], device="cuda"), ignore_index=-100).numpy()
  assert np.isfinite(loss[0]) and np.isnan(loss[1:]).all(), loss


# *** indexing ***

@pytest.mark.parametrize("dtype", (bt.float32, bt.bfloat16, bt.float16), ids=NAME)
def test_embedding_and_backward(dtype):
  for (v, d), idx_shape, layout in (((50304, 768), (4, 256), "contiguous"), ((100, 33), (7,), "transposed"),
                                    ((10, 5), (3, 4, 5), "strided")):
    w = pair((v, d), dtype, layout)
    i = rand(idx_shape, bt.int64, -v, v, seed=5)
    idx = (bt.from_numpy(i), bt.from_numpy(i).to("cuda"))
    run("embedding", w, idx)
    g = pair(idx_shape + (d,), dtype, "contiguous", seed=6)
    atol, rtol = TOL[dtype]
    run("embedding_backward", g, idx, num=v, tol=(atol * 4, rtol * 4))


@pytest.mark.parametrize("dtype", (bt.float32, bt.bfloat16, bt.int64), ids=NAME)
def test_gather_and_scatter_add(dtype):
  for shape, ishape, dim, layout in (((10, 20), (10, 5), 1, "contiguous"), ((30, 4, 5), (7, 4, 5), 0, "transposed"),
                                     ((6, 7, 8), (6, 3, 8), 1, "strided"), ((50,), (200,), 0, "contiguous")):
    x = pair(shape, dtype, layout)
    i = rand(ishape, bt.int64, -shape[dim], shape[dim], seed=7)
    index = (bt.from_numpy(i), bt.from_numpy(i).to("cuda"))
    run("gather", x, index, dim=dim)
    i = rand(ishape, bt.int64, 0, shape[dim], seed=7)
    index = (bt.from_numpy(i), bt.from_numpy(i).to("cuda"))
    src = pair(tuple(n + 1 for n in ishape), dtype, "contiguous", seed=8)  # larger than index, as scatter_add allows
    run("scatter_add", x, index, src, dim=dim, tol=tuple(4 * t for t in TOL[dtype]) if dtype.is_floating_point else None)


@pytest.mark.parametrize("reduce", ("sum", "prod", "mean", "amax", "amin"))
@pytest.mark.parametrize("dtype", (bt.float32, bt.bfloat16, bt.float64, bt.int64, bt.int8), ids=NAME)
def test_scatter_reduce(reduce, dtype):
  """Repeated positions, with and without self; float inputs hold NaNs (which PyTorch's reductions keep) and, for
  amax and amin, ties."""
  nan = lambda v: np.where(np.random.default_rng(5).random(v.shape) < 0.02, np.nan, v)
  for shape, ishape, dim, layout in (((10, 20), (10, 30), 1, "contiguous"), ((30, 4, 5), (70, 4, 5), 0, "transposed"),
                                     ((6, 7, 8), (6, 9, 8), 1, "strided"), ((50,), (400,), 0, "contiguous")):
    low, high = (0.7, 1.4) if reduce == "prod" and dtype.is_floating_point else (-3, 4)
    prep = (lambda v: nan(np.round(v))) if dtype.is_floating_point else None  # whole numbers tie
    x = pair(shape, dtype, layout, low, high, prep=None if reduce == "prod" else prep)
    src = pair(ishape, dtype, "contiguous", low, high, seed=8, prep=None if reduce == "prod" else prep)
    i = rand(ishape, bt.int64, 0, shape[dim], seed=7)
    index = (bt.from_numpy(i), bt.from_numpy(i).to("cuda"))
    for include_self in (True, False):
      run("scatter_reduce", x, index, src, dim=dim, reduce=reduce, include_self=include_self,
          tol=tuple(8 * t for t in TOL[dtype]) if dtype.is_floating_point else None)


def test_scatter_reduce_gradients():
  """The VJP (gathers, scatter_adds and scatter_reduce itself) on the GPU against the CPU's, ties included."""
  rng = np.random.default_rng(0)
  x, src = (np.round(rng.uniform(-2, 2, shape)).astype(np.float32) for shape in ((5, 6), (9, 6)))
  i = rng.integers(0, 5, (9, 6))
  for reduce in ("sum", "prod", "mean", "amax", "amin"):
    for include_self in (True, False):
      grads = []
      for device in ("cpu", "cuda"):
        a, b = (bt.from_numpy(v).to(device).requires_grad_() for v in (x, src))
        out = a.scatter_reduce(0, bt.from_numpy(i).to(device), b, reduce, include_self=include_self)
        (out * bt.arange(30, dtype=bt.float32, device=device).reshape(5, 6)).sum().backward()
        grads.append((out.detach(), a.grad, b.grad))
      for what, got, want in zip(("out", "x.grad", "src.grad"), grads[1], grads[0]):
        check(f"scatter_reduce {reduce} include_self={include_self} {what}", got, want)


def ix(n: int, shape, seed=9):
  """Distinct positions of a dim of size n (so index_put has one value per position), some written negative."""
  rng = np.random.default_rng(seed)
  i = rng.permutation(n)[:math.prod(shape)].reshape(shape)
  i = np.where(rng.random(shape) < 0.3, i - n, i).astype(np.int64)
  return bt.from_numpy(i), bt.from_numpy(i).to("cuda")


@pytest.mark.parametrize("dtype", (bt.float32, bt.bfloat16, bt.bool_), ids=NAME)
def test_index_family(dtype):
  shape = (6, 7, 8, 9)
  x = pair(shape, dtype, "transposed")
  for idx, positions in (([ix(6, (5,))], (0,)), ([ix(7, (2, 3))], (1,)), ([ix(6, (4,)), ix(8, (4,))], (0, 2)),
                         ([ix(7, (2, 1)), ix(8, (1, 3))], (1, 2)),
                         ([ix(6, (5,)), ix(7, (5,)), ix(8, (5,)), ix(9, (5,))], (0, 1, 2, 3))):
    cpu, _ = run("index", x, *idx, positions=positions)
    v = pair(cpu.shape, dtype, "contiguous", seed=10)
    run("index_put", x, v, *idx, positions=positions)
    if dtype is not bt.bool_:
      run("index_backward", v, *idx, shape=shape, positions=positions, tol=tuple(4 * t for t in TOL[dtype]))


def test_slice_backward():
  for dtype in (bt.float32, bt.int64):
    g = pair((3, 2, 4), dtype, "transposed")
    run("slice_backward", g, shape=(7, 5, 9), index=((1, 7, 2), (0, 2, 1), (2, 9, 2)))


def test_getitem_through_autograd():
  """Basic and advanced indexing in one key, forward and backward (slice_backward, index_backward)."""
  x, i = rand((5, 6, 7), bt.float32), np.array([[0, 4], [2, -1]])
  results = {}
  for dev in ("cpu", "cuda"):
    t = bt.tensor(x, device=dev, requires_grad=True)
    idx = bt.tensor(i, device=dev)
    y = t[idx, 1:5:2, idx]
    (y * y).sum().backward()
    results[dev] = (y.detach(), t.grad)
  check("getitem", results["cuda"][0], results["cpu"][0])
  check("getitem backward", results["cuda"][1], results["cpu"][1])


# *** convolution (tests/cuda/test_conv.py compares the layers with PyTorch CUDA) ***

@pytest.mark.parametrize("dtype", (bt.float64, bt.float32, bt.bfloat16), ids=NAME)
def test_conv_kernels_in_3d_2d_and_1d(dtype):
  """conv, conv_grad_input and conv_grad_weight: 3-D geometry (the kernels' DEPTH variant), and 2-D and 1-D, which
  skip the depth dim."""
  tol = tuple(10 * t for t in TOL[dtype]) if dtype is bt.float32 else tuple(2 * t for t in TOL[dtype])
  for xs, ws, stride, padding, dilation, groups, layout in (
      ((2, 4, 6, 7, 5), (6, 2, 3, 2, 3), (2, 1, 1), (1, 0, 2), (1, 2, 1), 2, "contiguous"),
      ((1, 3, 5, 6, 7), (4, 3, 1, 3, 3), (1, 2, 1), (0, 1, 1), (1, 1, 1), 1, "transposed"),
      ((2, 2, 6, 5, 4), (2, 1, 3, 3, 2), (3, 2, 1), (2, 1, 0), (2, 1, 2), 2, "offset"),
      ((2, 4, 9, 10), (6, 2, 3, 2), (2, 1), (1, 2), (1, 2), 2, "strided"),
      ((2, 6, 33), (4, 3, 5), (3,), (2,), (2,), 2, "contiguous")):
    x, w = pair(xs, dtype, layout), pair(ws, dtype, seed=1)
    attrs = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    out, _ = run("conv", x, w, tol=tol, **attrs)
    g = pair(out.shape, dtype, "strided", seed=2)
    run("conv_grad_input", g, w, shape=xs, tol=tol, **attrs)
    run("conv_grad_weight", g, x, shape=ws, tol=tol, **attrs)


# *** random ***

@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.bfloat16])
def test_dropout_values_and_gradient(dtype):
  """Dropout of a strided view: x / (1 - p) where the mask the same generator state draws keeps, 0 elsewhere; the
  gradient is the same mask and scale on the upstream gradient."""
  base = bt.randn(256, 384, device="cuda").to(dtype).requires_grad_(True)
  x, p = base[::2, 1::3], 0.25
  out = bt.nn.functional.dropout(x, p, generator=bt.Generator("cuda").manual_seed(11))
  keep = bt.ops.bernoulli_mask(x.shape, 1 - p, device="cuda", generator=bt.Generator("cuda").manual_seed(11)).numpy()
  assert out.dtype is dtype and abs(keep.mean() - (1 - p)) < 0.02
  xs = x.detach().to(dtypes.float32).numpy().astype(np.float64)
  tol = 1e-6 if dtype is dtypes.float32 else 1.6e-2  # bf16: the scale, a Python number, is rounded to bf16 too
  np.testing.assert_allclose(out.detach().to(dtypes.float32).numpy(), np.where(keep, xs / (1 - p), 0.0), rtol=tol)
  g = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)
  out.backward(bt.tensor(g).to("cuda").to(dtype))
  want = np.zeros(base.shape)
  want[::2, 1::3] = np.where(keep, g.astype(dtype.np).astype(np.float64) / (1 - p), 0.0)
  np.testing.assert_allclose(base.grad.to(dtypes.float32).numpy(), want, rtol=tol, atol=1e-30)


def test_random_statistics_and_reproducibility():
  n = 1 << 22
  g = bt.Generator("cuda").manual_seed(1234)
  u = bt.rand(n, device="cuda", generator=g).numpy().astype(np.float64)
  z = bt.randn(n, device="cuda", generator=g).numpy().astype(np.float64)
  k = bt.randint(-5, 7, (n,), device="cuda", generator=g).numpy()
  b = bt.ops.bernoulli_mask((n,), 0.3, device="cuda", generator=g).numpy()
  se = 1 / math.sqrt(n)
  assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 6 * se * math.sqrt(1 / 12), u.mean()
  assert abs(u.var() - 1 / 12) < 0.002 and abs(np.histogram(u, 16, (0, 1))[0] / n - 1 / 16).max() < 0.002
  assert abs(z.mean()) < 6 * se and abs(z.var() - 1) < 0.01 and abs((np.abs(z) < 1).mean() - 0.6827) < 0.002
  assert k.min() == -5 and k.max() == 6 and abs(np.bincount(k + 5) / n - 1 / 12).max() < 0.002 and k.dtype == np.int64
  assert b.dtype == np.bool_ and abs(b.mean() - 0.3) < 6 * se
  assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 6 * se  # neighbours are independent
  g2 = bt.Generator("cuda").manual_seed(1234)
  again = bt.rand(n, device="cuda", generator=g2).numpy().astype(np.float64)
  assert (again == u).all(), "same seed and offset, different numbers"
  assert (bt.rand(n, device="cuda", generator=g2).numpy() == u).mean() < 1e-4, "the offset did not advance the stream"
  for dtype in (bt.bfloat16, bt.float16, bt.float64):
    r = bt.rand(1000, dtype=dtype, device="cuda")
    assert r.dtype is dtype and 0 <= float(r.min()) <= float(r.max()) <= 1
  assert bt.randint(0, 3, (100,), dtype=bt.int32, device="cuda").dtype is bt.int32


# *** gradient clipping (multi-tensor kernels) ***

@pytest.mark.parametrize("max_norm", (1e9, 0.5), ids=("unclipped", "clipped"))
def test_clip_grad_norm_multi_tensor(max_norm):
  shapes = [(768, 3072), (3072,), (50304, 64), (7,), (), (0, 3)]
  grads = [(rand(s, bt.float32, seed=i), bt.bfloat16 if i % 3 == 1 else bt.float32) for i, s in enumerate(shapes)]
  results = {}
  for device in ("cuda", "cpu"):
    params = [bt.zeros(a.shape, dtype=dt, device=device, requires_grad=True) for a, dt in grads]
    for p, (a, dt) in zip(params, grads): p.grad = bt.tensor(a, device=device).to(dt)
    results[device] = bt.nn.utils.clip_grad_norm_(params, max_norm), params
  (total, params), (want_total, want_params) = results["cuda"], results["cpu"]
  check("clip_grad_norm_ total", total, want_total, (0, 1e-5))
  for i, (p, q) in enumerate(zip(params, want_params)):
    check(f"clip_grad_norm_ grad {i} {shapes[i]}", p.grad, q.grad, TOL[p.dtype])


# *** fused AdamW ***

def _channels_last_last(params: list, step: int) -> None:
  """The last parameter (4-d) made channels-last, a leaf; its gradient channels-last on even steps, row-major on odd
  ones (read through a copy in the parameter's layout by the multi-tensor kernels)."""
  if step < 0:
    params[-1] = params[-1].detach().contiguous(memory_format=bt.channels_last).requires_grad_()
  elif step % 2 == 0:
    params[-1].grad = params[-1].grad.contiguous(memory_format=bt.channels_last)


def test_fused_adamw_matches_the_per_parameter_update():
  """With a channels-last parameter among them: its moments take its layout and it joins the launch."""
  shapes = [(768, 3072), (3072,), (50304, 64), (7,), (), (64, 32, 3, 3)]
  init = [rand(s, bt.float32, seed=i) for i, s in enumerate(shapes)]
  grads = [[rand(s, bt.float32, seed=100 * k + i) for i, s in enumerate(shapes)] for k in range(4)]
  runs = {}
  for name, device, fused in (("fused", "cuda", None), ("reference", "cuda", False), ("cpu", "cpu", False)):
    params = [bt.tensor(a, device=device, requires_grad=True) for a in init]
    _channels_last_last(params, -1)
    opt = bt.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=fused)
    for k, step in enumerate(grads):
      for p, g in zip(params, step): p.grad = bt.tensor(g, device=device)
      _channels_last_last(params, k)
      opt.step()
    runs[name] = (params, opt)
  # the same float32 arithmetic in another order: a few ulps of the parameters' scale (~1), not of each value
  for (pf, of), (pr, orf) in ((runs["fused"], runs["reference"]),):
    for i, (a, b) in enumerate(zip(pf, pr)):
      check(f"fused AdamW param {i} {shapes[i]}", a.detach(), b.detach().cpu(), (5e-7, 1e-6))
      for key in ("exp_avg", "exp_avg_sq"):
        check(f"fused AdamW {key} {i}", of.state[a][key], orf.state[b][key].cpu(), (5e-7, 1e-6))
      assert of.state[a]["step"].item() == orf.state[b]["step"].item() == len(grads)
      assert of.state[a]["exp_avg"].stride() == a.stride()
  for i, (a, b) in enumerate(zip(runs["fused"][0], runs["cpu"][0])):
    check(f"fused AdamW vs CPU param {i}", a.detach(), b.detach(), (1e-6, 1e-5))


# *** fused SGD ***

@pytest.mark.parametrize("kwargs", [dict(momentum=0.9, weight_decay=1e-4), dict(momentum=0.9, nesterov=True),
                                    dict(momentum=0.8, dampening=0.3, maximize=True), dict(weight_decay=0.01)],
                         ids=("momentum", "nesterov", "dampening-maximize", "plain"))
def test_fused_sgd_matches_the_per_parameter_update_and_the_cpu(kwargs):
  """One launch per step (two while a parameter starts its buffer, as the second group here does at step 1) against
  the per-parameter update on the GPU and on the CPU; a strided gradient and bf16 parameters among them."""
  shapes = [(768, 3072), (3072,), (50304, 64), (7,), (), (0, 3), (64, 32, 3, 3)]
  init = [rand(s, bt.float32, seed=i) for i, s in enumerate(shapes)]
  grads = [[rand(s, bt.float32, seed=100 * k + i) for i, s in enumerate(shapes)] for k in range(4)]
  runs = {}
  for name, device, fused in (("fused", "cuda", None), ("reference", "cuda", False), ("cpu", "cpu", False)):
    params = [bt.tensor(a, device=device, requires_grad=True) for a in init]
    params[3] = bt.tensor(init[3], device=device).bfloat16().requires_grad_()
    _channels_last_last(params, -1)
    opt = bt.optim.SGD(params, lr=0.05, **kwargs, fused=fused)
    for k, step in enumerate(grads):
      for i, (p, g) in enumerate(zip(params, step)):
        p.grad = None if k == 0 and i == 1 else bt.tensor(g, device=device).to(p.dtype)
      params[0].grad = params[0].grad.t().contiguous().t()  # the same values, transposed strides
      _channels_last_last(params, k)
      opt.step()
    runs[name] = (params, opt)
  (pf, of), (pr, orf), (pc, oc) = runs["fused"], runs["reference"], runs["cpu"]
  for i, (a, b, c) in enumerate(zip(pf, pr, pc)):
    tol = (2e-2, 2e-2) if a.dtype is bt.bfloat16 else (1e-6, 1e-5)  # one rounding or one per op; the GPU's FMAs
    check(f"fused SGD param {i} {shapes[i]}", a.detach(), b.detach().cpu(), tol)
    check(f"fused SGD vs CPU param {i} {shapes[i]}", a.detach(), c.detach(), tol)
    if kwargs.get("momentum"):
      check(f"fused SGD buffer {i}", of.state[a]["momentum_buffer"], oc.state[c]["momentum_buffer"], tol)
      assert of.state[a]["momentum_buffer"].stride() == a.stride(), i
