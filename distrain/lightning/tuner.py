"""``lightning.pytorch.tuner``: Lightning's ``Tuner`` (``lr_find``; ``scale_batch_size`` is refused, naming the
planner)."""

from distrain.callbacks.lr_finder import LRFinder as _LRFinder
from distrain.lightning._refuse import refusing
from distrain.tuner import Tuner

__all__ = ["Tuner", "_LRFinder"]

__getattr__ = refusing(__name__)
