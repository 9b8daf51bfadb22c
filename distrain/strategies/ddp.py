"""DistributedDataParallel: replicate the model, all-reduce gradients in buckets during backward."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distrain import compat, distributed
from distrain.config import ConfigError
from distrain.module import StepRouter
from distrain.parallel import expert_parallel
from distrain.strategies.base import LoopFacts, SetUp, Strategy, Traits, checked_start_method
from distrain.strategies.registry import alias, register, unalias

COMM_HOOKS = ("fp16_compress", "bf16_compress", "powersgd", "post_localsgd")
#: the strategies that take ``expert_parallel_size``
EXPERT_PARALLEL = ("ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "fsdp", "fsdp_cpu_offload", "model_parallel")


class DDPStrategy(Strategy):
    """``start_method``: "popen" (re-run the script per rank), "spawn" or "fork". ``expert_parallel_size``: ranks
    that split each mixture-of-experts layer's experts (``distrain.parallel.expert_parallel``); DDP replicates the rest
    and leaves the experts to it."""

    @functools.cached_property  # asked in every step's logging: made once
    def traits(self) -> Traits:
        return Traits(
            replicated_state=self.expert_parallel_size == 1,
            forward_syncs_buffers=self.ddp_kwargs.get("broadcast_buffers", True),
        )

    def __init__(
        self,
        start_method: str = "popen",
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | float = timedelta(minutes=30),
        ddp_comm_hook: Callable | str | None = None,
        ddp_comm_state: Any = None,
        ddp_comm_wrapper: Callable | None = None,
        model_averaging_period: int | None = None,
        activation_checkpointing_policy: Any = None,
        collective_timeout: timedelta | float | None = timedelta(minutes=5),
        expert_parallel_size: int = 1,
        **ddp_kwargs: Any,
    ):
        super().__init__(process_group_backend, timeout, activation_checkpointing_policy, collective_timeout)
        self.expert_parallel_size = expert_parallel.check_size(expert_parallel_size)
        unknown = sorted(ddp_kwargs.keys() - self.passes_options_to())
        if unknown:
            raise ValueError(
                f"DDPStrategy: {', '.join(unknown)} is not an option of DDPStrategy nor of torch's "
                "DistributedDataParallel"
            )
        if isinstance(ddp_comm_hook, str) and ddp_comm_hook not in COMM_HOOKS:
            raise ValueError(f"ddp_comm_hook {ddp_comm_hook!r} is unknown; choose one of {', '.join(COMM_HOOKS)}")
        self.start_method = checked_start_method(start_method)
        self.ddp_kwargs = dict(
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            **ddp_kwargs,
        )
        self.ddp_comm_hook = ddp_comm_hook
        self.ddp_comm_state = ddp_comm_state
        self.ddp_comm_wrapper = ddp_comm_wrapper
        self.model_averaging_period = model_averaging_period
        self._model_averager = None
        self._no_gradient: list[str] | None = None  # the parameters the first backward left without a gradient

    @staticmethod
    def passes_options_to() -> set[str]:
        """The options it hands to ``DistributedDataParallel`` as they are (``**ddp_kwargs``): all but those it sets."""
        taken = set(inspect.signature(DistributedDataParallel.__init__).parameters)
        return taken - {"self", "module", "device_ids", "output_device", "process_group", "device_mesh"}

    @property
    def planned_as(self) -> tuple[str, dict[str, Any]]:
        return "ddp", {"gradient_as_bucket_view": self.ddp_kwargs["gradient_as_bucket_view"]}

    # DDP wraps once it knows whether the loop accumulates: a static graph cannot skip gradient sync on
    # accumulation micro-steps.
    def _setup_training(self, model: nn.Module, optimizers: list, schedulers: list, loop: LoopFacts) -> SetUp:
        return SetUp(self._wrap(model, accumulating=loop.max_accumulate > 1), optimizers, schedulers)

    def _wrap(self, module: nn.Module, accumulating: bool) -> DistributedDataParallel:
        kwargs = dict(self.ddp_kwargs)
        if kwargs.get("static_graph") and accumulating:
            # torch's DDP asserts (expect_autograd_hooks_) when a static graph meets no_sync, and once
            # past that stops reducing gradients (pytorch#143580, #187732): train correctly instead
            if self.is_global_zero:
                print(
                    "distrain: static_graph=true with gradient accumulation: torch's DDP cannot skip the gradient "
                    "all-reduce of accumulation micro-steps on a static graph (pytorch#143580), so this run uses "
                    "static_graph=false (the micro-steps still skip their all-reduce)",
                    flush=True,
                )
            kwargs["static_graph"] = False
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        if self.experts is not None:  # each rank's experts are its own: averaged over their holders instead
            own = [n for n, p in module.named_parameters() if getattr(p, "expert_parallel", False)]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, own)
        ddp = DistributedDataParallel(module, device_ids=device_ids, **kwargs)
        if self.experts is not None:
            self.experts.average_when_complete(lambda: ddp.require_backward_grad_sync)
        self._register_comm_hook(ddp)
        return ddp

    def reduce_dtype(self, model: nn.Module, module: nn.Module) -> torch.dtype:
        """A compression hook's dtype; else the gradients' own."""
        compressed = {"bf16_compress": torch.bfloat16, "fp16_compress": torch.float16}
        hook = self.ddp_comm_hook
        return compressed[hook] if isinstance(hook, str) and hook in compressed else super().reduce_dtype(model, module)

    def _register_comm_hook(self, ddp: DistributedDataParallel) -> None:
        hook, state = self.ddp_comm_hook, self.ddp_comm_state
        if hook is None:
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook

        if isinstance(hook, str):
            hook, state = self._named_hook(hook)
        if hook is default_hooks.bf16_compress_hook and self.backend == "gloo":
            # DDP refuses this exact function unless NCCL is used, yet gloo all-reduces bf16
            # fine; the same torch implementation under another name runs.
            hook = compat.bf16_compress_hook_gloo
        if isinstance(state, post_localSGD_hook.PostLocalSGDState) and state.subgroup is None:
            # torch's default subgroup is "ranks per node = GPUs per node", which is 0 on a CPU
            # machine; use the ranks of this node explicitly.
            state.subgroup, _ = dist.new_subgroups(
                group_size=int(os.environ.get("LOCAL_WORLD_SIZE", self.nprocs_per_node))
            )
        if isinstance(state, post_localSGD_hook.PostLocalSGDState) and self.model_averaging_period:
            from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

            self._model_averager = PeriodicModelAverager(
                period=self.model_averaging_period, warmup_steps=state.start_localSGD_iter
            )
        if self.ddp_comm_wrapper is not None:
            hook = self.ddp_comm_wrapper(hook)
        ddp.register_comm_hook(state, hook)

    def _named_hook(self, name: str):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

        if name == "fp16_compress":
            return default_hooks.fp16_compress_hook, None
        if name == "bf16_compress":
            return default_hooks.bf16_compress_hook, None
        if name == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
            return powerSGD_hook.powerSGD_hook, state
        # post_localsgd: global all-reduce for the first steps, then local SGD + periodic averaging
        if self.model_averaging_period is None:
            self.model_averaging_period = 4
        state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=8)
        return post_localSGD_hook.post_localSGD_hook, state

    def no_backward_sync(self, module: nn.Module, enabled: bool = True):
        if enabled and isinstance(module, DistributedDataParallel):
            if module.static_graph:
                raise RuntimeError(
                    "no_backward_sync with DDP(static_graph=True): torch's DDP asserts, or silently stops reducing "
                    "gradients, when a static graph skips a sync (pytorch#143580); use static_graph=False to "
                    "accumulate gradients"
                )
            return module.no_sync()
        return contextlib.nullcontext()

    def run_step(self, model: nn.Module, micro_batches: list, before_each: Callable | None = None):
        """As ``Strategy.run_step``. DDP's error for a parameter that got no gradient (its reduction never finished,
        found at the next step's forward) is one line naming the parameters the first backward left without one, and
        the option that trains such a model."""
        try:
            return super().run_step(model, micro_batches, before_each)
        except RuntimeError as error:
            if "Expected to have finished reduction in the prior iteration" not in str(error):
                raise
            names = self._no_gradient or []
            shown = f" ({', '.join(names[:3])}{', …' if len(names) > 3 else ''})" if names else ""
            raise RuntimeError(
                f"DDP: {len(names) or 'some'} parameter{'s' * (len(names) != 1)} of the model got no gradient in a "
                f"step{shown}, so DDP's gradient reduction never finished: a layer the loss does not use in every step "
                "(an index or a choice computed without gradient, a branch not taken). Train it with "
                "find_unused_parameters=True (Lightning's strategy='ddp_find_unused_parameters_true'; "
                "distributed.find_unused_parameters in a config)"
            ) from None

    def backward(self, loss: torch.Tensor, module: nn.Module | None = None) -> None:
        super().backward(loss, module)
        if self._no_gradient is None and module is not None:  # once: what DDP's own error cannot name
            own = self.experts.owns if self.experts is not None else (lambda p: False)  # its experts: its own
            user = self.unwrap(module)
            params = (user.module if isinstance(user, StepRouter) else user).named_parameters()  # the user's names
            self._no_gradient = [n for n, p in params if p.requires_grad and p.grad is None and not own(p)]

    def clip_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """As ``Strategy.clip_gradients``. Once post-local SGD averages gradients within subgroups only, the ranks'
        norms differ: a norm that is not finite on one rank is returned as NaN on every rank (one all-reduce), so
        every rank skips or stops the step alike."""
        return self._agreed(super().clip_gradients(module, optimizer, max_norm))

    def gradient_norm(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        return self._agreed(super().gradient_norm(module, optimizer))

    def _agreed(self, norm: torch.Tensor) -> torch.Tensor:
        """post_localsgd: once local SGD starts, gradients are averaged within subgroups only and the ranks'
        norms differ. A norm that is not finite on any rank is not finite on every rank (one all-reduce), so
        the Trainer's check skips or stops the step on every rank alike."""
        if self._model_averager is None:  # gradients are all-reduced over every rank: one norm everywhere
            return norm
        bad = distributed.all_reduce(torch.tensor(0.0 if bool(torch.isfinite(norm)) else 1.0), "sum")
        return norm if float(bad) == 0 else torch.full_like(norm, float("nan"))

    def optimizer_step(self, optimizer: torch.optim.Optimizer, module: nn.Module | None = None) -> None:
        """As ``Strategy.optimizer_step``; with post-local SGD and ``model_averaging_period``, the parameters are
        then averaged over the ranks by torch's ``PeriodicModelAverager``."""
        super().optimizer_step(optimizer, module)
        if self._model_averager is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            self._model_averager.average_parameters(params)

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The module inside DDP's wrapper (``module`` itself when it is not wrapped)."""
        return module.module if isinstance(module, DistributedDataParallel) else module


def options_from_config(config, block_classes) -> dict:
    """The config's DDP keys (``distributed.*``) → DDPStrategy options."""
    d = config.distributed
    return dict(
        find_unused_parameters=d.find_unused_parameters,
        gradient_as_bucket_view=d.gradient_as_bucket_view,
        static_graph=d.static_graph,
        ddp_comm_hook=d.comm_hook,
        expert_parallel_size=d.expert_parallel_size,
    )


def check(config) -> None:
    """The DDP keys of a config (``distributed.*``)."""
    hook = config.distributed.comm_hook
    if hook is not None and hook not in COMM_HOOKS:
        raise ConfigError(f"distributed.comm_hook {hook!r} is unknown; choose one of {', '.join(COMM_HOOKS)}")
    strategy = config.distributed.strategy
    if config.distributed.expert_parallel_size > 1 and unalias(strategy, {})[0] not in EXPERT_PARALLEL:
        raise ConfigError(
            "distributed.expert_parallel_size applies to strategy ddp, fsdp (and their variants) or model_parallel, "
            f"but the strategy is {strategy!r}"
        )


for _name, _method, _about in (
    ("ddp", "popen", "DistributedDataParallel; re-runs your script once per rank (works under torchrun/srun)"),
    ("ddp_spawn", "spawn", "DDP in spawned workers; the trained weights come back to the parent"),
    ("ddp_fork", "fork", "DDP in forked workers (notebooks)"),
    ("ddp_notebook", "fork", "the same as ddp_fork"),
):
    register(
        _name,
        functools.partial(DDPStrategy, start_method=_method),
        _about,
        options_from_config,
        "distributed",
        check,
        cost_model="distrain.planner.models.replicated",
    )
    # Lightning's names for the same start with find_unused_parameters set (ddp_find_unused_parameters_true ...)
    for _flag in (False, True):
        alias(f"{_name}_find_unused_parameters_{str(_flag).lower()}", _name, find_unused_parameters=_flag)
