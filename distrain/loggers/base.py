"""Loggers receive finished metrics on rank 0 only; they open their files lazily."""

from __future__ import annotations

from typing import Any


class Logger:
    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def log_hyperparams(self, params: dict[str, Any]) -> None: ...

    def finalize(self) -> None: ...
