"""The planner on the command line: ``distrain plan``, and the decisions ``distrain train`` takes
before any rank starts (``strategy: auto``, ``activation_checkpointing: auto``, the does-it-fit
warning, stopping when nothing fits)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from distrain.config import RunConfig
from distrain.planner.batch import BatchLayout, keep_global_batch
from distrain.planner.estimate import Job, Option, Row
from distrain.planner.machine import resolve_hardware
from distrain.planner.model_stats import ModelSpec
from distrain.planner.plan import Budget, Planner, option_for_run
from distrain.planner.timing import Hardware
from distrain.planner.units import format_rate, format_seconds, human

#: the decision of the process that planned, for the ranks its launcher starts (they re-run the command)
PLANNED_ENV = "DISTRAIN_PLANNED"


# ---- from a run's config ---------------------------------------------------------------------------------
def plans_for_gpu(config: RunConfig) -> bool:
    import torch

    accelerator = config.distributed.accelerator
    if accelerator in ("gpu", "cuda"):
        return True
    if accelerator == "cpu":
        return False
    return config.distributed.gpu_memory is not None or torch.cuda.is_available()


def ranks_per_node(config: RunConfig, gpu: bool) -> int:
    devices = config.distributed.devices
    if devices != "auto":
        return int(devices)
    import torch

    from distrain.accelerators import Accelerator, auto_device_count

    if gpu:
        if not torch.cuda.is_available():
            raise ValueError("planning for GPUs on a machine without one: give --devices (GPUs per node)")
        return torch.cuda.device_count()
    return auto_device_count(Accelerator())


def spec_from_config(config: RunConfig, job=None) -> ModelSpec:
    from distrain.models.gpt import GPT_SIZES

    t, data = config.training, config.data
    if t.model_name in GPT_SIZES:
        return ModelSpec.builtin_gpt(t.model_name, data.seq_len)
    if hasattr(job, "hf_config"):  # the Hugging Face job has read the model's config and sized its data
        return ModelSpec.huggingface(t.model_name, job.data.max_length, job.task, t.num_labels, hf_config=job.hf_config)
    return ModelSpec.huggingface(t.model_name, data.max_length or data.seq_len, t.task, t.num_labels)


def zero_config(config: RunConfig) -> dict | None:
    """The DeepSpeed config a ZeRO run would use: the user's JSON, if given."""
    path = config.deepspeed.config
    if path is None:
        return None
    from distrain.strategies.deepspeed_config import read_user_config

    return read_user_config(path)[0]


def job_from_config(config: RunConfig, gpu: bool, job=None) -> Job:
    t, d = config.training, config.distributed
    # ddp_torchft: replica_groups groups of `devices` ranks each, all on this machine; DDP over all of them
    per_node = ranks_per_node(config, gpu) * (d.replica_groups if d.strategy == "ddp_torchft" else 1)
    return Job(
        spec=spec_from_config(config, job),
        micro_batch=t.batch_size_per_gpu,
        precision=t.precision,
        world_size=per_node * d.num_nodes,
        num_nodes=d.num_nodes,
        accumulate=t.gradient_accumulation_steps,
        clip=t.max_grad_norm or None,
        gpu=gpu,
        zero=zero_config(config) or {},
        gradient_as_bucket_view=d.gradient_as_bucket_view,
        fsdp_options={
            "forward_prefetch": config.fsdp.forward_prefetch,
            "mixed_precision": {k: v for k, v in vars(config.fsdp.mixed_precision).items() if v} or None,
        },
        fsdp_sharding=config.fsdp.sharding_strategy,
        fsdp_cpu_offload=config.fsdp.cpu_offload,
        tensor_parallel=d.tensor_parallel_size,
        sequence_parallel=d.sequence_parallel,
        pipeline_stages=d.pipeline_stages,
        pipeline_schedule=d.pipeline_schedule,
        stages_per_rank=d.pipeline_stages_per_rank,
        split_points=d.pipeline_split_points,
        **(
            dict(
                replica_groups=d.replica_groups,
                semi_sync=d.semi_sync,
                sync_every=d.sync_every,
                outer_momentum=d.outer_momentum,
            )
            if d.strategy == "ddp_torchft"
            else {}
        ),  # fmt: skip
    )


def runs_activation_checkpointing(config: RunConfig) -> bool:
    """Whether ``distrain train`` checkpoints every block: ``training.activation_checkpointing: true``, the
    spec's ``activation_checkpointing.enabled``, or a DeepSpeed JSON that says how activations are
    checkpointed (partitioned, on the CPU)."""
    if config.training.activation_checkpointing is True or config.fsdp.activation_checkpointing.enabled:
        return True
    section = (zero_config(config) or {}).get("activation_checkpointing") or {}
    return any(section.get(k) for k in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"))


def budget_from_config(config: RunConfig, gpu: bool, per_node: int) -> Budget:
    d = config.distributed
    return Budget.resolve(per_node, gpu=gpu, gpu_memory=d.gpu_memory, cpu_memory=d.cpu_memory)


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
    if not plan.rows:  # a layout the planner has no model of (3-D): say so, not "nothing fits"
        print(
            f"distrain plan: strategy {strategy} is not planned (the planner models DDP, FSDP, DeepSpeed ZeRO, and "
            "tensor parallelism or pipelines of the built-in GPT and Llama-style models, with FSDP; not both at once); "
            "`distrain plan` without --strategy plans the others",
            file=sys.stderr,
        )
        return 2
    run = option_for_run(named, job, job.fsdp_sharding, job.fsdp_cpu_offload) if named != "auto" else None
    if run is not None and ac != "auto":
        plan.mark_run(_with_checkpoint(run, None if runs_ac else 0))
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
    # a tensor-parallel or pipeline layout: its ranks share samples, so more micro-batches keep the global batch
    shared = row.option.tensor * row.option.pipeline
    out.update(accumulate=row.accumulate, data_parallel_size=job.world_size // shared)
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


# ---- distrain train ------------------------------------------------------------------------------------------
@dataclass
class Decision:
    """What the planner decided for a run."""

    strategy: str
    sharding: str | None = None
    checkpoint: int | None = 0
    """Blocks to checkpoint: 0 none, ``None`` every one (the planner's; the config's when not planned)."""
    planned_checkpoint: bool = False
    """The planner chose ``checkpoint`` (else the config's activation checkpointing applies)."""
    accumulate: int | None = None
    """Micro-batches per optimizer step, when the plan changes them: a tensor-parallel or pipeline layout that
    ``auto`` chose keeps the config's global batch with more micro-batches per data-parallel rank."""
    messages: list[str] = field(default_factory=list)
    stop: bool = False

    def strategy_options(self, block_classes) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.sharding is not None:
            options["sharding_strategy"] = self.sharding
        if self.planned_checkpoint:
            from distrain.planner.model_stats import checkpoint_policy

            options["activation_checkpointing_policy"] = checkpoint_policy(tuple(block_classes), self.checkpoint)
        return options

    def to_env(self, config: RunConfig) -> str:
        return json.dumps(
            {
                "config": _fingerprint(config),
                "strategy": self.strategy,
                "sharding": self.sharding,
                "checkpoint": self.checkpoint,
                "planned_checkpoint": self.planned_checkpoint,
                "accumulate": self.accumulate,
            }
        )

    @classmethod
    def from_env(cls, text: str, config: RunConfig) -> Decision | None:
        """The decision the launching process took for this same config, if it took one."""
        values = json.loads(text)
        if values.pop("config", None) != _fingerprint(config):
            return None
        return cls(**values)


def _fingerprint(config: RunConfig) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def decide_for_training(config: RunConfig, job=None) -> Decision:
    """Before any rank starts: resolve ``strategy: auto`` and ``activation_checkpointing: auto``
    with the memory plan, warn when an explicit strategy will not fit, stop when nothing fits. A
    planner failure never stops a run: it falls back to what the config says, with a note. Under an
    outside launcher every rank runs this: rank 0 plans, and the others take its decision
    (``decide_before_strategy``) or, when there is nothing to decide, skip the plan (rank 0 warns)."""
    from datetime import timedelta

    from distrain import distributed
    from distrain.cluster import detect_cluster

    inherited = os.environ.get(PLANNED_ENV)
    if inherited and os.environ.get("DISTRAIN_LAUNCHED"):  # a rank our launcher started: the parent decided
        decision = Decision.from_env(inherited, config)
        if decision is not None:
            return decision
    d = config.distributed
    if d.strategy != "auto" and config.training.activation_checkpointing != "auto":
        if detect_cluster().rank != 0:  # only a warning to compute, and rank 0 prints it
            return Decision(strategy=d.strategy)
        return _planned(config, job)
    timeout = timedelta(seconds=d.timeout_seconds)
    decision = distributed.decide_before_strategy(lambda: _planned(config, job), d.accelerator, d.backend, timeout)
    os.environ[PLANNED_ENV] = decision.to_env(config)  # on every rank: what a later look-up here finds
    return decision


def _planned(config: RunConfig, job) -> Decision:
    from distrain.planner import cache

    fallback = Decision(strategy=_without_plan(config))
    try:
        gpu = plans_for_gpu(config)
        per_node = ranks_per_node(config, gpu)
        plan_key = cache.key(config, budget_from_config(config, gpu, per_node), per_node)
        kept = cache.read(plan_key)
        if kept is not None:  # this run (or its twin) was planned before on this machine: no trace, no timing
            decision = Decision(**kept)
            decision.messages = [f"{m} (planned before: {cache.directory()})" for m in decision.messages]
        else:
            decision = _decide(config, job)
            if not decision.stop:
                kept = {name: getattr(decision, name) for name in cache.FIELDS}
                # the key again: a first plan on this machine has just measured and kept its rates, which the
                # next start's key includes
                cache.write(cache.key(config, budget_from_config(config, gpu, per_node), per_node), kept)
    except Exception as e:  # the plan is advice; training must not depend on it
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        fallback.messages.append(f"distrain: the memory planner could not plan this run ({type(e).__name__}: {first})")
        return fallback
    os.environ[PLANNED_ENV] = decision.to_env(config)
    return decision


def rates_or_none(job: Job) -> Hardware | None:
    """The rates to time options with, or None (then the ranking order decides) when they cannot be had."""
    try:
        return resolve_hardware(job.gpu, job.precision, job.per_node)
    except Exception:  # noqa: BLE001 — timing refines the choice; a plan without it is still a plan
        return None


def _without_plan(config: RunConfig) -> str:
    """``auto`` as it was before the planner: one process → single, several → ddp."""
    d = config.distributed
    if d.strategy != "auto":
        return d.strategy
    try:
        return "ddp" if ranks_per_node(config, plans_for_gpu(config)) * d.num_nodes > 1 else "single"
    except Exception:
        return "auto"


def _decide(config: RunConfig, job) -> Decision:
    d, t = config.distributed, config.training
    gpu = plans_for_gpu(config)
    job = job_from_config(config, gpu, job)
    budget = budget_from_config(config, gpu, job.per_node)
    ac = t.activation_checkpointing
    # auto takes the fastest predicted option that fits: this machine's rates (a second to measure on a CPU)
    planner = Planner(job, budget, rates_or_none(job) if d.strategy == "auto" else None)
    if d.strategy == "auto":
        checkpoint = "auto" if ac == "auto" else (True if ac else "both")
        row, seen = planner.choose("auto", checkpoint)
        if row is None:
            plan = planner.plan("all", "both")
            return Decision(
                strategy="auto",
                stop=True,
                messages=[
                    plan.table(),
                    f"distrain: nothing fits in {human(budget.usable)} per rank; not starting "
                    "(`distrain plan` with the same arguments shows this table)",
                ],
            )
        option = row.option
        planned_ac = ac == "auto" or (ac is False and option.checkpoint != 0)
        return Decision(
            strategy=option.strategy,
            sharding=option.sharding if option.family == "fsdp" else None,
            checkpoint=option.checkpoint,
            planned_checkpoint=planned_ac,
            accumulate=row.accumulate if row.accumulate != job.accumulate else None,
            messages=[f"distrain: strategy auto → {planner.reason(row, seen)}"],
        )
    option = option_for_run(d.strategy, job, config.fsdp.sharding_strategy, config.fsdp.cpu_offload)
    if option is None:
        return Decision(strategy=d.strategy)
    if ac == "auto":
        row = planner.fitting_checkpoint(option)
        if row is None:
            every = planner.row(_with_checkpoint(option, None), max_batch=False)
            return Decision(
                strategy=d.strategy,
                checkpoint=None,
                planned_checkpoint=True,
                messages=[_does_not_fit(every, budget)],
            )
        blocks = "no blocks" if row.option.checkpoint == 0 else "every block"
        if row.option.checkpoint not in (0, None):
            blocks = f"the first {row.option.checkpoint} of {job.spec.num_blocks} blocks"
        return Decision(
            strategy=d.strategy,
            checkpoint=row.option.checkpoint,
            planned_checkpoint=True,
            messages=[
                f"distrain: activation_checkpointing auto → {blocks}: {human(row.peak)} per rank "
                f"of {human(budget.usable)}"
            ],
        )
    row = planner.row(_with_checkpoint(option, None if ac else 0), max_batch=False)
    return Decision(strategy=d.strategy, messages=[] if row.fits else [_does_not_fit(row, budget)])


def _with_checkpoint(option: Option, checkpoint: int | None) -> Option:
    from dataclasses import replace

    return replace(option, checkpoint=checkpoint)


def _does_not_fit(row: Row, budget: Budget) -> str:
    return (
        f"distrain: warning: the memory plan says {row.label} needs {human(row.peak)} per rank, more than "
        f"the {human(budget.usable)} usable ({budget.source}): it will not fit. `distrain plan` with the same "
        "arguments shows what would"
    )


def print_messages(decision: Decision) -> None:
    if int(os.environ.get("RANK", 0)) != 0:
        return
    for message in decision.messages:
        print(message, file=sys.stderr if decision.stop or "warning" in message else sys.stdout, flush=True)
