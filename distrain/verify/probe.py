"""What a verified run records, on every rank, from the live objects: the whole parameters before the first
step and after each, the whole gradients of each step, each rank's samples, whether replicated parameters
stay equal on every rank that holds them, and the dtypes each precision stage really uses.

Whole tensors are gathered the way each strategy holds them: DTensor shards (FSDP, tensor parallel)
through ``full_tensor``, ZeRO partitions through DeepSpeed's ``safe_get_full_*``, a pipeline's stages by
merging what each rank holds. Every rank calls the same collectives in the same order; rank 0 keeps the
result and writes it (``torch.save``) for the comparison."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from distrain import compat
from distrain.callbacks.base import Callback
from distrain.data import batch_size_of


def sample_ids(batch: Any) -> list[str]:
    """One id per sample of a batch: a hash of its rows (the tokens under the attention mask, so that how much
    padding a batch got does not matter)."""
    n = batch_size_of(batch)
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == n]
    ids = []
    for i in range(n):
        digest = hashlib.sha1()
        for t in tensors:
            row = t[i]
            if mask is not None and row.dim() == 1 and row.shape == mask[i].shape:  # the mask's own row too
                row = row[mask[i].bool()]
            digest.update(row.detach().contiguous().cpu().numpy().tobytes())
        ids.append(digest.hexdigest()[:16])
    return ids


class Probe(Callback):
    """Records a run for ``distrain verify`` (see the module's docstring); rank 0 writes it to ``out``."""

    def __init__(self, out: Path, save_checkpoint_to: Path | None = None):
        self.out, self.checkpoint = out, save_checkpoint_to
        self.initial: dict[str, torch.Tensor] = {}
        self.steps: list[dict] = []
        self.samples: list[list[str]] = []  # this rank's sample ids, one list per step
        self.replicas: list[dict[str, str]] = []  # this rank's hash of each parameter it holds whole, per step
        self.dtypes: dict[str, set[str]] = {}
        self._hooks: list = []

    # ---- the loop's points ------------------------------------------------------------------------------------
    def on_fit_start(self, trainer, module) -> None:
        self.initial = whole(trainer, grads=False)
        self._watch_compute(trainer.strategy, module)

    def on_train_step_start(self, trainer, module, batches: list) -> None:
        self.samples.append([i for batch in batches for i in sample_ids(batch)])

    def on_after_backward(self, trainer, module) -> None:
        grads = whole(trainer, grads=True)
        scaler = trainer.runtime.precision.scaler
        if scaler is not None:  # fp16: still multiplied by the loss scale here
            grads = {k: v / scaler.get_scale() for k, v in grads.items()}
        self.steps.append({"grads": grads})
        if len(self.steps) == 1:
            self._audit_gradients(trainer, module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step = self.steps[-1]
        step["loss"] = float(trainer.callback_metrics["loss"])
        step["weights"] = whole(trainer, grads=False)
        self.replicas.append(_replica_hashes(trainer.strategy, module))
        if len(self.steps) == 1:
            self._audit_optimizer(trainer)
            for hook in self._hooks:
                hook.remove()

    def on_train_end(self, trainer, module) -> None:
        if self.checkpoint is not None:
            trainer.save_checkpoint(self.checkpoint)
        strategy = trainer.strategy
        ranks = strategy.all_gather_job_object(
            {
                "samples": self.samples,
                "replicas": self.replicas,
                "data_parallel_rank": strategy.data_parallel_rank,
                "sequence_slice": strategy.sequence_slice,
                "losses": [step["loss"] for step in self.steps],
                "experts": strategy.experts.held() if strategy.experts is not None else None,
            }
        )
        if len(ranks) > trainer.world_size:  # replica groups: each logged its own group's mean; the job's is theirs
            for i, step in enumerate(self.steps):
                losses = [r["losses"][i] for r in ranks if i < len(r["losses"])]
                step["loss"] = sum(losses) / len(losses)
        if trainer.is_global_zero:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            record = {
                "initial": self.initial,
                "steps": self.steps,
                "ranks": ranks,
                "dtypes": {k: sorted(v) for k, v in self.dtypes.items()},
                "strategy": type(strategy).__name__,
                "world_size": len(ranks),
                "data_parallel_size": strategy.data_parallel_size,
                "experts_count": strategy.expert_parallel_size,
                "precision": trainer.runtime.precision.name,
                "missing_from_optimizer": _missing_from_optimizer(strategy, module, trainer.optimizers),
                "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            }
            torch.save(record, self.out)

    # ---- the precision audit, from the live objects ------------------------------------------------------------
    def _see(self, stage: str, dtype: torch.dtype) -> None:
        self.dtypes.setdefault(stage, set()).add(str(dtype).replace("torch.", ""))

    def _watch_compute(self, strategy, module: nn.Module) -> None:
        """What the matmuls of the first step compute in (autocast's dtype, or the weights')."""

        def seen(_, inputs, output) -> None:
            if isinstance(output, torch.Tensor) and output.is_floating_point():
                self._see("compute", output.dtype)

        for m in module.modules():
            weight = getattr(m, "weight", None)
            if not isinstance(weight, torch.Tensor) or isinstance(m, nn.Embedding):
                continue
            if len(strategy.full_shape(weight)) == 2:
                self._hooks.append(m.register_forward_hook(seen))

    def _audit_gradients(self, trainer, module: nn.Module) -> None:
        strategy = trainer.strategy
        for p in module.parameters():
            self._see("storage", strategy.local_shard(p).dtype)
            if p.grad is not None:
                self._see("gradients", p.grad.dtype)
        self._see("reduction", strategy.reduce_dtype(trainer.model, module))

    def _audit_optimizer(self, trainer) -> None:
        for optimizer in trainer.optimizers:
            inner = getattr(optimizer, "optimizer", optimizer)  # a wrapper (DeepSpeed's ZeRO) around a torch optimizer
            for p in trainer.strategy.master_weights(optimizer):
                self._see("master weights", p.dtype)
            for state in inner.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        self._see("optimizer state", value.dtype)


def _missing_from_optimizer(strategy, module: nn.Module, optimizers: list) -> list[str]:
    """Trainable parameters no optimizer steps (only knowable where the optimizer holds the parameters)."""
    held = {id(p) for o in optimizers for g in getattr(o, "param_groups", []) for p in g["params"]}
    if not strategy.traits.optimizer_holds_parameters or not held:
        return []
    return [compat.unwrapped_name(n) for n, p in module.named_parameters() if p.requires_grad and id(p) not in held]


def _replica_hashes(strategy, module: nn.Module) -> dict[str, str]:
    """A hash of each parameter this rank holds whole (not a shard, not a partition): copies that must agree."""
    out = {}
    for name, p in module.named_parameters():
        if strategy.holds_whole(p):
            out[compat.unwrapped_name(name)] = hashlib.sha1(p.detach().float().cpu().numpy().tobytes()).hexdigest()[:16]
    return out


def whole(trainer, grads: bool) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) of the module, whole, in fp32, on CPU, under its one-process name. Every
    rank calls it; each rank returns what it could gather (all of it on rank 0)."""
    strategy, out = trainer.strategy, {}
    for name, p in trainer.module.named_parameters():
        t = strategy.full_gradient(p) if grads else strategy.full_parameter(p)
        if t is not None:
            out[compat.unwrapped_name(name)] = t.detach().float().cpu().clone()
    if strategy.traits.stages_hold_own_parameters:  # a pipeline: each stage gathers its own, and then the stages
        merged: dict[str, torch.Tensor] = {}
        for part in trainer.runtime.all_gather_object(out):
            for k, v in part.items():
                merged.setdefault(k, v)
        out = merged
    return out
