"""Lightning's half precision (``precision="16-true"``, its precision page's "Select FP16 precision"), on a CPU as
Lightning runs it there: the weights (those configure_model builds too), each batch and the tensors a step makes are
float16, which the step asserts; Adam steps the float16 weights (no float32 copy). Random numbers drawn inside fit as
in random_streams.py. The final weights, under ``predictions/``, are compared with Lightning's."""

import os

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


def noisy_sums(n):
    x = torch.randn(n, 4)
    return TensorDataset(x, x.sum(1, keepdim=True))


class NoisyRegression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout(0.2))
        self.head = None

    def configure_model(self):
        if self.head is None:
            self.head = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x + 0.1 * torch.randn_like(x)
        assert x.dtype == torch.float16 and torch.zeros(1).dtype == torch.float16
        assert self.head.weight.dtype == torch.float16
        loss = torch.nn.functional.mse_loss(self.head(self.body(x)), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.head(self.body(x)), y))

    def train_dataloader(self):
        return DataLoader(noisy_sums(64), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(noisy_sums(16), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01, eps=1e-4)


if __name__ == "__main__":
    pl.seed_everything(7)
    os.makedirs("predictions", exist_ok=True)
    trainer = pl.Trainer(
        max_epochs=2,
        limit_train_batches=3,
        precision="16-true",
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    model = NoisyRegression()
    trainer.fit(model)
    weights = [p.detach().float() for p in model.parameters()]
    torch.save(weights, os.path.join("predictions", f"final_rank{trainer.global_rank}.pt"))
