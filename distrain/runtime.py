"""``Runtime``: accelerator + precision + strategy, for users who write their own loop.

    rt = Runtime(strategy="ddp", devices=2)
    rt.launch(main)                       # main(rt) runs in every rank

    def main(rt):
        model, opt = rt.setup(model, opt)
        loader = rt.setup_dataloaders(loader)
        for x, y in loader:
            loss = model(x, y)
            rt.backward(loss)
            opt.step(); opt.zero_grad()

The Trainer is built on exactly this class and nothing beneath it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from distrain import distributed, launch
from distrain.accelerators import auto_device_count, resolve_accelerator
from distrain.checkpoint import state as ckpt_state
from distrain.cluster import detect_cluster, end_fast_at_exit, export_cluster_env
from distrain.data import move_to_device, with_distributed_sampler
from distrain.distributed import watch
from distrain.precision import Precision
from distrain.strategies.base import Strategy
from distrain.strategies.registry import make_strategy
from distrain.training import startup


class Runtime:
    """Accelerator, precision and strategy for a loop of your own, as Lightning Fabric or Accelerate give them:
    the Trainer is built on exactly this. ``Runtime(accelerator, strategy, devices, num_nodes, precision,
    **strategy_kwargs)``; then ``launch(fn)`` (or run under torchrun), ``setup(model, optimizer)``,
    ``backward(loss)``, ``optimizer_step``, ``no_backward_sync``, ``clip_gradients``, the collectives
    (``all_reduce``, ``all_gather``, ``broadcast``, ``barrier``), ``save`` / ``load`` (sharded where the strategy
    shards) and ``autocast``. Rank facts: ``global_rank``, ``local_rank``, ``world_size``, ``is_global_zero``,
    ``device``."""

    def __init__(
        self,
        accelerator: str = "auto",
        strategy: str | Strategy = "auto",
        devices: int | str = "auto",
        num_nodes: int = 1,
        precision: str = "32-true",
        **strategy_kwargs: Any,
    ):
        self.cluster = detect_cluster()
        export_cluster_env(self.cluster)
        self.accelerator = resolve_accelerator(accelerator)
        self.nprocs, num_nodes = self._resolve_devices(devices, num_nodes)
        self.num_nodes = num_nodes
        self.precision = Precision(precision, self.accelerator.name)
        self.strategy = make_strategy(strategy, self.nprocs * num_nodes, **strategy_kwargs)
        #: strategy="auto": it stands for DDP until the Trainer asks the memory planner (its options kept for that)
        self.auto_options = strategy_kwargs if isinstance(strategy, str) and strategy == "auto" else None
        if self.nprocs * num_nodes > 1 and self.strategy.start_method is None:
            raise ValueError(
                f"strategy {type(self.strategy).__name__} runs a single process, but "
                f"{self.nprocs * num_nodes} processes were requested (devices={devices}, num_nodes={num_nodes})"
            )
        self.strategy.connect(self.accelerator, self.precision, self.cluster, self.nprocs, num_nodes)
        self._launcher = self.strategy.launcher(self.nprocs, self.cluster, num_nodes)
        #: NCCL flight-recorder dumps on a collective timeout go here (the Trainer: its run dir)
        self.flight_recorder_dir: str | None = None
        #: each rank's output (``rank_N.log``) and failure record go here (the Trainer: its run dir's logs/)
        self.log_dir: str | None = None
        #: what the memory plan says about this run, ``(host) -> str``: called only once a rank ran out of memory (of
        #: the host's when ``host``: the kernel killed it). The Trainer's fit sets it; a loop of your own may
        self.memory_plan: Callable[[bool], str] | None = None
        self._environment_ready = False

    def _resolve_devices(self, devices: int | str, num_nodes: int) -> tuple[int, int]:
        """(processes on this node, nodes). Under an outside launcher its environment decides; a run that did not
        name its nodes (num_nodes=1) takes the launcher's count, which an elastic one (``--nnodes MIN:MAX``)
        changes from one rendezvous to the next."""
        if self.cluster.source == "kubeflow":
            if num_nodes != self.cluster.num_nodes:
                raise ValueError(
                    f"num_nodes={num_nodes} (from the Trainer/CLI) but the PyTorchJob runs "
                    f"WORLD_SIZE={self.cluster.num_nodes} pods (one per node); make them agree"
                )
            os.environ["NODE_RANK"] = str(self.cluster.node_rank)  # our launcher starts this node's ranks
        if self.cluster.launched_externally:
            world = self.cluster.world_size
            nprocs = self.cluster.local_world_size if devices == "auto" else int(devices)
            if num_nodes == 1 and nprocs == self.cluster.local_world_size and world % nprocs == 0:
                num_nodes = world // nprocs
            if nprocs * num_nodes != world:
                raise ValueError(
                    f"num_nodes × devices = {num_nodes} × {nprocs} = {num_nodes * nprocs} (from the Trainer/CLI) "
                    f"but the {self.cluster.source} environment says WORLD_SIZE={world}; make them agree"
                )
            return nprocs, num_nodes
        if devices == "auto":
            return auto_device_count(self.accelerator), num_nodes
        if not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices must be a positive integer or 'auto', got {devices!r}")
        if self.accelerator.name == "cuda" and devices > torch.cuda.device_count():
            raise ValueError(f"devices={devices} but this machine has {torch.cuda.device_count()} CUDA GPUs")
        return devices, num_nodes

    # ---- where am I --------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self.strategy.world_size

    @property
    def global_rank(self) -> int:
        """This process's rank among all ranks."""
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.strategy.local_rank

    @property
    def node_rank(self) -> int:
        """This node's rank (``NODE_RANK``, else torchrun's ``GROUP_RANK``; 0 when neither is set)."""
        return int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0)))

    @property
    def is_global_zero(self) -> bool:
        """Whether this process is global rank 0."""
        return self.strategy.is_global_zero

    @property
    def device(self) -> torch.device:
        """This rank's device."""
        return self.strategy.root_device

    # ---- launching ------------------------------------------------------------------------------
    def launch(self, fn: Callable | None = None, *args: Any, **kwargs: Any) -> Any:
        """Start every rank and run ``fn(runtime, *args)`` in each; returns rank 0's result.

        With strategy "ddp" in a script, ``launch()`` with no function starts the other ranks
        (running the same script) and sets up this one, as Fabric's does.
        """
        if fn is None:
            if not self.ranks_run_this_script:
                raise ValueError(
                    f"strategy {type(self.strategy).__name__} starts ranks that run a function, not this script: "
                    "call runtime.launch(fn)"
                )
            return self.run_in_ranks(lambda: None)
        return self.run_in_ranks(fn, self, *args, **kwargs)

    def run_in_ranks(self, fn: Callable, *args: Any, collect=None, restore=None, **kwargs: Any) -> Any:
        """``fn(*args)`` in every rank (started now when no launcher did it); rank 0's result. Spawned or forked
        ranks: ``collect()`` runs in every rank after ``fn`` and rank 0's payload reaches ``restore`` here."""
        if self._launcher is not None and hasattr(self._launcher, "log_dir"):
            self._launcher.log_dir = self.log_dir
            self._launcher.explain_memory = self.explain_out_of_memory
        in_rank = functools.partial(_run_in_rank, self, fn)  # picklable, for spawn
        if self._launcher is None:
            return in_rank(*args, **kwargs)
        return self._launcher.launch(in_rank, *args, collect=collect, restore=restore, **kwargs)

    @property
    def ranks_run_this_script(self) -> bool:
        """This process is one of the job's ranks, or becomes rank 0 at ``launch()`` (the others re-run this
        script): False where the ranks run a function in processes of their own (spawn, fork) or this process only
        supervises (replica groups)."""
        return self._launcher is None or self._launcher.starts_this_script

    @property
    def environment_ready(self) -> bool:
        """This rank's device and process group are set up (the strategy can no longer change)."""
        return self._environment_ready

    def use_strategy(self, strategy: Strategy) -> None:
        """Run with ``strategy`` instead (``strategy="auto"``, once decided), before any rank starts. It compiles as
        the Trainer told the strategy it replaces (``compile=``)."""
        strategy.compile = self.strategy.compile
        strategy.connect(self.accelerator, self.precision, self.cluster, self.nprocs, self.num_nodes)
        self.strategy = strategy
        self._launcher = strategy.launcher(self.nprocs, self.cluster, self.num_nodes)
        self.auto_options = None

    def setup_environment(self) -> None:
        """Start (or join) the process group and bind this rank's device; ``launch`` and the Trainer call it."""
        if not self._environment_ready:
            if self.flight_recorder_dir is not None:
                self.strategy.flight_recorder_dir = self.flight_recorder_dir
            self.strategy.setup_environment()
            self._environment_ready = True
            self._check_ranks_agree()

    def _check_ranks_agree(self) -> None:
        """Every rank must run the same strategy; ranks that decided apart (an inherited decision that
        differs) would otherwise wait in each other's collectives. One small all-gather at start-up."""
        if self.strategy.start_method is None or self.world_size == 1:
            return
        names = self.all_gather_object(type(self.strategy).__name__)
        if len(set(names)) > 1:
            each = ", ".join(f"rank {rank}: {name}" for rank, name in enumerate(names))
            raise RuntimeError(f"the ranks of this job run different strategies ({each}); every rank must run one")

    # ---- model, optimizers, data ----------------------------------------------------------------
    def init_module(self, empty_init: bool | None = None):
        """Context to build the model in: on the device (and in a "true" precision's dtype: bf16 for bf16-true)."""
        return self.strategy.module_init_context(empty_init)

    def setup(self, module: nn.Module, *optimizers: torch.optim.Optimizer):
        """Wrap the model for the strategy and move it; returns ``model`` or ``(model, *optimizers)``."""
        self.setup_environment()
        model, optimizers, _ = self.strategy.setup(module, optimizers)
        return (model, *optimizers) if optimizers else model

    def setup_dataloaders(
        self, *loaders: DataLoader, use_distributed_sampler: bool = True, move_to_device: bool = True, seed: int = 0
    ):
        """Give each rank its disjoint share (a resumable DistributedSampler) and move batches to the device.
        Shares are per data-parallel rank: a tensor-parallel group or a pipeline's stages see the same batches."""
        out = []
        dp_size, dp_rank = self.strategy.data_parallel_size, self.strategy.data_parallel_rank
        for loader in loaders:
            if use_distributed_sampler:
                loader = with_distributed_sampler(loader, dp_size, dp_rank, seed)
            out.append(_DeviceLoader(loader, self.device) if move_to_device else loader)
        return out[0] if len(out) == 1 else out

    def to_device(self, batch: Any) -> Any:
        """``batch`` (tensors in any nesting of lists, tuples and dicts) on this rank's device, its floating-point
        tensors in the precision's dtype where it is a "true" one (``16-true``, ``bf16-true``, ``64-true``), as
        Lightning's."""
        return move_to_device(batch, self.device, self.precision.true_dtype)

    def autocast(self):
        """The precision's autocast context for the forward (a no-op in 32-true)."""
        return self.precision.autocast()

    # ---- the step -------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, model: nn.Module | None = None) -> None:
        """``loss.backward()`` through the precision (a GradScaler's scale) and the strategy (DeepSpeed's engine)."""
        self.strategy.backward(loss, model)

    def no_backward_sync(self, model: nn.Module, enabled: bool = True):
        """Skip the gradient all-reduce of backwards inside (gradient accumulation); ``enabled=False`` is a no-op."""
        return self.strategy.no_backward_sync(model, enabled)

    def clip_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (over every rank's shard) to ``max_norm``; returns the norm before clipping."""
        return self.strategy.clip_gradients(model, optimizer, max_norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> None:
        """Step ``optimizer`` through the precision (unscale, skip an overflowed fp16 step) and the strategy."""
        self.strategy.optimizer_step(optimizer, model)

    # ---- collectives ------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean", group=None) -> torch.Tensor:
        """``tensor`` reduced over every rank (or ``group``'s: ``strategy.data_parallel_group`` for the ranks with
        other samples): ``op`` is ``mean``, ``sum``, ``max`` or ``min``."""
        return self.strategy.all_reduce(tensor, op, group)

    def all_reduce_async(self, tensor: torch.Tensor, op: str = "max") -> Callable[[], torch.Tensor]:
        """Start an all-reduce and return a function that waits for its result (no host sync until then)."""
        return self.strategy.all_reduce_async(tensor, op)

    def all_gather(self, tensor: torch.Tensor, group=None) -> torch.Tensor:
        """Every rank's ``tensor`` (or every rank of ``group``'s), stacked along a new first dimension, in rank
        order."""
        return self.strategy.all_gather(tensor, group)

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's ``obj`` (picklable, from this job's own ranks), in rank order."""
        return self.strategy.all_gather_object(obj)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        return self.strategy.broadcast(obj, src)

    def barrier(self, name: str | None = None) -> None:
        """Wait until every rank is here; ``name`` is what a hang report says they were waiting in."""
        self.strategy.barrier(name)

    def decided_on_rank_zero(self, decide: Callable[[], Any]) -> Any:
        """``decide()`` on rank 0, its result (or its exception) on every rank."""
        return distributed.decided_on_rank_zero(decide)

    # ---- hang diagnosis ---------------------------------------------------------------------------
    def mark_phase(self, step: int | None, phase: str) -> None:
        """Record where this rank is; if a collective later times out, the error names the ranks
        that are elsewhere and their step and phase. Cheap: one store write per new phase."""
        watch.mark(step, phase)

    def patient(self, phase: str):
        """Context for a phase that may keep some ranks waiting long (checkpoint IO, rank 0
        tokenizing): its collectives get the process-group init timeout, not the collective one."""
        return watch.patient(phase)

    @contextlib.contextmanager
    def diagnosing_hangs(self, on_error=None):
        """A collective that timed out or lost a peer becomes a CollectiveHangError naming the ranks
        that were elsewhere, and where (fit, validate, test and predict alike); ``on_error(error, hang)`` sees either
        first."""
        try:
            yield
        except BaseException as error:
            hang = self.explain_failure(error)
            if on_error is not None:
                on_error(error, hang)
            if hang is None:
                raise
            raise hang from error

    def explain_failure(self, error: BaseException) -> Exception | None:
        """For an error raised by a collective that timed out or lost a peer: an error naming the
        rank(s) that did not arrive and where they stopped. None for any other error."""
        return watch.explain(error)

    def explain_out_of_memory(self, host: bool = False) -> str:
        """For a rank that ran out of memory (a CUDA out-of-memory error here; ``host``: a rank the kernel killed): what
        the memory plan says, in one line (``memory_plan``); that it is unavailable, and why, when it cannot say."""
        if self.memory_plan is None:
            return "memory plan: unavailable (the Trainer's fit plans; a loop of your own may set Runtime.memory_plan)"
        try:
            return self.memory_plan(host)
        except Exception as e:  # noqa: BLE001 — the line that names the rank must reach the console
            return f"memory plan: unavailable ({type(e).__name__}: {str(e).strip()[:200]})"

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only, flushed."""
        if self.is_global_zero:
            print(*args, **kwargs, flush=True)

    # ---- checkpoints ------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, state: dict[str, Any], background: bool = False):
        """Objects with ``state_dict()`` (model, optimizer, ...) are saved by state; the rest as is.
        ``background``: staged now and written while training goes on; the returned ``Pending`` commits it
        (``.complete()``, every rank together), until then ``path`` is not there."""
        with watch.patient("checkpoint save"):  # rank 0 may write for minutes while others wait
            return self.strategy.save_checkpoint(path, state, background)

    def load(self, path: str | os.PathLike, state: dict[str, Any] | None = None, strict: bool = True) -> dict[str, Any]:
        """Load into ``state``'s objects in place; returns the checkpoint entries not asked for. Without
        ``state``: the checkpoint's entries as plain values, of any strategy's checkpoint — the model's weights
        whole (a sharded checkpoint's optimizer state needs the live optimizer: pass ``state``)."""
        if state is None:
            return ckpt_state.read_plain(path)
        with watch.patient("checkpoint load"):
            return self.strategy.load_checkpoint(path, state, strict=strict)

    @staticmethod
    def seed_everything(seed):
        """``distrain.seed_everything(seed)``: Python, NumPy and torch seeded in this process; returns the seed."""
        return seed_everything(seed)

    def teardown(self) -> None:
        """End the strategy and the process group this runtime started."""
        self.strategy.teardown()
        self._environment_ready = False


def _run_in_rank(runtime: Runtime, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    if runtime.log_dir is not None and not os.environ.get("DISTRAIN_LAUNCHED_CHILD"):
        launch.tee_output(runtime.log_dir, runtime.global_rank)  # a child's output already goes to its log
    try:
        startup.mark("imports and config")
        runtime.setup_environment()
        startup.mark("process group")
        return fn(*args, **kwargs)
    except Exception as error:
        launch.record_failure(runtime.log_dir, runtime.global_rank, error, runtime.explain_out_of_memory)
        raise
    finally:
        if os.environ.get("DISTRAIN_LAUNCHED_CHILD"):  # a rank our launcher started: it ends with its work
            end_fast_at_exit()


def seed_everything(seed: int, workers: bool = True) -> int:
    """Seed Python, NumPy and torch (all devices) in this process; returns the seed, as Lightning's does. Call it
    before building a model outside ``configure_model`` (``Trainer(seed=...)`` seeds only what the Trainer builds).
    ``workers``: accepted so Lightning code runs unchanged — the DataLoader workers of every loader distrain sets up
    are seeded from (seed, rank, epoch) whatever it says."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return seed


class _DeviceLoader:
    """Iterates a DataLoader and moves each batch to the device; the loader stays reachable."""

    def __init__(self, loader: DataLoader, device: torch.device):
        self.loader = loader
        self.device = device

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield move_to_device(batch, self.device)

    @property
    def sampler(self):
        return self.loader.sampler

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)


def rng_state() -> dict[str, Any]:
    """This rank's RNG states as plain lists: they travel through all_gather_object and load
    with weights_only=True."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


@contextlib.contextmanager
def isolated_rng():
    """Python's, NumPy's and torch's random streams as they were before the block (Lightning's ``isolate_rng``)."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
