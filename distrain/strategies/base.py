"""The one interface every parallel strategy implements.

A strategy decides how the model and optimizers are set up (``setup``: one entry point; it wraps,
shards, compiles and checkpoints the model, then builds the optimizers on what it made), how one
optimizer step's micro-batches run (``run_step``: forward and backward each, gradients synchronized
once), how gradients are clipped and applied, and how a checkpoint is written and read. It starts the
process group through ``distrain.distributed`` and knows nothing about the Trainer: what it needs from
the loop comes in as arguments. What the rest of distrain must know about it is one record
(``Traits``). Each strategy is one file that registers its names (``registry.register``).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
from torch import nn

from distrain import distributed
from distrain.accelerators import Accelerator
from distrain.checkpoint import io as ckpt_io
from distrain.checkpoint import state as ckpt_state
from distrain.cluster import ClusterEnv
from distrain.module import Module, StepRouter, loss_of, overrides
from distrain.parallel import expert_parallel
from distrain.precision import Precision
from distrain.strategies.layers import apply_activation_checkpointing, apply_compile, device_init_context


@dataclass
class LoopFacts:
    """What the training loop will do, for strategies that configure an engine up front
    (DeepSpeed's batch, accumulation and clipping live in its config)."""

    micro_batch_size: int | None = None
    accumulate: int = 1
    max_accumulate: int = 1  # the largest accumulation of the schedule (it may grow with the epochs)
    gradient_clip_val: float | None = None
    total_steps: int | None = None
    run_dir: str | None = None
    live_state: tuple[Callable[[], dict], Callable[[dict], None]] | None = None
    """``(state, load_state)``: the run's live state (weights, optimizer, progress, data position), for a strategy that
    hands it to a peer or takes a peer's (fault tolerance)."""


@dataclass(frozen=True)
class Traits:
    """What the rest of distrain needs to know about a strategy, in one place."""

    collective_forward: bool = False
    """Forward passes communicate (sharded parameters): every rank runs every forward, also in evaluation."""
    engine_skips_nonfinite: bool = False
    """The optimizer step itself skips a step whose gradients are not finite (DeepSpeed's engine)."""
    compiles: bool = True
    """``torch.compile`` can be applied to the model it sets up."""
    converts_fp8: bool = True
    """It converts the model for precision="fp8" (torchao's float8 layers)."""
    float8_all_gather: bool = False
    """fp8 weights are all-gathered in float8 (FSDP2)."""
    metrics_elsewhere: bool = False
    """Logged values may live on other ranks than rank 0 (a pipeline's last stage): each is reduced across ranks."""
    saves_in_background: bool = True
    """Checkpoints can be written while training goes on (``async_save``)."""
    reruns_steps: bool = True
    """A step's forward and backward can run again before its optimizer step, every rank deciding alike
    (``on_anomaly`` re-runs an anomalous step): not where an engine counts every backward (DeepSpeed), where a
    schedule owns the backward (pipelines), nor across replica groups that decide apart (torchft)."""
    optimizer_holds_parameters: bool = True
    """The optimizer's parameter groups hold the module's own parameters (not where an engine steps flat partitions
    of them, ZeRO-3): then a parameter no optimizer holds is one that is never trained."""
    stages_hold_own_parameters: bool = False
    """Each pipeline stage holds only its own layers: a whole model is gathered from every stage."""
    runs_module_backward: bool = True
    """A LightningModule's own ``backward(loss)`` runs the backward (not where an engine runs it, DeepSpeed's, nor where
    a pipeline's schedule does)."""
    counts_metrics: bool = True
    """This rank's logged values count in cross-rank reductions; a rank holding a copy of another's samples (a
    tensor-parallel peer, a pipeline's earlier stage) does not, so a sample counts once."""
    forward_syncs_buffers: bool = False
    """The wrapper's forward sets every rank's buffers to rank 0's (DDP's ``broadcast_buffers``): evaluation runs
    through it too, every rank running as many forwards, so each rank evaluates with rank 0's buffers (BatchNorm's
    running statistics), as Lightning's DDP does."""
    replicated_state: bool = False
    """Every rank holds the whole training state, the same (DDP without split experts): one rank alone can write a
    checkpoint of it (``trainer.save_checkpoint`` called under ``if trainer.is_global_zero:``)."""


class SetUp(NamedTuple):
    model: nn.Module
    """What to call: the wrapped model (``model(step_name, batch, i)`` under the Trainer)."""
    optimizers: list
    schedulers: list


#: builds the optimizers on the model as set up (sharded, partitioned): ``() -> (optimizers, scheduler configs)``
OptimizerFactory = Callable[[], tuple[list, list]]


def checked_start_method(value: str) -> str:
    """How a multi-process strategy's own launcher starts its ranks (``launcher``): "popen" (re-run the script per
    rank), "spawn" or "fork"; anything else is refused here, where it is given, not at launch."""
    if value not in ("popen", "spawn", "fork"):
        raise ValueError(f"start_method must be popen, spawn or fork, got {value!r}")
    return value


class Strategy:
    """The base of every parallel strategy: one process on one device, with no wrapping, as it stands. A subclass
    overrides the parts it changes: how the model is set up (``_setup_module``, ``_setup_training``), the step
    (``backward``, ``no_backward_sync``, ``clip_gradients``, ``optimizer_step``, ``run_step``), the collectives and
    the checkpoint format. The Runtime drives it: ``connect``, then ``setup_environment`` in every rank, ``setup``,
    the steps, and ``teardown``."""

    #: how extra ranks are started when no launcher did it: "popen", "spawn", "fork" or None (one process)
    start_method: str | None = None
    #: ``torch.compile`` when the model is set up (``Trainer(compile=...)`` sets it): False, True or compile kwargs
    compile: bool | dict = False
    #: ``Trainer(sync_batchnorm=True)``: batch norms share their batch statistics over the ranks (torch's
    #: ``SyncBatchNorm``, converted when the model is set up)
    sync_batchnorm: bool = False
    #: the ranks' named mesh, for strategies that lay ranks out on one (``model_parallel``); None otherwise
    device_mesh: Any = None
    #: how the ranks split the work (``ParallelLayout``: data, tensor, pipeline, context), where it is more than data
    layout: Any = None
    #: ranks that split each mixture-of-experts layer's experts (DDP and FSDP take it; ``parallel/expert_parallel.py``)
    expert_parallel_size: int = 1
    #: the split once the model is set up (``ExpertSplit``), else None
    experts: Any = None

    @property
    def traits(self) -> Traits:
        """What the rest of distrain needs to know about this strategy (``Traits``); the defaults here."""
        return Traits()

    def __init__(
        self,
        process_group_backend: str | None = None,
        timeout: timedelta | float = timedelta(minutes=30),
        activation_checkpointing_policy: Any = None,
        collective_timeout: timedelta | float | None = timedelta(minutes=5),
    ):
        self.process_group_backend = process_group_backend
        self.activation_checkpointing_policy = activation_checkpointing_policy
        #: process-group init (and checkpoint IO) wait this long: nodes come up at different times
        self.timeout = as_timedelta(timeout)
        #: every other collective fails after this, naming the ranks that did not arrive (None: ``timeout``)
        self.collective_timeout = as_timedelta(collective_timeout)
        #: where NCCL's flight recorder dumps on a timeout (the Trainer sets its run dir)
        self.flight_recorder_dir: str | None = None
        self.accelerator: Accelerator | None = None
        self.precision: Precision | None = None
        self.cluster: ClusterEnv | None = None
        self.nprocs_per_node = 1
        self.num_nodes = 1

    # ---- wiring, done once by the Runtime ------------------------------------------------------
    def connect(self, accelerator: Accelerator, precision: Precision, cluster: ClusterEnv, nprocs: int, num_nodes: int):
        """Called by the Runtime when it is built (and by ``use_strategy``), before any rank starts: the accelerator,
        the precision plugin, the cluster, the processes per node and the number of nodes. Refuses, in one line, what
        this strategy cannot run: fp8 where it does not convert the model, an NCCL backend without CUDA, a sharded
        strategy on CUDA over gloo."""
        self.accelerator, self.precision, self.cluster = accelerator, precision, cluster
        if precision.name == "fp8" and not self.traits.converts_fp8:
            raise ValueError(f"precision='fp8' is not supported with {type(self).__name__}")
        precision.float8_all_gather = self.traits.float8_all_gather
        self.nprocs_per_node, self.num_nodes = nprocs, num_nodes
        expert_parallel.check_size(self.expert_parallel_size, nprocs * num_nodes)
        if self.start_method is not None and "nccl" in self.backend and accelerator.name != "cuda":
            raise ValueError(
                f"process group backend {self.process_group_backend!r} (distributed.backend in a config file) needs "
                f"CUDA GPUs, and this run is on {accelerator.name} (torch.cuda.is_available()="
                f"{torch.cuda.is_available()}); use gloo, or leave the backend unset (gloo on CPU, nccl on GPUs)"
            )
        sharded = self.traits.collective_forward and nprocs * num_nodes > 1
        if sharded and accelerator.name == "cuda" and _cuda_backend(self.backend) == "gloo":
            # seen on torch 2.11 (H200): FSDP2's and tensor parallelism's DTensor collectives over gloo on CUDA
            # tensors end every rank in SIGSEGV; ZeRO-3 needs a CUDA all-gather-coalesced gloo lacks. DDP's
            # all-reduce over gloo works.
            raise ValueError(
                f"{type(self).__name__} on CUDA needs NCCL: gloo cannot carry the collectives that gather its "
                f"sharded parameters from CUDA memory (FSDP and tensor parallelism crash with SIGSEGV), and the "
                f"process group backend is {self.backend!r} (distributed.backend); leave it unset (nccl on GPUs), "
                "with one rank per GPU"
            )

    @property
    def world_size(self) -> int:
        """The number of ranks: the process group's size once it is started, else processes per node × nodes."""
        dist = torch.distributed
        return dist.get_world_size() if dist.is_initialized() else self.nprocs_per_node * self.num_nodes

    @property
    def global_rank(self) -> int:
        """This process's rank in the process group; before the group is started, ``RANK`` (or, unset, the first
        rank of its node, from ``NODE_RANK``)."""
        if torch.distributed.is_initialized():
            return torch.distributed.get_rank()
        # before our launcher ran: this process will be local rank 0 of its node
        return int(os.environ.get("RANK", int(os.environ.get("NODE_RANK", 0)) * self.nprocs_per_node))

    @property
    def planned_as(self) -> tuple[str, dict[str, Any]] | None:
        """How the memory planner models this strategy, read only to explain a rank that ran out of memory: a
        registered name and the fields of the planner's ``Job`` that describe this instance; None where it has no
        model of it."""
        return None

    @property
    def layout_note(self) -> str:
        """How the ranks are arranged, for the run's header (model-parallel strategies: `` (pipeline 2 × data 1
        × tensor 2)``, expert parallelism: `` (experts over 2 ranks)``); empty when every rank is a data-parallel
        replica."""
        return f" (experts over {self.expert_parallel_size} ranks)" if self.expert_parallel_size > 1 else ""

    @property
    def data_parallel_size(self) -> int:
        """How many ranks see different data (all of them, for data parallelism; model-parallel
        strategies: the size of the data-parallel dimension). Data is sharded over these."""
        return self.world_size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's place among the ``data_parallel_size`` ranks that see different data: which shard of the data
        it reads (its global rank, for data parallelism)."""
        return self.global_rank

    @property
    def sequence_slice(self) -> tuple[tuple[int, int, int], ...] | None:
        """Under context parallelism, the pieces of the last sequence this rank computed: (start, stop, the padded
        length it was cut from) of each; None where every rank computes whole sequences."""
        return None

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (``LOCAL_RANK``; 0 when unset)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def is_global_zero(self) -> bool:
        """Whether this process is global rank 0."""
        return self.global_rank == 0

    @property
    def root_device(self) -> torch.device:
        """This rank's device: the accelerator's device for its local rank."""
        return self.accelerator.device(self.local_rank)

    @property
    def backend(self) -> str:
        """The process group backend: ``process_group_backend`` when given, else the accelerator's (gloo on CPU, nccl
        on GPUs)."""
        return self.process_group_backend or self.accelerator.backend

    # ---- lifecycle ------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Called in every rank before anything touches the model."""
        self.accelerator.setup_device(self.root_device)
        self._set_cpu_threads()
        if self.start_method is not None:  # a multi-process strategy
            distributed.init_process_group(
                self.backend,
                self.timeout,
                self.collective_timeout,
                device=self.root_device,
                flight_recorder_dir=self.flight_recorder_dir,
            )
            if self.world_size > 1:
                self.precision.agree_on_overflow()

    def _set_cpu_threads(self) -> None:
        # N ranks on one CPU each using every core oversubscribes it (the classic CPU slowdown).
        # An explicit OMP_NUM_THREADS (torchrun sets one) wins; a forked rank keeps its one thread
        # (distributed.in_a_forked_child: more would wait forever).
        if self.accelerator.name == "cpu" and "OMP_NUM_THREADS" not in os.environ and self.start_method != "fork":
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.nprocs_per_node))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))

    def teardown(self) -> None:
        """Called by the Runtime's ``teardown`` when the ranks are done: a multi-process strategy ends its process
        group (with no barrier first)."""
        if self.start_method is not None:
            distributed.shutdown(barrier=False)

    # ---- the model ------------------------------------------------------------------------------
    def module_init_context(self, empty_init: bool | None = None):
        """Where ``configure_model`` runs: directly on the device (and in a "true" precision's dtype).
        ``empty_init=True`` skips the initializers: for weights about to be loaded anyway."""
        return device_init_context(self.root_device, self.precision.true_dtype, empty_init)

    def setup(
        self,
        module: nn.Module,
        optimizers: Iterable[torch.optim.Optimizer] | OptimizerFactory = (),
        loop: LoopFacts | None = None,
    ) -> SetUp:
        """The one set-up entry point. The model first (sharding strategies replace its parameters), then the
        optimizers: ``optimizers`` built by a factory on the model as set up (the Trainer:
        ``configure_optimizers``), or built before and re-pointed at the new parameters by name (a loop of your
        own). ``loop``: what the Trainer will do (None: a loop of your own, or evaluation)."""
        names = {id(p): n for n, p in module.named_parameters()}
        if self.sync_batchnorm:  # each BatchNorm*d replaced in place, with the same parameters
            module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
        model = self._setup_module(module)
        if callable(optimizers):
            optimizers, schedulers = optimizers()
        else:
            optimizers, schedulers = list(optimizers), []
            params = dict(self.unwrap(model).named_parameters())
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    group["params"] = [params.get(names.get(id(p)), p) for p in group["params"]]
        return self._setup_training(model, list(optimizers), list(schedulers), loop or LoopFacts())

    def _setup_module(self, module: nn.Module) -> nn.Module:
        """The model: precision, device, compilation, activation checkpointing (sharding strategies shard here)."""
        module = self.precision.convert_module(module).to(self.root_device)
        self._split_experts(module)
        apply_compile(module, self.compile, per_block=False)  # the whole model; before AC: AC stays outside
        apply_activation_checkpointing(module, self.activation_checkpointing_policy)
        return module

    def _split_experts(self, module: nn.Module) -> None:
        """``expert_parallel_size`` > 1: each mixture-of-experts layer keeps this rank's share of its experts."""
        if self.expert_parallel_size > 1:
            self.experts = expert_parallel.split_model(module, self.expert_parallel_size, self.root_device.type)

    def _setup_training(self, model: nn.Module, optimizers: list, schedulers: list, loop: LoopFacts) -> SetUp:
        """What to call and step (DDP's wrapper, DeepSpeed's engine)."""
        return SetUp(model, optimizers, schedulers)

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The module inside what ``setup`` returned (DDP's wrapper, DeepSpeed's engine): here, ``module`` itself."""
        return module

    # ---- launching: how the other ranks start ------------------------------------------------------------------
    def launcher(self, nprocs: int, cluster: ClusterEnv, num_nodes: int):
        """What starts this job's other ranks from this process (``launch.py``), per ``start_method``: None when an
        outside launcher (torchrun, srun) started every rank, or when there is one process."""
        from distrain import launch

        if cluster.launched_externally or self.start_method is None or nprocs * num_nodes == 1:
            return None
        node_rank = int(os.environ.get("NODE_RANK", 0))
        if self.start_method == "popen":
            return launch.SubprocessLauncher(nprocs, num_nodes, node_rank)
        return launch.MultiprocessingLauncher(nprocs, self.start_method, num_nodes, node_rank)

    # ---- what a rank holds: read by verify, the histograms, checkpoints (a strategy keeps parts elsewhere) -------
    def full_shape(self, param: torch.Tensor) -> torch.Size:
        """The whole parameter's shape (a DTensor's is already the whole one; this rank's experts are 1/N)."""
        if self.experts is not None and self.experts.owns(param):
            return torch.Size((param.shape[0] * self.expert_parallel_size, *param.shape[1:]))
        return param.shape

    def local_shard(self, param: torch.Tensor) -> torch.Tensor:
        """The part of ``param`` this rank stores: a DTensor's local shard, else the parameter."""
        return param.to_local() if _is_dtensor(param) else param

    def holds_whole(self, param: torch.Tensor) -> bool:
        """This rank holds the whole of ``param`` (a copy every data-parallel rank must agree on): not a DTensor's
        shard, nor this rank's share of the experts."""
        return not _is_dtensor(param) and not getattr(param, "expert_parallel", False)

    def full_parameter(self, param: torch.Tensor) -> torch.Tensor:
        """The whole parameter, detached (a collective for a sharded one, or experts: call on every rank)."""
        whole = param.detach().full_tensor() if _is_dtensor(param) else param.detach()
        return self.experts.gather(whole) if self.experts is not None and self.experts.owns(param) else whole

    def full_gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """The whole gradient, or None (a collective for a sharded one, or experts: call on every rank)."""
        grad = param.grad
        whole = grad.full_tensor() if grad is not None and _is_dtensor(grad) else grad
        if whole is not None and self.experts is not None and self.experts.owns(param):
            return self.experts.gather(whole)
        return whole

    def reduce_dtype(self, model: nn.Module, module: nn.Module) -> torch.dtype:
        """The dtype gradients are reduced across ranks in, read from the live objects (``model``: what ``setup``
        returned): here the gradients' own."""
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        return grads[0].dtype if grads else next(module.parameters()).dtype

    def master_weights(self, optimizer) -> list[torch.Tensor]:
        """The weights ``optimizer`` steps (the fp32 masters where an engine keeps its own)."""
        inner = getattr(optimizer, "optimizer", optimizer)  # a wrapper around a torch optimizer
        return [p for group in inner.param_groups for p in group["params"]]

    # ---- the step -------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, module: nn.Module | None = None) -> None:
        """``loss.backward()`` through the precision plugin (the loss scaled first when there is a grad scaler); the
        LightningModule's own ``backward(loss)`` instead where it overrides it, as Lightning calls it."""
        scaled = self.precision.scale_loss(loss)
        user = self.unwrap(module) if module is not None else None
        user = user.module if isinstance(user, StepRouter) else user
        if isinstance(user, Module) and overrides(user, "backward"):
            user.backward(scaled)
        else:
            scaled.backward()

    def no_backward_sync(self, module: nn.Module, enabled: bool = True):
        """Skip gradient synchronization for this backward (accumulation micro-steps)."""
        return contextlib.nullcontext()

    def clip_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Unscale ``optimizer``'s gradients and clip them to a global norm of ``max_norm``; returns the norm they had
        before clipping, as a plain tensor."""
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if self.experts is not None:  # each rank's experts are its own: the norm sums them over the ranks
            norm = self._norm_with_experts(params)
            expert_parallel.clip(params, max_norm, norm)
            return norm
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # of DTensor gradients: over every shard
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def clip_gradient_values(self, module: nn.Module, optimizer: torch.optim.Optimizer, clip_value: float):
        """Lightning's ``gradient_clip_algorithm="value"``: unscale ``optimizer``'s gradients and clamp each element to
        ``[-clip_value, clip_value]`` (elementwise: a shard is clamped as the whole would be); returns their global
        norm from before (``gradient_norm``), in which a non-finite gradient still shows."""
        norm = self.gradient_norm(module, optimizer)
        torch.nn.utils.clip_grad_value_([p for g in optimizer.param_groups for p in g["params"]], clip_value)
        return norm

    def gradient_norm(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """The global norm of the gradients about to be applied, without clipping them."""
        self.precision.unscale_gradients(optimizer)
        if self.experts is not None:
            return self._norm_with_experts([p for group in optimizer.param_groups for p in group["params"]])
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # sharded gradients: over all shards

    def _norm_with_experts(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The gradient norm of ``params`` (unscaled already) where each rank's experts are its own: the rest's and
        every rank's experts once."""
        own = {id(p) for p in self.experts.parameters()}
        params = [p for p in params if p.grad is not None]
        return self.experts.total_norm([p for p in params if id(p) not in own], [p for p in params if id(p) in own])

    def optimizer_step(self, optimizer: torch.optim.Optimizer, module: nn.Module | None = None) -> None:
        """``optimizer.step()`` through the precision plugin: with a grad scaler, a step whose gradients overflowed is
        skipped and the scale updated."""
        self.precision.optimizer_step(optimizer)

    def check_module(self, module: nn.Module) -> None:
        """Before any rank starts: refuse, in one line, a module this strategy cannot run (its layers
        built in ``__init__``; a module that builds them in ``configure_model`` is checked in the ranks): here,
        experts that ``expert_parallel_size`` cannot split."""
        expert_parallel.check_module(module, self.expert_parallel_size)

    def start_step(self, step: int) -> bool:
        """Before a step's batches are read (``step``: the steps done so far). True when this rank's state was just
        replaced by a peer's (a replica group that rejoins, ``ddp_torchft``): the loop then re-reads its data
        position."""
        return False

    def commit_step(self) -> bool:
        """After the backward: whether this step's gradients may be applied. False (a replica group was lost during
        the step, ``ddp_torchft``, which says so on the console): the loop drops the step, and it does not count."""
        return True

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own training state, beside the model's and the optimizers' (``ddp_torchft`` with
        ``semi_sync``: the weights of the last meeting and the outer optimizer): saved in checkpoints, given back to
        ``load_state_dict`` on resume. Tensors and plain values only (read weights-only). Empty for most."""
        return {}

    def load_state_dict(self, state: dict[str, Any], source: str) -> None:
        """``state`` from a checkpoint (``source`` names it in errors)."""

    def metrics(self) -> dict[str, float]:
        """Numbers the strategy adds to each logged record (``ddp_torchft``: the bytes it sent to other groups)."""
        return {}

    def run_step(
        self, model: nn.Module, micro_batches: list[tuple[int, Any]], before_each: Callable[[Any], None] | None = None
    ) -> tuple[torch.Tensor, Any]:
        """Forward and backward over one optimizer step's ``(batch_idx, batch)`` pairs (on the device): each
        loss divided by their number (the gradient is their mean, also in a shorter last window), gradients
        synchronized across ranks on the last one only. ``before_each(batch)`` runs before each
        ``training_step``. Returns the step's loss (the mean over the micro-batches) and the last output."""
        window = len(micro_batches)
        step_loss = torch.zeros((), device=self.root_device) if window > 1 else None
        output = None
        for i, (batch_idx, batch) in enumerate(micro_batches):
            if before_each is not None:
                before_each(batch)
            with self.no_backward_sync(model, enabled=i < window - 1):  # no gradient all-reduce before the last
                with self.precision.autocast():
                    output = model("training_step", batch, batch_idx)
                loss = loss_of(output)
                # one micro-batch: the loss as it is (× 1 and 0 + x are exact), three device ops fewer per step
                self.backward(loss * (1 / window) if window > 1 else loss, model)
            if window > 1:
                step_loss += loss.detach().float() / window
        return (step_loss if window > 1 else loss.detach().float()), output

    # ---- collectives over every rank, or over ``group`` (``data_parallel_group``: the ranks with other samples) ----
    @property
    def data_parallel_group(self) -> torch.distributed.ProcessGroup | None:
        """The ranks that hold other samples than this one (its data-parallel replicas), for the collectives'
        ``group``: every rank (None) under data parallelism. Under model parallelism the ranks of a tensor-parallel,
        context-parallel or pipeline group hold copies of the same samples: a sum over every rank counts each
        sample once per copy, a gather returns it once per copy; over this group, once."""
        return None

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean", group=None) -> torch.Tensor:
        """``tensor`` reduced over every rank of the process group (or ``group``'s) by ``op`` ("mean", "sum", "max"
        or "min"); a new tensor on ``tensor``'s device (``tensor`` itself on one process)."""
        return distributed.all_reduce(tensor, op, group)

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "max") -> Callable[[], torch.Tensor]:
        """Start an all-reduce that overlaps with what follows; the returned function waits for it and returns the
        result. Every rank must start the same ones in the same order."""
        return distributed.all_reduce_async(tensor, op)

    def all_gather(self, tensor: torch.Tensor, group=None) -> torch.Tensor:
        """Every rank's ``tensor`` (or every rank of ``group``'s) stacked along a new leading dimension, in rank
        order."""
        return distributed.all_gather(tensor, group)

    def all_gather_object(self, obj: Any, group=None) -> list:
        """Every rank's picklable ``obj`` (or every rank of ``group``'s), as a list in rank order (``[obj]`` on one
        process)."""
        return distributed.all_gather_object(obj, group)

    def all_gather_job_object(self, obj: Any) -> list:
        """Every rank's ``obj`` over the whole job, in order: the process group's ranks here; a strategy whose job
        spans several process groups (torchft's replica groups) gathers across them too."""
        return self.all_gather_object(obj)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """A tensor (returned on the caller's device) or any picklable object, from rank ``src`` to every rank."""
        return distributed.broadcast(obj, src)

    def agree_to_stop(self, vote: float) -> float | Callable[[], float]:
        """Start the agreement of every rank of the job on a stop: the largest ``vote`` (0: go on; a signal number;
        below 1: asked for by the code). A function that reads the result one step later, when each step starts one
        (the reduction has long finished by then); or the result itself, on a job of one process."""
        if self.world_size == 1:
            return vote
        pending = self.all_reduce_async(torch.tensor(vote), "max")
        return lambda: float(pending())

    def barrier(self, name: str | None = None) -> None:
        """Wait until every rank gets here. ``name`` says which barrier it is (unused here)."""
        distributed.barrier()

    # ---- checkpoints: one full-state file written by rank 0 (sharded strategies override) -------
    def save_checkpoint(self, path: str | os.PathLike, state: dict[str, Any], background: bool = False):
        """``background``: written as DCP shards by ``async_save`` (which ``load_checkpoint`` reads as well) while
        training goes on; returns the ``Pending`` commit."""
        if background:
            gather = self.all_gather_object
            return ckpt_state.save_sharded(path, state, self.unwrap, self.is_global_zero, gather, background=True)
        plain = ckpt_state.state_of(state, self.unwrap, ckpt_state.FULL)

        def write(tmp) -> list:
            return ckpt_io.save_state_file(plain, tmp) if self.is_global_zero else []

        return ckpt_io.write_checkpoint(path, write, self.is_global_zero, self.all_gather_object)

    def load_checkpoint(self, path: str | os.PathLike, state: dict[str, Any], strict: bool = True) -> dict[str, Any]:
        """Reads both formats: a full ``state.pt`` and a DCP-sharded directory (resharded to us)."""
        return ckpt_state.load_any(path, state, self.unwrap, ckpt_state.FULL, strict)


def _is_dtensor(t: Any) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")  # not loaded: nothing is a DTensor (and DDP never loads it)
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def _cuda_backend(backend: str) -> str:
    """The backend that carries CUDA tensors: ``gloo`` → gloo, ``cpu:gloo,cuda:nccl`` → nccl."""
    if ":" not in backend:
        return backend
    pairs = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    return pairs.get("cuda", "")


def as_timedelta(value: timedelta | float | None) -> timedelta | None:
    """Seconds (or a timedelta) as a timedelta: a positive, finite time (NaN or inf crashed later, inside a
    collective's set-up)."""
    if value is None or isinstance(value, timedelta):
        seconds = value.total_seconds() if value is not None else None
    else:
        seconds = float(value)
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"a timeout must be a positive, finite number of seconds, got {value!r}")
    return value if value is None or isinstance(value, timedelta) else timedelta(seconds=seconds)
