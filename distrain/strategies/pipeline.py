"""Pipeline parallelism: ``strategy="pipeline"`` / ``PipelineStrategy(stages, schedule, microbatches)``.

The model's blocks are split into ``stages`` runs, one per rank (``torch.distributed.pipelining``);
ranks left over (a multiple of the stages) are data-parallel replicas of the pipeline, each stage
sharded over them with FSDP2. ``tensor_parallel_size`` splits each stage's layers as well (3-D).
It is ``ModelParallelStrategy`` with a pipeline and no tensor parallelism by default; see
``distrain/parallel/pipeline_stages.py`` for how a step runs.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

from distrain.strategies.model_parallel import ModelParallelStrategy, check, options_from_config
from distrain.strategies.registry import register


class PipelineStrategy(ModelParallelStrategy):
    """``stages``: pipeline ranks (``"auto"``: every rank that tensor parallelism leaves, no data
    parallelism); ``schedule``: ``"1F1B"`` (default), ``"GPipe"`` or ``"Interleaved1F1B"``;
    ``microbatches``: the Trainer's accumulation micro-batches are the pipeline's (None: as many as
    ``accumulate_grad_batches``; a different number is refused); ``split_points``: block indices
    or names where stages 2, 3, ... begin (default: balanced by parameter count)."""

    pipeline_strategy = True

    def __init__(
        self,
        stages: int | str = "auto",
        schedule: str = "1F1B",
        microbatches: int | None = None,
        split_points: list[int | str] | None = None,
        stages_per_rank: int | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int | str = "auto",
        sequence_parallel: bool = True,
        activation_checkpointing_policy: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float = timedelta(minutes=30),
        collective_timeout: timedelta | float | None = timedelta(minutes=5),
    ):
        super().__init__(
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size,
            pipeline_stages=stages,  # "auto": every rank tensor parallelism leaves (connect)
            schedule=schedule,
            microbatches=microbatches,
            split_points=split_points,
            stages_per_rank=stages_per_rank,
            sequence_parallel=sequence_parallel,
            activation_checkpointing_policy=activation_checkpointing_policy,
            process_group_backend=process_group_backend,
            timeout=timeout,
            collective_timeout=collective_timeout,
        )


register(
    "pipeline",
    PipelineStrategy,
    "pipeline stages (torch.distributed.pipelining: 1F1B, GPipe, Interleaved1F1B), FSDP2 over replicas",
    functools.partial(options_from_config, pipeline=True),
    "distributed",
    check,
    cost_model="distrain.planner.models.pipeline",
)
