"""Weights & Biases and MLflow, used only when their packages are installed.

Both name their run before it starts (W&B: an id chosen here; MLflow: the run it created) and give
that name to checkpoints (``state_dict``): a job resumed from a checkpoint continues the same
tracker run instead of starting a new one. Only rank 0 logs.
"""

from __future__ import annotations

import re
import time
import warnings
from numbers import Number
from pathlib import Path
from typing import Any

from distrain.config import redacted
from distrain.loggers.base import Logger

#: a tracker's run id as the trackers make them (W&B: 8 characters; MLflow: 32 hex digits); read back from a
#: checkpoint, anything else — a path (W&B names its local run directory after the id), a URL — is not taken
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _run_id(value: Any, tracker: str) -> str | None:
    if value is None or (isinstance(value, str) and _RUN_ID.fullmatch(value)):
        return value
    warnings.warn(
        f"distrain: the checkpoint's {tracker} run id {value!r} is not a run id; starting a new run", stacklevel=3
    )
    return None


def _require(package: str, extra: str) -> None:
    """Fail at construction (before any rank starts) if the package is missing; import it only
    where it logs (rank 0): importing mlflow alone takes seconds."""
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise ImportError(f"the {package} logger needs the '{package}' package: pip install 'distrain[{extra}]'")


def _new_wandb_id() -> str:
    # W&B's own format (wandb.util.generate_id): 8 characters of [a-z0-9]
    import secrets
    import string

    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, Number) and not isinstance(v, bool)}


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


class WandbLogger(Logger):
    """``mode``: ``online``, ``offline`` (files under ``save_dir/wandb``; ``wandb sync`` uploads them)
    or ``disabled``; None → W&B's default (``WANDB_MODE``). ``id``: continue this W&B run."""

    def __init__(
        self,
        project: str = "distrain",
        name: str | None = None,
        save_dir: str | None = None,
        id: str | None = None,
        mode: str | None = None,
        **kwargs: Any,
    ):
        _require("wandb", "wandb")
        self.id = id or _new_wandb_id()  # known before the run starts: checkpoints carry it
        self.save_dir = save_dir
        self.init_kwargs = dict(project=project, name=name, dir=save_dir, mode=mode, **kwargs)
        self._run = None

    @property
    def run(self):
        if self._run is None:
            import wandb

            if self.save_dir:
                Path(self.save_dir).mkdir(parents=True, exist_ok=True)
            # resume="allow": the run with this id continues if it exists, else it is created
            self._run = wandb.init(id=self.id, resume="allow", **self.init_kwargs)
        return self._run

    def _experiment(self):
        return self.run

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(_numeric(metrics), step=step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.run.config.update(redacted(params), allow_val_change=True)

    def log_histogram(self, name: str, values: Any, step: int) -> None:
        import wandb

        self.run.log({name: wandb.Histogram(values.detach().float().cpu().numpy())}, step=step)

    def finalize(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None

    def state_dict(self) -> dict[str, Any]:
        return {"id": self.id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = _run_id(state.get("id"), "W&B")
        if not saved or saved == self.id:
            return
        if self._run is not None:  # already logging to another run: keep it
            warnings.warn(f"distrain: W&B run {self.id} is already running; not switching to {saved}", stacklevel=2)
            return
        self.id = saved

    def __getstate__(self):
        return {**self.__dict__, "_run": None}


class MLFlowLogger(Logger):
    """``tracking_uri``: e.g. ``sqlite:///mlflow.db`` or a server's URL (None → ``MLFLOW_TRACKING_URI``,
    else MLflow's default). ``run_id``: continue this MLflow run."""

    def __init__(
        self,
        experiment_name: str = "distrain",
        tracking_uri: str | None = None,
        run_name: str | None = None,
        run_id: str | None = None,
        tags: dict[str, str] | None = None,
    ):
        _require("mlflow", "mlflow")
        self.experiment_name, self.tracking_uri, self.run_name = experiment_name, tracking_uri, run_name
        self.run_id = run_id
        self.tags = tags
        self._client = None

    @property
    def client(self):
        """The client, with the run started (or continued)."""
        if self._client is None:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=self.tracking_uri)
            if self.run_id is None:
                experiment = client.get_experiment_by_name(self.experiment_name)
                experiment_id = (
                    experiment.experiment_id if experiment else client.create_experiment(self.experiment_name)
                )
                self.run_id = client.create_run(experiment_id, run_name=self.run_name, tags=self.tags).info.run_id
            else:  # a resumed job: the same run goes on
                client.update_run(self.run_id, status="RUNNING")
            self._client = client
        return self._client

    def _experiment(self):
        return self.client

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(k, v, now, step) for k, v in _numeric(metrics).items()]
        for i in range(0, len(entries), 1000):  # MLflow's per-request limit
            self.client.log_batch(self.run_id, metrics=entries[i : i + 1000])

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        client = self.client
        flat = {k: str(v)[:6000] for k, v in _flatten(redacted(params)).items()}
        # parameters are immutable in MLflow: a resumed run logs only those it does not have yet
        existing = client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in flat.items() if k in existing and existing[k] != v)
        if changed:
            warnings.warn(
                f"distrain: MLflow run {self.run_id} keeps its first values of {', '.join(changed)} "
                "(MLflow parameters cannot change)",
                stacklevel=2,
            )
        entries = [Param(k, v) for k, v in flat.items() if k not in existing]
        for i in range(0, len(entries), 100):
            client.log_batch(self.run_id, params=entries[i : i + 100])

    def finalize(self) -> None:
        if self._client is not None:
            self._client.set_terminated(self.run_id)
            self._client = None

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id} if self.run_id else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = _run_id(state.get("run_id"), "MLflow")
        if not saved or saved == self.run_id:
            return
        if self._client is not None:
            warnings.warn(f"distrain: MLflow run {self.run_id} is already open; not switching to {saved}", stacklevel=2)
            return
        self.run_id = saved

    def __getstate__(self):
        return {**self.__dict__, "_client": None}
