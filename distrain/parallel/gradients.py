"""The global gradient norm when parameters are split several ways: DTensor shards (tensor parallel,
FSDP; possibly on different meshes) and pipeline stages (each rank holds some layers)."""

from __future__ import annotations

from itertools import groupby

import torch
import torch.distributed as dist


def total_norm(params: list[torch.Tensor], pipeline_group, device: torch.device) -> torch.Tensor:
    """The 2-norm of all gradients of the model, the same on every rank. ``params``: those this rank
    counts (a parameter two stages hold is counted by one). DTensor gradients are grouped by layout
    (one reduction per group, as torch's own clipping does per mesh); stages add their squares."""
    grads = [p.grad for p in params if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float32, device=device)

    def layout(g):
        return repr((getattr(g, "device_mesh", None), getattr(g, "placements", None)))

    for _, same in groupby(sorted(grads, key=layout), key=layout):
        norm = torch.nn.utils.get_total_norm(list(same))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # the group's norm over all shards
        squares = squares + norm.float().to(device) ** 2
    if pipeline_group is not None:
        dist.all_reduce(squares, group=pipeline_group)
    return squares.sqrt()


def scale_gradients(params: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Clip to ``max_norm`` given the global ``norm`` (torch's rule: ``max_norm / (norm + 1e-6)``, at most 1)."""
    coefficient = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    if coefficient < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coefficient)


def match_gradient_layouts(params) -> None:
    """Give each DTensor gradient its parameter's layout. A vocabulary-split embedding's gradient comes
    back whole (``Replicate``) from torch's embedding backward; cutting it to the parameter's split is
    local (no communication), saves memory, and lets copies of a tied weight be summed shard by shard."""
    for p in params:
        g = p.grad
        if g is not None and hasattr(p, "placements") and hasattr(g, "placements") and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)
