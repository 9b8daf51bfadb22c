"""A rank-0 progress bar: steps, loss, throughput, ETA."""

from __future__ import annotations

import sys

from distrain.callbacks.base import Callback


class ProgressBar(Callback):
    """A tqdm bar on global rank 0 (on stderr): the optimizer steps done out of ``estimated_stepping_batches``, with
    the values logged with ``prog_bar=True``, redrawn at most every ``refresh_seconds``. The Trainer adds one unless
    ``enable_progress_bar=False``. ``refresh_steps``: moved every so many steps (0: no bar); ``position``: tqdm's
    line."""

    def __init__(self, refresh_seconds: float = 1.0, refresh_steps: int = 1, position: int = 0):
        self.refresh_seconds, self.refresh_steps, self.position = refresh_seconds, refresh_steps, position
        self.bar = None

    def on_fit_start(self, trainer, module) -> None:
        """Opens the bar on rank 0, at the current ``global_step`` (a resumed run starts where it was)."""
        if not trainer.is_global_zero or not self.refresh_steps:
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=trainer.estimated_stepping_batches or None,
            initial=trainer.global_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=self.refresh_seconds,
            position=self.position,
            file=sys.stderr,
        )

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        """Moves the bar to ``global_step`` and shows the progress-bar metrics."""
        if self.bar is None or trainer.global_step % self.refresh_steps:
            return
        self.bar.update(trainer.global_step - self.bar.n)
        shown = {k: v for k, v in trainer.progress_bar_metrics.items()}
        if shown:
            self.bar.set_postfix(
                {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in shown.items()}, refresh=False
            )

    def on_train_end(self, trainer, module) -> None:
        """Closes the bar (``on_exception`` too)."""
        if self.bar is not None:
            self.bar.update(trainer.global_step - self.bar.n)
            self.bar.close()
            self.bar = None

    on_exception = lambda self, trainer, module, exception: self.on_train_end(trainer, module)  # noqa: E731

    def __getstate__(self):
        return {**self.__dict__, "bar": None}
