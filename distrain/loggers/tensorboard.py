"""TensorBoard event files through torch's SummaryWriter."""

from __future__ import annotations

from numbers import Number
from pathlib import Path
from typing import Any

from distrain.config import redacted
from distrain.loggers.base import Logger


class TensorBoardLogger(Logger):
    def __init__(self, save_dir: str, name: str = "tensorboard"):
        self.log_dir = Path(save_dir) / name
        self._writer = None

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        for name, value in metrics.items():
            if isinstance(value, Number) and not isinstance(value, bool):
                self.writer.add_scalar(name, value, step)

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        self.writer.add_histogram(name, values.detach().float().cpu(), step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        import yaml

        self.writer.add_text("config", "```\n" + yaml.safe_dump(redacted(params), sort_keys=False) + "\n```")

    def finalize(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __getstate__(self):
        return {**self.__dict__, "_writer": None}
