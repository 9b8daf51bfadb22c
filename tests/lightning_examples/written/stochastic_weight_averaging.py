"""Stochastic Weight Averaging as Lightning's training-tricks page enables it (``StochasticWeightAveraging(
swa_epoch_start=..., swa_lrs=...)``): from the third epoch the weights are averaged at each epoch's start and the
learning rate follows SWALR in place of the module's StepLR, and the average is the model's at the end. Its files under
``predictions/`` (each validation's losses, the final weights) are compared with Lightning's."""

import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch.utils.data import DataLoader, TensorDataset


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        self.val_losses, self.validations = [], 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_losses.append(F.mse_loss(self.net(x), y).detach())

    def on_validation_epoch_end(self):
        name = f"val_rank{self.global_rank}_{self.validations}.pt"
        torch.save(torch.stack(self.val_losses), os.path.join("predictions", name))
        self.val_losses, self.validations = [], self.validations + 1

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


if __name__ == "__main__":
    pl.seed_everything(3)
    g = torch.Generator().manual_seed(0)
    train = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    val = TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
    os.makedirs("predictions", exist_ok=True)
    swa = StochasticWeightAveraging(swa_epoch_start=3, swa_lrs=0.05, annealing_epochs=2)
    trainer = pl.Trainer(
        max_epochs=6, enable_progress_bar=False, logger=False, enable_checkpointing=False, callbacks=[swa]
    )
    model = Net()
    trainer.fit(model, DataLoader(train, batch_size=4, shuffle=True), DataLoader(val, batch_size=4))
    weights = [t.detach().clone() for t in model.state_dict().values()]
    torch.save(weights, os.path.join("predictions", f"final_rank{trainer.global_rank}.pt"))
