"""Validation, test and prediction loops.

Under strategies whose forward runs collectives (FSDP, ZeRO-3: each layer all-gathers its
parameters), every rank must run as many forwards as the busiest one, or the others wait forever.
A rank that runs out of batches repeats its last one with logging muted, so each sample still
counts exactly once.
"""

from __future__ import annotations

import torch

from distrain.data import batch_size_of, move_to_device
from distrain.training.metrics import MetricsLogger

DEFAULT_LOSS_NAMES = {"validation_step": "val_loss", "test_step": "test_loss"}


class Evaluator:
    def __init__(self, runtime, metrics: MetricsLogger):
        self.runtime = runtime
        self.metrics = metrics

    def run(self, module, model, step_name: str, loader, limit: int | None) -> dict[str, float]:
        """``step_name`` (validation_step or test_step) over ``loader``: the epoch metrics, reduced
        over every rank's samples. ``model`` is the strategy-wrapped module, or None to call
        ``module`` directly."""
        rt = self.runtime
        collector = self.metrics.collector
        was_training = module.training
        module.eval()
        collector.stage = "validate"
        default_name = DEFAULT_LOSS_NAMES[step_name]
        num_batches = len(loader) if limit is None else min(limit, len(loader))
        collective = rt.strategy.collective_forward and model is not None
        # Sharded forwards all-gather: every rank must run as many steps as the busiest one.
        num_steps = int(rt.all_reduce(torch.tensor(num_batches), op="max")) if collective else num_batches
        batches = iter(loader)
        batch = None
        with torch.no_grad():
            for batch_idx in range(num_steps):
                collector.muted = batch_idx >= num_batches
                if not collector.muted:
                    batch = move_to_device(next(batches), rt.device)
                if batch is None:  # this rank got no evaluation data at all
                    break
                collector.current_batch_size = batch_size_of(batch)
                with rt.autocast():
                    output = (
                        model(step_name, batch, batch_idx)
                        if collective
                        else getattr(module, step_name)(batch, batch_idx)
                    )
                if isinstance(output, torch.Tensor) and output.dim() == 0 and default_name not in collector.epoch_sums:
                    collector.log(default_name, output, sync_dist=True)
        collector.muted = False
        metrics = collector.pop_epoch_metrics()
        collector.stage = "train"
        module.train(was_training)
        return metrics

    def predict(self, module, model, loader) -> list:
        """This rank's predictions, in its sampler order."""
        module.eval()
        step = (lambda b, i: model("predict_step", b, i)) if model is not None else module.predict_step
        with torch.no_grad(), self.runtime.autocast():
            return [step(move_to_device(batch, self.runtime.device), i) for i, batch in enumerate(loader)]
