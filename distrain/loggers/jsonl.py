"""One JSON object per logged step, appended to ``metrics.jsonl`` — the simplest thing to read back."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from distrain.loggers.base import Logger


class JSONLLogger(Logger):
    """Its ``experiment`` is a ``DummyExperiment``: a JSON-lines file has no place for images or graphs."""

    def __init__(self, save_dir: str, filename: str = "metrics.jsonl"):
        self.save_dir = self.log_dir = str(save_dir)
        self.path = Path(save_dir) / filename
        self._file = None

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")

    def finalize(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __getstate__(self):
        return {**self.__dict__, "_file": None}


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
