"""The cost model of ``model_parallel``: tensor parallel (each layer split over ``tensor`` ranks) and context
parallel (each sequence over ``context`` ranks), with FSDP over the ranks that remain; simulated on a fake process
group (``simulate.py``: distrain's ``ModelParallelStrategy`` itself). A ``model_parallel`` run with pipeline stages
is the pipeline model's."""

from __future__ import annotations

from dataclasses import replace

from distrain.planner.models import CostModel, data_parallel_kind
from distrain.planner.models.pipeline import pipeline_option
from distrain.planner.models.replicated import with_worst_routing
from distrain.planner.options import Option, Row
from distrain.planner.timing import Collective, Hardware, StepTime, collective_seconds, copy_seconds, work_seconds

#: sequences from this many tokens make ``auto`` and ``distrain plan`` look at context parallelism too (below, its
#: all-to-alls cost more than the activations it saves are worth)
LONG_SEQUENCE = 8192


class ModelParallel(CostModel):
    kinds = ("tp", "cp")
    overlaps_communication = False  # tensor_parallel_step_time adds every collective
    shares_samples = True

    def offered(self, job) -> list[Option]:
        tensor = tensor_parallel_option(job)
        return [*([tensor] if tensor else []), *context_parallel_options(job)]

    def option_for_run(self, strategy: str, job) -> Option | None:
        if job.pipeline_stages not in (None, "auto", 1):
            return pipeline_option(job, strict=True, strategy=strategy)
        if job.context_parallel > 1:
            return context_parallel_option(job, job.context_parallel, strict=True)
        return tensor_parallel_option(job, strict=True)

    def strategy(self, option) -> str:
        return "model_parallel"

    def level(self, option) -> int:
        return 5

    def label(self, option, accumulate=None) -> str:
        return "".join(long for long, _ in _name_parts(option))

    def short(self, option) -> str:
        return "".join(short for _, short in _name_parts(option))

    def prefetch(self, estimator, option) -> None:
        from distrain.planner.simulate import start_tensor_parallel_simulation

        begin = lambda: start_tensor_parallel_simulation(**_simulation(estimator, option))  # noqa: E731
        estimator.start(_key(estimator, option), begin)

    def estimate(self, estimator, option) -> Row:
        p = _simulated(estimator, option)
        sharded = p.params + p.grads + p.optimizer if option.get("sharding") else 0
        row = Row(option, p.params, p.grads, p.optimizer, p.activations, 0, p.peak, sharded=sharded)
        return with_worst_routing(estimator, option, row, data_parallel_kind(option), option.context)

    def activation_slope(self, estimator, option) -> float:
        """Each rank holds its part of every layer (of every sequence): the whole model's activations, split so."""
        whole = replace(option, family=data_parallel_kind(option), tensor=1, context=1)
        return estimator.activation_slope(whole) / (option.tensor * option.context)

    def step_time(self, estimator, option, hw) -> StepTime:
        trace = estimator.trace(data_parallel_kind(option), option.checkpoint)
        return tensor_parallel_step_time(option, estimator.job, trace, _simulated(estimator, option), hw)

    def seconds_at_least(self, estimator, planner, option, hw) -> float:
        """Without the optimizer step: a context-parallel rank computes 1/N of every operation's work; a
        tensor-parallel rank computes 1/T of every operation's FLOPs and bytes yet runs every operation, and waits
        for a collective in each block's forward and backward (Megatron's layout: two each)."""
        work = estimator.trace(data_parallel_kind(option), option.checkpoint).work.forward_backward
        micro_batches = planner.job.accumulate
        if option.family == "cp":
            return micro_batches * work_seconds(work.scaled(1 / (option.context * option.tensor)), hw)
        waits = 2 * estimator.job.spec.num_blocks * (hw.blocking_collective_seconds or hw.collective_seconds)
        return micro_batches * (work_seconds(work.scaled(1 / option.tensor), hw) + waits)


def _simulated(estimator, option):
    from distrain.planner.simulate import simulate_tensor_parallel

    return estimator.memo(_key(estimator, option), lambda: simulate_tensor_parallel(**_simulation(estimator, option)))


def _key(estimator, option) -> tuple:
    o = option
    return (
        "tp",
        o.tensor,
        o.context,
        o.get("sequence_parallel", False),
        o.checkpoint,
        estimator.job.micro_batch,
        o.get("experts"),
    )


def _simulation(estimator, option) -> dict:
    """The arguments of the option's simulation (``simulate.simulate_tensor_parallel``)."""
    job = estimator.job
    return dict(
        spec=job.spec,
        micro_batch=job.micro_batch,
        world_size=job.world_size,
        tensor=option.tensor,
        context=option.context,
        sequence_parallel=option.get("sequence_parallel", False),
        precision=job.precision,
        checkpoint=option.checkpoint,
        accumulate=job.accumulate,
        foreach=job.gpu,
        experts=option.get("experts") or 1,
    )


def tensor_parallel_step_time(option, job, trace, simulated, hw: Hardware) -> StepTime:
    """One optimizer step under tensor parallelism (``simulated``: ``simulate.TensorParallelStep``).
    Each rank computes 1/T of every layer's FLOPs and bytes, yet runs every operation; the
    collectives are the ones the simulated step issued (each layer's, per micro-batch; FSDP's over
    the data-parallel ranks in 2-D). A layer's collective sits between two computations that need
    it, so none is counted as hidden behind compute, on a GPU either."""
    t = option.tensor * option.context  # context parallel: each rank 1/N of the tokens (attention: of the heads)
    compute = job.accumulate * work_seconds(trace.work.forward_backward.scaled(1 / t), hw)
    optimizer = work_seconds(trace.work.step, hw, 1 / job.world_size)  # the state is split over every rank
    grouped: dict[tuple[str, int, bool], list[float]] = {}
    for kind, size, ranks, fsdp in simulated.collectives:
        grouped.setdefault((kind, ranks, fsdp), []).append(size)
    # tensor-parallel groups stay within a node; FSDP's data-parallel ones cross nodes, through flat buffers
    sent = [
        Collective(kind, sum(sizes), ranks, job.accumulate, len(sizes), fsdp and job.num_nodes > 1, fsdp)
        for (kind, ranks, fsdp), sizes in grouped.items()
    ]
    sent += [
        Collective(kind, size, ranks, 1, 1, fsdp and job.num_nodes > 1, fsdp)
        for kind, size, ranks, fsdp in simulated.step_collectives
    ]
    compute += sum(copy_seconds(c, hw) for c in sent)
    comm = sum(collective_seconds(c, hw, blocking=not c.copied) for c in sent)  # FSDP's (copied) are prefetched
    return StepTime(compute, optimizer, comm, compute + optimizer + comm)


def context_parallel_option(job, context: int, strict: bool = False, heads: list[int] | None = None) -> Option | None:
    """The layout ``strategy: model_parallel`` with ``context_parallel_size=context`` runs (tensor parallel over what
    it leaves of a node unless set, when ``strict``; FSDP over data × context). None when the model cannot split its
    sequences or tensor parallelism its heads; that raises the run's own error when ``strict``. ``heads``: the
    model's, when known. Heads that the size does not divide take the ring (``engine_for``), named in the option;
    Ulysses, the engine otherwise, is not."""
    from distrain.parallel.context_parallel import engine_for
    from distrain.parallel.layout import layout_for

    if job.world_size < 2 or job.pipeline_stages not in (None, "auto", 1):
        return None
    try:
        tensor = job.tensor_parallel if strict else 1
        layout = layout_for(job.world_size, job.per_node, False, tensor, "auto", None, 1, context)
        heads = _attention_heads(job) if heads is None else heads
        engine = engine_for(heads, layout.context, layout.tensor, job.spec.name)
    except ValueError:
        if strict:
            raise
        return None
    ring = "ring" if engine == "ring" else None
    experts = job.expert_parallel if strict and job.expert_parallel > 1 else None  # the run's: split as it asks
    return Option(
        "cp", sharding="FULL_SHARD", tensor=layout.tensor, context=layout.context, engine=ring, experts=experts
    )


def _attention_heads(job) -> list[int]:
    """The heads of each attention layer of the job's model (built on the meta device); the run's own error when it
    cannot split its sequences."""
    from distrain.parallel.context_parallel import attention_heads, no_support_message

    module = job.spec.build()
    heads = attention_heads(module)
    if heads is None:
        raise ValueError(no_support_message(module))
    return heads


def context_parallel_options(job) -> list[Option]:
    """What ``auto`` and ``all`` look at for a long sequence (``LONG_SEQUENCE``): each size that divides one node's
    devices (and the world), from 2 to the whole node, FSDP over the ranks that remain; Ulysses where it divides the
    model's heads, else the ring. A larger size holds less of each sequence and sends more: which one is fastest is
    the planner's to say. The model is built once for every size."""
    if job.world_size < 2 or job.pipeline_stages not in (None, "auto", 1) or job.spec.seq_len < LONG_SEQUENCE:
        return []
    try:
        heads = _attention_heads(job)
    except ValueError:
        return []
    sizes = [c for c in range(2, job.per_node + 1) if job.per_node % c == 0 and job.world_size % c == 0]
    return [option for c in sizes if (option := context_parallel_option(job, c, heads=heads)) is not None]


def tensor_parallel_option(job, strict: bool = False) -> Option | None:
    """The layout ``strategy: model_parallel`` runs with the job's sizes (tensor parallel over one node's
    devices unless set; FSDP over the ranks that remain), or None when there is nothing to split, the
    model has no built-in plan, or a pipeline is asked for (``pipeline_option``'s). A size the run would refuse
    (one that does not divide the heads) raises when ``strict`` (the strategy was named), else is left out."""
    from distrain.parallel.layout import layout_for
    from distrain.parallel.tensor_parallel import check_plan

    if job.world_size < 2 or job.pipeline_stages not in (None, "auto", 1):
        return None
    try:
        layout = layout_for(job.world_size, job.per_node, False, job.tensor_parallel, "auto", None)
        if layout.tensor < 2:  # nothing split: FSDP alone, which any model runs
            return None
        check_plan(job.spec.build(), layout.tensor, job.sequence_parallel)  # what the run would say
        if not strict and job.sequence_parallel and job.spec.seq_len % layout.tensor:
            return None  # sequences split over the ranks: auto takes no layout a batch of this length cannot run
    except ValueError:
        if strict:
            raise
        return None
    sharding = "FULL_SHARD" if layout.data > 1 else None
    return Option("tp", sharding=sharding, tensor=layout.tensor, sequence_parallel=job.sequence_parallel)


MODELS = (ModelParallel(),)


def _name_parts(option) -> list[tuple[str, str]]:
    """The parts of the option's name that hold (its label's, its short name's), in order."""
    engine, experts = option.get("engine"), option.get("experts")
    if option.family == "cp":
        parts = [
            (f"context parallel {option.context}", f"CP{option.context}"),
            (f" ({engine})", f"({engine})") if engine else None,
            (f" × tensor {option.tensor}", f"×TP{option.tensor}") if option.tensor > 1 else None,
            (" × fsdp", "×FSDP") if option.get("sharding") else None,
            (f" + experts over {experts}", f"+EP{experts}") if experts else None,
        ]
    else:
        parts = [
            (f"tensor parallel {option.tensor}", f"TP{option.tensor}"),
            (" + SP", "+SP") if option.get("sequence_parallel", False) else None,
            (" × fsdp", "×FSDP") if option.get("sharding") else None,
        ]
    return [part for part in parts if part is not None]
