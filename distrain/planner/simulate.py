"""FSDP's per-rank memory, simulated: the real FSDP2 on a fake process group of the planned world
size, under fake tensors, measured by torch's ``FSDPMemTracker``.

distrain's own ``FSDPStrategy`` shards the module (same units, mixed-precision policy, activation
checkpointing and ``reshard_after_forward`` as a run), then one training step runs as the Trainer
runs it: accumulation micro-steps without gradient sync, the last with it, the
optimizer step. The tracker's peak, by kind (sharded and unsharded parameters and gradients,
activations, all-gather and reduce-scatter buffers, optimizer state), is the prediction. This is
torchtitan's memory estimator, applied to every sharding and to distrain's own set-up.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from distrain import distributed
from distrain.config import Refusal
from distrain.planner import fake
from distrain.planner.model_stats import (
    ModelSpec,
    checkpoint_policy,
    create_optimizer_state,
    first_optimizer,
    loss_of,
    use_foreach,
)


@dataclass
class FSDPPeak:
    """Per-rank bytes at the peak, by what they hold."""

    params: int
    grads: int
    optimizer: int
    buffers: int
    """All-gather outputs and reduce-scatter inputs."""
    peak: int
    sharded_state: int
    """Sharded parameters, sharded gradients and optimizer state: what CPU offload moves to the host."""


def start_fsdp_simulation(*args, **kwargs) -> Started:
    """One rank's peak during a training step under FSDP2 (``sharding``: FULL_SHARD, SHARD_GRAD_OP
    or HYBRID_SHARD), simulated in a forked child process: a simulation leaves state behind in the
    process that ran it (DTensors built afterwards on a real group placed their shards as the fake
    group's rank 0 — every rank the same shard — and checkpoints failed), and the process that
    plans is the one that trains (rank 0 of ``distrain train``). Started now, its result read later
    (``Started.result``): simulations started together run side by side."""
    return Started(_simulate_fsdp, args, kwargs)


def simulate_tensor_parallel(*args, **kwargs) -> TensorParallelStep:
    """One rank's memory and communication in a training step under tensor parallelism (alone, or
    in 2-D with FSDP over the data-parallel ranks), simulated in a forked child as FSDP's is."""
    return start_tensor_parallel_simulation(*args, **kwargs).result()


def start_tensor_parallel_simulation(*args, **kwargs) -> Started:
    """``simulate_tensor_parallel`` started, its result read later."""
    return Started(_simulate_tensor_parallel, args, kwargs)


class Started:
    """A simulation running in a child process; ``result()`` waits for it. At most one child per core runs at once:
    starting another first waits for the oldest.

    The child is forked (nothing to import, nothing to pickle) on a machine without a GPU. Where a GPU is present it
    is a fresh interpreter that sees none (``CUDA_VISIBLE_DEVICES=""``): a child forked from a process that has
    touched CUDA (asking whether a GPU exists is enough) fails at its first CUDA call with "CUDA error:
    initialization error", and on a GPU machine torch's fake tensors and FSDP2 make such calls. A fresh child
    receives the spec made portable (``ModelSpec.portable``) and runs the same CPU code as a forked one."""

    running: list[Started] = []
    fresh: bool | None = None
    """A fresh interpreter rather than a fork; None: where a GPU is present (tests set True to run that path)."""

    def __init__(self, simulation, args, kwargs):
        while len(Started.running) >= _cores():
            Started.running[0]._collect()
        fresh = _machine_has_gpu() if Started.fresh is None else Started.fresh
        self._child = _FreshChild(simulation, args, kwargs) if fresh else _ForkedChild(simulation, args, kwargs)
        self._outcome = None
        Started.running.append(self)

    def _collect(self) -> None:
        self._outcome = self._child.outcome()
        Started.running.remove(self)

    def result(self):
        if self._outcome is None:
            self._collect()
        ok, value = self._outcome
        if not ok:
            raise value
        return value


class _ForkedChild:
    def __init__(self, simulation, args, kwargs):
        import multiprocessing

        if "fork" not in multiprocessing.get_all_start_methods():
            raise RuntimeError("simulating a sharded layout needs os.fork (Linux, macOS) where there is no GPU")
        # torch imports its compiler (torch._dynamo, ~2 s of a core) at the first call of any function it marks as
        # never compiled: fake tensors, FSDP, an optimizer's constructor. Every child made that first call and
        # imported it again (a plan of 7B forks a dozen); imported here once, each inherits it
        import torch._dynamo  # noqa: F401

        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        self._process = context.Process(target=_forked_main, args=(send, simulation, args, kwargs), daemon=True)
        with distributed.inherited_never_collected():
            self._process.start()
        send.close()

    def outcome(self) -> tuple[bool, object]:
        try:
            outcome = self._receive.recv()
        except EOFError:
            outcome = (False, RuntimeError(f"the simulation died (exit code {self._process.exitcode})"))
        self._receive.close()
        self._process.join()
        return outcome


class _FreshChild:
    def __init__(self, simulation, args, kwargs):
        import inspect
        import subprocess
        import sys
        import tempfile

        import cloudpickle

        bound = inspect.signature(simulation).bind(*args, **kwargs)
        bound.arguments["spec"] = bound.arguments["spec"].portable(bound.arguments["micro_batch"])
        # cloudpickle: a module class defined in the running script (``__main__``, a notebook) travels by value, as
        # the fresh interpreter cannot import it; everything else by reference, as pickle does
        payload = cloudpickle.dumps((simulation, bound.args, bound.kwargs))
        env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": "",
            # this process's import path: the script's folder and the model's modules, as a forked child has them
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
        command = [sys.executable, "-c", "from distrain.planner.simulate import _fresh_main; _fresh_main()"]
        # the payload from a file, not a pipe: writing more than a pipe holds would wait for the child's imports, and
        # the children started together would start one after another
        with tempfile.TemporaryFile() as stdin:
            stdin.write(payload)
            stdin.seek(0)
            self._process = subprocess.Popen(command, stdin=stdin, stdout=subprocess.PIPE, env=env)

    def outcome(self) -> tuple[bool, object]:
        import pickle

        data = self._process.stdout.read()
        self._process.stdout.close()
        code = self._process.wait()
        try:
            return pickle.loads(data)
        except Exception:  # noqa: BLE001 — nothing (or half) was written: the child died
            return False, RuntimeError(f"the simulation died (exit code {code})")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _machine_has_gpu() -> bool:
    """Whether a CUDA GPU is visible, asked without initialising CUDA here (``device_count`` asks NVML first)."""
    return torch.cuda._is_compiled() and torch.cuda.device_count() > 0


def _outcome_of(run) -> tuple[bool, object]:
    try:
        return True, run()
    except Refusal as e:  # the run's own refusal: the parent stops the launch with its line
        return False, Refusal(str(e))
    except BaseException as e:  # sent back and raised in the parent
        return False, RuntimeError(f"{type(e).__name__}: {e}")


def _forked_main(send, simulation, args, kwargs) -> None:
    distributed.in_a_forked_child()
    send.send(_outcome_of(lambda: simulation(*args, **kwargs)))
    send.close()


def _fresh_main() -> None:
    """A fresh child (``_FreshChild``): the simulation from standard input, its outcome to standard output; whatever
    else the child prints goes to standard error, so only the outcome travels on that pipe. What fails to unpickle
    (a class the child cannot rebuild) is an outcome too: the plan's one line names it."""
    import pickle
    import sys

    result = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)

    def run():
        simulation, args, kwargs = pickle.loads(sys.stdin.buffer.read())
        return simulation(*args, **kwargs)

    pickle.dump(_outcome_of(run), result)
    result.close()


def _simulate_fsdp(
    spec: ModelSpec,
    micro_batch: int,
    *,
    world_size: int,
    num_nodes: int = 1,
    sharding: str = "FULL_SHARD",
    precision: str = "32-true",
    checkpoint: int | None = 0,
    accumulate: int = 1,
    foreach: bool = False,
    options: dict | None = None,
) -> FSDPPeak:
    """The simulation itself, in a forked child (it makes a fake process group; an inherited one is forgotten)."""
    from torch.distributed.device_mesh import init_device_mesh

    from distrain.strategies.fsdp import FSDPStrategy

    with fake.fake_process_group(world_size, forked_child=True):
        if sharding == "HYBRID_SHARD":
            mesh = init_device_mesh("cpu", (num_nodes, world_size // num_nodes), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
        strategy = FSDPStrategy(
            sharding_strategy=sharding,
            device_mesh=mesh,
            auto_wrap_policy=set(spec.block_classes) or None,
            activation_checkpointing_policy=checkpoint_policy(
                spec.block_classes, checkpoint, spec.selective_checkpointing
            ),
            **(options or {}),
        )
        _connect(strategy, precision, world_size, num_nodes)
        with _set_up(strategy, spec, micro_batch, foreach) as (model, optimizer, batch):
            tracker = fake.fsdp_memory_tracker_class()(model, optimizer)
            tracker.track_inputs(tuple(t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)))
            with tracker:
                # with accumulation, the micro-steps before the last keep unsharded gradients (no
                # reduce-scatter); one of them shows what all of them hold
                micro_steps = min(accumulate, 2)
                for i in range(micro_steps):
                    if i:
                        tracker.reset_mod_stats()  # FSDPMemTracker refuses a module's second forward otherwise
                    sync = i == micro_steps - 1
                    with contextlib.nullcontext() if sync else strategy.no_backward_sync(model):
                        with strategy.precision.autocast():
                            loss = loss_of(model("training_step", batch, 0))
                        (loss / micro_steps).backward()
                        del loss
                # no clip_grad_norm_: in place on the sharded gradients in a real run (measured: the same
                # peak with and without), while DTensor's foreach multiply under fake tensors is not
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            snapshot = tracker.get_tracker_snapshot("peak")
    return _peak_of(snapshot)


def _connect(strategy, precision: str, world_size: int, num_nodes: int) -> None:
    """The strategy told its devices, precision and ranks, as the launcher tells a run's."""
    from distrain.accelerators import Accelerator
    from distrain.cluster import detect_cluster
    from distrain.precision import Precision

    # fp16 runs as bf16 here (same bytes): a CPU simulation cannot build a 16-mixed Precision
    sim_precision = "bf16-mixed" if precision == "16-mixed" else precision
    simulated = Precision(sim_precision, "cpu", simulated=True)
    strategy.connect(Accelerator(), simulated, detect_cluster(), world_size, num_nodes)


@contextlib.contextmanager
def _set_up(strategy, spec: ModelSpec, micro_batch: int, foreach: bool):
    """A connected ``strategy`` set up as a run sets it up, on the model built on the meta device, under fake
    tensors: yields the model, its optimizer with its state, and a batch."""
    from distrain.module import StepRouter

    module = spec.build()
    # the weights' values do not matter: skip every loader a module may run at materialization
    object.__setattr__(module, "reset_parameters", lambda: None)
    fake_mode = fake.fake_tensor_mode(allow_non_fake_inputs=True)
    with (
        fake_mode as mode,
        fake.transformers_as_in_eager(),
        fake.device_meshes_outside_fake_mode(),
        fake.norms_as_on_cuda(foreach),  # a GPU's run: its norms keep what CUDA's kernels keep
    ):
        model = strategy.setup(StepRouter(module)).model
        optimizer = first_optimizer(module.configure_optimizers())
        if foreach:
            use_foreach(optimizer)
        create_optimizer_state(model, optimizer)
        yield model, optimizer, tree_map_only(torch.Tensor, mode.from_tensor, spec.make_batch(micro_batch))


def _peak_of(snapshot: dict) -> FSDPPeak:
    kinds: dict[str, int] = {}
    for device, per_device in snapshot.items():
        if device.type == "meta":
            continue
        for kind, nbytes in per_device.items():
            name = getattr(kind, "value", kind)
            kinds[name] = kinds.get(name, 0) + nbytes
    k = lambda *names: sum(kinds.get(n, 0) for n in names)  # noqa: E731
    return FSDPPeak(
        params=k("Sharded Param", "Unsharded Param", "Buffer"),
        grads=k("Sharded Grad", "Unsharded Grad"),
        optimizer=k("OptState"),
        buffers=k("All Gather", "Reduce Scatter"),
        peak=k("Total"),
        sharded_state=k("Sharded Param", "Sharded Grad", "OptState"),
    )


# ---- tensor parallelism ----------------------------------------------------------------------------------
@dataclass
class TensorParallelStep:
    """One rank's bytes in a tensor-parallel step, and the collectives one micro-batch's forward and
    backward sends (``(kind, bytes of the whole tensor, ranks, FSDP's over the data-parallel ranks)``;
    the step's own, such as the gradient norm's, in ``step_collectives``)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    """Alive at the forward/backward peak besides parameters and optimizer state (gradients included)."""
    peak: int
    collectives: list[tuple[str, float, int, bool]]
    step_collectives: list[tuple[str, float, int, bool]]


class _CollectiveLog(TorchDispatchMode):
    """Records the collectives a step issues (functional collectives: DTensor's redistributes and the
    loss's; c10d's: FSDP's) under the current ``phase``; runs each as it is."""

    def __init__(self):
        super().__init__()
        self.phase = "forward_backward"
        self.seen: dict[str, list] = {"forward_backward": [], "step": []}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        entry = _collective_entry(func, args)
        if entry is not None:
            self.seen[self.phase].append(entry)
        return out


def _collective_entry(func, args) -> tuple[str, float, int, bool] | None:
    import torch.distributed as dist

    if func.namespace not in ("_c10d_functional", "c10d"):  # every other operation of the step: nothing to log
        return None
    name = func._overloadpacket.__name__.replace("_", "")  # all_reduce, allreduce_, _allgather_base_, ...
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    kind = next((k for k in kinds if k.replace("_", "") in name), None)
    if kind is None:
        return None
    tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
    boxed = [a for a in args if isinstance(a, torch.ScriptObject)]
    if boxed:  # c10d's ops take the group itself, boxed (FSDP's gathers and reductions: output, input)
        ranks = dist.ProcessGroup.unbox(boxed[0]).size()
        size = max(t.numel() * t.element_size() for t in tensors)
    else:  # functional collectives name their group, after the reduce op
        name = next(a for a in reversed(args) if isinstance(a, str))
        ranks = dist.distributed_c10d._resolve_process_group(name).size()
        size = tensors[0].numel() * tensors[0].element_size()
        if kind == "all_gather":
            size *= ranks  # the input is one rank's part
    return kind, float(size), ranks, bool(boxed)


def _simulate_tensor_parallel(
    spec: ModelSpec,
    micro_batch: int,
    *,
    world_size: int,
    tensor: int,
    sequence_parallel: bool = True,
    precision: str = "32-true",
    checkpoint: int | None = 0,
    accumulate: int = 1,
    foreach: bool = False,
    context: int = 1,
    experts: int = 1,
) -> TensorParallelStep:
    """distrain's ``ModelParallelStrategy`` on a fake process group, under fake tensors, one training
    step as the Trainer runs it. The peak is taken over forward and backward; the optimizer step's is
    counted (its state, parameters and gradients): fake DTensors' fused optimizer kernels allocate
    outputs that a real run updates in place."""
    from distrain.strategies.model_parallel import ModelParallelStrategy

    with fake.fake_process_group(world_size, forked_child=True):
        strategy = ModelParallelStrategy(
            tensor_parallel_size=tensor,
            data_parallel_size=world_size // (tensor * context),
            context_parallel_size=context,
            expert_parallel_size=experts,
            sequence_parallel=sequence_parallel,
            activation_checkpointing_policy=checkpoint_policy(
                spec.block_classes, checkpoint, spec.selective_checkpointing
            ),
        )
        _connect(strategy, precision, world_size, 1)
        strategy.device_mesh = strategy.layout.mesh("cpu")  # as a rank's setup_environment builds it
        with _set_up(strategy, spec, micro_batch, foreach) as (model, optimizer, batch):
            tracker = fake.peak_memory_tracker()
            tracker.track_external(model, optimizer)
            log = _CollectiveLog()
            micro_steps = min(accumulate, 2)  # the second shows what accumulation holds
            with tracker, log:
                for i in range(micro_steps):
                    sync = i == micro_steps - 1
                    with contextlib.nullcontext() if sync else strategy.no_backward_sync(model):
                        with strategy.precision.autocast():
                            loss = loss_of(model("training_step", batch, 0))
                        strategy.backward(loss / micro_steps, model)
                        del loss
                    if i == 0:
                        per_micro_batch = list(log.seen["forward_backward"])
                peak = tracker.peak_bytes()
                log.phase = "step"
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            local = lambda t: getattr(t, "_local_tensor", t)  # noqa: E731
            nbytes = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)  # noqa: E731
            params = nbytes(model.parameters())  # each tied parameter once, as parameters() yields it
            grads = nbytes(p for p in model.parameters() if p.requires_grad)
            opt = nbytes(v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    return TensorParallelStep(
        params=params,
        grads=grads,
        optimizer=opt,
        activations=max(0, peak - params - opt),
        peak=max(peak, params + grads + opt),
        collectives=per_micro_batch,
        step_collectives=log.seen["step"],
    )
