"""The optimizers and their schedulers, as the loop and the module's hooks see them: what ``configure_optimizers``
returned, in every form Lightning accepts (the optimizers, and each LR scheduler's config: ``interval``,
``frequency``, ``monitor``); the optimizer the hooks get (``LoopOptimizer``; manual optimization's is in
``training/manual.py``); and the schedulers stepped when due."""

from __future__ import annotations

import functools
from typing import Any

import torch


def parse_optimizers(conf: Any, manual: bool = False) -> tuple[list[torch.optim.Optimizer], list[dict]]:
    """Every form of ``configure_optimizers`` Lightning accepts: an optimizer; a list or tuple of them;
    ``([optimizers], [schedulers])``; ``{"optimizer": o, "lr_scheduler": s or {"scheduler": s, "interval",
    "frequency", "monitor"}, "monitor": ...}``; a list of such dicts. Several optimizers need manual optimization
    (as in Lightning 2.x)."""
    schedulers: list = []
    if isinstance(conf, torch.optim.Optimizer):
        optimizers = [conf]
    elif isinstance(conf, dict):
        optimizers, schedulers = _optimizer_dict(conf)
    elif isinstance(conf, (list, tuple)) and len(conf) == 2 and all(isinstance(c, (list, tuple)) for c in conf):
        optimizers, schedulers = list(conf[0]), list(conf[1])
    elif isinstance(conf, (list, tuple)) and conf and all(isinstance(c, dict) for c in conf):
        optimizers = []
        for c in conf:
            opts, scheds = _optimizer_dict(c)
            optimizers += opts
            schedulers += scheds
    elif isinstance(conf, (list, tuple)):
        optimizers = list(conf)
    else:
        raise TypeError(
            f"configure_optimizers returned {type(conf).__name__}; expected an optimizer, a list of them, "
            "([optimizers], [schedulers]), or a dict with 'optimizer'"
        )
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise TypeError("configure_optimizers must give at least one torch.optim.Optimizer")
    if len(optimizers) != 1 and not manual:
        raise ValueError(
            f"configure_optimizers gave {len(optimizers)} optimizers: several need manual optimization "
            "(automatic_optimization = False and opt.step() in training_step), as in Lightning"
        )
    configs = []
    for s in schedulers:
        c = dict(s) if isinstance(s, dict) else {"scheduler": s}
        c.setdefault("interval", "epoch")
        c.setdefault("frequency", 1)
        if c["interval"] not in ("step", "epoch"):
            raise ValueError(f"lr_scheduler interval must be 'step' or 'epoch', got {c['interval']!r}")
        configs.append(c)
    return optimizers, configs


def _optimizer_dict(conf: dict) -> tuple[list, list]:
    if "optimizer" not in conf:
        raise KeyError(f"configure_optimizers returned a dict without 'optimizer' (keys: {', '.join(conf)})")
    scheduler = conf.get("lr_scheduler")
    if scheduler is None:
        return [conf["optimizer"]], []
    scheduler = dict(scheduler) if isinstance(scheduler, dict) else {"scheduler": scheduler}
    if conf.get("monitor") is not None:
        scheduler.setdefault("monitor", conf["monitor"])
    return [conf["optimizer"]], [scheduler]


class LoopOptimizer:
    """An optimizer as the module's hooks get it (Lightning's ``LightningOptimizer``): ``step()`` goes through the
    strategy and the precision plugin (a grad scaler, DeepSpeed's engine); the rest is the optimizer's. It is an
    instance of the optimizer's class too, so ``isinstance(opt, torch.optim.Optimizer)`` holds and torch's LR
    schedulers take it."""

    def __init__(self, trainer, optimizer: torch.optim.Optimizer):
        self.__class__ = _loop_optimizer_class(type(self), type(optimizer))
        self._trainer = trainer
        self.optimizer = optimizer

    def step(self, closure=None) -> Any:
        """The step's forward and backward have run: the closure only returns what it computed."""
        result = closure() if closure is not None else None
        self._trainer.runtime.optimizer_step(self.optimizer, self._trainer.model)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:  # param_groups, state, state_dict, ...
        if name == "optimizer":  # not set yet
            raise AttributeError(name)
        return getattr(self.optimizer, name)


@functools.cache
def _loop_optimizer_class(wrapper: type, optimizer: type) -> type:
    try:
        return type(f"{wrapper.__name__}[{optimizer.__name__}]", (wrapper, optimizer), {})
    except TypeError:  # an engine's optimizer class that cannot be mixed in (a metaclass, a layout): the wrapper alone
        return wrapper


def sync_gradients(trainer, optimizer) -> None:
    """Average ``optimizer``'s gradients over the data-parallel ranks, once per step (manual optimization)."""
    if trainer.data_parallel_size == 1 or getattr(optimizer, "_distrain_synced", False):
        return
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat = trainer.runtime.all_reduce(flat, op="mean")
        for g, synced in zip(grads, torch.split(flat, [g.numel() for g in grads])):
            g.copy_(synced.view_as(g))
    optimizer._distrain_synced = True


def step_schedulers(trainer, interval: str) -> None:
    """Step the schedulers of this ``interval`` that are due (``frequency``); one that monitors a metric
    (``"monitor"``, e.g. ReduceLROnPlateau) steps with its latest value, and names it when it was never logged."""
    if not trainer.module.automatic_optimization:
        return  # manual optimization: the module steps its schedulers itself (trainer.lr_schedulers())
    count = trainer.global_step + 1 if interval == "step" else trainer.current_epoch + 1
    for config in trainer.lr_schedulers:
        if config["interval"] != interval or count % config["frequency"]:
            continue
        monitor = config.get("monitor")
        if monitor is None and isinstance(config["scheduler"], torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError(
                "configure_optimizers: a ReduceLROnPlateau scheduler needs a metric to monitor: return "
                '{"optimizer": opt, "lr_scheduler": {"scheduler": s, "monitor": "val_loss"}}'
            )
        if monitor is not None and monitor not in trainer.callback_metrics:
            known = ", ".join(sorted(trainer.callback_metrics)) or "none yet"
            raise KeyError(f"lr_scheduler monitors {monitor!r}, which was never logged (logged: {known})")
        metric = trainer.callback_metrics[monitor] if monitor is not None else None
        trainer.module.lr_scheduler_step(config["scheduler"], metric)
