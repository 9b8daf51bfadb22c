from distrain.loggers.base import Logger
from distrain.loggers.csv_logger import CSVLogger
from distrain.loggers.external import MLFlowLogger, WandbLogger
from distrain.loggers.jsonl import JSONLLogger
from distrain.loggers.tensorboard import TensorBoardLogger

__all__ = ["Logger", "CSVLogger", "JSONLLogger", "TensorBoardLogger", "WandbLogger", "MLFlowLogger"]
