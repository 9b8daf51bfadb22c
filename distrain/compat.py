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


# ---- ring attention (torch.distributed.tensor.experimental._context_parallel) ----------------------------------
# Checked against torch 2.13.0.


def ring_attention(query, key, value, group, scale: float | None = None, balanced: bool = True):
    """Causal attention of this rank's slice of a sequence against the whole sequence, the key/value slices passed
    around the ``group`` (ring attention). ``query``/``key``/``value``: ``[batch, heads, local tokens, head_dim]``,
    the same heads on every rank. ``balanced``: the rank holds chunks ``r`` and ``2N-1-r`` of ``2N`` (torch's
    round-robin layout, which evens out the causal work); else one contiguous slice, chunk ``r`` of ``N``.

    torch runs ring attention inside its DTensor dispatcher (``context_parallel``), on CUDA kernels only. Its
    forward and backward are ``_templated_ring_attention`` and ``_templated_ring_attention_backward``, generic over
    the attention kernel (``_context_parallel._attention``, torch 2.13.0): here they run under an autograd function
    of our own, with CUDA's memory-efficient kernel (any dtype) or, on a CPU, ``_scaled_dot_product_flash_attention
    _for_cpu`` and its backward, so the same ring is tested on gloo (``tests/test_context_parallel.py``: it needs
    ranks). The layout flag the templates read (``_cp_options.enable_load_balance``) is set for the call only.

    Context parallelism's ring engine (``SequenceShard``, for heads that Ulysses cannot split) calls it."""
    return _RingAttention.apply(query, key, value, group, scale, balanced)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, group, scale, balanced):
        kernel = _RingKernel.of(query, scale)
        with _ring_layout(balanced) as ring:
            out, lse, *rest = ring._templated_ring_attention(
                group, 2, kernel.forward, query, key, value, is_causal=True, **kernel.forward_kwargs
            )
        ctx.save_for_backward(query, key, value, out, lse, *rest)
        ctx.group, ctx.kernel, ctx.balanced = group, kernel, balanced
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, *rest = ctx.saved_tensors
        kernel = ctx.kernel
        with _ring_layout(ctx.balanced) as ring:
            grads = ring._templated_ring_attention_backward(
                ctx.group,
                2,
                kernel.backward,
                grad_out=grad_out.contiguous(),
                query=query,
                key=key,
                value=value,
                out=out,
                logsumexp=lse,
                is_causal=True,
                **kernel.backward_kwargs(rest),
            )
        return grads[0], grads[1], grads[2], None, None, None


class _RingKernel:
    """The attention kernel the ring runs on the query's device, with its schema's keywords: CUDA's
    memory-efficient kernel (fp32, bf16 and fp16 alike), else the CPU flash kernel. No dropout."""

    def __init__(self, forward, backward, forward_kwargs: dict, backward_kwargs: dict, philox: bool):
        self.forward, self.backward, self.forward_kwargs = forward, backward, forward_kwargs
        self._backward_kwargs, self._philox = backward_kwargs, philox

    @classmethod
    def of(cls, query, scale: float | None) -> _RingKernel:
        aten = torch.ops.aten
        common = {"dropout_p": 0.0, "scale": scale}
        if query.device.type == "cuda":  # the ring merges log-sum-exps, so the kernel always computes them
            return cls(
                aten._scaled_dot_product_efficient_attention,
                aten._scaled_dot_product_efficient_attention_backward.default,
                {**common, "attn_bias": None, "compute_log_sumexp": True},
                {
                    **common,
                    "grad_out_name": "grad_out_",
                    "attn_bias": None,
                    "grad_input_mask": (True, True, True, False),
                },
                philox=True,
            )
        return cls(
            aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            common,
            {**common, "grad_out_name": "grad_out"},
            philox=False,
        )

    def backward_kwargs(self, rest: list) -> dict:
        """``rest``: what the forward kernel returned beyond the output and its log-sum-exp (CUDA's philox seed and
        offset, which its backward takes back)."""
        if not self._philox:
            return self._backward_kwargs
        return {**self._backward_kwargs, "philox_seed": rest[0], "philox_offset": rest[1]}


@contextlib.contextmanager
def _ring_layout(balanced: bool):
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    before = ring._cp_options.enable_load_balance
    ring._cp_options.enable_load_balance = balanced
    try:
        yield ring
    finally:
        ring._cp_options.enable_load_balance = before


# ---- torch.distributed.pipelining -----------------------------------------------------------------------------
# Checked against torch 2.13.0.


def pipeline_stage(module, stage_index: int, num_stages: int, device, group):
    """A ``PipelineStage`` (public) whose shapes are learned from the first micro-batch at run time."""
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage(module, stage_index, num_stages, device, group=group)


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
