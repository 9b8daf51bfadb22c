"""Every private or version-sensitive call into torch, DeepSpeed and transformers, in one place.

Each function names what it relies on and the versions it was checked against; each has a test in
``tests/test_compat.py`` that exercises the real call, so an upgrade that moves one fails there,
by name, instead of deep inside a training run. Supported torch: see ``pyproject.toml``. The planner's own
private calls (fake tensors, memory trackers, the fake process group) are in ``distrain/planner/fake.py``, under
the same rule.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Callable
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


# ---- DeepSpeed ----------------------------------------------------------------------------------------
# Checked against deepspeed 0.19.8.


@contextlib.contextmanager
def deepspeed_without_shm_op():
    """``deepspeed.init_distributed`` on CPU JIT-loads its shared-memory all-reduce op
    (``deepspeed_shm_comm``), which only its inference all-reduce uses. Each load takes torch's file
    lock in ~/.cache/torch_extensions; a rank killed inside that window leaves the lock behind, and
    every later DeepSpeed run on the machine waits on it forever. Training never uses the op: mark it
    incompatible for the call (``deepspeed.ops.__compatible_ops__``, read by
    ``deepspeed.comm.torch.build_shm_op``: deepspeed 0.19.8)."""
    import deepspeed.ops

    ops = deepspeed.ops.__compatible_ops__
    before = ops.get("deepspeed_shm_comm")
    ops["deepspeed_shm_comm"] = False
    try:
        yield
    finally:
        if before is None:
            ops.pop("deepspeed_shm_comm", None)
        else:
            ops["deepspeed_shm_comm"] = before


#: an entry of ``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's op builder parses it: major.minor, maybe +PTX
_PLAIN_ARCH = re.compile(r"^\d+\.\d+(\+PTX)?$")
#: an entry with an architecture variant ("9.0a": Hopper's, "10.0f": Blackwell's family), as torch and images write it
_VARIANT_ARCH = re.compile(r"^(\d+\.\d+)[a-z]+(\+PTX)?$")


@contextlib.contextmanager
def deepspeed_parsable_arch_list():
    """DeepSpeed's JIT op builder (``CUDAOpBuilder.compute_capability_args``, deepspeed 0.19.8; deepspeedai/DeepSpeed
    PR #8619, open) parses each ``TORCH_CUDA_ARCH_LIST`` entry's numbers with ``int()``, so an architecture variant
    ("9.0a", which Hopper images set) kills the build of FusedAdam and CPU Adam before anything compiles, and ZeRO
    ran with torch's AdamW without a word. For the build only, each such entry becomes its plain number ("9.0a" →
    "9.0": what these ops need); an entry neither form reads, and an empty list, become the devices' capabilities.
    The variable is given back as it was afterwards. A list DeepSpeed parses is left alone."""
    import os

    raw = os.environ.get("TORCH_CUDA_ARCH_LIST")
    entries = [e.strip() for e in (raw or "").replace(" ", ";").split(";") if e.strip()]
    if raw is None or all(_PLAIN_ARCH.match(e) for e in entries):
        yield
        return
    plain = [f"{m[1]}{m[2] or ''}" for m in map(_VARIANT_ARCH.match, entries) if m is not None]
    plain += [e for e in entries if _PLAIN_ARCH.match(e)]
    if not plain or len(plain) < len(entries):
        plain = [f"{a}.{b}" for a, b in map(torch.cuda.get_device_capability, range(torch.cuda.device_count()))]
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(dict.fromkeys(plain))
    try:
        yield
    finally:
        os.environ["TORCH_CUDA_ARCH_LIST"] = raw


#: ``deepspeed.utils.groups``' module globals that hold process groups, and their values before any is made
_DEEPSPEED_GROUP_GLOBALS = {
    **dict.fromkeys(("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP"), None),
    **dict.fromkeys(("_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "mpu", "mesh_device"), None),
    **dict.fromkeys(("_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK"), None),
    **dict.fromkeys(("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"), dict),
    **dict.fromkeys(("_EXPERT_DATA_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP_RANKS"), dict),
}


def deepspeed_forget_ended_groups() -> bool:
    """DeepSpeed keeps the process groups it makes (its copy of the world group, ZeRO's, the experts') in module
    globals of ``deepspeed.utils.groups`` for the life of the process (deepspeed 0.19.8). When the process group
    they were made from has ended and another begun in the same process (a second run after one that ended its
    group: distrain verify's cells sharing their ranks, a notebook), the next engine broadcasts over a destroyed
    group: "Group ... is not registered". Before an engine is made, if any of them belongs to no live group
    (``distributed_c10d._world.pg_map``, torch 2.13.0), all of them are forgotten, and DeepSpeed makes them again.
    True when it forgot."""
    from deepspeed.utils import groups

    live = dist.distributed_c10d._world.pg_map

    def ended(value) -> bool:
        if isinstance(value, dict):
            return any(ended(v) for v in value.values())
        return isinstance(value, dist.ProcessGroup) and value not in live

    if not any(ended(getattr(groups, name, None)) for name in _DEEPSPEED_GROUP_GLOBALS):
        return False
    for name, initial in _DEEPSPEED_GROUP_GLOBALS.items():
        setattr(groups, name, initial() if initial is dict else initial)
    return True


def cpu_info_asked_once() -> None:
    """py-cpuinfo's ``get_cpu_info()`` answers from a new Python process on every call (about 1 s on this machine's
    2 cores, more when they are busy), and DeepSpeed asks it for each CPU Adam it builds and for each op it checks
    (``deepspeed.ops.adam.cpu_adam``, ``op_builder.builder``: three or four times as an offloaded run starts, on every
    rank). The answer does not change while a process lives: kept after the first call. DeepSpeed imports the
    function where it calls it (deepspeed 0.19.8), so the module's attribute is the one to replace."""
    try:
        import cpuinfo
    except ImportError:
        return
    if getattr(cpuinfo.get_cpu_info, "asked_once", False):
        return
    import copy
    import functools

    first = functools.cache(cpuinfo.get_cpu_info)

    def get_cpu_info() -> dict:
        return copy.deepcopy(first())  # each caller its own copy, as from the real function

    get_cpu_info.asked_once = True
    cpuinfo.get_cpu_info = get_cpu_info


@contextlib.contextmanager
def deepspeed_universal_loading(engine):
    """Load the next checkpoint in DeepSpeed's universal format (resharded to this world size).
    The switch is the engine config's ``load_universal_checkpoint`` (deepspeed 0.19.8); DeepSpeed
    reads it on each ``load_checkpoint``."""
    engine._config.load_universal_checkpoint = True
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = False


def deepspeed_to_universal(input_folder: str, output_folder: str) -> None:
    """DeepSpeed's ``ds_to_universal`` converter, called as its command line would (it has no
    function API): deepspeed 0.19.8."""
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    args = Namespace(
        input_folder=input_folder,
        output_folder=output_folder,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )  # the version record Megatron clients write
    with contextlib.redirect_stdout(None):
        ds_to_universal.main(args)


# ---- transformers ---------------------------------------------------------------------------------------
# Checked against transformers 5.23.


def experts_grouped_forward(experts: Any) -> Callable[..., Any] | None:
    """transformers' own grouped-matmul forward of an experts module built with ``use_experts_implementation``
    (``integrations.moe.grouped_mm_experts_forward``, transformers 5.25: ``forward(self, hidden_states,
    top_k_index, top_k_weights)``), which computes every layout the decorator's flags declare (transposed, biased,
    interleaved, without a gate, normed after each expert); None for a module built without it."""
    if not hasattr(experts, "is_transposed") or not isinstance(getattr(experts, "num_experts", None), int):
        return None
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward


def experts_gate(experts: Any) -> Callable[[Any], Any] | None:
    """A Hugging Face experts module's own gating of its ``gate_up_proj`` output, where it has one: clamps (DeepSeek
    V4), softcaps and two-argument activations (Inkling 2). ``_apply_gate``, private in transformers 5.25, is what its
    grouped-matmul backends call too; None where the module has none (``act_fn(gate) * up``)."""
    gate = getattr(experts, "_apply_gate", None)
    return gate if callable(gate) else None


def transformers_no_init_weights():
    """Build a model without running its initializers (``transformers.initialization.no_init_weights``
    in 5.x)."""
    from transformers.initialization import no_init_weights

    return no_init_weights()


# ---- torchao (precision="fp8") ------------------------------------------------------------------------------
class DropImportNoise(logging.Filter):
    """torchao 0.18 on a CPU build of torch: importing it (transformers does, for any model) warns that its
    CUDA kernels cannot load and makes torch warn about its enum registrations. Neither says anything a
    user can act on; only these two messages are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cpu_kernels = message.startswith("Failed to load") and ".so" in message and not torch.cuda.is_available()
        return not (cpu_kernels or "is an Enum subclass and is now natively supported by torch.compile" in message)


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


# ---- transformers (pipeline stages of Llama-style models) -----------------------------------------------------------
def hf_causal_mask(config, inputs_embeds, attention_mask, position_ids):
    """The causal (and padding) mask a Llama-style model builds in its forward, for a pipeline stage that
    runs some of its layers: ``transformers.masking_utils.create_causal_mask(config, inputs_embeds,
    attention_mask, past_key_values, position_ids)`` (transformers 5.4+, pyproject's floor: 5.0–5.3 name the
    embeddings ``input_embeds`` and need ``cache_position``; may return None for SDPA's own causal path)."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    # no cache: named ``cache`` since transformers 5.2x (``past_key_values`` is deprecated there, and warns)
    no_cache = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
    return create_causal_mask(
        config=config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        position_ids=position_ids,
        **{no_cache: None},
    )
