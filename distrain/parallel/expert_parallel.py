"""Expert parallelism: each mixture-of-experts layer's experts split over a group of ranks, 1/N each, the tokens
sent to the rank that holds their expert and back by all-to-all (``all_to_all_single`` with uneven splits, which
gloo runs too).

The group's ranks hold different tokens (they are data-parallel ranks), so an expert's gradient arrives whole on its
rank, summed over every rank's tokens: it is not all-reduced again. Each rank's loss is the mean over its own
tokens, so the sum is ``group size`` times the gradient of the mean over the group's tokens; ``scale_expert_grads``
divides it back (the data-parallel average the rest of the model gets from its all-reduce).

A layer is found by its structure, not its name: a module with a ``router`` and stacked ``experts`` whose weights
are 3-D with the experts first (``distrain.models.moe.MoE``).

Under the Trainer (``expert_parallel_size``, DDP and FSDP) ``split_model`` lays the ranks out as a mesh of
(expert_parallel, expert_data_parallel): N consecutive ranks hold different experts (on one node where N fits
in it: the all-to-all, every layer's traffic, stays on the node's links), ranks ``r``, ``r + N``, ... the same ones.
The rest of the model keeps its layout over every rank. The experts' gradients are then averaged over
the ranks that hold the same experts (DDP: an all-reduce when the gradient is complete; FSDP: the experts sharded
over those ranks, divided by the whole world) and the gradient norm sums every rank's experts once. Checkpoints hold
every layer's whole ``[experts, ...]`` tensors under the model's own names (``global_state`` / ``local_state``), so
they resume on another expert-parallel size, or none.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._functional_collectives import all_to_all_single_autograd

from distrain import compat
from distrain.models.moe import MoE, expert_counts, group_sizes, grouped_linear
from distrain.parallel import gradients

EP, EDP = "expert_parallel", "expert_data_parallel"


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The mixture-of-experts layers of ``model`` that expert parallelism can split."""
    return [m for m in model.modules() if expert_count(m)]


#: the stacked weights of a Hugging Face (transformers 5) layer's experts: ``[experts, 2 × intermediate, hidden]`` and
#: ``[experts, hidden, intermediate]``, each expert ``down(act(gate) * up)``: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek
_HF_EXPERT_WEIGHTS = {"gate_up_proj", "down_proj"}


def splittable_experts(model: nn.Module) -> int:
    """The experts per layer expert parallelism can split in ``model`` (the fewest, if layers differ); 0 when it has
    no mixture-of-experts layer, or one laid out as it cannot split."""
    try:
        counts = [count for m in model.modules() if (count := expert_count(m))]
    except ValueError:
        return 0
    return min(counts, default=0)


def dispatched_per_token(layer: nn.Module) -> tuple[int, int]:
    """(top_k, width) of a mixture-of-experts layer: each token leaves for ``top_k`` experts as ``width`` numbers,
    and comes back so (``expert_count`` found it); for experts that take every token, top_k is every expert."""
    router = getattr(layer, "router", None)
    router = getattr(layer, "gate", None) if router is None else router
    if not _is_distrains_moe(layer) and _takes_every_token(layer.experts):
        return expert_count(layer), router.weight.shape[1]
    top_k = getattr(layer, "top_k", None) or getattr(router, "top_k", None) or 1
    return int(top_k), router.weight.shape[1]


class ExpertLoad:
    """The balance over the experts of the last forward through a model's Hugging Face mixture-of-experts blocks: the
    busiest expert's tokens over the mean, in the least balanced layer (1.0 when even, the expert count when every
    token went to one), read from each token's chosen experts as the experts' forward receives them. A block laid
    out as expert parallelism cannot split is not watched."""

    def __init__(self, model: nn.Module):
        self.counts: dict[int, torch.Tensor] = {}
        try:
            layers = [(m.experts, count) for m in model.modules() if (count := expert_count(m)) and hasattr(m, "gate")]
        except ValueError:
            layers = []
        for index, (experts, count) in enumerate(layers):
            experts.register_forward_pre_hook(functools.partial(self._see, index, count))
        self.watched = len(layers)

    def _see(self, index: int, count: int, module: nn.Module, args: tuple) -> None:
        if len(args) >= 2 and isinstance(args[1], torch.Tensor):  # (hidden_states, top_k_index, top_k_weights)
            self.counts[index] = expert_counts(args[1].detach().reshape(-1), count)

    def max_over_mean(self) -> torch.Tensor | None:
        if not self.counts:
            return None
        return torch.stack([c.max() / c.float().mean().clamp(min=1e-9) for c in self.counts.values()]).max()


def expert_count(module: nn.Module) -> int:
    """How many experts ``module`` holds when it is a mixture-of-experts layer expert parallelism can split (0 when
    it is none); one line naming what stops it when it is one that cannot be split. Found by structure: stacked
    ``experts`` weights, experts first, with a router beside them: distrain's ``MoE`` (``router``, ``compute``) or a
    Hugging Face sparse-MoE block (``gate`` with a ``[experts, hidden]`` weight)."""
    experts = getattr(module, "experts", None)
    if not isinstance(experts, nn.Module):
        return 0
    stacked = dict(experts.named_parameters(recurse=False))
    router = getattr(module, "router", None)
    router = getattr(module, "gate", None) if router is None else router
    # the experts' count: their stacked weights' first dimension, which the router scores (its weight may sit in a
    # sub-layer of its own: HunYuan's gate.wg), perhaps with one more class for "no expert" (ZAYA's skip expert,
    # whose tokens reach the experts with weight 0)
    scores = [p.shape[0] for p in router.parameters() if p.dim() == 2] if isinstance(router, nn.Module) else []
    if not stacked or not scores or all(p.dim() < 3 for p in stacked.values()):
        return 0
    count = next(iter(stacked.values())).shape[0]
    if not all(p.shape[0] == count for p in stacked.values()) or not {count, count + 1} & set(scores):
        return 0
    if _is_distrains_moe(module):
        return count
    # transformers' flags for experts laid out otherwise: transposed, with biases, gate and up interleaved, no gate,
    # a norm after each expert (integrations/moe.py, 5.x). Experts that declare them are computed by transformers'
    # own grouped forward (compat.experts_grouped_forward), whatever their layout
    declared = compat.experts_grouped_forward(experts) is not None
    layout = not declared and _declares_own_layout(experts)
    unknown = set(stacked) != _HF_EXPERT_WEIGHTS or not callable(getattr(experts, "act_fn", None))
    if layout or (unknown and not declared):
        raise ValueError(
            f"expert parallelism cannot split {type(module).__name__} yet: its experts ({type(experts).__name__}) "
            f"hold {', '.join(sorted(stacked))}{' (transposed, biased, interleaved or normed)' if layout else ''}, "
            "and it splits experts of gate_up_proj [experts, 2 × intermediate, hidden] and down_proj with an act_fn "
            "(Mixtral, Qwen-MoE, OLMoE, DeepSeek); train it without expert_parallel_size"
        )
    per_expert = sorted(  # one value per expert held by a sub-layer (Ergo's experts' own norms): not split yet
        f"{type(experts).__name__}.{name}"
        for name, p in experts.named_parameters()
        if "." in name and p.dim() >= 1 and p.shape[0] == count
    )
    if per_expert:
        raise ValueError(
            f"expert parallelism cannot split {type(module).__name__} yet: {', '.join(per_expert)} holds one row per "
            "expert outside the stacked weights it splits; train it without expert_parallel_size"
        )
    called = _forward_arguments(experts)
    if called is not None and len(called) not in (1, 3):
        raise ValueError(
            f"expert parallelism cannot split {type(module).__name__} yet: its experts ({type(experts).__name__}) "
            f"are called as forward({', '.join(called)}), and it splits experts called with each token's top-k "
            "choices, forward(hidden_states, top_k_index, top_k_weights) (Mixtral, Qwen-MoE, OLMoE, DeepSeek), or "
            "with every token for every expert, forward(hidden_states) (Llama 4); train it without "
            "expert_parallel_size"
        )
    return count


def _takes_every_token(experts: nn.Module) -> bool:
    """Experts called as ``forward(hidden_states)`` alone (Llama 4's): every token goes to every expert, its rows
    grouped by expert and weighted by the router before the call (zero where the expert was not chosen)."""
    return len(_forward_arguments(experts) or ()) == 1


def _forward_arguments(module: nn.Module) -> list[str] | None:
    """The names a module's class takes in ``forward`` after ``self`` (None where its signature cannot be read)."""
    try:
        parameters = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return None
    return [name for name in parameters if name != "self"]


def _is_distrains_moe(module: nn.Module) -> bool:
    """distrain's own ``MoE`` (``models/moe.py``: a linear ``router`` and a ``compute`` step), not a Hugging Face
    block that also names its router ``router`` (Phi-3.5-MoE's)."""
    return isinstance(module, MoE)


def split_experts(model: nn.Module, group: dist.ProcessGroup) -> list[nn.Module]:
    """Keep on this rank its 1/N of every layer's experts (N: ``group``'s size; the experts ``rank·E/N`` to
    ``(rank+1)·E/N - 1``) and route the layer's tokens through the group. Returns the layers split. A layer whose
    expert count N does not divide is refused in one line, naming it."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    layers = [(name, m, expert_count(m)) for name, m in model.named_modules()]
    layers = [(name, m, count) for name, m, count in layers if count]
    if not layers:
        raise ValueError(
            f"expert_parallel_size={size}: {type(model).__name__} has no mixture-of-experts layer to split"
        )
    for name, layer, count in layers:
        if count % size:
            raise ValueError(
                f"expert_parallel_size={size} does not divide {name}'s {count} experts; choose a divisor of {count}"
            )
        local = count // size
        for pname, p in list(layer.experts.named_parameters(recurse=False)):
            piece = p.detach()[rank * local : (rank + 1) * local].clone()
            setattr(layer.experts, pname, nn.Parameter(piece, requires_grad=p.requires_grad))
            layer.experts.get_parameter(pname).expert_parallel = True  # its gradient is not all-reduced
        if _is_distrains_moe(layer):  # its compute step goes through the group
            layer.compute = _Dispatch(layer.experts, group, size, local)
        elif _takes_every_token(layer.experts):  # every token for every expert: each expert's rows go to its rank
            layer.experts.forward = _EveryTokenDispatch(layer.experts.forward, group, local)
        else:  # a Hugging Face block: its experts' forward (routing in, weighted sum out) does
            compute = _hf_compute(layer.experts)  # before num_experts changes: the route depends on the module
            if compat.experts_grouped_forward(layer.experts) is not None:
                layer.experts.num_experts = local  # transformers' grouped forward counts this rank's experts
            layer.experts.forward = _HFExperts(layer.experts, _Dispatch(compute, group, size, local))
    return [m for _, m, _ in layers]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters ``split_experts`` left on this rank: each rank's own, not replicas."""
    return [p for p in model.parameters() if getattr(p, "expert_parallel", False)]


def scale_expert_grads(model: nn.Module, group_size: int) -> None:
    """The experts' gradients, summed over the group's tokens by the all-to-all's backward, as the mean over the
    group's ranks (what the rest of the model's all-reduce gives)."""
    for p in expert_parameters(model):
        if p.grad is not None:
            p.grad.div_(group_size)


class _Dispatch:
    """``MoE.compute`` over the group: tokens grouped by (global) expert go to the rank that holds it, through its
    local experts (``experts(tokens, counts)``: each expert's ``counts[e]`` tokens through it), and back in the order
    they came."""

    def __init__(self, experts: Callable, group: dist.ProcessGroup, size: int, local: int):
        self.experts, self.group, self.size, self.local = experts, group, size, local

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        n, local = self.size, self.local
        if isinstance(counts, FakeTensor):  # the planner's trace: the routing even on every rank (``group_sizes``)
            even = group_sizes(counts, len(tokens))
            sent = [even[d * local : (d + 1) * local] for d in range(n)]
            mine = dist.get_rank(self.group)
            received = [even[mine * local : (mine + 1) * local]] * n  # each rank sends me what I keep of mine
        else:
            to = counts.view(n, local)  # [destination rank, its expert]: tokens this rank sends
            came = torch.empty_like(to)  # [source rank, my expert]: tokens this rank receives
            dist.all_to_all_single(came, to, group=self.group)
            sent, received = to.tolist(), came.tolist()
        sent_per_rank, received_per_rank = [sum(row) for row in sent], [sum(row) for row in received]
        arrived = all_to_all_single_autograd(tokens, received_per_rank, sent_per_rank, self.group)
        # grouped by source rank, then by my expert: regroup by my expert for the experts, then back
        pieces = [size for row in received for size in row]  # sizes in (source, expert) order
        chunks = arrived.split(pieces)
        by_expert = [chunks[s * local + e] for e in range(local) for s in range(n)]
        # through the experts even with no token: whether the result needs a gradient (and so whether this rank
        # joins the all-to-all's backward, which every rank must) may not depend on the tokens a rank received
        out = self.experts(torch.cat(by_expert), [sum(row[e] for row in received) for e in range(local)])
        back = out.split([pieces[s * local + e] for e in range(local) for s in range(n)])
        returned = torch.cat([back[e * n + s] for s in range(n) for e in range(local)])
        return all_to_all_single_autograd(returned, sent_per_rank, received_per_rank, self.group)


class _EveryTokenDispatch:
    """Experts that take every token for every expert (``_takes_every_token``), split: the rows a rank holds for
    another rank's experts (a block of ``local`` experts × its tokens) go to that rank, through its experts (the
    module's own forward, on the experts it holds, with every rank's tokens), and back in the order they came."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], group: dist.ProcessGroup, local: int):
        self.forward, self.group, self.local = forward, group, local

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        size, local, width = dist.get_world_size(self.group), self.local, hidden.shape[-1]
        mine = hidden.shape[0] // (size * local)  # this rank's tokens: the rows of each expert
        if compat.is_fake(hidden):  # the planner's trace: as many tokens on every rank
            tokens = [mine] * size
        else:
            gathered = [torch.zeros(1, dtype=torch.long, device=hidden.device) for _ in range(size)]
            dist.all_gather(gathered, torch.tensor([mine], device=hidden.device), group=self.group)
            tokens = [int(t) for t in gathered]
        sent, received = [local * mine] * size, [local * t for t in tokens]
        arrived = all_to_all_single_autograd(hidden, received, sent, self.group).split(received)
        # each source rank's block is [my experts, its tokens]: side by side, [my experts, every rank's tokens]
        rows = torch.cat([block.view(local, t, width) for block, t in zip(arrived, tokens)], dim=1)
        out = self.forward(rows.reshape(-1, width))
        back = out.view(local, sum(tokens), -1).split(tokens, dim=1)
        returned = torch.cat([block.reshape(-1, out.shape[-1]) for block in back])
        return all_to_all_single_autograd(returned, sent, received, self.group)


class _HFExperts:
    """A Hugging Face experts module's ``forward(hidden_states, top_k_index, top_k_weights)`` with its experts split:
    each token's ``top_k`` copies grouped by expert, through ``dispatch``, weighted and summed back per token (in
    the order transformers' own loop sums them: by expert)."""

    def __init__(self, experts: nn.Module, dispatch: _Dispatch):
        self.count = dispatch.size * dispatch.local
        self.dispatch = dispatch

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        top_k = top_k_index.shape[-1]
        slots = top_k_index.reshape(-1)
        counts = expert_counts(slots, self.count)
        order = slots.argsort(stable=True)
        token = order // top_k
        out = self.dispatch(hidden[token], counts)
        out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        return torch.zeros_like(hidden).index_add_(0, token, out.to(hidden.dtype))


def _hf_compute(experts: nn.Module) -> Callable[[torch.Tensor, list[int]], torch.Tensor]:
    """This rank's experts of a Hugging Face experts module, as transformers computes each. A module built with
    transformers' ``use_experts_implementation`` goes through transformers' own grouped forward (every layout its
    flags declare), each dispatched row its own token with its expert and a weight of 1; another: ``down(gate(
    gate_up))``, the module's own gating where it has one (``compat.experts_gate``), else ``act(gate) * up``."""
    grouped = compat.experts_grouped_forward(experts)
    if grouped is not None:

        def through_transformers(tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
            if not tokens.shape[0]:  # no row for this rank's experts: zero gradients for them, not none, and the
                # rows (none) still in the graph, so that the backward's all-to-all runs here as on the other ranks
                nothing = sum(p.reshape(-1)[:1].sum() for p in experts.parameters(recurse=False))
                return tokens * 0 + 0 * nothing
            rows = torch.tensor(counts, device=tokens.device)
            ids = torch.repeat_interleave(torch.arange(len(counts), device=tokens.device), rows).unsqueeze(1)
            return grouped(experts, tokens, ids, torch.ones(ids.shape, dtype=tokens.dtype, device=tokens.device))

        return through_transformers
    own = compat.experts_gate(experts)

    def gated(gate_up: torch.Tensor) -> torch.Tensor:
        if own is not None:
            return own(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return experts.act_fn(gate) * up

    def compute(tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return grouped_linear(gated(grouped_linear(tokens, experts.gate_up_proj, counts)), experts.down_proj, counts)

    return compute


def check_size(size: Any, world_size: int | None = None) -> int:
    """``expert_parallel_size`` (against the run's ranks, ``world_size``, once known), before any rank starts: one
    line naming the key."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(
            f"expert_parallel_size (distributed.expert_parallel_size) must be a positive integer, got {size!r}"
        )
    if size > 1 and world_size is not None and world_size % size:
        raise ValueError(
            f"expert_parallel_size={size} (distributed.expert_parallel_size) must divide the number of ranks, "
            f"{world_size} (devices × num_nodes)"
        )
    return size


def _declares_own_layout(experts: nn.Module) -> bool:
    """Experts laid out otherwise than transformers' default: transposed, biased, interleaved, gateless, normed."""
    return bool(
        getattr(experts, "is_transposed", False)
        or getattr(experts, "has_bias", False)
        or not getattr(experts, "is_concatenated", True)
        or not getattr(experts, "has_gate", True)
        or getattr(experts, "has_post_expert_norm", False)
    )


def check_module(module: nn.Module, size: int) -> None:
    """Before any rank starts: ``module`` has mixture-of-experts layers, and ``size`` divides each one's experts. A
    model built in ``configure_model`` has no layers yet: the experts it declares (``hparams["n_experts"]``, the
    built-in GPT's) are checked, and the rest when its ranks split it."""
    if size == 1 or experts_of(module) is not None:  # split already (predict after fit): checked when it was split
        return
    params = list(module.parameters())
    if not params or any(p.is_meta for p in params):
        hparams = getattr(module, "hparams", None)
        declared = hparams.get("n_experts") if isinstance(hparams, dict) else None
        if declared == 0:
            raise ValueError(
                f"expert_parallel_size={size}: {type(module).__name__} declares no experts (n_experts=0), so it has "
                "no mixture-of-experts layer to split"
            )
        if isinstance(declared, int) and declared and declared % size:
            raise ValueError(
                f"expert_parallel_size={size} does not divide the model's {declared} experts (n_experts); choose a "
                f"divisor of {declared}"
            )
        return
    layers = [(name, expert_count(m)) for name, m in module.named_modules()]
    layers = [(name, count) for name, count in layers if count]
    if not layers:
        raise ValueError(
            f"expert_parallel_size={size}: {type(module).__name__} has no mixture-of-experts layer to split"
        )
    for name, count in layers:
        if count % size:
            raise ValueError(
                f"expert_parallel_size={size} does not divide {name}'s {count} experts; choose a divisor of {count}"
            )


@dataclass
class ExpertSplit:
    """What ``split_model`` did: the mesh, this rank's place in it, and the experts' parameters by name."""

    size: int
    """Ranks that split each layer's experts (N)."""
    mesh: Any
    """``DeviceMesh`` of (expert_parallel, expert_data_parallel)."""
    world: int
    owners: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)
    """Each expert parameter's name in the model (``experts_of``) → (its ``experts`` module, its attribute): the live
    parameter, also once FSDP replaced it."""

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank(EP)

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(EP)

    @property
    def data_group(self) -> dist.ProcessGroup:
        """The ranks that hold the same experts."""
        return self.mesh.get_group(EDP)

    def parameter(self, name: str) -> torch.Tensor:
        module, attr = self.owners[name]
        return getattr(module, attr)

    def parameters(self) -> list[torch.Tensor]:
        """This rank's expert parameters, as they are now."""
        return [self.parameter(n) for n in self.owners]

    def owns(self, param: torch.Tensor) -> bool:
        """``param`` is one of this rank's expert parameters."""
        return any(param is p for p in self.parameters())

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every expert of a layer, whole (``local``: this rank's, whole over its expert-data-parallel ranks); every
        expert-parallel rank calls it together."""
        return _gather_rows(local, self.group)

    def held(self) -> dict[str, tuple[int, int]]:
        """The experts this rank holds (whole, or its shard of them), by parameter: ``(first, last + 1)``."""
        return {
            name: (self.rank * _rows(p), (self.rank + 1) * _rows(p)) for name, p in zip(self.owners, self.parameters())
        }

    # ---- gradients ------------------------------------------------------------------------------------------------
    def average_when_complete(self, syncing: Callable[[], bool]) -> None:
        """DDP: DDP leaves the experts alone (each rank's are its own); once a backward that syncs (``syncing()``)
        has accumulated an expert's gradient, it is summed over the ranks holding the same experts and divided by
        the world: the mean over every rank's tokens, as the rest of the model's all-reduce gives."""
        data_ranks = self.world // self.size

        def average(param: torch.Tensor) -> None:
            if syncing():
                if data_ranks > 1:
                    dist.all_reduce(param.grad, group=self.data_group)
                param.grad.div_(self.world)

        for name in self.owners:
            self.parameter(name).register_post_accumulate_grad_hook(average)

    def shard(self, fully_shard: Callable, **kwargs: Any) -> None:
        """FSDP: each layer's experts a unit of their own, sharded over the ranks that hold the same experts; the
        reduce-scatter divides by the world (its sum over N times fewer ranks carries every rank's tokens)."""
        for module in {id(m): m for m, _ in self.owners.values()}.values():
            fully_shard(module, mesh=self.mesh[EDP], **kwargs)
            module.set_gradient_divide_factor(float(self.world))
            if self.world > self.size and dist.get_backend(self.data_group) == "gloo":
                # gloo has no pre-multiplied sum: a sum, then the division. Not on one rank: there torch 2.13's FSDP
                # divides by the factor twice when sums are forced (the gradients came out a quarter, not a half)
                module.set_force_sum_reduction_for_comms(True)

    def total_norm(self, shared: list[torch.Tensor], experts: list[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of every gradient of the model: of ``shared`` parameters (alike on every rank, or sharded) and
        of every rank's ``experts`` once (their squares summed over the expert-parallel ranks)."""
        device = (shared or experts)[0].device
        others = gradients.total_norm(shared, None, device)
        own = gradients.total_norm(experts, self.group, device)
        return (others**2 + own**2).sqrt()

    # ---- checkpoints: each layer's experts whole, under the model's names -----------------------------------------
    def global_state(self, state: dict[str, Any], sharded: dict[str, Any] | None = None) -> dict[str, Any]:
        """``state`` (a model's state dict, or an optimizer's per-parameter ``state``) with each layer's experts whole,
        ``[experts, ...]``. ``sharded`` given (``state`` is full, perhaps on rank 0 only): this rank's own state,
        gathered into ``state``'s entries. Else ``state`` is this rank's own and each expert tensor becomes a
        DTensor over the mesh, which DCP writes and reshards. Call on every rank."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        out = dict(state)
        for name, fieldname, value in self._entries(state if sharded is None else sharded):
            local = value.full_tensor() if sharded is not None and isinstance(value, DTensor) else value
            if sharded is not None:
                whole = _gather_rows(local, self.group)
                present = _get(state, name, fieldname)
                if present is not None:
                    _put(out, name, fieldname, whole.to(present.device))
                continue
            fsdp = isinstance(local, DTensor)
            within = local.placements[0] if fsdp else Replicate()  # FSDP's: rows, or columns (few experts)
            local = local.to_local() if fsdp else local
            live = self.parameter(name)
            shape = torch.Size((self.size * _rows(live), *live.shape[1:]))
            placements = [Shard(0), within]
            whole = DTensor.from_local(local, self.mesh, placements, shape=shape, stride=_contiguous_stride(shape))
            _put(out, name, fieldname, whole)
        return out

    def local_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The reverse of ``global_state``: whole expert tensors (full ones, or the DTensors it made) as this rank's
        part of them. A checkpoint with another number of experts is refused, naming the tensor."""
        from torch.distributed.tensor import DTensor

        out = dict(state)
        for name, fieldname, value in self._entries(state):
            live = self.parameter(name)
            rows = _rows(live)
            if isinstance(value, DTensor) and value.device_mesh is self.mesh:
                local = value.to_local()
                if isinstance(live, DTensor):
                    local = DTensor.from_local(
                        local, live.device_mesh, live.placements, shape=live.shape, stride=live.stride()
                    )
            elif value.shape[0] == rows * self.size:
                local = value[self.rank * rows : (self.rank + 1) * rows]
            else:
                what = name + (f" ({fieldname})" if fieldname else "")
                raise ValueError(f"{what}: {value.shape[0]} experts in the checkpoint, {rows * self.size} in the model")
            _put(out, name, fieldname, local)
        return out

    def global_shapes(self, shapes: dict[str, tuple]) -> dict[str, tuple]:
        """A model's parameter shapes with its experts' whole (to compare with a checkpoint's)."""
        out = dict(shapes)
        for name in self.owners:
            if name in out:
                out[name] = (out[name][0] * self.size, *out[name][1:])
        return out

    def _entries(self, state: dict[str, Any]):
        """(parameter name, optimizer field or None, tensor) of every expert tensor in ``state``, in the same order on
        every rank; an optimizer's step counts (0-d) are left alone."""
        for name in self.owners:
            value = state.get(name)
            fields = value.items() if isinstance(value, dict) else [(None, value)]
            for fieldname, tensor in fields:
                if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
                    yield name, fieldname, tensor


def clip(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients of ``params`` so that their total ``norm`` is at most ``max_norm`` (torch's clipping, on
    gradients that are DTensors of different meshes: each scaled in place through its local part)."""
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        grad.mul_(coef.to(grad.device, grad.dtype))


def split_model(model: nn.Module, size: int, device_type: str) -> ExpertSplit:
    """Every rank together: the mesh of (expert_parallel, expert_data_parallel) over the world, each layer's experts
    split over the expert-parallel ranks (``split_experts``), and the split recorded on ``model`` (``experts_of``)."""
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size()
    # N consecutive ranks split the experts (one node's, where N fits in it), ranks N apart hold the same ones. The
    # expert-parallel dimension comes first, so that a layer's experts are [Shard(0), Shard(0)] over the mesh: the
    # rows split among the expert-parallel ranks, then each rank's among those that hold the same ones (FSDP)
    ranks = [[j * size + i for j in range(world // size)] for i in range(size)]  # a list: the planner's fake tensors
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=(EP, EDP))
    split = ExpertSplit(size, mesh, world)
    for layer in split_experts(model, mesh.get_group(EP)):
        layer.experts._distrain_expert_split = split
    return experts_of(model)


def experts_of(model: nn.Module) -> ExpertSplit | None:
    """The ``ExpertSplit`` of a model ``split_model`` split (its expert parameters named as in ``model``'s state
    dict, whatever wraps its layers), else None."""
    owners, split = {}, None
    for name, module in model.named_modules():
        split = getattr(module, "_distrain_expert_split", None) or split
        if hasattr(module, "_distrain_expert_split"):
            prefix = ".".join(part for part in name.split(".") if part not in _WRAPPERS)
            for attr, _ in module.named_parameters(recurse=False):
                owners[f"{prefix}.{attr}".lstrip(".")] = (module, attr)
    return None if split is None else dataclasses.replace(split, owners=owners)


#: the names wrappers add to a layer's (activation checkpointing, compile), which state dicts leave out
_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def _rows(param: torch.Tensor) -> int:
    """This rank's experts in ``param`` (a DTensor sharded over the expert-data-parallel ranks counts whole)."""
    return param.shape[0]


def _contiguous_stride(shape: tuple) -> tuple:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def _gather_rows(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every expert-parallel rank's experts (``local``: this rank's, whole over its expert-data-parallel ranks)."""
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces)


def _get(state: dict[str, Any], name: str, fieldname: str | None) -> torch.Tensor | None:
    value = state.get(name)
    return value.get(fieldname) if isinstance(value, dict) and fieldname is not None else value


def _put(out: dict[str, Any], name: str, fieldname: str | None, value: torch.Tensor) -> None:
    out[name] = value if fieldname is None else {**out[name], fieldname: value}
