"""Stop training after a time budget, as Lightning's ``Timer`` (``Trainer(max_time=...)``)."""

from __future__ import annotations

import math
import re
import time
from datetime import timedelta

from distrain.callbacks.base import Callback

_DAYS_HOURS_MINUTES_SECONDS = re.compile(r"^(\d+):(\d{1,2}):(\d{1,2}):(\d{1,2})$")


def as_duration(duration: str | timedelta | dict) -> timedelta:
    """Lightning's forms: ``"DD:HH:MM:SS"``, a ``timedelta``, or a dict of its arguments (``{"hours": 12}``)."""
    if isinstance(duration, timedelta):
        out = duration
    elif isinstance(duration, str) and (match := _DAYS_HOURS_MINUTES_SECONDS.match(duration.strip())):
        days, hours, minutes, seconds = map(int, match.groups())
        out = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    elif isinstance(duration, dict):
        try:
            out = timedelta(**duration)
        except TypeError as e:
            raise ValueError(f"max_time {duration!r}: {e}") from None
    else:
        raise ValueError(f"max_time is 'DD:HH:MM:SS', a timedelta or a dict such as {{'hours': 12}}, got {duration!r}")
    if out.total_seconds() <= 0:
        raise ValueError(f"max_time must be longer than zero, got {duration!r}")
    return out


class Timer(Callback):
    """Stops ``fit`` once its training time reaches ``duration``, checked after each optimizer step (``interval``
    "step") or at each epoch's end ("epoch"); with no ``duration`` (Lightning's default) it only keeps the time. The
    time spent so far is saved in each checkpoint, so a resumed run spends what is left. Validation inside ``fit``
    counts, as it does in Lightning."""

    def __init__(self, duration: str | timedelta | dict | None = None, interval: str = "step", verbose: bool = True):
        if interval not in ("step", "epoch"):
            raise ValueError(f"Timer interval must be 'step' or 'epoch', got {interval!r}")
        self.duration = as_duration(duration) if duration is not None else None
        self.interval = interval
        self.verbose = verbose
        self._spent_before = 0.0  # by the runs this one resumed
        self._started: float | None = None

    def time_elapsed(self) -> float:
        """Seconds of training so far, the resumed runs' included."""
        running = time.monotonic() - self._started if self._started is not None else 0.0
        return self._spent_before + running

    def time_remaining(self) -> float | None:
        """Seconds left of ``duration`` (None: none was given)."""
        return None if self.duration is None else self.duration.total_seconds() - self.time_elapsed()

    def on_train_start(self, trainer, module) -> None:
        self._started = time.monotonic()

    def on_train_end(self, trainer, module) -> None:
        self._spent_before, self._started = self.time_elapsed(), None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.interval == "step":
            self._check(trainer)

    def on_train_epoch_end(self, trainer, module) -> None:
        if self.interval == "epoch":
            self._check(trainer)

    def _check(self, trainer) -> None:
        if trainer.should_stop or self.duration is None or self.time_remaining() > 0:
            return
        trainer.should_stop = True
        if self.verbose and trainer.is_global_zero:
            spent = timedelta(seconds=round(self.time_elapsed()))
            print(f"distrain: max_time {self.duration} reached ({spent} spent training): stopping", flush=True)

    def state_dict(self) -> dict:
        return {"time_elapsed": {"train": self.time_elapsed()}}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint is someone else's file: the time is taken only when it is a finite number >= 0."""
        spent = state.get("time_elapsed", {}) if isinstance(state, dict) else {}
        spent = spent.get("train") if isinstance(spent, dict) else None
        if isinstance(spent, (int, float)) and not isinstance(spent, bool) and math.isfinite(spent) and spent >= 0:
            self._spent_before = float(spent)
