"""``lightning.pytorch.demos``: the small models and datasets Lightning's bug reports and tests are written with. Its
datasets that download (MNIST, WikiText-2) are not here: this namespace reads no network."""

from distrain.lightning._refuse import refusing
from distrain.lightning.demos.boring_classes import (
    BoringDataModule,
    BoringModel,
    RandomDataset,
    RandomDictDataset,
    RandomIterableDataset,
)

__all__ = ["BoringDataModule", "BoringModel", "RandomDataset", "RandomDictDataset", "RandomIterableDataset"]

__getattr__ = refusing(__name__)
