"""The cost model of pipeline layouts (``strategy: pipeline``, and ``model_parallel`` with ``pipeline_stages``): each
rank's memory and the step's time, from a
trace of each stage alone and the schedule's arithmetic.

A fake process group cannot run ``torch.distributed.pipelining`` (stages exchange shape metadata as
objects before the first step), so the planner does not run the pipeline. It traces each stage the way a
rank runs it: the model's own ``PipelineSplit`` cut by the run's own ``split_blocks``, each stage's
``StageModule`` (the user's layers) through one micro-batch's forward and backward under fake tensors,
the last stage with the user's ``training_step``. The schedule then says how many micro-batches a rank
holds at once and how long stages wait:

- **memory of a rank**: the parameters, gradients and optimizer state of the layers it keeps (tied
  copies included), and the activations of the micro-batches in flight with the buffers they were received
  in (distrain's stages hold a receive buffer only while its micro-batch is in flight), walked through the
  rank's forwards and backwards in the
  order torch's schedule runs them: GPipe runs every forward first (all A); 1F1B warms up with
  min(A, P − s) forwards on stage s; Interleaved1F1B with torch's own warm-up count of chunks.
- **time**: the first micro-batch crosses every stage forward and back, the other A − 1 follow at the
  pace of the slowest stage (the bubble: (P − 1) stage-times, or (P − 1)/V with V chunks per rank);
  each stage-time includes its point-to-point sends and receives. Then the optimizer step of the
  slowest rank, the all-reduce of gradients of parameters two stages share, and FSDP's collectives
  when stages are replicated over data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from distrain.module import loss_of, run_step
from distrain.planner import fake
from distrain.planner.model_stats import (
    ModelSpec,
    Phases,
    set_up_module,
    to_empty_keeping_ties,
)
from distrain.planner.models import CostModel, data_parallel_kind
from distrain.planner.options import Option, Row
from distrain.planner.timing import Collective, StepTime, collective_seconds, work_seconds
from distrain.planner.work import PhaseWork, WorkCounter


@dataclass(frozen=True)
class StageTrace:
    """One stage through one micro-batch (forward and backward), and what it holds."""

    index: int
    param_bytes: int
    param_elements: int
    """Trainable elements of the layers this stage holds (a tied parameter counted by each holder)."""
    tensors: int
    """Trainable parameter tensors it holds (the optimizer's per-tensor operations)."""
    saved: int
    """Activation bytes alive at the end of its forward: what a micro-batch in flight keeps until its backward."""
    peak: int
    """The most activation bytes alive during one micro-batch's forward and backward (``cached`` included)."""
    cached: int
    """Bytes that stay once for every micro-batch of a step: autocast's low-precision copies of the weights."""
    received: int
    """Bytes of the activation this stage receives (0 on the first)."""
    blocks: int
    largest_unit: int
    """Bytes of its largest block's parameters (what FSDP gathers at once over data-parallel ranks)."""
    work: PhaseWork
    """Forward and backward of one micro-batch."""


@dataclass(frozen=True)
class PipelineTrace:
    stages: list[StageTrace]
    ties: list[tuple[int, int]]
    """Parameters held by several stages: (bytes, how many stages hold it)."""


def trace_pipeline(
    spec: ModelSpec,
    micro_batch: int,
    num_stages: int,
    *,
    param_dtype: torch.dtype = torch.float32,
    autocast: torch.dtype | None = None,
    checkpoint: int | None = 0,
    split_points=None,
    gpu: bool = False,
    compiled: bool = False,
    float8: bool = False,
    tensor: int = 1,
    sequence_parallel: bool = True,
    share: Callable[[int], float] | None = None,
) -> PipelineTrace:
    """Each of ``num_stages`` stages through one micro-batch, in order (a stage's input is what the one before
    sent). Stages with the same blocks count and position (neither first nor last) are traced once: their
    layers are the same. ``tensor`` > 1: each stage as one of its ``tensor`` ranks holds and computes it
    (``split_over_tensor``), keeping ``share(blocks)`` of the activations of a stage of that many blocks (None:
    ``activation_share``, the same for any stage)."""
    from distrain.parallel.layout import ParallelLayout
    from distrain.parallel.pipeline_split import split_for
    from distrain.parallel.pipeline_stages import PipelineBuild
    from distrain.parallel.tensor_parallel import split_parameters

    module, _ = set_up_module(spec, param_dtype, checkpoint, float8=float8)
    with (
        fake.fake_tensor_mode(allow_non_fake_inputs=True) as mode,
        fake.transformers_as_in_eager(),
        fake.norms_as_on_cuda(gpu),  # a GPU's run: its norms keep what CUDA's kernels keep
    ):
        to_empty_keeping_ties(module)
        split_ids = split_parameters(module, tensor, sequence_parallel) if tensor > 1 else set()
        if tensor > 1 and share is None:
            share = lambda blocks: activation_share(tensor, sequence_parallel)  # noqa: E731
        split = split_for(module)
        build = PipelineBuild.create(module, split, ParallelLayout(pipeline=num_stages), 0, split_points)
        batch = tree_map_only(torch.Tensor, mode.from_tensor, spec.make_batch(micro_batch))
        build.local = list(range(num_stages))
        stage_modules = build.stage_modules(None)
        stages: list[StageTrace] = []
        cache: dict[tuple, StageTrace] = {}
        received = None
        for s, stage in enumerate(stage_modules):
            middle = 0 < s < num_stages - 1
            key = ("middle", len(build.ranges[s])) if middle else None
            if key in cache:
                stages.append(replace(cache[key], index=s))
                continue  # its output is the same shape as its input: the next stage receives the same
            trace, received_next = _trace_stage(module, split, stage, s, batch, received, autocast, compiled)
            if tensor > 1:
                kept = share(len(build.ranges[s]))
                trace = split_over_tensor(trace, stage, split_ids, tensor, sequence_parallel, kept, checkpoint is None)
            if key is not None:
                cache[key] = trace
            stages.append(trace)
            received = received_next
        ties = []
        params = dict(module.named_parameters())
        for name, holders in build.ties:
            p = params[name]
            ties.append((p.numel() * p.element_size() // (tensor if id(p) in split_ids else 1), len(holders)))
    return PipelineTrace(stages, ties)


def _trace_stage(module, split, stage, index: int, batch, received, autocast, compiled: bool = False):
    """Forward and backward of one micro-batch through ``stage``; returns its trace and what it sends on."""
    held = {id(p): p for p in stage.parameters() if p.requires_grad}
    held_params = list(held.values())
    inputs = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    args = () if received is None else tuple(t.detach().requires_grad_(True) for t in received)
    phases, counter = Phases(), WorkCounter()
    tracker = fake.timeline_memory_tracker(phases.sample)
    tracker.track_external(module, *inputs, *args)
    with tracker, counter:
        # the schedule runs inside one autocast region: its cache of low-precision weight copies, made in the
        # first forward, stays for every micro-batch; what a micro-batch keeps is the rest
        with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
            out = stage.run(batch, *args)
            if stage.is_last:
                out = _loss(module, split, out, batch)
            saved = phases.timeline[-1][0] if phases.timeline else 0
            phases.phase = counter.phase = "backward"
            if stage.is_last:
                out.backward()
                sent = None
            else:  # its output, and with a split's auxiliary loss the sum so far
                out = out if isinstance(out, tuple) else (out,)
                sent = tuple(t.detach() for t in out)
                torch.autograd.backward(out, [torch.zeros_like(t) for t in out])
            del out
            for t in args:  # the gradient sent back to the stage before: gone once sent
                t.grad = None
            torch.zeros(())  # one more operation: the tracker's sample of what remains (the autocast cache)
            cached = phases.timeline[-1][0]
    for p in held_params:
        p.grad = None
    trace = StageTrace(
        index=index,
        param_bytes=sum(p.numel() * p.element_size() for p in held_params),
        param_elements=sum(p.numel() for p in held_params),
        tensors=len(held_params),
        saved=max(0, saved - cached),
        peak=phases.act,
        cached=cached,
        received=0 if received is None else sum(t.numel() * t.element_size() for t in received),
        blocks=len(stage.blocks),
        largest_unit=max((sum(p.numel() * p.element_size() for p in b.parameters()) for b in stage.blocks), default=0),
        # a GPU's compiled stage: its memory-bound operations fused
        work=counter.work.forward_backward.compiled() if compiled else counter.work.forward_backward,
    )
    return trace, sent


def activation_share(tensor: int, sequence_parallel: bool) -> float:
    """The share of a Megatron block's activations one of ``tensor`` tensor-parallel ranks keeps, where the model
    cannot be simulated at another depth (``simulated_activation_share`` is what torch's layers keep). With sequence
    parallelism every activation is split (by heads, hidden units or sequence). Without it, the residual stream and
    what the norms keep stay whole on every rank: Korthikanti et al. 2022 (https://arxiv.org/abs/2205.05198),
    §4.2.2, equation 2: of a layer's 34 sbh bytes, 10 whole and 24 split (the attention scores' term left out:
    flash attention keeps none)."""
    return 1 / tensor if sequence_parallel else (10 + 24 / tensor) / 34


def split_over_tensor(
    trace: StageTrace,
    stage,
    split_ids: set[int],
    tensor: int,
    sequence_parallel: bool,
    share: float,
    checkpointed: bool = False,
):
    """A stage traced whole, as one of its ``tensor`` tensor-parallel ranks holds and computes it: the parameters
    the built-in plan splits (``split_ids``) 1/``tensor`` each, the rest whole; ``share`` of the activations, except
    what a ``checkpointed`` stage keeps between its forward and backward (its blocks' inputs: the residual stream,
    split only along the sequence); what it receives 1/``tensor`` when the residual stream is split along the
    sequence (else whole); 1/``tensor`` of every operation's FLOPs and bytes, each operation still run (as
    ``ModelParallel`` prices a tensor-parallel rank)."""
    held = {id(p): p for p in stage.parameters() if p.requires_grad}
    nbytes = lambda p: p.numel() * p.element_size()  # noqa: E731
    kept = sum(nbytes(p) / (tensor if i in split_ids else 1) for i, p in held.items()) / max(1, trace.param_bytes)
    residual = 1 / tensor if sequence_parallel else 1.0
    return replace(
        trace,
        param_bytes=int(trace.param_bytes * kept),
        param_elements=int(trace.param_elements * kept),
        saved=int(trace.saved * (residual if checkpointed else share)),
        peak=int((trace.peak - trace.cached) * share + trace.cached * kept),
        cached=int(trace.cached * kept),  # autocast's copies of the weights: as the weights split
        received=trace.received // tensor if sequence_parallel else trace.received,
        largest_unit=int(trace.largest_unit * kept),
        work=trace.work.scaled(1 / tensor),
    )


def _loss(module, split, head_output, batch) -> torch.Tensor:
    """The user's ``training_step`` on the last stage, its model call answered by the head's output (as
    ``PipelineRunner`` does)."""
    split.model.forward = lambda *args, **kwargs: split.answer_call(head_output, *args, **kwargs)
    try:
        return loss_of(run_step(module, "training_step", batch, 0))
    finally:
        del split.model.forward


# ---- the schedule's arithmetic ------------------------------------------------------------------------------------
def rank_order(schedule: str, rank: int, pipeline: int, stages_per_rank: int, micro_batches: int) -> list:
    """(forward?, stage) of each forward and backward a pipeline rank runs in one step, in order:
    torch's schedules (``Schedule1F1B``, ``ScheduleGPipe``, ``ScheduleInterleaved1F1B``'s ``_get_1f1b_rank_ops``),
    and ``PipelineRunner``'s fall-back to GPipe when 1F1B has fewer micro-batches than stages."""
    a, p, v = micro_batches, pipeline, stages_per_rank
    if v == 1:
        warmup = a if schedule == "GPipe" or a < p else min(a, p - rank)
        return [(True, rank)] * warmup + [(False, rank), (True, rank)] * (a - warmup) + [(False, rank)] * warmup
    per_round = a // max(1, a // p)
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), a * v)

    def forward_stage(op: int) -> int:
        return (op // per_round) % v * p + rank

    def backward_stage(op: int) -> int:
        return (v - 1 - ((op - warmup) // per_round) % v) * p + rank

    order = [(True, forward_stage(op)) for op in range(warmup)]
    for op in range(warmup, a * v):
        order += [(True, forward_stage(op)), (False, backward_stage(op))]
    return order + [(False, backward_stage(op)) for op in range(a * v, a * v + warmup)]


def activations_in_flight(
    order: list[tuple[bool, int]], stages: list[StageTrace], sent_gradients: dict | None = None
) -> tuple[int, int]:
    """(the most activation bytes alive before any gradient exists, the most after): a forward keeps its
    stage's saved activations, and the buffer it received them in, until that micro-batch's backward, which peaks
    at the stage's own peak beside the buffer of the gradient it receives (distrain's stages hold a receive buffer only
    while its micro-batch is in flight: ``pipeline_memory.InFlightStage``). The gradient a backward sends to the stage
    before goes at once where ``sent_gradients`` is None (1F1B waits for each send); else it stays until the compute
    ``sent_gradients`` lets it go at (``sent_gradient_releases``), or to the step's end. The autocast cache of each of
    the rank's stages stays from its first forward on. The first backward of a step runs before gradients exist (the
    Trainer sets them to None after each step)."""
    held, before, after, grads = 0, 0, 0, False
    cached: dict[int, int] = {}
    for forward, s, chunk in numbered(order):
        if sent_gradients:
            held -= sum(
                stages[sent].received for sent, _ in sent_gradients.get(("F" if forward else "B", s, chunk), ())
            )
        kept = stages[s].saved + stages[s].received
        if forward:
            held += kept
            cached[s] = stages[s].cached
            at = held + sum(cached.values())
        else:
            gradient = stages[s + 1].received if s + 1 < len(stages) else 0
            at = held - stages[s].saved + gradient + stages[s].peak + sum(cached.values()) - stages[s].cached
            held -= kept - (stages[s].received if sent_gradients is not None else 0)
        before, after = (before, max(after, at)) if grads else (max(before, at), after)
        grads = grads or not forward
    return before, after


def numbered(order: list[tuple[bool, int]]) -> list[tuple[bool, int, int]]:
    """(forward?, stage, micro-batch) of each compute in ``order``: each stage runs its micro-batches in order,
    forward and backward."""
    seen: dict[tuple[bool, int], int] = {}
    out = []
    for forward, stage in order:
        seen[(forward, stage)] = seen.get((forward, stage), -1) + 1
        out.append((forward, stage, seen[(forward, stage)]))
    return out


@functools.cache
def sent_gradient_releases(schedule: str, rank: int, pipeline: int, stages_per_rank: int, micro_batches: int):
    """When the gradients a pipeline rank sends back go (``activations_in_flight``'s ``sent_gradients``): None, at
    once (1F1B waits for each send before the next); {} at the step's end (torch's GPipe, also 1F1B's fall-back with
    fewer micro-batches than stages, keeps each send's work, and through it the tensor sent, to the step's end, and
    nothing comes back to prove one received); under the looped schedules, at the compute of this rank that first
    knows its receiver consumed it, as distrain's stages let them go (``pipeline_memory.release_sent_gradients``, on the
    order torch lowers from these computes)."""
    if stages_per_rank == 1:
        return {} if schedule == "GPipe" or micro_batches < pipeline else None
    return _looped_releases(schedule, pipeline, stages_per_rank, micro_batches)[rank]


@functools.cache
def _looped_releases(schedule: str, pipeline: int, stages_per_rank: int, micro_batches: int):
    from distrain.parallel import pipeline_memory

    orders = {r: numbered(rank_order(schedule, r, pipeline, stages_per_rank, micro_batches)) for r in range(pipeline)}
    return pipeline_memory.sent_gradient_releases(orders, pipeline)


def rank_stages(rank: int, pipeline: int, stages_per_rank: int) -> list[int]:
    """The stages a pipeline rank runs (torch's loop-style placement, as ``PipelineBuild``)."""
    return [s for s in range(pipeline * stages_per_rank) if s % pipeline == rank]


# ---- a plan's row and time -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankLoad:
    """What one pipeline rank holds and does."""

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    step_extra: int
    tensors: int
    share: float
    """Its trainable elements over those of the traced whole-model step (the optimizer's state and work scale
    with it; above 1 when that step was traced at a shallower depth)."""

    activations_with_grads: int
    """The most activation bytes alive at a backward that runs once gradients exist (the first backward of a
    step runs before: gradients are set to None after each optimizer step)."""

    grads_in_backward: int
    """Gradient bytes alive while a backward runs: under FSDP, the unsharded ones only (the reduce-scatter and the
    sharded gradients come once the step's last backward is done)."""

    @property
    def peak(self) -> int:
        states = self.params + self.optimizer + self.buffers
        backward = max(self.activations, self.grads_in_backward + self.activations_with_grads)
        return states + max(backward, self.grads + self.step_extra)


def rank_loads(option, job, trace: PipelineTrace, full) -> list[RankLoad]:
    """Each pipeline rank's bytes (``full``: a traced whole-model step, for the optimizer's and gradients'
    bytes per element)."""
    p, v, a = option.pipeline, option.get("stages_per_rank", 1), job.accumulate
    data = max(1, job.world_size // (p * option.tensor))
    stages = trace.stages
    loads = []
    for r in range(p):
        mine = [stages[s] for s in rank_stages(r, p, v)]
        share = sum(s.param_elements for s in mine) / max(1, sum(map(sum, full.groups)))
        schedule = option.get("schedule")
        activations, with_grads = activations_in_flight(
            rank_order(schedule, r, p, v, a), stages, sent_gradient_releases(schedule, r, p, v, a)
        )
        buffers = 0  # the receive buffers are the micro-batches' in flight: with their activations
        params = sum(s.param_bytes for s in mine)
        grads, optimizer = int(full.grad_bytes * share), int(full.optimizer_bytes * share)
        in_backward = grads
        if data > 1:
            # torch's pipeline stages keep an FSDP module's parameters and gradients unsharded through a step's
            # micro-batches (no resharding after backward, gradient sync at the last one): beside the sharded
            # state, the unsharded parameters and gradients, the reduce-scatter's copy of those gradients, and
            # two blocks gathered at once in forward
            params += params // data
            grads = 2 * grads + grads // data  # in_backward: the unsharded ones
            optimizer //= data
            buffers += 2 * max(s.largest_unit for s in mine)
        extra, tensors = int(full.step_extra * share), sum(s.tensors for s in mine)
        loads.append(
            RankLoad(r, params, grads, optimizer, activations, buffers, extra, tensors, share, with_grads, in_backward)
        )
    return loads


def pipeline_row(option, loads: list[RankLoad]):
    """The plan's row: the pipeline rank with the highest peak (the others hold less)."""
    worst = max(loads, key=lambda load: load.peak)
    others = ", ".join(f"{load.peak / 2**20:.0f}" for load in loads)
    return Row(
        option,
        worst.params,
        worst.grads,
        worst.optimizer,
        worst.activations,
        worst.buffers,
        worst.peak,
        note=f"the fullest pipeline rank: {worst.rank} (MiB per rank: {others})",
    )


def pipeline_step_time(option, job, trace: PipelineTrace, full, hw, tensor_collectives=None):
    """Seconds of one optimizer step through the pipeline (see the module's docstring). ``tensor_collectives``:
    under tensor parallelism, (a block's, the model's ends') collectives in one micro-batch's forward and backward
    (``tensor_parallel_collectives``), each between two computations that need it: on a stage's path."""
    p, v, a = option.pipeline, option.get("stages_per_rank", 1), job.accumulate
    data = max(1, job.world_size // (p * option.tensor))
    stages = trace.stages

    def transfer(nbytes: int) -> float:  # one point-to-point send, forward or backward: the sender and receiver wait
        return nbytes / hw.intra_bandwidth + hw.collective_seconds if nbytes else 0.0

    def tensor_parallel(stage: StageTrace) -> float:  # the ends (embeddings, head and loss) counted on the last
        if tensor_collectives is None:
            return 0.0
        per_block, ends = tensor_collectives
        counts = {c: n * stage.blocks for c, n in per_block.items()}
        for c, n in ends.items() if stage.index == len(stages) - 1 else ():
            counts[c] = counts.get(c, 0) + n
        return sum(n * collective_seconds(Collective(*c, 1, 1), hw, blocking=True) for c, n in counts.items())

    compute, with_links = [], []
    for s in stages:
        sent = stages[s.index + 1].received if s.index + 1 < len(stages) else 0
        links = 2 * transfer(s.received) + 2 * transfer(sent)
        compute.append(work_seconds(s.work, hw))
        with_links.append(compute[-1] + links + tensor_parallel(s))

    def through_pipeline(times: list[float]) -> float:
        if v == 1:  # the first micro-batch crosses every stage; the rest follow at the slowest stage's pace
            return sum(times) + (a - 1) * max(times)
        per_rank = [sum(times[s] for s in rank_stages(r, p, v)) for r in range(p)]
        return (a + (p - 1) / v) * max(per_rank)

    loads = rank_loads(option, job, trace, full)
    step = full.work.step
    optimizer = max(
        step.flops * load.share / data / hw.matmul_flops
        + step.bytes * load.share / data / hw.memory_bandwidth
        + step.ops * load.tensors / max(1, sum(map(len, full.groups))) * hw.op_seconds
        for load in loads
    )
    after = [Collective("all_reduce", size, holders, 1, 1, inter_node=False) for size, holders in trace.ties]
    gathered = 0.0
    if data > 1:  # each rank's gradients reduce-scattered over its replicas once per step (fp32)
        grads = max(load.share for load in loads) * full.grad_bytes
        after.append(Collective("reduce_scatter", grads, data, 1, 1, inter_node=job.num_nodes > 1))
        # FSDP gathers a rank's stages once per step, block by block, at their first micro-batch, and they stay
        # gathered through the rest (``ModelParallelStrategy`` does not reshard them after forward under a
        # pipeline): the slowest rank's gathers
        gathered = max(collective_seconds(_gathers(stages, rank_stages(r, p, v), data, job), hw) for r in range(p))
    tail = sum(collective_seconds(c, hw) for c in after) + gathered + hw.collective_seconds  # + the loss's broadcast
    busy = through_pipeline(compute)
    seconds = through_pipeline(with_links) + optimizer + tail
    return StepTime(busy, optimizer, seconds - busy - optimizer, seconds)


def _simulated(estimator, tensor: int, sequence_parallel: bool, checkpoint: int | None) -> list:
    """distrain's ``ModelParallelStrategy`` simulated on a fake group of ``tensor`` ranks
    (``simulate_tensor_parallel``, one micro-batch), on the model at one block and at two; a model that cannot
    change its depth, whole."""
    from distrain.planner.simulate import start_tensor_parallel_simulation

    job = estimator.job
    specs = [job.spec] if job.spec.with_depth is None else [job.spec.with_depth(d) for d in (1, 2)]

    def simulate() -> list:
        started = [
            start_tensor_parallel_simulation(
                spec=spec,
                micro_batch=job.micro_batch,
                world_size=tensor,
                tensor=tensor,
                sequence_parallel=sequence_parallel,
                precision=job.precision,
                checkpoint=checkpoint,
                foreach=job.gpu,
            )
            for spec in specs
        ]
        return [s.result() for s in started]

    return estimator.memo(("pp-tp", tensor, sequence_parallel, checkpoint, job.micro_batch), simulate)


def tensor_parallel_collectives(estimator, option) -> tuple[dict, dict]:
    """(a block's, the model's ends') collectives in one micro-batch's forward and backward under the option's
    tensor parallelism, as ``{(kind, bytes of the whole tensor, ranks): count}``: what the simulated model's second
    block adds is a block's (``_simulated``). A model simulated whole has its collectives spread over its blocks."""
    from collections import Counter

    sp = option.get("sequence_parallel", False)
    steps = _simulated(estimator, option.tensor, sp, option.checkpoint)
    counts = [Counter(c[:3] for c in step.collectives) for step in steps]
    if len(counts) == 1:
        return {c: n / estimator.job.spec.num_blocks for c, n in counts[0].items()}, {}
    block = counts[1] - counts[0]
    return dict(block), dict(counts[0] - block)


def simulated_activation_share(estimator, option) -> Callable[[int], float]:
    """The share of a stage's activations one tensor-parallel rank keeps, by the stage's blocks, as torch's
    tensor-parallel layers keep them: what the simulated model at that depth keeps on ``option.tensor`` ranks over
    what it keeps on one (each depth's activations found from the model at one block and at two). A block keeps
    more than 1/T (with sequence parallelism the all-gathered inputs of the column-parallel layers stay whole for
    their backward), and the model's ends keep more than a block (the vocabulary-parallel logits are gathered whole
    for the loss): tiny-llama over 2 ranks, 0.555 of a block, 0.72 of the ends. A stage is priced as if it held
    both ends, in the proportion the whole model at its depth does: a middle stage's share comes out a little
    high. ``activation_share`` where the model cannot change its depth."""
    sp = option.get("sequence_parallel", False)
    split, whole = _simulated(estimator, option.tensor, sp, 0), _simulated(estimator, 1, False, 0)
    if len(split) == 1:
        return lambda blocks: activation_share(option.tensor, sp)

    def at_depth(steps, blocks: int) -> float:
        one, two = steps[0].activations, steps[1].activations
        return one + (blocks - 1) * (two - one)

    return lambda blocks: at_depth(split, blocks) / max(1.0, at_depth(whole, blocks))


def _gathers(stages: list, mine: list[int], data: int, job) -> Collective:
    """FSDP's gathers of one rank's stages (``mine``) over its ``data`` replicas, a block at a time."""
    units = sum(stages[s].blocks + 1 for s in mine)
    return Collective("all_gather", sum(stages[s].param_bytes for s in mine), data, 1, units, job.num_nodes > 1)


class Pipeline(CostModel):
    kinds = ("pp",)
    shares_samples = True
    extrapolates_depth = False  # traced stage by stage at full depth (a stage per block, at most)

    def offered(self, job) -> list[Option]:
        option = pipeline_option(job)
        return [option] if option is not None else []

    def option_for_run(self, strategy: str, job) -> Option | None:
        return pipeline_option(job, strict=True, strategy=strategy)

    def strategy(self, option) -> str:
        return "pipeline"

    def level(self, option) -> int:
        return 5

    def label(self, option, accumulate=None) -> str:
        schedule = option.get("schedule")
        if schedule == "1F1B" and accumulate is not None and accumulate < option.pipeline:
            schedule = "GPipe"  # fewer micro-batches than stages: PipelineRunner runs GPipe, and it is planned so
        return (
            f"pipeline {option.pipeline} {schedule}"
            + (f" ({option.get('stages_per_rank', 1)} stages/rank)" if option.get("stages_per_rank", 1) > 1 else "")
            + (f" × tensor {option.tensor}" if option.tensor > 1 else "")
            + (" + SP" if option.get("sequence_parallel") else "")
            + (" × fsdp" if option.get("sharding") else "")
        )

    def short(self, option) -> str:
        return (
            f"PP{option.pipeline}"
            + (f"×TP{option.tensor}" if option.tensor > 1 else "")
            + ("+SP" if option.get("sequence_parallel") else "")
            + ("×FSDP" if option.get("sharding") else "")
        )

    def estimate(self, estimator, option, micro_batch: int | None = None) -> Row:
        return pipeline_row(option, pipeline_ranks(estimator, option, micro_batch))

    def activation_slope(self, estimator, option) -> float:
        b = estimator.job.micro_batch
        return max(0.0, (self.estimate(estimator, option, 2 * b).peak - self.estimate(estimator, option).peak) / b)

    def step_time(self, estimator, option, hw) -> StepTime:
        full = _whole_step(estimator, option)
        trace = _pipeline_trace(estimator, option)
        collectives = tensor_parallel_collectives(estimator, option) if option.tensor > 1 else None
        return pipeline_step_time(option, estimator.job, trace, full, hw, collectives)

    def seconds_at_least(self, estimator, planner, option, hw) -> float:
        """With no communication, a pipeline runs its micro-batches at its slowest rank's pace, at least 1/P of the
        whole (of 1/T of each operation's FLOPs and bytes, under tensor parallelism), plus the fill (less a tenth:
        its stages are traced one by one)."""
        work = estimator.trace(data_parallel_kind(option), option.checkpoint).work.forward_backward
        p, v = option.pipeline, option.get("stages_per_rank", 1)
        return 0.9 * (planner.job.accumulate + (p - 1) / v) * work_seconds(work.scaled(1 / option.tensor), hw) / p


def _pipeline_trace(estimator, option, micro_batch: int | None = None) -> PipelineTrace:
    b = micro_batch or estimator.job.micro_batch
    stages = option.pipeline * option.get("stages_per_rank", 1)
    kind = data_parallel_kind(option)

    def trace() -> PipelineTrace:
        param_dtype, autocast = estimator.dtypes(kind)
        return trace_pipeline(
            estimator.job.spec,
            b,
            stages,
            param_dtype=param_dtype,
            autocast=autocast,
            checkpoint=option.checkpoint,
            split_points=estimator.job.split_points,
            gpu=estimator.job.gpu,
            compiled=estimator.job.fuses,
            float8=estimator.job.float8,
            tensor=option.tensor,
            sequence_parallel=option.get("sequence_parallel", False),
            share=simulated_activation_share(estimator, option) if option.tensor > 1 else None,
        )

    key = ("pp", stages, option.checkpoint, b, kind, option.tensor, option.get("sequence_parallel", False))
    return estimator.memo(key, trace)


def pipeline_ranks(estimator, option, micro_batch: int | None = None) -> list[RankLoad]:
    """What each pipeline rank holds: each stage traced alone, the schedule's micro-batches in flight counted, FSDP
    over the data-parallel replicas when there are any."""
    full = _whole_step(estimator, option, micro_batch)
    return rank_loads(option, estimator.job, _pipeline_trace(estimator, option, micro_batch), full)


def _whole_step(estimator, option, micro_batch: int | None = None):
    """A traced whole-model step in the option's dtypes, for bytes and work per parameter element: a deep model's
    at its deeper shallow depth."""
    return estimator.deepest.trace(data_parallel_kind(option), option.checkpoint, micro_batch)


def pipeline_option(job, strict: bool = False, strategy: str = "pipeline") -> Option | None:
    """The layout ``strategy`` runs with the job's sizes (a stage per rank unless set; tensor parallel within each
    stage when asked; FSDP over the ranks that remain), or None when the model cannot be split into that many stages
    or over that many tensor-parallel ranks: that raises the run's own error when ``strict``."""
    from distrain.parallel.layout import default_stages_per_rank, layout_for
    from distrain.parallel.pipeline_split import split_blocks, split_for
    from distrain.parallel.tensor_parallel import check_plan

    if job.world_size < 2:
        return None
    per_rank = job.stages_per_rank or default_stages_per_rank(job.pipeline_schedule)
    try:
        # model_parallel: tensor parallel over what the stages leave of a node, as the strategy resolves it
        sizes = (job.tensor_parallel, "auto", job.pipeline_stages, per_rank)
        layout = layout_for(job.world_size, job.per_node, strategy == "pipeline", *sizes)
        module = job.spec.build()
        if layout.tensor > 1:
            check_plan(module, layout.tensor, job.sequence_parallel)
            if not strict and job.sequence_parallel and job.spec.seq_len % layout.tensor:
                return None  # as tensor_parallel_option: no layout a batch of this length cannot run
        split_blocks(split_for(module), layout.num_stages, job.split_points, root=module)
    except (ValueError, TypeError):
        if strict:
            raise
        return None
    sharding = "FULL_SHARD" if layout.data > 1 else None
    return Option(
        "pp",
        sharding=sharding,
        pipeline=layout.pipeline,
        tensor=layout.tensor,
        sequence_parallel=job.sequence_parallel if layout.tensor > 1 else None,
        schedule=job.pipeline_schedule,
        stages_per_rank=per_rank,
    )


MODELS = (Pipeline(),)
