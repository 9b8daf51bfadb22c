"""Turning live objects into checkpoint state and back, for every strategy.

Model and optimizer state go through torch.distributed.checkpoint's ``get_state_dict`` /
``set_state_dict``: optimizer state is keyed by parameter name (not by position) and tensors are
either full (single, DDP, FSDP "full") or DTensor shards (FSDP "sharded"). One format on every
strategy is what lets a DDP checkpoint resume under FSDP and the reverse.

On disk a checkpoint directory holds either ``state.pt`` (everything, full tensors) or a DCP
shard set (``.metadata`` + ``*.distcp``: model and optimizers) next to ``meta.pt`` (the rest:
progress, RNG, schedulers, config). Both load with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from distrain import compat
from distrain.checkpoint import io as ckpt_io
from distrain.checkpoint import lightning_layout, safe_load
from distrain.parallel import expert_parallel

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

#: what this module takes from torch.distributed.checkpoint, imported at the first checkpoint: the import costs
#: about 1.2 s (DTensor, sympy) in every rank, and the time to the first step is what every start and every
#: restart waits for. Inside this module a function calls ``_dcp()`` first; from outside, ``state.FULL`` works.
_FROM_DCP = (
    "dcp",
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "FULL",
    "FULL_EVERY_RANK",
    "SHARDED",
)


def _dcp() -> None:
    global dcp, StateDictOptions, FULL, FULL_EVERY_RANK, SHARDED
    global get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict
    if "SHARDED" in globals():
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
    FULL_EVERY_RANK = StateDictOptions(full_state_dict=True)
    SHARDED = StateDictOptions(full_state_dict=False)


def __getattr__(name: str) -> Any:
    if name in _FROM_DCP:
        _dcp()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


META_FILE = ckpt_io.META_FILE
DEEPSPEED_TAG = "deepspeed"  # the engine's shard folder inside a distrain checkpoint directory
DEEPSPEED_META = "deepspeed"  # meta.pt entry: world size, stage, where the model sits in the engine
#: DeepSpeed's NVMe-swapped optimizer state (master weights, moments) by parameter name: its own files hold it empty
SWAPPED_FILE = "swapped_optimizer_state.pt"


def _optimizers(value: Any) -> list[torch.optim.Optimizer] | None:
    if isinstance(value, torch.optim.Optimizer):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.optim.Optimizer) for v in value):
        return list(value)
    return None


def _the_model(state: dict[str, Any], unwrap: Callable) -> nn.Module | None:
    models = [unwrap(v) for v in state.values() if isinstance(v, nn.Module)]
    return models[0] if len(models) == 1 else None


def tensor_keys(state: dict[str, Any]) -> list[str]:
    """The entries that hold model/optimizer tensors (what DCP shards)."""
    return [k for k, v in state.items() if isinstance(v, nn.Module) or _optimizers(v) is not None]


def state_of(state: dict[str, Any], unwrap: Callable, options: StateDictOptions) -> dict[str, Any]:
    """Replace live objects by their state; must be called on every rank (may communicate)."""
    _dcp()
    model = _the_model(state, unwrap)
    experts = expert_parallel.experts_of(model) if model is not None else None
    out: dict[str, Any] = {}
    for key, value in state.items():
        opts = _optimizers(value)
        if isinstance(value, nn.Module):
            out[key] = get_model_state_dict(unwrap(value), options=options)
            if experts is not None:  # each layer's experts whole, under their names: any expert layout resumes
                own = get_model_state_dict(unwrap(value), options=SHARDED) if options.full_state_dict else None
                out[key] = experts.global_state(out[key], own)
        elif opts is not None:
            states = [
                get_optimizer_state_dict(model, o, options=options) if model is not None else o.state_dict()
                for o in opts
            ]
            if experts is not None:
                for o, s in zip(opts, states):
                    own = get_optimizer_state_dict(model, o, options=SHARDED) if options.full_state_dict else None
                    s["state"] = experts.global_state(s.get("state", {}), own and own["state"])
            out[key] = states if isinstance(value, (list, tuple)) else states[0]
        elif ckpt_io.is_stateful(value):
            out[key] = value.state_dict()
        elif isinstance(value, (list, tuple)) and any(ckpt_io.is_stateful(v) for v in value):
            out[key] = [v.state_dict() for v in value]
        else:
            out[key] = value
    return out


def load_into(
    state: dict[str, Any], loaded: dict[str, Any], unwrap: Callable, options: StateDictOptions, strict: bool = True
) -> dict[str, Any]:
    """Load ``loaded`` into ``state``'s objects in place; plain entries are replaced. Returns the
    checkpoint's entries that ``state`` did not ask for."""
    _dcp()
    model = _the_model(state, unwrap)
    experts = expert_parallel.experts_of(model) if model is not None else None
    options = StateDictOptions(full_state_dict=options.full_state_dict, strict=strict)
    for key, target in state.items():
        if key not in loaded:
            if strict:
                raise KeyError(f"checkpoint has no entry {key!r} (it has: {', '.join(sorted(loaded))})")
            continue
        value = loaded[key]
        opts = _optimizers(target)
        if isinstance(target, nn.Module):
            if strict:
                _check_fits(unwrap(target), {k: tuple(v.shape) for k, v in value.items()}, key)
            if experts is not None:  # this rank's share of each layer's whole experts
                value = experts.local_state(value)
            set_model_state_dict(unwrap(target), value, options=options)
        elif opts is not None:
            values = value if isinstance(target, (list, tuple)) else [value]
            if len(values) != len(opts):
                raise ValueError(f"checkpoint entry {key!r} holds {len(values)} optimizer states, expected {len(opts)}")
            for o, v in zip(opts, values):
                if experts is not None:
                    v = {**v, "state": experts.local_state(v["state"])}
                _take_group_keys(o, v)
                if model is not None:
                    set_optimizer_state_dict(model, o, v, options=compat.optimizer_load_options(v, options))
                else:
                    o.load_state_dict(v)
        elif ckpt_io.is_stateful(target):
            target.load_state_dict(value)
        elif isinstance(target, (list, tuple)) and any(ckpt_io.is_stateful(t) for t in target):
            for t, v in zip(target, value):
                t.load_state_dict(v)
        else:
            state[key] = value
    return {k: v for k, v in loaded.items() if k not in state}


def _take_group_keys(optimizer: torch.optim.Optimizer, saved: Any) -> None:
    """A hyperparameter the saved parameter groups have and the live ones lack (one a scheduler added: SWALR's
    ``swa_lr``, ``initial_lr``) is added to them before loading, as ``Optimizer.load_state_dict`` takes the saved
    groups whole; torch's ``set_optimizer_state_dict`` asks every saved key of the live groups."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if isinstance(groups, list):
        for live, group in zip(optimizer.param_groups, groups):
            if isinstance(group, dict):
                for key, value in group.items():
                    if key != "params":
                        live.setdefault(key, value)


def is_sharded_checkpoint(path: Path) -> bool:
    return (path / ".metadata").is_file()


def save_sharded(
    path: str | os.PathLike,
    state: dict[str, Any],
    unwrap: Callable,
    is_global_zero: bool,
    gather: Callable,
    adjust: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    background: bool = False,
):
    """Every rank writes its own shards in parallel (DCP); rank 0 commits the directory. ``adjust``
    may rewrite the collected state first (a pipeline makes its stages' optimizer groups agree).
    ``background``: DCP's ``async_save`` stages the shards into host memory (pinned on CUDA) and writes them
    from a thread, over a process group of its own; returns the ``Pending`` commit."""
    _dcp()
    collected = state_of(state, unwrap, SHARDED)
    if adjust is not None:
        collected = adjust(collected)
    keys = tensor_keys(state)

    def write(tmp: Path):
        tensors = {k: collected[k] for k in keys}
        meta = [tmp / META_FILE] if is_global_zero else []
        if is_global_zero:
            torch.save({k: v for k, v in collected.items() if k not in keys}, tmp / META_FILE)
        if not background:
            dcp.save(tensors, checkpoint_id=str(tmp))  # DCP flushes the shards it writes
            return meta
        saving = dcp.async_save(
            tensors, checkpoint_id=str(tmp), process_group=_checkpoint_group(), async_stager=_stager()
        )
        return ckpt_io.then(saving, lambda _: meta)

    return ckpt_io.write_checkpoint(path, write, is_global_zero, gather, background=background)


_CHECKPOINT_GROUP: dict = {}


def _checkpoint_group():
    """A gloo group of every rank for background DCP writes: their collectives run in DCP's thread, which must not
    share the training's group (torchtitan does the same). Made by every rank together, at the first background
    save of each process group (a second ``fit`` in one process brings a new one)."""
    if not dist.is_initialized():
        return None
    world = dist.distributed_c10d._get_default_group()
    if _CHECKPOINT_GROUP.get("world") is not world:
        _CHECKPOINT_GROUP.update(world=world, group=dist.new_group(backend="gloo"))
    return _CHECKPOINT_GROUP["group"]


_STAGER: list = []


def _stager():
    """Copies the shards into host memory before ``async_save`` returns (the run goes on changing the live tensors),
    into pinned buffers on CUDA, kept from one save to the next (torchtitan's choice). One for the process."""
    if not _STAGER:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        options = StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
        )
        _STAGER.append(DefaultStager(options))
    return _STAGER[0]


def _check_fits(model: nn.Module, found: dict[str, tuple], source: str) -> None:
    """A checkpoint of another model fails in one line naming the first keys that differ."""
    _dcp()
    expected = {k: tuple(v.shape) for k, v in get_model_state_dict(model, options=SHARDED).items()}
    experts = expert_parallel.experts_of(model)
    if experts is not None:  # a checkpoint holds each layer's experts whole
        expected = experts.global_shapes(expected)
    compare_model_keys(expected, found, source, type(model).__name__)


def compare_model_keys(expected: dict[str, tuple], found: dict[str, tuple], source: str, model_name: str) -> None:
    """Parameter names → shapes the model has against those the checkpoint holds: a one-line error naming
    the first that differ."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    reshaped = [
        f"{k} {found[k]} in the checkpoint, {expected[k]} here"
        for k in expected
        if k in found and found[k] != expected[k]
    ]
    problems = [
        f"{what}: {', '.join(names[:3])}{' …' if len(names) > 3 else ''}"
        for what, names in (("missing", missing), ("unexpected", unexpected), ("other shapes", reshaped))
        if names
    ]
    if problems:
        raise ckpt_io.CheckpointError(
            f"the checkpoint's {source!r} does not fit {model_name} "
            f"(a checkpoint of another model?): {'; '.join(problems)}"
        )


def saved_model_shapes(path: str | os.PathLike, key: str = "model") -> dict[str, tuple] | None:
    """Parameter names → shapes of the model a checkpoint holds, read without its tensors' bytes: a sharded
    checkpoint's metadata, a full one's file memory-mapped (weights only). None where it cannot be read so (a
    DeepSpeed checkpoint, a damaged file): loading it says what is wrong, and falls back where it can."""
    try:
        path = ckpt_io.resolve_checkpoint(path)
        if is_deepspeed_checkpoint(path):
            return None
        if is_sharded_checkpoint(path):
            return _stored_shapes(safe_load.read_dcp_metadata(path).state_dict_metadata, key)
        file = path if path.is_file() else path / ckpt_io.STATE_FILE
        model = safe_load.load_torch_file(file, mmap=True).get(key)
    except Exception:  # noqa: BLE001 (damaged, unsafe, another layout: the load itself reports it)
        return None
    if not isinstance(model, dict):
        return None
    return {k: tuple(v.shape) for k, v in model.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}


def _stored_shapes(stored: dict[str, Any], key: str) -> dict[str, tuple]:
    """A DCP checkpoint's entries under ``key`` (its ``state_dict_metadata``), by their names within it → shapes."""
    prefix = f"{key}."
    return {k[len(prefix) :]: tuple(getattr(m, "size", ())) for k, m in stored.items() if k.startswith(prefix)}


def load_any(
    path: str | os.PathLike, state: dict[str, Any], unwrap: Callable, options: StateDictOptions, strict: bool = True
) -> dict[str, Any]:
    """Load a full or a sharded checkpoint into ``state`` (whatever wrote it, whatever world size)."""
    _dcp()
    path = ckpt_io.resolve_checkpoint(path)
    if not is_sharded_checkpoint(path):
        loaded = ckpt_io.read_state_file(path)
        if lightning_layout.written_by_lightning(loaded):  # a run from before the move to distrain
            loaded = _from_lightning(loaded, state, unwrap, path)
        return load_into(state, loaded, unwrap, FULL, strict)
    # DCP reads into the tensors we hand it, resharding to our layout: ask for our own state
    # first (this also creates optimizer state, so there is something to load into).
    keys = tensor_keys(state)
    every_rank = FULL_EVERY_RANK if options.full_state_dict else options  # FULL offloads to rank 0 only
    target = state_of({k: state[k] for k in keys}, unwrap, every_rank)
    if strict:  # DCP's own error for a key it lacks is long; say it in one line first
        stored = safe_load.read_dcp_metadata(path).state_dict_metadata
        for key in keys:
            model = state[key]
            if isinstance(model, nn.Module):
                _check_fits(unwrap(model), _stored_shapes(stored, key), key)
    safe_load.dcp_load(target, path, no_dist=not dist.is_initialized())
    meta = ckpt_io.load_file(path / META_FILE) if (path / META_FILE).exists() else {}
    return load_into(state, {**meta, **target}, unwrap, options, strict)


def _from_lightning(loaded: dict[str, Any], state: dict[str, Any], unwrap: Callable, path: Path) -> dict[str, Any]:
    """A checkpoint Lightning wrote, as distrain's entries for ``state``'s objects (``lightning_layout``); what it has
    no entry for (the precision's scaler) stays as it is."""
    model_key = next((k for k, v in state.items() if isinstance(v, nn.Module)), "model")
    optimizers_key = next((k for k, v in state.items() if _optimizers(v) is not None), None)
    optimizers = _optimizers(state[optimizers_key]) if optimizers_key is not None else []
    model = state.get(model_key)
    names = {id(p): n for n, p in unwrap(model).named_parameters()} if isinstance(model, nn.Module) else {}
    try:
        out = lightning_layout.as_distrain(loaded, model_key, optimizers_key, optimizers, names)
    except ValueError as e:
        raise ckpt_io.CheckpointError(f"{path} (written by Lightning): {e}") from None
    for key, target in state.items():
        if key not in out and ckpt_io.is_stateful(target):
            out[key] = target.state_dict()
    return out


def is_deepspeed_checkpoint(path: Path) -> bool:
    return (path / DEEPSPEED_TAG).is_dir()


def read_checkpoint_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Everything but the tensors' shards: progress, hyperparameters, config, ..."""
    path = ckpt_io.resolve_checkpoint(path)
    if not (path / META_FILE).is_file():
        return ckpt_io.read_state_file(path)
    return ckpt_io.load_file(path / META_FILE)


def read_model_weights(path: str | os.PathLike, key: str = "model") -> dict[str, torch.Tensor]:
    """The full model weights of any distrain checkpoint, on CPU, without a process group."""
    path = ckpt_io.resolve_checkpoint(path)
    if is_deepspeed_checkpoint(path):
        return _deepspeed_fp32_weights(path)
    if not is_sharded_checkpoint(path):
        state = ckpt_io.read_state_file(path)
        lightnings = isinstance(state.get("state_dict"), dict)
        if key == "model" and lightnings and (key not in state or "current_model_state" in state):
            # a file in Lightning's layout (convert_zero_checkpoint_to_fp32_state_dict's), or one whose state_dict a
            # weight-averaging callback made the average: the weights Lightning's load_from_checkpoint loads
            return state["state_dict"]
        if key not in state:
            raise KeyError(f"{path} holds no {key!r} weights (its entries: {', '.join(sorted(map(str, state)))})")
        return state[key]
    # only the model's tensors: empty full-size ones from the metadata, filled by DCP (no process group)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = safe_load.read_dcp_metadata(path).state_dict_metadata
    prefix = f"{key}."
    weights = {
        name[len(prefix) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, meta in stored.items()
        if name.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    safe_load.dcp_load({key: weights}, path, no_dist=True)
    return weights


def _deepspeed_fp32_weights(path: Path) -> dict[str, torch.Tensor]:
    """DeepSpeed's own consolidation (zero_to_fp32) of the ZeRO partitions, under the user
    module's names."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    prefix = read_checkpoint_meta(path).get(DEEPSPEED_META, {}).get("module_prefix", "")
    if (path / SWAPPED_FILE).is_file():  # NVMe optimizer offload: the engine's files hold no master weights
        swapped = safe_load.load_torch_file(path / SWAPPED_FILE)
        return {k[len(prefix) :]: v["fp32"] for k, v in swapped.items() if k.startswith(prefix)}
    with safe_load.deepspeed_loading(), contextlib.redirect_stderr(io.StringIO()):  # its progress bars
        weights = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DEEPSPEED_TAG)
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


def read_plain(path: str | os.PathLike, key: str = "model") -> dict[str, Any]:
    """Any distrain checkpoint as plain values, without a process group: a full one (``state.pt``, a checkpoint file)
    as it is; a sharded (DCP) or DeepSpeed one as its ``meta.pt`` entries plus the whole model weights. With Lightning's
    keys (``lightning_layout.lightning_keys``: the weights under ``state_dict`` too), which older checkpoints lack."""
    path = ckpt_io.resolve_checkpoint(path)
    if not (path / META_FILE).is_file():
        return lightning_layout.lightning_keys(ckpt_io.read_state_file(path))
    return lightning_layout.lightning_keys({**ckpt_io.load_file(path / META_FILE), key: read_model_weights(path, key)})


def checkpoint_state_of(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """Full (unsharded) model and optimizer tensors by name, on every rank: handy to compare
    runs across strategies and world sizes."""
    _dcp()
    out = {f"model.{k}": v.cpu() for k, v in get_model_state_dict(model, options=FULL_EVERY_RANK).items()}
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer, options=FULL_EVERY_RANK)
        for name, per_param in osd["state"].items():
            out.update({f"optim.{name}.{k}": v.cpu() for k, v in per_param.items() if isinstance(v, torch.Tensor)})
    return out
