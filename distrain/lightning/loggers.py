"""``lightning.pytorch.loggers``: distrain's loggers, with Lightning's ``experiment``, ``log_graph``, ``save_dir`` and
``log_dir``. ``CSVLogger`` is distrain's JSON-lines logger in Lightning's place (``metrics.jsonl``, one record per
logged step), and ``Logger`` the base of all."""

from distrain.lightning._refuse import refusing
from distrain.loggers import JSONLLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from distrain.loggers.base import DummyExperiment


class CSVLogger(JSONLLogger):
    """Lightning's ``CSVLogger(save_dir, name="lightning_logs", version=None)``: the metrics as JSON lines in
    ``save_dir/name[/version_N]/metrics.jsonl`` (one record per logged step, read back with ``pandas.read_json(...,
    lines=True)``)."""

    def __init__(self, save_dir: str, name: str | None = "lightning_logs", version: int | str | None = None):
        import os

        path = os.path.join(save_dir, name or "")
        if version is not None:
            path = os.path.join(path, version if isinstance(version, str) else f"version_{version}")
        super().__init__(path)
        self.save_dir, self.name, self.version = str(save_dir), name, version


__all__ = ["CSVLogger", "DummyExperiment", "Logger", "MLFlowLogger", "TensorBoardLogger", "WandbLogger"]


__getattr__ = refusing(__name__)
