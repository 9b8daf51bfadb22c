"""distrain: train PyTorch models on 1 process, N processes or N nodes — the strategy is one parameter.

The public names below are imported on first use (PEP 562): ``import distrain`` — and so ``distrain --help``,
``distrain config`` — does not import torch. ``distrain.Trainer``, ``from distrain import Trainer`` and
``distrain.strategies`` (any submodule) work as if they had been imported here.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from typing import TYPE_CHECKING

from distrain import config as _config
from distrain._version import __version__ as __version__

#: public name → the module that defines it
_EXPORTS = {
    "Trainer": "distrain.trainer",
    "Module": "distrain.module",
    "LossModule": "distrain.module",
    "DataModule": "distrain.datamodule",
    "LightningModule": "distrain.lightning.core",  # `import lightning as L` → `import distrain as L`: L.LightningModule
    "LightningDataModule": "distrain.lightning.core",
    "Runtime": "distrain.runtime",
    "Strategy": "distrain.strategies",
    "DDPStrategy": "distrain.strategies",
    "DeepSpeedStrategy": "distrain.strategies",
    "FSDPStrategy": "distrain.strategies",
    "ModelParallelStrategy": "distrain.strategies",
    "PipelineStrategy": "distrain.strategies",
    "PipelineSplit": "distrain.parallel.pipeline_split",
    "SingleDeviceStrategy": "distrain.strategies",
    "Callback": "distrain.callbacks",
    "ModelCheckpoint": "distrain.callbacks",
    "EarlyStopping": "distrain.callbacks",
    "ProgressBar": "distrain.callbacks",
    "RunConfig": "distrain.config",
    "build_config": "distrain.config",
    "seed_everything": "distrain.runtime",
    "wrap": "distrain.strategies.layers",
    "checkpoint_state_of": "distrain.checkpoint.state",
    "CollectiveHangError": "distrain.distributed.watch",
    "NonFiniteError": "distrain.training.nonfinite",
    "CheckpointError": "distrain.checkpoint.io",
}

__all__ = [
    "Trainer",
    "Module",
    "LossModule",
    "DataModule",
    "LightningModule",
    "LightningDataModule",
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
    "EarlyStopping",
    "ProgressBar",
    "RunConfig",
    "build_config",
    "seed_everything",
    "wrap",
    "checkpoint_state_of",
    "CollectiveHangError",
    "NonFiniteError",
    "CheckpointError",
]  # = _EXPORTS' names (tests/test_cli_front_door.py checks)

if TYPE_CHECKING:  # what the names are, for type checkers and IDEs (nothing is imported at run time)
    from distrain.callbacks import Callback, EarlyStopping, ModelCheckpoint, ProgressBar
    from distrain.checkpoint.io import CheckpointError
    from distrain.checkpoint.state import checkpoint_state_of
    from distrain.config import RunConfig, build_config
    from distrain.datamodule import DataModule
    from distrain.distributed.watch import CollectiveHangError
    from distrain.lightning.core import LightningDataModule, LightningModule
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
    from distrain.trainer import Trainer
    from distrain.training.nonfinite import NonFiniteError


def __getattr__(name: str):
    """A public name (``_EXPORTS``) or a submodule, imported the first time it is asked for."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name == "pytorch":  # `import lightning as L` → `import distrain as L`: L.pytorch is Lightning's namespace
        value = importlib.import_module(f"{__name__}.lightning")
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _strategy_checks(config) -> None:
    """Every config built is checked by the strategies' files too: ``registry.validate_config``, which
    ``config.CHECKS`` gets when ``distrain.strategies.registry`` is imported (config.py knows no strategy). Its checks
    import the strategies, which need torch, so it happens here, when the first config is validated, rather than with
    the package: ``validate``'s loop over ``CHECKS`` then reaches the check it appended, right after this one."""
    if "distrain.strategies.registry" not in sys.modules:
        importlib.import_module("distrain.strategies.registry")


_config.CHECKS.insert(0, _strategy_checks)


class _QuietImportNoise(logging.Filter):
    """``compat.DropImportNoise`` (torchao's import noise on a CPU build of torch), imported only when torchao or
    torch's pytree logs something: torch is loaded by then, and ``import distrain`` stays free of it."""

    def filter(self, record: logging.LogRecord) -> bool:
        from distrain.compat import DropImportNoise

        return DropImportNoise().filter(record)


for _name in ("torchao", "torch.utils._pytree"):  # before transformers (or distrain's fp8) imports torchao
    logging.getLogger(_name).addFilter(_QuietImportNoise())
