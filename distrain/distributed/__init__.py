"""The process group: how it starts, how long its collectives may wait, how a hang is explained,
and how it ends (one path). Strategies, the runtime and the launchers all use this package; it
uses none of them."""

from distrain.distributed.collectives import (
    SharedFailure,
    all_gather,
    all_gather_object,
    all_reduce,
    all_reduce_async,
    barrier,
    broadcast,
    decided_on_rank_zero,
    global_rank,
    shared_outcome,
)
from distrain.distributed.process_group import (
    decide_before_strategy,
    in_a_forked_child,
    inherited_never_collected,
    init_process_group,
    shutdown,
)
from distrain.distributed.watch import CollectiveHangError

__all__ = [
    "init_process_group",
    "decide_before_strategy",
    "shutdown",
    "inherited_never_collected",
    "in_a_forked_child",
    "all_reduce",
    "all_reduce_async",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "barrier",
    "decided_on_rank_zero",
    "global_rank",
    "shared_outcome",
    "SharedFailure",
    "CollectiveHangError",
]
