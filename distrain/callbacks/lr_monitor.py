"""Each optimizer's learning rate in the loggers, as Lightning's ``LearningRateMonitor``."""

from __future__ import annotations

from collections import Counter

from distrain.callbacks.base import Callback

_INTERVALS = (None, "step", "epoch")


class LearningRateMonitor(Callback):
    """Sends each optimizer's learning rate to the loggers (rank 0), under Lightning's names: ``lr-<Optimizer>``
    (``lr-<Optimizer>-1`` for a second optimizer of one class; a scheduler dict's ``name`` in its place), then
    ``/pg1``, ``/pg2``, ... (or each parameter group's ``name``) where there are several groups, with ``-momentum``
    (Adam's first beta) and ``-weight_decay`` after it when asked.

    ``logging_interval``: ``step`` (every ``log_every_n_steps`` optimizer steps), ``epoch`` (when each epoch starts)
    or None (both)."""

    def __init__(self, logging_interval: str | None = None, log_momentum: bool = False, log_weight_decay: bool = False):
        if logging_interval not in _INTERVALS:
            raise ValueError(
                f"LearningRateMonitor logging_interval must be 'step', 'epoch' or None, got {logging_interval!r}"
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.logging_interval != "epoch" and trainer.global_step % trainer.log_every_n_steps == 0:
            self._log(trainer)

    def on_train_epoch_start(self, trainer, module) -> None:
        if self.logging_interval != "step":
            self._log(trainer)

    def _log(self, trainer) -> None:
        stats = self.stats(trainer)
        if stats and trainer.is_global_zero:  # straight to the loggers, as Lightning's does
            for logger in trainer.loggers:
                logger.log_metrics(stats, trainer.global_step)

    def stats(self, trainer) -> dict[str, float]:
        """What it logs now, by name (Lightning's names)."""
        scheduler_names = {id(config["scheduler"].optimizer): config.get("name") for config in trainer.lr_schedulers}
        seen: Counter = Counter()
        out: dict[str, float] = {}
        for optimizer in trainer.optimizers:
            cls = type(optimizer).__name__
            name = scheduler_names.get(id(optimizer))
            if name is None:
                seen[cls] += 1
                name = f"lr-{cls}"
            if seen[cls] > 1:
                name += f"-{seen[cls] - 1}"
            groups = optimizer.param_groups
            for i, group in enumerate(groups):
                label = group.get("name", f"pg{i + 1}" if len(groups) > 1 else None)
                key = f"{name}/{label}" if label else name
                out[key] = float(group["lr"])
                if self.log_momentum:
                    betas = "betas" in optimizer.defaults
                    out[f"{key}-momentum"] = float(group["betas"][0] if betas else group.get("momentum", 0.0))
                if self.log_weight_decay:
                    out[f"{key}-weight_decay"] = float(group.get("weight_decay", 0.0))
        return out
