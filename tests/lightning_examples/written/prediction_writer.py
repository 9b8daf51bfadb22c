"""Predictions written by each rank as Lightning's documentation teaches (``BasePredictionWriter``, the "deploy" page's
``CustomWriter``): after each batch, a file of its predictions, and at the end, every batch's predictions and their
samples' indices in the dataset, one file per rank, with ``return_predictions=False``. Trained a few steps first, so
the predictions are the trained model's. Its files under ``predictions/`` are compared with Lightning's."""

import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader, TensorDataset


class CustomWriter(BasePredictionWriter):
    def __init__(self, output_dir, write_interval):
        super().__init__(write_interval)
        self.output_dir = output_dir

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
        name = f"rank{trainer.global_rank}-batch{batch_idx}.pt"
        torch.save(prediction, os.path.join(self.output_dir, str(dataloader_idx), name))

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        torch.save(predictions, os.path.join(self.output_dir, f"predictions_{trainer.global_rank}.pt"))
        torch.save(batch_indices, os.path.join(self.output_dir, f"batch_indices_{trainer.global_rank}.pt"))


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self.net(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    pl.seed_everything(1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(30, 4, generator=g), torch.randn(30, 1, generator=g))
    os.makedirs(os.path.join("predictions", "0"), exist_ok=True)
    writer = CustomWriter(output_dir="predictions", write_interval="batch_and_epoch")
    trainer = pl.Trainer(
        max_steps=4, enable_progress_bar=False, logger=False, enable_checkpointing=False, callbacks=[writer]
    )
    model = Regression()
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True))
    trainer.predict(model, DataLoader(data, batch_size=4), return_predictions=False)
