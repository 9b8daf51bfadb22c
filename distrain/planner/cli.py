"""The planner on the command line: ``distrain plan`` and its what-if over cluster shapes. The decisions
``distrain train`` takes before any rank starts are ``decide.py``'s."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from distrain.batch import BatchLayout, keep_global_batch
from distrain.planner.estimate import Job, Row
from distrain.planner.from_config import (
    budget_from_config,
    job_from_config,
    plans_for_gpu,
    runs_activation_checkpointing,
)
from distrain.planner.machine import resolve_hardware
from distrain.planner.plan import Planner, option_for_run
from distrain.planner.timing import Hardware
from distrain.units import format_rate, format_seconds

if TYPE_CHECKING:
    from distrain.config import RunConfig


# ---- the rates a plan is timed with ---------------------------------------------------------------------------
@dataclass
class TimingArgs:
    """``distrain plan``'s timing flags."""

    enabled: bool = True
    gpu_type: str | None = None
    bandwidth: float | None = None
    """GB/s."""
    inter_node_bandwidth: float | None = None
    tokens: float | None = None
    gpu_hour_price: float | None = None
    measure: bool = False
    """Measure this machine's rates again (instead of taking the kept ones)."""

    @classmethod
    def from_args(cls, args) -> TimingArgs:
        for flag in ("bandwidth", "inter_node_bandwidth", "tokens", "gpu_hour_price"):
            value = getattr(args, flag)
            if value is not None and value <= 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be positive, not {value}")
        return cls(
            not args.no_time,
            args.gpu_type,
            args.bandwidth,
            args.inter_node_bandwidth,
            args.tokens,
            args.gpu_hour_price,
            args.measure,
        )

    def hardware(self, job: Job) -> Hardware | None:
        if not self.enabled:
            return None
        gb = lambda v: None if v is None else v * 1e9  # noqa: E731
        return resolve_hardware(
            job.gpu,
            job.precision,
            job.per_node,
            self.gpu_type,
            gb(self.bandwidth),
            gb(self.inter_node_bandwidth),
            self.measure,
        )


# ---- distrain plan -----------------------------------------------------------------------------------------
def plan_command(config: RunConfig, strategy: str, as_json: bool, timing: TimingArgs | None = None) -> int:
    """``--strategy all`` (the default): every option, the run's own marked when the config names one;
    ``--strategy X``: the option X runs as ``distrain train`` with the same arguments would start it (the
    config's FSDP sharding, the DeepSpeed JSON's stage and offload), with and without activation checkpointing."""
    gpu = plans_for_gpu(config)
    job = job_from_config(config, gpu)
    budget = budget_from_config(config, gpu, job.per_node)
    ac = config.training.activation_checkpointing
    runs_ac = runs_activation_checkpointing(config)
    checkpoint = True if runs_ac and strategy == "all" else "both"
    named = config.distributed.strategy
    hardware = (timing or TimingArgs()).hardware(job)
    plan = Planner(job, budget, hardware).plan("all" if strategy in ("all", "auto") else named, checkpoint)
    if not plan.rows:  # a layout the planner has no model of: say so, not "nothing fits"
        print(
            f"distrain plan: strategy {strategy} is not planned (the planner models DDP, FSDP, DeepSpeed ZeRO, and "
            "tensor parallelism and pipelines of the built-in GPT and Llama-style models, with FSDP); "
            "`distrain plan` without --strategy plans the others",
            file=sys.stderr,
        )
        return 2
    run = option_for_run(named, job) if named != "auto" else None
    if run is not None and ac != "auto":
        plan.mark_run(replace(run, checkpoint=None if runs_ac else 0))
    if as_json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(plan.table())
    return 0


def what_if_command(config: RunConfig, shapes: list[tuple[str, int]], timing: TimingArgs, as_json: bool) -> int:
    """``distrain plan --num-nodes 1,2,4,8`` (or ``--devices 2,4,8``): per cluster shape, the fastest option that
    fits, its tokens/s, the time and cost of ``--tokens``, and the micro-batch × accumulation that keeps the
    configured global batch on that many ranks (what an elastic resume takes)."""
    from copy import deepcopy

    if not timing.enabled:
        raise ValueError("a what-if plan compares step times: drop --no-time")
    gpu = plans_for_gpu(config)
    base = job_from_config(config, gpu)
    saved = BatchLayout(base.micro_batch, base.accumulate, base.world_size)
    rows = []
    for flag, value in shapes:
        shaped = deepcopy(config)
        setattr(shaped.distributed, flag, value)
        job = job_from_config(shaped, gpu)
        layout, _ = keep_global_batch(saved, base.micro_batch, job.world_size)
        job = replace(job, micro_batch=layout.micro_batch, accumulate=layout.accumulate)
        budget = budget_from_config(shaped, gpu, job.per_node)
        planner = Planner(job, budget, timing.hardware(job))
        row, _ = planner.choose("all", "auto")
        rows.append(_shape_row(job, layout, row, timing))
    if as_json:
        print(json.dumps({"model": base.spec.name, "global_batch": saved.global_batch, "shapes": rows}, indent=2))
        return 0
    hw = timing.hardware(base)
    print(
        f"{base.spec.name}: global batch {saved.global_batch} × {base.spec.seq_len} tokens, {base.precision}; "
        f"rates: {hw.source}"
    )
    cols = ["nodes", "devices", "option", "micro×accum", "step", "tokens/s"]
    if timing.tokens:
        cols.append(f"time for {timing.tokens:.3g} tokens")
    if timing.tokens and timing.gpu_hour_price:
        cols.append("cost")
    table = [cols]
    for r in rows:
        if r["option"] is None:
            table.append([str(r["num_nodes"]), str(r["world_size"]), "nothing fits"] + [""] * (len(cols) - 3))
            continue
        cells = [str(r["num_nodes"]), str(r["world_size"]), r["option"], f"{r['micro_batch']}×{r['accumulate']}"]
        cells += [format_seconds(r["step_seconds"]), format_rate(r["tokens_per_second"])]
        if timing.tokens:
            cells.append(_duration(r["seconds_for_tokens"]))
        if timing.tokens and timing.gpu_hour_price:
            cells.append(f"{r['cost']:,.0f}")
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for row in table:
        print("  ".join(c.ljust(w) if i == 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    print("micro×accum: keeps the global batch on that many ranks (as an elastic resume would)")
    return 0


def _shape_row(job: Job, layout, row: Row | None, timing: TimingArgs) -> dict:
    out = {
        "num_nodes": job.num_nodes,
        "world_size": job.world_size,
        "micro_batch": layout.micro_batch,
        "accumulate": layout.accumulate,
        "global_batch": layout.global_batch,
        "data_parallel_size": job.world_size,
        "option": None,
    }
    if row is None or row.step is None:
        return out
    tokens_per_second = row.tokens_per_step / row.step.seconds
    out.update(option=row.label, strategy=row.option.strategy, step_seconds=row.step.seconds)
    # a tensor-, context-parallel or pipeline layout: its ranks share samples, so more micro-batches keep the
    # global batch
    out.update(accumulate=row.accumulate, data_parallel_size=job.world_size // row.option.sharing_a_sample)
    out["tokens_per_second"] = tokens_per_second
    if timing.tokens:
        out["seconds_for_tokens"] = timing.tokens / tokens_per_second
        if timing.gpu_hour_price:
            out["cost"] = out["seconds_for_tokens"] / 3600 * job.world_size * timing.gpu_hour_price
    return out


def _duration(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
