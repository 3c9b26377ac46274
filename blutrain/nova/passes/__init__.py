"""Nova's passes over a `nova` module, each a named xDSL `ModulePass` (the name labels its IR dump):

  canonicalize   algebraic identities and view/permute/expand/cast chain folding    (canonicalize.py)
  fold           ops of splats (`nova.full`) into splats                            (fold.py)
  cse            one op per distinct computation                                    (cse.py)
  dce            drop unused ops                                                    (dce.py)
  fuse-casts     autocast's casts folded into the kernels around them               (fuse_casts.py)
  fuse-gemm      biases, GELUs, residuals and GELU backwards folded into GEMMs      (fuse_gemm.py)
  fuse-bias-grads the GPU's bias gradients summed by the kernels writing their input (fuse_gemm.py)
  fuse-wgrad     the GPU's weight gradients: float32 stores and bias gradients      (fuse_gemm.py)
  fuse-norms     residual adds folded into the layer norms and their backward       (fuse_norms.py)
  fuse-pointwise groups of elementwise ops into one synthesized kernel each          (fuse_pointwise.py)
"""
from blutrain.nova.passes.base import NovaPass, PatternPass
from blutrain.nova.passes.canonicalize import CanonicalizePass
from blutrain.nova.passes.cse import CSEPass
from blutrain.nova.passes.dce import DCEPass
from blutrain.nova.passes.fold import FoldPass
from blutrain.nova.passes.fuse_casts import FuseCastsPass
from blutrain.nova.passes.fuse_gemm import FuseBiasGradientsPass, FuseGemmPass, FuseWeightGradientsPass
from blutrain.nova.passes.fuse_norms import FuseNormsPass
from blutrain.nova.passes.fuse_pointwise import FusePointwisePass

PASSES: dict[str, type[NovaPass]] = {p.name: p for p in (CanonicalizePass, FoldPass, FuseCastsPass, FuseGemmPass,
                                                         CSEPass, DCEPass, FuseNormsPass, FuseBiasGradientsPass,
                                                         FuseWeightGradientsPass, FusePointwisePass)}
