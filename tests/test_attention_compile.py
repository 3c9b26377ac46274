"""The CUDA flash-attention kernels compile for sm_90 on the CPU (Triton as a compiler only), fit the H100/H200's
shared memory, and their host-side layout helpers handle GPT-2's strided q/k/v."""
import pytest

pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
import triton  # noqa: E402

from blutrain import dtypes  # noqa: E402
from blutrain.backend.cuda.array import CudaArray  # noqa: E402
from blutrain.backend.cuda.kernels import aligned  # noqa: E402
from blutrain.backend.cuda.kernels import attention  # noqa: E402

SHARED_OPTIN = 232448  # bytes of shared memory a block may opt in to on sm_90


def _name(s) -> str:
  fn, _, consts, opts = s
  return f"{fn.__name__}-" + "-".join(f"{k}={v}" for k, v in consts.items()) + f"-w{opts['num_warps']}s{opts['num_stages']}"


@pytest.mark.parametrize("s", attention.SPECS, ids=_name)
def test_kernel_compiles_for_sm90(s):
  fn, signature, constexprs, options = s
  sig = {k: v.partition(":")[0] for k, v in signature.items()}
  attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items() if v.endswith(":16")}
  k = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32), options=options)
  assert k.asm["cubin"], f"{_name(s)}: no cubin"
  assert k.metadata.shared <= SHARED_OPTIN, f"{_name(s)}: {k.metadata.shared} bytes of shared memory"
  assert "mma" in k.asm["ptx"], f"{_name(s)}: no tensor-core instructions in the PTX"


def test_every_kernel_dtype_and_masking_is_in_specs():
  seen = {(s[0].__name__, s[2]["CAUSAL"], s[2]["PRECISION"]) for s in attention.SPECS}
  for fn in ("_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv"):
    assert {(fn, True, "tf32"), (fn, False, "tf32"), (fn, True, "tf32x3")} <= seen


def _arr(shape, strides, ptr=1 << 20):
  return CudaArray(ptr, shape, strides, dtypes.bfloat16, 0, None)


def test_batch_dims_of_gpt2_qkv_views():
  B, T, H, D = 2, 16, 3, 8
  q = _arr((B, H, T, D), (T * 3 * H * D, D, 3 * H * D, 1))  # qkv.split(C, 2)[0].view(B, T, H, D).transpose(1, 2)
  assert attention._batch(q, 2) == ((B, H), (T * 3 * H * D, D))
  assert attention._batch(_arr((T, D), (D, 1)), 0) == ((1, 1), (0, 0))
  assert attention._batch(_arr((5, T, D), (T * D, D, 1)), 1) == ((1, 5), (0, T * D))
  assert attention._batch(_arr((2, 3, 4, T, D), (12 * T * D, 4 * T * D, T * D, D, 1)), 3) == ((6, 4), (4 * T * D, T * D))
  assert attention._batch(_arr((2, 3, 4, T, D), (4 * T * D, 8 * T * D, T * D, D, 1)), 3) is None  # permuted: copy


def test_variant_choice():
  s = attention.attention_spec("fwd", dtypes.bfloat16, 64, True)
  assert s[2]["EVEN_D"] and s[2]["BLOCK_D"] == 64 and s[1]["Q"] == "*bf16:16" and s[1]["sqm"] == "i32:16"
  s = attention.attention_spec("dkdv", dtypes.float32, 40, False, "tf32x3", aligned=False)
  assert not s[2]["EVEN_D"] and s[2]["BLOCK_D"] == 64 and s[1]["K"] == "*fp32" and s[1]["sdn"] == "i32"
  assert aligned([_arr((4,), (1,))], (16, 32)) and not aligned([_arr((4,), (1,), 2 + (1 << 20))], ())
  assert not aligned([_arr((4,), (1,))], (16, 40))
