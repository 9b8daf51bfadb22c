from distrain.strategies.base import Strategy
from distrain.strategies.ddp import DDPStrategy
from distrain.strategies.deepspeed import DeepSpeedStrategy
from distrain.strategies.fsdp import FSDPStrategy
from distrain.strategies.registry import STRATEGIES, make_strategy
from distrain.strategies.single import SingleDeviceStrategy

__all__ = ["Strategy", "DDPStrategy", "DeepSpeedStrategy", "FSDPStrategy", "SingleDeviceStrategy", "STRATEGIES", "make_strategy"]
