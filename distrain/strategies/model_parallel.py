"""Model parallelism: tensor parallel (DTensor) × FSDP2 over the data-parallel dimension × pipeline
stages, on one ``DeviceMesh`` (``distrain.parallel``).

``ModelParallelStrategy(tensor_parallel_size, data_parallel_size)`` is Lightning's name and
meaning: the mesh has ``"data_parallel"`` and ``"tensor_parallel"`` dims, ``configure_model`` may
apply a tensor-parallel plan of its own on ``self.device_mesh["tensor_parallel"]``; otherwise the
built-in plan of the model (distrain's GPT, Hugging Face Llama-style) is applied. FSDP2 then shards
each block and the rest over the data-parallel dim (2-D). ``pipeline_stages`` adds a pipeline
(3-D); ``PipelineStrategy`` (``strategy="pipeline"``) is the pipeline alone (plus FSDP over what
ranks remain).

Set-up order (torchtitan's): tensor parallel → activation checkpointing → pipeline stages → FSDP →
memory for this rank's shards → initialization. A model built in ``configure_model`` (on the meta
device) is initialized on the whole model's structure, drawing every random number a one-process
build draws, each rank keeping only its shards and stages (``sharded_init``): every layout starts
from the same weights. Data is split over the data-parallel dimension only: a tensor-parallel group
and a pipeline see the same batches.

Checkpoints are DCP shards with the one-process parameter names: a checkpoint written under TP=2
loads under FSDP, on one process or as a pipeline, and the reverse.
"""

from __future__ import annotations

import contextlib
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distrain.checkpoint import io as ckpt_io
from distrain.checkpoint import safe_load
from distrain.checkpoint import state as ckpt_state
from distrain.config import ConfigError, DistributedConfig, Refusal
from distrain.module import StepRouter, overrides
from distrain.parallel import expert_parallel
from distrain.parallel.layout import CP, DP, PP, SCHEDULES, TP, ParallelLayout, default_stages_per_rank, layout_for
from distrain.strategies import sharded_init
from distrain.strategies.base import LoopFacts, SetUp, Strategy, Traits
from distrain.strategies.fsdp import built_on_meta, gradient_sync_off, live_reduce_dtype, shard_experts
from distrain.strategies.layers import apply_activation_checkpointing, apply_compile, block_classes, is_marked_unit
from distrain.strategies.registry import register


class ModelParallelStrategy(Strategy):
    """Tensor × data (FSDP2) × pipeline parallelism.

    - ``tensor_parallel_size``: ranks that split each layer (``"auto"``: the devices of one node, as
      Lightning's); ``data_parallel_size``: replicas (``"auto"``: the ranks that remain).
    - ``pipeline_stages``: pipeline ranks (1: none); ``schedule``: ``"1F1B"``, ``"GPipe"`` or
      ``"Interleaved1F1B"`` (``stages_per_rank`` virtual stages each, default 2); ``microbatches``: the
      pipeline's micro-batches per step, which are the Trainer's accumulation micro-batches (None: as
      many as ``accumulate_grad_batches``); ``split_points``: block indices or names where stages
      begin (default: balanced by parameter count).
    - ``sequence_parallel``: split the norms and the residual stream along the sequence too.
    - ``context_parallel_size``: ranks that split each sequence (``distrain.parallel.context_parallel``); they
      share samples, and FSDP2 shards over data × context.
    - ``expert_parallel_size``: ranks that split each mixture-of-experts layer's experts
      (``distrain.parallel.expert_parallel``), among the data × context ranks (which hold different tokens); each
      layer's experts sharded by FSDP2 over the ranks that hold the same ones. Not yet with tensor parallelism or a
      pipeline (refused before any rank starts).
    """

    start_method = "popen"
    #: "auto" sizes as ``strategy="pipeline"`` reads them (``layout_for``)
    pipeline_strategy = False

    def __init__(
        self,
        tensor_parallel_size: int | str = "auto",
        data_parallel_size: int | str = "auto",
        pipeline_stages: int = 1,
        schedule: str = "1F1B",
        microbatches: int | None = None,
        split_points: list[int | str] | None = None,
        stages_per_rank: int | None = None,
        sequence_parallel: bool = True,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        activation_checkpointing_policy: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float = timedelta(minutes=30),
        collective_timeout: timedelta | float | None = timedelta(minutes=5),
    ):
        super().__init__(process_group_backend, timeout, activation_checkpointing_policy, collective_timeout)
        if schedule not in SCHEDULES:
            raise ValueError(
                f"pipeline schedule (distributed.pipeline_schedule) must be one of {', '.join(SCHEDULES)}, "
                f"got {schedule!r}"
            )
        if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
            raise ValueError(
                f"microbatches (distributed.pipeline_microbatches) must be a positive integer, got {microbatches!r}"
            )
        if stages_per_rank is None:
            stages_per_rank = default_stages_per_rank(schedule)
        if schedule != "Interleaved1F1B" and stages_per_rank != 1:
            raise ValueError(
                f"stages_per_rank={stages_per_rank} needs schedule='Interleaved1F1B' "
                "(GPipe and 1F1B run one stage per rank)"
            )
        self.tensor_parallel_size = tensor_parallel_size
        self.data_parallel_size_option = data_parallel_size
        self.pipeline_stages = pipeline_stages
        self.schedule = schedule
        self.microbatches = microbatches
        self.split_points = list(split_points) if split_points else None
        self.stages_per_rank = stages_per_rank
        self.sequence_parallel = sequence_parallel
        self.context_parallel_size = context_parallel_size
        self.expert_parallel_size = expert_parallel.check_size(expert_parallel_size)
        self.layout: ParallelLayout | None = None
        self.device_mesh = None
        self.runner = None  # the pipeline (pipeline_stages > 1), after set-up
        self.tensor_plan: str | None = None  # which plan tensor parallelism applied
        self.context_engine: str | None = None  # which engine splits the sequences (context parallelism)
        self._sequence_shard = None
        self._deferred = sharded_init.DeferredBuild()  # configure_model's meta build, initialized at set-up

    # ---- the layout, decided before any rank starts ----------------------------------------------------------
    def connect(self, accelerator, precision, cluster, nprocs: int, num_nodes: int):
        """As ``Strategy.connect``, then decides the layout, before any rank starts: the pipeline × data × tensor
        sizes for this number of ranks."""
        super().connect(accelerator, precision, cluster, nprocs, num_nodes)
        self.layout = layout_for(
            nprocs * num_nodes,
            nprocs,
            self.pipeline_strategy,
            self.tensor_parallel_size,
            self.data_parallel_size_option,
            self.pipeline_stages,
            self.stages_per_rank,
            self.context_parallel_size,
        )
        _check_experts_layout(self.expert_parallel_size, self.layout)

    @property
    def layout_note(self) -> str:
        experts = f", experts over {self.expert_parallel_size} ranks" if self.expert_parallel_size > 1 else ""
        return f" ({self.layout.describe()}{experts})" if self.layout else ""

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data if self.layout else self.world_size

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """This rank's data-parallel replicas: the ranks at its place in the pipeline, context and tensor groups."""
        return self.device_mesh.get_group(DP) if self.device_mesh is not None else None

    @property
    def sequence_slice(self) -> tuple[tuple[int, int, int], ...] | None:
        return self._sequence_shard.last_slice if self._sequence_shard is not None else None

    @property
    def data_parallel_rank(self) -> int:
        return self.layout.coordinates(self.global_rank)[1] if self.layout else self.global_rank

    @property
    def traits(self) -> Traits:
        """Forwards communicate. With pipeline stages, logged values live on the last stage (reduced across ranks),
        and steps are not re-run (the schedule runs the backward); one copy of each sample counts in metrics: the
        first tensor-parallel rank's of the last stage."""
        pipelined = bool(self.layout and self.layout.pipeline > 1)
        pp, _, cp, tp = self.layout.coordinates(self.global_rank) if self.layout else (0, 0, 0, 0)
        last = self.layout.pipeline - 1 if self.layout else 0
        return Traits(
            collective_forward=True,
            metrics_elsewhere=pipelined,  # the last stage logs; rank 0 is the first
            stages_hold_own_parameters=pipelined,
            # one copy: the first tensor- and context-parallel rank of the last stage
            counts_metrics=tp == 0 and cp == 0 and pp == last,
            reruns_steps=self.pipeline_stages == 1,  # a pipeline's schedule runs the backward
            runs_module_backward=self.pipeline_stages == 1,
        )

    def setup_environment(self) -> None:
        super().setup_environment()
        self.device_mesh = self.layout.mesh(self.root_device.type)

    def reduce_dtype(self, model: nn.Module, module: nn.Module) -> torch.dtype:
        # the data-parallel dimension is FSDP2's
        return live_reduce_dtype(model) or super().reduce_dtype(model, module)

    # ---- building the model ----------------------------------------------------------------------------------------
    def module_init_context(self, empty_init: bool | None = None):
        """configure_model builds on the meta device; set-up gives each rank its shards and stages and
        initializes them to a one-process build's weights (``empty_init=True`` skips that)."""
        if empty_init is False:
            return super().module_init_context(empty_init)
        return self._deferred.context(empty_init)

    def check_module(self, module: nn.Module) -> None:
        from distrain.module import Module
        from distrain.parallel.tensor_parallel import check_plan, is_parallelized

        super().check_module(module)  # experts that expert_parallel_size cannot split
        if self.layout.context > 1:
            _check_context_parallel(module, self.layout)
        if isinstance(module, Module) and overrides(module, "configure_model"):
            blocks = module.num_blocks()  # its layers do not exist yet: checked in the ranks once built; the depth now
            if blocks is not None and self.layout.num_stages > blocks:
                name = module.hparams.get("model_name", type(module).__name__)
                raise Refusal(
                    f"{self.layout.num_stages} pipeline stages (distributed.pipeline_stages"
                    f"{' × pipeline_stages_per_rank' if self.layout.stages_per_rank > 1 else ''}) but "
                    f"{name} has {blocks} blocks: each stage needs at least one"
                )
            return
        if self.layout.tensor > 1 and not is_parallelized(module):
            check_plan(module, self.layout.tensor, self.sequence_parallel)  # no plan, or a size that does not divide
        if self.layout.pipeline > 1:
            from distrain.parallel.pipeline_split import split_blocks, split_for
            from distrain.parallel.pipeline_stages import check_split_covers

            # refuses a module with no plan, more stages than blocks, split points that name no stages, a layer
            # on no stage
            split = split_for(module)
            split_blocks(split, self.layout.num_stages, self.split_points, root=module)
            check_split_covers(module, split)

    def _setup_module(self, module: nn.Module) -> nn.Module:
        from distrain.parallel.tensor_parallel import apply_tensor_parallel, retie, shared_parameters

        lay, mesh = self.layout, self.device_mesh
        if lay.pipeline > 1 and not isinstance(module, StepRouter):  # a loop of your own calls the model itself
            raise ValueError(
                "the pipeline strategy runs inside the Trainer (its schedule runs each step); use Trainer.fit"
            )
        module = self.precision.convert_module(module)
        user = getattr(module, "module", module)  # the user's Module inside the Trainer's step router
        on_meta = built_on_meta(module)
        if not on_meta:  # built in __init__: every rank starts from rank 0's weights
            module.to(self.root_device)
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src=0)
        ties = shared_parameters(module)
        if lay.tensor > 1:
            self.tensor_plan = apply_tensor_parallel(user, mesh[TP], self.sequence_parallel)
        if lay.context > 1:
            self._apply_context_parallel(user)
        self._split_experts(module)  # on the meta device too: this rank's rows of each layer's experts
        split = None
        if lay.pipeline > 1:
            from distrain.parallel.pipeline_split import split_for

            split = split_for(user)
        # each block, after its layers are split and before AC (as FSDP): what a pipeline stage or FSDP unit runs
        blocks = list(split.blocks) if split else self._fsdp_units(module)
        apply_compile(user, self.compile, per_block=True, blocks=blocks)
        apply_activation_checkpointing(module, self.activation_checkpointing_policy)
        build = None
        if split is not None:
            from distrain.parallel.pipeline_stages import PipelineBuild, PipelineRunner

            build = PipelineBuild.create(user, split, lay, lay.coordinates(self.global_rank)[0], self.split_points)
            runner = PipelineRunner(user, build, lay, mesh, self.schedule, self.root_device, self.precision)
            roots, units = runner.stage_modules, [b for m in runner.stage_modules for b in m.blocks]
        else:
            roots, units = [module], self._fsdp_units(module)
        if lay.data * lay.context > 1 and not _fsdp_applied(module):
            self._fully_shard(roots, units)
        retie(ties)
        rng, skip_init = self._deferred.take()
        if on_meta:
            self._materialize(roots, build.keep if build else [module])
            retie(ties)
            if not skip_init:
                blocks = build.split.blocks if build else units
                unit_of = sharded_init.units_of_parameters(module, list(blocks))
                access = sharded_init.dtensor_shards_and_expert_rows(self.root_device, self.experts)
                self.init_peak_bytes = sharded_init.replay_initialization(module, rng, access, unit_of)
        if build is not None:
            build.prune(user)  # after initialization: other stages' layers drew their random numbers too
            runner.finish()
            self.runner = runner
        return module

    def _fsdp_units(self, module: nn.Module) -> list[nn.Module]:
        classes = tuple(block_classes(module))
        return [m for m in module.modules() if m is not module and (isinstance(m, classes) or is_marked_unit(m))]

    def _fully_shard(self, roots: list[nn.Module], units: list[nn.Module]) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        param_dtype = self.precision.gathered_param_dtype  # as FSDPStrategy's, fp8 included
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
        # a pipeline stage keeps its parameters gathered through a step's micro-batches (torch's stages do not
        # reshard them after backward until the last): resharding after each forward would gather them again for
        # every micro-batch's backward, and not overlapped (torchtitan's default under pipelining, the same)
        kwargs = dict(mesh=self._data_mesh(), mp_policy=policy, reshard_after_forward=self.layout.pipeline == 1)
        if self.experts is not None:
            shard_experts(self.experts, fully_shard, kwargs)
        for unit in reversed(units):
            fully_shard(unit, **kwargs)
        for root in roots:
            fully_shard(root, **kwargs)

    def _data_mesh(self):
        """The ranks a gradient is averaged over: the replicas, and with context parallelism the ranks that split
        each sequence too (each holds its slice's share; torchtitan's ``dp_shard_cp``)."""
        if self.layout.context == 1:
            return self.device_mesh[DP]
        from distrain.compat import flatten_mesh

        return flatten_mesh(self.device_mesh[DP, CP], "data_context_parallel")

    def _apply_context_parallel(self, user: nn.Module) -> None:
        from distrain.parallel.context_parallel import SequenceShard, apply_context_parallel, no_support_message

        engine = _check_context_parallel(user, self.layout)  # a model built in configure_model is seen only now
        cp = self.layout.coordinates(self.global_rank)[2]
        shard = SequenceShard(self.device_mesh.get_group(CP), cp, self.layout.context, engine)
        if not apply_context_parallel(user, shard):
            raise ValueError(no_support_message(user))
        self.context_engine, self._sequence_shard = shard.engine, shard

    def _materialize(self, roots: list[nn.Module], keep: list[nn.Module]) -> None:
        """Memory for what this rank holds: its stages (FSDP units allocate only their shards); other
        stages' layers stay on the meta device until they are dropped."""
        for root in roots:
            root.to_empty(device=self.root_device)
        for part in keep:
            for m in part.modules():
                if any(t.is_meta for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]):
                    m.to_empty(device=self.root_device, recurse=False)

    def _setup_training(self, module: nn.Module, optimizers: list, schedulers: list, loop: LoopFacts) -> SetUp:
        if self.runner is not None and optimizers and self.microbatches not in (None, loop.accumulate):
            raise ValueError(
                f"PipelineStrategy(microbatches={self.microbatches}) but accumulate_grad_batches={loop.accumulate}: "
                "the pipeline's micro-batches are the Trainer's accumulation micro-batches (the global batch means "
                "what it means under DDP); set accumulate_grad_batches (training.gradient_accumulation_steps) to "
                f"{self.microbatches}, or leave microbatches unset"
            )
        if self.runner is not None and loop.accumulate < self.layout.pipeline and optimizers:
            self.runner.warned_short = True  # said here once; the schedule's fallback need not say it again
            if self.is_global_zero:
                warnings.warn(
                    f"distrain: {loop.accumulate} micro-batch(es) per step on {self.layout.pipeline} pipeline stages: "
                    "stages mostly wait for each other (and 1F1B runs breadth-first); accumulate_grad_batches ≥ the "
                    "stages (a multiple; training.gradient_accumulation_steps) keeps them busy",
                    stacklevel=2,
                )
        return SetUp(_ParallelModel(module, self), optimizers, schedulers)

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The module inside distrain's model-parallel wrapper (``module`` itself when it is not wrapped)."""
        return module.module if isinstance(module, _ParallelModel) else module

    # ---- the step ------------------------------------------------------------------------------------------------
    def _loss_parallel(self):
        if self.layout.tensor > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()  # the logits stay split by vocabulary through the loss and its backward
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, module: nn.Module | None = None) -> None:
        """As ``Strategy.backward``, under torch's ``loss_parallel`` when tensor parallelism splits the logits by
        vocabulary."""
        with self._loss_parallel():
            super().backward(loss, module)

    def no_backward_sync(self, module: nn.Module, enabled: bool = True):
        root = self.unwrap(module)
        if not enabled or not hasattr(root, "set_requires_gradient_sync"):
            return contextlib.nullcontext()
        return gradient_sync_off(root)

    def run_step(self, model: nn.Module, micro_batches: list[tuple[int, Any]], before_each=None):
        """A pipeline: its schedule runs the whole window through its stages."""
        if self.runner is None:
            return super().run_step(model, micro_batches, before_each)
        return self.runner.train(micro_batches, before_each, self._loss_parallel())

    def gradient_norm(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        from distrain.parallel.gradients import match_gradient_layouts, total_norm

        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        match_gradient_layouts(params)
        if self.experts is not None:  # each rank's experts are its own: the norm sums them over the ranks
            return self._norm_with_experts(params)
        group = self.device_mesh.get_group(PP) if self.layout.pipeline > 1 else None
        skip = self.runner.counted_once() if self.runner is not None else set()
        return total_norm([p for p in params if id(p) not in skip], group, self.root_device)

    def clip_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global norm (``gradient_norm``: over every tensor, data and pipeline
        shard, each parameter counted once) is at most ``max_norm``; returns that norm."""
        from distrain.parallel.gradients import scale_gradients

        norm = self.gradient_norm(module, optimizer)
        scale_gradients([p for g in optimizer.param_groups for p in g["params"] if p.grad is not None], norm, max_norm)
        return norm

    def optimizer_step(self, optimizer: torch.optim.Optimizer, module: nn.Module | None = None) -> None:
        """As ``Strategy.optimizer_step``, once each gradient has its parameter's layout
        (``match_gradient_layouts``)."""
        from distrain.parallel.gradients import match_gradient_layouts

        match_gradient_layouts(p for group in optimizer.param_groups for p in group["params"])
        super().optimizer_step(optimizer, module)

    # ---- checkpoints: DCP shards under the one-process names -------------------------------------------------
    def save_checkpoint(self, path, state: dict[str, Any], background: bool = False):
        adjust = self._agree_optimizer_groups if self.layout.pipeline > 1 else None
        return ckpt_state.save_sharded(
            path, state, self.unwrap, self.is_global_zero, self.all_gather_object, adjust, background
        )

    def _agree_optimizer_groups(self, collected: dict[str, Any]) -> dict[str, Any]:
        """Each stage's optimizer groups list its own parameters; DCP stores one copy of such lists, so
        they are made the union over the pipeline (what one process's optimizer would list)."""
        group = self.device_mesh.get_group(PP)
        for value in collected.values():
            states = value if isinstance(value, list) else [value]
            if not all(isinstance(s, dict) and "param_groups" in s for s in states) or not states:
                continue
            everyone = [None] * self.layout.pipeline
            dist.all_gather_object(everyone, [s["param_groups"] for s in states], group=group)
            for i, s in enumerate(states):
                for g, param_group in enumerate(s["param_groups"]):
                    names = [n for stage in everyone for n in stage[i][g]["params"]]
                    param_group["params"] = list(dict.fromkeys(names))
        return collected

    def load_checkpoint(self, path, state: dict[str, Any], strict: bool = True) -> dict[str, Any]:
        if self.layout.pipeline > 1 and strict:
            self._check_pipeline_fits(path, state)
            strict = False  # each stage loads its own part; the whole was checked above
        return ckpt_state.load_any(path, state, self.unwrap, ckpt_state.SHARDED, strict)

    def _check_pipeline_fits(self, path, state: dict[str, Any]) -> None:
        """A checkpoint of another model fails in one line, as on one process: the stages' names together
        against the checkpoint's."""
        model_keys = [k for k, v in state.items() if isinstance(v, nn.Module)]
        path = ckpt_io.resolve_checkpoint(path)
        for key in model_keys:
            local = {
                k: tuple(v.shape)
                for k, v in ckpt_state.get_model_state_dict(self.unwrap(state[key]), options=ckpt_state.SHARDED).items()
            }
            everyone = [None] * self.layout.pipeline
            dist.all_gather_object(everyone, local, group=self.device_mesh.get_group(PP))
            expected = {k: v for stage in everyone for k, v in stage.items()}
            found = _stored_model_shapes(path, key)
            ckpt_state.compare_model_keys(expected, found, key, type(self.unwrap(state[key])).__name__)


class _ParallelModel(nn.Module):
    """What the Trainer calls: ``model(step_name, batch, i)``. Tensor parallel: the step runs under
    ``loss_parallel`` and DTensor results come back whole; pipeline: evaluation steps run through the
    stages (training steps go through ``run_step``)."""

    def __init__(self, module: nn.Module, strategy: ModelParallelStrategy):
        super().__init__()
        self.module = module
        object.__setattr__(self, "strategy", strategy)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils._pytree import tree_map

        from distrain.parallel.pipeline_stages import whole_tensor, whole_tensors

        strategy = self.strategy
        step_name = args[0] if args and isinstance(args[0], str) else None  # None: a loop of your own calls it
        if strategy.runner is not None:
            batch, batch_idx = args[1:]
            return strategy.runner.evaluate(step_name, batch, batch_idx, strategy._loss_parallel())
        with strategy._loss_parallel():
            out = self.module(*args, **kwargs)
        if step_name == "training_step":  # the loss must stay differentiable
            return {**out, "loss": whole_tensor(out["loss"])} if isinstance(out, dict) else whole_tensor(out)
        if step_name is None and torch.is_grad_enabled():  # your loss, to call backward on: whole, differentiable
            return tree_map(whole_tensor, out)
        return whole_tensors(out)


def _check_context_parallel(module: nn.Module, layout: ParallelLayout) -> str:
    """Before any rank starts: the model splits sequences, and tensor parallelism can give each rank whole heads;
    the engine its heads take (``engine_for``). A model built in ``configure_model`` is checked in the ranks once
    built (the built-in job's size is known now)."""
    from distrain.models.gpt import GPT_SIZES
    from distrain.models.lm import GPTLanguageModel
    from distrain.module import Module
    from distrain.parallel.context_parallel import attention_heads, engine_for, no_support_message

    heads, name = attention_heads(module), type(module).__name__
    if isinstance(module, GPTLanguageModel):  # known by its name before configure_model builds it
        name = module.hparams["model_name"]
        return engine_for(heads or [GPT_SIZES[name]["n_head"]], layout.context, layout.tensor, name)
    engine = engine_for(heads, layout.context, layout.tensor, name)
    built_later = isinstance(module, Module) and overrides(module, "configure_model")
    if not built_later and not any(
        callable(getattr(type(m), "enable_context_parallel", None)) for m in module.modules()
    ):
        raise ValueError(no_support_message(module))
    return engine


def _fsdp_applied(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def _stored_model_shapes(path, key: str) -> dict[str, tuple]:
    if ckpt_state.is_sharded_checkpoint(path):
        stored = safe_load.read_dcp_metadata(path).state_dict_metadata
        return {k[len(key) + 1 :]: tuple(getattr(m, "size", ())) for k, m in stored.items() if k.startswith(f"{key}.")}
    return {k: tuple(v.shape) for k, v in ckpt_io.read_state_file(path)[key].items()}


def options_from_config(config, block_classes, pipeline: bool = False) -> dict:
    """The config's ``distributed`` keys → ModelParallelStrategy options (``pipeline``: PipelineStrategy's)."""
    d = config.distributed
    options = dict(
        tensor_parallel_size=d.tensor_parallel_size,
        data_parallel_size=d.data_parallel_size,
        sequence_parallel=d.sequence_parallel,
        schedule=d.pipeline_schedule,
        microbatches=d.pipeline_microbatches,
        split_points=d.pipeline_split_points,
        stages_per_rank=d.pipeline_stages_per_rank,
    )
    if pipeline:
        options["stages"] = d.pipeline_stages if d.pipeline_stages is not None else "auto"
    else:  # (a pipeline with context parallelism is refused by check)
        options["pipeline_stages"] = d.pipeline_stages or 1
        options["context_parallel_size"] = d.context_parallel_size
        options["expert_parallel_size"] = d.expert_parallel_size
    return options


def _check_experts_layout(size: int, layout: ParallelLayout) -> None:
    """Expert parallelism splits the experts among ranks that hold different tokens: here the data × context
    ranks of a model not split otherwise (every rank, so ``Strategy.connect`` has checked that the size divides
    them)."""
    if size > 1 and (layout.tensor > 1 or layout.pipeline > 1):
        raise Refusal(
            f"expert_parallel_size={size} (distributed.expert_parallel_size) under model_parallel splits the experts "
            f"among the data and context-parallel ranks, and not yet with tensor parallelism or a pipeline (this "
            f"layout: {layout.describe()}); leave it unset there: tensor parallelism splits each expert's hidden "
            "units, and a pipeline's stages each hold their own blocks' experts"
        )


def check(config) -> None:
    """Sizes and names of the model-parallel keys; with a known number of ranks, whether the layout fits."""
    d, t = config.distributed, config.training

    for name in ("tensor_parallel_size", "data_parallel_size"):
        value = getattr(d, name)
        if value != "auto" and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"distributed.{name} must be a positive integer or 'auto', got {value!r}")
    if d.pipeline_schedule not in SCHEDULES:
        raise ConfigError(
            f"distributed.pipeline_schedule must be one of {', '.join(SCHEDULES)}, got {d.pipeline_schedule!r}"
        )
    if d.pipeline_microbatches is not None and t.gradient_accumulation_steps not in (1, d.pipeline_microbatches):
        raise ConfigError(
            f"distributed.pipeline_microbatches={d.pipeline_microbatches} but training.gradient_accumulation_steps="
            f"{t.gradient_accumulation_steps}: the pipeline's micro-batches are the accumulation micro-batches; set one"
        )
    if d.strategy not in ("model_parallel", "pipeline"):
        # a layout asked of a strategy that has none would be ignored: the run would not be what the file says
        defaults = DistributedConfig()
        asked = [
            f"distributed.{name}={getattr(d, name)}"
            for name in (
                "tensor_parallel_size",
                "data_parallel_size",
                "sequence_parallel",
                "pipeline_stages",
                "pipeline_schedule",
                "pipeline_microbatches",
                "pipeline_split_points",
                "pipeline_stages_per_rank",
                "context_parallel_size",
            )
            if getattr(d, name) != getattr(defaults, name)
        ]
        if asked:
            raise ConfigError(
                f"{', '.join(asked)} applies to strategy model_parallel or pipeline, but the strategy is "
                f"{d.strategy}; choose one of those (--strategy model_parallel) or remove the key"
            )
        return
    if not isinstance(d.devices, int):
        return
    try:
        layout_for(
            d.devices * d.num_nodes,
            d.devices,
            d.strategy == "pipeline",
            d.tensor_parallel_size,
            d.data_parallel_size,
            d.pipeline_stages,
            d.pipeline_stages_per_rank or default_stages_per_rank(d.pipeline_schedule),
            d.context_parallel_size,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


register(
    "model_parallel",
    ModelParallelStrategy,
    "tensor parallel (DTensor) × FSDP2 over the data-parallel ranks, optionally × pipeline stages",
    options_from_config,
    "distributed",
    check,
    cost_model="distrain.planner.models.tensor",
)
