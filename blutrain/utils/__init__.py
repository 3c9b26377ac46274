"""`torch.utils`'s names: `utils.data` (datasets, samplers, DataLoader)."""
from blutrain.utils import data

__all__ = ["data"]
