"""TensorBoard event files through torch's SummaryWriter."""

from __future__ import annotations

import warnings
from numbers import Number
from pathlib import Path
from typing import Any

from distrain.config import redacted
from distrain.loggers.base import Logger, yaml_plain


class TensorBoardLogger(Logger):
    """Event files in ``save_dir/name`` (``/version`` when one is given). ``log_graph``: the module's graph, from
    its ``example_input_array``, when fit starts. ``experiment`` is torch's ``SummaryWriter`` (on rank 0)."""

    def __init__(
        self, save_dir: str, name: str = "tensorboard", version: int | str | None = None, log_graph: bool = False
    ):
        self.save_dir, self.name, self.version = str(save_dir), name, version
        self.log_dir = Path(save_dir) / name
        if version is not None:
            self.log_dir = self.log_dir / (version if isinstance(version, str) else f"version_{version}")
        self._log_graph = log_graph  # Lightning's names: tutorials set them on trainer.logger
        self._default_hp_metric = None
        self._writer = None
        self._writer_kwargs: dict[str, Any] = {}  # SummaryWriter's own keywords (Lightning's TensorBoardLogger)

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir), **self._writer_kwargs)
        return self._writer

    def _experiment(self):
        return self.writer

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """The graph ``model`` traces on ``input_array`` (default: its ``example_input_array``), with ``log_graph``
        on (fit calls it when it starts); as Lightning's, nothing otherwise."""
        if not self._log_graph:
            return
        if input_array is None:
            input_array = getattr(model, "example_input_array", None)
        if input_array is None:
            warnings.warn(
                "distrain: log_graph needs an input: pass input_array or set example_input_array", stacklevel=2
            )
            return
        self.writer.add_graph(model, input_array)

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        for name, value in metrics.items():
            if isinstance(value, Number) and not isinstance(value, bool):
                self.writer.add_scalar(name, value, step)

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        self.writer.add_histogram(name, values.detach().float().cpu(), step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        import yaml

        text = yaml.safe_dump(yaml_plain(redacted(params)), sort_keys=False)
        self.writer.add_text("config", "```\n" + text + "\n```")

    def finalize(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __getstate__(self):
        return {**self.__dict__, "_writer": None}
