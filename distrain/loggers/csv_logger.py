"""Lightning's CSV logger, file for file: ``metrics.csv`` (a header of every key logged so far, sorted; one row per
logged step, empty where a step did not log a key) and ``hparams.yaml`` in ``save_dir/name/version_N``, N counting up
from the versions already there, so that a tutorial's ``pd.read_csv(f"{trainer.logger.log_dir}/metrics.csv")`` reads
what Lightning's would have written."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from distrain.config import redacted
from distrain.loggers.base import Logger, yaml_plain
from distrain.run_dir import next_version


class CSVLogger(Logger):
    """``CSVLogger(save_dir, name="lightning_logs", version=None, prefix="", flush_logs_every_n_steps=100)``.
    ``version``: an int (``version_3``), a folder name, or None for one more than the highest ``version_N`` there
    (read once, as the logger is made: every rank makes it before any writes, so all name the same folder). Rows are
    kept in memory and written every ``flush_logs_every_n_steps`` steps and at the end; a key first logged late
    rewrites the file under the wider header, as Lightning's does."""

    def __init__(
        self,
        save_dir: str | os.PathLike,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ):
        if not isinstance(flush_logs_every_n_steps, int) or flush_logs_every_n_steps < 1:
            raise ValueError(
                f"CSVLogger: flush_logs_every_n_steps must be an int >= 1, got {flush_logs_every_n_steps!r}"
            )
        self.save_dir, self.name, self.prefix = os.fspath(save_dir), name or "", prefix
        self.flush_logs_every_n_steps = flush_logs_every_n_steps
        root = Path(self.save_dir) / self.name
        self.version = next_version(root) if version is None else version
        self.log_dir = str(root / (self.version if isinstance(self.version, str) else f"version_{self.version}"))
        self.metrics_file = Path(self.log_dir) / "metrics.csv"
        self._rows: list[dict[str, Any]] = []  # logged, not yet written
        self._keys: list[str] = []  # the header: every key written so far, sorted
        self._hparams: dict[str, Any] = {}

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        join = f"{self.prefix}-" if self.prefix else ""
        self._rows.append({**{join + k: _cell(v) for k, v in metrics.items()}, "step": step})
        if (step + 1) % self.flush_logs_every_n_steps == 0:
            self.save()

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        import yaml

        self._hparams.update(redacted(params))
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(self.log_dir) / "hparams.yaml", "w") as f:
            yaml.safe_dump({str(k): yaml_plain(v) for k, v in self._hparams.items()}, f)

    def save(self) -> None:
        """Writes the rows logged since the last save."""
        if not self._rows:
            return
        new_keys = {k for row in self._rows for k in row} - set(self._keys)
        self._keys = sorted({*self._keys, *new_keys})
        self.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        exists = self.metrics_file.is_file()
        if exists and new_keys:  # the header widens: the rows so far, again under it
            with open(self.metrics_file, newline="") as f:
                earlier = list(csv.DictReader(f))
            self._write("w", earlier + self._rows)
        else:
            self._write("a" if exists else "w", self._rows)
        self._rows = []

    def _write(self, mode: str, rows: list[dict[str, Any]]) -> None:
        with open(self.metrics_file, mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._keys)
            if mode == "w":
                writer.writeheader()
            writer.writerows(rows)

    def finalize(self) -> None:
        self.save()
        if not (Path(self.log_dir) / "hparams.yaml").exists():  # Lightning's folder has one, if only ``{}``
            self.log_hyperparams({})

    def __getstate__(self):
        return {**self.__dict__, "_rows": []}  # a copy sent to a rank writes nothing twice


def _cell(value: Any) -> Any:
    return value.item() if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1 else value
