"""torch's private and version-sensitive calls: process groups and their store, DDP's comm hooks, checkpoint wrappers,
FSDP1-style wrap policies, device meshes, fake tensors, the pipelining schedule. Each names what it relies on and
the versions it was checked against; ``tests/test_compat.py`` exercises each for real
(``distrain/compat/__init__.py``)."""

from __future__ import annotations

import functools
import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("distrain")

# ---- torch.distributed ------------------------------------------------------------------------------


def default_store() -> dist.Store:
    """The default group's rendezvous store (the hang watch writes progress records into it).
    ``distributed_c10d._get_default_store``: checked on torch 2.13.0; torchtitan uses it too."""
    return dist.distributed_c10d._get_default_store()


def set_group_timeouts(timeout: timedelta) -> None:
    """The timeout of every process group this rank belongs to. torch has no public setter;
    ``_set_pg_timeout`` (checked on torch 2.13.0) is what torchtitan uses for the same purpose."""
    c10d = dist.distributed_c10d
    groups = [None] + [pg for pg in list(c10d._world.pg_map) if pg is not c10d._get_default_group()]
    for group in groups:
        try:
            c10d._set_pg_timeout(timeout, group)
        except (ValueError, RuntimeError, AssertionError) as e:  # not a member, or a backend without timeouts
            logger.debug("distrain: could not set the timeout of process group %s: %s", group, e)


def bf16_compress_hook_gloo(process_group, bucket):
    """torch's own bf16 compression hook, under a name DDP does not refuse on gloo: DDP rejects any
    hook *named* ``bf16_compress_hook`` unless NCCL is used, yet gloo all-reduces bf16 fine.
    ``default_hooks._compress_hook``: checked on torch 2.13.0."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def checkpoint_wrapper_api():
    """torch's activation-checkpoint wrappers (``checkpoint_wrapper``, ``apply_activation_checkpointing``,
    ``CheckpointImpl``) live in a private module path: checked on torch 2.13.0 (FSDP2 docs use it)."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper

    return checkpoint_wrapper


def fsdp1_policy_targets(root: torch.nn.Module, policy: Any) -> list[torch.nn.Module]:
    """The modules below ``root`` that FSDP1's ``auto_wrap_policy`` would wrap, found by FSDP1's own walk: torch's
    ``_recursive_wrap`` (a callable called as ``policy(module=, recurse=, nonwrapped_numel=)``, the remainder counting
    the parameters no wrapped child took: ``transformer_auto_wrap_policy``, ``size_based_auto_wrap_policy`` and
    ``lambda_auto_wrap_policy`` partials) with a "wrapper" that only records, or a ``_Policy``'s ``_run_policy``
    (``ModuleWrapPolicy``, ``CustomPolicy``). Both private in ``torch.distributed.fsdp.wrap``; checked on torch
    2.13.0, as Lightning's FSDPStrategy hands them to FSDP1."""
    from torch.distributed.fsdp import wrap

    if isinstance(policy, wrap._Policy):
        chosen = policy._run_policy(root, set(), {})
    else:
        chosen = []

        def record(module, **_):
            chosen.append(module)
            return module

        wrap._recursive_wrap(root, policy, record, set(), set(), only_wrap_children=True)
    return [m for m in root.modules() if m is not root and m in chosen]


@functools.cache  # asked at every selectively checkpointed forward; torch's list is fixed for the process
def compute_intensive_ops() -> frozenset:
    """The operations torch's partitioner counts as compute-intensive (matmuls, convolutions, the fused attention
    kernels of CUDA), whose outputs selective activation checkpointing keeps: ``torch._functorch.partitioners.
    get_default_op_list().compute_intensive_ops``, as torchtitan's selective checkpointing reads it. Checked on torch
    2.13.0."""
    from torch._functorch.partitioners import get_default_op_list

    return frozenset(op.default for op in get_default_op_list().compute_intensive_ops)


def unwrapped_name(name: str) -> str:
    """A parameter's name without what torch's wrappers insert: activation checkpointing's
    ``_checkpoint_wrapped_module.`` and ``torch.compile``'s ``_orig_mod.`` (checked on torch 2.13.0)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def optimizer_load_options(stored: dict, options):
    """``set_optimizer_state_dict`` with a full state dict asserts ("Expected device to be set", torch
    2.13.0) when the stored state holds no tensor at all — plain SGD, say. There is nothing to
    distribute then: load it as a local state dict (param groups by name). Decided on what was stored:
    a freshly built optimizer has no state yet, whatever it will hold."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    per_param = stored.get("state", {}).values() if isinstance(stored, dict) else []
    has_tensors = any(
        isinstance(v, torch.Tensor) and v.dim() > 0 for s in per_param if isinstance(s, dict) for v in s.values()
    )
    if options.full_state_dict and not has_tensors:
        return StateDictOptions(full_state_dict=False, strict=options.strict)
    return options


def plain_random_sampler(sampler: Any) -> bool:
    """A RandomSampler that is a plain shuffle (no replacement, no fixed ``num_samples``), which
    distrain can replace by its distributed sampler. ``RandomSampler._num_samples``: torch 2.13.0."""
    from torch.utils.data import RandomSampler

    return type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None


def flatten_mesh(mesh, name: str):
    """Several dimensions of a ``DeviceMesh`` as one (FSDP2 over data × context parallel ranks, torchtitan's
    ``dp_shard_cp``): ``DeviceMesh._flatten``, private in torch 2.13."""
    return mesh._flatten(name)


def all_gather_differentiable(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``dim``, with a backward that hands each rank its part's
    gradient (context parallelism: the whole sequence's logits). ``torch.distributed.nn.functional.all_gather``
    is deprecated for this functional collective (torch 2.13)."""
    from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

    return wait_tensor(all_gather_single_autograd(tensor.contiguous(), dim, group))


# ---- fake tensors ------------------------------------------------------------------------------------


def is_fake(tensor: torch.Tensor) -> bool:
    """A tensor of ``FakeTensorMode`` (also inside a DTensor): no values. ``torch._subclasses.fake_tensor.is_fake``:
    checked on torch 2.13.0."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return _is_fake(getattr(tensor, "_local_tensor", tensor))


# ---- torch.distributed.pipelining -----------------------------------------------------------------------------
# Checked against torch 2.13.0.


def run_pipeline_schedule(schedule, stages, arg_mbs, kwarg_mbs, target_mbs, backward: bool) -> None:
    """One step of a pipelining schedule over micro-batches we made ourselves. The public ``step(batch)``
    splits one whole batch into equal chunks; a Trainer's micro-batches are already made (and may be
    dicts, or differ in length). So this is what ``step()`` does around ``_step_microbatches`` in torch
    2.13.0 (``_PipelineSchedule.eval`` sets ``_has_backward`` the same way): set ``has_backward`` on the
    schedule and its stages, clear each stage's per-step state, run the micro-batch lists."""
    schedule._has_backward = backward
    for stage in stages:
        stage.has_backward = backward
        stage.clear_runtime_states()
    schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, None, return_outputs=False)
