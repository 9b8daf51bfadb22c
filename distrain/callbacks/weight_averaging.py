"""An average of the weights as training goes (Stochastic Weight Averaging, an Exponential Moving Average), kept beside
the model by torch's own ``AveragedModel``: updated after each optimizer step (or as ``should_update`` says),
evaluated in place of the model during validation, and the model's once training ends. Lightning's
``WeightAveraging`` and ``EMAWeightAveraging``, and its older ``StochasticWeightAveraging``, with their numbers.

The average is a whole copy of the model on every rank: refused where a rank holds part of it (FSDP, ZeRO, tensor or
pipeline parallelism), as Lightning refuses weight averaging for sharded models."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
from torch.optim.swa_utils import SWALR, AveragedModel

from distrain.callbacks.base import Callback


def refuse_partial_models(callback: Callback, trainer) -> None:
    """An average is a whole copy of the model on every rank: refused in one line where a rank holds part of it."""
    if not trainer.strategy.traits.replicated_state:
        raise ValueError(
            f"{type(callback).__name__} keeps a whole copy of the model on every rank, and under "
            f"{type(trainer.strategy).__name__} a rank holds part of it: use it with one process or DDP"
        )


class WeightAveraging(Callback):
    """The average of the weights, ``AveragedModel(module, device, use_buffers, **kwargs)`` (``avg_fn`` or
    ``multi_avg_fn`` choose how it averages: an equal average by default, SWA's). ``use_buffers`` averages the buffers
    too (Lightning's default, not torch's). Override ``should_update(step_idx=..., epoch_idx=...)`` to choose when it
    updates: after every optimizer step by default (``step_idx`` is 0 after the first)."""

    def __init__(self, device: torch.device | str | int | None = None, use_buffers: bool = True, **kwargs: Any):
        self._device = torch.device(device) if isinstance(device, str) else device
        self._use_buffers = use_buffers
        self._kwargs = kwargs
        self._average_model: AveragedModel | None = None
        self._latest_update_step = 0  # the optimizer steps taken at the last update
        self._latest_update_epoch = -1  # the epoch after which it last updated
        self._restored: dict | None = None  # the average a resumed run starts from, until fit sets up

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Whether to update after optimizer step ``step_idx`` or after epoch ``epoch_idx`` (0-based; the other is
        None): after every step."""
        return step_idx is not None

    def setup(self, trainer, module, stage: str) -> None:
        if stage != "fit":
            return
        refuse_partial_models(self, trainer)
        device = self._device if self._device is not None else next(module.parameters(), torch.empty(0)).device
        self._average_model = AveragedModel(module, device=device, use_buffers=self._use_buffers, **self._kwargs)
        if self._restored is not None:
            self._average_model.load_state_dict(self._restored)
            self._restored = None

    def on_train_batch_end(self, trainer, module, outputs: Any, batch: Any, batch_idx: int) -> None:
        step_idx = trainer.global_step - 1  # the optimizer step just taken, 0-based as epochs are
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=step_idx):
            self._average_model.update_parameters(module)
            self._latest_update_step = trainer.global_step

    def on_train_epoch_end(self, trainer, module) -> None:
        epoch = trainer.current_epoch
        if epoch > self._latest_update_epoch and self.should_update(epoch_idx=epoch):
            self._average_model.update_parameters(module)
            self._latest_update_epoch = epoch

    def on_train_end(self, trainer, module) -> None:
        if self._average_model is None:
            return
        for average, current in self._pairs(module):
            current.data.copy_(average.data)

    def on_validation_epoch_start(self, trainer, module) -> None:
        if self._average_model is not None:
            self._swap(module)

    def on_validation_epoch_end(self, trainer, module) -> None:
        if self._average_model is not None:
            self._swap(module)

    def _pairs(self, module):
        average = self._average_model.module
        return zip(
            itertools.chain(average.parameters(), average.buffers()),
            itertools.chain(module.parameters(), module.buffers()),
        )

    def _swap(self, module) -> None:
        for average, current in self._pairs(module):
            kept = average.data.clone()
            average.data.copy_(current.data)
            current.data.copy_(kept)

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """When it last updated, and the average itself: a resumed run goes on averaging exactly."""
        average = None if self._average_model is None else self._average_model.state_dict()
        state = {"latest_update_step": self._latest_update_step, "latest_update_epoch": self._latest_update_epoch}
        return {**state, "average": average}

    def load_state_dict(self, state: dict) -> None:
        for key in ("latest_update_step", "latest_update_epoch"):
            if type(state.get(key)) is not int:
                raise ValueError(f"{type(self).__name__}'s {key} is {state.get(key)!r}, not an integer")
        self._latest_update_step, self._latest_update_epoch = state["latest_update_step"], state["latest_update_epoch"]
        average = state.get("average")
        if isinstance(average, dict):
            if self._average_model is not None:
                self._average_model.load_state_dict(average)
            else:  # read before fit sets up: taken there
                self._restored = average

    def on_save_checkpoint(self, trainer, module, checkpoint: dict) -> None:
        """Lightning's layout: ``state_dict`` holds the average (what ``load_from_checkpoint`` loads), the model's own
        weights are ``current_model_state``. distrain resumes from its ``model`` entry, the current weights."""
        if self._average_model is None:
            return
        average = self._average_model.state_dict()
        checkpoint["current_model_state"] = module.state_dict()
        checkpoint["state_dict"] = {k[len("module.") :]: v for k, v in average.items() if k.startswith("module.")}
        checkpoint["averaging_state"] = {k: v for k, v in average.items() if not k.startswith("module.")}


class ExponentialAverage:
    """torch's ``get_ema_avg_fn(decay)`` (the same arithmetic), as an object a spawned rank can be sent: torch's is a
    closure, which pickle cannot carry (``ddp_spawn`` failed with it)."""

    def __init__(self, decay: float):
        self.decay = decay

    @torch.no_grad()
    def __call__(self, ema_param: torch.Tensor, current_param: torch.Tensor, num_averaged: Any) -> torch.Tensor:
        return self.decay * ema_param + (1 - self.decay) * current_param


class EMAWeightAveraging(WeightAveraging):
    """An exponential moving average of the weights (``decay``), updated every ``update_every_n_steps`` optimizer
    steps from step ``update_starting_at_step`` on, and after each epoch from ``update_starting_at_epoch`` on where
    given (Lightning's)."""

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        use_buffers: bool = True,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(device=device, use_buffers=use_buffers, **kwargs, avg_fn=ExponentialAverage(decay))
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        if step_idx is not None:
            started = self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
            if started and self.update_every_n_steps > 0 and step_idx % self.update_every_n_steps == 0:
                return True
        return (
            epoch_idx is not None
            and self.update_starting_at_epoch is not None
            and (epoch_idx >= self.update_starting_at_epoch)
        )


class StochasticWeightAveraging(Callback):
    """Lightning's SWA: from epoch ``swa_epoch_start`` (an int, 1-based; a float, that share of ``max_epochs``) the
    weights are averaged at the start of each epoch up to the last, and the learning rate follows torch's ``SWALR``
    towards ``swa_lrs`` over ``annealing_epochs`` (``"cos"`` or ``"linear"``), in place of the module's own scheduler;
    the average becomes the model's when the last epoch ends. ``avg_fn(averaged, current, n)``: how it averages
    (equally by default). A model with BatchNorm, whose statistics Lightning recomputes in an extra epoch, is
    refused: ``EMAWeightAveraging`` averages the statistics too."""

    def __init__(
        self,
        swa_lrs: float | list[float],
        swa_epoch_start: int | float = 0.8,
        annealing_epochs: int = 10,
        annealing_strategy: str = "cos",
        avg_fn: Any = None,
        device: torch.device | str | None = torch.device("cpu"),
    ):
        whole = isinstance(swa_epoch_start, int) and not isinstance(swa_epoch_start, bool) and swa_epoch_start >= 1
        if not whole and not (isinstance(swa_epoch_start, float) and 0 <= swa_epoch_start <= 1):
            raise ValueError("swa_epoch_start should be a >0 integer or a float between 0 and 1.")
        lrs = swa_lrs if isinstance(swa_lrs, list) else [swa_lrs]
        if not isinstance(swa_lrs, (float, list)) or not all(isinstance(lr, float) and lr > 0 for lr in lrs):
            raise ValueError("The `swa_lrs` should a positive float, or a list of positive floats")
        anneal = annealing_strategy  # SWALR's anneal_strategy: how the learning rate moves to swa_lrs
        if anneal not in ("cos", "linear"):
            raise ValueError(f"annealing_strategy should be 'cos' or 'linear', got {anneal!r}")
        if avg_fn is not None and not callable(avg_fn):
            raise ValueError("The `avg_fn` should be callable.")
        self._swa_epoch_start, self._swa_lrs = swa_epoch_start, swa_lrs
        self._annealing_epochs, self._anneal = annealing_epochs, anneal
        self._avg_fn = avg_fn or self.avg_fn
        self._device = device
        self._average_model: torch.nn.Module | None = None
        self._initialized = False
        self._swa_scheduler: Any = None
        self._scheduler_state: dict | None = None
        self._init_n_averaged = 0
        self._latest_update_epoch = -1
        self._max_epochs = -1
        self.n_averaged: torch.Tensor | None = None

    @property
    def swa_start(self) -> int:
        return max(self._swa_epoch_start - 1, 0)  # 0-based

    @property
    def swa_end(self) -> float:
        return float("inf") if self._max_epochs == -1 else self._max_epochs - 1

    @staticmethod
    def avg_fn(averaged: torch.Tensor, current: torch.Tensor, num_averaged: torch.Tensor) -> torch.Tensor:
        return averaged + (current - averaged) / (num_averaged + 1)

    def setup(self, trainer, module, stage: str) -> None:
        if stage != "fit":
            return
        refuse_partial_models(self, trainer)
        self._average_model = copy.deepcopy(module)  # before the strategy moves the model

    def on_fit_start(self, trainer, module) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError("StochasticWeightAveraging works with 1 optimizer")
        if len(trainer.lr_schedulers) > 1:
            raise ValueError("StochasticWeightAveraging works with at most 1 lr_scheduler")
        batch_norm = next((m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)), None)
        if batch_norm is not None:
            raise ValueError(
                f"StochasticWeightAveraging: {type(module).__name__} has a {type(batch_norm).__name__}, whose "
                "statistics Lightning recomputes for the averaged weights in an extra epoch that distrain does not "
                "run; use EMAWeightAveraging (it averages the statistics too), or torch.optim.swa_utils.update_bn "
                "after fit"
            )
        self._max_epochs = -1 if trainer.max_epochs is None else trainer.max_epochs
        if isinstance(self._swa_epoch_start, float):
            if self._max_epochs == -1:
                raise ValueError(
                    "StochasticWeightAveraging with a float swa_epoch_start needs max_epochs: give it as an integer"
                )
            self._swa_epoch_start = int(self._max_epochs * self._swa_epoch_start)
        if self._scheduler_state is not None:  # resumed: the SWA schedule replaces the module's again, its state kept
            trainer.lr_schedulers.clear()

    def on_train_epoch_start(self, trainer, module) -> None:
        epoch = trainer.current_epoch
        if not self._initialized and self.swa_start <= epoch <= self.swa_end:
            self._initialized = True
            self._average_model = self._average_model.to(self._device or next(module.parameters()).device)
            optimizer = trainer.optimizers[0]
            if isinstance(self._swa_lrs, float):
                self._swa_lrs = [self._swa_lrs] * len(optimizer.param_groups)
            for lr, group in zip(self._swa_lrs, optimizer.param_groups):
                group["initial_lr"] = lr
            self._swa_scheduler = SWALR(
                optimizer,
                swa_lr=self._swa_lrs,
                anneal_epochs=self._annealing_epochs,
                anneal_strategy=self._anneal,
                last_epoch=self._max_epochs if self._anneal == "cos" else -1,
            )
            if self._scheduler_state is not None:
                self._swa_scheduler.load_state_dict(self._scheduler_state)
            config = {"scheduler": self._swa_scheduler, "interval": "epoch", "frequency": 1}
            if trainer.lr_schedulers:
                replaced = trainer.lr_schedulers[0]
                if trainer.is_global_zero:
                    print(
                        f"distrain: StochasticWeightAveraging: swapping the scheduler "
                        f"{type(replaced['scheduler']).__name__} for SWALR",
                        flush=True,
                    )
                trainer.lr_schedulers[0] = config
            else:
                trainer.lr_schedulers.append(config)
            if self.n_averaged is None:
                self.n_averaged = torch.tensor(self._init_n_averaged, dtype=torch.long)
        if self.swa_start <= epoch <= self.swa_end and epoch > self._latest_update_epoch:
            for averaged, current in zip(self._average_model.parameters(), module.parameters()):
                averaged_ = averaged.detach()
                current_ = current.detach().to(averaged_.device)
                n = self.n_averaged.to(averaged_.device)
                averaged_.copy_(current_ if self.n_averaged == 0 else self._avg_fn(averaged_, current_, n))
            self.n_averaged += 1
            self._latest_update_epoch = epoch

    def on_train_end(self, trainer, module) -> None:
        # the epoch count has moved past the last epoch when that epoch ended the run
        if self._average_model is not None and (trainer.current_epoch - 1 == self.swa_end or self._max_epochs == -1):
            for averaged, current in zip(self._average_model.parameters(), module.parameters()):
                current.detach().copy_(averaged.to(current.device))

    def state_dict(self) -> dict:
        return {
            "n_averaged": 0 if self.n_averaged is None else self.n_averaged.item(),
            "latest_update_epoch": self._latest_update_epoch,
            "scheduler_state": None if self._swa_scheduler is None else self._swa_scheduler.state_dict(),
            "average_model_state": None if self._average_model is None else self._average_model.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("n_averaged", "latest_update_epoch"):
            if type(state.get(key)) is not int:
                raise ValueError(f"StochasticWeightAveraging's {key} is {state.get(key)!r}, not an integer")
        self._init_n_averaged, self._latest_update_epoch = state["n_averaged"], state["latest_update_epoch"]
        self._scheduler_state = state.get("scheduler_state")
        if self._average_model is not None and isinstance(state.get("average_model_state"), dict):
            self._average_model.load_state_dict(state["average_model_state"])
