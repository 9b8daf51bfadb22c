"""A user's module for the replica-group tests: the CLI trains it as ``training.module=tests/ft_models.py:SGDMLP``.
SGD with momentum: averaging the groups' weights after every step is then DDP's update, to fp32 rounding (the update
is linear in the gradient), which AdamW's is not."""

from __future__ import annotations

import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distrain


class SGDMLP(distrain.Module):
    def __init__(self, batch_size: int = 4, samples: int = 96, lr: float = 0.01):
        super().__init__()
        late = os.environ.get("FT_MODELS_LATE_GROUP")  # "group:seconds": that group's ranks start late (a slow host)
        if late and os.environ.get("REPLICA_GROUP_ID") == late.split(":")[0]:
            time.sleep(float(late.split(":")[1]))
        self.save_hyperparameters()
        g = torch.Generator().manual_seed(3)
        x = torch.randn(samples, 8, generator=g)
        self.data = TensorDataset(x, (x @ torch.randn(8, 1, generator=g)).tanh())
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.hparams["batch_size"], shuffle=True)
