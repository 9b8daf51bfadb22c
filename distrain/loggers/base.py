"""Loggers receive finished metrics on rank 0 only; they open their files lazily."""

from __future__ import annotations

from typing import Any


class Logger:
    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def log_hyperparams(self, params: dict[str, Any]) -> None: ...

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        """A tensor's values as a histogram (loggers that cannot show one ignore it)."""

    def finalize(self) -> None: ...

    # A tracker's run identity travels in checkpoints, so a resumed job continues the same run.
    @property
    def state_key(self) -> str:
        return type(self).__name__

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
