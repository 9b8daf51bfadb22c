"""What strategies do to a model's layers: choose them (policies), recompute their activations
(activation checkpointing), mark them as sharded units (``wrap``), and build them (init contexts)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import torch
from torch import nn

from distrain import compat
from distrain.config import Refusal
from distrain.precision import default_dtype


def wrap(module: nn.Module) -> nn.Module:
    """Mark ``module`` as its own sharded unit (call inside ``configure_model``). Sharding
    strategies shard it separately; every other strategy ignores the mark."""
    module._distrain_wrap = True
    return module


def is_marked_unit(module: nn.Module) -> bool:
    return getattr(module, "_distrain_wrap", False)


def hidden_size_of(module: nn.Module) -> int | None:
    """The width the bucket-size rules of thumb scale with: HF's config.hidden_size, GPT's n_embd."""
    for m in module.modules():
        for holder in (getattr(m, "config", None), getattr(m, "cfg", None)):
            for key in ("hidden_size", "n_embd", "d_model"):
                value = getattr(holder, key, None)
                if isinstance(value, int):
                    return value
    return None


def block_classes(module: nn.Module) -> set[type]:
    """The model's repeated layer — what sharding strategies make their units, what activation checkpointing
    and per-block compilation select: distrain's ``block_class`` attribute, or transformers'
    ``_no_split_modules``. Empty when the model names none."""
    for m in module.modules():
        cls = getattr(m, "block_class", None)
        if isinstance(cls, type):
            return {cls}
    names = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    return {type(m) for m in module.modules() if type(m).__name__ in names}


def selected_layers(module: nn.Module, policy: Any) -> list[nn.Module]:
    """The layers a ``policy`` selects: a set of layer classes, a callable ``(module) -> bool``, or
    ``{"classes": {...}, "every_n": k}`` for every k-th matching layer (``"count": n``: only the
    first n of those, as the memory planner's ``activation_checkpointing: auto`` asks; ``"selective": True``: they
    recompute per operation, ``selective_recomputation``)."""
    if not policy:
        return []
    every_n, count = 1, None
    if isinstance(policy, dict):
        every_n = int(policy.get("every_n", 1))
        count = policy.get("count")
        if every_n < 1:
            raise ValueError(f"activation checkpointing every_n must be >= 1, got {every_n}")
        policy = policy["classes"]
    if is_fsdp1_policy(policy):
        return compat.fsdp1_policy_targets(module, policy)
    if callable(policy) and not isinstance(policy, type):
        return [m for m in module.modules() if policy(m)]
    classes = tuple(policy) if isinstance(policy, (set, list, tuple, frozenset)) else (policy,)
    matches = [m for m in module.modules() if isinstance(m, classes)]
    return [m for i, m in enumerate(matches) if i % every_n == 0][:count]


def is_fsdp1_policy(policy: Any) -> bool:
    """An FSDP1 ``auto_wrap_policy`` (as Lightning's FSDPStrategy takes): a torch ``_Policy`` (``ModuleWrapPolicy``),
    or a callable FSDP1 calls as ``policy(module=, recurse=, nonwrapped_numel=)`` (a ``functools.partial`` of
    ``transformer_auto_wrap_policy``...), not a ``(module) -> bool`` of distrain's."""
    from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

    if isinstance(policy, (ModuleWrapPolicy, CustomPolicy)):
        return True
    if not callable(policy) or isinstance(policy, type):
        return False
    try:
        inspect.signature(policy).bind(module=None, recurse=True, nonwrapped_numel=0)
    except (TypeError, ValueError):  # ValueError: no signature to read (a builtin)
        return False
    return True


def apply_activation_checkpointing(module: nn.Module, policy: Any, reentrant: bool = False) -> None:
    """Recompute the activations of the selected layers in backward (torch's non-reentrant
    checkpoint; ``reentrant=True``: the older reentrant one, as DeepSpeed's own works — the memory
    planner traces ZeRO runs with it). ``policy``: see ``selected_layers``."""
    if not policy:
        return
    api = compat.checkpoint_wrapper_api()
    chosen = {id(m) for m in selected_layers(module, policy)}
    impl = api.CheckpointImpl.REENTRANT if reentrant else api.CheckpointImpl.NO_REENTRANT
    selective = {}
    if is_selective(policy):
        if reentrant:  # DeepSpeed's own checkpointing, as the planner traces a ZeRO run
            raise Refusal(SELECTIVE_NOT_WITH_DEEPSPEED)
        selective = {"context_fn": selective_recomputation}
    wrapper = functools.partial(api.checkpoint_wrapper, checkpoint_impl=impl, **selective)
    api.apply_activation_checkpointing(module, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: id(m) in chosen)


#: selective recomputation runs under torch's non-reentrant checkpoint; DeepSpeed's own is reentrant
SELECTIVE_NOT_WITH_DEEPSPEED = (
    "selective activation checkpointing (training.activation_checkpointing_mode: selective) is not supported with "
    "DeepSpeed, whose activation checkpointing recomputes whole layers: use mode full"
)


def is_selective(policy: Any) -> bool:
    """The policy's layers recompute per operation (``{"selective": True}``), not whole."""
    return isinstance(policy, dict) and bool(policy.get("selective"))


#: kept by a selectively checkpointed layer beside torch's compute-intensive operations: attention on a CPU and
#: cuDNN's (torch's list has CUDA's flash and memory-efficient kernels), the absolute maximum float8 scales are
#: computed from, the experts' choice (``topk``: recomputed, a tie could route otherwise), and the collectives that
#: tensor and expert parallelism run inside a layer (recomputing them would communicate again). torchtitan's list
_ALSO_SAVED = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten.max.default,
    torch.ops.aten.topk.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_to_all_single.default,
}
#: the matmuls of which every second one is recomputed (torchtitan counts ``mm`` and ``linear``, its Llama having no
#: biases; a linear layer with a bias runs ``addmm``)
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.linear.default)


def selective_recomputation():
    """The contexts of one selectively checkpointed forward (``torch.utils.checkpoint``'s ``context_fn``): torchtitan's
    per-operation policy (``selective_ac_option = "op"``). The layer keeps the outputs of its compute-intensive
    operations (matmuls, attention, convolutions; ``compat.compute_intensive_ops`` and ``_ALSO_SAVED``) except every
    second matmul's, and recomputes the rest in backward: norms, activation functions, element-wise operations, every
    second matmul. A third to a half of a block's matmul FLOPs are done again (Llama's: 37%) and none of its
    attention, against all of both under full recomputation, for far less memory than keeping everything."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = compat.compute_intensive_ops() | _ALSO_SAVED
    matmuls = {False: 0, True: 0}  # counted apart in forward and in the recomputation, which must choose alike

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in _MATMULS:
            matmuls[ctx.is_recompute] += 1
            if matmuls[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_compile(
    module: nn.Module, options: bool | dict | None, per_block: bool, blocks: list[nn.Module] | None = None
) -> list[nn.Module]:
    """``torch.compile`` the model's compute: each transformer block (``per_block``, the torchtitan
    way for sharded strategies; a block's ``forward`` is one graph, reused by every block) or each
    network the module holds (the whole model, for single and DDP). Returns what was compiled.

    Only ``forward`` is compiled, in place: hooks on the module (FSDP's all-gather, activation
    checkpointing's wrapper, applied after this) stay outside the compiled region, and parameter
    names — hence checkpoints — do not change. ``options``: True, or ``torch.compile`` keyword
    arguments (``{"mode": "max-autotune"}``). ``blocks``: the blocks, where the strategy knows them (a pipeline's
    split, FSDP units marked with ``wrap``). Compilation itself happens at the first step."""
    if not options:
        return []
    kwargs = {} if options is True else dict(options)
    targets = (_blocks(module) if blocks is None else blocks) if per_block else []
    targets = targets or _networks(module)
    for target in targets:
        target.forward = torch.compile(target.forward, **kwargs)
    return targets


def _blocks(module: nn.Module) -> list[nn.Module]:
    classes = tuple(block_classes(module))
    return [m for m in module.modules() if classes and isinstance(m, classes)]


def _networks(module: nn.Module) -> list[nn.Module]:
    """The networks a distrain Module holds (its child modules with parameters), not the Module
    itself: ``training_step`` logs and keeps Python state that a graph should not capture. Any
    other module is compiled whole."""
    from distrain.module import Module

    inner = getattr(module, "module", None)  # the Trainer's step router around the user's Module
    if isinstance(inner, Module) and not isinstance(module, Module):
        module = inner
    if not isinstance(module, Module):
        return [module]
    return [child for child in module.children() if any(True for _ in child.parameters())]


def device_init_context(device: torch.device, dtype: torch.dtype | None, empty_init: bool | None):
    """Build directly on ``device`` (and in ``dtype``: a "true" precision's); ``empty_init=True`` skips the
    initializers, for weights about to be loaded anyway."""
    stack = contextlib.ExitStack()
    stack.enter_context(device)
    if dtype is not None:
        stack.enter_context(default_dtype(dtype))
    if empty_init:
        stack.enter_context(SkipInit())
    return stack


class SkipInit(torch.overrides.TorchFunctionMode):
    """Makes ``torch.nn.init.*`` no-ops: memory is allocated, nothing is written into it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs.get("tensor")
        return func(*args, **(kwargs or {}))
