"""Neural-network building blocks with `torch.nn`'s names: Module, Parameter, layers, losses, containers, and the
`functional`, `init` and `utils` submodules."""
from blutrain.nn import functional, init, parallel, utils
from blutrain.nn.container import ModuleDict, ModuleList, Sequential
from blutrain.nn.conv import (AdaptiveAvgPool1d, AdaptiveAvgPool2d, AvgPool1d, AvgPool2d, Conv1d, Conv2d, Conv3d,
                              ConvTranspose1d, ConvTranspose2d, ConvTranspose3d, MaxPool1d, MaxPool2d)
from blutrain.nn.layers import (CELU, ELU, GELU, SELU, Dropout, Embedding, Flatten, Hardsigmoid, Hardswish, Hardtanh,
                                Identity, LayerNorm, LeakyReLU, Linear, LogSigmoid, LogSoftmax, Mish, ReLU, ReLU6,
                                RMSNorm, Sigmoid, SiLU, Softmax, Softmin, Softplus, Softsign, Tanh, Unflatten)
from blutrain.nn.loss import (BCELoss, BCEWithLogitsLoss, CrossEntropyLoss, HuberLoss, KLDivLoss, L1Loss, MSELoss,
                              NLLLoss, SmoothL1Loss)
from blutrain.nn.module import Module, Parameter
from blutrain.nn.norm import BatchNorm1d, BatchNorm2d, BatchNorm3d, GroupNorm
from blutrain.nn.rnn import GRU, LSTM, MultiheadAttention

__all__ = ["Module", "Parameter", "Sequential", "ModuleList", "ModuleDict", "Identity", "Linear", "Embedding",
           "LayerNorm", "RMSNorm", "Dropout", "Flatten", "Unflatten", "GELU", "SiLU", "ReLU", "Tanh", "Sigmoid",
           "Softmax", "LogSoftmax", "Softmin", "LeakyReLU", "ELU", "CELU", "SELU", "Hardtanh", "ReLU6", "Hardsigmoid",
           "Hardswish", "Mish", "Softplus", "Softsign", "LogSigmoid", "L1Loss", "MSELoss", "SmoothL1Loss", "HuberLoss",
           "NLLLoss", "CrossEntropyLoss", "BCELoss", "BCEWithLogitsLoss", "KLDivLoss", "Conv1d", "Conv2d", "Conv3d",
           "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "MaxPool1d", "MaxPool2d", "AvgPool1d", "AvgPool2d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d",
           "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "GroupNorm", "LSTM", "GRU", "MultiheadAttention", "functional",
           "init", "parallel", "utils"]
