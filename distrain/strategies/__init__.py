"""Parallel strategies, one file each; importing this package registers their names."""

from distrain.strategies.base import Strategy, TrainingPlan
from distrain.strategies.ddp import DDPStrategy
from distrain.strategies.deepspeed import DeepSpeedStrategy
from distrain.strategies.fsdp import FSDPStrategy
from distrain.strategies.registry import make_strategy
from distrain.strategies.single import SingleDeviceStrategy

__all__ = [
    "Strategy",
    "TrainingPlan",
    "DDPStrategy",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "SingleDeviceStrategy",
    "make_strategy",
]
