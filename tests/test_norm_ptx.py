"""Without a GPU: the layer-norm and cross-entropy kernels' variants for rows whose pointers, length and strides are
multiples of 16 (`vectors`, which the host takes whenever they are: GPT-2's rows of 768 and its 50,304 logits) load
and store whole rows as 16-byte vectors, where the others (nothing promised) read and write one element at a time."""
import re
from collections import Counter

import pytest

from blutrain import dtypes
from blutrain.backend.cuda.kernels import loss, norm
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
  "cross-entropy forward": lambda v: loss.ce_spec(False, bf16, dtypes.int64, True, M, 50304, False, f32, v),
  "cross-entropy backward": lambda v: loss.ce_spec(True, bf16, dtypes.int64, True, M, 50304, False, f32, v),
  "cross-entropy backward from the logsumexp": lambda v: loss.ce_lse_spec(True, bf16, dtypes.int64, True, M, 50304,
                                                                          False, f32, v),
}
ROW_SCALARS = {"cross-entropy forward": 3, "cross-entropy backward": 2, "cross-entropy backward from the logsumexp": 3}


def _accesses(code: str) -> Counter:
  return Counter(m.group(2) or "scalar" for m in re.finditer(r"(ld|st)\.global(?:\.\w+)*?(\.v[24])?\.b\d+", code))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_aligned_rows_move_as_16_byte_vectors(name):
  vec, plain = _accesses(ptx(VARIANTS[name](True))), _accesses(ptx(VARIANTS[name](False)))
  assert plain[".v4"] == 0 and plain["scalar"] > 0, (name, plain)
  # a loss row's own scalars stay scalars: its target, picked logit and loss; its gradient and logsumexp
  assert vec[".v4"] > 0 and vec["scalar"] <= ROW_SCALARS.get(name, 0), (name, vec)
