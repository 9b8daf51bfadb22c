"""``lightning.pytorch.utilities.types``: the type names Lightning code annotates its hooks with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

STEP_OUTPUT = Tensor | Mapping[str, Any] | None
TRAIN_DATALOADERS = Any
EVAL_DATALOADERS = Any
LRSchedulerTypeUnion = LRScheduler | ReduceLROnPlateau
LRSchedulerPLType = LRSchedulerTypeUnion
#: what ``configure_optimizers`` may return (``training/optimizers.py`` reads every form)
OptimizerLRScheduler = Optimizer | list | tuple | dict | None
