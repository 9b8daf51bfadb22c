"""Callbacks: code that runs at fixed points of the loop without the loop knowing what it does."""

from __future__ import annotations

from typing import Any


class Callback:
    """Subclass and override the hooks you need: Lightning's ``Callback`` hooks, each called where Lightning calls
    it, on every rank, with the trainer and the module (in the order of ``trainer.callbacks``). A callback's hook
    runs before the module's hook of the same name, except ``on_train_step_start`` and ``on_train_epoch_end``,
    which run after it. A callback sets ``trainer.should_stop`` to end the run, on every rank: at the next step
    boundary, or at the end of the epoch when it asks in an epoch-end or validation hook."""

    # ---- every stage ----------------------------------------------------------------------------------
    def setup(self, trainer, module, stage: str) -> None:
        """At the start of every stage (``stage``: "fit", "validate", "test" or "predict"): after the datamodule's
        ``setup``, before the module's ``setup`` and ``configure_model`` (Lightning's order)."""

    def teardown(self, trainer, module, stage: str) -> None:
        """Last in every stage (``stage`` as in ``setup``), whether it finished or failed: after the datamodule's
        ``teardown``, before the module's."""

    def on_exception(self, trainer, module, exception: BaseException) -> None:
        """When training fails: ``exception`` is the error raised (a ``CollectiveHangError`` for a collective that
        hung). ``teardown`` follows."""

    # ---- fit ----------------------------------------------------------------------------------------
    def on_fit_start(self, trainer, module) -> None:
        """Once the model, the optimizers and a resumed checkpoint are set up, before the first step."""

    def on_sanity_check_start(self, trainer, module) -> None:
        """Before the sanity check's validation batches (``num_sanity_val_steps``), after ``on_fit_start``; the
        validation hooks run during it, with ``trainer.sanity_checking`` True."""

    def on_sanity_check_end(self, trainer, module) -> None:
        """After the sanity check, its metrics dropped."""

    def on_train_start(self, trainer, module) -> None:
        """After ``on_fit_start``, before the first epoch."""

    def on_train_epoch_start(self, trainer, module) -> None:
        """At the start of each training epoch, before its first batch is read."""

    def on_train_step_start(self, trainer, module, batches: list) -> None:
        """distrain's own: this rank's micro-batches of the coming optimizer step, as the loader gave them."""

    def on_train_batch_start(self, trainer, module, batch: Any, batch_idx: int) -> None:
        """Before each micro-batch's ``training_step`` (the module's hook decides a -1 skip)."""

    def on_before_zero_grad(self, trainer, module, optimizer) -> None:
        """Once per optimizer step, before its first backward."""

    def on_before_backward(self, trainer, module, loss) -> None:
        """Before each micro-batch's backward, with its loss."""

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

    def on_train_end(self, trainer, module) -> None:
        """When training ends (its steps or epochs done, or stopped), after the last validation."""

    def on_fit_end(self, trainer, module) -> None:
        """Last in ``fit`` before ``teardown``: a checkpoint written in the background is on disk."""

    # ---- validation (in fit and in validate), test and predict: each stage's start, epoch, batches and end ----
    def on_validation_start(self, trainer, module) -> None:
        """Before each validation."""

    def on_validation_epoch_start(self, trainer, module) -> None:
        """Before the first validation batch."""

    def on_validation_batch_start(self, trainer, module, batch: Any, batch_idx: int) -> None:
        """Before each ``validation_step``."""

    def on_validation_batch_end(self, trainer, module, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After each ``validation_step``, with what it returned."""

    def on_validation_epoch_end(self, trainer, module) -> None:
        """After the last validation batch; what the module logs here is in the validation's metrics."""

    def on_validation_end(self, trainer, module) -> None:
        """After each validation, its metrics in ``trainer.callback_metrics``."""

    def on_test_start(self, trainer, module) -> None:
        """Before ``test`` runs its first batch."""

    def on_test_epoch_start(self, trainer, module) -> None:
        """Before the first test batch."""

    def on_test_batch_start(self, trainer, module, batch: Any, batch_idx: int) -> None:
        """Before each ``test_step``."""

    def on_test_batch_end(self, trainer, module, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After each ``test_step``, with what it returned."""

    def on_test_epoch_end(self, trainer, module) -> None:
        """After the last test batch."""

    def on_test_end(self, trainer, module) -> None:
        """After the test, its metrics in ``trainer.callback_metrics``."""

    def on_predict_start(self, trainer, module) -> None:
        """Before ``predict`` runs its first batch."""

    def on_predict_epoch_start(self, trainer, module) -> None:
        """Before the first batch to predict."""

    def on_predict_batch_start(self, trainer, module, batch: Any, batch_idx: int) -> None:
        """Before each ``predict_step``."""

    def on_predict_batch_end(self, trainer, module, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After each ``predict_step``, with its predictions."""

    def on_predict_epoch_end(self, trainer, module) -> None:
        """After the last batch to predict."""

    def on_predict_end(self, trainer, module) -> None:
        """When ``predict`` is done."""

    # ---- checkpoints ----------------------------------------------------------------------------------
    def on_save_checkpoint(self, trainer, module, checkpoint: dict) -> None:
        """A checkpoint is being made: keys added to ``checkpoint`` are saved (plain values and tensors), before
        the module's ``on_save_checkpoint``."""

    def on_load_checkpoint(self, trainer, module, checkpoint: dict) -> None:
        """On resume: the checkpoint's own keys (those the callbacks' and the module's ``on_save_checkpoint``
        added), after the module's ``on_load_checkpoint`` and before ``load_state_dict``."""

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
