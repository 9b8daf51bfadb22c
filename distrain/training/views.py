"""What a ``Trainer`` shows of itself, under Lightning's names: where this process is (rank, world size), where the
loop is (step, epoch, limits), and the views callbacks and modules read (metrics, the checkpoint callback, the
loggers). Read-only, over the parts ``training/assembly.py`` builds; the loop itself is in ``distrain/trainer.py``."""

from __future__ import annotations

import math
from typing import Any

from distrain.callbacks import ModelCheckpoint
from distrain.config import redacted


class TrainerViews:
    is_global_zero = property(lambda self: self.runtime.is_global_zero, doc="Whether this process is global rank 0.")
    global_rank = property(lambda self: self.runtime.global_rank, doc="This process's rank among all ranks.")
    local_rank = property(lambda self: self.runtime.local_rank, doc="This process's rank on its node.")
    world_size = property(lambda self: self.runtime.world_size, doc="The number of ranks.")
    num_devices = property(lambda self: self.runtime.nprocs, doc="Processes per node (Lightning's name).")
    num_nodes = property(lambda self: self.runtime.num_nodes, doc="The number of nodes.")
    data_parallel_size = property(
        lambda self: self.runtime.strategy.data_parallel_size,
        doc="How many ranks see different data: the data is sharded over them.",
    )
    strategy = property(lambda self: self.runtime.strategy, doc="The run's ``Strategy``.")
    lightning_module = property(lambda self: self.module, doc="The module being trained (Lightning's name).")
    global_step = property(
        lambda self: self.progress.global_step, doc="The optimizer steps taken so far (a resumed run's included)."
    )
    current_epoch = property(lambda self: self.progress.epoch, doc="The epoch the loop is in, counted from 0.")
    loggers = property(lambda self: self.metrics.loggers, doc="The loggers metrics go to (from rank 0).")
    logger = property(
        lambda self: next(iter(self.metrics.loggers), None),
        doc="The first of ``loggers`` (TensorBoard, by default), or None.",
    )
    precision = property(
        lambda self: self.runtime.precision.name,
        doc="The precision the run trains in (``bf16-mixed``...), Lightning's.",
    )
    preempted = property(
        lambda self: self.stop.preempted, doc="The signal that stopped the run, if one did (None otherwise)."
    )
    max_steps = property(
        lambda self: self.loop.max_steps,
        doc="The most optimizer steps the run takes (-1: no limit, ``max_epochs`` decides).",
    )
    max_epochs = property(
        lambda self: self.loop.max_epochs, doc="The most epochs the run takes (None: ``max_steps`` decides)."
    )
    log_every_n_steps = property(
        lambda self: self.metrics.log_every_n_steps, doc="How often the step's metrics go to the loggers."
    )
    check_val_every_n_epoch = property(
        lambda self: self.loop.check_val_every_n_epoch, doc="Fit validates in every n-th epoch."
    )
    val_check_interval = property(
        lambda self: self.loop.val_check_interval,
        doc="How often fit validates: steps, a fraction of an epoch, or None (once an epoch).",
    )
    # the config that checkpoints store and loggers get as hyperparameters: kept redacted (no credentials)
    run_config = property(
        lambda self: self._run_config,
        lambda self, v: setattr(self, "_run_config", redacted(v)),
        doc="The resolved config (the CLI sets it), redacted: checkpoints store it, loggers get it as hyperparameters.",
    )

    @property
    def callback_metrics(self) -> dict[str, float]:
        """The latest value of every metric logged (steps, epochs, validations), by name: what ``ModelCheckpoint``
        monitors and a ``ReduceLROnPlateau`` scheduler reads."""
        return self.metrics.callback_metrics

    @property
    def logged_metrics(self) -> dict[str, Any]:
        """The last record sent to the loggers: a logging step's (loss, lr, throughput, memory, the module's
        values), an epoch's or a validation's."""
        return self.metrics.logged_metrics

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """What the progress bar shows, as of the last logging step: the loss (or the module's own loss logged with
        ``prog_bar=True``), tokens per second, and the module's ``prog_bar=True`` values."""
        return self.metrics.progress_bar_metrics

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The first ``ModelCheckpoint`` among the callbacks, or None."""
        return next((c for c in self.callbacks if isinstance(c, ModelCheckpoint)), None)

    @property
    def estimated_stepping_batches(self) -> int | None:
        """The optimizer steps the run will take: ``max_steps``, else the epochs' steps from the train loader's
        length and the accumulation schedule; None when that is unknown (a loader with no length)."""
        if self.loop.max_steps != -1:
            return self.loop.max_steps
        n = self.loop_state.num_batches
        if n is None or self.loop.max_epochs is None:
            return None
        return sum(math.ceil(n / self.loop.accumulate_for(e)) for e in range(self.loop.max_epochs))
