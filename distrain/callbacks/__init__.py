from distrain.callbacks.base import Callback
from distrain.callbacks.checkpoint import ModelCheckpoint
from distrain.callbacks.plot import PlotSummary
from distrain.callbacks.progress import ProgressBar

__all__ = ["Callback", "ModelCheckpoint", "PlotSummary", "ProgressBar"]
