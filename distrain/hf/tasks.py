"""The two Hugging Face jobs as ``distrain.Module``s: causal LM and sequence classification.

Both take batches of ``input_ids`` / ``attention_mask`` (/ ``token_type_ids``) (/ ``labels``) as
``distrain.hf.data.PadCollator`` makes them, and build their model in ``configure_model``: the
full pretrained model on one process or DDP; under FSDP only its structure, on the meta device,
with the weights streamed in from rank 0 once each rank's shards exist (``reset_parameters``).
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from distrain.hf import models
from distrain.models import norms
from distrain.models.loss import token_loss_sum
from distrain.module import Module
from distrain.optim import adamw, warmup_decay
from distrain.parallel.expert_parallel import ExpertLoad
from distrain.strategies import sharded_init


class HFTaskModule(Module):
    task: str = ""

    def __init__(
        self,
        model_name: str,
        pretrained: bool = True,
        hf_config: dict | None = None,
        tokenizer: str | None = None,
        learning_rate: float = 5e-4,
        weight_decay: float = 0.01,
        warmup_steps: int = 0,
        total_steps: int = 1000,
        lr_schedule: str = "cosine",
        seed: int = 0,
        task: str | None = None,
        low_precision_norms: bool = False,
    ):
        """``hf_config``: the model's config as a plain dict (``config_dict``), e.g. with ``num_labels``
        set from the data; default: the model's own. It travels in checkpoints' hyperparameters with
        ``task``, so an export needs nothing but the checkpoint."""
        super().__init__()
        if task not in (None, self.task):
            raise ValueError(f"{type(self).__name__} is the {self.task} task, not {task!r}")
        self.save_hyperparameters()
        if hf_config is None:
            self.hparams["hf_config"] = config_dict(models.load_config(model_name))
        self.hparams["task"] = self.task
        self.model = None
        self.expert_load: ExpertLoad | None = None

    def num_blocks(self) -> int | None:
        return self.hparams["hf_config"].get("num_hidden_layers")

    def hf_config(self):
        return models.config_from_dict(self.hparams["hf_config"])

    # ---- building ------------------------------------------------------------------------------
    #: the Hugging Face model's weights come from its files or the library's own initializer, all of
    #: them in ``reset_parameters`` (a sharded replay calls it and does not descend into the model)
    reset_parameters_covers_children = True

    def configure_model(self) -> None:
        """The model is built empty wherever the strategy builds (the device, the meta device, ZeRO-3
        partitions) and gets its weights in ``reset_parameters``: one code path under every strategy,
        hence the same weights on any world size."""
        if self.model is not None:
            return
        self.model = models.build_empty(self.task, self.hf_config())
        if self.hparams.get("low_precision_norms"):
            norms.low_precision_norms(self.model)
        self.expert_load = ExpertLoad(self.model)  # a mixture of experts: its balance, for the metrics
        if not sharded_init.initialization_deferred():  # built whole here: initialize it now
            sharded_init.initialize_now(self)

    def reset_parameters(self) -> None:
        """Pretrained weights from the checkpoint files, one tensor at a time (under FSDP and ZeRO-3
        each rank keeps only its shard of each); buffers and anything the files lack from the model's
        own initializer (``models.initialize``)."""
        h = self.hparams
        models.initialize(self.model, h["model_name"], h["pretrained"], h["seed"])

    def configure_optimizers(self):
        h = self.hparams
        optimizer = adamw(self.model, h["learning_rate"], h["weight_decay"])
        scheduler = warmup_decay(optimizer, h["warmup_steps"], h["total_steps"], h["lr_schedule"])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def flops_per_token(self) -> float:
        return 6.0 * sum(p.numel() for p in self.model.parameters())

    def _inputs(self, batch: dict) -> dict:
        return {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}


class CausalLMModule(HFTaskModule):
    """Next-token loss over the real tokens only (padding masked out), normalized by the number of
    real tokens in the whole optimizer step: all ranks, all accumulation micro-steps.

    Why: with a per-micro-batch mean, a token in a short batch weighs more than one in a long
    batch, so the result depends on how the global batch was split. Here the Trainer shows us the
    step's micro-batches before the first runs (``on_train_step_start``); one all-reduce gives the
    step's global token count N. Each micro-step then returns ``sum of its token losses × W × A / N``:
    the Trainer divides by A (the micro-batches in the step) and the gradient reduction averages over W ranks, so
    the step's gradient is exactly that of (sum of all token losses) / N — as on one process."""

    task = "causal_lm"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._loss_scale: float | None = None
        self.sequence_shard = None  # context parallelism: this rank's slice of every sequence

    def enable_context_parallel(self, shard) -> None:
        """Split every sequence over a context-parallel group (``distrain.parallel.context_parallel``): each rank
        runs the model on its slice at its global positions, attention through the group's engine; batches arrive
        whole."""
        from distrain.parallel.context_parallel import use_engine_in_hf

        use_engine_in_hf(self.model, shard)
        self.sequence_shard = shard

    @staticmethod
    def _targets(batch: dict) -> torch.Tensor:
        """Which next-token targets are real tokens: position t+1 is not padding."""
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        return (mask if mask is not None else torch.ones_like(ids))[:, 1:].bool()

    def on_train_step_start(self, batches: list, window: int) -> None:
        local = sum(int(self._targets(b).sum()) for b in batches)
        runtime = self.trainer.runtime
        total = float(runtime.all_reduce(torch.tensor(local, dtype=torch.float64), op="sum"))
        # under model parallelism the ranks of a TP group or pipeline count the same batches: the total and W
        # both grow by world / data-parallel ranks, so the ratio is the data-parallel one (parity-tested)
        self._loss_scale = runtime.world_size * window / max(total, 1.0)

    def _token_loss_sum(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        targets = batch["input_ids"][:, 1:].masked_fill(~self._targets(batch), -100)
        if self.sequence_shard is not None:  # the targets are shifted whole, then split with the tokens
            shard = self.sequence_shard
            logits = self._logits_of_slice(batch)
            return shard.loss_sum(logits, shard.split(F.pad(targets, (0, 1), value=-100), -100))
        logits = self.model(**self._inputs(batch), use_cache=False).logits
        # the targets shifted, not the logits: a slice of the logits would be copied whole
        return token_loss_sum(logits, F.pad(targets, (0, 1), value=-100)), (targets != -100).sum()

    def _logits_of_slice(self, batch: dict) -> torch.Tensor:
        """Context parallelism: the logits of this rank's slice of every sequence, at its global positions. No mask
        goes in: right padding under SDPA's causal mask keeps real tokens from pads."""
        from distrain.parallel.context_parallel import right_padded

        if not right_padded(batch.get("attention_mask")):
            raise ValueError(
                "context parallelism (distributed.context_parallel_size) needs right-padded batches: a row's "
                "attention_mask has padding before a real token (left padding or packed sequences)"
            )
        shard, ids = self.sequence_shard, batch["input_ids"]
        local = shard.split(ids, 0)
        positions = shard.positions(local.shape[1], ids.device).expand(len(ids), -1)
        return self.model(input_ids=local, position_ids=positions, use_cache=False).logits

    def training_step(self, batch, batch_idx):
        loss_sum, count = self._token_loss_sum(batch)
        if self.expert_load is not None and self.expert_load.watched:  # the experts' balance, as the built-in GPT's
            self.log("moe_load_max_over_mean", self.expert_load.max_over_mean())
        if self._loss_scale is None:  # a loop without the step hook (your own): this micro-batch's mean
            return loss_sum / count.clamp(min=1)
        return loss_sum * self._loss_scale

    def validation_step(self, batch, batch_idx):
        loss_sum, count = self._token_loss_sum(batch)
        n = int(count)
        if n:  # weighted by tokens: the epoch value is the mean over every real token of all ranks
            self.log("val_loss", loss_sum / n, batch_size=n)
        self.log("val_tokens", n, reduce_fx="sum")

    def predict_step(self, batch, batch_idx):
        if self.sequence_shard is not None:  # the whole sequence's logits, gathered from the slices
            return self.sequence_shard.gather(self._logits_of_slice(batch), batch["input_ids"].shape[1])
        return self.model(**self._inputs(batch), use_cache=False).logits


class SequenceClassificationModule(HFTaskModule):
    """Cross-entropy over ``labels``; evaluation logs loss and accuracy as sample-weighted means over
    every rank's samples, and ``val_samples`` (their count: the eval set's size, each sample once)."""

    task = "sequence_classification"

    def training_step(self, batch, batch_idx):
        logits = self.model(**self._inputs(batch)).logits
        self.log("train_acc", (logits.argmax(-1) == batch["labels"]).float().mean())
        return F.cross_entropy(logits.float(), batch["labels"])

    def validation_step(self, batch, batch_idx):
        logits = self.model(**self._inputs(batch)).logits
        labels = batch["labels"]
        n = len(labels)
        self.log("val_loss", F.cross_entropy(logits.float(), labels), batch_size=n)
        self.log("val_acc", (logits.argmax(-1) == labels).float().mean(), batch_size=n)
        self.log("val_samples", n, reduce_fx="sum")

    def predict_step(self, batch, batch_idx):
        return self.model(**self._inputs(batch)).logits


TASK_MODULES = {"causal_lm": CausalLMModule, "sequence_classification": SequenceClassificationModule}


def config_dict(config) -> dict:
    """A config as plain JSON types: checkpoints load with ``weights_only=True``."""
    return json.loads(config.to_json_string(use_diff=False))
