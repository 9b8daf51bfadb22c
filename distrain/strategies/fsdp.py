"""Fully sharded data parallel on FSDP2 (``fully_shard``, DTensor parameters).

Parameters, gradients and optimizer state are split across ranks; each wrapped layer
all-gathers its parameters just before use and frees them after. The order of set-up matters:
activation checkpointing wraps layers first (so recomputation happens inside the sharded unit),
then every selected layer is sharded, then the root (which owns what is left: embeddings, head).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distrain.checkpoint import state as ckpt_state
from distrain.config import ConfigError
from distrain.parallel import expert_parallel
from distrain.strategies import sharded_init
from distrain.strategies.base import Strategy, Traits, checked_start_method
from distrain.strategies.layers import (
    apply_activation_checkpointing,
    apply_compile,
    block_classes,
    is_fsdp1_policy,
    is_marked_unit,
    selected_layers,
)
from distrain.strategies.registry import register

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


class FSDPStrategy(Strategy):
    """FSDP1-style option names, mapped onto FSDP2:

    - ``FULL_SHARD``: reshard parameters after forward (ZeRO-3); ``SHARD_GRAD_OP``: keep them
      gathered between forward and backward (ZeRO-2-like); ``NO_SHARD``: replicate (a 2-D mesh
      with shard size 1); ``HYBRID_SHARD``: shard within a node, replicate across nodes.
    - ``auto_wrap_policy``: a set of layer classes, a callable ``(module) -> bool``, or an int
      (min parameters per wrapped unit); or FSDP1's, as Lightning's FSDPStrategy takes them (``ModuleWrapPolicy``,
      ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``, ``size_based_...``),
      each choosing the modules FSDP1 would wrap. Default: the module's ``block_class`` if it has one.
    - ``activation_checkpointing``: Lightning's older form of ``activation_checkpointing_policy``, a layer class or
      a list of them. ``limit_all_gathers`` (FSDP1's): FSDP2 has no CPU rate limit to set; False says so.
    - ``mixed_precision``: ``MixedPrecisionPolicy`` or a dict of param/reduce/buffer dtypes;
      default from the Trainer's precision, with fp32 gradient reduction.
    - ``sync_each_micro_batch``: with gradient accumulation, reduce-scatter the gradients after every
      micro-batch (as torchtitan and FSDP1 do) instead of once per step. Each rank then holds only its shard of
      the gradients, not the whole model's unsharded ones between micro-batches, for one reduce-scatter more per
      micro-batch (HF Accelerate's ``sync_each_batch``).
    - ``expert_parallel_size``: ranks that split each mixture-of-experts layer's experts
      (``distrain.parallel.expert_parallel``); each layer's experts are then sharded over the ranks that hold the
      same ones, the rest of the model over every rank.
    """

    start_method = "popen"
    #: forwards all-gather the sharded parameters; precision="fp8": weights travel in float8 (torchao)
    traits = Traits(collective_forward=True, float8_all_gather=True)

    def __init__(
        self,
        sharding_strategy: str = "FULL_SHARD",
        cpu_offload: bool = False,
        auto_wrap_policy: Any = None,
        activation_checkpointing_policy: Any = None,
        mixed_precision: Any = None,
        state_dict_type: str = "sharded",
        device_mesh: Any = None,
        forward_prefetch: bool = False,
        backward_prefetch: str | None = "BACKWARD_PRE",
        use_orig_params: bool = True,
        sync_module_states: bool = True,
        sync_each_micro_batch: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | float = timedelta(minutes=30),
        start_method: str = "popen",
        collective_timeout: timedelta | float | None = timedelta(minutes=5),
        expert_parallel_size: int = 1,
        activation_checkpointing: Any = None,
        limit_all_gathers: bool = True,
    ):
        if activation_checkpointing is not None:
            if activation_checkpointing_policy is not None:
                raise ValueError(
                    "FSDPStrategy: set activation_checkpointing_policy or activation_checkpointing (its older "
                    "form), not both"
                )
            classes = activation_checkpointing
            activation_checkpointing_policy = set(classes) if isinstance(classes, (list, tuple, set)) else {classes}
        super().__init__(process_group_backend, timeout, activation_checkpointing_policy, collective_timeout)
        self.expert_parallel_size = expert_parallel.check_size(expert_parallel_size)
        if sharding_strategy not in SHARDING_STRATEGIES:
            raise ValueError(
                f"sharding_strategy must be one of {', '.join(SHARDING_STRATEGIES)}, got {sharding_strategy!r}"
            )
        if state_dict_type not in ("sharded", "full"):
            raise ValueError(f"state_dict_type must be 'sharded' or 'full', got {state_dict_type!r}")
        self.start_method = checked_start_method(start_method)
        self.sharding_strategy = sharding_strategy
        self.cpu_offload = cpu_offload
        self.auto_wrap_policy = auto_wrap_policy
        self.mixed_precision = mixed_precision
        self.state_dict_type = state_dict_type
        self.device_mesh = device_mesh
        self.forward_prefetch = forward_prefetch
        self.sync_module_states = sync_module_states
        self.sync_each_micro_batch = sync_each_micro_batch
        self._deferred = sharded_init.DeferredBuild()  # configure_model's meta build, initialized at set-up
        self._explain_fsdp1_options(backward_prefetch, use_orig_params, limit_all_gathers)

    @staticmethod
    def _explain_fsdp1_options(backward_prefetch, use_orig_params, limit_all_gathers) -> None:
        # FSDP2 has no switch for these; say what happens instead of silently dropping them.
        if not limit_all_gathers:
            warnings.warn(
                "limit_all_gathers=False: FSDP2 keeps its all-gathers in flight by its own streams, with no CPU "
                "rate limit to turn off (limit_all_gathers is FSDP1's)",
                stacklevel=3,
            )
        if backward_prefetch not in (None, "BACKWARD_PRE"):
            warnings.warn(
                f"backward_prefetch={backward_prefetch!r}: FSDP2 always prefetches the next layer's "
                "all-gather in backward (the BACKWARD_PRE behaviour); the option has no other setting",
                stacklevel=3,
            )
        if not use_orig_params:
            warnings.warn(
                "use_orig_params=False: FSDP2 always exposes the original parameters (as DTensors)", stacklevel=3
            )

    @property
    def backend(self) -> str:
        """As ``Strategy.backend``; with ``cpu_offload`` on CUDA and no backend given, ``cpu:gloo,cuda:nccl``."""
        # offloaded gradients live on the CPU: clipping reduces them there, which needs gloo
        if self.process_group_backend is None and self.cpu_offload and self.accelerator.name == "cuda":
            return "cpu:gloo,cuda:nccl"
        return super().backend

    # ---- set-up ----------------------------------------------------------------------------
    def module_init_context(self, empty_init: bool | None = None):
        """configure_model builds on the meta device: no rank ever holds the whole model. Set-up then
        initializes it shard by shard to exactly the weights a one-process build would have
        (``sharded_init``), from the RNG state recorded here; ``empty_init=True`` skips that (for
        weights about to be loaded)."""
        if empty_init is False:
            return super().module_init_context(empty_init)
        return self._deferred.context(empty_init)

    def _mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        if self.device_mesh is not None:
            if isinstance(self.device_mesh, tuple):
                return init_device_mesh(self.root_device.type, self.device_mesh, mesh_dim_names=("replicate", "shard"))
            return self.device_mesh
        world = self.world_size
        if self.sharding_strategy == "NO_SHARD":
            return init_device_mesh(self.root_device.type, (world, 1), mesh_dim_names=("replicate", "shard"))
        if self.sharding_strategy == "HYBRID_SHARD":
            per_node = world // self.num_nodes
            return init_device_mesh(
                self.root_device.type, (self.num_nodes, per_node), mesh_dim_names=("replicate", "shard")
            )
        return init_device_mesh(self.root_device.type, (world,), mesh_dim_names=("shard",))

    def _mp_policy(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mp = self.mixed_precision
        if isinstance(mp, MixedPrecisionPolicy):
            return mp
        default_param = self.precision.gathered_param_dtype
        if isinstance(mp, dict):
            dt = {k: _DTYPES[v] if isinstance(v, str) else v for k, v in mp.items() if v is not None}
            if dt.get("buffer_dtype", torch.float32) != torch.float32:
                warnings.warn(
                    "mixed_precision.buffer_dtype: FSDP2 does not cast buffers; they keep the dtype "
                    "the model gives them (set it in the model, or use precision='bf16-true')",
                    stacklevel=2,
                )
            return MixedPrecisionPolicy(
                param_dtype=dt.get("param_dtype", default_param), reduce_dtype=dt.get("reduce_dtype", torch.float32)
            )
        return MixedPrecisionPolicy(param_dtype=default_param, reduce_dtype=torch.float32 if default_param else None)

    def _wrap_selector(self, module: nn.Module) -> Callable[[nn.Module], bool]:
        policy = self.auto_wrap_policy
        if policy is None:
            policy = block_classes(module) or None
        if policy is None:
            return lambda m: False
        if isinstance(policy, int):
            return lambda m: (
                m is not module
                and sum(p.numel() for p in m.parameters()) >= policy
                and not any(sum(p.numel() for p in c.parameters()) >= policy for c in m.children())
            )
        if is_fsdp1_policy(policy):  # FSDP1's, walked as FSDP1 walks it
            chosen = {id(m) for m in selected_layers(module, policy)}
            return lambda m: id(m) in chosen
        if callable(policy) and not isinstance(policy, type):
            return policy
        classes = tuple(policy) if isinstance(policy, (set, list, tuple, frozenset)) else (policy,)
        return lambda m: isinstance(m, classes)

    def _setup_module(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

        if isinstance(module, FSDPModule):  # sharded by an earlier stage (a fit after Tuner.lr_find, a second fit)
            return module
        module = self.precision.convert_module(module)
        on_meta = built_on_meta(module)
        if not on_meta:
            module = module.to(self.root_device)
            if self.sync_module_states:
                for t in [*module.parameters(), *module.buffers()]:
                    dist.broadcast(t.data, src=0)
        self._split_experts(
            module
        )  # on the meta device too: this rank's rows of each layer's experts, initialized below
        apply_compile(module, self.compile, per_block=True)  # each block, before AC and sharding (torchtitan)
        apply_activation_checkpointing(module, self.activation_checkpointing_policy)
        mesh = self._mesh()
        kwargs = dict(
            mesh=mesh,
            reshard_after_forward=self.sharding_strategy not in ("SHARD_GRAD_OP", "NO_SHARD"),
            mp_policy=self._mp_policy(),
            shard_placement_fn=few_rows_by_columns(mesh.size(mesh.ndim - 1)),
        )
        if self.cpu_offload:
            # pinned memory needs an accelerator: on a CPU-only machine it fails at set-up
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        if self.experts is not None:
            shard_experts(self.experts, fully_shard, kwargs)
        selected = self._wrap_selector(module)
        units = [m for m in module.modules() if m is not module and (selected(m) or is_marked_unit(m))]
        for unit in reversed(units):  # innermost first, so nested units own their own params
            fully_shard(unit, **kwargs)
        fully_shard(module, **kwargs)
        if self.forward_prefetch and len(units) > 1:
            for this, nxt in zip(units, units[1:]):
                this.set_modules_to_forward_prefetch([nxt])
        rng, skip_init = self._deferred.take()
        if on_meta:
            module.to_empty(device=torch.device("cpu") if self.cpu_offload else self.root_device)
            if not skip_init:
                unit_of = sharded_init.units_of_parameters(module, list(reversed(units)))
                access = sharded_init.dtensor_shards_and_expert_rows(self.root_device, self.experts)
                #: the most bytes of full-size temporaries initialization held at once (one unit at most)
                self.init_peak_bytes = sharded_init.replay_initialization(module, rng, access, unit_of)
            for sub in module.modules():  # offloading moves parameters only: buffers live on the device
                for name, buf in sub.named_buffers(recurse=False):
                    sub._buffers[name] = buf.to(self.root_device)
        return module

    # ---- the step ----------------------------------------------------------------------------
    def no_backward_sync(self, module: nn.Module, enabled: bool = True):
        """Accumulate unsharded local gradients: no reduce-scatter until the last micro-step (unless
        ``sync_each_micro_batch``: then every micro-step reduce-scatters into the sharded gradients)."""
        if not enabled or self.sync_each_micro_batch or not hasattr(module, "set_requires_gradient_sync"):
            return contextlib.nullcontext()
        return gradient_sync_off(module)

    def reduce_dtype(self, model: nn.Module, module: nn.Module) -> torch.dtype:
        return live_reduce_dtype(model) or super().reduce_dtype(model, module)

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, path, state: dict[str, Any], background: bool = False):
        if self.state_dict_type == "sharded":
            return ckpt_state.save_sharded(
                path, state, self.unwrap, self.is_global_zero, self.all_gather_object, background=background
            )
        return super().save_checkpoint(path, state, background)  # full: gathered into CPU memory on rank 0 only

    def load_checkpoint(self, path, state: dict[str, Any], strict: bool = True) -> dict[str, Any]:
        return ckpt_state.load_any(path, state, self.unwrap, ckpt_state.SHARDED, strict)


def shard_experts(experts, fully_shard: Callable, kwargs: dict[str, Any]) -> None:
    """Each layer's experts (``experts``: the ``ExpertSplit``) an FSDP2 unit of their own, over the ranks that hold
    the same ones, with the other units' ``kwargs`` but their mesh and placement: fewer experts than those ranks
    are sharded by columns (``few_rows_by_columns``)."""
    shared = {k: v for k, v in kwargs.items() if k not in ("mesh", "shard_placement_fn")}
    experts.shard(fully_shard, shard_placement_fn=few_rows_by_columns(experts.world // experts.size), **shared)


def few_rows_by_columns(ranks: int) -> Callable[[nn.Parameter], Any]:
    """FSDP2's ``shard_placement_fn`` for ``ranks`` shards. FSDP2 shards a parameter's first dimension, padded to a
    multiple of the ranks: stacked experts ``[experts, out, in]`` with fewer experts than ranks would leave each
    rank a whole expert (Mixtral's 8 over 16 ranks: an eighth of them on every rank, not a sixteenth; the planner's
    simulation of FSDP2 showed it). Such a parameter is sharded along its second dimension, where that divides
    evenly (FSDP2 requires it there), as torchtitan shards its experts; every other parameter along its first."""
    from torch.distributed.tensor import Shard

    def placement(param: nn.Parameter):
        if param.dim() >= 2 and param.shape[0] < ranks and param.shape[1] % ranks == 0:
            return Shard(1)
        return None  # FSDP2's own: Shard(0)

    return placement


def live_reduce_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype FSDP2 reduces gradients in, from the policy its live state holds (what it does, not what was asked
    for: verify audits it); None when no module of ``model`` is sharded."""
    for m in model.modules():
        state = getattr(m, "_get_fsdp_state", None)
        if state is not None:
            policy = state()._mp_policy
            return policy.reduce_dtype or policy.param_dtype
    return None


@contextlib.contextmanager
def gradient_sync_off(module: nn.Module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def built_on_meta(module: nn.Module) -> bool:
    """Whether configure_model built the model on the meta device; a mix of meta and real tensors
    cannot be sharded faithfully (re-allocating the meta ones would wipe the real ones)."""
    tensors = [*module.parameters(), *module.buffers()]
    meta = [t.is_meta for t in tensors]
    if any(meta) and not all(meta):
        raise ValueError(
            f"{type(module).__name__} has layers built in __init__ and layers built in configure_model (on the meta "
            "device); under FSDP build all of them in configure_model (or all in __init__)"
        )
    return any(meta)


def check(config) -> None:
    """The ``fsdp:`` section of a config."""
    f = config.fsdp
    if f.sharding_strategy not in SHARDING_STRATEGIES:
        raise ConfigError(
            f"fsdp.sharding_strategy must be one of {', '.join(SHARDING_STRATEGIES)}, got {f.sharding_strategy!r}"
        )
    if f.auto_wrap_policy not in (None, "transformer_based", "size_based"):
        raise ConfigError(
            f"fsdp.auto_wrap_policy must be transformer_based, size_based or null, got {f.auto_wrap_policy!r}"
        )
    if f.state_dict_type not in ("sharded", "full"):
        raise ConfigError(f"fsdp.state_dict_type must be sharded or full, got {f.state_dict_type!r}")
    for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        value = getattr(f.mixed_precision, name)
        if value not in (None, *_DTYPES):
            raise ConfigError(f"fsdp.mixed_precision.{name} must be bf16, fp16 or fp32, got {value!r}")


def options_from_config(config, block_classes) -> dict:
    """The config's ``fsdp:`` section → FSDPStrategy options."""
    f = config.fsdp
    return dict(
        sharding_strategy=f.sharding_strategy,
        cpu_offload=f.cpu_offload or config.distributed.strategy == "fsdp_cpu_offload",
        auto_wrap_policy={"transformer_based": block_classes, "size_based": f.min_num_params}.get(
            f.auto_wrap_policy, _root_only
        ),
        mixed_precision={k: v for k, v in vars(f.mixed_precision).items() if v} or None,
        state_dict_type=f.state_dict_type,
        forward_prefetch=f.forward_prefetch,
        backward_prefetch=f.backward_prefetch,
        use_orig_params=f.use_orig_params,
        sync_module_states=f.sync_module_states,
        sync_each_micro_batch=f.sync_each_micro_batch,
        expert_parallel_size=config.distributed.expert_parallel_size,
    )


def _root_only(module: nn.Module) -> bool:
    """auto_wrap_policy: null — no unit but the root."""
    return False


register(
    "fsdp",
    FSDPStrategy,
    "FSDP2: parameters, gradients and optimizer state sharded across ranks",
    options_from_config,
    "fsdp",
    check,
    cost_model="distrain.planner.models.fsdp",
)
register(
    "fsdp_cpu_offload",
    functools.partial(FSDPStrategy, cpu_offload=True),
    "FSDP2 with parameters, gradients and optimizer state offloaded to CPU memory",
    options_from_config,
    "fsdp",
    check,
    cost_model="distrain.planner.models.fsdp",
)
