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

from distrain.callbacks.base import Callback
from distrain.data import batch_size_of

#: wrapper names that are not the user's (activation checkpointing, torch.compile)
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def plain_name(name: str) -> str:
    for part in _WRAPPERS:
        name = name.replace(part, "")
    return name


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
        self._watch_compute(module)

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
        self.replicas.append(_replica_hashes(module))
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
                "precision": trainer.runtime.precision.name,
                "missing_from_optimizer": _missing_from_optimizer(module, trainer.optimizers),
                "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            }
            torch.save(record, self.out)

    # ---- the precision audit, from the live objects ------------------------------------------------------------
    def _see(self, stage: str, dtype: torch.dtype) -> None:
        self.dtypes.setdefault(stage, set()).add(str(dtype).replace("torch.", ""))

    def _watch_compute(self, module: nn.Module) -> None:
        """What the matmuls of the first step compute in (autocast's dtype, or the weights')."""

        def seen(_, inputs, output) -> None:
            if isinstance(output, torch.Tensor) and output.is_floating_point():
                self._see("compute", output.dtype)

        for m in module.modules():
            weight = getattr(m, "weight", None)
            shape = getattr(weight, "ds_shape", getattr(weight, "shape", ()))  # ZeRO-3: the whole shape
            if isinstance(weight, torch.Tensor) and len(shape) == 2 and not isinstance(m, nn.Embedding):
                self._hooks.append(m.register_forward_hook(seen))

    def _audit_gradients(self, trainer, module: nn.Module) -> None:
        for p in module.parameters():
            storage = getattr(p, "ds_tensor", p)  # ZeRO-3: this rank's partition
            self._see("storage", storage.dtype)
            if p.grad is not None:
                self._see("gradients", p.grad.dtype)
        self._see("reduction", _reduction_dtype(trainer, module))

    def _audit_optimizer(self, trainer) -> None:
        for optimizer in trainer.optimizers:
            inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO wraps a torch optimizer
            # ZeRO steps flat fp32 partitions, and empties the inner optimizer's groups between steps
            masters = getattr(optimizer, "fp32_partitioned_groups_flat", None) or getattr(
                optimizer, "single_partition_of_fp32_groups", None
            )
            for p in masters or [p for group in inner.param_groups for p in group["params"]]:
                self._see("master weights", p.dtype)
            for state in inner.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        self._see("optimizer state", value.dtype)


def _reduction_dtype(trainer, module: nn.Module) -> torch.dtype:
    """The dtype gradients are reduced in: FSDP2's live mixed-precision policy, DeepSpeed's engine, a DDP
    compression hook; else the gradients' own."""
    engine = trainer.model
    if hasattr(engine, "communication_data_type"):
        return engine.communication_data_type
    for m in trainer.model.modules():
        state = getattr(m, "_get_fsdp_state", None)
        if state is not None:
            policy = state()._mp_policy
            return policy.reduce_dtype or policy.param_dtype or next(module.parameters()).dtype
    hook = getattr(trainer.strategy, "ddp_comm_hook", None)
    if hook in ("bf16_compress", "fp16_compress"):
        return torch.bfloat16 if hook == "bf16_compress" else torch.float16
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return grads[0].dtype if grads else next(module.parameters()).dtype


def _missing_from_optimizer(module: nn.Module, optimizers: list) -> list[str]:
    """Trainable parameters no optimizer steps (only knowable where the optimizer holds the parameters)."""
    held = {id(p) for o in optimizers for g in getattr(o, "param_groups", []) for p in g["params"]}
    if any(hasattr(p, "ds_id") for p in module.parameters()) or not held:
        return []
    return [plain_name(n) for n, p in module.named_parameters() if p.requires_grad and id(p) not in held]


def _replica_hashes(module: nn.Module) -> dict[str, str]:
    """A hash of each parameter this rank holds whole (not a shard, not a partition): copies that must agree."""
    out = {}
    for name, p in module.named_parameters():
        if hasattr(p, "ds_id") or hasattr(p, "full_tensor"):
            continue
        out[plain_name(name)] = hashlib.sha1(p.detach().float().cpu().numpy().tobytes()).hexdigest()[:16]
    return out


def whole(trainer, grads: bool) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) of the module, whole, in fp32, on CPU, under its one-process name. Every
    rank calls it; each rank returns what it could gather (all of it on rank 0)."""
    module = trainer.module
    zero = any(hasattr(p, "ds_id") for p in module.parameters()) or hasattr(trainer.model, "communication_data_type")
    out = {}
    for name, p in module.named_parameters():
        if zero:
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

            t = safe_get_full_grad(p) if grads else safe_get_full_fp32_param(p)
            if t is None:  # stage 0 steps a plain torch optimizer: the parameter itself
                t = p.grad if grads else p
        else:
            t = p.grad if grads else p
        if t is None:
            continue
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[plain_name(name)] = t.detach().float().cpu().clone()
    if getattr(trainer.strategy, "runner", None) is not None:  # a pipeline: each stage holds its own parameters
        merged: dict[str, torch.Tensor] = {}
        for part in trainer.runtime.all_gather_object(out):
            for k, v in part.items():
                merged.setdefault(k, v)
        out = merged
    return out
