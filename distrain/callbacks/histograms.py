"""Histograms of every parameter and its gradient, every n optimizer steps (TensorBoard, W&B).

Sharded parameters are gathered one at a time — an FSDP2 DTensor with ``full_tensor()``, a ZeRO
partition with DeepSpeed's ``safe_get_full_fp32_param`` / ``safe_get_full_grad`` — drawn on rank 0
and dropped before the next, so no rank ever holds more than one full parameter beyond its shards.
Every rank takes part in the gathers; only rank 0 logs. It runs where gradients are final
(reduced and clipped), just before the optimizer step.
"""

from __future__ import annotations

import torch

from distrain.callbacks.base import Callback
from distrain.loggers.base import Logger


class ParameterHistograms(Callback):
    def __init__(self, every_n_steps: int):
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"histogram_every_n_steps must be a positive integer, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        step = trainer.global_step + 1  # the step being made
        if step % self.every_n_steps:
            return
        # the same on every rank (each builds the same loggers), so the gathers below stay matched
        loggers = [lg for lg in trainer.loggers if type(lg).log_histogram is not Logger.log_histogram]
        if not loggers:
            return
        for name, param in module.named_parameters():
            weights = full_value(param)
            grad = full_grad(param)
            if trainer.is_global_zero:
                for lg in loggers:
                    lg.log_histogram(f"weights/{name}", weights, step)
                    if grad is not None:
                        lg.log_histogram(f"gradients/{name}", grad, step)
            del weights, grad


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_value(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter (a collective for sharded ones: call on every rank)."""
    if hasattr(param, "ds_id"):  # a ZeRO-3 partition
        from deepspeed.utils import safe_get_full_fp32_param

        return safe_get_full_fp32_param(param)
    if _is_dtensor(param):
        return param.detach().full_tensor()
    return param.detach()


def full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole gradient, or None (a collective for sharded ones: call on every rank)."""
    if hasattr(param, "ds_id") or hasattr(param, "_hp_mapping"):  # DeepSpeed ZeRO keeps grads in its partitions
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(param)
    if param.grad is None:
        return None
    return param.grad.full_tensor() if _is_dtensor(param.grad) else param.grad
