"""An average of the weights as training goes (Stochastic Weight Averaging, an Exponential Moving Average), kept beside
the model by torch's own ``AveragedModel``: updated after each optimizer step (or as ``should_update`` says),
evaluated in place of the model during validation, and the model's once training ends. Lightning's
``WeightAveraging`` and ``EMAWeightAveraging``, with their numbers.

The average is a whole copy of the model on every rank: refused where a rank holds part of it (FSDP, ZeRO, tensor or
pipeline parallelism), as Lightning refuses weight averaging for sharded models."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

from distrain.callbacks.base import Callback


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
        strategy = trainer.strategy
        if not strategy.traits.replicated_state:
            raise ValueError(
                f"{type(self).__name__} keeps a whole copy of the model on every rank, and under "
                f"{type(strategy).__name__} a rank holds part of it: use it with one process or DDP"
            )
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
        super().__init__(device=device, use_buffers=use_buffers, **kwargs, avg_fn=get_ema_avg_fn(decay=decay))
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
