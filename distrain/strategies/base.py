"""The one interface every parallel strategy implements.

A strategy owns: the process group, how the model and optimizer are wrapped, backward/step,
skipping gradient sync, clipping, collectives, and how a checkpoint is written and read.
It knows nothing about the Trainer.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from distrain.accelerators import Accelerator
from distrain.checkpoint import io as ckpt_io
from distrain.checkpoint import state as ckpt_state
from distrain.cluster import ClusterEnv
from distrain.precision import Precision
from distrain.strategies import watch


@dataclass
class TrainingPlan:
    """What the training loop will do, for strategies that configure an engine up front
    (DeepSpeed's batch, accumulation and clipping live in its config)."""

    micro_batch_size: int | None = None
    accumulate: int = 1
    gradient_clip_val: float | None = None
    total_steps: int | None = None
    run_dir: str | None = None


class Strategy:
    #: how extra ranks are started when no launcher did it: "popen", "spawn", "fork" or None
    start_method: str | None = None
    #: forward passes run collectives (sharded parameters): every rank must run the same steps
    collective_forward: bool = False

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
        self.timeout = _as_timedelta(timeout)
        #: every other collective fails after this, naming the ranks that did not arrive (None: ``timeout``)
        self.collective_timeout = _as_timedelta(collective_timeout)
        #: where NCCL's flight recorder dumps on a timeout (the Trainer sets its run dir)
        self.flight_recorder_dir: str | None = None
        self.accelerator: Accelerator | None = None
        self.precision: Precision | None = None
        self.cluster: ClusterEnv | None = None
        self.nprocs_per_node = 1
        self.num_nodes = 1

    # ---- wiring, done once by the Runtime -------------------------------------------------
    def connect(self, accelerator: Accelerator, precision: Precision, cluster: ClusterEnv, nprocs: int, num_nodes: int):
        self.accelerator, self.precision, self.cluster = accelerator, precision, cluster
        self.nprocs_per_node, self.num_nodes = nprocs, num_nodes

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else self.nprocs_per_node * self.num_nodes

    @property
    def global_rank(self) -> int:
        if dist.is_initialized():
            return dist.get_rank()
        # before our launcher ran: this process will be local rank 0 of its node
        return int(os.environ.get("RANK", int(os.environ.get("NODE_RANK", 0)) * self.nprocs_per_node))

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def root_device(self) -> torch.device:
        return self.accelerator.device(self.local_rank)

    # ---- lifecycle ---------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Called in every rank before anything touches the model."""
        self.accelerator.setup_device(self.root_device)
        self._set_cpu_threads()
        if self.start_method is not None and not dist.is_initialized():  # a multi-process strategy
            if "RANK" not in os.environ:  # one process, started by nobody: a group of one
                from distrain.cluster import find_free_port

                os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
            kwargs = {}
            if self.backend == "nccl":
                kwargs["device_id"] = self.root_device  # eager NCCL init: errors surface here, not mid-step
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            if "TORCHELASTIC_RESTART_COUNT" in os.environ:
                kwargs["store"] = _elastic_attempt_store(rank, world, self.timeout)
            if self.backend == "nccl":
                watch.enable_nccl_flight_recorder(self.flight_recorder_dir)
            dist.init_process_group(self.backend, rank=rank, world_size=world, timeout=self.timeout, **kwargs)
            watch.start(rank, world, self.timeout)
            # No barrier at exit: a peer that crashed must not make the survivors hang.
            from distrain.runtime import shutdown_distributed

            atexit.register(shutdown_distributed, barrier=False)
        if watch.active() is not None:  # a group distrain started (this strategy, or an earlier one)
            watch.active().set_collective_timeout(self.collective_timeout or self.timeout)

    @property
    def backend(self) -> str:
        return self.process_group_backend or self.accelerator.backend

    def _set_cpu_threads(self) -> None:
        # N ranks on one CPU each using every core oversubscribes it (the classic CPU slowdown).
        # An explicit OMP_NUM_THREADS (torchrun sets one) wins.
        if self.accelerator.name == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.nprocs_per_node))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))

    def module_init_context(self, empty_init: bool | None = None):
        """Where ``configure_model`` runs: directly on the device (and in bf16 for bf16-true).
        ``empty_init=True`` skips the initializers: for weights about to be loaded anyway."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.root_device)
        if self.precision.name == "bf16-true":
            stack.enter_context(_default_dtype(torch.bfloat16))
        if empty_init:
            stack.enter_context(_SkipInit())
        return stack

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = self.precision.convert_module(module).to(self.root_device)
        apply_activation_checkpointing(module, self.activation_checkpointing_policy)
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def setup(self, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()):
        return self.setup_module(module), [self.setup_optimizer(o) for o in optimizers]

    def setup_training(self, module: nn.Module, optimizers: list, schedulers: list[dict], plan: TrainingPlan):
        """After ``setup_module`` and ``configure_optimizers``: returns the model to call, the
        optimizers to step and the LR scheduler configs the loop steps."""
        return module, [self.setup_optimizer(o) for o in optimizers], schedulers

    def teardown(self) -> None:
        if self.start_method is not None and dist.is_initialized():
            dist.destroy_process_group()
            watch.stop()

    # ---- hang diagnosis (see strategies/watch.py) ----------------------------------------------
    def progress(self, step: int | None, phase: str) -> None:
        """Record where this rank is (step, phase): a collective that times out names the ranks that
        are elsewhere. Cheap: one store write when the phase changes."""
        if watch.active() is not None:
            watch.active().mark(step, phase)

    def patient(self, phase: str):
        """Context for a phase that may keep some ranks waiting long (checkpoint IO): its collectives
        get the process-group init timeout instead of the collective timeout."""
        return watch.active().patient(phase) if watch.active() is not None else contextlib.nullcontext()

    def explain_failure(self, error: BaseException) -> Exception | None:
        """A collective timed out or lost a peer: an error naming the ranks that did not arrive and where
        they stopped (None for other errors)."""
        return watch.active().explain(error) if watch.active() is not None else None

    # ---- the step ----------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, module: nn.Module | None = None) -> None:
        self.precision.scale_loss(loss).backward()

    def no_backward_sync(self, module: nn.Module, enabled: bool = True):
        """Skip gradient synchronization for this backward (accumulation micro-steps)."""
        return contextlib.nullcontext()

    def clip_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, module: nn.Module | None = None) -> None:
        self.precision.optimizer_step(optimizer)

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module

    # ---- collectives (no-ops on one process) ---------------------------------------------
    def _comm_device(self) -> torch.device:
        # NCCL only moves CUDA tensors; gloo moves CPU ones (and CUDA ones through the host)
        return self.root_device if self.backend == "nccl" else torch.device("cpu")

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Returns the reduced tensor on the caller's device (the input is left unchanged)."""
        if not dist.is_initialized() or self.world_size == 1:
            return tensor
        ops = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op not in ops:
            raise ValueError(f"all_reduce op must be mean, sum, max or min, got {op!r}")
        work = tensor.detach().to(self._comm_device(), copy=True)
        dist.all_reduce(work, op=ops[op])
        if op == "mean":
            work = work / self.world_size
        return work.to(tensor.device)

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "max") -> Callable[[], torch.Tensor]:
        """Start an all-reduce that overlaps with what follows; call the returned function for
        the result. Every rank must start the same ones in the same order."""
        if not dist.is_initialized() or self.world_size == 1:
            return lambda: tensor
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        work = tensor.detach().to(self._comm_device(), copy=True)
        handle = dist.all_reduce(work, op=ops[op], async_op=True)

        def result() -> torch.Tensor:
            handle.wait()
            return work.to(tensor.device)

        return result

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stacks every rank's tensor along a new leading dimension (on the caller's device)."""
        if not dist.is_initialized() or self.world_size == 1:
            return tensor.unsqueeze(0)
        work = tensor.detach().to(self._comm_device()).contiguous()
        out = [torch.empty_like(work) for _ in range(self.world_size)]
        dist.all_gather(out, work)
        return torch.stack(out).to(tensor.device)

    def all_gather_object(self, obj: Any) -> list:
        if not dist.is_initialized() or self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized() or self.world_size == 1:
            return obj
        if isinstance(obj, torch.Tensor):
            work = obj.detach().to(self._comm_device(), copy=True)
            dist.broadcast(work, src)
            return work.to(obj.device)
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()

    # ---- checkpoints: one full-state file written by rank 0 (sharded strategies override) -----
    def save_checkpoint(self, path: str | os.PathLike, state: dict[str, Any]) -> None:
        plain = ckpt_state.collect(state, self.unwrap, ckpt_state.FULL)
        if self.is_global_zero:
            ckpt_io.write_checkpoint_dir(path, {ckpt_io.STATE_FILE: plain})
        self.barrier("save_checkpoint")

    def load_checkpoint(self, path: str | os.PathLike, state: dict[str, Any], strict: bool = True) -> dict[str, Any]:
        """Reads both formats: a full ``state.pt`` and a DCP-sharded directory (resharded to us)."""
        return ckpt_state.load_any(path, state, self.unwrap, ckpt_state.FULL, strict)


def apply_activation_checkpointing(module: nn.Module, policy: Any) -> None:
    """Recompute the activations of the selected layers in backward (torch's non-reentrant
    checkpoint). ``policy``: see ``checkpointed_layers``."""
    if not policy:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing as apply_ac,
        checkpoint_wrapper,
    )

    chosen = {id(m) for m in checkpointed_layers(module, policy)}
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_ac(module, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: id(m) in chosen)


def checkpointed_layers(module: nn.Module, policy: Any) -> list[nn.Module]:
    """The layers an activation-checkpointing ``policy`` selects: a set of layer classes, a
    callable ``(module) -> bool``, or ``{"classes": {...}, "every_n": k}`` for every k-th
    matching layer."""
    if not policy:
        return []
    every_n = 1
    if isinstance(policy, dict):
        every_n = int(policy.get("every_n", 1))
        if every_n < 1:
            raise ValueError(f"activation checkpointing every_n must be >= 1, got {every_n}")
        policy = policy["classes"]
    if callable(policy) and not isinstance(policy, type):
        return [m for m in module.modules() if policy(m)]
    classes = tuple(policy) if isinstance(policy, (set, list, tuple, frozenset)) else (policy,)
    matches = [m for m in module.modules() if isinstance(m, classes)]
    return [m for i, m in enumerate(matches) if i % every_n == 0]


def _as_timedelta(value: timedelta | float | None) -> timedelta | None:
    return value if value is None or isinstance(value, timedelta) else timedelta(seconds=float(value))


def _elastic_attempt_store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """torchrun's agent keeps one store for the whole job. After a restart, the keys the dead
    attempt's ranks wrote (their gloo addresses) are still in it, and a new rank can read a dead
    peer's address before the live peer overwrites it: "connectFullMesh failed ... Connection
    refused". Each attempt gets its own key space."""
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=not agent_hosts_store and rank == 0, timeout=timeout,
    )
    return dist.PrefixStore(f"distrain/attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Makes ``torch.nn.init.*`` no-ops: memory is allocated, nothing is written into it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs.get("tensor")
        return func(*args, **(kwargs or {}))


def wrap(module: nn.Module) -> nn.Module:
    """Mark ``module`` as its own sharded unit (call inside ``configure_model``). Sharding
    strategies shard it separately; every other strategy ignores the mark."""
    module._distrain_wrap = True
    return module


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
