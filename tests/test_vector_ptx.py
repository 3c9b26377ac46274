"""Without a GPU: the layer-norm, cross-entropy and reduction kernels' variants for rows whose pointers, lengths and
strides are multiples of 16 (`vectors`, which the host takes whenever they are: GPT-2's rows of 768, its 50,304
logits, its bias gradients) load and store whole rows as 16-byte vectors, where the others (nothing promised) read
and write one element at a time."""
import re
from collections import Counter

import pytest

from blutrain import dtypes
from blutrain.backend.cuda.kernels import loss, norm, reduce
from tests.helpers import ptx

triton = pytest.importorskip("triton")

f32, bf16 = dtypes.float32, dtypes.bfloat16
M, N = 1 << 14, 768
VARIANTS = {
  "forward to bf16": lambda v: norm.layer_norm_spec(f32, f32, f32, 1, M, N, False, bf16, None, v),
  "forward with the residual add": lambda v: norm.layer_norm_spec(f32, f32, f32, 1, M, N, False, bf16, bf16, v),
  "backward from a bf16 gradient": lambda v: norm.layer_norm_backward_spec(f32, bf16, f32, True, M, N, False, None, v),
  "backward with a residual gradient": lambda v: norm.layer_norm_backward_spec(f32, bf16, f32, True, M, N, False, bf16,
                                                                                v),
  "backward with a residual gradient and a bf16 copy of dx": lambda v: norm.layer_norm_backward_spec(
    f32, bf16, f32, True, M, N, False, f32, v, None, bf16),
  "cross-entropy forward": lambda v: loss.ce_spec(False, bf16, dtypes.int64, True, M, 50304, False, f32, v),
  "cross-entropy backward": lambda v: loss.ce_spec(True, bf16, dtypes.int64, True, M, 50304, False, f32, v),
  "cross-entropy backward from the logsumexp": lambda v: loss.ce_lse_spec(True, bf16, dtypes.int64, True, M, 50304,
                                                                          False, f32, v),
  "row sums": lambda v: reduce.reduce_spec("sum", f32, f32, 1, 1, False, True, M, N, False, v),
  "a bias gradient (sums over rows)": lambda v: reduce.reduce_spec("sum", bf16, f32, 1, 1, True, False, N, M, False, v),
}
ROW_SCALARS = {"cross-entropy forward": 3, "cross-entropy backward": 2, "cross-entropy backward from the logsumexp": 3,
               "row sums": 1, "a bias gradient (sums over rows)": 1}  # a reduction stores its sums as scalars


def _accesses(code: str) -> Counter:
  """Global loads and stores by width: ".v4"/".v2" vectors or "scalar"; a pipelined loop's asynchronous copies into
  shared memory count as ".v4" when they move 16 bytes (`cp.async ..., 0x10`) and as scalars otherwise."""
  moves = Counter(m.group(2) or "scalar" for m in re.finditer(r"(ld|st)\.global(?:\.\w+)*?(\.v[24])?\.b\d+", code))
  moves.update(".v4" if m.group(1) == "0x10" else "scalar"
               for m in re.finditer(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+)", code))
  return moves


@pytest.mark.parametrize("name", list(VARIANTS))
def test_aligned_rows_move_as_16_byte_vectors(name):
  vec, plain = _accesses(ptx(VARIANTS[name](True))), _accesses(ptx(VARIANTS[name](False)))
  assert plain[".v4"] == 0 and plain["scalar"] > 0, (name, plain)
  # a loss row's own scalars stay scalars: its target, picked logit and loss; its gradient and logsumexp
  assert vec[".v4"] > 0 and vec["scalar"] <= ROW_SCALARS.get(name, 0), (name, vec)


def test_reductions_take_the_vectors_variant_only_when_its_promise_holds():
  ok = lambda aligned=True, k=((768,), (1,)), r=((16384,), (768,)), chunk=16384: reduce._vectors(aligned, *k, *r, chunk)
  assert ok()  # GPT-2's bias gradient: sums over 16,384 rows of 768
  assert ok(k=((16384,), (768,)), r=((768,), (1,)), chunk=768)  # row sums
  assert not ok(aligned=False)  # a view starting off 16 bytes
  assert not ok(k=((770,), (1,)), r=((16384,), (770,)))  # rows of 770: every other row starts off 16 bytes
  assert not ok(chunk=1000)  # a split whose pieces start off 16 bytes
  assert not ok(k=((12, 64), (64, 1)), r=((16384,), (768,)))  # two kept dims: strided offsets
