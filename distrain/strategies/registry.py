"""String names for strategies, in one place."""

from __future__ import annotations

import functools
from typing import Any, Callable

from distrain.strategies.base import Strategy
from distrain.strategies.ddp import DDPStrategy
from distrain.strategies.deepspeed import DeepSpeedStrategy
from distrain.strategies.deepspeed_config import PRESETS as DEEPSPEED_PRESETS
from distrain.strategies.fsdp import FSDPStrategy
from distrain.strategies.single import SingleDeviceStrategy

STRATEGIES: dict[str, Callable[..., Strategy]] = {
    "single": SingleDeviceStrategy,
    "ddp": lambda **kw: DDPStrategy(start_method="popen", **kw),
    "ddp_spawn": lambda **kw: DDPStrategy(start_method="spawn", **kw),
    "ddp_fork": lambda **kw: DDPStrategy(start_method="fork", **kw),
    "ddp_notebook": lambda **kw: DDPStrategy(start_method="fork", **kw),
    "fsdp": FSDPStrategy,
    "fsdp_cpu_offload": lambda **kw: FSDPStrategy(**{"cpu_offload": True, **kw}),
    **{name: functools.partial(lambda preset, **kw: DeepSpeedStrategy(**{**preset, **kw}), preset)
       for name, preset in DEEPSPEED_PRESETS.items()},
    "auto": lambda **kw: None,  # resolved by the Runtime once the world size is known
}


def make_strategy(name: str | Strategy, world_size: int, **kwargs: Any) -> Strategy:
    if isinstance(name, Strategy):
        return name
    if name not in STRATEGIES:
        raise ValueError(f"strategy {name!r} is unknown; choose one of {', '.join(sorted(STRATEGIES))}")
    generic = {k: v for k, v in kwargs.items() if k in ("process_group_backend", "timeout", "collective_timeout",
                                                       "activation_checkpointing_policy")}
    if name == "auto":
        if world_size == 1:  # options for the multi-process strategies do not apply to one process
            return SingleDeviceStrategy(**generic)
        name = "ddp"
    if name == "single":
        if world_size > 1:
            raise ValueError(f"strategy='single' runs one process, but {world_size} were requested")
        if kwargs.keys() - generic.keys():
            raise ValueError(f"strategy='single' does not take {', '.join(sorted(kwargs.keys() - generic.keys()))}")
        return SingleDeviceStrategy(**generic)
    return STRATEGIES[name](**kwargs)
