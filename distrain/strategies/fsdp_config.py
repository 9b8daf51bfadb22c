"""The ``fsdp:`` section of a run's config: FSDPStrategy's keys, declared by this package (``pyproject.toml``, the
``distrain.config`` entry point group) as a plug-in's would be. Kept apart from ``fsdp.py`` so that listing the
keys (``distrain config``) needs no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from distrain.config import number


@dataclass
class ActivationCheckpointingConfig:
    enabled: bool = False
    every_n_layers: int = number(1, gt=0)


@dataclass
class MixedPrecisionConfig:
    """dtype names (bf16, fp16, fp32); null → from ``training.precision`` (reduction in fp32)."""

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    buffer_dtype: str | None = None


@dataclass
class FSDPConfig:
    """Used when ``distributed.strategy`` is ``fsdp``/``fsdp_cpu_offload``. FSDP1 names, mapped to FSDP2."""

    #: where the spec's FSDP file puts these keys → where they live here. That file lost its indentation, so its
    #: activation_checkpointing/mixed_precision sections may stand at the top level or under fsdp:; both land in
    #: this section (``config.map_spec_keys`` applies them in order: a section first, then its renamed keys).
    spec_keys: ClassVar[dict[str, str]] = {
        "activation_checkpointing": "fsdp.activation_checkpointing",
        "mixed_precision": "fsdp.mixed_precision",
        "fsdp.activation_checkpointing.checkpoint_every_n_layers": "fsdp.activation_checkpointing.every_n_layers",
    }

    sharding_strategy: str = "FULL_SHARD"
    """FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD."""
    cpu_offload: bool = False
    backward_prefetch: str | None = "BACKWARD_PRE"
    """FSDP2 always prefetches in backward (BACKWARD_PRE); other values are explained, not applied."""
    forward_prefetch: bool = False
    auto_wrap_policy: str | None = "transformer_based"
    """``transformer_based`` (the model's block class), ``size_based`` (min_num_params) or null (root only)."""
    min_num_params: int = number(1_000_000, gt=0)
    """size_based: wrap (shard as one unit) each module of at least this many parameters."""
    use_orig_params: bool = True
    sync_module_states: bool = True
    """A model built in __init__ (not on the meta device) starts from rank 0's weights on every rank, as under DDP."""
    sync_each_micro_batch: bool = False
    """With gradient accumulation: reduce-scatter after every micro-batch, so that each rank holds only its shard
    of the gradients between them (not the whole model's unsharded ones), for one reduce-scatter per micro-batch."""
    state_dict_type: str = "sharded"
    """``sharded`` (each rank writes its shards, DCP) or ``full`` (gathered to rank 0, on CPU)."""
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)

    def activation_checkpointing_every(self) -> int | None:
        """The spec's ``activation_checkpointing.enabled``: blocks recomputed (every ``every_n_layers``-th),
        whatever the strategy; None when not enabled."""
        ac = self.activation_checkpointing
        return ac.every_n_layers if ac.enabled else None
