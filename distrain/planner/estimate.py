"""The job being planned, and the estimator that prices its options.

The estimator holds what every option shares: the model's statistics, the traced step in each dtype, the
simulations' cache, and the arithmetic of depth (a deep model is priced at two shallow depths and extrapolated) and
of partial activation checkpointing (interpolated between none, one and every block). What one option holds and
how long its step takes is its cost model's (``planner/models/``: one per strategy file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from dataclasses import replace as _replace

import torch

from distrain.planner.model_stats import (
    SHALLOW_DEPTHS,
    ModelSpec,
    ParamStats,
    StepTrace,
    affine,
    is_deep,
    trace_step,
)
from distrain.planner.models import model_of
from distrain.planner.options import BYTE_FIELDS, Option, Row
from distrain.planner.simulate import Started
from distrain.planner.timing import Hardware, StepTime, step_at_depth
from distrain.precision import AUTOCAST, TRUE_DTYPES, compute_dtype


@dataclass
class Job:
    """The run being planned."""

    spec: ModelSpec
    micro_batch: int
    precision: str = "32-true"
    world_size: int = 1
    num_nodes: int = 1
    accumulate: int = 1
    clip: float | None = None
    gpu: bool = False
    """Plan for CUDA devices: the optimizer runs torch's multi-tensor (foreach) kernels, offload applies."""
    compile: bool = False
    """``training.compile``: on a GPU, the memory-bound operations between matmuls run fused (``work.WorkCounter``);
    on a CPU, where compiling measured no faster (docs/benchmarks.md), the work stays eager's."""
    gradient_as_bucket_view: bool = True
    configured: dict[str, dict] = field(default_factory=dict)
    """What the run's config says to the cost models that read one (their strategy's own section), by each model's
    first kind, as its ``from_config`` found it (``fsdp``: sharding, offload, options; ``zero``: the DeepSpeed
    JSON). A model with nothing here prices its strategy's defaults."""
    tensor_parallel: int | str = "auto"
    sequence_parallel: bool = True
    context_parallel: int = 1
    """``distributed.context_parallel_size`` of a run named ``model_parallel``."""
    expert_parallel: int = 1
    """``distributed.expert_parallel_size`` of a run named ``ddp`` or ``fsdp``."""
    pipeline_stages: int | str | None = None
    """What a run named ``model_parallel`` or ``pipeline`` splits (``distributed.tensor_parallel_size``,
    ``sequence_parallel``, ``pipeline_stages``)."""
    pipeline_schedule: str = "1F1B"
    stages_per_rank: int | None = None
    split_points: list | None = None
    replica_groups: int = 1
    """``ddp_torchft``: the replica groups the ranks form (``world_size`` counts every group's ranks)."""
    semi_sync: str | None = None
    sync_every: int = 8
    outer_momentum: float = 0.9
    """``ddp_torchft``'s ``distributed.semi_sync`` (local_sgd or diloco), ``sync_every`` and DiLoCo's momentum."""

    def __post_init__(self):
        if self.float8 and not self.gpu:
            raise ValueError(
                "precision='fp8' runs on GPUs with float8 tensor cores (H100, H200, L4): plan it for one "
                "(--gpu-type H100), or plan 'bf16-mixed' here"
            )
        if self.float8:
            from distrain.precision import require_torchao

            require_torchao("planning precision='fp8' traces torchao's float8 layers, as the run converts them,")

    @property
    def float8(self) -> bool:
        """``precision: fp8``: the linear layers are torchao's float8 ones (``precision.convert_to_float8``)."""
        return self.precision == "fp8"

    @property
    def fuses(self) -> bool:
        """Whether the traced work runs compiled: ``compile`` on a GPU (its memory-bound operations fused)."""
        return self.compile and self.gpu

    @property
    def per_node(self) -> int:
        return self.world_size // self.num_nodes

    @property
    def tokens_per_step(self) -> int:
        """Tokens (samples × sequence length) one optimizer step of the whole job consumes."""
        return self.micro_batch * self.accumulate * self.world_size * self.spec.seq_len

    def tokens_per_step_of(self, option: Option) -> int:
        """The same under ``option``: tensor- and context-parallel ranks and pipeline stages share their samples
        (the micro-batch is per data-parallel rank)."""
        return self.tokens_per_step // option.sharing_a_sample


class Estimator:
    """Estimates options for one job; traces and simulations are cached.

    A deep model (more than 8 identical blocks) is estimated at 4 and 8 blocks and each byte count
    extrapolated to its depth: every part is affine in the number of identical blocks (their
    parameters, gradients, states and saved activations add up; embeddings, head, loss, buffers and
    the one-block working sets do not change), and a 70B model plans in seconds instead of minutes.
    Checkpointing k of L blocks is extrapolated from none and one block (each further block trades
    its saved activations for its input), never below checkpointing them all.

    ``same_step``: the estimator of this job at another accumulation (a tensor-parallel or pipeline layout's, whose
    ranks share samples), whose traced steps this one shares: a bare step is the same however many a step takes."""

    def __init__(self, job: Job, same_step: Estimator | None = None):
        if same_step is not None and _replace(same_step.job, accumulate=job.accumulate) != job:
            raise ValueError("an estimator shares traced steps only with one of the same job at another accumulation")
        self.job = job
        self._same_step = same_step
        self._traces: dict[tuple, StepTrace] = same_step._traces if same_step else {}
        self._stats: ParamStats | None = None
        self._memo: dict[tuple, object] = {}  # the cost models' simulations and traces (``memo``)
        self._rows: dict[Option, Row] = {}
        self._shallow: dict[int, Estimator] | None = None
        if is_deep(job.spec):
            if same_step is not None:
                self._shallow = {
                    d: Estimator(_replace(job, spec=shallow.job.spec), shallow)
                    for d, shallow in same_step._shallow.items()
                }
            else:
                self._shallow = {d: Estimator(_replace(job, spec=job.spec.with_depth(d))) for d in SHALLOW_DEPTHS}

    @property
    def num_blocks(self) -> int:
        return self.job.spec.num_blocks

    # ---- shared measurements -----------------------------------------------------------------------
    @property
    def stats(self) -> ParamStats:
        if self._stats is None:
            self._stats = self._same_step.stats if self._same_step else ParamStats.of(self.job.spec.build())
        return self._stats

    def dtypes(self, kind: str) -> tuple[torch.dtype, torch.dtype | None]:
        """(parameter dtype, autocast dtype) of the model as the strategy of options of ``kind`` computes with
        it. DeepSpeed keeps its bf16/fp16 copy of the parameters in the model (fp32 masters in the optimizer),
        and FSDP's mixed-precision policy gathers them in the compute dtype (``CostModel.sharded_dtypes``); one
        process and DDP keep fp32 parameters under autocast (whose cache holds a bf16 copy of each weight during
        forward), except bf16-true."""
        p = self.job.precision
        compute = compute_dtype(p)  # fp8: torchao's float8 linears under bf16 autocast, FSDP gathering in bf16
        autocast = compute if p in AUTOCAST else None
        if model_of(kind).sharded_dtypes:
            return compute, autocast
        return (compute if p in TRUE_DTYPES else torch.float32), autocast

    def trace(
        self, kind: str, checkpoint: int | None, micro_batch: int | None = None, routed_over: int = 1
    ) -> StepTrace:
        """The traced bare step with the dtypes (and checkpointing) of options of ``kind``; ``routed_over`` > 1: a
        mixture of experts' worst routing with its experts over that many ranks (``model_stats.worst_routing``)."""
        job = self.job
        b = micro_batch or job.micro_batch
        param_dtype, autocast = self.dtypes(kind)
        reentrant = model_of(kind).reentrant_checkpointing and checkpoint != 0
        key = (b, param_dtype, autocast, checkpoint, reentrant, routed_over)
        if key not in self._traces:
            trace = trace_step(
                job.spec,
                b,
                checkpoint=checkpoint,
                param_dtype=param_dtype,
                autocast=autocast,
                foreach=job.gpu,
                clip=job.clip,
                reentrant=reentrant,
                float8=job.float8,
                routed_over=routed_over,
            )
            self._traces[key] = _replace(trace, work=trace.work.compiled()) if job.fuses else trace
        return self._traces[key]

    def memo(self, key: tuple, make):
        """``make()``, once per key: a cost model's simulations and traces, kept with this estimator (one that
        ``start`` began is waited for here)."""
        if key not in self._memo:
            self._memo[key] = make()
        value = self._memo[key]
        if isinstance(value, Started):
            value = self._memo[key] = value.result()
        return value

    def start(self, key: tuple, begin) -> None:
        """``begin()`` (a simulation started in a child process, ``simulate.Started``), unless the key is known:
        what ``memo`` returns for it later."""
        if key not in self._memo:
            self._memo[key] = begin()

    def prefetch(self, option: Option) -> None:
        """Start the simulations ``estimate(option)`` will need, to run beside the others ``prefetch`` starts (one
        child process each): the depths and checkpointing counts it is made of, as ``estimate`` walks them."""
        blocks = self.num_blocks
        if option.checkpoint not in (0, 1, None) and blocks > 1:
            for checkpoint in (0, 1, None):
                self.prefetch(_replace(option, checkpoint=checkpoint))
            return
        model = option.model
        if self._shallow is not None and model.extrapolates_depth:
            for estimator in self._shallow.values():
                estimator.prefetch(option)
            return
        model.prefetch(self, option)

    @property
    def deepest(self) -> Estimator:
        """The estimator of the deepest model traced whole: this one, or a deep model's deeper shallow depth."""
        return self._shallow[max(self._shallow)] if self._shallow else self

    # ---- options -------------------------------------------------------------------------------------
    def estimate(self, option: Option) -> Row:
        if option not in self._rows:
            self._rows[option] = self._estimate(option)
        return self._rows[option]

    def _estimate(self, option: Option) -> Row:
        blocks = self.num_blocks
        if option.checkpoint not in (0, 1, None) and blocks > 1:
            if option.checkpoint >= blocks:
                return _replace(self.estimate(_replace(option, checkpoint=None)), option=option)
            # each further checkpointed block (from the first) trades its saved activations for its
            # input, the same amount every time, until the count where recomputing the last block
            # (at the start of backward) is what remains: no lower than checkpointing them all
            none = self.estimate(_replace(option, checkpoint=0))
            one = self.estimate(_replace(option, checkpoint=1))
            every = self.estimate(_replace(option, checkpoint=None))
            k = option.checkpoint
            values = {
                f: max(int(getattr(none, f) + k * (getattr(one, f) - getattr(none, f))), getattr(every, f))
                for f in BYTE_FIELDS
            }
            return _replace(one, option=option, **values)
        model = option.model
        if self._shallow is not None and model.extrapolates_depth:
            rows = {d: est.estimate(option) for d, est in self._shallow.items()}
            values = {f: affine({d: getattr(r, f) for d, r in rows.items()}, blocks) for f in BYTE_FIELDS}
            return _replace(rows[max(rows)], option=option, **values)
        return model.estimate(self, option)

    def activation_slope(self, option: Option) -> float:
        """Peak bytes per extra sample of micro-batch: the traced activations at twice the batch.
        Only activations grow with the batch; every other part stays."""
        blocks = self.num_blocks
        if option.checkpoint not in (0, 1, None) and blocks > 1:
            none = self.activation_slope(_replace(option, checkpoint=0))
            one = self.activation_slope(_replace(option, checkpoint=1))
            every = self.activation_slope(_replace(option, checkpoint=None))
            return max(none + min(option.checkpoint, blocks) * (one - none), every)
        model = option.model
        if self._shallow is not None and model.extrapolates_depth:
            slopes = {d: est.activation_slope(option) for d, est in self._shallow.items()}
            return float(affine(slopes, blocks))
        return model.activation_slope(self, option)

    def step_time(self, option: Option, hw: Hardware) -> StepTime:
        """Predicted seconds per optimizer step (``timing.py``). Like the bytes, the time is affine in
        the number of checkpointed blocks and in depth: deep models are timed at two shallow depths."""
        blocks = self.num_blocks
        if option.checkpoint not in (0, 1, None) and blocks > 1:
            none = self.step_time(_replace(option, checkpoint=0), hw)
            every = self.step_time(_replace(option, checkpoint=None), hw)
            share = min(option.checkpoint, blocks) / blocks
            return none.scaled(1 - share) + every.scaled(share)
        model = option.model
        if self._shallow is not None and model.extrapolates_depth:
            times = {d: est.step_time(option, hw) for d, est in self._shallow.items()}
            return step_at_depth(times, blocks, hw.overlap and model.overlaps_communication)
        return model.step_time(self, option, hw)
