from distrain.callbacks.base import Callback
from distrain.callbacks.checkpoint import ModelCheckpoint
from distrain.callbacks.device_stats import DeviceStatsMonitor
from distrain.callbacks.early_stopping import EarlyStopping
from distrain.callbacks.lr_finder import LearningRateFinder
from distrain.callbacks.lr_monitor import LearningRateMonitor
from distrain.callbacks.plot import PlotSummary
from distrain.callbacks.prediction_writer import BasePredictionWriter
from distrain.callbacks.progress import ProgressBar
from distrain.callbacks.timer import Timer
from distrain.callbacks.weight_averaging import EMAWeightAveraging, StochasticWeightAveraging, WeightAveraging

__all__ = [
    "BasePredictionWriter",
    "Callback",
    "DeviceStatsMonitor",
    "EMAWeightAveraging",
    "EarlyStopping",
    "LearningRateFinder",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "PlotSummary",
    "ProgressBar",
    "StochasticWeightAveraging",
    "Timer",
    "WeightAveraging",
]
