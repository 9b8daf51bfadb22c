"""An exponential moving average of the weights, as Lightning's training-tricks page teaches (``EMAWeightAveraging``):
updated after each optimizer step from step 2 on, evaluated in place of the model in each validation (the sanity
check's too), the model's at the end, and what a checkpoint's ``load_from_checkpoint`` loads. The model has a
BatchNorm layer, whose buffers are averaged too. Its files under ``predictions/`` (each validation's losses, the final
weights, the weights loaded from the first epoch's checkpoint) are compared with Lightning's."""

import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        )
        self.val_losses, self.validations = [], 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.val_losses.append(loss.detach())
        self.log("val_loss", loss)

    def on_validation_epoch_end(self):
        name = f"val_rank{self.global_rank}_{self.validations}.pt"
        torch.save(torch.stack(self.val_losses), os.path.join("predictions", name))
        self.val_losses, self.validations = [], self.validations + 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def weights(module):
    return [t.detach().clone() for t in module.state_dict().values() if t.is_floating_point()]


if __name__ == "__main__":
    pl.seed_everything(2)
    g = torch.Generator().manual_seed(0)
    train = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    val = TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
    os.makedirs("predictions", exist_ok=True)
    averaging = EMAWeightAveraging(decay=0.9, update_starting_at_step=2)
    checkpoints = ModelCheckpoint(dirpath="checkpoints", filename="{epoch}", save_top_k=-1)
    trainer = pl.Trainer(max_epochs=3, enable_progress_bar=False, logger=False, callbacks=[averaging, checkpoints])
    model = Net()
    trainer.fit(model, DataLoader(train, batch_size=4, shuffle=True), DataLoader(val, batch_size=4))
    rank = trainer.global_rank
    torch.save(weights(model), os.path.join("predictions", f"final_rank{rank}.pt"))
    loaded = Net.load_from_checkpoint(os.path.join("checkpoints", "epoch=0.ckpt"))
    torch.save(weights(loaded), os.path.join("predictions", f"loaded_epoch0_rank{rank}.pt"))
