"""Without a GPU: the kernels that Nova's fuse-norms pass calls add the residual gradient and scale the clipped
gradient with PTX's explicitly rounded add.rn / mul.rn (never contracted into an FMA, never flushing subnormals), so
they compute the bits of the separate add and scale kernels; the variants without the fusion have none."""
import re

import pytest

from blutrain import dtypes
from blutrain.backend.cuda.kernels import norm, optim
from tests.helpers import ptx as _ptx

triton = pytest.importorskip("triton")
f32, bf16 = dtypes.float32, dtypes.bfloat16


@pytest.mark.parametrize("fused, plain, instruction", [
  (norm.layer_norm_backward_spec(f32, bf16, f32, True, 1 << 14, 768, False, f32),
   norm.layer_norm_backward_spec(f32, bf16, f32, True, 1 << 14, 768, False), "add"),
  (optim.adamw_spec(f32, f32, True, True, True), optim.adamw_spec(f32, f32, True, True, False), "mul")],
  ids=["layer_norm_backward_residual", "adamw_clip"])
def test_fused_arithmetic_is_explicitly_rounded_ieee(fused, plain, instruction):
  ptx, base = _ptx(fused), _ptx(plain)  # libdevice's add_rn / mul_rn would read add.rn.ftz.f32 / mul.rn.ftz.f32
  explicit = rf"\b{instruction}\.rn\.f32\b"
  assert len(re.findall(explicit, ptx)) > len(re.findall(explicit, base))
