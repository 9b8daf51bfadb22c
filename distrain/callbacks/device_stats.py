"""The devices' statistics beside the training curves: Lightning's ``DeviceStatsMonitor``."""

from __future__ import annotations

from typing import Any

import torch

from distrain.callbacks.base import Callback


def cpu_stats() -> dict[str, float]:
    """The host's memory, CPU and swap use, in percent (Lightning's names)."""
    import psutil

    return {
        "cpu_vm_percent": psutil.virtual_memory().percent,
        "cpu_percent": psutil.cpu_percent(),
        "cpu_swap_percent": psutil.swap_memory().percent,
    }


class DeviceStatsMonitor(Callback):
    """At the start and end of each training, validation and test batch of a logging step (every
    ``log_every_n_steps``), rank 0's device statistics go to the loggers under
    ``DeviceStatsMonitor.<hook>/<stat>``: CUDA's memory statistics (``torch.cuda.memory_stats``) on a GPU, the host's
    CPU, memory and swap use on a CPU; ``cpu_stats`` True adds the host's on a GPU, False drops them on a CPU."""

    def __init__(self, cpu_stats: bool | None = None) -> None:
        self._cpu_stats = cpu_stats

    def setup(self, trainer, module, stage: str) -> None:
        if stage == "fit" and not trainer.loggers:
            raise ValueError("Cannot use `DeviceStatsMonitor` callback with `Trainer(logger=False)`.")

    def _log(self, trainer, key: str, stepped: bool = False) -> None:
        """``stepped``: the batch's optimizer step is counted already (the end of a training batch)."""
        step = trainer.global_step + (0 if stepped else 1)  # the optimizer step this batch counts towards
        if not trainer.is_global_zero or step % trainer.log_every_n_steps:
            return  # the loggers write rank 0's, on logging steps
        device = trainer.strategy.root_device
        if device.type == "cpu" and self._cpu_stats is False:
            return
        stats: dict[str, Any] = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
        if device.type == "cpu" or self._cpu_stats:
            stats.update(cpu_stats())
        prefix = f"{type(self).__qualname__}.{key}"
        for logger in trainer.loggers:
            separator = getattr(logger, "group_separator", "/")
            logger.log_metrics(
                {f"{prefix}{separator}{name}": value for name, value in stats.items()}, step - 1
            )  # Lightning's step for it: the optimizer steps taken before this batch's

    def on_train_batch_start(self, trainer, module, batch: Any, batch_idx: int) -> None:
        self._log(trainer, "on_train_batch_start")

    def on_train_batch_end(self, trainer, module, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._log(trainer, "on_train_batch_end", stepped=True)

    def on_validation_batch_start(self, trainer, module, batch: Any, batch_idx: int) -> None:
        self._log(trainer, "on_validation_batch_start")

    def on_validation_batch_end(self, trainer, module, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._log(trainer, "on_validation_batch_end")

    def on_test_batch_start(self, trainer, module, batch: Any, batch_idx: int) -> None:
        self._log(trainer, "on_test_batch_start")

    def on_test_batch_end(self, trainer, module, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._log(trainer, "on_test_batch_end")
