"""A script that never seeds (the harness seeds torch once, as a user's earlier line might), its data made in a
datamodule's setup, on 1 process and on several ranks."""

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Points(pl.LightningDataModule):
    def setup(self, stage):
        x = torch.rand(48, 3)
        self.train, self.val = TensorDataset(x[:40], x[:40].mean(1)), TensorDataset(x[40:], x[40:].mean(1))

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=4)


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5))
        self.out = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.out(self.net(x)).squeeze(1), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.out(self.net(x)).squeeze(1), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


if __name__ == "__main__":
    trainer = pl.Trainer(
        max_epochs=2,
        limit_train_batches=4,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(Model(), datamodule=Points())
