"""``strategy: auto`` and ``activation_checkpointing: auto``, decided once per job and in one place, for
``distrain train`` and ``Trainer(strategy="auto")`` alike, before the strategy exists.

- **The choice** (``choose``): the planner's fastest option that fits (``Planner.choose``), and the one line that
  says why. When nothing fits: the plan's table, and the run stops before any rank starts.
- **The fallback** (``fallback``): when the planner itself fails, what ``auto`` meant before the planner (one
  process: single, several: DDP), with a note. The plan is advice; a run never fails because the planner did.
- **Sharing** (``shared``): the process that plans is the one that starts the ranks (our launcher re-runs the
  command in each, and each takes the decision from ``PLANNED_ENV``), or rank 0 under an outside launcher (torchrun,
  srun), whose decision every rank takes (``distributed.decide_before_strategy``).
- **The fingerprint** (``fingerprint``): what a decision was made for; a rank takes an inherited decision only
  for the same inputs.

Both keep their decisions between starts (``cache.py``, ``_kept_or``): ``distrain train`` plans its config
(``for_config``), the Trainer its module and loader (``for_trainer``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from distrain.config import Refusal
from distrain.planner.plan import Budget, Planner, option_for_run
from distrain.units import human

if TYPE_CHECKING:
    from distrain.config import RunConfig
    from distrain.planner.estimate import Job, Row
    from distrain.planner.timing import Hardware

#: the decision of the process that planned, for the ranks its launcher starts (they re-run the command)
PLANNED_ENV = "DISTRAIN_PLANNED"


@dataclass
class Decision:
    """What the planner decided for a run."""

    strategy: str
    sharding: str | None = None
    checkpoint: int | None = 0
    """Blocks to checkpoint: 0 none, ``None`` every one (the planner's; the config's when not planned)."""
    planned_checkpoint: bool = False
    """The planner chose ``checkpoint`` (else the config's activation checkpointing applies)."""
    accumulate: int | None = None
    """Micro-batches per optimizer step, when the plan changes them: a tensor-parallel or pipeline layout that
    ``auto`` chose keeps the config's global batch with more micro-batches per data-parallel rank."""
    context: int = 1
    """Ranks that split each sequence, when the plan chose context parallelism (with no tensor parallelism)."""
    experts: int = 1
    """Ranks that split each mixture-of-experts layer's experts, when the plan chose expert parallelism."""
    sync_each: bool = False
    """FSDP reduce-scatters after every micro-batch (``fsdp.sync_each_micro_batch``), when the plan chose it."""
    messages: list[str] = field(default_factory=list)
    stop: bool = False

    def strategy_options(self, block_classes, selective: bool = False) -> dict[str, Any]:
        """The strategy's keyword arguments this decision sets (``selective``: checkpointed blocks recompute per
        operation)."""
        options: dict[str, Any] = {}
        if self.sharding is not None:
            options["sharding_strategy"] = self.sharding
        if self.context > 1:
            options.update(context_parallel_size=self.context, tensor_parallel_size=1)
        if self.experts > 1:
            options["expert_parallel_size"] = self.experts
        if self.sync_each:
            options["sync_each_micro_batch"] = True
        if self.planned_checkpoint:
            from distrain.planner.model_stats import checkpoint_policy

            policy = checkpoint_policy(tuple(block_classes), self.checkpoint, selective)
            options["activation_checkpointing_policy"] = policy
        return options

    def shared_values(self) -> dict[str, Any]:
        """What the ranks take from the process that planned (which prints the messages)."""
        return {name: getattr(self, name) for name in _FIELDS}

    def to_env(self, fingerprint: str) -> str:
        return json.dumps({"fingerprint": fingerprint, **self.shared_values()})

    @classmethod
    def from_env(cls, text: str, fingerprint: str) -> Decision | None:
        """The decision the launching process took for the same inputs, if it took one."""
        try:
            values = json.loads(text)
        except ValueError:
            return None
        if not isinstance(values, dict) or values.pop("fingerprint", None) != fingerprint:
            return None
        return cls.from_values(values)

    @classmethod
    def from_values(cls, values: Any, with_messages: bool = False) -> Decision | None:
        """The decision ``values`` hold (``shared_values()``, and its ``messages`` where ``with_messages``: a kept
        file), or None when they are not what distrain writes. Read as untrusted: each field of its type and range,
        a strategy only ever a registered name (nothing here names code to import)."""
        from distrain.strategies import registry
        from distrain.strategies.fsdp import SHARDING_STRATEGIES

        fields = {**_FIELDS, "messages": (list,)} if with_messages else _FIELDS
        if not isinstance(values, dict) or set(values) != set(fields):
            return None
        if any(type(values[name]) not in types for name, types in fields.items()):  # bool is no int here, nor int bool
            return None
        least = {"checkpoint": 0, "accumulate": 1, "context": 1, "experts": 1}
        if any(isinstance(values[name], int) and values[name] < low for name, low in least.items()):
            return None
        if values["strategy"] not in registry.names() or values["sharding"] not in (None, *SHARDING_STRATEGIES):
            return None
        if with_messages and not all(isinstance(m, str) for m in values["messages"]):
            return None
        return cls(**values)


#: a decision's fields that the ranks take from the process that planned and a later start takes from the kept
#: plan (``cache.py``), with the types each may take
_FIELDS: dict[str, tuple[type, ...]] = {
    "strategy": (str,),
    "sharding": (str, type(None)),
    "checkpoint": (int, type(None)),
    "planned_checkpoint": (bool,),
    "accumulate": (int, type(None)),
    "context": (int,),
    "experts": (int,),
    "sync_each": (bool,),
}


def fingerprint(*inputs: Any) -> str:
    """What a decision is for: the hash of its inputs."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]


def shared(fingerprint: str, plan: Callable[[], Decision], accelerator: str, backend, timeout: timedelta) -> Decision:
    """The job's one decision for ``fingerprint``: the launching process's, when it took one; else ``plan()`` on
    rank 0 (every rank waits for it and takes it) or in this process alone. Kept in ``PLANNED_ENV`` for the ranks
    this process starts and for a later look-up here."""
    from distrain import distributed

    decision = inherited(fingerprint)
    if decision is None:
        decision = distributed.decide_before_strategy(plan, accelerator, backend, timeout)
        os.environ[PLANNED_ENV] = decision.to_env(fingerprint)
    return decision


def inherited(fingerprint: str) -> Decision | None:
    """In a rank our launcher started: the decision its parent took for the same inputs."""
    text = os.environ.get(PLANNED_ENV)
    return Decision.from_env(text, fingerprint) if text and os.environ.get("DISTRAIN_LAUNCHED") else None


def choose(planner: Planner, checkpointing: bool | str) -> Decision:
    """``strategy: auto`` for the planner's job. ``checkpointing``: the run's activation checkpointing: ``"auto"``
    (the planner checkpoints just enough blocks), True (every block: the run's own policy) or False (none, unless
    only checkpointing fits: then the planner's)."""
    plan_checkpoints = "auto" if checkpointing == "auto" else (True if checkpointing else "both")
    row, seen = planner.choose("auto", plan_checkpoints)
    if row is None:
        return Decision(
            strategy="auto",
            stop=True,
            messages=[
                planner.plan("all", "both").table(),
                f"distrain: nothing fits in {human(planner.budget.usable)} per rank; not starting "
                "(`distrain plan` with the same arguments shows this table)",
            ],
        )
    option = row.option
    return Decision(
        strategy=option.strategy,
        sharding=option.model.settings(option).get("sharding_strategy"),
        checkpoint=option.checkpoint,
        planned_checkpoint=checkpointing == "auto" or (checkpointing is False and option.checkpoint != 0),
        accumulate=row.accumulate if row.accumulate != planner.job.accumulate else None,
        context=option.context,
        experts=option.get("experts") or 1,
        sync_each=bool(option.get("sync_each")),
        messages=[f"distrain: strategy auto → {planner.reason(row, seen)}"],
    )


def fallback(strategy: str, why: str) -> Decision:
    """The run as it would start without a plan, and why there is none."""
    return Decision(strategy=strategy, messages=[f"distrain: strategy {strategy}, unplanned: {why}"])


def failed(strategy: str, error: BaseException, named: bool = False) -> Decision:
    """The planner could not plan the run: it starts unplanned, unless the run ``named`` its strategy and what
    stopped the plan is that strategy's own refusal, met planning its layout: then nothing starts, and the refusal
    is the one line. (Under ``auto`` a refusal came from a layout the run may not take: it starts unplanned.)"""
    if named and isinstance(error, Refusal):
        return Decision(strategy=strategy, stop=True, messages=[f"distrain: error: {error}"])
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return fallback(strategy, f"the memory planner could not plan this run ({type(error).__name__}: {first})")


def rates_or_none(job: Job) -> Hardware | None:
    """The rates to time options with, or None (then the ranking order decides) when they cannot be had."""
    from distrain.planner.machine import resolve_hardware

    try:
        return resolve_hardware(job.gpu, job.precision, job.per_node)
    except Exception:  # noqa: BLE001 — timing refines the choice; a plan without it is still a plan
        return None


def print_messages(decision: Decision) -> None:
    """The decision's lines, on rank 0: a stop and a warning to stderr."""
    if int(os.environ.get("RANK", 0)) != 0:
        return
    for message in decision.messages:
        print(message, file=sys.stderr if decision.stop or "warning" in message else sys.stdout, flush=True)


# ---- distrain train ------------------------------------------------------------------------------------------
def for_config(config: RunConfig, job=None) -> Decision:
    """Before any rank starts: resolve ``strategy: auto`` and ``activation_checkpointing: auto``, warn when an
    explicit strategy will not fit, stop when nothing fits. Under an outside launcher every rank runs this: rank 0
    plans and the others take its decision or, when there is nothing to decide, skip the plan (rank 0 warns)."""
    from distrain.cluster import detect_cluster

    d = config.distributed
    key = fingerprint(config.to_dict())
    if d.strategy != "auto" and config.training.activation_checkpointing != "auto":  # nothing to share
        decision = inherited(key)
        if decision is None and detect_cluster().rank != 0:  # only a warning to compute, and rank 0 prints it
            return Decision(strategy=d.strategy)
        if decision is None:
            decision = _kept_or_planned(config, job)
            os.environ[PLANNED_ENV] = decision.to_env(key)
        return decision
    timeout = timedelta(seconds=d.timeout_seconds)
    return shared(key, lambda: _kept_or_planned(config, job), d.accelerator, d.backend, timeout)


def _kept_or_planned(config: RunConfig, job) -> Decision:
    """``_kept_or`` for a config: its key (``cache.key``) and its plan (``_planned``)."""
    from distrain.planner import cache
    from distrain.planner.from_config import budget_from_config, plans_for_gpu, ranks_per_node
    from distrain.precision import Precision

    try:
        gpu = plans_for_gpu(config)
    except Exception as e:  # noqa: BLE001 — the plan is advice
        return failed(_without_plan(config), e)
    try:  # a precision these devices cannot run: no layout can, and the run would refuse it at once (one line)
        Precision(config.training.precision, "cuda" if gpu else "cpu")
    except ValueError as e:
        return Decision(_without_plan(config), stop=True, messages=[f"distrain: error: {e}"])
    try:
        per_node = ranks_per_node(config, gpu)
        key = lambda: cache.key(config, budget_from_config(config, gpu, per_node), per_node)  # noqa: E731
        return _kept_or(key, lambda: _planned(config, job))
    except Exception as e:  # the plan is advice; training must not depend on it (but a refusal stops it)
        return failed(_without_plan(config), e, named=config.distributed.strategy != "auto")


def _kept_or(key: Callable[[], str], plan: Callable[[], Decision]) -> Decision:
    """The decision kept under ``key()`` on this machine (``cache.py``), else ``plan()``'s, kept for the next start."""
    from distrain.planner import cache

    decision = Decision.from_values(cache.read(key()), with_messages=True)
    if decision is not None:  # this run (or its twin) was planned before on this machine: no trace, no timing
        decision.messages = [f"{m} (planned before: {cache.directory()})" for m in decision.messages]
        return decision
    decision = plan()
    if not decision.stop:
        # the key again: a first plan on this machine has just measured and kept its rates, which the next start's
        # key includes
        cache.write(key(), {**decision.shared_values(), "messages": decision.messages})
    return decision


def _without_plan(config: RunConfig) -> str:
    """``auto`` as it was before the planner: one process → single, several → ddp."""
    from distrain.planner.from_config import plans_for_gpu, ranks_per_node

    d = config.distributed
    if d.strategy != "auto":
        return d.strategy
    try:
        return "ddp" if ranks_per_node(config, plans_for_gpu(config)) * d.num_nodes > 1 else "single"
    except Exception:
        return "auto"


def _planned(config: RunConfig, job) -> Decision:
    from distrain.planner.from_config import budget_from_config, job_from_config, plans_for_gpu

    d, ac = config.distributed, config.training.activation_checkpointing
    gpu = plans_for_gpu(config)
    job = job_from_config(config, gpu, job)
    budget = budget_from_config(config, gpu, job.per_node)
    if d.strategy == "auto":  # the fastest predicted option that fits, on this machine's rates
        return choose(Planner(job, budget, rates_or_none(job)), ac)
    planner = Planner(job, budget)  # a named strategy: its memory only
    option = option_for_run(d.strategy, job)
    if option is None:
        return Decision(strategy=d.strategy)
    if ac == "auto":
        row = planner.fitting_checkpoint(option)
        if row is None:
            every = planner.row(replace(option, checkpoint=None), max_batch=False)
            return Decision(
                d.strategy, checkpoint=None, planned_checkpoint=True, messages=[_does_not_fit(every, budget)]
            )
        blocks = "no blocks" if row.option.checkpoint == 0 else "every block"
        if row.option.checkpoint not in (0, None):
            blocks = f"the first {row.option.checkpoint} of {job.spec.num_blocks} blocks"
        return Decision(
            strategy=d.strategy,
            checkpoint=row.option.checkpoint,
            planned_checkpoint=True,
            messages=[
                f"distrain: activation_checkpointing auto → {blocks}: {human(row.peak)} per rank "
                f"of {human(budget.usable)}"
            ],
        )
    row = planner.row(replace(option, checkpoint=None if ac else 0), max_batch=False)
    return Decision(strategy=d.strategy, messages=[] if row.fits else [_does_not_fit(row, budget)])


def _does_not_fit(row: Row, budget: Budget) -> str:
    return (
        f"distrain: warning: the memory plan says {row.label} needs {human(row.peak)} per rank, more than "
        f"the {human(budget.usable)} usable ({budget.source}): it will not fit. `distrain plan` with the same "
        "arguments shows what would"
    )


# ---- Trainer(strategy="auto") --------------------------------------------------------------------------------
def for_trainer(runtime, module, loader, accumulate: int, clip: float | None, kwargs: dict[str, Any]):
    """(the strategy to train ``module`` with, or None to keep the runtime's; the micro-batches per step when the
    choice changes them, else None). Prints the decision and why; raises when nothing fits."""
    from distrain.planner.model_stats import ModelSpec
    from distrain.strategies.layers import is_selective
    from distrain.strategies.registry import lookup, make_strategy, options_of

    world = runtime.nprocs * runtime.num_nodes
    if world == 1:
        return None, None
    key = fingerprint(type(module).__qualname__, getattr(loader, "batch_size", None), world, accumulate)
    strategy = runtime.strategy
    plan = lambda: _trainer_plan(runtime, module, loader, accumulate, clip, kwargs)  # noqa: E731
    decision = shared(key, plan, runtime.accelerator.name, strategy.process_group_backend, strategy.timeout)
    for message in decision.messages:
        runtime.print(message)
    if decision.stop:
        raise RuntimeError(decision.messages[-1].removeprefix("distrain: "))
    # the module's block classes only when the plan checkpoints them (finding them builds its spec)
    blocks = ModelSpec.from_module(module, loader).block_classes if decision.planned_checkpoint else ()
    takes = options_of(lookup(decision.strategy)) or kwargs.keys()
    not_taken = sorted(kwargs.keys() - takes)
    if not_taken:  # options for a strategy auto did not choose
        runtime.print(f"distrain: strategy auto chose {decision.strategy}, which does not take {', '.join(not_taken)}")
    selective = is_selective(kwargs.get("activation_checkpointing_policy"))
    options = {k: v for k, v in kwargs.items() if k in takes} | decision.strategy_options(blocks, selective)
    return make_strategy(decision.strategy, world, **options), decision.accumulate


def _trainer_plan(runtime, module, loader, accumulate: int, clip: float | None, kwargs: dict[str, Any]) -> Decision:
    from torch.utils.data import DataLoader

    from distrain.planner.estimate import Job
    from distrain.planner.model_stats import ModelSpec
    from distrain.strategies.layers import is_selective

    if not isinstance(loader, DataLoader) or loader.batch_size is None or not hasattr(loader.dataset, "__len__"):
        return fallback("ddp", "the memory planner needs a DataLoader with a batch size")
    from distrain.planner import cache

    policy = kwargs.get("activation_checkpointing_policy")
    try:
        spec = ModelSpec.from_module(module, loader, _policy_classes(policy))
        spec = spec.with_selective_checkpointing() if is_selective(policy) else spec
        gpu = runtime.accelerator.name == "cuda"
        world = runtime.nprocs * runtime.num_nodes
        # compile: the Trainer's compile=, set on the strategy auto replaces
        precision, compile = runtime.precision.name, bool(runtime.strategy.compile)
        job = Job(spec, loader.batch_size, precision, world, runtime.num_nodes, accumulate, clip, gpu, compile)
        budget = Budget.resolve(runtime.nprocs, gpu=gpu)
        run = _trainer_run(spec, job, bool(policy))
        plan = lambda: choose(Planner(job, budget, rates_or_none(job)), bool(policy))  # noqa: E731
        return _kept_or(lambda: cache.key_of(run, budget, job.per_node), plan)
    except Exception as e:  # the plan is advice: training goes on without it
        return failed("ddp", e)


def _trainer_run(spec, job: Job, checkpointing: bool) -> dict[str, Any]:
    """What describes a Trainer's run to the plan cache (``cache.key_of``): its model as the plan builds it (on the
    meta device: each layer's class, each tensor's name, shape and dtype), the source of every class in it (the file's
    size and time; a class with no file, a notebook's, its own source), the first sample's shapes and the job's
    numbers. A changed step, layer, size or batch is another key."""
    import inspect
    import itertools

    import torch
    from torch.utils._pytree import tree_flatten

    from distrain.planner import cache

    def source(cls: type) -> list:
        try:
            return cache.source_stat(inspect.getsourcefile(cls))
        except (OSError, TypeError):  # no file: a notebook's class (its source), or a built-in one (its name)
            pass
        try:
            return [fingerprint(inspect.getsource(cls))]
        except (OSError, TypeError):
            return [f"{cls.__module__}.{cls.__qualname__}"]

    model = spec.build()
    classes = {type(m): None for m in model.modules()}
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    sample = tree_flatten(spec.make_batch(1))[0]
    return {
        "layers": [f"{name}:{type(m).__module__}.{type(m).__qualname__}" for name, m in model.named_modules()],
        "sources": sorted(json.dumps(source(cls)) for cls in classes),
        "tensors": [(name, list(t.shape), str(t.dtype), t.requires_grad) for name, t in tensors],
        "sample": [(list(t.shape), str(t.dtype)) for t in sample if isinstance(t, torch.Tensor)],
        "blocks": [f"{c.__module__}.{c.__qualname__}" for c in spec.block_classes],
        "job": (job.micro_batch, job.precision, job.world_size, job.num_nodes, job.accumulate, job.clip, job.gpu),
        "compile": job.compile,
        "checkpointing": checkpointing,
    }


def _policy_classes(policy) -> tuple[type, ...] | None:
    if isinstance(policy, dict):
        policy = policy.get("classes")
    if isinstance(policy, type):
        return (policy,)
    if isinstance(policy, (set, list, tuple, frozenset)):
        return tuple(policy)
    return None


def decide_auto_strategy(trainer, module, loader, datamodule=None) -> None:
    """A Trainer's strategy="auto": before any rank starts, the memory planner picks the fastest strategy that fits
    this module and micro-batch in the device's memory (DDP, FSDP, with activation checkpointing or
    offload), and says why (``planner/decide.py``). Any other strategy is left alone."""
    from distrain.module import overrides
    from distrain.runtime import isolated_rng

    rt = trainer.runtime
    if rt.auto_options is None or rt.environment_ready:
        return
    options = rt.auto_options
    rt.auto_options = None  # plan once
    with isolated_rng():  # the loader made and read here draws nothing from the script's streams
        if loader is None and datamodule is None and not overrides(module, "prepare_data", "setup"):
            loader = module.train_dataloader()  # the planner reads a batch; this loader needs no set-up first
        # else (a datamodule, or a module whose loader needs prepare_data/setup, which run in the ranks where they
        # can wait for each other): the planner gets no loader and keeps DDP, and says so
        strategy, accumulate = for_trainer(
            rt, module, loader, trainer.loop.accumulate_for(0), trainer.loop.gradient_clip_val, options
        )
    if strategy is not None:
        rt.use_strategy(strategy)
    if accumulate:  # a layout whose ranks share samples: as many more micro-batches, the same global batch
        factor = accumulate // trainer.loop.accumulate_for(0)
        trainer.loop.accumulation = {epoch: n * factor for epoch, n in trainer.loop.accumulation.items()}
