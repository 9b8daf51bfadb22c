"""How the ranks are arranged: pipeline × data × tensor parallel, as one ``DeviceMesh``.

Ranks are numbered tensor-parallel innermost (the group that talks most sits on neighbouring
devices, NVLink on one node), then data parallel, then pipeline stages outermost — torchtitan's
order. The mesh's dimension names are Lightning's (``"data_parallel"``, ``"tensor_parallel"``),
plus ``"pipeline_parallel"``.
"""

from __future__ import annotations

from dataclasses import dataclass

PP, DP, TP = "pipeline_parallel", "data_parallel", "tensor_parallel"
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

    @property
    def world_size(self) -> int:
        return self.pipeline * self.data * self.tensor

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
    ) -> ParallelLayout:
        """The layout for ``world_size`` ranks; a size that cannot be is a one-line error naming
        the option (and its config key) at fault."""
        for name, key, value in (
            ("tensor_parallel_size", "distributed.tensor_parallel_size", tensor_parallel_size),
            ("stages", "distributed.pipeline_stages", pipeline_stages),
            ("stages_per_rank", "distributed.pipeline_stages_per_rank", stages_per_rank),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} ({key}) must be a positive integer, got {value!r}")
        model_parallel = tensor_parallel_size * pipeline_stages
        if world_size % model_parallel:
            raise ValueError(
                f"{world_size} ranks cannot hold tensor_parallel_size={tensor_parallel_size} × "
                f"pipeline stages={pipeline_stages} ({model_parallel} ranks per model replica): the number of "
                f"ranks (devices × num_nodes) must be a multiple of {model_parallel} "
                "(distributed.tensor_parallel_size, distributed.pipeline_stages)"
            )
        data = world_size // model_parallel
        if data_parallel_size not in (None, "auto"):
            if not isinstance(data_parallel_size, int) or isinstance(data_parallel_size, bool):
                raise ValueError(
                    f"data_parallel_size (distributed.data_parallel_size) must be an integer or 'auto', "
                    f"got {data_parallel_size!r}"
                )
            if data_parallel_size != data:
                raise ValueError(
                    f"data_parallel_size={data_parallel_size} × tensor_parallel_size={tensor_parallel_size} × pipeline "
                    f"stages={pipeline_stages} = {data_parallel_size * model_parallel}, but {world_size} ranks run "
                    "(devices × num_nodes); leave data_parallel_size 'auto' (distributed.data_parallel_size) or make "
                    "them agree"
                )
        return cls(pipeline_stages, data, tensor_parallel_size, stages_per_rank)

    def mesh(self, device_type: str):
        """The ranks as a ``DeviceMesh`` of dims (pipeline_parallel, data_parallel, tensor_parallel); every
        rank must call this together (it creates the process groups of each dimension)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pipeline, self.data, self.tensor), mesh_dim_names=(PP, DP, TP))

    def describe(self) -> str:
        parts = [
            f"pipeline {self.pipeline}" + (f" × {self.stages_per_rank} stages" if self.stages_per_rank > 1 else "")
        ]
        parts += [f"data {self.data}", f"tensor {self.tensor}"]
        return " × ".join(parts)
