"""How the ranks are arranged: pipeline × data × context × tensor parallel, as one ``DeviceMesh``.

Ranks are numbered tensor-parallel innermost (the group that talks most sits on neighbouring
devices, NVLink on one node), then context parallel, then data parallel, then pipeline stages
outermost — torchtitan's order. The mesh's dimension names are Lightning's (``"data_parallel"``,
``"tensor_parallel"``), plus ``"context_parallel"`` and ``"pipeline_parallel"``.
"""

from __future__ import annotations

from dataclasses import dataclass

PP, DP, CP, TP = "pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel"
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")


@dataclass(frozen=True)
class ParallelLayout:
    pipeline: int = 1
    """Pipeline ranks (each holds a contiguous run of the model's blocks)."""
    data: int = 1
    """Data-parallel replicas (FSDP2 shards each stage over them); the data is split over these only."""
    tensor: int = 1
    """Ranks that split each layer's weights (DTensor)."""
    stages_per_rank: int = 1
    """Model pieces per pipeline rank (Interleaved1F1B: 2 or more, the virtual stages)."""
    context: int = 1
    """Ranks that split each sequence (they share samples; ``distrain.parallel.context_parallel``)."""

    @property
    def world_size(self) -> int:
        return self.pipeline * self.data * self.context * self.tensor

    def coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """(pipeline, data, context, tensor) position of ``rank``: tensor innermost, pipeline outermost."""
        tensor, rest = rank % self.tensor, rank // self.tensor
        context, rest = rest % self.context, rest // self.context
        return rest // self.data, rest % self.data, context, tensor

    @property
    def num_stages(self) -> int:
        return self.pipeline * self.stages_per_rank

    @classmethod
    def resolve(
        cls,
        world_size: int,
        tensor_parallel_size: int = 1,
        data_parallel_size: int | str | None = "auto",
        pipeline_stages: int = 1,
        stages_per_rank: int = 1,
        context_parallel_size: int = 1,
    ) -> ParallelLayout:
        """The layout for ``world_size`` ranks; a size that cannot be is a one-line error naming
        the option (and its config key) at fault."""
        for name, key, value in (
            ("tensor_parallel_size", "distributed.tensor_parallel_size", tensor_parallel_size),
            ("stages", "distributed.pipeline_stages", pipeline_stages),
            ("stages_per_rank", "distributed.pipeline_stages_per_rank", stages_per_rank),
            ("context_parallel_size", "distributed.context_parallel_size", context_parallel_size),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} ({key}) must be a positive integer, got {value!r}")
        if context_parallel_size > 1 and pipeline_stages > 1:
            raise ValueError(
                "context parallelism (distributed.context_parallel_size) does not compose with pipeline stages yet "
                "(distributed.pipeline_stages); choose one"
            )
        model_parallel = tensor_parallel_size * pipeline_stages * context_parallel_size
        if world_size % model_parallel:
            context = f" × context_parallel_size={context_parallel_size}" if context_parallel_size > 1 else ""
            raise ValueError(
                f"{world_size} ranks cannot hold tensor_parallel_size={tensor_parallel_size} × "
                f"pipeline stages={pipeline_stages}{context} ({model_parallel} ranks per model replica): the number "
                f"of ranks (devices × num_nodes) must be a multiple of {model_parallel} "
                "(distributed.tensor_parallel_size, distributed.pipeline_stages, distributed.context_parallel_size)"
            )
        data = world_size // model_parallel
        if data_parallel_size not in (None, "auto"):
            if not isinstance(data_parallel_size, int) or isinstance(data_parallel_size, bool):
                raise ValueError(
                    f"data_parallel_size (distributed.data_parallel_size) must be an integer or 'auto', "
                    f"got {data_parallel_size!r}"
                )
            if data_parallel_size != data:
                context = f" × context_parallel_size={context_parallel_size}" if context_parallel_size > 1 else ""
                raise ValueError(
                    f"data_parallel_size={data_parallel_size} × tensor_parallel_size={tensor_parallel_size} × pipeline "
                    f"stages={pipeline_stages}{context} = {data_parallel_size * model_parallel}, but {world_size} "
                    "ranks run "
                    "(devices × num_nodes); leave data_parallel_size 'auto' (distributed.data_parallel_size) or make "
                    "them agree"
                )
        return cls(pipeline_stages, data, tensor_parallel_size, stages_per_rank, context_parallel_size)

    def mesh(self, device_type: str):
        """The ranks as a ``DeviceMesh`` of dims (pipeline_parallel, data_parallel, context_parallel,
        tensor_parallel); every rank must call this together (it creates the process groups of each dimension)."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.pipeline, self.data, self.context, self.tensor)
        return init_device_mesh(device_type, shape, mesh_dim_names=(PP, DP, CP, TP))

    def describe(self) -> str:
        parts = [
            f"pipeline {self.pipeline}" + (f" × {self.stages_per_rank} stages" if self.stages_per_rank > 1 else "")
        ]
        parts += [f"data {self.data}"] + ([f"context {self.context}"] if self.context > 1 else [])
        parts += [f"tensor {self.tensor}"]
        return " × ".join(parts)


def default_stages_per_rank(schedule: str) -> int:
    """Model pieces per pipeline rank when none is given: Interleaved1F1B runs 2 (its virtual stages)."""
    return 2 if schedule == "Interleaved1F1B" else 1


def layout_for(
    world_size: int,
    devices_per_node: int,
    pipeline_strategy: bool,
    tensor_parallel_size: int | str = "auto",
    data_parallel_size: int | str | None = "auto",
    pipeline_stages: int | str | None = "auto",
    stages_per_rank: int = 1,
    context_parallel_size: int = 1,
) -> ParallelLayout:
    """The layout a strategy's options ask for, ``"auto"`` resolved the one way the strategies and the config
    check share. ``strategy="pipeline"``: no tensor parallelism unless asked, every rank it leaves a stage, at
    least 2 stages. ``strategy="model_parallel"``: no pipeline unless asked, tensor parallelism over one node's
    devices (shared among the stages)."""
    tp = tensor_parallel_size
    if pipeline_strategy:
        tp = 1 if tp == "auto" else tp
        stages = pipeline_stages
        if stages in (None, "auto") and isinstance(tp, int) and tp > 0:
            stages = max(1, world_size // tp)
        if isinstance(stages, int) and not isinstance(stages, bool) and stages < 2:
            raise ValueError(
                f"the pipeline strategy needs at least 2 stages (distributed.pipeline_stages), got {stages}"
                + (" (one process: use strategy='single')" if world_size == 1 else "")
            )
    else:
        stages = 1 if pipeline_stages in (None, "auto") else pipeline_stages
        if tp == "auto":  # one node's devices, shared among the stages and the context-parallel ranks
            shared = (stages if isinstance(stages, int) and stages > 1 else 1) * max(1, context_parallel_size)
            tp = max(1, devices_per_node // shared)
    return ParallelLayout.resolve(world_size, tp, data_parallel_size, stages, stages_per_rank, context_parallel_size)
