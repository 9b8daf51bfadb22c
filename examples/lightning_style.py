"""A LightningModule, unchanged but for its import, trained on 2 CPU ranks under DDP.

    python examples/lightning_style.py                 # 2 CPU ranks, DDP, a few steps
    python examples/lightning_style.py --devices 1 --strategy single

Written to Lightning 2.x's documented API: ``save_hyperparameters`` and ``self.hparams.lr``, a loss dict returned
from ``training_step``, ``self.log(..., prog_bar=True)``, a scheduler stepped every step, and the module's own
``train_dataloader``/``val_dataloader`` (``trainer.fit(model)`` with no loaders). ``seed_everything`` comes first,
before the model is built: ``Trainer(seed=...)`` seeds only what the Trainer builds (``configure_model``, the
sampler's shuffle, dropout in the ranks), so two runs of this script print the same losses.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distrain as L  # was: import lightning as L


def make_data(n: int, seed: int) -> TensorDataset:
    """y = a fixed linear function of x, plus noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class Regressor(L.Module):  # was: L.LightningModule
    def __init__(self, lr: float = 0.05, hidden: int = 16, batch_size: int = 8):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        self.print(f"step {self.global_step} epoch {self.current_epoch} loss {loss.item():.8f}")  # rank 0 only
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(make_data(128, seed=0), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(make_data(32, seed=1), batch_size=self.hparams.batch_size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--root", default="runs/lightning_style")
    args = p.parse_args()

    L.seed_everything(42)  # first: the weights built in Regressor() below are the same in every run
    model = Regressor()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_steps=args.max_steps,
        default_root_dir=args.root,
        enable_progress_bar=False,
        enable_plots=False,
        logger=False,
    )
    trainer.fit(model)
    if trainer.is_global_zero:
        print(f"val_loss {trainer.callback_metrics['val_loss']:.8f}")


if __name__ == "__main__":
    main()
