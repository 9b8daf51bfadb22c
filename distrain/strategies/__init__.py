"""Parallel strategies, one file each. Importing this package imports every file in it, and each file
registers its names (``registry.register``): a new strategy is one new file."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

from distrain.strategies.base import LoopFacts, Strategy  # noqa: E402
from distrain.strategies.ddp import DDPStrategy  # noqa: E402
from distrain.strategies.deepspeed import DeepSpeedStrategy  # noqa: E402
from distrain.strategies.fsdp import FSDPStrategy  # noqa: E402
from distrain.strategies.model_parallel import ModelParallelStrategy  # noqa: E402
from distrain.strategies.pipeline import PipelineStrategy  # noqa: E402
from distrain.strategies.registry import make_strategy  # noqa: E402
from distrain.strategies.single import SingleDeviceStrategy  # noqa: E402

__all__ = [
    "Strategy",
    "LoopFacts",
    "DDPStrategy",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "PipelineStrategy",
    "SingleDeviceStrategy",
    "make_strategy",
]
