"""Validation inside the epochs, as Lightning's docs teach it for long epochs (``val_check_interval``, a count of
batches or a fraction of the epoch), with a checkpoint kept by the monitored validation loss and the test run from the
best one. Its files under ``predictions/`` are compared with Lightning's: when each hook ran (the training batch ends,
the validations, the epoch ends and the checkpoints saved, by step), each validation's loss, the checkpoints kept and
the best one's score, the test loss of the best weights, and the names and values of the training loss logged both
per step and per epoch (``train_loss_step``, ``train_loss_epoch``, and ``train_loss`` the newer of the two). The
second fit ends at ``max_steps`` inside an epoch; the third counts its batches across epochs
(``check_val_every_n_epoch=None``)."""

import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)  # logged as train_loss_step and train_loss_epoch
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class When(pl.Callback):
    """Each hook of interest as ``<letter><global step>``, each validation's loss, and the training loss's names and
    values the callbacks see at each validation's and each epoch's end."""

    def __init__(self):
        self.events, self.val_losses, self.train_losses = [], [], []

    def _train_losses(self, trainer):
        self.train_losses.append(sorted([k, float(v)] for k, v in trainer.callback_metrics.items() if "train" in k))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.events.append(f"B{trainer.global_step}")

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.events.append(f"V{trainer.global_step}")
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))
            self._train_losses(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        self.events.append(f"E{trainer.global_step}")
        self._train_losses(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.events.append(f"S{trainer.global_step}")


def fit(name, data, val, test, **trainer_args):
    pl.seed_everything(3)
    when = When()
    keep = ModelCheckpoint(dirpath=name, monitor="val_loss", save_top_k=2, filename="{epoch}-{step}")
    trainer = pl.Trainer(enable_progress_bar=False, logger=False, callbacks=[when, keep], **trainer_args)
    trainer.fit(Net(), DataLoader(data, batch_size=4, shuffle=True), DataLoader(val, batch_size=4))
    tested = trainer.test(ckpt_path="best", dataloaders=DataLoader(test, batch_size=4), verbose=False)
    kept = sorted(f for f in os.listdir(name) if f.endswith(".ckpt"))
    record = [when.events, when.val_losses, when.train_losses, kept, os.path.basename(keep.best_model_path)]
    record += [float(keep.best_model_score), tested[0]["test_loss"], trainer.current_epoch, trainer.global_step]
    torch.save(record, os.path.join("predictions", f"{name}_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    val = TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
    test = TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
    os.makedirs("predictions", exist_ok=True)
    fit("every_3_batches", data, val, test, max_epochs=2, val_check_interval=3)
    fit("half_epochs", data, val, test, max_epochs=3, max_steps=7, val_check_interval=0.5)
    fit("across_epochs", data, val, test, max_epochs=2, val_check_interval=5, check_val_every_n_epoch=None)
