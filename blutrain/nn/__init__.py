"""Neural-network building blocks with `torch.nn`'s names: Module, Parameter, layers, containers, and the
`functional`, `init` and `utils` submodules."""
from blutrain.nn import functional, init, parallel, utils
from blutrain.nn.container import ModuleDict, ModuleList, Sequential
from blutrain.nn.layers import (GELU, Dropout, Embedding, Identity, LayerNorm, Linear, ReLU, RMSNorm, Sigmoid, SiLU,
                                Tanh)
from blutrain.nn.module import Module, Parameter

__all__ = ["Module", "Parameter", "Sequential", "ModuleList", "ModuleDict", "Identity", "Linear", "Embedding",
           "LayerNorm", "RMSNorm", "Dropout", "GELU", "SiLU", "ReLU", "Tanh", "Sigmoid", "functional", "init", "parallel", "utils"]
