"""A script that names its strategy, as Lightning's GPU pages teach (``strategy="ddp"``), on whatever devices it is
given, one included, with random numbers drawn between seeding and fit. Lightning's DDP seeds every stream again from
``seed_everything``'s seed when it sets up, on one device too; a single-device run goes on with the script's."""

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class NoisyRegression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x + 0.1 * torch.randn_like(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    pl.seed_everything(1)
    model = NoisyRegression()
    torch.rand(5)  # drawn between seeding and fit (an augmentation's parameters, a split of the data)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    trainer = pl.Trainer(
        strategy="ddp", max_steps=4, enable_progress_bar=False, logger=False, enable_checkpointing=False
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
