"""One declaration per op: the registry of blutrain.ops is the vocabulary, and every table keyed by op name (each
backend's kernels, autocast's policy; Nova's dialect has its own test) is held to it."""
import pytest

from blutrain import amp
from blutrain.backend.cpu.kernels import kernels as cpu_kernels
from blutrain.ops import registry

VIEWS = {name for name, o in registry.items() if o.view is not None}  # made by striding: no kernel anywhere
# composites that PyTorch's autocast lists and that consult the policy themselves (ops.nn.linear, attention)
AUTOCAST_COMPOSITES = {"linear", "scaled_dot_product_attention"}


def test_views_are_the_layout_ops():
  assert VIEWS == {"view", "permute", "expand", "slice"}


@pytest.mark.parametrize("backend", ["cpu", "cuda"], ids=["cpu backend", "cuda backend"])  # not the `cuda` marker
def test_every_primitive_has_one_kernel_per_backend(backend):
  if backend == "cpu": table = cpu_kernels
  else:
    cuda = pytest.importorskip("blutrain.backend.cuda", reason="the CUDA backend's packages are not installed")
    table = cuda.kernels
  missing, unknown = set(registry) - VIEWS - set(table), set(table) - set(registry)
  assert not missing, f"ops without a {backend} kernel: {sorted(missing)}"
  assert not unknown, f"{backend} kernels of no op in blutrain.ops.registry: {sorted(unknown)}"
  assert not VIEWS & set(table), f"view ops never run a kernel: {sorted(VIEWS & set(table))}"


def test_autocast_policy_names_ops():
  for device, table in amp.POLICY.items():
    unknown = set(table) - set(registry) - AUTOCAST_COMPOSITES
    assert not unknown, f"autocast's {device} policy names no op: {sorted(unknown)}"
    assert set(table.values()) <= {amp.LOWER, amp.FP32}


def test_signatures_are_well_formed():
  kinds = {"int", "bool", "float", "num", "str", "dtype", "ints", "index", "device"}
  for name, o in registry.items():
    assert all(a.kind in kinds for a in o.attrs), name
    assert len({a.name for a in o.attrs}) == len(o.attrs), f"{name}: an attribute declared twice"
    names = [i.lstrip("?*") for i in o.inputs]
    assert len(set(names)) == len(names), f"{name}: an operand declared twice"
    assert not (o.multi and o.vjp), f"{name}: multi-output primitives have no VJP"
