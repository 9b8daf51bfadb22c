"""Weights & Biases and MLflow, used only when their packages are installed."""

from __future__ import annotations

from numbers import Number
from typing import Any

from distrain.loggers.base import Logger


def _require(package: str, extra: str):
    try:
        return __import__(package)
    except ImportError:
        raise ImportError(
            f"the {package} logger needs the '{package}' package: pip install 'distrain[{extra}]'"
        ) from None


class WandbLogger(Logger):
    def __init__(self, project: str = "distrain", name: str | None = None, save_dir: str | None = None, **kwargs: Any):
        _require("wandb", "wandb")
        self.init_kwargs = dict(project=project, name=name, dir=save_dir, **kwargs)
        self._run = None

    @property
    def run(self):
        if self._run is None:
            import wandb

            self._run = wandb.init(**self.init_kwargs)
        return self._run

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def finalize(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None

    def __getstate__(self):
        return {**self.__dict__, "_run": None}


class MLFlowLogger(Logger):
    def __init__(self, experiment_name: str = "distrain", tracking_uri: str | None = None, run_name: str | None = None):
        _require("mlflow", "mlflow")
        self.experiment_name, self.tracking_uri, self.run_name = experiment_name, tracking_uri, run_name
        self._started = False

    def _start(self):
        import mlflow

        if not self._started:
            if self.tracking_uri:
                mlflow.set_tracking_uri(self.tracking_uri)
            mlflow.set_experiment(self.experiment_name)
            mlflow.start_run(run_name=self.run_name)
            self._started = True
        return mlflow

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, Number) and not isinstance(v, bool)}
        self._start().log_metrics(numeric, step=step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        flat = {}

        def walk(prefix, tree):
            for k, v in tree.items():
                walk(f"{prefix}{k}.", v) if isinstance(v, dict) else flat.__setitem__(f"{prefix}{k}", v)

        walk("", params)
        self._start().log_params(flat)

    def finalize(self) -> None:
        if self._started:
            import mlflow

            mlflow.end_run()
            self._started = False
