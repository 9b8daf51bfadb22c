"""Each strategy's cost model: what the planner knows of the runs one strategy file starts.

A strategy's registration names the module of its cost model (``register(..., cost_model="distrain.planner.models.
fsdp")``), imported only when something is planned. That module lists its models in ``MODELS``; each prices the
options of its ``kinds`` (``Option.family``) and answers the same few questions: the layouts it offers a job, the
option a run of one of its strategies takes, its names in a table, each rank's memory, and the step's time. The
planner asks these and nothing else, so a new strategy is its file plus its model's file (the plug-in test adds
both, and nothing here or in ``plan.py`` changes).

The models here: ``replicated`` (one process, DDP and its replica groups), ``fsdp``, ``zero`` (DeepSpeed), ``tensor``
(tensor and context parallel, FSDP over the ranks that remain) and ``pipeline``.
"""

from __future__ import annotations

import importlib
from typing import Any


class CostModel:
    """One family of options and how the planner prices them. The defaults are a replicated model's; each answer
    is about one ``option`` of this model's kinds."""

    kinds: tuple[str, ...] = ()
    """The ``Option.family`` values it prices."""
    shares_samples = False
    """Its ranks share samples (tensor, context or pipeline ranks): planned at the accumulation that keeps the
    job's global batch (``Planner.model_parallel_planners``)."""
    spans_replica_groups = False
    """It runs over replica groups (``ddp_torchft``): the only options a job of several groups is offered."""
    extrapolates_depth = True
    """A deep model is estimated at two shallow depths and extrapolated (a pipeline's stages are traced at full
    depth instead)."""
    sharded_dtypes = False
    """The model's parameters are kept (or gathered) in the compute dtype (FSDP's mixed-precision policy,
    DeepSpeed's bf16 copy); else fp32 under autocast."""
    overlaps_communication = True
    """On a GPU its step takes the longer of compute and communication (``timing.step_time``); False: the two add up
    (tensor parallelism's collectives sit between the computations that need them)."""
    reentrant_checkpointing = False
    """Its activation checkpointing is the reentrant kind (DeepSpeed's)."""
    replaces_optimizer = False
    """The engine steps its own optimizer, not the user's: ranked after an option that shards as much, and never
    chosen by ``auto``."""
    defaults: dict[str, Any] = {}
    """The strategy options a run takes unless told (``settings`` left out of advice when they are these)."""

    # ---- the layouts it offers, and the run's ---------------------------------------------------------------
    def offered(self, job) -> list:
        """The options ``distrain plan`` and ``auto`` look at for ``job`` (without activation checkpointing)."""
        return []

    def option_for_run(self, strategy: str, job):
        """The option a run of ``strategy`` (one of the strategies that name this model) takes, as ``distrain
        train`` would start it; None for what it does not model. A size the run would refuse raises its error."""
        return None

    def auto_may_choose(self, option) -> bool:
        """``strategy: auto`` chooses among the same training as DDP's, only laid out another way."""
        return not self.replaces_optimizer

    # ---- names ------------------------------------------------------------------------------------------
    def strategy(self, option) -> str:
        """The strategy name the option runs as (``--strategy``)."""
        return option.family

    def from_config(self, config) -> dict:
        """What a run's config says to this model (its strategy's own section: FSDP's sharding, the DeepSpeed
        JSON), kept in ``Job.configured``: the one place a model reads a config."""
        return {}

    def configured(self, job) -> dict:
        """What ``from_config`` found for ``job``; {}: the strategy's defaults."""
        return job.configured.get(self.kinds[0], {})

    def settings(self, option) -> dict[str, Any]:
        """The strategy's options (beyond its name) that make a run this option, e.g. FSDP's sharding."""
        return {}

    def level(self, option) -> int:
        """What is sharded (the ranking's first key): 0 nothing, 1 optimizer state, 2 and gradients, 3 and
        parameters within a node, 4 and parameters across every rank, 5 the model split."""
        return 0

    def label(self, option, accumulate: int | None = None) -> str:
        """The table's name of the option (before checkpointing, offload and replica groups), as it runs at
        ``accumulate`` micro-batches per step."""
        return option.family

    def short(self, option) -> str:
        """The name in one-line reasons (``DDP``, ``FSDP``, ``ZeRO-3``)."""
        return option.family

    def offloaded(self, option) -> str:
        """What its offload moves to the host (``opt``, ``opt+params``)."""
        return "opt"

    def sharding(self, option) -> str | None:
        """The sharding a JSON row names (``FULL_SHARD``, ``zero-3``)."""
        return option.get("sharding")

    # ---- memory and time ----------------------------------------------------------------------------------
    def estimate(self, estimator, option):
        """Each rank's bytes, by part (``options.Row``), at the job's depth (or a shallow one: see
        ``extrapolates_depth``)."""
        raise NotImplementedError

    def prefetch(self, estimator, option) -> None:
        """Start what ``estimate`` will wait for (``estimator.start``), so that the simulations of many options run
        side by side; nothing for a model that simulates nothing."""

    def activation_slope(self, estimator, option) -> float:
        """Peak bytes per extra sample of micro-batch: the traced activations at twice the batch."""
        b = estimator.job.micro_batch
        single = estimator.trace(option.family, option.checkpoint).activations
        double = estimator.trace(option.family, option.checkpoint, 2 * b).activations
        return max(0.0, (double - single) / b)

    def step_time(self, estimator, option, hw):
        """Predicted seconds per optimizer step, by part (``timing.StepTime``): the traced bare step of the option's
        kind, as ``time_of`` times it with one gather unit per block and one for the rest."""
        trace = estimator.trace(option.family, option.checkpoint)
        return self.time_of(option, estimator.job, trace, estimator.num_blocks + 1, hw)

    def time_of(self, option, job, trace, units: int, hw):
        """The step of ``trace`` with this option's collectives over ``units`` gather units (what the default
        ``step_time`` asks; a model that overrides ``step_time`` needs none)."""
        raise NotImplementedError

    def seconds_at_least(self, estimator, planner, option, hw) -> float:
        """A bound below ``planner``'s step time of the option that costs no simulation (``estimator``: the
        job's at its own accumulation): the step time itself unless the model has a cheaper bound."""
        return planner.seconds(option)


def data_parallel_kind(option) -> str:
    """The kind whose dtypes a layout that splits the model computes in: FSDP's when it shards over data-parallel
    replicas, else DDP's."""
    return "fsdp" if option.get("sharding") else "ddp"


_MODELS: dict[str, CostModel] = {}
_MODULE_OF_STRATEGY: dict[str, str | None] = {}


def _load() -> None:
    """Import the cost model of every registered strategy (once): each registration names its module. Nothing is
    kept when one fails (the next call says so again)."""
    if _MODULE_OF_STRATEGY:
        return
    from distrain.strategies import registry

    modules = {name: entry.cost_model for name, entry in registry.entries().items()}
    kinds: dict[str, CostModel] = {}
    for path in dict.fromkeys(p for p in modules.values() if p):
        named_by = ", ".join(sorted(n for n, p in modules.items() if p == path))
        for model in _models_in(path, named_by):
            for kind in model.kinds:
                if kind in kinds and kinds[kind] is not model:
                    raise ValueError(f"cost model kind {kind!r} is defined twice ({path}, of strategy {named_by})")
                kinds[kind] = model
    _MODELS.update(kinds)
    _MODULE_OF_STRATEGY.update(modules)


def _models_in(path: str, named_by: str) -> tuple[CostModel, ...]:
    """The ``MODELS`` of a cost model's module, or an error that names the module and the strategies that name it."""
    try:
        found = importlib.import_module(path).MODELS
    except Exception as e:  # noqa: BLE001 — a plug-in's mistake, named
        raise ValueError(
            f"the cost model {path!r} of strategy {named_by} could not be loaded: {type(e).__name__}: {e}"
        ) from None
    if not all(isinstance(m, CostModel) for m in found):
        raise ValueError(f"the cost model {path!r} of strategy {named_by}: MODELS must hold CostModel instances")
    return tuple(found)


def model_of(option_or_kind) -> CostModel:
    """The cost model that prices an option (or an ``Option.family``)."""
    kind = option_or_kind if isinstance(option_or_kind, str) else option_or_kind.family
    _load()
    if kind not in _MODELS:
        raise ValueError(f"no cost model prices options of kind {kind!r}")
    return _MODELS[kind]


def models() -> list[CostModel]:
    """Every registered strategy's cost models, each once."""
    _load()
    return list(dict.fromkeys(_MODELS.values()))


def model_for_strategy(strategy: str) -> CostModel | None:
    """The cost model a strategy's registration names (its first, where its module has several), or None."""
    _load()
    path = _MODULE_OF_STRATEGY.get(strategy)
    return importlib.import_module(path).MODELS[0] if path else None
