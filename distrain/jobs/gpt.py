"""The built-in job: distrain's GPT trained next-byte on a corpus that needs no download (Python's own
standard-library source by default)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.utils.data import DataLoader

from distrain.batch import BatchLayout
from distrain.jobs.common import announce
from distrain.models.gpt import Block

if TYPE_CHECKING:
    from distrain.config import RunConfig


class GPTJob:
    plannable = True
    block_classes = {Block}

    def __init__(self, config: RunConfig):
        from distrain.models.gpt import GPT_SIZES

        self.config = config
        self.strategy = config.distributed.strategy
        t = config.training
        size = GPT_SIZES[t.model_name]
        d, layers, vocab = size["n_embd"], size["n_layer"], 256  # bytes
        # a block: attention 4d², its MLP 8d² (with n_experts: that many, and a router of d × n_experts), two norms;
        # the embeddings (the head tied to the token embedding) and the final norm
        mlp = t.n_experts * 8 * d * d + d * t.n_experts if t.n_experts else 8 * d * d
        self.parameter_count = layers * (4 * d * d + mlp + 2 * d) + (vocab + config.data.seq_len + 1) * d

    def fit(self, trainer, resume: str | None) -> None:
        module, train_loader, val_loader = self.prepare(trainer)
        trainer.fit(module, train_loader, val_loader, ckpt_path=resume)

    def prepare(self, trainer):
        """The built-in GPT and its byte-corpus train and validation loaders."""
        from distrain.data import byte_datasets
        from distrain.models.lm import GPTLanguageModel

        config = self.config
        t, data = config.training, config.data
        train_set, val_set = byte_datasets(data.dataset, data.seq_len, data.max_bytes, data.val_fraction)
        batch = BatchLayout(t.batch_size_per_gpu, t.gradient_accumulation_steps, trainer.data_parallel_size)
        total_steps = t.max_steps if t.max_steps > 0 else batch.steps_over(len(train_set), t.num_epochs)
        module = GPTLanguageModel(
            model_name=t.model_name,
            block_size=data.seq_len,
            learning_rate=t.learning_rate,
            weight_decay=t.weight_decay,
            warmup_steps=int(t.warmup_ratio * total_steps),
            total_steps=total_steps,
            lr_schedule=t.lr_schedule,
            low_precision_norms=t.low_precision_norms,
            n_experts=t.n_experts,
            top_k=t.top_k,
        )
        loader = lambda ds, shuffle: DataLoader(  # noqa: E731
            ds, batch_size=t.batch_size_per_gpu, shuffle=shuffle, num_workers=data.num_workers, drop_last=shuffle
        )
        details = f", global batch {batch.global_batch} × {data.seq_len} bytes"
        announce(trainer, config, self.strategy, t.model_name, details, total_steps)
        return module, loader(train_set, True), loader(val_set, False)
