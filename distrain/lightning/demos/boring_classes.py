"""``lightning.pytorch.demos.boring_classes``: the model and data a Lightning bug report starts from, with the
behaviour Lightning documents for them (so a report written against Lightning runs, and trains, the same here):
a 32 → 2 linear layer pulled towards ones by a mean squared error, SGD at 0.1 with a StepLR each epoch, and random
32-wide samples, 64 of them a loader."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from distrain.datamodule import DataModule
from distrain.module import Module


class RandomDataset(Dataset):
    """``length`` samples of ``size`` standard-normal values, drawn once from torch's generator."""

    def __init__(self, size: int, length: int):
        self.len = length
        self.data = torch.randn(length, size)

    def __getitem__(self, index: int) -> Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return self.len


class RandomDictDataset(RandomDataset):
    """``RandomDataset``'s samples as ``{"a": x, "b": x + 2}``."""

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        a = self.data[index]
        return {"a": a, "b": a + 2}


class RandomIterableDataset(IterableDataset):
    """``count`` samples of ``size`` values, drawn as they are read."""

    def __init__(self, size: int, count: int):
        self.size, self.count = size, count

    def __iter__(self) -> Iterator[Tensor]:
        for _ in range(self.count):
            yield torch.randn(self.size)


class BoringModel(Module):
    """Lightning's module for bug reports: subclass it and change what the report is about."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(32, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)

    def loss(self, preds: Tensor, labels: Tensor | None = None) -> Tensor:
        """The mean squared error to ``labels``, ones by default: a loss that moves the weights."""
        return nn.functional.mse_loss(preds, torch.ones_like(preds) if labels is None else labels)

    def step(self, batch: Any) -> Tensor:
        return self.loss(self(batch))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        return {"loss": self.step(batch)}

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        return {"x": self.step(batch)}

    def test_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        return {"y": self.step(batch)}

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))

    def test_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))


class BoringDataModule(DataModule):
    """256 random samples, drawn when it is made: the first 64 train, the next validate, then test, then predict."""

    def __init__(self) -> None:
        super().__init__()
        self.random_full = RandomDataset(32, 64 * 4)

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.random_train = self._part(0)
        if stage in ("fit", "validate"):
            self.random_val = self._part(1)
        if stage == "test":
            self.random_test = self._part(2)
        if stage == "predict":
            self.random_predict = self._part(3)

    def _part(self, index: int) -> Subset:
        return Subset(self.random_full, range(64 * index, 64 * (index + 1)))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.random_train)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.random_val)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.random_test)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.random_predict)
