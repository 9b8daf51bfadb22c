"""The ``Trainer``'s arguments, checked and made what the loop reads (``checked_arguments``, ``LoopOptions``): the
numbers' bounds, the policies' names, Lightning's ``fast_dev_run`` and ``max_time``; Lightning's arguments distrain
does not run, the keywords that are neither the Trainer's nor the strategy's, and torch's process-wide flags.

Each keyword is taken or refused in one line before anything starts; none is dropped without a word (an option of
the multi-process strategies was, on one process; a typo went on to DistributedDataParallel and failed in the
ranks)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from distrain.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint, Timer
from distrain.config import Bounds, canonical_precision
from distrain.training.anomalies import POLICIES as ANOMALY_POLICIES
from distrain.training.defaults import callback_list
from distrain.training.nonfinite import POLICIES as NONFINITE_POLICIES

#: what each numeric argument of ``Trainer`` accepts (None is always "not set"), as the config's keys declare theirs
TRAINER_NUMBERS = {
    "num_nodes": Bounds(gt=0),
    "max_epochs": Bounds(gt=0),
    "max_steps": Bounds(gt=0, means={-1: "no limit: max_epochs decides"}),
    "gradient_clip_val": Bounds(ge=0, means={0: "no clipping"}),
    "val_check_interval": Bounds(gt=0),
    "log_every_n_steps": Bounds(gt=0),
    "seed": Bounds(ge=0),
    "limit_train_batches": Bounds(gt=0),
    "limit_val_batches": Bounds(ge=0, means={0: "no validation"}),
    "limit_test_batches": Bounds(ge=0),
    "limit_predict_batches": Bounds(ge=0),
    "check_val_every_n_epoch": Bounds(gt=0),
    "num_sanity_val_steps": Bounds(ge=0, means={-1: "every validation batch"}),
    "min_epochs": Bounds(ge=0),
    "min_steps": Bounds(ge=0),
    "histogram_every_n_steps": Bounds(gt=0),
    "straggler_threshold": Bounds(gt=0, means={0: "no straggler check"}),
    "anomaly_zscore": Bounds(gt=0),
    "anomaly_window": Bounds(gt=0),
}
#: the callbacks ``fast_dev_run`` leaves out, as Lightning does: they write files, log or end the run
WRITES_OR_STOPS = (ModelCheckpoint, EarlyStopping, LearningRateMonitor, Timer)

#: Lightning ``Trainer`` arguments distrain does not run: the value that means "not used" (accepted), and what to
#: do instead of any other
NOT_RUN: dict[str, tuple[Any, str]] = {
    "reload_dataloaders_every_n_epochs": (0, "the loaders are made once per stage; make an epoch-dependent dataset"),
    "barebones": (False, "turn off what you do not want: logger=False, enable_checkpointing=False, ..."),
    "plugins": (None, "precision and cluster environments are arguments here: precision=, and the launcher"),
    "model_registry": (None, "upload the checkpoint or its export (`distrain convert`) yourself"),
}


def check_keywords(strategy: Any, keywords: dict[str, Any], trainer_arguments: set[str]) -> None:
    """``keywords`` are Lightning arguments distrain runs without (at their "not used" value) or options of the
    strategy (``auto``: of any strategy it may choose). Anything else is a ValueError naming it, with the Trainer
    argument or option it may have meant."""
    from distrain.strategies.registry import check_options

    for key, value in keywords.items():
        if key in NOT_RUN:
            unused, instead = NOT_RUN[key]
            if value != unused:
                raise ValueError(f"Trainer({key}={value!r}): distrain does not run Lightning's {key}; {instead}")
    check_options(strategy, [k for k in keywords if k not in NOT_RUN], also_meant=trainer_arguments)


@dataclass(frozen=True)
class ProcessSettings:
    """Lightning's process-wide torch flags, set in each rank when a stage starts: ``deterministic`` (True, "warn"
    or False: ``torch.use_deterministic_algorithms``; None leaves it), ``benchmark`` (cuDNN's autotuner; None: off
    when deterministic, else left) and ``detect_anomaly`` (autograd's anomaly mode)."""

    deterministic: bool | str | None = None
    benchmark: bool | None = None
    detect_anomaly: bool = False

    def __post_init__(self):
        if self.deterministic not in (None, True, False, "warn"):
            raise ValueError(f"deterministic is True, False, 'warn' or None, got {self.deterministic!r}")
        if self.deterministic:  # cuBLAS is deterministic only with a fixed workspace (torch's reproducibility notes)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    def apply(self) -> None:
        if self.deterministic is not None:
            torch.use_deterministic_algorithms(bool(self.deterministic), warn_only=self.deterministic == "warn")
        benchmark = False if self.benchmark is None and self.deterministic else self.benchmark
        if benchmark is not None:
            torch.backends.cudnn.benchmark = benchmark
        if self.detect_anomaly:
            torch.autograd.set_detect_anomaly(True)


@dataclass
class TrainerState:
    """What runs now, as Lightning's ``trainer.state``: ``fn`` is the entry point (``fit``, ``validate``, ``test``,
    ``predict``), ``stage`` what that entry point is doing (``train``, ``validate``, ``test``, ``predict``)."""

    fn: str | None = None
    stage: str | None = None


@dataclass
class LoopOptions:
    """How long to train and how each optimizer step is made."""

    max_epochs: int | None
    max_steps: int
    accumulation: dict[int, int]
    """epoch → micro-batches per optimizer step (from that epoch on)."""
    gradient_clip_val: float | None
    gradient_clip_algorithm: str
    """``norm`` (the global norm scaled down to ``gradient_clip_val``) or ``value`` (each element clamped)."""
    val_check_interval: int | float | None
    check_val_every_n_epoch: int | None
    """Fit validates in every n-th epoch; None (Lightning's): in every epoch, an int ``val_check_interval`` counting the
    batches of the whole run rather than of each epoch."""
    limit_train_batches: int | float | None
    """Batches of each training epoch: a count, or a fraction of the loader (None: all); as the ``limit_*`` of the
    other stages."""
    limit_val_batches: int | float | None
    limit_test_batches: int | float | None
    limit_predict_batches: int | float | None
    num_sanity_val_steps: int
    """Validation batches run before training, their metrics dropped (-1: all of them)."""
    min_epochs: int | None
    min_steps: int | None
    """A stop a callback asks for (``should_stop``: early stopping, ``max_time``) waits until both are reached."""
    use_distributed_sampler: bool
    on_nonfinite: str
    """A non-finite loss or gradient norm: ``stop`` the run (the default), ``skip`` the step on every
    rank, or ``ignore`` it (no check, no host sync per step)."""
    overfit: bool = False
    """Lightning's ``overfit_batches``: the training data in its order, unshuffled (the limits hold the count)."""
    fast_dev_run: bool = False
    """Lightning's smoke test (its limits hold the batches): a search of its own (the learning-rate finder) is
    skipped, as Lightning skips it."""
    validates_as_lightning: bool = False
    """Lightning's schedule of fit's validations (``distrain.lightning``): ``val_check_interval`` counts the batches of
    each epoch (the count starts again with each), a validation inside an epoch runs after ``on_train_batch_end``, and
    none is added after the last step. distrain's own: optimizer steps over the whole run, the validation before
    ``on_train_batch_end`` (whose callbacks see its metrics), and every fit ends with a validation score."""

    def accumulate_for(self, epoch: int) -> int:
        return self.accumulation[max(e for e in self.accumulation if e <= epoch)]

    def val_every_steps(self, num_batches: int | None) -> int | None:
        """Validation every so many optimizer steps (None: at each validated epoch's end); a fractional
        ``val_check_interval`` is of an epoch's ``num_batches``."""
        v = self.val_check_interval
        if v is None:
            return None
        if isinstance(v, float) and v <= 1.0:
            if num_batches is None:
                raise ValueError("a fractional val_check_interval needs a train loader with a length")
            return max(1, int(num_batches * v / self.accumulate_for(0)))
        return int(v)

    def val_check_batch(self, num_batches: int | None) -> int | None:
        """Lightning's ``val_check_batch``: validation after each this many batches of an epoch (None: at each validated
        epoch's end, as a fraction of 1.0 means); a fraction is of the epoch's ``num_batches``."""
        v = self.val_check_interval
        if v is None or (isinstance(v, float) and v == 1.0):
            return None
        if isinstance(v, float) and v < 1.0:
            if num_batches is None:
                raise ValueError("a fractional val_check_interval needs a train loader with a length")
            return max(1, int(num_batches * v))
        if self.check_val_every_n_epoch is not None and num_batches is not None and int(v) > num_batches:
            raise ValueError(  # Lightning's refusal: it would never validate
                f"`val_check_interval` ({v}) must be less than or equal to the number of the training batches "
                f"({num_batches}). If you want to disable validation set `limit_val_batches` to 0.0 instead. If you "
                "want to validate based on the total training batches, set `check_val_every_n_epoch=None`."
            )
        return int(v)

    def validation_interval(self, num_batches: int | None) -> int | None:
        """fit's validations inside its epochs, for an epoch of ``num_batches``: every this many batches of each epoch
        (Lightning's schedule, ``val_check_batch``) or optimizer steps of the run (distrain's, ``val_every_steps``);
        None: at the end of each validated epoch."""
        return self.val_check_batch(num_batches) if self.validates_as_lightning else self.val_every_steps(num_batches)

    def validates_after(self, epoch: int, global_step: int, batch_indices: list[int], every: int | None) -> bool:
        """Whether fit validates after the optimizer step that made ``global_step`` from the epoch's batches
        ``batch_indices``, validating ``every`` (``validation_interval``). Lightning's schedule: after the batch that
        completes each ``every`` of the epoch (one inside an accumulation window after the window's step; Lightning
        runs it between the window's batches); distrain's: every ``every`` steps."""
        if every is None or not self.validates_epoch(epoch):
            return False
        if not self.validates_as_lightning:
            return global_step % every == 0
        if self.check_val_every_n_epoch is None:  # the run's batches so far (Lightning's total_batch_idx + 1)
            accumulate = self.accumulate_for(epoch)
            return global_step * accumulate // every > (global_step - 1) * accumulate // every
        return any((batch_idx + 1) % every == 0 for batch_idx in batch_indices)

    def validates_at_end(self, epoch: int, every: int | None) -> bool:
        """Whether fit validates when ``epoch`` ends: an epoch it validates, with no validations inside (``every``,
        ``validation_interval``, is None)."""
        return every is None and self.validates_epoch(epoch)

    def validates_epoch(self, epoch: int) -> bool:
        return self.check_val_every_n_epoch is None or (epoch + 1) % self.check_val_every_n_epoch == 0


def checked_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's arguments (``locals()`` of its ``__init__``), each checked, with what Lightning's shortcuts mean
    spelled out: ``fast_dev_run`` (n batches of each stage, nothing written) and ``max_time`` (a ``Timer``
    callback); ``loop``: the ``LoopOptions`` they make. A ValueError names the argument at fault."""
    a = {k: v for k, v in arguments.items() if k not in ("self", "__class__")}
    a["precision"] = canonical_precision(a["precision"])  # Lightning's 16, "bf16", 32 too
    for name, bounds in TRAINER_NUMBERS.items():  # NaN, ±inf and numbers that mean nothing: one line each
        bounds.check(f"Trainer's {name}", a[name])
    if a["on_nonfinite"] not in NONFINITE_POLICIES:
        raise ValueError(f"on_nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {a['on_nonfinite']!r}")
    if a["on_anomaly"] is not None and a["on_anomaly"] not in ANOMALY_POLICIES:
        raise ValueError(f"on_anomaly must be one of {', '.join(ANOMALY_POLICIES)} or None, got {a['on_anomaly']!r}")
    if not isinstance(a["log_every_n_steps"], int) or a["log_every_n_steps"] < 1:
        raise ValueError(f"log_every_n_steps must be a positive integer, got {a['log_every_n_steps']!r}")
    for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches"):
        if isinstance(a[name], float) and a[name] > 1:
            raise ValueError(f"{name} is a number of batches or a fraction in (0, 1], got {a[name]!r}")
    if a["gradient_clip_algorithm"] not in (None, "norm", "value"):
        raise ValueError(f"gradient_clip_algorithm must be 'norm' or 'value', got {a['gradient_clip_algorithm']!r}")
    overfit = a["overfit_batches"]  # Lightning's: the same first batches every epoch, to train and to validate on
    if (
        isinstance(overfit, bool)
        or not isinstance(overfit, (int, float))
        or not 0 <= overfit
        or (isinstance(overfit, float) and overfit > 1)
    ):
        raise ValueError(f"overfit_batches is a number of batches or a fraction in [0, 1], got {overfit!r}")
    if overfit:
        a.update(limit_train_batches=overfit, limit_val_batches=overfit)
    if a["fast_dev_run"]:  # Lightning's smoke test: n batches of each stage, nothing written
        n = 1 if a["fast_dev_run"] is True else a["fast_dev_run"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"fast_dev_run is True, False or a number of batches >= 1, got {n!r}")
        a.update(max_steps=n, max_epochs=1, val_check_interval=None, num_sanity_val_steps=0)
        a.update(limit_train_batches=n, limit_val_batches=n, limit_test_batches=n, limit_predict_batches=n)
        a.update(logger=False, enable_checkpointing=False, enable_plots=False, max_time=None)
        a["callbacks"] = [c for c in callback_list(a["callbacks"]) if not isinstance(c, WRITES_OR_STOPS)]
    if a["max_time"] is not None:  # Lightning's Trainer(max_time=...): its Timer callback
        a["callbacks"] = [*callback_list(a["callbacks"]), Timer(a["max_time"])]
    a["loop"] = LoopOptions(
        max_epochs=a["max_epochs"] if a["max_epochs"] is not None else (1000 if a["max_steps"] == -1 else None),
        max_steps=a["max_steps"],
        accumulation=_accumulation_schedule(a["accumulate_grad_batches"]),
        gradient_clip_val=a["gradient_clip_val"],
        gradient_clip_algorithm=a["gradient_clip_algorithm"] or "norm",
        overfit=bool(overfit),
        fast_dev_run=bool(a["fast_dev_run"]),
        val_check_interval=a["val_check_interval"],
        check_val_every_n_epoch=a["check_val_every_n_epoch"],
        limit_train_batches=a["limit_train_batches"],
        limit_val_batches=a["limit_val_batches"],
        limit_test_batches=a["limit_test_batches"],
        limit_predict_batches=a["limit_predict_batches"],
        num_sanity_val_steps=a["num_sanity_val_steps"],
        min_epochs=a["min_epochs"],
        min_steps=a["min_steps"],
        use_distributed_sampler=a["use_distributed_sampler"],
        on_nonfinite=a["on_nonfinite"],
    )
    return a


def _accumulation_schedule(value: int | dict[int, int]) -> dict[int, int]:
    schedule = dict(value) if isinstance(value, dict) else {0: value}
    schedule.setdefault(0, 1)
    for epoch, n in schedule.items():
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"accumulate_grad_batches[{epoch}] must be a positive integer, got {n!r}")
    return schedule


def check_manual_optimization(trainer, module) -> None:
    """Manual optimization (``automatic_optimization = False``): what the loop would otherwise do for you is
    refused in one line, before any rank starts, as Lightning refuses it; so is a strategy it does not run under."""
    if module.automatic_optimization:
        return
    if trainer.anomalies is not None:
        raise ValueError("on_anomaly with automatic_optimization=False: the loop cannot re-run a step you step")
    if max(trainer.loop.accumulation.values()) > 1:
        raise ValueError(
            "accumulate_grad_batches > 1 with automatic_optimization=False: accumulate by hand in training_step "
            "(step the optimizer every N batches)"
        )
    if trainer.loop.gradient_clip_val:
        raise ValueError(
            "gradient_clip_val with automatic_optimization=False: call self.clip_gradients(opt, "
            "gradient_clip_val=...) in training_step"
        )
    from distrain.strategies.base import Strategy
    from distrain.strategies.ddp import DDPStrategy

    strategy = trainer.runtime.strategy
    # the base step (DDP's own overrides only name the parameters its error leaves unnamed)
    steps = {Strategy.backward, Strategy.run_step, DDPStrategy.backward, DDPStrategy.run_step}
    plain = type(strategy).backward in steps and type(strategy).run_step in steps
    if strategy.traits.collective_forward or strategy.traits.metrics_elsewhere or not plain:
        raise NotImplementedError(
            f"automatic_optimization=False is not supported with {type(strategy).__name__}: use DDP or one "
            "process, or automatic optimization (return the loss from training_step)"
        )
