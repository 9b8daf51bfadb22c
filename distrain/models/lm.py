"""The built-in job: the GPT trained next-byte on a corpus that needs no download."""

from __future__ import annotations

import torch

from distrain.models.gpt import GPT, GPT_SIZES, Block, gpt_config
from distrain.models.norms import low_precision_norms
from distrain.module import Module
from distrain.optim import adamw, warmup_decay


class GPTLanguageModel(Module):
    block_class = Block  # for activation-checkpointing / wrapping policies

    def __init__(
        self,
        model_name: str = "gpt-tiny",
        block_size: int = 128,
        dropout: float = 0.0,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 0,
        total_steps: int = 1000,
        lr_schedule: str = "cosine",
        n_experts: int = 0,
        top_k: int = 2,
        low_precision_norms: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.gpt: GPT | None = None

    def configure_model(self) -> None:
        if self.gpt is None:
            h = self.hparams
            moe = {"n_experts": h["n_experts"], "top_k": h["top_k"]} if h["n_experts"] else {}
            self.gpt = GPT(gpt_config(h["model_name"], block_size=h["block_size"], dropout=h["dropout"], **moe))
            if h.get("low_precision_norms"):
                low_precision_norms(self.gpt)

    def num_blocks(self) -> int:
        return GPT_SIZES[self.hparams["model_name"]]["n_layer"]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)

    def flops_per_token(self) -> float:
        return self.gpt.flops_per_token()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.gpt(x, y)
        for name, value in self.gpt.load_balance().items():  # a mixture of experts' balance, in the metrics
            self.log(name, value)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", self.gpt(x, y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", self.gpt(x, y))

    def configure_optimizers(self):
        h = self.hparams
        optimizer = adamw(self.gpt, h["learning_rate"], h["weight_decay"])
        scheduler = warmup_decay(optimizer, h["warmup_steps"], h["total_steps"], h["lr_schedule"])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
