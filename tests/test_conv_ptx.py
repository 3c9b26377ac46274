"""Without a GPU: the channels-last variants of the convolution kernels, for bf16 and a ResNet 3x3 layer (64
channels, 56x56, batch 128), read their tiles 16 bytes at a time (cp.async or ld.global.v4), never a bf16 element at
a time as the general variants do, and pipeline them through more than one stage of shared memory feeding wgmma."""
import re

import pytest

from blutrain import dtypes
from blutrain.backend.cuda.kernels import conv
from tests.helpers import compiled

triton = pytest.importorskip("triton")

RESNET = {"fwd": (128 * 56 * 56, 64, 576), "dgrad": (128 * 56 * 56, 64, 576), "wgrad": (64, 576, 128 * 56 * 56)}
WIDE = r"cp\.async\.c[ag]\.shared\.global \[[^\]]+\], \[[^\]]+\], 0x10|ld\.global(?:\.\w+)*\.v4"


@pytest.mark.parametrize("kind", list(RESNET))
def test_channels_last_bf16_tiles_load_16_bytes_at_a_time_and_pipeline(kind):
  s = conv.conv_spec(kind, dtypes.bfloat16, *RESNET[kind], True, False, channels=64)
  k = compiled(s)
  ptx, c = k.asm["ptx"], s.constexprs
  assert re.search(WIDE, ptx) and not re.search(r"ld\.global(?:\.\w+)*\.b16\b", ptx), f"{kind}: scalar tile loads"
  assert "wgmma.mma_async" in ptx
  waits = [int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)]
  assert waits and max(waits) >= 1, f"{kind}: no copies left in flight across K steps ({waits})"
  stage = (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 2
  assert k.metadata.shared >= 2 * stage, f"{kind}: {k.metadata.shared} bytes of shared memory, one stage is {stage}"
