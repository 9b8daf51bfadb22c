"""What ``configure_optimizers`` returned, in every form Lightning accepts: the optimizers, and each LR scheduler's
config (``interval``, ``frequency``, ``monitor``)."""

from __future__ import annotations

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
