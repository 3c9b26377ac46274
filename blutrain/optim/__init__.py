"""Optimizers with `torch.optim`'s names and update formulas, and learning-rate schedules (`optim.lr_scheduler`)."""
from blutrain.optim import lr_scheduler
from blutrain.optim.adam import Adam, AdamW
from blutrain.optim.optimizer import Optimizer
from blutrain.optim.adaptive import Adagrad, RMSprop
from blutrain.optim.sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "lr_scheduler"]
