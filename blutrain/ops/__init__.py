"""The op library: every primitive once (shape/dtype rule, VJP, name), composites over them."""
from blutrain.ops.core import (Op, registry, apply, is_grad_enabled, set_grad_enabled, no_grad, enable_grad, dynamic_scalar)
from blutrain.shapes import broadcast_shapes
from blutrain.ops.creation import (full, zeros, ones, empty, full_like, zeros_like, ones_like, empty_like, arange,
                                   linspace, eye, tensor, as_tensor, from_numpy, from_dlpack, as_tensor_like, to_device,
                                   Generator, default_generator, manual_seed, rand, randn, randint, bernoulli_mask,
                                   rand_like, randn_like, inplace)
from blutrain.ops.elementwise import (neg, exp, log, sqrt, rsqrt, abs, sin, cos, tanh, sigmoid, relu, erf, floor, gelu,
                                      silu, sign, square, reciprocal, add, sub, mul, div, pow, maximum, minimum, eq, ne,
                                      lt, le, gt, ge, logical_and, logical_or, logical_xor, logical_not, isnan, isfinite,
                                      where, cast, copy, clamp, clip, masked_fill, lerp, operands)
from blutrain.ops.reduce import (sum, mean, var, std, amax, amin, argmax, argmin, max, min, logsumexp, cumsum, all, any,
                                 sum_to)
from blutrain.ops.movement import (view, reshape, permute, transpose, expand, narrow, squeeze, unsqueeze, flatten,
                                   unflatten, split, chunk, unbind, repeat, cat, stack, getitem, setitem, nonzero)
from blutrain.ops.linalg import matmul
from blutrain.ops.nn import (softmax, log_softmax, layer_norm, rms_norm, gather, scatter_add, index_select, embedding,
                             one_hot, cross_entropy, nll_loss, mse_loss, dropout, tril, triu, linear,
                             scaled_dot_product_attention)
from blutrain.ops import elementwise
