"""``Trainer(strategy="auto")``: the memory planner decides, in ``fit``, before any rank starts."""

from __future__ import annotations

import json
import os
from typing import Any

from distrain import distributed
from distrain.planner.cli import PLANNED_ENV, rates_or_none
from distrain.strategies.registry import GENERIC_OPTIONS


def plan_runtime_strategy(runtime, module, loader, accumulate: int, clip: float | None, kwargs: dict[str, Any]):
    """(the strategy to train ``module`` with, or None to keep DDP; the micro-batches per step when the choice
    changes them, else None). Prints the choice and why. Ranks our launcher starts re-run the script; they
    take the decision of the process that started them. Ranks an outside launcher started take rank 0's."""
    from distrain.planner.model_stats import ModelSpec, checkpoint_policy
    from distrain.strategies.registry import make_strategy

    world = runtime.nprocs * runtime.num_nodes
    if world == 1:
        return None, None
    fingerprint = f"{type(module).__qualname__}/{getattr(loader, 'batch_size', None)}/{world}/{accumulate}"
    inherited = os.environ.get(PLANNED_ENV)
    choice = None
    if inherited and os.environ.get("DISTRAIN_LAUNCHED"):
        values = json.loads(inherited)
        if values.get("config") == fingerprint:
            choice = values
    if choice is None:  # under an outside launcher: rank 0 plans, every rank takes its choice
        strategy = runtime.strategy
        choose = lambda: _choose(runtime, module, loader, accumulate, clip, kwargs, fingerprint)  # noqa: E731
        choice = distributed.decide_before_strategy(
            choose, runtime.accelerator.name, strategy.process_group_backend, strategy.timeout
        )
        if choice is None:
            return None, None
        os.environ[PLANNED_ENV] = json.dumps(choice)
    options = {k: v for k, v in kwargs.items() if k in GENERIC_OPTIONS}
    if choice["sharding"]:
        options["sharding_strategy"] = choice["sharding"]
    if choice["planned_checkpoint"]:
        blocks = tuple(ModelSpec.from_module(module, loader).block_classes)
        options["activation_checkpointing_policy"] = checkpoint_policy(blocks, choice["checkpoint"])
    return make_strategy(choice["strategy"], world, **options), choice.get("accumulate")


def _choose(runtime, module, loader, accumulate: int, clip: float | None, kwargs: dict[str, Any], fingerprint: str):
    """The planner's choice as plain values, or None to keep DDP; says which and why."""
    from torch.utils.data import DataLoader

    from distrain.planner.estimate import Job
    from distrain.planner.model_stats import ModelSpec
    from distrain.planner.plan import Budget, Planner
    from distrain.planner.units import human

    say, world = runtime.print, runtime.nprocs * runtime.num_nodes
    if not isinstance(loader, DataLoader) or loader.batch_size is None or not hasattr(loader.dataset, "__len__"):
        say("distrain: strategy auto → ddp (the memory planner needs a DataLoader with a batch size)")
        return None
    policy = kwargs.get("activation_checkpointing_policy")
    blocks = _policy_classes(policy)
    try:
        spec = ModelSpec.from_module(module, loader, blocks)
        gpu = runtime.accelerator.name == "cuda"
        job = Job(spec, loader.batch_size, runtime.precision.name, world, runtime.num_nodes, accumulate, clip, gpu)
        budget = Budget.resolve(runtime.nprocs, gpu=gpu)
        planner = Planner(job, budget, rates_or_none(job))
        row, seen = planner.choose("auto", True if policy else "both")
    except Exception as e:  # the plan is advice: training goes on without it
        say(f"distrain: strategy auto → ddp (the memory planner could not trace {type(module).__name__}: {e})")
        return None
    if row is None:
        say(
            f"distrain: strategy auto: nothing fits in {human(budget.usable)} per rank "
            f"({planner.reason(None, seen)}); trying ddp"
        )
        return None
    say(f"distrain: strategy auto → {planner.reason(row, seen)}")
    option = row.option
    return {
        "config": fingerprint,
        "strategy": option.strategy,
        "sharding": option.sharding if option.family == "fsdp" else None,
        "checkpoint": option.checkpoint,
        "planned_checkpoint": not policy and option.checkpoint != 0,
        "accumulate": row.accumulate if row.accumulate != accumulate else None,
    }


def _policy_classes(policy) -> tuple[type, ...] | None:
    if isinstance(policy, dict):
        policy = policy.get("classes")
    if isinstance(policy, type):
        return (policy,)
    if isinstance(policy, (set, list, tuple, frozenset)):
        return tuple(policy)
    return None
