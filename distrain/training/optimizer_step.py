"""The optimizer step of automatic optimization, once the step's backward passes have run: the gradient norm (clipped
where the run clips), the check that the step is finite as ``on_nonfinite`` says, and the step itself through
Lightning's ``optimizer_step`` hook (manual optimization's is in ``training/manual.py``). Free functions over the
Trainer's public parts, as ``training/hooks.py``."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from distrain.module import overrides
from distrain.training.hooks import call_hook
from distrain.training.nonfinite import step_is_finite


def gradient_norm(trainer, optimizer) -> Any:
    """The global gradient norm: clipped to ``gradient_clip_val`` when set; else measured only to check it is
    finite."""
    rt, loop = trainer.runtime, trainer.loop
    if overrides(trainer.module, "configure_gradient_clipping"):  # the module clips; the loop measures after
        trainer.module.configure_gradient_clipping(optimizer, loop.gradient_clip_val, loop.gradient_clip_algorithm)
    elif loop.gradient_clip_val:  # by norm, or each element by value
        by = rt.strategy.clip_gradient_values if loop.gradient_clip_algorithm == "value" else rt.strategy.clip_gradients
        return by(trainer.model, optimizer, loop.gradient_clip_val)
    if loop.on_nonfinite == "ignore" or rt.precision.scaler is not None:
        return None  # fp16's GradScaler skips overflowed steps itself: that is how it finds its scale
    return rt.strategy.gradient_norm(trainer.model, optimizer)


def apply_step(trainer, optimizer, grad_norm: Any, step_loss: torch.Tensor, batch_idx: int) -> bool:
    """Step the optimizer unless the step must be skipped; returns whether it was applied.
    - fp16's GradScaler skips an overflowed step itself and lowers its scale (that is how it finds its
      scale; the overflow flag is agreed across ranks): a non-finite norm there is not an error;
    - an engine that checks (DeepSpeed ZeRO) skips inside its step: the check after it stops or reports;
    - an optimizer that skips on the device when handed ``found_inf`` (torch's fused ones) is handed it: no host
      sync, and the host reads the flag a step later (``training/nonfinite.DeviceCheck``); it returns True;
    - otherwise the loop checks first. The norm is global (every rank computed the same one), so every
      rank decides alike with no collective of its own (on_nonfinite="ignore" skips the host sync)."""
    rt, nonfinite = trainer.runtime, trainer.nonfinite
    scaler = rt.precision.scaler
    engine_checks = rt.strategy.traits.engine_skips_nonfinite
    guard = contextlib.nullcontext()
    if scaler is None and not engine_checks:
        if nonfinite.applies(optimizer, grad_norm):  # skipped on the device; the host reads it next step
            guard = nonfinite.guarding(optimizer, grad_norm, step_loss, trainer.global_step + 1)
        elif not _finite(trainer, grad_norm, step_loss):
            return False
    scale = scaler.get_scale() if scaler is not None else None
    call_hook(trainer, "on_before_optimizer_step", optimizer)
    closure = lambda: step_loss  # noqa: E731  (Lightning's closure: here forward and backward have run)
    with guard:
        trainer.module.optimizer_step(trainer.current_epoch, batch_idx, trainer.loop_optimizers[0], closure)
    if scaler is not None:
        return scaler.get_scale() >= scale
    return not engine_checks or _finite(trainer, grad_norm, step_loss)


def _finite(trainer, grad_norm: Any, step_loss: torch.Tensor) -> bool:
    """False when the step must be skipped (``training/nonfinite.py``)."""
    step = trainer.global_step + 1
    return step_is_finite(trainer.loop.on_nonfinite, grad_norm, step_loss, step, trainer.runtime, trainer.checkpoints)
