"""Pipeline parallelism: ``strategy="pipeline"`` / ``PipelineStrategy(stages, schedule, microbatches)``.

The model's blocks are split into ``stages`` runs, one per rank (``torch.distributed.pipelining``);
ranks left over (a multiple of the stages) are data-parallel replicas of the pipeline, each stage
sharded over them with FSDP2. ``tensor_parallel_size`` splits each stage's layers as well (3-D).
It is ``ModelParallelStrategy`` with a pipeline and no tensor parallelism by default; see
``distrain/parallel/pipeline.py`` for how a step runs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from distrain.strategies.model_parallel import ModelParallelStrategy, options_from_config
from distrain.strategies.registry import register


class PipelineStrategy(ModelParallelStrategy):
    """``stages``: pipeline ranks (``"auto"``: every rank that tensor parallelism leaves, no data
    parallelism); ``schedule``: ``"1F1B"`` (default), ``"GPipe"`` or ``"Interleaved1F1B"``;
    ``microbatches``: the Trainer's accumulation micro-batches are the pipeline's (None: as many as
    ``accumulate_grad_batches``; a different number is refused); ``split_points``: block indices
    or names where stages 2, 3, ... begin (default: balanced by parameter count)."""

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
            pipeline_stages=1,  # set in connect(), once the number of ranks is known for "auto"
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
        self.stages = stages

    def connect(self, accelerator, precision, cluster, nprocs: int, num_nodes: int):
        world = nprocs * num_nodes
        tp = self.tensor_parallel_size if isinstance(self.tensor_parallel_size, int) else 1
        stages = self.stages
        if stages == "auto":
            stages = max(1, world // tp)
        if isinstance(stages, int) and not isinstance(stages, bool) and stages < 2:
            raise ValueError(
                f"the pipeline strategy needs at least 2 stages (distributed.pipeline_stages), got {stages}"
                + (" (one process: use strategy='single')" if world == 1 else "")
            )
        self.pipeline_stages = stages
        self.tensor_parallel_size = tp
        super().connect(accelerator, precision, cluster, nprocs, num_nodes)


register(
    "pipeline",
    PipelineStrategy,
    "pipeline stages (torch.distributed.pipelining: 1F1B, GPipe, Interleaved1F1B), FSDP2 over replicas",
    options_from_config,
    "distributed",
)
