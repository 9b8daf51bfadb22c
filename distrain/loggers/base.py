"""Loggers receive finished metrics on rank 0 only; they open their files lazily."""

from __future__ import annotations

from typing import Any


class DummyExperiment:
    """What ``Logger.experiment`` is on ranks other than global rank 0, as in Lightning (only rank 0 writes), and for
    a logger with no place for what it is handed (an image, in a JSON-lines file): every call does nothing."""

    def _nothing(self, *args: Any, **kwargs: Any) -> DummyExperiment:
        return self

    def __getattr__(self, name: str) -> Any:
        return self._nothing

    def __getitem__(self, key: Any) -> DummyExperiment:
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


class Logger:
    #: where it writes (Lightning's names): set by loggers that write files
    save_dir: str | None = None
    log_dir: str | None = None
    name: str | None = None
    version: int | str | None = None

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def log_hyperparams(self, params: dict[str, Any]) -> None: ...

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        """A tensor's values as a histogram (loggers that cannot show one ignore it)."""

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """The model's graph (loggers that cannot show one ignore it)."""

    @property
    def experiment(self) -> Any:
        """The tracker's own object on global rank 0 (TensorBoard's ``SummaryWriter``, a W&B run, an MLflow client),
        for what the loggers' methods do not cover (``add_image``...); a ``DummyExperiment`` on the other ranks."""
        from distrain.distributed.collectives import global_rank  # torch: only when the experiment is asked for

        return self._experiment() if global_rank() == 0 else DummyExperiment()

    def _experiment(self) -> Any:
        return DummyExperiment()

    def finalize(self) -> None: ...

    # A tracker's run identity travels in checkpoints, so a resumed job continues the same run.
    @property
    def state_key(self) -> str:
        return type(self).__name__

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def yaml_plain(value: Any) -> Any:
    """A hyperparameter as YAML's safe dumper can write it: plain values, and lists and dicts of them, as they are;
    anything else (a class, a tensor, a tuple's items) by its repr or as a list."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [yaml_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): yaml_plain(v) for k, v in value.items()}
    return repr(value)
