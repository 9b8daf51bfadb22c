"""``lightning.pytorch.strategies``: distrain's strategies. Lightning's strategy names (``"ddp_spawn"``,
``"ddp_find_unused_parameters_true"``, ``"fsdp_cpu_offload"``, the DeepSpeed presets ...) are taken by
``Trainer(strategy=...)`` itself."""

from distrain.lightning._refuse import refusing
from distrain.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)

__all__ = [
    "DDPStrategy",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "SingleDeviceStrategy",
    "Strategy",
]


__getattr__ = refusing(__name__)
