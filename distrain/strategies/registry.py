"""Strategy names → strategies. Each strategy's file registers its own names (``register``), with
a one-line description, how the config file's settings become its options and how they are checked,
so a new strategy is one new file: nothing here, in config.py or in the CLI changes. The files in this
package register on import (``distrain/strategies/__init__.py`` imports each); a package of your own
registers through the ``distrain.strategies`` entry point group (``pyproject.toml``:
``[project.entry-points."distrain.strategies"] name = "your_package.module"``)."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

from distrain import config as run_config
from distrain.config import ConfigError

#: how the ranks are arranged: options only the model-parallel strategies take (another would ignore them, or hand
#: them to DistributedDataParallel, and the run would not be the layout asked for), and which take each
LAYOUT_OPTIONS = {
    "tensor_parallel_size": ("model_parallel", "pipeline"),
    "data_parallel_size": ("model_parallel", "pipeline"),
    "pipeline_stages": ("model_parallel",),
    "stages": ("pipeline",),
    "context_parallel_size": ("model_parallel",),
}


@dataclass(frozen=True)
class StrategyEntry:
    name: str
    build: Callable[..., Any]
    """Keyword options → a Strategy."""
    description: str
    options_from_config: Callable[[Any, set], dict] | None = None
    """``(RunConfig, the model's block classes) → options``: what the config file says for this strategy."""
    config_section: str | None = None
    """The config file's section those options come from (``fsdp``, ``deepspeed``, ``distributed``)."""
    check: Callable[[Any], None] | None = None
    """``(RunConfig) → None``: the file's checks of its keys, run on every config (raise ConfigError)."""
    cost_model: str | None = None
    """The module of its cost model in the planner (``distrain.planner.models.fsdp``), imported only when a run
    is planned; None: ``distrain plan`` says it has no model of it."""


_ENTRIES: dict[str, StrategyEntry] = {}

#: names other libraries give a strategy with options set (Lightning's ``ddp_find_unused_parameters_true``): the
#: registered strategy each means and those options. The strategy's file declares them (``alias``); they are not
#: listed among the strategies, so the planner and ``distrain strategies`` see each strategy once.
_ALIASES: dict[str, tuple[str, dict[str, Any]]] = {}

#: strategies other libraries (and the spec) name that distrain does not run, and what replaces each
REPLACED = {
    "dp": "DataParallel ('dp', DataParallelStrategy) runs one process over threads and is deprecated by PyTorch; "
    "use 'ddp' (one process per device, the same training)",
    "horovod": "Horovod ('horovod', HorovodStrategy) is not supported; use 'ddp' (its all-reduce), and for its fp16 "
    "compression DDPStrategy(ddp_comm_hook='fp16_compress') (config: distributed.comm_hook=fp16_compress)",
    "bagua": "Bagua ('bagua', BaguaStrategy) is not supported; its algorithms map to 'ddp' with a comm hook: "
    "gradient_allreduce → plain ddp, bytegrad/qadam → comm_hook='fp16_compress' (or 'powersgd'), "
    "decentralized/async → comm_hook='post_localsgd'",
    "colossalai": "Colossal-AI ('colossalai', ColossalAIStrategy) is not supported; its ZeRO and Gemini sharding map "
    "to 'fsdp' or 'deepspeed_stage_3' (with CPU offload: 'fsdp_cpu_offload', 'deepspeed_stage_3_offload'), and its "
    "tensor and pipeline parallelism to 'model_parallel' (distributed.tensor_parallel_size, pipeline_stages)",
    "hivemind": "Hivemind ('hivemind', HivemindStrategy) is not supported; for training that goes on when a "
    "machine is lost or joins late, use 'ddp_torchft' (replica groups that leave and rejoin a running job, torchft)",
    "ddp2": "'ddp2' was removed from Lightning; use 'ddp'",
    "xla": "XLA ('xla', XLAStrategy: TPUs) is not supported; distrain runs on CUDA GPUs and CPUs ('ddp', 'fsdp')",
    "ddp_sharded": "'ddp_sharded' (FairScale) is replaced by 'fsdp' (FSDP2: parameters, gradients and optimizer "
    "state sharded) or 'deepspeed_stage_2'",
}
REPLACED.update(
    {
        "DataParallelStrategy": REPLACED["dp"],
        "HorovodStrategy": REPLACED["horovod"],
        "BaguaStrategy": REPLACED["bagua"],
        "ColossalAIStrategy": REPLACED["colossalai"],
        "HivemindStrategy": REPLACED["hivemind"],
        "DDPShardedStrategy": REPLACED["ddp_sharded"],
        "single_xla": REPLACED["xla"],
        "xla_debug": REPLACED["xla"],
        "xla_fsdp": REPLACED["xla"],
        "XLAStrategy": REPLACED["xla"],
    }
)


def register(
    name: str,
    build: Callable[..., Any],
    description: str,
    options_from_config: Callable[[Any, set], dict] | None = None,
    config_section: str | None = None,
    check: Callable[[Any], None] | None = None,
    cost_model: str | None = None,
) -> None:
    """Make ``name`` a strategy: ``build(**options)`` makes it, ``description`` is its line in ``distrain
    strategies``, ``options_from_config(config, block_classes)`` turns the config file's ``config_section`` into
    its options, ``check(config)`` refuses what it cannot run, and ``cost_model`` names the module of its cost model
    (``planner/models/``) for ``distrain plan`` and ``strategy: auto``."""
    if name in _ENTRIES:
        raise ValueError(f"strategy name {name!r} is registered twice")
    if config_section is not None and config_section not in {f.name for f in fields(run_config.run_config_class())}:
        raise ValueError(
            f"strategy {name!r} takes its options from config section {config_section!r}, which no installed package "
            f"declares (entry point group {run_config.SECTION_GROUP!r}; a checkout of distrain: pip install -e .)"
        )
    _ENTRIES[name] = StrategyEntry(name, build, description, options_from_config, config_section, check, cost_model)


def alias(name: str, strategy: str, **options: Any) -> None:
    """Make ``name`` another name for ``strategy`` built with ``options`` (a run's own keywords override them)."""
    if name in _ENTRIES or name in _ALIASES:
        raise ValueError(f"strategy name {name!r} is registered twice")
    _ALIASES[name] = (strategy, options)


def unalias(name: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The registered strategy an alias means, with its options under ``options``; any other name as it is."""
    entries()  # the files that declare aliases are imported
    if isinstance(name, str) and name in _ALIASES:
        strategy, preset = _ALIASES[name]
        return strategy, {**preset, **options}
    return name, options


def entries() -> dict[str, StrategyEntry]:
    """Every registered strategy: this package's (each file registers itself when imported, and the first call
    imports them all) and those of installed plugins."""
    _load_plugins()
    return dict(_ENTRIES)


_plugins_loaded = False


def _load_plugins() -> None:
    """Import this package's files, then the modules installed packages name under the ``distrain.strategies``
    entry point group; each registers its strategies."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from importlib.metadata import entry_points

    from distrain import strategies

    strategies.import_all()

    for point in entry_points(group="distrain.strategies"):
        point.load()


def validate_config(config: Any) -> None:
    """The config's strategy is one distrain runs, and every strategy file's checks of its keys pass."""
    strategy = config.distributed.strategy
    if strategy not in names():
        try:
            lookup(strategy)
        except ValueError as e:  # unknown, or one that another library runs: the message says what replaces it
            raise ConfigError(f"distributed.{e}") from None
    for check in dict.fromkeys(e.check for e in entries().values() if e.check):  # one per file, in order
        check(config)


def section_of(strategy: str) -> str | None:
    """The config section a strategy name takes its options from (``auto`` as what it resolves to)."""
    return lookup(resolve_auto(strategy, 2)).config_section


run_config.CHECKS.append(validate_config)


def names() -> list[str]:
    return ["auto", *sorted(entries())]


def lookup(name: str) -> StrategyEntry:
    known = entries()
    name, _ = unalias(name, {})
    if name in REPLACED:
        raise ValueError(f"strategy {name!r}: {REPLACED[name]}")
    if name not in known:
        raise ValueError(f"strategy {name!r} is unknown; choose one of {', '.join(names())}")
    return known[name]


def resolve_auto(name: str, world_size: int) -> str:
    """``auto``: one process → single; several → ddp."""
    if name != "auto":
        return name
    return "single" if world_size == 1 else "ddp"


def start_method_of(strategy: str) -> str | None:
    """How a strategy's ranks start where its class says it (``replica_groups``: only by distrain's own launcher),
    read without building one; None where the entry does not say."""
    build = lookup(resolve_auto(strategy, 2)).build
    return getattr(getattr(build, "func", build), "start_method", None)


def starts_replica_groups(strategy: str) -> bool:
    """The strategy's ranks are replica groups that distrain's own launcher starts, each a torchrun of its own, with
    a run directory per group."""
    return start_method_of(strategy) == "replica_groups"


def runs_one_process(strategy: str) -> bool:
    """The strategy runs one process, whatever the devices."""
    return resolve_auto(strategy, 2) == "single"


def options_of(entry: StrategyEntry) -> set[str] | None:
    """The keyword options a strategy's ``build`` takes: its ``__init__``'s, and where that hands ``**kwargs`` on,
    its base classes' (a plugin's ``__init__(self, word, **options)``) and those a class names in
    ``passes_options_to`` (DDP: ``DistributedDataParallel``'s). None: a plain function with ``**kwargs``, which
    takes any."""
    target = entry.build.func if isinstance(entry.build, functools.partial) else entry.build
    names: set[str] = set()
    for cls in target.__mro__ if isinstance(target, type) else (target,):
        init = cls.__init__ if isinstance(target, type) else cls
        if init is object.__init__:
            break
        params = inspect.signature(init).parameters.values()
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
        if "passes_options_to" in vars(cls):
            names |= cls.passes_options_to()
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names
        if not isinstance(target, type):
            return None
    return names


def check_options(name: Any, options: Iterable[str], also_meant: Iterable[str] = ()) -> None:
    """Each of ``options`` is one the strategy takes (``auto``: one any strategy takes, since it may choose any),
    else a ValueError naming it and what it may have meant (an option, or one of ``also_meant``). A ``Strategy``
    instance takes none here: its options go to its constructor."""
    from distrain.strategies.base import Strategy

    options = sorted(options)
    if not options:
        return
    if isinstance(name, Strategy):
        raise ValueError(
            f"{', '.join(options)}: options of a {type(name).__name__} instance go to its constructor, not here"
        )
    for option in options:
        takers = LAYOUT_OPTIONS.get(option, (name,))
        if name not in takers:  # another would ignore it, or hand it to DistributedDataParallel
            raise ValueError(
                f"{option} applies to strategy={' or '.join(map(repr, takers))}, but the strategy is {name!r}; "
                f"pass strategy={takers[0]!r}"
            )
    by_strategy = {strategy: options_of(entry) for strategy, entry in entries().items()}
    known = by_strategy[lookup(name).name] if name != "auto" else set().union(*filter(None, by_strategy.values()))
    for option in options:
        if known is None or option in known:
            continue
        whose = "any strategy" if name == "auto" else f"strategy {name!r}"
        takers = [strategy for strategy, taken in by_strategy.items() if taken and option in taken]
        near = difflib.get_close_matches(option, sorted(known | set(also_meant)), n=1, cutoff=0.8)
        hint = f"; it is an option of {', '.join(map(repr, takers))}" if takers else ""
        hint = hint or (f"; did you mean {near[0]}?" if near else "")
        raise ValueError(f"{option} is not an option of {whose} (nor an argument here){hint}")


def make_strategy(name: Any, world_size: int, **kwargs: Any):
    """The strategy ``name`` names, built with ``kwargs``. ``auto`` stands for what it resolves to until the planner
    chooses (``planner/decide.py``, which gets every option): it is built with the options it takes."""
    from distrain.strategies.base import Strategy

    name, kwargs = unalias(name, kwargs)
    check_options(name, kwargs)
    if isinstance(name, Strategy):
        return name
    resolved = resolve_auto(name, world_size)
    entry = lookup(resolved)
    if resolved == "single" and world_size > 1:
        raise ValueError(f"strategy='single' runs one process, but {world_size} were requested")
    takes = options_of(entry)
    if name == "auto" and takes is not None:
        kwargs = {k: v for k, v in kwargs.items() if k in takes}
    return entry.build(**kwargs)


def options_from_config(strategy: str, config: Any, block_classes: set) -> dict:
    """The config file's options for ``strategy`` (``auto`` takes those of what it resolves to)."""
    strategy, preset = unalias(strategy, {})
    entry = lookup(resolve_auto(strategy, 2 if strategy == "auto" else 1))
    return {**(entry.options_from_config(config, block_classes) if entry.options_from_config else {}), **preset}
