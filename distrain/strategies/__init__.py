"""Parallel strategies, one file each; importing this package registers their names."""

from distrain.strategies.base import Strategy, TrainingPlan
from distrain.strategies.ddp import DDPStrategy
from distrain.strategies.deepspeed import DeepSpeedStrategy
from distrain.strategies.fsdp import FSDPStrategy
from distrain.strategies.model_parallel import ModelParallelStrategy
from distrain.strategies.pipeline import PipelineStrategy
from distrain.strategies.registry import make_strategy
from distrain.strategies.single import SingleDeviceStrategy

__all__ = [
    "Strategy",
    "TrainingPlan",
    "DDPStrategy",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "PipelineStrategy",
    "SingleDeviceStrategy",
    "make_strategy",
]
