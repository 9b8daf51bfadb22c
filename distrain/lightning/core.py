"""``lightning.pytorch.core``: the module and the datamodule."""

from distrain.datamodule import DataModule as LightningDataModule
from distrain.module import Module as LightningModule

__all__ = ["LightningDataModule", "LightningModule"]
