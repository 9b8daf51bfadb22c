"""distrain: train PyTorch models on 1 process, N processes or N nodes — the strategy is one parameter."""

from distrain import compat
from distrain.callbacks import Callback, ModelCheckpoint, ProgressBar
from distrain.checkpoint.io import CheckpointError
from distrain.checkpoint.state import checkpoint_state_of
from distrain.config import RunConfig, build_config
from distrain.datamodule import DataModule
from distrain.distributed.watch import CollectiveHangError
from distrain.module import LossModule, Module
from distrain.parallel.pipeline_split import PipelineSplit
from distrain.runtime import Runtime, seed_everything
from distrain.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    PipelineStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from distrain.strategies.layers import wrap
from distrain.trainer import NonFiniteError, Trainer

__version__ = "0.1.0"

compat.quiet_torchao_import()  # before transformers (or distrain's fp8) imports it

__all__ = [
    "Trainer",
    "Module",
    "LossModule",
    "DataModule",
    "Runtime",
    "Strategy",
    "DDPStrategy",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "PipelineStrategy",
    "PipelineSplit",
    "SingleDeviceStrategy",
    "Callback",
    "ModelCheckpoint",
    "ProgressBar",
    "RunConfig",
    "build_config",
    "seed_everything",
    "wrap",
    "checkpoint_state_of",
    "CollectiveHangError",
    "NonFiniteError",
    "CheckpointError",
]
