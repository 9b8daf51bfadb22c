"""Lightning's learning-rate range test: ``LearningRateFinder`` (a callback, run when fit starts) and what
``Tuner.lr_find`` returns (``LRFinder``: the learning rates tried, the smoothed loss at each, a suggestion, a plot).

In each rank, once fit has set up the model and its optimizer, a few steps run on the training data with the
learning rate raised from ``min_lr`` to ``max_lr`` after each, every other callback, logger, scheduler and validation
set aside (Lightning's ``_lr_find``); then the weights, optimizer, schedulers and progress go back to where they were
(held in memory, ``CheckpointManager.live_state``) and the random streams too, so the fit that follows trains as it
would have, from the learning rate the search suggests where ``update_attr`` asks. The numbers are Lightning's: the
same schedule of rates, the same smoothing, the same divergence stop and the same suggestion (the steepest descent of
the loss), rank 0's on every rank."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch
from torch.utils._pytree import tree_map

from distrain.callbacks.base import Callback
from distrain.loggers.base import Logger
from distrain.runtime import isolated_rng

MODES = ("linear", "exponential")


class TunerExit(Exception):  # noqa: N818 — Lightning's _TunerExitException: not an error, the end of a tuning fit
    """Raised when fit starts, after ``Tuner``'s search ran: the fit ends there, torn down, as in Lightning."""


class LRFinder:
    """The results of a search (Lightning's ``_LRFinder``): ``results["lr"]`` and ``results["loss"]`` (smoothed), one
    per step taken; ``suggestion()`` and ``plot()`` as Lightning's."""

    def __init__(self, mode: str, lr_min: float, lr_max: float, num_training: int, results: dict | None = None):
        self.mode, self.lr_min, self.lr_max, self.num_training = mode, lr_min, lr_max, num_training
        self.results: dict[str, Any] = dict(results or {})
        self._optimal_idx: int | None = None

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The rate where the loss fell fastest (the most negative gradient of the loss in the rate), the first
        ``skip_begin`` and last ``skip_end`` points and non-finite losses left out; None, said on the console, with
        fewer than two points left."""
        losses = torch.tensor(self.results["loss"][skip_begin:-skip_end])
        lrs = torch.tensor(self.results["lr"][skip_begin:-skip_end])
        finite = torch.isfinite(losses)
        losses, lrs = losses[finite], lrs[finite]
        if len(losses) < 2:
            print(
                "distrain: lr_find: too few points to suggest a learning rate; raise num_training or give it more "
                "training batches",
                flush=True,
            )
            self._optimal_idx = None
            return None
        gradients = torch.gradient(losses, spacing=[lrs])[0]
        kept = torch.arange(len(self.results["loss"]))[skip_begin:-skip_end][finite]
        self._optimal_idx = int(kept[int(torch.argmin(gradients))])
        return self.results["lr"][self._optimal_idx]

    def plot(self, suggest: bool = False, show: bool = False, ax=None):
        """The loss against the rate (a log axis for an exponential search), the suggestion marked with ``suggest``;
        returns the figure."""
        import matplotlib.pyplot as plt

        figure = plt.subplots()[0] if ax is None else ax.figure
        ax = ax if ax is not None else figure.axes[0]
        ax.plot(self.results["lr"], self.results["loss"])
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest and self.suggestion() is not None:
            i = self._optimal_idx
            ax.plot(self.results["lr"][i], self.results["loss"][i], markersize=10, marker="o", color="red")
        if show:
            plt.show()
        return figure


class RangeSchedule(torch.optim.lr_scheduler.LRScheduler):
    """The search's rates: from the optimizer's (``min_lr``) towards ``end_lr`` over ``num_iter`` steps, linearly or
    exponentially, in Lightning's steps (the first step at ``min_lr``, the second already two steps along)."""

    def __init__(self, optimizer, end_lr: float, num_iter: int, mode: str):
        self.end_lr, self.num_iter, self.mode = end_lr, num_iter, mode
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        if self.last_epoch <= 0:
            return list(self.base_lrs)
        r = (self.last_epoch + 1) / self.num_iter
        if self.mode == "linear":
            return [base + r * (self.end_lr - base) for base in self.base_lrs]
        return [base * (self.end_lr / base) ** r for base in self.base_lrs]


class _Recorder(Callback):
    """The only callback during a search: the rate of each step, and its loss smoothed as Lightning smooths it
    (an exponential average, bias-corrected); ends the search once the smoothed loss passes ``early_stop_threshold``
    times the best, rank 0 deciding for every rank."""

    def __init__(self, early_stop_threshold: float | None, beta: float = 0.98):
        self.early_stop_threshold, self.beta = early_stop_threshold, beta
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.avg_loss = self.best_loss = 0.0
        self.diverged = False

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if len(self.lrs) == len(self.losses):  # a step's first micro-batch
            self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        loss = outputs if isinstance(outputs, torch.Tensor) else (outputs or {}).get("loss")
        if loss is None:  # a step that returned nothing: no point of the curve
            self.losses.append(float("nan"))
            return
        # Lightning's step output is the loss of the step's last micro-batch, divided as its backward was
        loss = float(torch.as_tensor(loss).detach()) / trainer.loop.accumulate_for(trainer.current_epoch)
        step = trainer.global_step
        self.avg_loss = self.beta * self.avg_loss + (1 - self.beta) * loss
        smoothed = self.avg_loss / (1 - self.beta ** (step + 1))
        threshold = self.early_stop_threshold
        if trainer.runtime.broadcast(threshold is not None and step > 1 and smoothed > threshold * self.best_loss):
            self.diverged = True
            trainer.loop.max_steps = step  # the search's own options: it ends at this step, on every rank
        if smoothed < self.best_loss or step == 1:
            self.best_loss = smoothed
        self.losses.append(smoothed)


def lr_attribute(module, attr_name: str = "") -> str:
    """The name of the module's learning rate: ``attr_name``, else ``lr`` or ``learning_rate``, an attribute of the
    module or a key of its ``hparams`` (Lightning's rule); an AttributeError says what is missing."""
    names = [attr_name] if attr_name else ["lr", "learning_rate"]
    for name in names:
        if hasattr(module, name) or name in (getattr(module, "hparams", None) or {}):
            return name
    if attr_name:
        raise AttributeError(
            f"The attribute name for the learning rate was set to {attr_name}, but could not find this as a field "
            "in `model` or `model.hparams`."
        )
    raise AttributeError(
        "When using the learning rate finder, either `model` or `model.hparams` should have one of these fields: "
        "('lr', 'learning_rate'). If your model has a different name for the learning rate, set it with "
        "`.lr_find(attr_name=...)`."
    )


def set_lr_attribute(module, name: str, lr: float) -> None:
    """Lightning's ``lightning_setattr``: the module's attribute and its ``hparams`` entry, wherever each is."""
    hparams = getattr(module, "hparams", None)
    if hasattr(module, name):
        setattr(module, name, lr)
    if hparams is not None and name in hparams:
        hparams[name] = lr


#: the Trainer's parts a search replaces with its own, and puts back
_SET_ASIDE = ("callbacks", "lr_schedulers", "metrics", "loop", "loop_state", "anomalies")


def find_lr(
    trainer,
    module,
    *,
    min_lr: float,
    max_lr: float,
    num_training: int,
    mode: str,
    early_stop_threshold: float | None,
    update_attr: bool,
    attr_name: str,
) -> LRFinder | None:
    """The search, in every rank of a fit that has set up its optimizer (``LearningRateFinder.lr_find``: its
    arguments, Lightning's). None under ``fast_dev_run``, which skips it, as Lightning does."""
    if trainer.loop.fast_dev_run:
        if trainer.is_global_zero:
            warnings.warn("Skipping learning rate finder since `fast_dev_run` is enabled.", stacklevel=2)
        return None
    if update_attr:
        attr_name = lr_attribute(module, attr_name)
    if not module.automatic_optimization:
        raise ValueError(
            "lr_find under manual optimization (automatic_optimization = False): the search steps the optimizer "
            "itself; find the learning rate with automatic optimization, or without the finder"
        )
    optimizer = trainer.optimizers[0]
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"lr_find under {type(trainer.strategy).__name__}: its optimizer is its engine's {type(optimizer).__name__}"
            ", whose rate the search cannot schedule; find the rate under ddp or fsdp, and train with it here"
        )
    recorder = _Recorder(early_stop_threshold)
    kept = {name: getattr(trainer, name) for name in _SET_ASIDE}
    # its tensors may be the live ones, which the search moves: copies
    saved = tree_map(
        lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, trainer.checkpoints.live_state()
    )
    with isolated_rng():
        try:
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] = min_lr
            trainer.callbacks = [recorder]
            trainer.lr_schedulers = [
                {"scheduler": RangeSchedule(optimizer, max_lr, num_training, mode), "interval": "step", "frequency": 1}
            ]
            trainer.metrics = _quiet(trainer.metrics)
            # the rates run past max_steps and min_epochs; a diverging loss is the point, not a failure
            trainer.loop = dataclasses.replace(
                trainer.loop,
                max_steps=trainer.global_step + num_training,
                min_epochs=None,
                min_steps=None,
                on_nonfinite="ignore",
            )
            trainer.loop_state = type(trainer.loop_state)(num_batches=trainer.loop_state.num_batches)
            trainer.anomalies = None
            trainer.run_epochs(trainer.train_dataloader, None)
        finally:
            for name, value in kept.items():
                setattr(trainer, name, value)
            trainer.should_stop = False
            trainer.checkpoints.load_live_state(saved)
    results = trainer.runtime.broadcast({"lr": recorder.lrs, "loss": recorder.losses})
    finder = LRFinder(mode, min_lr, max_lr, num_training, results)
    suggested = finder.suggestion() if update_attr else None
    if trainer.is_global_zero:
        ran = len(finder.results["lr"])
        stopped = f", stopped after {ran} as the loss diverged" if recorder.diverged else ""
        print(f"distrain: lr_find tried {ran} learning rates from {min_lr:g} to {max_lr:g}{stopped}", flush=True)
    if suggested is not None:
        set_lr_attribute(module, attr_name, suggested)
        for group in optimizer.param_groups:  # the fit that follows trains from it
            group["lr"] = suggested
        if trainer.is_global_zero:
            print(f"distrain: learning rate set to {suggested:g} ({type(module).__name__}.{attr_name})", flush=True)
    return finder


class _Absorbing(Logger):
    """The search's logger where the run has one (Lightning's ``DummyLogger``): ``trainer.logger`` and its
    ``experiment`` take whatever the module's code hands them, and keep nothing."""

    def log_metrics(self, metrics: dict, step: int) -> None:
        pass


def _quiet(metrics):
    """A metrics logger for the search: the module's ``self.log`` calls land in it, nothing reaches a logger or the
    console, and the run's own values stay as they were."""
    loggers = [_Absorbing()] if metrics.loggers else []
    quiet = type(metrics)(metrics.runtime, loggers, 2**62, print_steps=False, straggler_threshold=math.inf)
    quiet.monitor, quiet.summarize = metrics.monitor, False
    quiet.start_fit(None, None)
    return quiet


class LearningRateFinder(Callback):
    """Lightning's ``LearningRateFinder``: the range test when fit starts (override ``on_fit_start`` and call
    ``lr_find(trainer, module)`` elsewhere, as Lightning's documentation shows); with ``update_attr`` the fit trains
    from the suggested rate, set on the module's ``lr``/``learning_rate`` (or ``attr_name``) and on its optimizer.
    ``optimal_lr``: the ``LRFinder`` of the last search."""

    SUPPORTED_MODES = MODES

    def __init__(
        self,
        min_lr: float = 1e-8,
        max_lr: float = 1,
        num_training_steps: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
        weights_only: bool | None = None,
    ):
        mode = mode.lower()
        if mode not in MODES:
            raise ValueError(f"`mode` should be either of {MODES}")
        if not (0 < min_lr < max_lr) or not math.isfinite(max_lr):
            raise ValueError(f"LearningRateFinder needs 0 < min_lr < max_lr, got min_lr={min_lr}, max_lr={max_lr}")
        if isinstance(num_training_steps, bool) or not isinstance(num_training_steps, int) or num_training_steps < 1:
            raise ValueError(f"LearningRateFinder's num_training_steps must be an int >= 1, got {num_training_steps!r}")
        self._min_lr, self._max_lr, self._num_training_steps, self._mode = min_lr, max_lr, num_training_steps, mode
        self._early_stop_threshold, self._update_attr, self._attr_name = early_stop_threshold, update_attr, attr_name
        self.early_exit = False  # Tuner's: the fit ends once the search ran
        self.optimal_lr: LRFinder | None = None

    def lr_find(self, trainer, module) -> None:
        self.optimal_lr = find_lr(
            trainer,
            module,
            min_lr=self._min_lr,
            max_lr=self._max_lr,
            num_training=self._num_training_steps,
            mode=self._mode,
            early_stop_threshold=self._early_stop_threshold,
            update_attr=self._update_attr,
            attr_name=self._attr_name,
        )
        if self.early_exit:
            raise TunerExit()
        trainer.loop_state.iterator_drew = True  # Lightning made the fit's iterator as the search ended

    def on_fit_start(self, trainer, module) -> None:
        if trainer.global_step > 0:  # resumed: its checkpoint's optimizer holds the rate the first search set
            if trainer.is_global_zero:
                print(
                    f"distrain: lr_find skipped: this fit goes on from step {trainer.global_step} with the learning "
                    "rate its checkpoint holds (Lightning restores that over a new search's)",
                    flush=True,
                )
            return
        self.lr_find(trainer, module)
