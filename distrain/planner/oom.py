"""What the memory plan says about a rank that ran out of memory: the run's predicted peak per rank against the
budget, and the nearest option of the plan that fits.

    memory plan: ddp needs 92.1 GiB per rank of 72.0 GiB usable; nearest option that fits: fsdp FULL_SHARD + AC,
    61.3 GiB (strategy fsdp, activation checkpointing on); or micro-batch 2 × accumulation 8 with ddp

Nothing is planned while the run trains: only a rank that ran out (a CUDA out-of-memory error, or a rank the kernel's
OOM killer ended) asks, through ``Runtime.memory_plan``, which the Trainer's fit points here. The plan is made in a
thread given ``SECONDS``: what it found by then is said. A plan the planner cannot make (a module it cannot trace, a
strategy it has no model of) is said to be unavailable, never raised: the line that names the rank comes first.

``host``: the kernel killed the rank, so the memory that ran out is the host's. On a GPU run that is what the plan
keeps there (offloaded state), not the device's peak; on a CPU run the two are the same.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

#: how long the failing rank plans (a small model: 2-7 s on 2 busy cores, most of it torch's first trace). Its record
#: is written before, so a launcher that stops it meanwhile still names it and its error
SECONDS = 15.0


def memory_plan(
    runtime, module, loader, micro_batch: int, accumulate: int, clip: float | None, host=False, seconds=SECONDS
) -> str:
    """One line: the run's predicted peak per rank and the budget; the nearest option that fits (or, when the plan
    says the run fits, the nearest that needs less); a smaller micro-batch that keeps the global batch."""
    found: dict[str, Any] = {}
    args = (found, runtime, module, loader, micro_batch, accumulate, clip, host)
    worker = threading.Thread(target=_plan, args=args, daemon=True, name="distrain-memory-plan")
    worker.start()
    worker.join(seconds)  # a thread left running is a daemon: the process is on its way out
    return _describe(found, seconds, done=not worker.is_alive())


def _plan(found: dict, runtime, module, loader, micro_batch, accumulate, clip, host) -> None:
    """Fills ``found`` as it goes (``budget``, ``row`` and ``need``, then ``nearest``, then ``smaller``), or
    ``unavailable``."""
    from distrain.batch import BatchLayout, keep_global_batch
    from distrain.planner.estimate import Job
    from distrain.planner.model_stats import ModelSpec
    from distrain.planner.plan import Budget, Planner, candidate_options, option_for_run, rank_key
    from distrain.strategies.layers import is_selective

    strategy = runtime.strategy
    try:
        if strategy.traits.collective_forward:  # FSDP, ZeRO-3, tensor parallel: the module holds shards, wrapped
            found["unavailable"] = (
                f"{type(strategy).__name__} has sharded the model the planner would trace; `distrain plan` with this "
                "run's arguments plans it"
            )
            return
        planned_as = strategy.planned_as
        if planned_as is None:
            found["unavailable"] = f"the planner has no model of {type(strategy).__name__}"
            return
        name, fields = planned_as
        spec = ModelSpec.from_module(module, loader)
        if is_selective(strategy.activation_checkpointing_policy):
            spec = spec.with_selective_checkpointing()
        gpu = runtime.accelerator.name == "cuda"
        world = runtime.world_size
        job = Job(spec, micro_batch, runtime.precision.name, world, runtime.num_nodes, accumulate, clip, gpu, **fields)
        option = option_for_run(name, job)
        if option is None:
            found["unavailable"] = f"the planner has no model of {type(strategy).__name__}"
            return
        option = replace(option, checkpoint=_checkpointed(strategy.activation_checkpointing_policy, spec.num_blocks))
        planner = Planner(job, Budget.resolve(runtime.nprocs, gpu=gpu))
        need = (lambda r: r.host) if host and gpu else (lambda r: r.peak)  # the memory that ran out
        row = planner.row(option, max_batch=False)
        found.update(budget=planner.budget, row=row, on_host=host and gpu)
        # the first option ranked after the run's (more sharded, recomputed or offloaded) that fits and needs less
        nearest = None
        for candidate in candidate_options(job, "all", "both"):
            if candidate == option or rank_key(candidate) < rank_key(option):
                continue
            other = planner.row(candidate, max_batch=False)
            if other.fits and need(other) < need(row):
                nearest = other
                break
        found["nearest"] = nearest  # (None: the search ended without one)
        if not row.fits and not found["on_host"]:  # the run's layout with smaller micro-batches, the global batch kept
            most = planner.row(option).max_micro_batch
            if most and most < micro_batch:
                layout, _ = keep_global_batch(BatchLayout(micro_batch, accumulate, world), most, world)
                smaller = f"micro-batch {layout.micro_batch} × accumulation {layout.accumulate}"
                found["smaller"] = f"{smaller} with {row.label}"
    except Exception as e:  # noqa: BLE001 — the plan is advice; the failure it explains comes first
        first = (str(e).strip().splitlines() or [""])[0][:200]
        found["unavailable"] = f"the planner could not plan {type(module).__name__}: {type(e).__name__}: {first}"


def _checkpointed(policy, blocks: int) -> int | None:
    """The blocks a run's activation checkpointing policy recomputes, as the planner counts them: 0 none, None every
    one, else the first n (``every_n``: as many as it selects)."""
    if not policy:
        return 0
    if isinstance(policy, dict):
        if policy.get("count") is not None:
            return policy["count"]
        every_n = int(policy.get("every_n", 1))
        if every_n > 1 and blocks:
            return -(-blocks // every_n)
    return None


def _describe(found: dict, seconds: float, done: bool) -> str:
    from distrain.units import human

    if "row" not in found:
        return f"memory plan: unavailable ({found.get('unavailable') or f'not made within {seconds:g} s'})"
    row, budget, on_host = found["row"], found["budget"], found["on_host"]
    if on_host:
        fits = row.host <= budget.usable_host
        usable = human(budget.usable_host)
        text = f"memory plan: {row.label} keeps {human(row.host)} per rank in host memory of {usable} usable"
        if fits:
            text += " (the rest is outside the plan — data loading? a checkpoint? another process?)"
    else:
        fits = row.fits
        text = f"memory plan: {row.label} needs {human(row.peak)} per rank of {human(budget.usable)} usable"
        if fits:
            text += " (predicted to fit: something outside the plan holds memory — another process? fragmentation?)"
    ways = []
    if found.get("nearest") is not None:
        nearest = found["nearest"]
        size = human(nearest.host if on_host else nearest.peak)
        ways.append(f"{nearest.label}, {size} ({_how(nearest.option)})")
    if found.get("smaller"):
        ways.append(found["smaller"])
    if ways:
        text += f"; nearest option that {'fits with less' if fits else 'fits'}: " + "; or ".join(ways)
    elif "nearest" in found:
        text += "; no option of the plan needs less" if fits else "; no option of the plan fits"
    elif not done:
        text += f"; no nearer option found within {seconds:g} s"
    return text


def _how(option) -> str:
    """What to set for ``option``: ``strategy fsdp, sharding_strategy SHARD_GRAD_OP, activation checkpointing on``."""
    how = f"strategy {option.strategy}"
    model = option.model
    for key, value in model.settings(option).items():
        if model.defaults.get(key) != value:  # what the strategy does unless told goes without saying
            how += f", {key} {value}"
    if option.checkpoint is None:
        how += ", activation checkpointing on"
    elif option.checkpoint:
        how += f", activation checkpointing on the first {option.checkpoint} blocks"
    return how


def memory_plan_of_fit(trainer, host: bool) -> str:
    """``Runtime.memory_plan`` for a Trainer's fit: what the memory planner says of this module and micro-batch
    under the running strategy, planned on the error path only."""
    from distrain.planner.oom import memory_plan

    micro_batch = trainer.batch_layout.micro_batch if trainer.batch_layout else 1
    accumulate, clip = trainer.loop.accumulate_for(trainer.current_epoch), trainer.loop.gradient_clip_val
    return memory_plan(trainer.runtime, trainer.module, trainer.train_dataloader, micro_batch, accumulate, clip, host)
