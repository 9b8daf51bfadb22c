"""The kinds of model users bring, for the strategy × model × route matrix (tests/test_matrix.py).

``MLP`` is a user's own small Module: layers built in ``__init__``, no ``configure_model``, no hidden
size anywhere, its data from ``train_dataloader()`` — the CLI trains it as ``training.module=
tests/matrix_models.py:MLP``. The others are the built-in GPT and the two Hugging Face tasks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import distrain


class MLP(distrain.Module):
    def __init__(self, batch_size: int = 4, samples: int = 48, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        g = torch.Generator().manual_seed(3)
        x = torch.randn(samples, 8, generator=g)
        self.data = TensorDataset(x, (x @ torch.randn(8, 1, generator=g)).tanh())
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.hparams["batch_size"], shuffle=True)


class ByteSequences(Dataset):
    """Learnable byte sequences (x, next-byte targets) for the built-in GPT."""

    def __init__(self, n: int = 48, seq_len: int = 16):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, 256, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.data = (start + stride * torch.arange(seq_len + 1)) % 256

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


def gpt(n_experts: int = 0):
    """The built-in GPT (``n_experts``: each block a mixture of that many experts, top-2)."""
    from distrain.models.lm import GPTLanguageModel

    moe = {"n_experts": n_experts, "top_k": 2} if n_experts else {}
    return GPTLanguageModel(
        "gpt-tiny", block_size=16, learning_rate=3e-3, warmup_steps=0, lr_schedule="constant", **moe
    )


def hf_causal(path: str):
    from distrain.hf.tasks import CausalLMModule

    return CausalLMModule(path, learning_rate=1e-2, warmup_steps=0, lr_schedule="constant")


def hf_classifier(path: str):
    from distrain.hf.tasks import SequenceClassificationModule

    return SequenceClassificationModule(path, learning_rate=1e-2, warmup_steps=0, lr_schedule="constant")


def hf_samples(path: str, task: str, n: int = 48) -> list[dict]:
    """Tokenized samples for the tiny models (uneven lengths: batches are padded)."""
    from distrain.hf import tiny
    from distrain.hf.models import load_tokenizer

    tok = load_tokenizer(path)

    def sample(text: str) -> dict:
        ids = tok(text)["input_ids"][:16]
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    if task == "causal_lm":
        return [sample(t) for t in tiny.counting_texts(n)]
    return [{**sample(r["text"]), "labels": r["label"]} for r in tiny.reviews(n)]


def hf_collate(path: str, multiple_of: int = 1):
    from distrain.hf.data import PadCollator
    from distrain.hf.models import load_tokenizer

    return PadCollator(load_tokenizer(path).pad_token_id, multiple_of=multiple_of)
