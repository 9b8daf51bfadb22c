"""What a plan is made of: the ways to train (``Option``) and what each holds per rank (``Row``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distrain.planner.models import model_of
from distrain.planner.timing import StepTime

#: Row fields that are bytes (extrapolated and interpolated)
BYTE_FIELDS = (
    "params", "grads", "optimizer", "activations", "buffers", "peak", "host", "sharded", "worst_routing_peak"
)  # fmt: skip


@dataclass(frozen=True, init=False, repr=False)
class Option:
    """One way to train: a kind of option (which names its cost model), activation checkpointing, offload, the
    layout's model-parallel sizes, and whatever else its cost model needs (``settings``: FSDP's sharding, a ZeRO
    stage, a pipeline schedule, a replica group's meeting) — only that model reads those, so a new model brings
    its own: ``Option("zero", stage=3)``, ``option.get("stage")``."""

    family: str
    """The kind of option, which names the cost model that prices it (``planner/models/``): ``single``, ``ddp``,
    ``fsdp``, ``zero``, ``tp`` (tensor parallel; FSDP over the remaining ranks), ``cp`` (context parallel, each
    sequence split over ``context`` ranks, optionally × ``tensor``; FSDP over data × context), ``pp`` (pipeline
    stages; FSDP over the remaining ranks), or a plug-in's own."""
    checkpoint: int | None = 0
    """Blocks whose activations are recomputed: 0 none, ``None`` every block."""
    offload: str = "none"
    """``none``, ``cpu`` or ``nvme``: where sharded state (ZeRO: optimizer, and parameters at stage 3) lives."""
    tensor: int = 1
    """Ranks that split each layer."""
    context: int = 1
    """Ranks that split each sequence."""
    pipeline: int = 1
    """Pipeline ranks."""
    settings: tuple[tuple[str, Any], ...] = ()
    """The cost model's own keys and values, sorted by key (hashable, so an option keys a cache); None is never
    kept (it is what ``get`` answers for a key not set)."""

    def __init__(
        self,
        family: str,
        *,
        checkpoint: int | None = 0,
        offload: str = "none",
        tensor: int = 1,
        context: int = 1,
        pipeline: int = 1,
        settings: tuple = (),
        **more: Any,
    ) -> None:
        for name, value in (
            ("family", family),
            ("checkpoint", checkpoint),
            ("offload", offload),
            ("tensor", tensor),
            ("context", context),
            ("pipeline", pipeline),
        ):
            object.__setattr__(self, name, value)
        given = {**dict(settings), **more}
        # a setting of None is one not set: ``Option("tp", sharding=None)`` is ``Option("tp")``
        object.__setattr__(self, "settings", tuple(sorted((k, v) for k, v in given.items() if v is not None)))

    def get(self, key: str, default: Any = None) -> Any:
        """One of ``settings`` (``default`` when the option has none of that name)."""
        return dict(self.settings).get(key, default)

    def __repr__(self) -> str:
        fields = [repr(self.family)]
        fields += [
            f"{k}={getattr(self, k)!r}"
            for k in ("checkpoint", "offload", "tensor", "context", "pipeline")
            if getattr(self, k) != Option.__dataclass_fields__[k].default
        ]
        fields += [f"{k}={v!r}" for k, v in self.settings]
        return f"Option({', '.join(fields)})"

    @property
    def sharing_a_sample(self) -> int:
        """Ranks that share each sample, all splitting its work: tensor × context × pipeline. A micro-batch is per
        data-parallel rank, so the data-parallel size is the world over this."""
        return self.tensor * self.context * self.pipeline

    @property
    def model(self):
        """The cost model that prices this option."""
        return model_of(self.family)

    @property
    def strategy(self) -> str:
        """The strategy name a run takes (``--strategy``)."""
        return self.model.strategy(self)

    @property
    def level(self) -> int:
        """What is sharded (the ranking's first key): 0 nothing, 1 optimizer state, 2 and gradients,
        3 and parameters within a node (hybrid), 4 and parameters across every rank, 5 the model split
        (tensor parallel: each layer and its activations, a collective in every layer; pipeline: the blocks
        into stages, which wait for each other)."""
        return self.model.level(self)

    def label_at(self, accumulate: int | None = None) -> str:
        """The table's label, as the option runs at ``accumulate`` micro-batches per step."""
        parts = [self.model.label(self, accumulate)]
        if self.checkpoint is None:
            parts.append("AC")
        elif self.checkpoint:
            parts.append(f"AC {self.checkpoint} blocks")
        if self.offload != "none":
            parts.append(f"{self.offload} offload ({self.model.offloaded(self)})")
        return " + ".join(parts)

    @property
    def label(self) -> str:
        return self.label_at()

    @property
    def short(self) -> str:
        """The name in one-line reasons: ``DDP``, ``FSDP+AC``, ``ZeRO-3``."""
        base = self.model.short(self)
        if self.checkpoint != 0:
            base += "+AC" if self.checkpoint is None else f"+AC{self.checkpoint}"
        if self.offload != "none":
            base += "+offload"
        return base


@dataclass
class Row:
    """An option's per-rank bytes (the table's row)."""

    option: Option
    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    peak: int
    host: int = 0
    """Host memory per rank for offloaded state."""
    sharded: int = 0
    """The part of ``peak`` divided among the ranks (shrinks as 1/N with more of them)."""
    fits: bool | None = None
    max_micro_batch: int | None = None
    max_seq_len: int | None = None
    """The longest sequence that fits at this micro-batch: activations grow with the tokens a rank holds (attention
    kernels keep no T×T matrix), everything else stays."""
    note: str = ""
    step: StepTime | None = None
    """Predicted seconds per optimizer step, by part (a plan made with the device's rates)."""
    accumulate: int = 1
    """Micro-batches per optimizer step it was planned with (``auto``'s tensor-parallel and pipeline layouts take
    more than the job's, to keep its global batch)."""
    tokens_per_step: int = 0
    """Tokens one optimizer step of the whole job consumes under this option."""
    worst_routing_peak: int = 0
    """Expert parallelism: ``peak`` on a rank whose experts the router sends every token it can (no capacity limit
    drops any): their activations ``model_stats.worst_routing`` times over. 0: no experts split."""

    @property
    def label(self) -> str:
        """The option's label as it runs at this accumulation: 1F1B with fewer micro-batches than stages runs
        GPipe (``PipelineRunner``), and the row is planned so."""
        return self.option.label_at(self.accumulate)

    def to_json(self) -> dict:
        o = self.option
        return {
            "strategy": o.strategy,
            "label": self.label,
            "sharding": o.model.sharding(o),
            "tensor_parallel_size": o.tensor,
            "context_parallel_size": o.context,
            "expert_parallel_size": o.get("experts") or 1,
            "sequence_parallel": o.get("sequence_parallel", False),
            "pipeline_stages": o.pipeline,
            "pipeline_schedule": o.get("schedule"),
            "semi_sync": o.get("semi_sync"),
            "sync_every": o.get("sync_every", 1),
            "activation_checkpointing": "all" if o.checkpoint is None else o.checkpoint,
            "offload": o.offload,
            "params_bytes": self.params,
            "grads_bytes": self.grads,
            "optimizer_bytes": self.optimizer,
            "activations_bytes": self.activations,
            "buffers_bytes": self.buffers,
            "peak_bytes": self.peak,
            "worst_routing_peak_bytes": self.worst_routing_peak or None,
            "host_bytes": self.host,
            "fits": self.fits,
            "max_micro_batch": self.max_micro_batch,
            "max_seq_len": self.max_seq_len,
            "note": self.note,
            "accumulate": self.accumulate,
            "step_seconds": self.step.seconds if self.step else None,
            "step_parts_seconds": (
                {
                    "compute": self.step.compute,
                    "optimizer": self.step.optimizer,
                    "communication": self.step.communication,
                }
                if self.step
                else None
            ),
        }
