"""Initializing a model that no rank holds whole: the same weights as a one-process build, one layer at a time.

Sharding strategies build ``configure_model`` without memory (FSDP: on the meta device; ZeRO-3:
each layer partitioned as it is built), so its initializers never ran on real tensors. The contract
distrain keeps: after set-up, the model holds **exactly** the weights (and buffers) a plain
single-process build with the same seed holds, on any world size and sharding.

How: the RNG state at the start of ``configure_model`` was recorded. Afterwards every module's
``reset_parameters()`` runs again, children first — the order an eager build runs them (each layer
as it is built, then its parents' own initialization) — from that RNG state. Every operation that
touches a sharded parameter runs instead on a full-size temporary of it, exactly as it would on one
process (same shape, same generator, so the same random draws on every rank); the temporary is
then cut to this rank's shard. Temporaries are written back whenever initialization moves on to a
parameter of another sharded unit (an FSDP block), so a rank holds its shards plus at most one
unit's full parameters. No random operator ever runs on a shard, so DTensor's per-device RNG
handling (and its CPU warning) never comes into play.

A module whose ``reset_parameters`` initializes its whole subtree in its own way (a Hugging Face
model, whose weights come from files or from the library's own initializer) sets
``reset_parameters_covers_children = True``: the replay calls it and does not descend further.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from distrain import compat

# Operations that overwrite every element of their first argument: the temporary need not hold the
# parameter's current values first (no gather).
_OVERWRITING_INITS = {
    getattr(torch.nn.init, name)
    for name in (
        "uniform_",
        "normal_",
        "trunc_normal_",
        "constant_",
        "ones_",
        "zeros_",
        "eye_",
        "dirac_",
        "xavier_uniform_",
        "xavier_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "orthogonal_",
        "sparse_",
    )
}
_OVERWRITING_METHODS = {
    getattr(torch.Tensor, name)
    for name in (
        "normal_",
        "uniform_",
        "zero_",
        "fill_",
        "copy_",
        "random_",
        "bernoulli_",
        "exponential_",
        "geometric_",
        "log_normal_",
        "cauchy_",
    )
}
# Questions about a tensor's shape and type: answered by the sharded parameter itself (its global
# metadata), no temporary needed.
_METADATA = {
    torch.Tensor.dim,
    torch.Tensor.size,
    torch.Tensor.numel,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.element_size,
    torch.Tensor.__len__,
    *(
        getattr(torch.Tensor, name).__get__
        for name in (
            "shape",
            "dtype",
            "device",
            "ndim",
            "requires_grad",
            "is_meta",
            "layout",
            "is_cuda",
            "grad_fn",
            "is_leaf",
        )
    ),
}


class ShardAccess:
    """How one sharding strategy lets initialization see its parameters whole."""

    #: every access needs the whole parameter (ZeRO-3: a partitioned parameter's own shape is empty)
    metadata_from_shard = True

    def full(self, param: torch.Tensor, overwritten: bool) -> torch.Tensor:
        """A full-size tensor standing for ``param`` (its current values unless ``overwritten``)."""
        raise NotImplementedError

    def commit(self, param: torch.Tensor, full: torch.Tensor) -> None:
        """Write ``full`` back into this rank's part of ``param``."""
        raise NotImplementedError


class PlainTensors(ShardAccess):
    """A model built whole: initialization runs on its tensors directly (tracked all the same, so
    an uninitialized parameter is reported under every strategy alike)."""

    def full(self, param, overwritten):
        return param

    def commit(self, param, full):
        pass


class DTensorShards(ShardAccess):
    """FSDP2 and model parallelism: parameters are DTensors; the temporary lives on ``device`` (where an eager build
    would have drawn its random numbers). On the whole model's structure, under pipeline stages: another stage's
    parameters (still on the meta device) get a temporary that is drawn into and dropped, so every rank draws the
    same random numbers in the same order; a plain (replicated) parameter receives its values in place."""

    def __init__(self, device: torch.device):
        self.device = device

    def full(self, param, overwritten):
        sharded = hasattr(param, "device_mesh")
        if param.is_meta or (overwritten and sharded):
            return torch.empty(param.shape, dtype=param.dtype, device=self.device)
        return param.full_tensor().to(self.device) if sharded else param  # an all-gather: every rank runs it

    def commit(self, param, full):
        if param.is_meta or full is param:
            return
        from torch.distributed.tensor import distribute_tensor

        # src_data_rank=None: every rank cuts its own piece of the identical full tensor (no communication)
        piece = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(piece)


class SplitRows(ShardAccess):
    """Parameters split by rows over ``parts`` ranks before ``inner``'s sharding (expert parallelism: each rank's rows
    of a layer's stacked experts). Initialization of such a parameter runs on a temporary of the whole one, ``parts``
    times as many rows, so every rank draws what one process draws; this rank (``index``) keeps its rows, which
    ``inner`` then shards. ``gather``: every part's rows (a collective), for an initialization that reads the current
    values. An initializer that reads the shape without touching the values (a fan-in) sees this rank's rows."""

    def __init__(self, inner: ShardAccess, split: Callable[[torch.Tensor], bool], parts: int, index: int, gather):
        self.inner, self.split, self.parts, self.index, self.gather = inner, split, parts, index, gather
        self.metadata_from_shard = inner.metadata_from_shard

    def full(self, param, overwritten):
        if not self.split(param):
            return self.inner.full(param, overwritten)
        if overwritten or param.is_meta:
            whole = (param.shape[0] * self.parts, *param.shape[1:])
            return torch.empty(whole, dtype=param.dtype, device=getattr(self.inner, "device", param.device))
        return self.gather(self.inner.full(param, False))

    def commit(self, param, full):
        if not self.split(param):
            return self.inner.commit(param, full)
        rows = param.shape[0]
        self.inner.commit(param, full[self.index * rows : (self.index + 1) * rows])


def dtensor_shards_and_expert_rows(device, experts=None) -> ShardAccess:
    """What initialization keeps of each parameter it draws whole on a rank of FSDP2 (or model parallelism): the
    rank's DTensor shard, and with ``experts`` (an ``ExpertSplit``) the rank's rows of each layer's experts, drawn
    whole as one process draws them."""
    access = DTensorShards(device)
    if experts is None:
        return access
    return SplitRows(access, experts.owns, experts.size, experts.rank, experts.gather)


def units_of_parameters(module: nn.Module, units: list[nn.Module] | None = None) -> dict[int, int]:
    """``id(param) → the unit that owns it``: with ``units`` (innermost first, e.g. FSDP's sharded
    blocks) the innermost one holding it, the root owning the rest; without, the module that holds
    it directly (ZeRO-3 partitions each module's own parameters)."""
    owner: dict[int, int] = {}
    if units is None:
        for index, m in enumerate(module.modules()):
            for p in m.parameters(recurse=False):
                owner.setdefault(id(p), index)
        return owner
    for index, unit in enumerate(units):
        for p in unit.parameters():
            owner.setdefault(id(p), index)
    for p in module.parameters():
        owner.setdefault(id(p), len(units))
    return owner


class _FullTensorInit(TorchFunctionMode):
    """Runs every operation on a tracked (sharded) parameter on its full-size temporary."""

    def __init__(
        self,
        params: dict[int, tuple[str, torch.Tensor]],
        buffers: dict[int, str],
        unit_of: dict[int, int],
        access: ShardAccess,
    ):
        super().__init__()
        self.params, self.buffers, self.unit_of, self.access = params, buffers, unit_of, access
        self.held: dict[int, torch.Tensor] = {}  # id(param) -> its full temporary, not yet written back
        self.touched: set[int] = set()  # parameters and buffers initialization wrote (or read)
        self.peak_held_bytes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        tracked = [x for x in leaves if isinstance(x, torch.Tensor) and id(x) in self.params]
        if not tracked or (func in _METADATA and self.access.metadata_from_shard):
            for x in leaves:
                if isinstance(x, torch.Tensor) and id(x) in self.buffers and x is (args[0] if args else None):
                    self.touched.add(id(x))  # an operation on the buffer itself (copy_, fill_, ...)
            return func(*args, **kwargs)
        overwritten = (func in _OVERWRITING_INITS or func in _OVERWRITING_METHODS) and args and tracked == [args[0]]
        fulls = {id(p): self._full(p, overwritten) for p in tracked}
        args, kwargs = tree_map(lambda x: fulls.get(id(x), x) if isinstance(x, torch.Tensor) else x, (args, kwargs))
        return func(*args, **kwargs)

    def _full(self, param: torch.Tensor, overwritten: bool) -> torch.Tensor:
        key = id(param)
        self.touched.add(key)
        if key in self.held:
            return self.held[key]
        if any(self.unit_of.get(k) != self.unit_of.get(key) for k in self.held):
            self.write_back()  # moving on to another unit: at most one unit is held whole
        full = self.access.full(param, overwritten)
        self.held[key] = full
        self.peak_held_bytes = max(self.peak_held_bytes, sum(t.numel() * t.element_size() for t in self.held.values()))
        return full

    def write_back(self) -> None:
        with torch.no_grad():
            for key, full in self.held.items():
                self.access.commit(self.params[key][1], full)
        self.held.clear()


def replay_initialization(
    module: nn.Module, rng_state: dict[str, Any], access: ShardAccess, unit_of: dict[int, int]
) -> int:
    """Run every ``reset_parameters`` of ``module`` children first from ``rng_state`` (see
    ``record_rng``), on full-size temporaries of the sharded parameters, holding at most one unit
    (``units_of_parameters``) whole at a time. Raises if a parameter or buffer stays uninitialized.
    Returns the most bytes of temporaries held at once."""
    params = {id(p): (name, p) for name, p in module.named_parameters()}
    if any(compat.is_fake(p) for _, p in params.values()):
        return 0  # the memory planner's simulation: fake tensors hold no values to initialize
    buffers = {id(b): name for name, b in module.named_buffers()}
    mode = _FullTensorInit(params, buffers, unit_of, access)
    restore_rng(rng_state)
    with torch.no_grad(), mode:
        for initialize in _initializers(module):
            initialize()
    mode.write_back()
    missing = [name for key, (name, _) in params.items() if key not in mode.touched]
    missing += [name for key, name in buffers.items() if key not in mode.touched]
    if missing:
        users, prefix = _users_module(module)
        missing = [name.removeprefix(prefix) for name in missing]
        raise RuntimeError(
            f"{users} was built in configure_model under a sharding strategy, but nothing initializes "
            f"{', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}: a sharded model is initialized by its "
            "modules' reset_parameters() (torch's convention, run children first as an eager build would). Give the "
            "module that owns them a reset_parameters(), or build them in __init__ instead of configure_model"
        )
    return mode.peak_held_bytes


#: torch.nn layers whose initializer has another name than ``reset_parameters`` (their ``__init__`` runs it last,
#: after their children's): read off torch.nn, the layers that make parameters and have no ``reset_parameters``,
#: and ``nn.Transformer``, which draws all its matrices again once its layers are built
_TORCH_INITIALIZERS = {nn.MultiheadAttention: "_reset_parameters", nn.Transformer: "_reset_parameters"}
#: torch.nn layers whose ``__init__`` does not run their ``reset_parameters`` (their children's initialization is
#: all an eager build draws): read off torch.nn, every ``__init__`` in each layer's classes
_NOT_RUN_BY_INIT = (nn.AdaptiveLogSoftmaxWithLoss,)


def _initializers(module: nn.Module):
    """What an eager build of ``module`` runs, in its order: each module's initializer, children first (each layer
    as it is built, then its parent's own), not descending below a module whose ``reset_parameters`` covers its whole
    subtree. torch's ``TransformerEncoder``/``TransformerDecoder`` deep-copy the one layer they are given: the first
    is initialized, and the others are copies of it, drawing nothing, as in an eager build."""
    if not getattr(module, "reset_parameters_covers_children", False):
        layers = getattr(module, "layers", None)
        cloned = isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)) and len(layers) > 1
        for child in module.children():
            if cloned and child is layers:
                yield from _initializers(layers[0])
                yield lambda: _copy_into(layers[0], list(layers)[1:])
            else:
                yield from _initializers(child)
    if type(module) in _NOT_RUN_BY_INIT:  # the class itself: a subclass's own __init__ may run it
        return
    initialize = getattr(module, "reset_parameters", None)
    if initialize is None:
        torchs = next((name for cls in type(module).__mro__ if (name := _TORCH_INITIALIZERS.get(cls))), None)
        initialize = getattr(module, torchs, None) if torchs else None
    if callable(initialize):
        yield initialize


def _copy_into(first: nn.Module, clones: list[nn.Module]) -> None:
    for clone in clones:
        for mine, theirs in zip([*clone.parameters(), *clone.buffers()], [*first.parameters(), *first.buffers()]):
            mine.copy_(theirs)


def _users_module(module: nn.Module) -> tuple[str, str]:
    """The user's class, and the prefix its names have here: not distrain's step router around it, nor the class
    FSDP2 makes of it (``FSDPModel``)."""
    prefix = ""
    while type(module).__name__.endswith("StepRouter") and isinstance(getattr(module, "module", None), nn.Module):
        module, prefix = module.module, prefix + "module."
    users = next(c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed"))
    return users.__name__, prefix


def initialize_now(module: nn.Module) -> None:
    """For a model built whole on its device: run its initialization as a sharded replay would (the
    same calls, the same checks)."""
    replay_initialization(module, record_rng(), PlainTensors(), {})


_deferring = 0


@contextlib.contextmanager
def deferred():
    """Inside it (a sharding strategy's ``configure_model`` context) modules are built without memory
    and initialized later by ``replay_initialization``; a module that would initialize itself while
    being built (a Hugging Face model loading its weights) waits for ``reset_parameters`` instead."""
    global _deferring
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1


def initialization_deferred() -> bool:
    return _deferring > 0


def built_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's shape as its module built it, wherever the strategy's build context put it: ZeRO-3's
    ``zero.Init`` leaves an empty placeholder and keeps the shape beside it (``ds_shape``)."""
    return getattr(param, "ds_shape", param.shape)


# ---- the RNG state configure_model started from ---------------------------------------------------------------
def record_rng() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


class DeferredBuild:
    """What a sharding strategy's ``configure_model`` context leaves for its set-up: the RNG state the build
    started from (the replay draws from it) and whether to skip initialization (``empty_init=True``)."""

    def __init__(self):
        self.rng: dict[str, Any] | None = None
        self.skip = False

    def context(self, empty_init: bool | None) -> contextlib.ExitStack:
        """Layers built on the meta device, their initialization deferred to the replay, the RNG state at
        entry recorded."""
        self.skip = bool(empty_init)
        self.rng = record_rng()  # now: the stack's contexts are entered as they are added, here
        stack = contextlib.ExitStack()
        stack.enter_context(deferred())
        stack.enter_context(torch.device("meta"))
        return stack

    def take(self) -> tuple[dict[str, Any], bool]:
        """(the RNG state to replay from — now's, for a model the caller built on meta itself — and whether
        to skip initialization); the next build starts afresh."""
        rng, skip = self.rng or record_rng(), self.skip
        self.rng, self.skip = None, False
        return rng, skip


def to_empty_keeping_ties(module: nn.Module, device: str | torch.device = "cpu") -> None:
    """Meta parameters → empty ones on ``device`` (fake ones inside a fake mode), keeping tied weights tied:
    ``to_empty`` swaps each occurrence of a shared parameter separately (a tied head would become a second
    matrix of its own)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, name))
    module.to_empty(device=device)
    for places in owners.values():
        first_module, first_name = places[0]
        shared = first_module._parameters[first_name]
        for m, name in places[1:]:
            m._parameters[name] = shared
