"""Histograms of every parameter and its gradient, every n optimizer steps (TensorBoard, W&B).

Sharded parameters are gathered one at a time by the strategy (``Strategy.full_parameter``: an FSDP2
DTensor's ``full_tensor()``, DeepSpeed's ``safe_get_full_fp32_param`` for a ZeRO partition) — drawn on rank 0
and dropped before the next, so no rank ever holds more than one full parameter beyond its shards.
Every rank takes part in the gathers; only rank 0 logs. It runs where gradients are final
(reduced and clipped), just before the optimizer step.
"""

from __future__ import annotations

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
        strategy = trainer.strategy  # it knows where its parameters and gradients live (shards, partitions)
        for name, param in module.named_parameters():
            weights = strategy.full_parameter(param)
            grad = strategy.full_gradient(param)
            if trainer.is_global_zero:
                for lg in loggers:
                    lg.log_histogram(f"weights/{name}", weights, step)
                    if grad is not None:
                        lg.log_histogram(f"gradients/{name}", grad, step)
            del weights, grad
