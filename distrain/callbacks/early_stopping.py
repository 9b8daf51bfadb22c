"""Stop training once a monitored metric stops improving, as Lightning's ``EarlyStopping``."""

from __future__ import annotations

import math
import operator

from distrain.callbacks.base import Callback

_BETTER = {"min": operator.lt, "max": operator.gt}


class EarlyStopping(Callback):
    """Stops ``fit`` when ``monitor`` (a logged metric, e.g. ``val_loss``) has not improved by more than
    ``min_delta`` for ``patience`` checks in a row, or at once when it is not finite (``check_finite``), reaches
    ``stopping_threshold`` or goes past ``divergence_threshold``. ``mode``: ``min`` or ``max``.

    It checks after each validation, or at each training epoch's end (``check_on_train_epoch_end``; by default when
    validation runs once in every epoch, after it, as Lightning does). A stop asked at an epoch's end ends the run
    there, on every rank; one asked mid-epoch (``val_check_interval`` in steps), at the next step boundary. Its
    counts are saved in each checkpoint, so a resumed run goes on counting. ``strict``: a metric never logged is an
    error naming those that were (else the check is skipped). The reason for a stop is printed on rank 0; ``verbose``
    prints each improvement too."""

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: str = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
        log_rank_zero_only: bool = False,
    ):
        if mode not in _BETTER:
            raise ValueError(f"EarlyStopping mode must be 'min' or 'max', got {mode!r}")
        if not isinstance(patience, int) or patience < 0:
            raise ValueError(f"EarlyStopping patience must be an integer >= 0, got {patience!r}")
        if not math.isfinite(min_delta):
            raise ValueError(f"EarlyStopping min_delta must be a finite number, got {min_delta!r}")
        self.monitor = monitor
        self.min_delta = abs(min_delta)  # an improvement is by more than this, in the direction of mode
        self.patience = patience
        self.verbose = verbose
        self.mode = mode
        self.strict = strict
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.wait_count = 0
        self.stopped_epoch = 0
        self.best_score = math.inf if mode == "min" else -math.inf

    @property
    def state_key(self) -> str:
        return self._generate_state_key(monitor=self.monitor, mode=self.mode)

    # ---- when to check --------------------------------------------------------------------------------------
    def setup(self, trainer, module, stage: str) -> None:
        if self.check_on_train_epoch_end is None:  # validation once every epoch: after it, at the epoch's end
            interval = trainer.val_check_interval
            self._at_epoch_end = (interval is None or interval == 1.0) and trainer.check_val_every_n_epoch == 1
        else:
            self._at_epoch_end = self.check_on_train_epoch_end

    def on_train_epoch_end(self, trainer, module) -> None:
        if self._at_epoch_end:
            self._check(trainer)

    def on_validation_end(self, trainer, module) -> None:
        if not self._at_epoch_end and trainer.state.fn == "fit":
            self._check(trainer)

    # ---- the check --------------------------------------------------------------------------------------
    def _check(self, trainer) -> None:
        if trainer.should_stop or trainer.sanity_checking:  # the run is ending already; a sanity check's metrics
            return  # are dropped
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            if self.strict:
                logged = ", ".join(sorted(metrics)) or "none yet"
                raise RuntimeError(
                    f"EarlyStopping monitors {self.monitor!r}, which was never logged (logged: {logged}); log it, "
                    "or pass EarlyStopping(strict=False) to skip the check until it is"
                )
            return
        current = float(metrics[self.monitor])
        stop, reason = self._evaluate(current)
        if reason and (stop or self.verbose) and trainer.is_global_zero:
            print(f"distrain: EarlyStopping: {reason}", flush=True)
        if stop:
            trainer.should_stop = True
            self.stopped_epoch = trainer.current_epoch

    def _evaluate(self, current: float) -> tuple[bool, str | None]:
        better = _BETTER[self.mode]
        name = self.monitor
        if self.check_finite and not math.isfinite(current):
            return True, f"{name} = {current} is not finite (best was {self.best_score:.6g}): stopping"
        if self.stopping_threshold is not None and better(current, self.stopping_threshold):
            return True, f"{name} = {current:.6g} reached the stopping threshold {self.stopping_threshold}: stopping"
        if self.divergence_threshold is not None and better(-current, -self.divergence_threshold):
            return True, (
                f"{name} = {current:.6g} went past the divergence threshold {self.divergence_threshold}: stopping"
            )
        shifted = current + self.min_delta if self.mode == "min" else current - self.min_delta
        if better(shifted, self.best_score):
            reason = f"{name} improved to {current:.6g}" + (
                f" (by {abs(self.best_score - current):.6g})" if math.isfinite(self.best_score) else ""
            )
            self.best_score, self.wait_count = current, 0
            return False, reason
        self.wait_count += 1
        if self.wait_count >= self.patience:
            return True, (
                f"{name} did not improve in the last {self.wait_count} checks (best {self.best_score:.6g}): stopping"
            )
        return False, None

    # ---- checkpoints --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
            "best_score": self.best_score,
            "patience": self.patience,
        }

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint is someone else's file: each count is taken only when it is a number of the right kind
        (the rest stay as they are); ``patience`` stays the one given here."""
        if not isinstance(state, dict):
            return
        wait, epoch, best = state.get("wait_count"), state.get("stopped_epoch"), state.get("best_score")
        if isinstance(wait, int) and not isinstance(wait, bool) and wait >= 0:
            self.wait_count = wait
        if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0:
            self.stopped_epoch = epoch
        if isinstance(best, (int, float)) and not isinstance(best, bool) and not math.isnan(best):
            self.best_score = float(best)
