"""What ``distrain train --model_name <hub name or local directory>`` runs: a Hugging Face model and
dataset on distrain's Trainer, with the same config, strategies, checkpoints and run directory as
the built-in job, plus a ``from_pretrained`` export at the end.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import TYPE_CHECKING

from torch.utils.data import DataLoader

from distrain.batch import BatchLayout
from distrain.config import ConfigError
from distrain.hf import data as hf_data
from distrain.hf import models
from distrain.hf.tasks import TASK_MODULES, config_dict
from distrain.jobs.common import announce
from distrain.strategies.layers import block_classes

if TYPE_CHECKING:
    from distrain.config import RunConfig


class HFJob:
    plannable = True

    def __init__(self, config: RunConfig):
        """Reads the model's config only (no weights, no data): a wrong name fails before any rank starts."""
        t = config.training
        self.config = config
        self.strategy = config.distributed.strategy
        from distrain.models.gpt import GPT_SIZES

        close = difflib.get_close_matches(t.model_name, GPT_SIZES, n=1, cutoff=0.8)
        if close and not models.looks_local(t.model_name):  # a typo, not a hub name: do not go to the network
            raise ConfigError(
                f"training.model_name {t.model_name!r} is not a built-in GPT size (did you mean {close[0]!r}?)"
            )
        self.hf_config = models.load_config(t.model_name, trust_remote_code=t.trust_remote_code, **t.model_config)
        self.task = models.infer_task(self.hf_config, t.task, t.model_name)
        skeleton = models.build_skeleton(self.task, self.hf_config)
        # FSDP units and activation checkpointing: the model's own _no_split_modules layers
        self.block_classes = block_classes(skeleton)
        self.parameter_count = sum(p.numel() for p in skeleton.parameters())
        self.data = self._data_config()
        self._check_data()

    def fit(self, trainer, resume: str | None) -> None:
        """Runs in every rank: data (tokenized once), the task module, fit, export."""
        c = self.config
        module, train_loader, val_loader = self.prepare(trainer)
        trainer.fit(module, train_loader, val_loader, ckpt_path=resume)
        out = Path(c.output_dir)
        if c.checkpointing.export_hf and not trainer.preempted and trainer.is_global_zero:
            cb = trainer.checkpoint_callback  # its dirpath: the local stage of an object storage URL
            ckpt_dir = Path(cb.dirpath) if cb is not None and cb.dirpath else out / "checkpoints"
            if (ckpt_dir / "last").exists():
                from distrain.hf.export import export_checkpoint

                # this run's own tokenizer, as its config names it (not as read back from the checkpoint)
                tokenizer = c.data.tokenizer or c.training.model_name
                exported = export_checkpoint(ckpt_dir / "last", out / "hf", tokenizer=tokenizer)
                print(f"distrain: Hugging Face model → {exported}", flush=True)

    def prepare(self, trainer):
        """The task module and its train and validation loaders (the data tokenized once, on rank 0 first)."""
        c = self.config
        t, data = c.training, self.data
        if trainer.runtime.ranks_run_this_script:
            # start the ranks now, not at fit(): then rank 0 tokenizes while the others wait, instead
            # of every rank tokenizing (spawn/fork strategies prepare the data once, in this process)
            trainer.runtime.launch()
        tokenizer_name = data.tokenizer or t.model_name
        tokenizer = models.load_tokenizer(tokenizer_name, trust_remote_code=t.trust_remote_code)
        prepared = hf_data.prepare(data, tokenizer, self.task, seed=t.seed, runtime=trainer.runtime)
        hf_config = self._config_for(prepared, tokenizer)
        batch = BatchLayout(t.batch_size_per_gpu, t.gradient_accumulation_steps, trainer.data_parallel_size)
        total_steps = t.max_steps if t.max_steps > 0 else batch.steps_over(len(prepared.train), t.num_epochs)
        module = TASK_MODULES[self.task](
            model_name=t.model_name,
            pretrained=t.pretrained,
            hf_config=config_dict(hf_config),
            tokenizer=tokenizer_name,
            learning_rate=t.learning_rate,
            weight_decay=t.weight_decay,
            warmup_steps=int(t.warmup_ratio * total_steps),
            total_steps=total_steps,
            lr_schedule=t.lr_schedule,
            seed=t.seed,
            low_precision_norms=t.low_precision_norms,
        )
        layout = trainer.strategy.layout  # sequence parallelism splits sequences over TP ranks
        collate = hf_data.collator(data, tokenizer, multiple_of=layout.tensor if layout else 1)
        train_loader = DataLoader(
            prepared.train,
            batch_size=t.batch_size_per_gpu,
            shuffle=True,
            drop_last=True,
            collate_fn=collate,
            num_workers=data.num_workers,
        )
        val_loader = DataLoader(
            prepared.eval,
            batch_size=t.batch_size_per_gpu,
            shuffle=False,
            collate_fn=collate,
            num_workers=data.num_workers,
        )
        details = (
            f", global batch {batch.global_batch} × ≤{data.max_length or data.seq_len} tokens, "
            f"{len(prepared.train)} train / {len(prepared.eval)} eval samples"
        )
        announce(trainer, c, self.strategy, f"{t.model_name} ({self.task})", details, total_steps)
        return module, train_loader, val_loader

    def _data_config(self):
        """``data`` with ``max_length`` resolved: never beyond the model's position embeddings."""
        data = self.config.data
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        if data.max_length is None:
            return dataclasses.replace(data, max_length=min(data.seq_len, limit) if limit else data.seq_len)
        if limit and data.max_length > limit:
            raise ConfigError(
                f"data.max_length={data.max_length} is longer than {self.config.training.model_name}'s "
                f"max_position_embeddings={limit}"
            )
        return data

    def _check_data(self) -> None:
        """What can be told of the data before the plan and the ranks: the built-in corpus is bytes for the built-in
        GPT, which no tokenizer reads, and a dataset written as a path must exist (a hub name is looked up by the
        ranks, which load it)."""
        data, model = self.config.data, self.config.training.model_name
        if data.dataset == "builtin:stdlib":
            raise ConfigError(
                f"data.dataset: the built-in corpus (builtin:stdlib, Python's source as bytes) trains the built-in GPT "
                f"sizes; {model} is a Hugging Face model and needs text its tokenizer reads: data.dataset=<a hub "
                "dataset name, or a local .txt, .json, .jsonl, .csv or .parquet file, or a directory>"
            )
        for key, source in (("data.dataset", data.dataset), ("data.eval_split", data.eval_split)):
            if source and models.looks_local(source) and not Path(source).expanduser().exists():
                raise ConfigError(f"{key}: no such file or directory: {source!r}")

    def _config_for(self, prepared: hf_data.Prepared, tokenizer):
        """The model's config with what the data decides: classes (and their names), the pad token."""
        config = self.hf_config
        if self.task == "sequence_classification":
            num_labels = self.config.training.num_labels or prepared.num_labels
            if num_labels != config.num_labels:
                config.num_labels = num_labels
            if prepared.label_names and len(prepared.label_names) == num_labels:
                config.id2label = dict(enumerate(prepared.label_names))
                config.label2id = {n: i for i, n in enumerate(prepared.label_names)}
        if (
            getattr(config, "pad_token_id", None) is None
        ):  # e.g. Llama for classification finds the last real token by it
            config.pad_token_id = tokenizer.pad_token_id
        return config
