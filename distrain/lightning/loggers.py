"""``lightning.pytorch.loggers``: distrain's loggers, with Lightning's ``experiment``, ``log_graph``, ``save_dir`` and
``log_dir``; ``CSVLogger`` writes Lightning's ``metrics.csv`` and ``hparams.yaml``; ``Logger`` is the base of all."""

from distrain.lightning._refuse import refusing
from distrain.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from distrain.loggers.base import DummyExperiment

__all__ = ["CSVLogger", "DummyExperiment", "Logger", "MLFlowLogger", "TensorBoardLogger", "WandbLogger"]


__getattr__ = refusing(__name__)
