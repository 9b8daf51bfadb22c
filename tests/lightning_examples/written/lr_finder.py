"""Lightning's learning-rate finder as its documentation shows it: ``Tuner(trainer).lr_find(model)`` (the rates it
tried, their smoothed losses, the suggestion, which becomes the module's ``hparams.learning_rate``), then ``fit`` from
it; and the ``LearningRateFinder`` callback, searching when fit starts (linearly, to a divergence) and training on
from its suggestion. Each search crosses an epoch's end. Its files under ``predictions/`` (each search's results and
suggestion, the learning rate each fit trained with, the final weights) are compared with Lightning's."""

import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateFinder
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader, TensorDataset


class LitModel(pl.LightningModule):
    def __init__(self, learning_rate=1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


def save(name, value):
    torch.save(value, os.path.join("predictions", f"{name}_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    pl.seed_everything(7)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 4, generator=g)
    train = DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4, shuffle=True)
    os.makedirs("predictions", exist_ok=True)

    model = LitModel()
    trainer = pl.Trainer(max_epochs=2, enable_progress_bar=False, logger=False, enable_checkpointing=False)
    found = Tuner(trainer).lr_find(model, train, num_training=40)
    save("tuner", [torch.tensor(found.results["lr"]), torch.tensor(found.results["loss"]), found.suggestion()])
    save("tuned_lr", model.hparams.learning_rate)
    trainer.fit(model, train)
    save("tuned_fit", [p.detach().clone() for p in model.parameters()])

    model = LitModel()
    finder = LearningRateFinder(min_lr=1e-3, max_lr=0.3, num_training_steps=30, mode="linear")
    trainer = pl.Trainer(
        max_epochs=1, enable_progress_bar=False, logger=False, enable_checkpointing=False, callbacks=[finder]
    )
    trainer.fit(model, train)
    results = finder.optimal_lr.results
    save("callback", [torch.tensor(results["lr"]), torch.tensor(results["loss"]), finder.optimal_lr.suggestion()])
    save("callback_fit", [trainer.optimizers[0].param_groups[0]["lr"], *[p.detach() for p in model.parameters()]])

    model = LitModel()
    trainer = pl.Trainer(
        max_epochs=1, accumulate_grad_batches=2, enable_progress_bar=False, logger=False, enable_checkpointing=False
    )
    found = Tuner(trainer).lr_find(model, train, num_training=14, mode="linear", max_lr=0.1, early_stop_threshold=None)
    save("accumulated", [torch.tensor(found.results["lr"]), torch.tensor(found.results["loss"]), found.suggestion()])
