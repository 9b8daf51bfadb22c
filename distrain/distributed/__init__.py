"""The process group: how it starts, how long its collectives may wait, how a hang is explained,
and how it ends (one path). Strategies, the runtime and the launchers all use this package; it
uses none of them."""

from distrain.distributed.collectives import (
    all_gather,
    all_gather_object,
    all_reduce,
    all_reduce_async,
    barrier,
    broadcast,
)
from distrain.distributed.process_group import init_process_group, shutdown
from distrain.distributed.watch import CollectiveHangError

__all__ = [
    "init_process_group",
    "shutdown",
    "all_reduce",
    "all_reduce_async",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "barrier",
    "CollectiveHangError",
]
