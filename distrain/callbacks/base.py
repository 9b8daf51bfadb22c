"""Callbacks: code that runs at fixed points of the loop without the loop knowing what it does."""

from __future__ import annotations

from typing import Any


class Callback:
    """Subclass and override the hooks you need. The Trainer calls them on every rank, each with itself and the
    module (in the order of ``trainer.callbacks``), before the module's hook of the same name, except
    ``on_train_step_start``, ``on_validation_end`` and ``on_train_epoch_end``, which run after it. A callback sets
    ``trainer.should_stop`` to end the run, on every rank, at a step boundary."""

    def setup(self, trainer, module, stage: str) -> None:
        """At the start of every stage (``stage``: "fit", "validate", "test" or "predict"): after the module's
        ``setup`` and ``configure_model``, before the strategy sets the model up."""

    def on_fit_start(self, trainer, module) -> None:
        """Once the model, the optimizers and a resumed checkpoint are set up, before the first step."""

    def on_train_epoch_start(self, trainer, module) -> None:
        """At the start of each training epoch, before its first batch is read."""

    def on_train_step_start(self, trainer, module, batches: list) -> None:
        """This rank's micro-batches of the coming optimizer step, as the loader gave them."""

    def on_after_backward(self, trainer, module) -> None:
        """The step's gradients are accumulated and reduced across ranks, not yet unscaled nor clipped."""

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        """Gradients are final here (reduced, clipped)."""

    def on_train_batch_end(self, trainer, module, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Called after each *optimizer step* (not each accumulation micro-step)."""

    def on_train_epoch_end(self, trainer, module) -> None:
        """At the end of each training epoch: after its validation (when validation runs once per epoch), the
        module's ``on_train_epoch_end`` and the epoch schedulers. A checkpoint saved here resumes at the next
        epoch."""

    def on_validation_end(self, trainer, module) -> None:
        """After each validation during ``fit``, its metrics in ``trainer.callback_metrics`` (not called by
        ``Trainer.validate``)."""

    def on_train_end(self, trainer, module) -> None:
        """When training ends (its steps or epochs done, or stopped), after the last validation."""

    def on_exception(self, trainer, module, exception: BaseException) -> None:
        """When training fails: ``exception`` is the error raised (a ``CollectiveHangError`` for a collective that
        hung). ``teardown`` follows."""

    def teardown(self, trainer, module, stage: str) -> None:
        """Last in every stage (``stage`` as in ``setup``), whether it finished or failed, before the module's
        ``teardown``."""

    @property
    def state_key(self) -> str:
        """The key this callback's ``state_dict`` is saved under in a checkpoint: its class name. A callback that
        may run beside another of its class returns ``_generate_state_key(...)`` of what tells them apart."""
        return type(self).__name__

    def _generate_state_key(self, **kwargs: Any) -> str:
        """``ClassName{'key': value, ...}``, as Lightning writes it (so a Lightning checkpoint's key matches)."""
        return f"{type(self).__qualname__}{repr(kwargs)}"

    def state_dict(self) -> dict:
        """What this callback saves in each checkpoint (plain values); empty here."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """On resume: what ``state_dict`` saved, read back from the checkpoint."""
