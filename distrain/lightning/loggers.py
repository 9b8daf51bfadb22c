"""``lightning.pytorch.loggers``: distrain's loggers, with Lightning's ``experiment``, ``log_graph``, ``save_dir`` and
``log_dir``; ``CSVLogger`` writes Lightning's ``metrics.csv`` and ``hparams.yaml``; ``Logger`` is the base of all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distrain.lightning._refuse import refusing
from distrain.loggers import CSVLogger, Logger, MLFlowLogger, WandbLogger
from distrain.loggers import TensorBoardLogger as _TensorBoardLogger
from distrain.loggers.base import DummyExperiment
from distrain.run_dir import next_version

__all__ = ["CSVLogger", "DummyExperiment", "Logger", "MLFlowLogger", "TensorBoardLogger", "WandbLogger"]


class TensorBoardLogger(_TensorBoardLogger):
    """Lightning's: event files in ``save_dir/name/version_N`` (``name`` "lightning_logs"; ``version`` None: the next
    free one, read as the logger is made), ``sub_dir`` below it; metric names after ``prefix-``; any other keyword goes
    to TensorBoard's ``SummaryWriter``. ``default_hp_metric`` is accepted (no ``hp_metric`` placeholder is written)."""

    def __init__(
        self,
        save_dir: str | Path,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        log_graph: bool = False,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: str | Path | None = None,
        **kwargs: Any,
    ):
        name = name or ""
        super().__init__(save_dir, name, next_version(Path(save_dir) / name) if version is None else version, log_graph)
        if sub_dir is not None:
            self.log_dir = self.log_dir / sub_dir
        self.prefix, self._writer_kwargs = prefix, kwargs

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        join = f"{self.prefix}-" if self.prefix else ""
        super().log_metrics({join + name: value for name, value in metrics.items()}, step)


__getattr__ = refusing(__name__)
