"""Callbacks: code that runs at fixed points of the loop without the loop knowing what it does."""

from __future__ import annotations

from typing import Any


class Callback:
    def setup(self, trainer, module, stage: str) -> None: ...
    def on_fit_start(self, trainer, module) -> None: ...
    def on_train_epoch_start(self, trainer, module) -> None: ...
    def on_train_step_start(self, trainer, module, batches: list) -> None:
        """This rank's micro-batches of the coming optimizer step, as the loader gave them."""

    def on_after_backward(self, trainer, module) -> None:
        """The step's gradients are accumulated and reduced across ranks, not yet unscaled nor clipped."""

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        """Gradients are final here (reduced, clipped)."""

    def on_train_batch_end(self, trainer, module, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Called after each *optimizer step* (not each accumulation micro-step)."""

    def on_train_epoch_end(self, trainer, module) -> None: ...
    def on_validation_end(self, trainer, module) -> None: ...
    def on_train_end(self, trainer, module) -> None: ...
    def on_exception(self, trainer, module, exception: BaseException) -> None: ...
    def teardown(self, trainer, module, stage: str) -> None: ...

    @property
    def state_key(self) -> str:
        return type(self).__name__

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...
