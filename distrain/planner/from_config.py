"""The job, memory budget and checkpointing a run's config plans for: what ``distrain plan`` and ``distrain train``
(``decide.py``) both read from a ``RunConfig``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distrain.planner.estimate import Job
from distrain.planner.model_stats import ModelSpec
from distrain.planner.models import models
from distrain.planner.plan import Budget
from distrain.strategies import registry

if TYPE_CHECKING:
    from distrain.config import RunConfig


def plans_for_gpu(config: RunConfig) -> bool:
    import torch

    accelerator = config.distributed.accelerator
    if accelerator in ("gpu", "cuda"):
        return True
    if accelerator == "cpu":
        return False
    return config.distributed.gpu_memory is not None or torch.cuda.is_available()


def ranks_per_node(config: RunConfig, gpu: bool) -> int:
    devices = config.distributed.devices
    if devices != "auto":
        return int(devices)
    import torch

    from distrain.accelerators import Accelerator, auto_device_count

    if gpu:
        if not torch.cuda.is_available():
            raise ValueError("planning for GPUs on a machine without one: give --devices (GPUs per node)")
        return torch.cuda.device_count()
    return auto_device_count(Accelerator())


def spec_from_config(config: RunConfig, job=None) -> ModelSpec:
    from distrain.models.gpt import GPT_SIZES, check_experts_key

    t, data = config.training, config.data
    check_experts_key(t)
    if t.model_name in GPT_SIZES:
        spec = ModelSpec.builtin_gpt(t.model_name, data.seq_len, n_experts=t.n_experts, top_k=t.top_k)
    elif hasattr(job, "hf_config"):  # the Hugging Face job has read the model's config and sized its data
        spec = ModelSpec.huggingface(t.model_name, job.data.max_length, job.task, t.num_labels, hf_config=job.hf_config)
    else:
        spec = ModelSpec.huggingface(t.model_name, data.max_length or data.seq_len, t.task, t.num_labels)
    spec = spec.with_low_precision_norms() if t.low_precision_norms else spec
    return spec.with_selective_checkpointing() if t.activation_checkpointing_mode == "selective" else spec


def job_from_config(config: RunConfig, gpu: bool, job=None) -> Job:
    t, d = config.training, config.distributed
    # ddp_torchft: replica_groups groups of `devices` ranks each, all on this machine; DDP over all of them
    per_node = ranks_per_node(config, gpu) * (d.replica_groups if registry.starts_replica_groups(d.strategy) else 1)
    return Job(
        spec=spec_from_config(config, job),
        micro_batch=t.batch_size_per_gpu,
        precision=t.precision,
        world_size=per_node * d.num_nodes,
        num_nodes=d.num_nodes,
        accumulate=t.gradient_accumulation_steps,
        clip=t.max_grad_norm or None,
        gpu=gpu,
        compile=bool(t.compile),
        gradient_as_bucket_view=d.gradient_as_bucket_view,
        configured={model.kinds[0]: said for model in models() if (said := model.from_config(config))},
        tensor_parallel=d.tensor_parallel_size,
        sequence_parallel=d.sequence_parallel,
        context_parallel=d.context_parallel_size,
        expert_parallel=d.expert_parallel_size,
        pipeline_stages=d.pipeline_stages,
        pipeline_schedule=d.pipeline_schedule,
        stages_per_rank=d.pipeline_stages_per_rank,
        split_points=d.pipeline_split_points,
        **(
            dict(
                replica_groups=d.replica_groups,
                semi_sync=d.semi_sync,
                sync_every=d.sync_every,
                outer_momentum=d.outer_momentum,
            )
            if registry.starts_replica_groups(d.strategy)
            else {}
        ),  # fmt: skip
    )


def activation_checkpointing_every(config: RunConfig) -> int | None:
    """Every how many blocks ``distrain train`` recomputes activations (1: every block); None: it does not. A
    strategy's section may ask for it (``activation_checkpointing_every``: the spec's
    ``activation_checkpointing.enabled`` in ``fsdp:`` with its ``every_n_layers``, a DeepSpeed JSON that says how
    activations are checkpointed), else ``training.activation_checkpointing: true`` asks for every block."""
    from distrain.config import sections

    for name in sections():
        every = getattr(getattr(config, name), "activation_checkpointing_every", lambda: None)()
        if every:
            return every
    return 1 if config.training.activation_checkpointing is True else None


def runs_activation_checkpointing(config: RunConfig) -> bool:
    """Whether ``distrain train`` recomputes activations (``activation_checkpointing_every``)."""
    return activation_checkpointing_every(config) is not None


def budget_from_config(config: RunConfig, gpu: bool, per_node: int) -> Budget:
    d = config.distributed
    return Budget.resolve(per_node, gpu=gpu, gpu_memory=d.gpu_memory, cpu_memory=d.cpu_memory)
