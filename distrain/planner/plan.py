"""The plan: every option's per-rank memory against the budget, ranked, with a recommendation.

Ranking (the fastest first): no offload before offload (moving state over PCIe every step costs
the most), then the least sharding (nothing < optimizer state < gradients < parameters within a
node < parameters across all ranks: each level adds communication), then the least recomputation
(none < some blocks < every block), then torch's own engines before one that steps its own optimizer
(DeepSpeed) at the same level. ``strategy="auto"`` takes the fastest option that fits among those its
cost model lets it choose (the user's optimizer unchanged); ZeRO rows are there to compare, and to pick
by name. What each option holds and costs is its cost model's (``planner/models/``); nothing here
names a strategy.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

from distrain.planner.estimate import Estimator, Job, Option, Row
from distrain.planner.models import model_for_strategy, models
from distrain.planner.timing import Hardware, StepTime
from distrain.units import cell, format_rate, format_seconds, format_size, human, parse_size

#: share of each budget kept free: the CUDA caching allocator's fragmentation, the CUDA context,
#: NCCL and cuBLAS workspaces are memory that tensors cannot use
HEADROOM = 0.10
#: predicted step times within this share of each other count as a tie (the ranking order decides): the
#: prediction is within ±25% (benchmarks/plan_time.py) and one machine's measured steps spread by ±10%, so a
#: smaller difference is no reason to shard more, recompute or switch engines
TIE = 0.10


def host_memory() -> int:
    """This machine's total memory (the same on every node of a uniform cluster, so every rank
    that plans reaches the same answer)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        raise ValueError("cannot read this machine's memory: give --cpu-memory (e.g. 64GB)") from None


def device_memory() -> int | None:
    """Memory of this machine's first CUDA device, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory


@dataclass
class Budget:
    """Memory per rank: on its device, and on the host for offloaded state."""

    device: int
    host: int
    gpu: bool
    source: str
    headroom: float = HEADROOM

    @property
    def usable(self) -> int:
        return int(self.device * (1 - self.headroom))

    @property
    def usable_host(self) -> int:
        return int(self.host * (1 - self.headroom))

    @classmethod
    def resolve(
        cls,
        ranks_per_node: int,
        gpu: bool | None = None,
        gpu_memory: str | int | None = None,
        cpu_memory: str | int | None = None,
    ) -> Budget:
        """The budget from ``--gpu-memory`` (per device) and ``--cpu-memory`` (per node), each
        defaulting to this machine's. A GPU plan when asked, when ``gpu_memory`` is given, or when
        this machine has a GPU; on a CPU run each rank gets its share of the node's memory."""
        host = parse_size(cpu_memory) if cpu_memory is not None else host_memory()
        host_source = "--cpu-memory" if cpu_memory is not None else "this machine"
        if gpu is None:
            gpu = gpu_memory is not None or device_memory() is not None
        per_rank_host = host // max(1, ranks_per_node)
        if not gpu:
            source = f"{format_size(host)} GiB host memory ({host_source}) / {ranks_per_node} ranks"
            return cls(per_rank_host, per_rank_host, False, source)
        if gpu_memory is not None:
            device, device_source = parse_size(gpu_memory), "--gpu-memory"
        else:
            device, device_source = device_memory(), "this machine"
            if device is None:
                raise ValueError("planning for GPUs on a machine without one: give --gpu-memory (e.g. 80GB)")
        source = f"{format_size(device)} GiB per GPU ({device_source}), {format_size(host)} GiB host per node"
        return cls(device, per_rank_host, True, source)


# ---- options and their order ---------------------------------------------------------------------------
def rank_key(option: Option) -> tuple:
    ac = 0 if option.checkpoint == 0 else 2 if option.checkpoint is None else 1
    offload = {"none": 0, "cpu": 1, "nvme": 2}[option.offload]
    return (offload > 0, option.level, ac, offload, option.model.replaces_optimizer)


def _offered(job: Job, shares_samples: bool) -> list[Option]:
    """The options the cost models offer ``job``: those whose ranks share samples, or the others. Replica groups
    take only what spans them."""
    return [
        option
        for model in models()
        if model.shares_samples == shares_samples and (job.replica_groups == 1 or model.spans_replica_groups)
        for option in model.offered(job)
    ]


def candidate_options(job: Job, strategy: str = "all", checkpoint: str | bool = "both") -> list[Option]:
    """The data-parallel options for a job, in ranking order (layouts whose ranks share samples run more
    micro-batches: ``Planner.model_parallel_planners``). ``strategy``: ``all``, ``auto`` (those it may choose)
    or a strategy name; ``checkpoint``: ``both`` (with and without), True, False."""
    options = _offered(job, shares_samples=False)
    if strategy == "auto":
        options = [o for o in options if o.model.auto_may_choose(o)]
    elif strategy != "all":  # the option that strategy runs, as the run would start it
        run = option_for_run(strategy, job)
        options = [run] if run is not None else []
    options = [replace(o, checkpoint=c) for o in options for c in _checkpoint_variants(checkpoint)]
    return sorted(options, key=rank_key)


def _checkpoint_variants(checkpoint: str | bool) -> list[int | None]:
    """``both``: without and with every block checkpointed; True: with; False: without."""
    return [0, None] if checkpoint == "both" else [None] if checkpoint is True else [0]


def option_for_run(strategy: str, job: Job) -> Option | None:
    """The option an explicitly named strategy runs, as ``distrain train`` would start it (its cost model's
    answer: what the config's section of the strategy says, ``job.configured``, such as FSDP's sharding and offload
    or the ZeRO stage of the user's DeepSpeed JSON; the layout of the job's sizes). None for what no model prices (a
    pipeline of tensor-parallel stages, a strategy registered without a cost model)."""
    model = model_for_strategy(strategy)
    return model.option_for_run(strategy, job) if model is not None else None


# ---- the plan ---------------------------------------------------------------------------------------------
@dataclass
class Plan:
    job: Job
    budget: Budget
    rows: list[Row]
    recommendation: Row | None
    reason: str
    suggestions: list[str] = field(default_factory=list)
    run: Option | None = None
    """The option ``distrain train`` with the same arguments runs (marked in the table and the JSON)."""
    hardware_source: str = ""

    def mark_run(self, option: Option) -> None:
        self.run = option
        if not any(self.is_run(r) for r in self.rows):
            self.run = None

    def is_run(self, row: Row) -> bool:
        """The row of the option the run takes as configured (not the same layout at another accumulation)."""
        return row.option == self.run and row.accumulate == self.job.accumulate

    def header(self) -> str:
        job, budget = self.job, self.budget
        spec = job.spec
        return (
            f"{spec.name}: micro-batch {job.micro_batch} × {spec.seq_len} tokens, {job.precision}"
            + (f", accumulation {job.accumulate}" if job.accumulate > 1 else "")
            + (", AC per operation (selective)" if spec.selective_checkpointing else "")
            + f", {job.world_size} rank{'s' if job.world_size > 1 else ''}"
            + (f" ({job.num_nodes} nodes × {job.per_node})" if job.num_nodes > 1 else "")
            + f"; {budget.source}; {int(budget.headroom * 100)}% kept free → {human(budget.usable)} usable per rank"
        )

    def table(self) -> str:
        timed = any(r.step for r in self.rows)
        cols = ("params", "grads", "optim", "activ.", "buffers", "peak", "host", "fits", "max batch", "max seq")
        if timed:
            cols += ("step", "tokens/s")
        labels = [self._label(r) for r in self.rows]
        width = max([len(label) for label in labels] + [24])
        lines = [self.header(), ""]
        lines.append(f"{'per rank (M: MiB, G: GiB)':<{width}} " + " ".join(f"{c:>8}" for c in cols))
        for r, label in zip(self.rows, labels):
            host = cell(r.host) if r.host else "-"
            cells = [cell(v) for v in (r.params, r.grads, r.optimizer, r.activations, r.buffers, r.peak)]
            cells += [host, "yes" if r.fits else "no", "-" if r.max_micro_batch is None else str(r.max_micro_batch)]
            cells += ["-" if r.max_seq_len is None else format_rate(r.max_seq_len)]
            if timed:
                cells += [
                    format_seconds(r.step.seconds),
                    format_rate(r.tokens_per_step / r.step.seconds),
                ]
            mark = "  ← this run" if self.is_run(r) else ""
            lines.append(f"{label:<{width}} " + " ".join(f"{c:>8}" for c in cells) + mark)
        lines.append("")
        lines.append(
            "activ.: the most activation memory alive at once (forward/backward) at this micro-batch; "
            "buffers: all-gather/reduce-scatter and DeepSpeed buckets; peak: the larger of forward/backward "
            "and the optimizer step; max batch: the largest micro-batch that fits; max seq: the longest sequence that "
            "fits at this micro-batch (tokens)"
        )
        if any(r.accumulate != self.job.accumulate for r in self.rows):
            lines.append(
                "accum N: tensor- and context-parallel ranks and pipeline stages share their samples, so N "
                "micro-batches per step keep the job's global batch"
            )
        routed = [r for r in self.rows if r.worst_routing_peak]
        if routed:
            lines.append(
                "worst routing: the peak of a rank whose experts the router sends every token it can (expert "
                "parallelism drops none): "
                + "; ".join(
                    f"{r.label} {human(r.worst_routing_peak)}"
                    + ("" if r.worst_routing_peak <= self.budget.usable else " (does not fit)")
                    for r in routed
                )
            )
        if timed:
            lines.append(
                f"step: predicted time per optimizer step; tokens/s: the whole job's ({self.job.world_size} ranks); "
                f"rates: {self.hardware_source}"
            )
        lines.append(f"recommendation: {self.reason}")
        lines += [f"  {s}" for s in self.suggestions]
        return "\n".join(lines)

    def _label(self, row: Row) -> str:
        return row.label + (f" (accum {row.accumulate})" if row.accumulate != self.job.accumulate else "")

    def to_json(self) -> dict:
        job = self.job
        return {
            "model": job.spec.name,
            "micro_batch": job.micro_batch,
            "seq_len": job.spec.seq_len,
            "precision": job.precision,
            "world_size": job.world_size,
            "num_nodes": job.num_nodes,
            "device_budget_bytes": self.budget.device,
            "usable_bytes": self.budget.usable,
            "host_budget_bytes": self.budget.host,
            "rows": [
                {
                    **r.to_json(),
                    "tokens_per_second": r.tokens_per_step / r.step.seconds if r.step else None,
                    "this_run": self.is_run(r),
                }
                for r in self.rows
            ],
            "rates": self.hardware_source or None,
            "recommendation": self.recommendation.option.strategy if self.recommendation else None,
            "reason": self.reason,
            "suggestions": self.suggestions,
        }


class Planner:
    """Plans one job against one budget; estimates are made only when needed, and cached."""

    def __init__(self, job: Job, budget: Budget, hardware: Hardware | None = None, same_step: Planner | None = None):
        """``same_step``: the planner of this job at another accumulation, whose traced steps this one shares."""
        self.job = job
        self.budget = budget
        self.hardware = hardware
        """The device's and links' rates: with them every row has a predicted step time, and the
        choice is the fastest option that fits; without, the first that fits in ranking order."""
        self.estimator = Estimator(job, same_step.estimator if same_step else None)
        self._model_parallel: list[tuple[Planner, Option]] | None = None

    def row(self, option: Option, max_batch: bool = True) -> Row:
        row = self.estimator.estimate(option)
        fits = row.peak <= self.budget.usable and (row.host == 0 or row.host <= self.budget.usable_host)
        max_b = max_seq = None
        if max_batch and option.offload == "none":
            slope = self.estimator.activation_slope(option)
            if slope > 0:
                room = self.budget.usable - row.peak
                max_b = max(0, int(self.job.micro_batch + math.floor(room / slope)))
                # a sample's activations are tokens × a constant: the micro-batch's grow by b·slope/T a token
                seq_len, b = self.job.spec.seq_len, self.job.micro_batch
                max_seq = max(0, int(seq_len * (1 + room / (b * slope))))
        return replace(
            row,
            fits=fits,
            max_micro_batch=max_b,
            max_seq_len=max_seq,
            step=self.step_time(option),
            accumulate=self.job.accumulate,
            tokens_per_step=self.job.tokens_per_step_of(option),
        )

    def step_time(self, option: Option) -> StepTime | None:
        return self.estimator.step_time(option, self.hardware) if self.hardware else None

    def seconds(self, option: Option) -> float:
        step = self.step_time(option)
        return step.seconds if step else 0.0

    @staticmethod
    def prefer(fitting: list[Row]) -> Row:
        """Among options that fit: the fastest predicted; those within ``TIE`` of it count as equally fast,
        and the ranking order decides among them (less sharding, recomputation and offload first)."""
        fastest = min(r.step.seconds for r in fitting)
        near = [r for r in fitting if r.step.seconds <= fastest * (1 + TIE)]
        return min(near, key=lambda r: rank_key(r.option))

    def fitting_checkpoint(self, option: Option) -> Row | None:
        """``activation_checkpointing: auto``: the option with the fewest checkpointed blocks that
        fits (none, some, every one), or None."""
        blocks = self.job.spec.num_blocks
        none = self.row(replace(option, checkpoint=0), max_batch=False)
        if none.fits:
            return none
        every = self.row(replace(option, checkpoint=None), max_batch=False)
        if not every.fits or blocks <= 1:
            return every if every.fits else None
        for count in range(1, blocks):  # rows for partial counts are arithmetic on cached estimates
            row = self.row(replace(option, checkpoint=count), max_batch=False)
            if row.fits:
                return row
        return every

    def choose(self, strategy: str = "auto", checkpoint: bool | str = "both") -> tuple[Row | None, list[Row]]:
        """The option to run and the rows looked at to find it: with the hardware's rates, the fastest
        predicted that fits (``prefer``; options tried fastest first, until they are slower than the
        fastest that fits by more than the tie); without, the first that fits in ranking order.
        ``checkpoint="auto"``: each option with just enough checkpointed blocks, which decides its
        time, so every such option is looked at. ``auto`` and ``all`` look at tensor-parallel and pipeline
        layouts too, each with the accumulation that keeps the global batch (``model_parallel_planners``)."""
        seen: list[Row] = []
        options = candidate_options(self.job, strategy, False if checkpoint == "auto" else checkpoint)
        candidates = [(self, o) for o in options]
        if strategy in ("auto", "all"):
            variants = _checkpoint_variants(checkpoint)  # "auto": without; fitting_checkpoint adds blocks
            candidates += [(p, replace(o, checkpoint=c)) for p, o in self.model_parallel_planners() for c in variants]
            candidates.sort(key=lambda pair: rank_key(pair[1]))
        if checkpoint == "auto":
            fitting = []
            for planner, option in candidates:
                row = planner.fitting_checkpoint(option)
                seen.append(row or planner.row(replace(option, checkpoint=None), max_batch=False))
                if row is not None:
                    fitting.append(row)
                    if self.hardware is None:
                        return row, seen
            if not fitting:
                return None, seen
            best = self.prefer(fitting)
            return best, [r for r in seen if r is best or r.step.seconds < best.step.seconds]
        if self.hardware is None:
            for planner, option in candidates:
                row = planner.row(option, max_batch=False)
                seen.append(row)
                if row.fits:
                    return row, seen
            return None, seen
        # fastest first, by a bound that costs no simulation: a tensor-parallel or pipeline layout is simulated
        # (seconds each) only when its bound could still beat the fastest option that fits
        fitting: list[Row] = []
        walked: list[tuple[float, int, Row]] = []
        by_bound = sorted((self.seconds_at_least(*pair), index, pair) for index, pair in enumerate(candidates))
        for bound, index, (planner, option) in by_bound:
            if fitting and bound > min(r.step.seconds for r in fitting) * (1 + TIE):
                break
            row = planner.row(option, max_batch=False)
            walked.append((row.step.seconds, index, row))
            if row.fits:
                fitting.append(row)
        # the rows looked at, as a walk in order of the exact time sees them: up to the fastest that fits and the
        # options within the tie of it
        last = min(r.step.seconds for r in fitting) * (1 + TIE) if fitting else math.inf
        seen = [row for seconds, _, row in sorted(walked, key=lambda w: w[:2]) if seconds <= last]
        return (self.prefer(fitting) if fitting else None), seen

    def seconds_at_least(self, planner: Planner, option: Option) -> float:
        """``planner.seconds(option)``, or, for a layout whose time needs a simulated step (tensor parallel, a
        pipeline), its cost model's bound below it from this planner's trace of the same micro-batch."""
        return option.model.seconds_at_least(self.estimator, planner, option, self.hardware)

    def model_parallel_planners(self) -> list[tuple[Planner, Option]]:
        """The tensor-parallel and pipeline layouts a run of this job could take, each with the planner of the
        same job at the accumulation that keeps its global batch: their ranks share samples (a micro-batch is
        per data-parallel rank), so each step runs ``tensor × pipeline`` times the micro-batches. Made once:
        their planners keep their traces and simulations for ``choose`` and ``plan`` alike, and share this one's traced
        steps."""
        if self._model_parallel is None:
            self._model_parallel = []
            for option in _offered(self.job, shares_samples=True):
                job = replace(self.job, accumulate=self.job.accumulate * option.sharing_a_sample)
                self._model_parallel.append((Planner(job, self.budget, self.hardware, same_step=self), option))
        return self._model_parallel

    def reason(self, chosen: Row | None, seen: list[Row]) -> str:
        """``fsdp FULL_SHARD + AC: DDP needs 112 GiB/rank, FSDP 61, FSDP+AC 38 of 72``."""
        values = [r.peak for r in seen] + [self.budget.usable]
        unit = "GiB" if max(values) >= 2**30 else "MiB"
        one_unit = min(values) >= (2**30 if unit == "GiB" else 2**20) / 10  # else each number with its own unit
        size = (lambda n: format_size(n, unit)) if one_unit else human
        parts = []
        # the memory story reads in ranking order (DDP, then more sharding), whatever order time put them in
        for i, r in enumerate(sorted(seen, key=lambda r: rank_key(r.option))):
            parts.append(f"{r.option.short} {'needs ' if i == 0 else ''}{size(r.peak)}")
            if i == 0:
                parts[-1] += f" {unit}/rank" if one_unit else "/rank"
        budget = f" of {size(self.budget.usable)}"
        if chosen is None:
            return "nothing fits: " + ", ".join(parts) + budget
        why = ", ".join(parts) + budget
        if len(seen) == 1 and chosen.option.level == 0 and chosen.option.checkpoint == 0:
            why += " (fits with nothing sharded, recomputed or offloaded)"
        if chosen.step is not None:
            tokens = chosen.tokens_per_step / chosen.step.seconds
            why += f"; predicted {format_seconds(chosen.step.seconds)}/step, {tokens:,.0f} tokens/s: "
            faster = [r for r in seen if r.fits and r.step and r.step.seconds < chosen.step.seconds]
            if faster:
                best = min(faster, key=lambda r: r.step.seconds)
                why += (
                    f"within {TIE:.0%} of the fastest that fits ({best.option.short} "
                    f"{format_seconds(best.step.seconds)}), and simpler"
                )
            else:
                why += "the fastest that fits"
        if chosen.accumulate != self.job.accumulate:
            why += (
                f" (accumulation {chosen.accumulate} instead of {self.job.accumulate}: its ranks share samples, so "
                "the global batch stays the same)"
            )
        return f"{chosen.label}: {why}"

    def plan(self, strategy: str = "all", checkpoint: bool | str = "both") -> Plan:
        """``strategy="all"``: every option for the job's global batch (tensor-parallel and pipeline layouts
        with the accumulation that keeps it), the recommendation as ``auto`` would choose."""
        options = [(self, o) for o in candidate_options(self.job, strategy, checkpoint)]
        if strategy == "all":
            variants = _checkpoint_variants(checkpoint)
            options += [(p, replace(o, checkpoint=c)) for p, o in self.model_parallel_planners() for c in variants]
        for planner, option in options:  # every row's simulations side by side, one child process each
            planner.estimator.prefetch(option)
        rows = sorted((p.row(o) for p, o in options), key=lambda r: rank_key(r.option))
        eligible = [r for r in rows if r.option.model.auto_may_choose(r.option)] if strategy == "all" else rows
        if self.hardware is not None:
            eligible = sorted(eligible, key=lambda r: r.step.seconds)
            fitting = [r for r in eligible if r.fits]
            chosen = self.prefer(fitting) if fitting else None
        else:
            chosen = next((r for r in eligible if r.fits), None)
        seen = eligible[: eligible.index(chosen) + 1] if chosen else eligible
        seen = _distinct(seen)
        reason = self.reason(chosen, seen) + self._semi_sync_note(chosen, rows)
        suggestions = [] if chosen else self.smallest_changes(rows)
        source = self.hardware.source if self.hardware else ""
        return Plan(self.job, self.budget, rows, chosen, reason, suggestions, hardware_source=source)

    @staticmethod
    def _semi_sync_note(chosen: Row | None, rows: list[Row]) -> str:
        """Replica groups: what meeting every ``sync_every`` steps would gain over this link (never chosen for the
        user: it trains another way, whose loss they should check)."""
        semi = [r for r in rows if r.option.get("semi_sync") and r.fits and r.step and r.option.checkpoint == 0]
        if chosen is None or chosen.step is None or not semi:
            return ""
        best = min(semi, key=lambda r: r.step.seconds)
        gain = chosen.step.seconds / best.step.seconds
        if gain < 1 + TIE:
            return ""
        return (
            f"; {best.label} would train at {gain:.1f}× the tokens/s over this link between the groups (another "
            "optimization: compare its loss)"
        )

    def smallest_changes(self, rows: list[Row]) -> list[str]:
        """What would make it fit: a smaller micro-batch, more devices, offload."""
        out = []
        smaller = [r for r in rows if r.option.offload == "none" and r.max_micro_batch]
        if smaller:
            best = max(smaller, key=lambda r: (r.max_micro_batch, [-x for x in rank_key(r.option)]))
            out.append(f"a micro-batch of {best.max_micro_batch} (training.batch_size_per_gpu) with {best.label}")
        # what shrinks as 1/N with more ranks: every state sharded across every rank, by an engine auto may choose
        sharded = [r for r in rows if r.option.level == 4 and r.option.offload == "none"]
        sharded = [r for r in sharded if r.option.model.auto_may_choose(r.option)]
        if sharded:
            best = min(sharded, key=lambda r: r.peak)
            devices = self._devices_needed(best)
            if devices:
                per_node = self.job.per_node
                nodes = math.ceil(devices / per_node)
                out.append(
                    f"about {nodes * per_node} devices ({nodes} nodes × {per_node}, --num-nodes {nodes}) with "
                    f"{best.label}"
                )
        offloaded = [r for r in rows if r.option.offload != "none" and r.fits]
        if offloaded:
            r = offloaded[0]
            out.append(f"offload: {r.label} ({human(r.peak)} on the device)")
        if not out:
            out.append("no single change found: a smaller model, shorter sequences, or devices with more memory")
        return ["it would fit with " + out[0]] + [f"or with {s}" for s in out[1:]]

    def _devices_needed(self, row: Row) -> int | None:
        """Fully sharded state shrinks as 1/N; the rest (activations, one unit's gathered
        parameters) does not. The smallest power-of-two multiple of this world size that fits."""
        sharded = row.sharded
        fixed = row.peak - sharded
        if fixed >= self.budget.usable:
            return None
        world = self.job.world_size
        for factor in (2**k for k in range(1, 11)):
            if fixed + sharded / factor <= self.budget.usable:
                return world * factor
        return None


def _distinct(rows: list[Row]) -> list[Row]:
    """One row per (strategy, checkpointing) in a reason: offload variants repeat their base."""
    out, seen = [], set()
    for r in rows:
        key = (r.option.short,)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out
