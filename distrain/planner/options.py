"""What a plan is made of: the ways to train (``Option``) and what each holds per rank (``Row``)."""

from __future__ import annotations

from dataclasses import dataclass

from distrain.planner.models import model_of
from distrain.planner.timing import StepTime

#: Row fields that are bytes (extrapolated and interpolated)
_BYTE_FIELDS = ("params", "grads", "optimizer", "activations", "buffers", "peak", "host", "sharded")


@dataclass(frozen=True)
class Option:
    """One way to train: a strategy with its sharding, activation checkpointing and offload."""

    family: str
    """The kind of option, which names the cost model that prices it (``planner/models/``): ``single``, ``ddp``,
    ``fsdp``, ``zero``, ``tp`` (tensor parallel; FSDP over the remaining ranks), ``cp`` (context parallel, each
    sequence split over ``context`` ranks, optionally × ``tensor``; FSDP over data × context), ``pp`` (pipeline
    stages; FSDP over the remaining ranks), or a plug-in's own."""
    sharding: str | None = None
    """FSDP: FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD; ``tp``: FULL_SHARD when FSDP shards over the
    data-parallel ranks (the ranks beyond ``tensor``), else None."""
    stage: int | None = None
    """ZeRO stage."""
    checkpoint: int | None = 0
    """Blocks whose activations are recomputed: 0 none, ``None`` every block."""
    offload: str = "none"
    """``none``, ``cpu`` or ``nvme``: where sharded state (ZeRO: optimizer, and parameters at stage 3) lives."""
    tensor: int = 1
    """Ranks that split each layer (``tp``)."""
    sequence_parallel: bool = False
    """``tp``: the norms and the residual stream split along the sequence too."""
    context: int = 1
    """Ranks that split each sequence (``cp``)."""
    pipeline: int = 1
    """Pipeline ranks (``pp``)."""
    schedule: str | None = None
    """``pp``: 1F1B, GPipe or Interleaved1F1B."""
    stages_per_rank: int = 1
    """``pp``: stages each pipeline rank runs (Interleaved1F1B's virtual stages)."""
    semi_sync: str | None = None
    """``ddp`` of replica groups (``ddp_torchft``): ``local_sgd`` or ``diloco``, the groups meeting every
    ``sync_every`` steps instead of averaging gradients every step."""
    sync_every: int = 1

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
        if self.semi_sync:
            parts.append(f"{self.semi_sync} every {self.sync_every} steps")
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
        if self.semi_sync:
            base += f" {self.semi_sync}/{self.sync_every}"
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
            "sequence_parallel": o.sequence_parallel,
            "pipeline_stages": o.pipeline,
            "pipeline_schedule": o.schedule,
            "semi_sync": o.semi_sync,
            "sync_every": o.sync_every,
            "activation_checkpointing": "all" if o.checkpoint is None else o.checkpoint,
            "offload": o.offload,
            "params_bytes": self.params,
            "grads_bytes": self.grads,
            "optimizer_bytes": self.optimizer,
            "activations_bytes": self.activations,
            "buffers_bytes": self.buffers,
            "peak_bytes": self.peak,
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
