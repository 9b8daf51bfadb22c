"""Optimizer and learning-rate schedule used by the CLI jobs and the plain-module adapter."""

from __future__ import annotations

import math

import torch
from torch import nn


def adamw(model: nn.Module, lr: float, weight_decay: float, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW with no decay on biases, norms and other 1-D parameters (the usual GPT recipe).
    ``fused``: torch's single-kernel implementation; None → wherever torch has it for the
    parameters' device (see ``fused_adamw_default``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = fused_adamw_default(params) if fused is None else fused
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95), fused=fused or None)


#: where torch has a fused AdamW kernel and distrain measured it no slower than the for-each one
#: (benchmarks/fused_adamw.py, torch 2.13: 0.14-0.28x the time on CPU for the built-in GPT sizes)
FUSED_ADAMW_DEVICES = ("cuda", "cpu")


def fused_adamw_default(params: list[torch.Tensor]) -> bool:
    """Fused AdamW when every parameter is a floating-point tensor on a device in
    ``FUSED_ADAMW_DEVICES`` (FSDP2's DTensor shards included); the for-each one otherwise."""
    if not params:
        return False
    return all(
        p.device.type in FUSED_ADAMW_DEVICES and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
        for p in params
    )


def warmup_decay(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, kind: str = "cosine"):
    """Linear warmup to the base lr, then cosine or linear decay to 10% of it (or constant)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant" or total_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if kind == "cosine" else 1 - progress
        return 0.1 + 0.9 * decay

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
