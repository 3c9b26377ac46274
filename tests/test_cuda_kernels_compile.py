"""Without a GPU: every variant that the CUDA kernel library lists in its modules' SPECS compiles for sm_90 through
the runtime's compiler (launch.cubin), each distinct one once, spread over the CPU's cores; and the host-side rules
of the library (dim collapsing, broadcast strides, block schedules, the index space of advanced indexing) hold."""
import importlib
import math
import os
from concurrent.futures import ProcessPoolExecutor

import multiprocessing
import numpy as np
import pytest

from blutrain import dtypes
from blutrain.backend.cuda import launch
from blutrain.backend.cuda.array import CudaArray

K = importlib.import_module("blutrain.backend.cuda.kernels")  # the backend package's `kernels` attribute is its table


def _key(s) -> tuple:
  fn, sig, consts, opts = s
  return fn, tuple(sig.items()), tuple((k, repr(v)) for k, v in consts.items()), tuple(opts.items())


SPECS = list({_key(s): s for s in K.specs()}.values())


def _compile(i: int) -> str:
  """'' when SPECS[i] compiles to a cubin, else the error's last lines."""
  fn, sig, consts, opts = SPECS[i]
  try:
    cubin = launch.cubin(fn, sig, consts, opts["num_warps"], opts["num_stages"])
    return "" if cubin[:4] == b"\x7fELF" else "not an ELF cubin"
  except Exception as e:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
  """Every spec compiled once, in forked workers sharing a fresh cache directory."""
  os.environ["BLUTRAIN_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
  ctx = multiprocessing.get_context("fork")
  with ProcessPoolExecutor(max_workers=min(8, os.cpu_count() or 1), mp_context=ctx) as pool:
    return list(pool.map(_compile, range(len(SPECS)), chunksize=4))


def _id(s) -> str:
  fn, _, consts, _ = s
  brief = ",".join(f"{k}={v}" for k, v in consts.items() if k in ("OP", "MODE", "LOG", "P", "G", "REVERSE"))
  return f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}[{brief}]"


@pytest.mark.parametrize("i", range(len(SPECS)), ids=[f"{_id(s)}-{i}" for i, s in enumerate(SPECS)])
def test_spec_compiles_for_sm90(compiled, i):
  fn, sig, consts, opts = SPECS[i]
  assert not compiled[i], f"{_id(SPECS[i])} with {consts}, {opts} does not compile: {compiled[i]}"


def test_every_family_lists_specs():
  names = {s[0].__module__.rsplit(".", 1)[-1] for s in SPECS}
  assert {"elementwise", "creation", "reduce", "norm", "loss", "index", "random", "optim"} <= names, names


# *** host-side rules ***

def test_collapse_merges_what_every_operand_walks_as_one():
  assert K.collapse((2, 3, 4), (12, 4, 1)) == ((24,), [(1,)])
  assert K.collapse((2, 3, 4), (12, 4, 1), (0, 0, 1)) == ((6, 4), [(4, 1), (0, 1)])  # a bias row
  assert K.collapse((2, 1, 4), (4, 99, 1)) == ((8,), [(1,)])                          # size-1 dims drop out
  assert K.collapse((4, 3), (1, 4)) == ((4, 3), [(1, 4)])                             # transposed: nothing merges
  assert K.collapse((1, 1), (5, 5), (0, 0)) == ((1,), [(0,), (0,)])
  for shape, strides in (((3, 5, 7), (35, 7, 1)), ((3, 5, 7), (1, 3, 15)), ((2, 3, 4, 5), (60, 5, 15, 1))):
    cshape, (cst,) = K.collapse(shape, strides)
    want = sorted(sum(i * s for i, s in zip(idx, strides)) for idx in np.ndindex(*shape))
    got = sorted(sum(i * s for i, s in zip(idx, cst)) for idx in np.ndindex(*cshape))
    assert got == want and math.prod(cshape) == math.prod(shape), (shape, strides, cshape, cst)


def test_broadcast_strides_and_shape():
  a = CudaArray(0, (3, 1), (1, 1), dtypes.float32, 0, None)
  assert K.broadcast_strides(a, (2, 3, 4)) == (0, 1, 0)
  assert K.broadcast_shape((3, 1), (2, 1, 4), ()) == (2, 3, 4)
  assert K.f64_bits(1.5) == np.array(1.5).view(np.int64) and K.needs_i64((2**31,), (1,))


def test_schedules_stay_in_bounds():
  from blutrain.backend.cuda.kernels import elementwise, index, norm, reduce
  from blutrain.configurator import ONE_PASS_MAX
  pow2 = lambda n: n & (n - 1) == 0
  for n in (1, 7, 1000, 1 << 20, 10**9):
    for item in (1, 2, 4, 8):
      block, warps = elementwise.flat_schedule(n, item)
      assert pow2(block) and 1 <= warps <= 8 and block >= 32 * (16 // item) // 4
  for rows, cols in ((1, 1), (16384, 768), (3, 50304), (10**6, 3), (7, 33)):
    br, bc, w = elementwise.tile_schedule(rows, cols)
    assert pow2(br) and pow2(bc) and br * bc <= 4096 and w in (4, 8)
    bm, bn, w, one = norm.row_schedule(rows, cols)
    assert pow2(bm) and pow2(bn) and (one == (cols <= ONE_PASS_MAX)) and (bn >= cols or not one)
    for along_m in (False, True):
      bm, bn, w = reduce.reduce_schedule(rows, cols, along_m)
      assert pow2(bm) and pow2(bn) and bm * bn <= 4096
    br, bc, w = index.index_schedule(rows, cols)
    assert br * bc <= 2048
  assert elementwise.tile_schedule(4096, 768)[1] == 256  # divides 768: no column mask, rows stay aligned
  assert reduce.split_rule(1, 10**7, 1024) > 1 and reduce.split_rule(1000, 10**7, 1024) == 1


def test_index_space_is_numpys():
  from blutrain.backend.cuda.kernels.index import _index_space
  x = np.zeros((6, 7, 8, 9))
  arr = lambda *s: CudaArray(0, s, (0,) * len(s), dtypes.int64, 0, None)
  for shapes, positions in ((((5,),), (0,)), (((2, 3),), (1,)), (((4,), (4,)), (0, 2)), (((2, 1), (1, 3)), (1, 2)),
                            (((5,),) * 4, (0, 1, 2, 3))):
    key = [slice(None)] * 4
    for s, p in zip(shapes, positions): key[p] = np.zeros(s, np.int64)
    assert _index_space(x.shape, tuple(arr(*s) for s in shapes), positions)[0] == x[tuple(key)].shape


def test_conv_takes_the_channels_last_variant_only_where_promised():
  from blutrain.backend.cuda.kernels import conv
  from blutrain.shapes import cdiv
  nhwc, nchw = lambda c: ((2, c, 8, 8), (64 * c, 1, 8 * c, c)), lambda c: ((2, c, 8, 8), (64 * c, 64, 8, 1))
  w_last = ((32, 32, 3, 3), (288, 1, 96, 32))
  pick = lambda kind, x, w, g, dtype=dtypes.bfloat16, groups=1, aligned=True: conv.plan(
    kind, dtype, x, w, g, (1, 1), (1, 1), (1, 1), groups, True, aligned=aligned)
  x, g = nhwc(32), nhwc(32)
  assert pick("fwd", x, w_last, nchw(32))[4] and pick("dgrad", nchw(32), w_last, g)[4]
  s, grid, *_, cl = pick("wgrad", x, w_last, g)
  assert cl and grid[1] == 9 * cdiv(32, s.constexprs["BLOCK_N"])  # a column tile per kernel position
  assert not pick("fwd", x, w_last, g, aligned=False)[4]  # a pointer off 16 bytes
  assert not pick("fwd", x, w_last, g, dtypes.float64)[4]
  assert not pick("fwd", nchw(32), w_last, g)[4] and not pick("dgrad", x, w_last, nchw(32))[4]
  assert not pick("wgrad", x, w_last, nchw(32))[4]
  assert not pick("fwd", ((2, 32, 8, 8), (2 * 64 * 48, 1, 8 * 48 + 8, 48)), w_last, g)[4]  # a stride off 16
  assert not pick("fwd", x, ((32, 8, 3, 3), (72, 1, 24, 8)), g, groups=4)[4]  # 8 channels per group
