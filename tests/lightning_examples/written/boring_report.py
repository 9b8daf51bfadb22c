"""A bug report as Lightning's users write them: the BoringModel and its datamodule, subclassed, with Lightning's
imports (``demos``, ``utilities.types``); validation, a scheduler stepped each epoch, a checkpoint kept by a
monitored metric and ``test(ckpt_path="best")``."""

import os

from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from lightning.pytorch.utilities.types import STEP_OUTPUT


class Report(BoringModel):
    def training_step(self, batch, batch_idx) -> STEP_OUTPUT:
        loss = self.step(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx) -> STEP_OUTPUT:
        self.log("val_loss", self.step(batch))


def run():
    seed_everything(7)
    trainer = Trainer(
        default_root_dir=os.getcwd(),
        max_epochs=2,
        limit_train_batches=6,
        limit_val_batches=3,
        limit_test_batches=3,
        num_sanity_val_steps=0,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=[ModelCheckpoint(monitor="val_loss")],
    )
    trainer.fit(Report(), datamodule=BoringDataModule())
    trainer.test(ckpt_path="best", datamodule=BoringDataModule())


if __name__ == "__main__":
    run()
