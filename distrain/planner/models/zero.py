"""The cost model of the ``deepspeed_*`` strategies. DeepSpeed ZeRO's per-rank memory, counted from what its
optimizer allocates (deepspeed 0.19.8,
``runtime/zero/stage_1_and_2.py`` and ``stage3.py``), with the traced activations and the
module's own optimizer traced on a flat fp32 partition.

ZeRO keeps its own buffers beside the model, and they are sized by its config, not by the model:
the gradient buckets (``reduce_bucket_size`` elements, two of them with ``overlap_comm``) are
allocated whole whatever the model's size — 1.5 GiB per rank at 200M-element fp32 buckets. The
parts, per rank (N ranks, Ψ parameters, p bytes per parameter in the engine's dtype):

stage 1 / 2:
  parameters        the flat bit16 (or fp32) copy of every parameter       Ψ·p (aligned to 2N)
  fp32 master       this rank's partition                                  4·Ψ/N
  optimizer state   the optimizer's state on that partition (Adam: 8·Ψ/N)
  gradients         ``grads_in_partition``: the gradients of the parameters that overlap this
                    rank's partition, allocated at the first bucket reduction in backward
  buckets           ``ipg`` reduction buffers                             (1|2)·bucket·p
  step              the flattened gradient partition cast to fp32 (4·Ψ/N) and the optimizer's
                    own temporaries on it
stage 3:
  parameters        each parameter's partition (ceil(n/N) each), plus the persistent ones
                    (≤ ``stage3_param_persistence_threshold`` elements) whole, plus the gathered
                    working set: parameters stay gathered while they are reused within
                    ``stage3_max_reuse_distance`` elements, so a model smaller than half of it
                    keeps all of them gathered from forward into backward
  fp32 master, optimizer state, gradient partition (engine dtype), one bucket, and in the step
  the fp32 copy of the gradient partition (per ``sub_group_size`` chunk) with the optimizer's
  temporaries
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from distrain.planner import fake
from distrain.planner.model_stats import create_optimizer_state, first_optimizer
from distrain.planner.models import CostModel, model_of
from distrain.planner.models.replicated import replicated
from distrain.planner.options import Option, Row
from distrain.planner.timing import Collective, buckets, step_time

#: DeepSpeed's own defaults for what distrain's config leaves unset (deepspeed 0.19.8 ``DeepSpeedZeroConfig``)
DEEPSPEED_DEFAULTS = {
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
    "contiguous_gradients": True,
    "overlap_comm": False,
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
}


def zero_settings(user: dict | None, stage: int, hidden_size: int | None) -> dict:
    """The ``zero_optimization`` values a run would use: the user's DeepSpeed config section if
    given, else the one distrain's DeepSpeedStrategy builds; "auto" filled by the same rules."""
    from distrain.strategies.deepspeed import DeepSpeedStrategy
    from distrain.strategies.deepspeed_config import TrainingFacts, fill_buckets

    if user is None:
        user = DeepSpeedStrategy(stage=stage).config
    cfg = {"zero_optimization": dict(user.get("zero_optimization", user))}
    if hidden_size is not None:
        fill_buckets(cfg, TrainingFacts(hidden_size=hidden_size), "the DeepSpeed config")
    zero = {**DEEPSPEED_DEFAULTS, **cfg["zero_optimization"]}
    for key in DEEPSPEED_DEFAULTS:
        if zero[key] == "auto":  # no hidden size to fill it from
            zero[key] = DEEPSPEED_DEFAULTS[key]
    return zero


@dataclass
class FlatOptimizer:
    """The module's optimizer on one flat fp32 partition (what ZeRO's inner optimizer steps)."""

    state_per_element: float
    step_extra_per_element: float


def flat_optimizer(est, on_gpu_fused: bool) -> FlatOptimizer:
    """Traced on a fake flat tensor (once per estimator: ``zero_states`` keeps it): state bytes and step
    temporaries per element. On CUDA, DeepSpeed swaps torch's Adam/AdamW for its FusedAdam (in-place kernels,
    no temporaries)."""
    from distrain.planner.model_stats import Phases

    numel = 1 << 16
    module = est.job.spec.build()
    prototype = first_optimizer(module.configure_optimizers())
    fused = on_gpu_fused and type(prototype) in (torch.optim.Adam, torch.optim.AdamW)
    with fake.fake_tensor_mode(allow_non_fake_inputs=True):
        flat = torch.nn.Parameter(torch.zeros(numel))
        group = {k: v for k, v in prototype.param_groups[0].items() if k != "params"}
        optimizer = type(prototype)([{**group, "params": [flat]}])
        if est.job.gpu:
            for group in optimizer.param_groups:
                if group.get("foreach", False) is None:
                    group["foreach"] = True
        holder = torch.nn.Module()
        holder.flat = flat
        create_optimizer_state(holder, optimizer)
        flat.grad = torch.zeros_like(flat)
        phases = Phases()
        phases.phase = "step"
        tracker = fake.timeline_memory_tracker(phases.sample)
        tracker.track_external(holder, optimizer, flat.grad)
        with tracker:
            optimizer.step()
        state = sum(
            v.numel() * v.element_size()
            for s in optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim()
        )
    return FlatOptimizer(state / numel, 0.0 if fused else phases.step_extra / numel)


def _owners(group: list[int], world: int, align: int) -> list[set[int]]:
    """For each parameter of a flattened group, the ranks whose partition it overlaps."""
    size = math.ceil(sum(group) / align) * align // world
    owners, start = [], 0
    for n in group:
        first, last = start // size, (start + max(n, 1) - 1) // size
        owners.append(set(range(first, min(last, world - 1) + 1)))
        start += n
    return owners


def _first_partition_copy(trace, world: int, align: int, bucket: int) -> dict[int, int]:
    """When, in the traced backward, each rank allocates ``grads_in_partition``: at the first
    bucket reduction that holds one of its parameters. DeepSpeed reduces the bucket when the next
    gradient would overflow it (``reduce_independent_p_g_buckets_and_remove_grads``); a gradient
    larger than the bucket waits, on its own, for the next reduction; the rest goes at the end."""
    owners = [_owners(g, world, align) for g in trace.groups]
    first: dict[int, int] = {}
    pending: list[tuple[int, int]] = []
    elements = 0
    for index, g, i in trace.grad_events:
        n = trace.groups[g][i]
        if elements + n > bucket:
            for pg, pi in pending:
                for rank in owners[pg][pi]:
                    first.setdefault(rank, index)
            pending, elements = [], 0
        pending.append((g, i))
        elements += n
    for pg, pi in pending:  # the end-of-backward reduction
        for rank in owners[pg][pi]:
            first.setdefault(rank, len(trace.timeline))
    return first


def _partition_grad_elements(group: list[int], world: int, align: int, rank: int) -> int:
    """Elements of ``grads_in_partition`` on ``rank``: every parameter that overlaps its slice of
    the flat group counts whole."""
    owners = _owners(group, world, align)
    return sum(n for n, ranks in zip(group, owners) if rank in ranks)


def optimizer_groups(est) -> list[list[int]]:
    """The optimizer's parameter groups (trainable element counts, in order), from the meta model:
    ZeRO flattens and partitions each group on its own."""
    optimizer = first_optimizer(est.job.spec.build().configure_optimizers())
    groups = [[p.numel() for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
    return [g for g in groups if g]


@dataclass
class ZeroStates:
    """One rank's model states under ZeRO (bytes), before activations."""

    params: int
    """Stage 1/2: the flat copy of every parameter; stage 3: this rank's partitions and the persistent ones."""
    master: int
    """The fp32 master partition."""
    optimizer: int
    """The optimizer's state on it."""
    grads: int
    """Stage 1/2: ``grads_in_partition`` on the busiest rank; stage 3: the gradient-partition buffer."""
    step_grad: int
    """During the step: the gradient partition flattened and cast to fp32 (stage 3: one sub-group at a time)."""
    step_extra: int
    """During the step: the optimizer's temporaries on that fp32 partition."""
    buckets: int
    """The ``ipg`` reduction buffers (two with ``overlap_comm`` at stages 1/2)."""
    gathered: int = 0
    """Stage 3, forward and backward: parameters gathered and kept while reused."""
    part: int = 0
    """Elements of this rank's partition."""
    per_rank_grads: dict[int, int] | None = None

    @property
    def resident(self) -> int:
        """What stays allocated between steps."""
        return self.params + self.master + self.optimizer + self.grads

    @property
    def at_step(self) -> int:
        """Model states while the optimizer steps (no activations, no buckets)."""
        return self.resident + self.step_grad + self.step_extra


def zero_states(est, option: Option) -> ZeroStates:
    job = est.job
    world, stats = job.world_size, est.stats
    zero = zero_settings(_user_json(job) or None, option.get("stage"), job.spec.hidden_size)
    pb = est.dtypes("zero")[0].itemsize
    fused = job.gpu and option.offload == "none"
    opt = est.memo(("zero-flat-optimizer", fused), lambda: flat_optimizer(est, on_gpu_fused=fused))
    frozen = (stats.numel - stats.trainable) * pb + stats.buffer_bytes
    bucket = int(zero["reduce_bucket_size"])
    copies = 2 if zero["overlap_comm"] and option.get("stage") < 3 else 1
    buckets = copies * bucket * pb if zero["contiguous_gradients"] else 0
    if option.get("stage") in (1, 2):
        align = 2 * world  # nccl_start_alignment_factor × world size
        groups = est.memo(("zero-optimizer-groups",), lambda: optimizer_groups(est))
        flat = sum(math.ceil(sum(g) / align) * align for g in groups)
        part = flat // world
        per_rank = {r: sum(_partition_grad_elements(g, world, align, r) for g in groups) * pb for r in range(world)}
        return ZeroStates(
            params=flat * pb + frozen,
            master=4 * part,
            optimizer=int(opt.state_per_element * part),
            grads=max(per_rank.values()),
            step_grad=4 * part,
            step_extra=int(opt.step_extra_per_element * part),
            buckets=buckets,
            part=part,
            per_rank_grads=per_rank,
        )
    numels = [math.prod(s) for s in stats.shapes]
    part = sum(math.ceil(n / world) for n in numels)
    threshold = int(zero["stage3_param_persistence_threshold"])
    persistent = sum(n for n in numels if n <= threshold)
    gatherable = sum(n for n in numels if n > threshold)
    # kept gathered from forward into backward while reused within the reuse distance (elements of
    # the modules in between: twice the parameters after a layer), plus the module at work and the
    # prefetch bucket; a model under half the distance keeps every parameter gathered
    reuse = int(zero["stage3_max_reuse_distance"])
    working = stats.largest_layer + int(zero["stage3_prefetch_bucket_size"])
    chunk = min(part, int(zero["sub_group_size"]))
    return ZeroStates(
        params=part * pb + persistent * pb + frozen,
        master=4 * part,
        optimizer=int(opt.state_per_element * part),
        grads=part * pb,
        step_grad=4 * chunk,
        step_extra=int(opt.step_extra_per_element * chunk),
        buckets=buckets,
        gathered=min(gatherable, reuse // 2 + working) * pb,
        part=part,
    )


def zero_row(est, option: Option) -> Row:
    job = est.job
    zero = zero_settings(_user_json(job) or None, option.get("stage"), job.spec.hidden_size)
    states = zero_states(est, option)
    trace = est.trace("zero", option.checkpoint)
    pb = est.dtypes("zero")[0].itemsize
    if option.get("stage") in (1, 2):
        return _stage_1_2(est, option, states, trace, pb, int(zero["reduce_bucket_size"]))
    return _stage_3(est, option, states, trace, pb)


def _stage_1_2(est, option, states: ZeroStates, trace, pb: int, bucket: int) -> Row:
    world = est.job.world_size
    s = states
    # each rank's grads_in_partition appears at its first bucket reduction in backward, beside the
    # activations still alive then; the busiest rank sets the peak
    first_copy = _first_partition_copy(trace, world, 2 * world, bucket)
    backward = max(
        max(trace.activations, trace.activations_from(first_copy.get(r, len(trace.timeline))) + grads)
        for r, grads in s.per_rank_grads.items()
    )
    if option.offload == "none":
        forward_backward = s.params + s.master + s.optimizer + s.buckets + backward
        return Row(
            option,
            s.params,
            s.grads,
            s.master + s.optimizer,
            trace.activations,
            s.buckets,
            max(forward_backward, s.at_step),
            sharded=s.master + s.optimizer + s.grads,
        )
    # optimizer offload: master, states, fp32 gradients and a bit16 staging copy of the partition live
    # on the host (DeepSpeed's CPU Adam steps there); the device keeps the parameters, buckets and a
    # gradient staging buffer of the largest parameter
    staging = est.stats.largest_param * pb
    device = s.params + s.buckets + staging + trace.activations
    host = s.master + s.optimizer + 4 * s.part + pb * s.part + staging
    return Row(option, s.params, 0, 0, trace.activations, s.buckets + staging, device, host=host)


def _stage_3(est, option, states: ZeroStates, trace, pb: int) -> Row:
    s = states
    if option.offload == "none":
        forward_backward = s.resident + s.gathered + s.buckets + trace.activations
        step = s.at_step + s.buckets
        return Row(
            option,
            s.params + s.gathered,
            s.grads,
            s.master + s.optimizer,
            trace.activations,
            s.buckets,
            max(forward_backward, step),
            sharded=s.part * pb + s.master + s.optimizer + s.grads,
        )
    # parameter + optimizer offload: partitions, masters, states and gradients live on the host; the
    # device holds the persistent parameters, the gathered working set, the bucket and activations
    on_device = s.params - s.part * pb + s.gathered
    host = s.part * pb + s.master + s.optimizer + 4 * s.part
    return Row(
        option, on_device, 0, 0, trace.activations, s.buckets, on_device + s.buckets + trace.activations, host=host
    )


class Zero(CostModel):
    kinds = ("zero",)
    sharded_dtypes = True
    reentrant_checkpointing = True  # DeepSpeed's activation checkpointing
    replaces_optimizer = True

    def offered(self, job) -> list[Option]:
        # the engine owns the model's dtypes (DeepSpeed refuses fp8), and its checkpointing is reentrant (no selective)
        if job.world_size == 1 or job.float8 or job.spec.selective_checkpointing:
            return []
        options = [Option("zero", stage=s) for s in (1, 2, 3)]
        if job.gpu:
            options += [Option("zero", stage=2, offload="cpu"), Option("zero", stage=3, offload="cpu")]
        return options

    def from_config(self, config) -> dict:
        """The DeepSpeed config the run's strategy builds from the ``deepspeed:`` section (its stage, offload and
        bucket sizes): the section's JSON file, or the stage and offload that the plain ``deepspeed`` takes from the
        section. A preset (``deepspeed_stage_3_offload``) fixes its own: ``option_for_run`` reads its name."""
        from distrain.strategies import registry

        name = config.distributed.strategy
        if config.deepspeed.config is None and name != "deepspeed":
            return {}
        strategy = registry.make_strategy(name, 2, **registry.options_from_config(name, config, set()))
        return {"json": strategy.config}

    def option_for_run(self, strategy: str, job) -> Option:
        """The stage and offload of the user's DeepSpeed JSON (``from_config``) when there is one, else the
        preset's."""
        if job.float8:
            raise ValueError(f"precision='fp8' is not supported with {strategy} (DeepSpeed owns the model's dtypes)")
        stage, offload = _zero_of(strategy, _user_json(job))
        if stage == 0:  # no ZeRO: every rank holds everything, as under DDP
            return replicated(job)
        return Option("zero", stage=stage, offload=offload if job.gpu else "none")

    def strategy(self, option) -> str:
        suffix = {"none": "", "cpu": "_offload", "nvme": "_offload_nvme"}[option.offload]
        return f"deepspeed_stage_{option.get('stage')}{suffix}"

    def level(self, option) -> int:
        return {1: 1, 2: 2, 3: 4}[option.get("stage")]

    def label(self, option, accumulate=None) -> str:
        return f"zero-{option.get('stage')}"

    def short(self, option) -> str:
        return f"ZeRO-{option.get('stage')}"

    def offloaded(self, option) -> str:
        return "opt+params" if option.get("stage") == 3 else "opt"

    def sharding(self, option) -> str:
        return f"zero-{option.get('stage')}"

    def estimate(self, estimator, option) -> Row:
        return zero_row(estimator, option)

    def time_of(self, option, job, trace, units: int, hw):
        """The step of ``trace`` (the bare step in the engine's dtypes) with ``units`` stage-3 gather units."""
        sent = self.collectives(option, job, trace, units)
        gathers = (
            2 * job.accumulate if option.get("stage") == 3 else 0
        )  # stage 3's offloaded parameters, at each gather
        return step_time(job, trace, sent, hw, 1 / job.world_size, option.offload != "none", gathers)

    def collectives(self, option, job, trace, units: int) -> list[Collective]:
        """Gradients reduced in the model's dtype, in reduce buckets; updated parameters all-gathered (stage 3:
        gathered in forward and backward, by unit)."""
        n, a = job.world_size, job.accumulate
        if n == 1:
            return []
        params, grads, inter = trace.param_bytes, trace.grad_bytes, job.num_nodes > 1
        bucket = _zero_bucket_bytes(job, trace)
        if option.get("stage") == 3:
            return [
                Collective("all_gather", params, n, 2 * a, units, inter, True),
                Collective("reduce_scatter", grads, n, a, buckets(grads, bucket), inter, True),
            ]
        reductions = a if option.get("stage") == 2 else 1  # stage 2 reduces in every micro-batch's backward
        return [
            Collective("reduce_scatter", grads, n, reductions, buckets(grads, bucket), inter, True),
            Collective("all_gather", params, n, 1, buckets(params, bucket), inter, True),
        ]


def _user_json(job) -> dict:
    """The user's DeepSpeed JSON (``Zero.from_config``), or {}."""
    return model_of("zero").configured(job).get("json") or {}


def _zero_bucket_bytes(job, trace) -> float:
    user = _user_json(job)
    zero = user.get("zero_optimization", user) if user else {}
    size = zero.get("reduce_bucket_size", 200_000_000)
    elements = float(size) if isinstance(size, (int, float)) else 200_000_000.0
    bytes_per = trace.grad_bytes / max(1, trace.elements)
    return elements * bytes_per


def _zero_of(strategy: str, user: dict | None) -> tuple[int, str]:
    """(stage, where its state is offloaded) of a DeepSpeed run: the user's config, else the preset."""
    from distrain.strategies.deepspeed_config import PRESETS, zero_stage

    if user:
        zero = user.get("zero_optimization", {})
        devices = {zero.get(k, {}).get("device", "none") for k in ("offload_optimizer", "offload_param")}
        return zero_stage(user), "nvme" if "nvme" in devices else "cpu" if "cpu" in devices else "none"
    preset = PRESETS.get(strategy, {"stage": 2})
    return preset["stage"], "nvme" if "nvme" in strategy else "cpu" if preset.get("offload_optimizer") else "none"


MODELS = (Zero(),)
