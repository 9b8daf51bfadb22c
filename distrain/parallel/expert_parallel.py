"""Expert parallelism: each mixture-of-experts layer's experts split over a group of ranks, 1/N each, the tokens
sent to the rank that holds their expert and back by all-to-all (``all_to_all_single`` with uneven splits, which
gloo runs too).

The group's ranks hold different tokens (they are data-parallel ranks), so an expert's gradient arrives whole on its
rank, summed over every rank's tokens: it is not all-reduced again. Each rank's loss is the mean over its own
tokens, so the sum is ``group size`` times the gradient of the mean over the group's tokens; ``scale_expert_grads``
divides it back (the data-parallel average the rest of the model gets from its all-reduce).

A layer is found by its structure, not its name: a module with a ``router`` and stacked ``experts`` whose weights
are 3-D with the experts first (``distrain.models.moe.MoE``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The mixture-of-experts layers of ``model`` that expert parallelism can split."""
    return [m for m in model.modules() if _splittable(m)]


def _splittable(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return (
        isinstance(getattr(module, "router", None), nn.Linear)
        and isinstance(experts, nn.Module)
        and callable(getattr(module, "compute", None))
        and all(p.dim() == 3 and p.shape[0] == module.router.out_features for p in experts.parameters(recurse=False))
    )


def split_experts(model: nn.Module, group: dist.ProcessGroup) -> list[nn.Module]:
    """Keep on this rank its 1/N of every layer's experts (N: ``group``'s size; the experts ``rank·E/N`` to
    ``(rank+1)·E/N - 1``) and route the layer's tokens through the group. Returns the layers split. A layer whose
    expert count N does not divide is refused in one line, naming it."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    layers = [(name, m) for name, m in model.named_modules() if _splittable(m)]
    if not layers:
        raise ValueError(
            f"expert_parallel_size={size}: {type(model).__name__} has no mixture-of-experts layer to split"
        )
    for name, layer in layers:
        count = layer.router.out_features
        if count % size:
            raise ValueError(
                f"expert_parallel_size={size} does not divide {name}'s {count} experts; choose a divisor of {count}"
            )
        local = count // size
        for pname, p in list(layer.experts.named_parameters(recurse=False)):
            piece = p.detach()[rank * local : (rank + 1) * local].clone()
            setattr(layer.experts, pname, nn.Parameter(piece, requires_grad=p.requires_grad))
            layer.experts.get_parameter(pname).expert_parallel = True  # its gradient is not all-reduced
        layer.compute = _Dispatch(layer.experts, group, size, local)
    return [m for _, m in layers]


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
    local experts, and back in the order they came."""

    def __init__(self, experts: nn.Module, group: dist.ProcessGroup, size: int, local: int):
        self.experts, self.group, self.size, self.local = experts, group, size, local

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        n, local = self.size, self.local
        sent = counts.view(n, local)  # [destination rank, its expert]: tokens this rank sends
        received = torch.empty_like(sent)  # [source rank, my expert]: tokens this rank receives
        dist.all_to_all_single(received, sent, group=self.group)
        sent_per_rank, received_per_rank = sent.sum(1).tolist(), received.sum(1).tolist()
        arrived = all_to_all_single_autograd(tokens, received_per_rank, sent_per_rank, self.group)
        # grouped by source rank, then by my expert: regroup by my expert for the experts, then back
        pieces = received.reshape(-1).tolist()  # sizes in (source, expert) order
        chunks = arrived.split(pieces)
        by_expert = [chunks[s * local + e] for e in range(local) for s in range(n)]
        # through the experts even with no token: whether the result needs a gradient (and so whether this rank
        # joins the all-to-all's backward, which every rank must) may not depend on the tokens a rank received
        out = self.experts(torch.cat(by_expert), received.sum(0).tolist())
        back = out.split([pieces[s * local + e] for e in range(local) for s in range(n)])
        returned = torch.cat([back[e * n + s] for s in range(n) for e in range(local)])
        return all_to_all_single_autograd(returned, sent_per_rank, received_per_rank, self.group)
