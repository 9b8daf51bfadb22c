"""Writes the checkpoints Lightning 2.6.6 itself wrote that ``tests/test_lightning_namespace.py`` resumes under
``distrain.lightning`` (run with Lightning installed: ``python tests/data/lightning_written/make.py``), and what
Lightning's own runs ended with (``reference.json``): a regression with Adam and a StepLR (their states matter),
fitted 2 epochs of 8 batches; checkpointed at the end of epoch 0 (``epoch_end.ckpt``) and after 3 batches of epoch 1
(``mid_epoch.ckpt``). The loader keeps its order (``shuffle=False``): a Lightning checkpoint has no RNG state."""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

if os.environ.get("WRITTEN_BY") == "distrain":  # the same module under distrain, for the test (migrate's one edit)
    import distrain.lightning as pl
else:
    import lightning.pytorch as pl

HERE = Path(__file__).resolve().parent


class Regression(pl.LightningModule):
    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)]


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)


def trainer(folder, max_epochs, **checkpoint) -> pl.Trainer:
    callbacks = [pl.callbacks.ModelCheckpoint(dirpath=folder, save_top_k=-1, **checkpoint)] if checkpoint else []
    return pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, enable_checkpointing=bool(checkpoint),
    )  # fmt: skip


def weights(module) -> dict:
    return {k: v.flatten().tolist() for k, v in module.state_dict().items()}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        whole = Regression()
        trainer(f"{tmp}/steps", 2, every_n_train_steps=11, filename="{epoch}-{step}").fit(whole, loader())
        shutil.copy(f"{tmp}/steps/epoch=1-step=11.ckpt", HERE / "mid_epoch.ckpt")
        torch.manual_seed(0)
        trainer(f"{tmp}/epochs", 1, filename="{epoch}").fit(Regression(), loader())
        shutil.copy(f"{tmp}/epochs/epoch=0.ckpt", HERE / "epoch_end.ckpt")
        resumed = {}
        for name in ("epoch_end", "mid_epoch"):
            torch.manual_seed(1)  # another init: everything must come from the checkpoint
            module = Regression()
            run = trainer(None, 2)
            run.fit(module, loader(), ckpt_path=HERE / f"{name}.ckpt")
            resumed[name] = {"global_step": run.global_step, "weights": weights(module)}
    record = {"lightning": pl.__version__, "torch": torch.__version__, "whole": weights(whole), "resumed": resumed}
    (HERE / "reference.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v["global_step"] for k, v in resumed.items()}), file=sys.stderr)
