"""What the training loop keeps between its steps, declared once, with its types (``trainer.loop_state``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoopState:
    """The loop's own bookkeeping, as it is before any stage; ``fit`` and the loop change it, nothing else does."""

    num_batches: int | None = None
    """The train loader's batches per epoch, ``limit_train_batches`` applied (None: a loader without a length)."""
    val_every: int | None = None
    """fit's validations inside its epochs (``LoopOptions.validation_interval``), decided once ``num_batches`` is
    known: None, at the end of each validated epoch."""
    first_micro_batch: bool = False
    """At a step's first micro-batch, until ``on_before_zero_grad`` ran for it: once per optimizer step."""
    stopping: bool = False
    """The ranks agreed to stop (a signal, ``should_stop``, ``max_time``) at this step or epoch boundary."""
    told_minimum: bool = False
    """A stop asked before ``min_epochs``/``min_steps`` ran out was said on the console, once."""
    last_val_step: int = -1
    """The global step of fit's last validation: fit ends with one unless it just ran one."""
    announce_start: bool = False
    """fit resumed or was restarted: the console says how long its first step took to come."""
    iterator_drew: bool = False
    """The next epoch's loader iterator was made (its seed drawn) in a search whose random streams were then set back
    (Lightning's ``lr_find`` makes it so): the next epoch's draws nothing when made."""
