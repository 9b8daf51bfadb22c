"""``lightning.pytorch.utilities``: the helpers Lightning's scripts import from it."""

from distrain.lightning.trainer import seed_everything
from distrain.lightning.utilities.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_only, rank_zero_warn
from distrain.module import AttributeDict

__all__ = [
    "AttributeDict",
    "grad_norm",
    "rank_zero_debug",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
    "seed_everything",
]


def grad_norm(module, norm_type: float | int | str, group_separator: str = "/") -> dict:
    """Lightning's: each parameter's gradient norm, ``grad_{norm_type}_norm/{name}``, and their total,
    ``grad_{norm_type}_norm_total`` (to log in ``on_before_optimizer_step``)."""
    import torch

    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"grad_norm: norm_type must be a positive number or 'inf', got {norm_type}")
    norms = {
        f"grad_{norm_type}_norm{group_separator}{name}": p.grad.detach().norm(norm_type)
        for name, p in module.named_parameters()
        if p.grad is not None
    }
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.stack(list(norms.values())).norm(norm_type)
    return norms
