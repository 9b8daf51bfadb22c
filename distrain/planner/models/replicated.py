"""The cost model of the strategies whose every rank holds everything: one process, DDP (spawn, fork, notebook)
and DDP over replica groups (``ddp_torchft``, meeting every step or every ``sync_every`` steps)."""

from __future__ import annotations

import math
from dataclasses import replace

from distrain.planner.models import CostModel
from distrain.planner.options import Option, Row
from distrain.planner.timing import DDP_BUCKET_BYTES, Collective, buckets, step_time
from distrain.precision import compute_dtype
from distrain.strategies import registry


class Replicated(CostModel):
    kinds = ("single", "ddp")
    spans_replica_groups = True

    def offered(self, job) -> list[Option]:
        if job.world_size == 1:
            return [Option("single")]
        semi = [Option("ddp", semi_sync=m, sync_every=job.sync_every) for m in ("local_sgd", "diloco")]
        experts = offered_expert_parallel(job)
        return [Option("ddp"), *(semi if job.replica_groups > 1 else []), *experts]

    def option_for_run(self, strategy: str, job) -> Option:
        if registry.starts_replica_groups(strategy) and job.semi_sync and job.replica_groups > 1:
            return Option("ddp", semi_sync=job.semi_sync, sync_every=job.sync_every)
        if job.expert_parallel > 1 and not registry.runs_one_process(strategy):
            return Option("ddp", experts=job.expert_parallel)
        return replicated(job) if not registry.runs_one_process(strategy) else Option("single")

    def settings(self, option) -> dict:
        return {"expert_parallel_size": option.get("experts")} if option.get("experts") else {}

    def level(self, option) -> int:
        return 1 if option.get("experts") else 0  # the experts split: less than FSDP's, more than nothing

    def auto_may_choose(self, option) -> bool:
        return not option.get(
            "semi_sync"
        )  # a replica group meeting every H steps trains another way: shown, never chosen

    def label(self, option, accumulate=None) -> str:
        if option.family == "single":
            return "single process"
        semi_sync = option.get("semi_sync")
        if option.get("experts"):
            return f"ddp + experts over {option.get('experts')}"
        return f"ddp + {semi_sync} every {option.get('sync_every', 1)} steps" if semi_sync else "ddp"

    def short(self, option) -> str:
        if option.family == "single":
            return "1 process"
        semi_sync = option.get("semi_sync")
        if option.get("experts"):
            return f"DDP+EP{option.get('experts')}"
        return f"DDP {semi_sync}/{option.get('sync_every', 1)}" if semi_sync else "DDP"

    def estimate(self, estimator, option) -> Row:
        t = estimator.trace(option.family, option.checkpoint)
        job = estimator.job
        params = t.param_bytes + t.buffer_bytes
        grads, opt = t.grad_bytes, t.optimizer_bytes
        if option.get("experts"):  # each rank holds 1/N of the experts, their gradients and their state
            away = t.expert_bytes / t.param_bytes * (1 - 1 / option.get("experts"))
            params -= round(t.param_bytes * away)
            grads, opt = round(grads * (1 - away)), round(opt * (1 - away))
        if option.family == "single":
            # gradients appear one by one in backward, beside the activations still alive
            forward_backward = params + opt + t.activations_and_grads
            buffers = 0
        else:
            # DDP allocates its gradient buckets up front (with gradient_as_bucket_view they are the .grad
            # tensors); without bucket views the gradients and the buckets are separate copies
            buffers = 0 if job.gradient_as_bucket_view else grads
            forward_backward = params + grads + buffers + opt + t.activations
        if option.get("semi_sync") == "diloco":  # the parameters as of the last meeting, and the outer SGD's momentum
            outer = t.elements * 4 * (2 if job.outer_momentum else 1)
            opt += outer
            forward_backward += outer
        step = params + grads + buffers + opt + t.input_bytes + t.step_extra
        row = Row(option, params, grads, opt, t.activations, buffers, max(forward_backward, step))
        return with_worst_routing(estimator, option, row)

    def time_of(self, option, job, trace, units: int, hw):
        """The step of ``trace`` (the bare step in the option's dtypes) with this option's collectives."""
        return step_time(job, trace, self.collectives(option, job, trace, units), hw)

    def collectives(self, option, job, trace, units: int = 0) -> list[Collective]:
        """One all-reduce of the gradients per step (no_sync while accumulating), in 25 MiB buckets; over replica
        groups, within each group and then between the groups."""
        n = job.world_size
        if n == 1 or option.family == "single":
            return []
        grads = trace.grad_bytes
        copied = not job.gradient_as_bucket_view
        if job.replica_groups > 1:
            return _replica_group_collectives(option, job, grads, trace.elements)
        experts = option.get("experts")
        if experts:
            return expert_collectives(job, trace, experts, grads)
        return [Collective("all_reduce", grads, n, 1, buckets(grads, DDP_BUCKET_BYTES), job.num_nodes > 1, copied)]


def offered_expert_parallel(job) -> list[Option]:
    """A mixture of experts: DDP with each layer's experts over the most ranks that divide both the world and the
    experts (none when that is 1)."""
    experts = math.gcd(job.world_size, job.spec.experts) if job.spec.experts else 1
    return [Option("ddp", experts=experts)] if experts > 1 and job.replica_groups == 1 else []


def with_worst_routing(estimator, option, row: Row, kind: str | None = None, share: int = 1) -> Row:
    """``row`` with its peak under the worst routing, where its experts are split over ranks: the step traced again
    (as ``kind``'s, by default the option's) with one rank's experts taking every token copy they can
    (``model_stats.worst_routing``); the activations that adds, over ``share`` (a context-parallel rank holds
    1/``share`` of each sequence's tokens), add to the peak."""
    experts = option.get("experts")
    if not experts:
        return row
    even = estimator.trace(kind or option.family, option.checkpoint)
    worst = estimator.trace(kind or option.family, option.checkpoint, routed_over=experts)
    return replace(row, worst_routing_peak=row.peak + max(0, worst.activations - even.activations) // share)


def expert_collectives(job, trace, experts: int, grads: float) -> list[Collective]:
    """DDP with expert parallelism over ``experts`` ranks: the rest of the gradients all-reduced over every rank,
    each expert's over the ranks that hold it (one all-reduce per expert tensor), and each micro-batch's tokens to
    their experts and back by all-to-all, in forward and again in backward (each rank sends its share, keeps 1/N)."""
    n, inter = job.world_size, job.num_nodes > 1
    expert_grads = grads * trace.expert_bytes / trace.param_bytes
    shared = grads - expert_grads
    holders = n // experts
    return [
        Collective("all_reduce", shared, n, 1, buckets(shared, DDP_BUCKET_BYTES), inter, False),
        Collective("all_reduce", expert_grads / experts, holders, 1, max(1, trace.expert_tensors), inter, False),
        tokens_to_experts(job, trace, experts),
    ]


def tokens_to_experts(job, trace, experts: int) -> Collective:
    """Each micro-batch's tokens to their experts and back by all-to-all over ``experts`` ranks, in forward and
    again in backward, one per mixture-of-experts layer each way: ``top_k`` copies of each token's width, in the
    activations' dtype. N consecutive ranks: on one node where N fits in it (``expert_parallel.split_model``)."""
    moved = trace.dispatched * compute_dtype(job.precision).itemsize
    return Collective("all_to_all", moved, experts, 4 * job.accumulate, trace.moe_layers, experts > job.per_node)


def replicated(job) -> Option:
    """What a run that replicates everything is: DDP, or one process."""
    return Option("ddp") if job.world_size > 1 else Option("single")


def _replica_group_collectives(option, job, grads: float, elements: int) -> list[Collective]:
    """``ddp_torchft``: gradients averaged within each group every step, and between the groups over the link
    that joins them (the inter-node one: ``--inter-node-bandwidth``): every step, or, semi-synchronously, the
    fp32 parameters (local SGD) or pseudo-gradients (DiLoCo) once every ``sync_every`` steps."""
    per_group = job.world_size // job.replica_groups
    copied = not job.gradient_as_bucket_view
    chunks = buckets(grads, DDP_BUCKET_BYTES)
    within = [Collective("all_reduce", grads, per_group, 1, chunks, job.num_nodes > 1, copied)]
    if option.get("semi_sync") is None:
        return [*within, Collective("all_reduce", grads, job.replica_groups, 1, chunks, True, copied)]
    outer = elements * 4  # fp32, whatever the training precision: the outer step runs on fp32 copies
    meeting = Collective("all_reduce", outer, job.replica_groups, 1, buckets(outer, DDP_BUCKET_BYTES), True, False)
    return [*within, replace(meeting, every=option.get("sync_every", 1))]


MODELS = (Replicated(),)
