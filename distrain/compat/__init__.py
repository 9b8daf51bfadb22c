"""Every private or version-sensitive call into torch, DeepSpeed and transformers, in one package: a module per
upstream (``torch``, ``deepspeed``, ``transformers``, ``torchao``), each function re-exported here.

Each function names what it relies on and the versions it was checked against; each has a test in
``tests/test_compat.py`` that exercises the real call, so an upgrade that moves one fails there,
by name, instead of deep inside a training run. Supported torch: see ``pyproject.toml``. The planner's own
private calls (fake tensors, memory trackers, the fake process group) are in ``distrain/planner/fake.py``, under
the same rule.
"""

from __future__ import annotations

from distrain.compat.deepspeed import (
    cpu_info_asked_once,
    deepspeed_forget_ended_groups,
    deepspeed_parsable_arch_list,
    deepspeed_to_universal,
    deepspeed_universal_loading,
    deepspeed_without_shm_op,
)
from distrain.compat.torch import (
    all_gather_differentiable,
    bf16_compress_hook_gloo,
    checkpoint_wrapper_api,
    compute_intensive_ops,
    default_store,
    flatten_mesh,
    fsdp1_policy_targets,
    is_fake,
    optimizer_load_options,
    plain_random_sampler,
    run_pipeline_schedule,
    set_group_timeouts,
    unwrapped_name,
)
from distrain.compat.torchao import DropImportNoise
from distrain.compat.transformers import (
    experts_gate,
    experts_grouped_forward,
    hf_causal_mask,
    transformers_no_init_weights,
)

__all__ = [
    "DropImportNoise",
    "all_gather_differentiable",
    "bf16_compress_hook_gloo",
    "checkpoint_wrapper_api",
    "compute_intensive_ops",
    "cpu_info_asked_once",
    "deepspeed_forget_ended_groups",
    "deepspeed_parsable_arch_list",
    "deepspeed_to_universal",
    "deepspeed_universal_loading",
    "deepspeed_without_shm_op",
    "default_store",
    "experts_gate",
    "experts_grouped_forward",
    "flatten_mesh",
    "fsdp1_policy_targets",
    "hf_causal_mask",
    "is_fake",
    "optimizer_load_options",
    "plain_random_sampler",
    "run_pipeline_schedule",
    "set_group_timeouts",
    "transformers_no_init_weights",
    "unwrapped_name",
]
