"""Per-rank memory of each way to train: the options, and what each one holds.

Every estimate is a sum of named parts, each either measured on the traced step (activations,
the optimizer's state and temporaries, exactly as the module's own code allocates them) or
counted from the model's parameters by how the strategy stores them:

- single process / DDP: replicated parameters, gradients in DDP's buckets (with
  ``gradient_as_bucket_view`` the gradients *are* the buckets), the optimizer state, and the traced
  activations; the optimizer step adds its traced temporaries.
- FSDP: simulated (``simulate.py``): FSDP2 itself on a fake process group, measured by
  ``FSDPMemTracker``.
- DeepSpeed ZeRO: ``zero.py``, DeepSpeed's buffers counted from its source, with the same traced
  activations and optimizer temporaries.
- Tensor parallel (alone or with FSDP over the data-parallel ranks): simulated (``simulate.py``),
  distrain's ``ModelParallelStrategy`` on a fake process group.
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
    param_stats,
    trace_step,
)
from distrain.planner.options import _BYTE_FIELDS, Option, Row
from distrain.planner.timing import Hardware, StepTime, step_time


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
    zero: dict = field(default_factory=dict)
    """The DeepSpeed ``zero_optimization`` section a run would use (bucket sizes, thresholds)."""
    gradient_as_bucket_view: bool = True
    fsdp_options: dict = field(default_factory=dict)
    """FSDPStrategy options the run sets (``mixed_precision``, ``forward_prefetch``), for the simulation."""
    fsdp_sharding: str = "FULL_SHARD"
    fsdp_cpu_offload: bool = False
    """What a run named ``fsdp`` shards and offloads (the config's ``fsdp`` section)."""
    tensor_parallel: int | str = "auto"
    sequence_parallel: bool = True
    context_parallel: int = 1
    """``distributed.context_parallel_size`` of a run named ``model_parallel``."""
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
        return self.tokens_per_step // max(1, option.tensor * option.pipeline * option.context)


class Estimator:
    """Estimates options for one job; traces and simulations are cached.

    A deep model (more than 8 identical blocks) is estimated at 4 and 8 blocks and each byte count
    extrapolated to its depth: every part is affine in the number of identical blocks (their
    parameters, gradients, states and saved activations add up; embeddings, head, loss, buffers and
    the one-block working sets do not change), and a 70B model plans in seconds instead of minutes.
    Checkpointing k of L blocks is extrapolated from none and one block (each further block trades
    its saved activations for its input), never below checkpointing them all."""

    def __init__(self, job: Job):
        self.job = job
        self._traces: dict[tuple, StepTrace] = {}
        self._stats: ParamStats | None = None
        self._simulated: dict[tuple, object] = {}  # FSDP's and tensor parallelism's simulated steps
        self._rows: dict[Option, Row] = {}
        self._shallow: dict[int, Estimator] | None = None
        if is_deep(job.spec):
            self._shallow = {d: Estimator(_replace(job, spec=job.spec.with_depth(d))) for d in SHALLOW_DEPTHS}

    @property
    def num_blocks(self) -> int:
        return self.job.spec.num_blocks

    # ---- shared measurements -----------------------------------------------------------------------
    @property
    def stats(self) -> ParamStats:
        if self._stats is None:
            self._stats = param_stats(self.job.spec)
        return self._stats

    def dtypes(self, family: str) -> tuple[torch.dtype, torch.dtype | None]:
        """(parameter dtype, autocast dtype) of the model as the strategy computes with it. DeepSpeed
        keeps its bf16/fp16 copy of the parameters in the model (fp32 masters in the optimizer), and
        FSDP's mixed-precision policy gathers them in the compute dtype; one process and DDP keep fp32
        parameters under autocast (whose cache holds a bf16 copy of each weight during forward),
        except bf16-true."""
        p = self.job.precision
        autocast = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(p)
        if family in ("zero", "fsdp"):
            return {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-mixed": torch.float16}.get(
                p, torch.float32
            ), autocast
        return (torch.bfloat16 if p == "bf16-true" else torch.float32), autocast

    def trace(self, family: str, checkpoint: int | None, micro_batch: int | None = None) -> StepTrace:
        """The traced bare step with this family's dtypes."""
        job = self.job
        b = micro_batch or job.micro_batch
        param_dtype, autocast = self.dtypes(family)
        reentrant = family == "zero" and checkpoint != 0  # DeepSpeed's activation checkpointing is reentrant
        key = (b, param_dtype, autocast, checkpoint, reentrant)
        if key not in self._traces:
            self._traces[key] = trace_step(
                job.spec,
                b,
                checkpoint=checkpoint,
                param_dtype=param_dtype,
                autocast=autocast,
                foreach=job.gpu,
                clip=job.clip,
                reentrant=reentrant,
            )
        return self._traces[key]

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
                for f in _BYTE_FIELDS
            }
            return _replace(one, option=option, **values)
        if option.family == "pp":  # traced stage by stage at full depth (a stage per block, at most)
            return self._pipeline_row(option)
        if self._shallow is not None:
            rows = {d: est.estimate(option) for d, est in self._shallow.items()}
            values = {f: affine({d: getattr(r, f) for d, r in rows.items()}, blocks) for f in _BYTE_FIELDS}
            note = rows[max(rows)].note
            return _replace(rows[max(rows)], option=option, note=note, **values)
        if option.family in ("single", "ddp"):
            return self._replicated(option)
        if option.family == "fsdp":
            return self._fsdp_row(option)
        if option.family in ("tp", "cp"):
            return self._tensor_row(option)
        from distrain.planner.zero import zero_row

        return zero_row(self, option)

    def activation_slope(self, option: Option) -> float:
        """Peak bytes per extra sample of micro-batch: the traced activations at twice the batch.
        Only activations grow with the batch; every other part stays."""
        blocks, b = self.num_blocks, self.job.micro_batch
        if option.checkpoint not in (0, 1, None) and blocks > 1:
            none = self.activation_slope(_replace(option, checkpoint=0))
            one = self.activation_slope(_replace(option, checkpoint=1))
            every = self.activation_slope(_replace(option, checkpoint=None))
            return max(none + min(option.checkpoint, blocks) * (one - none), every)
        if option.family == "pp":
            return max(0.0, (self._pipeline_row(option, 2 * b).peak - self._pipeline_row(option).peak) / b)
        if self._shallow is not None:
            slopes = {d: est.activation_slope(option) for d, est in self._shallow.items()}
            return float(affine(slopes, blocks))
        family = "ddp" if option.family in ("single", "ddp") else option.family
        if family in ("tp", "cp"):  # each rank its part of every layer (of every sequence): activations split so
            family = "fsdp" if option.sharding else "ddp"
            whole = self.activation_slope(_replace(option, family=family, tensor=1, context=1))
            return whole / (option.tensor * option.context)
        single = self.trace(family, option.checkpoint).activations
        double = self.trace(family, option.checkpoint, 2 * b).activations
        return max(0.0, (double - single) / b)

    def step_time(self, option: Option, hw: Hardware) -> StepTime:
        """Predicted seconds per optimizer step (``timing.py``). Like the bytes, the time is affine in
        the number of checkpointed blocks and in depth: deep models are timed at two shallow depths."""
        blocks = self.num_blocks
        if option.checkpoint not in (0, 1, None) and blocks > 1:
            none = self.step_time(_replace(option, checkpoint=0), hw)
            every = self.step_time(_replace(option, checkpoint=None), hw)
            share = min(option.checkpoint, blocks) / blocks
            return none.scaled(1 - share) + every.scaled(share)
        if option.family == "pp":
            from distrain.planner.pipeline import pipeline_step_time

            full = self._whole_step(option)
            return pipeline_step_time(option, self.job, self._pipeline_trace(option), full, hw)
        if self._shallow is not None:
            times = {d: est.step_time(option, hw).astuple() for d, est in self._shallow.items()}
            (d1, t1), (d2, t2) = sorted(times.items())
            return StepTime(*(a + (b - a) * (blocks - d1) / (d2 - d1) for a, b in zip(t1, t2)))
        if option.family in ("tp", "cp"):
            from distrain.planner.timing import tensor_parallel_step_time

            trace = self.trace("fsdp" if option.sharding else "ddp", option.checkpoint)
            return tensor_parallel_step_time(option, self.job, trace, self._simulated_tensor(option), hw)
        family = "ddp" if option.family in ("single", "ddp") else option.family
        return step_time(option, self.job, self.trace(family, option.checkpoint), blocks + 1, hw)

    def _replicated(self, option: Option) -> Row:
        """One process, or DDP: every rank holds everything."""
        t = self.trace(option.family, option.checkpoint)
        params = t.param_bytes + t.buffer_bytes
        grads, opt = t.grad_bytes, t.optimizer_bytes
        if option.family == "single":
            # gradients appear one by one in backward, beside the activations still alive
            forward_backward = params + opt + t.activations_and_grads
            buffers = 0
        else:
            # DDP allocates its gradient buckets up front (with gradient_as_bucket_view they are the .grad
            # tensors); without bucket views the gradients and the buckets are separate copies
            buffers = 0 if self.job.gradient_as_bucket_view else grads
            forward_backward = params + grads + buffers + opt + t.activations
        if option.semi_sync == "diloco":  # the parameters as of the last meeting, and the outer SGD's momentum
            outer = t.elements * 4 * (2 if self.job.outer_momentum else 1)
            opt += outer
            forward_backward += outer
        step = params + grads + buffers + opt + t.input_bytes + t.step_extra
        return Row(option, params, grads, opt, t.activations, buffers, max(forward_backward, step))

    def _fsdp_row(self, option: Option) -> Row:
        from distrain.planner.simulate import simulate_fsdp

        job = self.job
        key = ("fsdp", option.sharding, option.checkpoint, job.micro_batch)
        if key not in self._simulated:
            self._simulated[key] = simulate_fsdp(
                job.spec,
                job.micro_batch,
                world_size=job.world_size,
                num_nodes=job.num_nodes,
                sharding=option.sharding,
                precision=job.precision,
                checkpoint=option.checkpoint,
                accumulate=job.accumulate,
                foreach=job.gpu,
                options=job.fsdp_options,
            )
        p = self._simulated[key]
        # the activations column means the same for every row: the traced peak at this micro-batch (the
        # simulation's own kinds at its peak moment mix in the optimizer step's temporaries)
        activations = self.trace("fsdp", option.checkpoint).activations
        if option.offload == "none":
            return Row(option, p.params, p.grads, p.optimizer, activations, p.buffers, p.peak, sharded=p.sharded_state)
        # CPU offload keeps the sharded parameters, gradients and optimizer state in host memory (the
        # optimizer steps there); the device holds what is unsharded for compute
        return Row(
            option,
            p.params,
            p.grads,
            p.optimizer,
            activations,
            p.buffers,
            p.peak - p.sharded_state,
            host=p.sharded_state,
            note="device peak: the simulated one less the sharded state moved to the host",
        )

    def _simulated_tensor(self, option: Option):
        from distrain.planner.simulate import simulate_tensor_parallel

        job = self.job
        key = ("tp", option.tensor, option.context, option.sequence_parallel, option.checkpoint, job.micro_batch)
        if key not in self._simulated:
            self._simulated[key] = simulate_tensor_parallel(
                job.spec,
                job.micro_batch,
                world_size=job.world_size,
                tensor=option.tensor,
                context=option.context,
                sequence_parallel=option.sequence_parallel,
                precision=job.precision,
                checkpoint=option.checkpoint,
                accumulate=job.accumulate,
                foreach=job.gpu,
            )
        return self._simulated[key]

    def _pipeline_trace(self, option: Option, micro_batch: int | None = None):
        from distrain.planner.pipeline import trace_pipeline

        b = micro_batch or self.job.micro_batch
        family = "fsdp" if option.sharding else "ddp"
        stages = option.pipeline * option.stages_per_rank
        key = ("pp", stages, option.checkpoint, b, family)
        if key not in self._simulated:
            param_dtype, autocast = self.dtypes(family)
            self._simulated[key] = trace_pipeline(
                self.job.spec,
                b,
                stages,
                param_dtype=param_dtype,
                autocast=autocast,
                checkpoint=option.checkpoint,
                split_points=self.job.split_points,
            )
        return self._simulated[key]

    def pipeline_ranks(self, option: Option, micro_batch: int | None = None) -> list:
        """What each pipeline rank holds (``pipeline.RankLoad``): each stage traced alone, the schedule's
        micro-batches in flight counted, FSDP over the data-parallel replicas when there are any."""
        from distrain.planner.pipeline import rank_loads

        full = self._whole_step(option, micro_batch)
        return rank_loads(option, self.job, self._pipeline_trace(option, micro_batch), full)

    def _pipeline_row(self, option: Option, micro_batch: int | None = None) -> Row:
        from distrain.planner.pipeline import pipeline_row

        return pipeline_row(option, self.pipeline_ranks(option, micro_batch))

    def _whole_step(self, option: Option, micro_batch: int | None = None) -> StepTrace:
        """A traced whole-model step in the option's dtypes, for bytes and work per parameter element: a
        deep model's at its deeper shallow depth."""
        estimator = self._shallow[max(self._shallow)] if self._shallow else self
        return estimator.trace("fsdp" if option.sharding else "ddp", option.checkpoint, micro_batch)

    def _tensor_row(self, option: Option) -> Row:
        """Tensor or context parallel, with FSDP over the other ranks when there are any: simulated."""
        p = self._simulated_tensor(option)
        sharded = p.params + p.grads + p.optimizer if option.sharding else 0
        return Row(option, p.params, p.grads, p.optimizer, p.activations, 0, p.peak, sharded=sharded)
