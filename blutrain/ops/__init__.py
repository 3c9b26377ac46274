"""The op library: every primitive once (signature, shape/dtype rule, VJP, name), composites over them.

Modules build on each other in this order, each importing only those before it: core (Op, apply), creation,
random, elementwise, reduce, movement, linalg, nn, ordering, optim (multi-tensor ops), collective (all_reduce,
reduce_scatter, all_gather over a process group), inplace; methods gives Tensor its methods from all of them.
A VJP that needs an op of a later module reaches it through a tensor method.

Names: a primitive's `Op` object is `<name>_op` (`add_op`, `layer_norm_backward_op`); the public function of the same
name (`add`, `layer_norm`) converts and checks its arguments and calls it. The string name is the same in the registry,
the backends' kernel tables and Nova's dialect (`nova.add`).
"""
from blutrain.autograd.tape import enable_grad, inference_mode, is_grad_enabled, no_grad, set_grad_enabled
from blutrain.ops import collective, methods
from blutrain.ops.core import Op, apply, dynamic_scalar, registry
from blutrain.ops.creation import (arange, as_tensor, as_tensor_like, empty, empty_like, eye, from_dlpack, from_numpy,
                                   full, full_like, linspace, ones, ones_like, tensor, to_device, zeros, zeros_like)
from blutrain.ops.elementwise import (abs, acos, acosh, add, allclose, asin, asinh, atan, atan2, atanh, bitwise_and,
                                      bitwise_left_shift, bitwise_not, bitwise_or, bitwise_right_shift, bitwise_xor,
                                      cast, ceil, clamp, clip, copy, copysign, cos, cosh, div, eq, equal, erf, exp,
                                      exp2, expm1, floor, floor_divide, fmod, ge, gelu, gt, isclose, isfinite, isinf,
                                      isnan, le, lerp, log, log10, log1p, log2, logaddexp, logical_and, logical_not,
                                      logical_or, logical_xor, lt, masked_fill, maximum, minimum, mul, ne, neg,
                                      operands, pow, reciprocal, relu, remainder, round, rsqrt, sigmoid, sign, silu,
                                      sin, sinh, sqrt, square, sub, tan, tanh, trunc, where)
from blutrain.ops.inplace import inplace, setitem
from blutrain.ops.linalg import bmm, einsum, matmul, mm, outer
from blutrain.ops.movement import (cat, chunk, diag, diagonal, expand, flatten, flip, getitem, masked_select, narrow,
                                   nonzero, permute, repeat, repeat_interleave, reshape, roll, split, squeeze, stack,
                                   transpose, unbind, unflatten, unfold, unsqueeze, view)
from blutrain.ops.nn import (conv, conv_transpose, cross_entropy, embedding, gather, gru_cell, gru_sequence, index_select,
                             layer_norm, linear, log_softmax, lstm_cell, lstm_sequence, mse_loss, nll_loss, one_hot,
                             rms_norm, scaled_dot_product_attention, scatter, scatter_add, scatter_reduce, softmax, tril,
                             triu)
from blutrain.ops.optim import adamw_, scale_, sgd_, sum_squares
from blutrain.ops.ordering import argsort, cummax, cummin, kthvalue, msort, multinomial, randperm, sort, topk
from blutrain.ops.random import (bernoulli, bernoulli_mask, default_generator, dropout, Generator, manual_seed, normal, rand,
                                 rand_like, randint, randn, randn_like)
from blutrain.ops.reduce import (all, amax, amin, any, argmax, argmin, cumprod, cumsum, logcumsumexp, logsumexp, max,
                                 mean, min, norm, prod, std, sum, sum_to, var)
from blutrain.shapes import Size, broadcast_shapes

methods.attach()
