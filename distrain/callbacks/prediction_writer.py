"""Writing predictions as ``predict`` makes them: each rank writes its own, with the dataset indices of each batch, so
a prediction over a data set too large for one process's memory needs no gather (``trainer.predict(model,
return_predictions=False)`` then keeps nothing a writer does not ask for). Lightning's ``BasePredictionWriter``."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

from distrain.callbacks.base import Callback


class WriteInterval(str, Enum):
    """When a writer writes: after each batch, at the epoch's end, or both (Lightning's values)."""

    BATCH = "batch"
    EPOCH = "epoch"
    BATCH_AND_EPOCH = "batch_and_epoch"

    @property
    def on_batch(self) -> bool:
        return self in (WriteInterval.BATCH, WriteInterval.BATCH_AND_EPOCH)

    @property
    def on_epoch(self) -> bool:
        return self in (WriteInterval.EPOCH, WriteInterval.BATCH_AND_EPOCH)


class BasePredictionWriter(Callback):
    """Subclass it and write ``write_on_batch_end`` (after each batch, with its samples' indices) and/or
    ``write_on_epoch_end`` (once, with every batch's predictions and indices: the predictions are then kept until the
    end, whatever ``return_predictions`` says), as ``write_interval`` says. ``batch_indices`` are the indices in the
    dataset of the rank's batch (``[]`` where a plain DataLoader's batch sampler does not draw the batches); the
    epoch's are a list per loader of a list per batch, as Lightning passes them."""

    def __init__(self, write_interval: str = "batch") -> None:
        if write_interval not in {i.value for i in WriteInterval}:
            raise ValueError(
                f"`write_interval` should be one of {[i.value for i in WriteInterval]}, got {write_interval!r}"
            )
        self.interval = WriteInterval(write_interval)

    def write_on_batch_end(
        self,
        trainer,
        pl_module,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        """Write one batch's predictions."""
        raise NotImplementedError(f"{type(self).__name__} writes on each batch: define write_on_batch_end")

    def write_on_epoch_end(self, trainer, pl_module, predictions: Sequence[Any], batch_indices: Sequence[Any]) -> None:
        """Write the predictions of every batch."""
        raise NotImplementedError(f"{type(self).__name__} writes at the epoch's end: define write_on_epoch_end")

    def on_predict_batch_end(self, trainer, module, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.interval.on_batch:
            indices = trainer.predict_loop.current_batch_indices
            self.write_on_batch_end(trainer, module, outputs, indices, batch, batch_idx, 0)

    def on_predict_epoch_end(self, trainer, module) -> None:
        if self.interval.on_epoch:
            loop = trainer.predict_loop
            self.write_on_epoch_end(trainer, module, loop.predictions, loop.epoch_batch_indices)
