"""``lightning.pytorch.callbacks``: the stock callbacks distrain has, under Lightning's names."""

from distrain.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint, ProgressBar, Timer
from distrain.lightning._refuse import refusing

#: Lightning's progress bars: distrain draws its own, one line per logging step where the output is not a terminal
TQDMProgressBar = RichProgressBar = ProgressBar

__all__ = [
    "Callback",
    "EarlyStopping",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ProgressBar",
    "RichProgressBar",
    "TQDMProgressBar",
    "Timer",
]


__getattr__ = refusing(__name__)
