"""The plan's decisions, kept between starts of the same run on the same machine.

Before a run starts, ``strategy: auto`` (and ``activation_checkpointing: auto``) trace one training step and time
this machine's links: seconds that every start paid again, and a restarted job pays them before it trains again.
The decision is a function of the config, the ranks and the machine, so it is kept under
``~/.cache/distrain/plans/<key>.json``, the key a hash of exactly those inputs: the config (without where its
files go), the world size and ranks per node, the memory budget per rank (devices, host), the rates kept for this
machine (``machine.py``) and its links, and the versions of distrain and torch (and, for a Module of your own, its
source file's size and time). ``Trainer(strategy="auto")`` keeps its decisions the same way, its run described by
the model (each layer's class and source file, each tensor's name, shape and dtype, built on the meta device as the
plan builds it), the first sample's shapes, the micro-batch, accumulation, clipping, precision and ranks
(``decide.for_trainer``). ``DISTRAIN_PLAN_CACHE`` names another folder, or ``off``. A changed input is another
key, so a stale plan is never read; ``distrain plan`` always plans afresh.

The file is read as untrusted bytes: JSON only, at most ``MAX_BYTES``, every field checked for its type; anything
else is ignored (the run plans as if there were no cache), never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from distrain.planner import kept

MAX_BYTES = 64 * 2**10
#: where a run's files go: not an input of the plan
_NOT_INPUTS = {("output_dir",), ("checkpointing", "checkpoint_dir"), ("logging",)}


def directory() -> Path | None:
    """Where plans are kept: ``DISTRAIN_PLAN_CACHE`` (a folder, or ``off``), else the user's cache folder."""
    chosen = os.environ.get("DISTRAIN_PLAN_CACHE")
    if chosen == "off":
        return None
    if chosen:
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "distrain" / "plans"


def key(config, budget, per_node: int) -> str:
    """The key of a ``distrain train`` run (see the module's docstring); ``budget``: the memory budget per rank the
    plan would fit (``from_config.budget_from_config``), ``per_node``: the ranks per node it plans for."""
    from distrain.cluster import detect_cluster

    settings = config.to_dict()
    for path in _NOT_INPUTS:
        node = settings
        for part in path[:-1]:
            node = node.get(part, {})
        node.pop(path[-1], None)
    cluster = detect_cluster()
    run = {
        "config": settings,
        "world": (cluster.world_size, cluster.local_world_size, cluster.source),
        "module_source": _module_source(config.training.module),
    }
    return key_of(run, budget, per_node)


def key_of(run: dict[str, Any], budget, per_node: int) -> str:
    """The hash of ``run`` (what describes the run: its config, or the Trainer's model and data) and of what the
    plan depends on besides: the memory budget per rank, the rates kept for this machine and its links, and the
    versions of distrain and torch."""
    import torch

    from distrain._version import __version__
    from distrain.planner import machine, timing

    # the rates the plan's timing reads: another measurement, another plan
    links = timing.measured_file()
    rates = None if budget.gpu else machine.kept_file(per_node)
    inputs = {
        "run": run,
        "budget": repr(budget),
        "links": _digest(links),
        "rates": _digest(rates),
        "versions": (__version__, torch.__version__),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:32]


def source_stat(path: str | Path | None) -> list:
    """A source file's path, size and modification time (a changed file is another plan), or what is known."""
    if path is None:
        return [None]
    try:
        stat = Path(path).stat()
    except OSError:
        return [str(path)]
    return [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns]


def _digest(path: Path | None) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() if path is not None and path.is_file() else None
    except OSError:
        return None


def _module_source(spec: str | None) -> list | None:
    """Size and modification time of a Module of your own's file: its model may have changed."""
    if not spec:
        return None
    target = spec.rsplit(":", 1)[0]
    path = Path(target)
    if not path.suffix == ".py":
        import importlib.util

        try:
            found = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            return [target]
        if found is None or not found.origin:
            return [target]
        path = Path(found.origin)
    return source_stat(path)


def read(plan_key: str) -> dict[str, Any] | None:
    """The values kept under ``plan_key`` (a JSON object of at most ``MAX_BYTES`` that names this key), or None.
    What they hold is ``decide.Decision.from_values``'s to check: a field of the wrong type is no decision."""
    if directory() is None:
        return None
    values = kept.read_json(directory() / f"{plan_key}.json", MAX_BYTES)
    if not isinstance(values, dict) or values.pop("key", None) != plan_key:
        return None
    return values


def write(plan_key: str, decision: dict[str, Any]) -> None:
    """Keep a decision (best effort: a read-only home only costs the next start its plan)."""
    if directory() is not None:
        kept.write_json(directory() / f"{plan_key}.json", {"key": plan_key, **decision})
