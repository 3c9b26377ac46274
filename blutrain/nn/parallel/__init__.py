"""Data parallelism, as torch.nn.parallel."""
from blutrain.nn.parallel.distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
