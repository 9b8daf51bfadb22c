"""DeepSpeed ZeRO's per-rank memory, counted from what its optimizer allocates (deepspeed 0.19.8,
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

from distrain import compat
from distrain.planner.estimate import Estimator, Option, Row
from distrain.planner.model_stats import ELEMENT_BYTES, create_optimizer_state, first_optimizer

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
    from distrain.strategies.deepspeed_config import TrainingFacts, _fill_buckets, options_config

    if user is None:
        user = options_config(stage, False, False, "cpu", "cpu", "/local_nvme", 2e8, 2e8, True, True, False, False)
    cfg = {"zero_optimization": dict(user.get("zero_optimization", user))}
    if hidden_size is not None:
        _fill_buckets(cfg, TrainingFacts(hidden_size=hidden_size), "the DeepSpeed config")
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


def flat_optimizer(est: Estimator, on_gpu_fused: bool) -> FlatOptimizer:
    """Traced once on a fake flat tensor: state bytes and step temporaries per element. On CUDA,
    DeepSpeed swaps torch's Adam/AdamW for its FusedAdam (in-place kernels, no temporaries)."""
    cached = getattr(est, "_flat_optimizer", None)
    if cached is not None:
        return cached
    from distrain.planner.model_stats import _Phases

    numel = 1 << 16
    module = est.job.spec.build()
    prototype = first_optimizer(module.configure_optimizers())
    fused = on_gpu_fused and type(prototype) in (torch.optim.Adam, torch.optim.AdamW)
    with compat.fake_tensor_mode(allow_non_fake_inputs=True):
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
        phases = _Phases()
        phases.phase = "step"
        tracker = compat.timeline_memory_tracker(phases.sample)
        tracker.track_external(holder, optimizer, flat.grad)
        with tracker:
            optimizer.step()
        state = sum(
            v.numel() * v.element_size()
            for s in optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim()
        )
    result = FlatOptimizer(state / numel, 0.0 if fused else phases.step_extra / numel)
    est._flat_optimizer = result
    return result


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


def zero_row(est: Estimator, option: Option) -> Row:
    job = est.job
    zero = zero_settings(job.zero or None, option.stage, job.spec.hidden_size)
    param_dtype, _ = est.dtypes("zero")
    pb = ELEMENT_BYTES[param_dtype]
    stats = est.stats
    trace = est.trace("zero", option.checkpoint)
    opt = flat_optimizer(est, on_gpu_fused=job.gpu and option.offload == "none")
    frozen = (stats.numel - stats.trainable) * pb + stats.buffer_bytes
    bucket = int(zero["reduce_bucket_size"])
    buckets = (
        (2 if zero["overlap_comm"] and option.stage < 3 else 1) * bucket * pb if zero["contiguous_gradients"] else 0
    )
    if option.stage in (1, 2):
        return _stage_1_2(est, option, trace, opt, zero, pb, frozen, buckets, bucket)
    return _stage_3(est, option, trace, opt, zero, pb, frozen, buckets)


def _stage_1_2(est, option, trace, opt, zero, pb, frozen, buckets, bucket) -> Row:
    world, stats = est.job.world_size, est.stats
    align = 2 * world  # nccl_start_alignment_factor × world size
    groups = trace.groups
    flat = sum(math.ceil(sum(g) / align) * align for g in groups)
    part = flat // world
    params = flat * pb + frozen
    master = 4 * part
    state = int(opt.state_per_element * part)
    step_flat = 4 * part  # the flattened gradient partition, cast to fp32 for the inner optimizer
    step_extra = int(opt.step_extra_per_element * part)
    # each rank's grads_in_partition appears at its first bucket reduction in backward, beside the
    # activations still alive then; the busiest rank sets the peak
    first_copy = _first_partition_copy(trace, world, align, bucket)
    per_rank = {r: sum(_partition_grad_elements(g, world, align, r) for g in groups) * pb for r in range(world)}
    grads = max(per_rank.values())
    backward = max(
        max(trace.activations, trace.activations_from(first_copy.get(r, len(trace.timeline))) + per_rank[r])
        for r in range(world)
    )
    forward_backward = params + master + state + buckets + backward
    if option.offload == "none":
        step = params + master + state + grads + step_flat + step_extra
        return Row(
            option,
            params,
            grads,
            master + state,
            trace.activations,
            buckets,
            max(forward_backward, step),
            sharded=master + state + grads,
        )
    # optimizer offload: master, states, fp32 gradients and a bit16 staging copy of the partition live
    # on the host (DeepSpeed's CPU Adam steps there); the device keeps the parameters, buckets and a
    # gradient staging buffer of the largest parameter
    staging = stats.largest_param * pb
    device = params + buckets + staging + trace.activations
    host = master + state + 4 * part + pb * part + staging
    return Row(option, params, 0, 0, trace.activations, buckets + staging, device, host=host)


def _stage_3(est, option, trace, opt, zero, pb, frozen, buckets) -> Row:
    world, stats = est.job.world_size, est.stats
    shapes = stats.shapes
    numels = [math.prod(s) for s in shapes]
    part = sum(math.ceil(n / world) for n in numels)
    threshold = int(zero["stage3_param_persistence_threshold"])
    persistent = sum(n for n in numels if n <= threshold)
    gatherable = sum(n for n in numels if n > threshold)
    # kept gathered from forward into backward while reused within the reuse distance (in elements,
    # counted over the modules in between: twice the parameters after a layer), plus the module at
    # work and the prefetch bucket
    reuse = int(zero["stage3_max_reuse_distance"])
    working = stats.largest_layer + int(zero["stage3_prefetch_bucket_size"])
    gathered = min(gatherable, reuse // 2 + working) * pb
    params = part * pb + persistent * pb + gathered + frozen
    master = 4 * part
    state = int(opt.state_per_element * part)
    grads = part * pb  # grad_partitions_flat_buffer, allocated at set-up
    chunk = min(part, int(zero["sub_group_size"]))
    step_extra = 4 * chunk + int(opt.step_extra_per_element * chunk)
    if option.offload == "none":
        forward_backward = params + master + state + grads + buckets + trace.activations
        step = part * pb + persistent * pb + frozen + master + state + grads + buckets + step_extra
        return Row(
            option,
            params,
            grads,
            master + state,
            trace.activations,
            buckets,
            max(forward_backward, step),
            sharded=part * pb + master + state + grads,
        )
    # parameter + optimizer offload: partitions, masters, states and gradients live on the host; the
    # device holds the persistent parameters, the gathered working set, the bucket and activations
    device = persistent * pb + gathered + frozen + buckets + trace.activations
    host = part * pb + master + state + 4 * part
    return Row(option, persistent * pb + gathered + frozen, 0, 0, trace.activations, buckets, device, host=host)
