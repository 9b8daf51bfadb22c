"""Lightning's ``Trainer`` arguments beyond the loop's: those distrain does not run, the keywords that are neither
the Trainer's nor the strategy's, and torch's process-wide flags.

Each keyword is taken or refused in one line before anything starts; none is dropped without a word (an option of
the multi-process strategies was, on one process; a typo went on to DistributedDataParallel and failed in the
ranks)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

#: Lightning ``Trainer`` arguments distrain does not run: the value that means "not used" (accepted), and what to
#: do instead of any other
NOT_RUN: dict[str, tuple[Any, str]] = {
    "overfit_batches": (0, "train and validate on a fixed subset instead: a Subset of your dataset"),
    "reload_dataloaders_every_n_epochs": (0, "the loaders are made once per stage; make an epoch-dependent dataset"),
    "profiler": (None, "run torch.profiler around fit, or in a callback's on_train_batch_start/end"),
    "barebones": (False, "turn off what you do not want: logger=False, enable_checkpointing=False, ..."),
    "plugins": (None, "precision and cluster environments are arguments here: precision=, and the launcher"),
    "model_registry": (None, "upload the checkpoint or its export (`distrain convert`) yourself"),
    "sync_batchnorm": (False, "convert the model yourself: torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)"),
}


def check_keywords(strategy: Any, keywords: dict[str, Any], trainer_arguments: set[str]) -> None:
    """``keywords`` are Lightning arguments distrain runs without (at their "not used" value) or options of the
    strategy (``auto``: of any strategy it may choose). Anything else is a ValueError naming it, with the Trainer
    argument or option it may have meant."""
    from distrain.strategies.registry import check_options

    for key, value in keywords.items():
        if key in NOT_RUN:
            unused, instead = NOT_RUN[key]
            if value != unused:
                raise ValueError(f"Trainer({key}={value!r}): distrain does not run Lightning's {key}; {instead}")
    check_options(strategy, [k for k in keywords if k not in NOT_RUN], also_meant=trainer_arguments)


@dataclass(frozen=True)
class ProcessSettings:
    """Lightning's process-wide torch flags, set in each rank when a stage starts: ``deterministic`` (True, "warn"
    or False: ``torch.use_deterministic_algorithms``; None leaves it), ``benchmark`` (cuDNN's autotuner; None: off
    when deterministic, else left) and ``detect_anomaly`` (autograd's anomaly mode)."""

    deterministic: bool | str | None = None
    benchmark: bool | None = None
    detect_anomaly: bool = False

    def __post_init__(self):
        if self.deterministic not in (None, True, False, "warn"):
            raise ValueError(f"deterministic is True, False, 'warn' or None, got {self.deterministic!r}")
        if self.deterministic:  # cuBLAS is deterministic only with a fixed workspace (torch's reproducibility notes)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    def apply(self) -> None:
        if self.deterministic is not None:
            torch.use_deterministic_algorithms(bool(self.deterministic), warn_only=self.deterministic == "warn")
        benchmark = False if self.benchmark is None and self.deterministic else self.benchmark
        if benchmark is not None:
            torch.backends.cudnn.benchmark = benchmark
        if self.detect_anomaly:
            torch.autograd.set_detect_anomaly(True)
