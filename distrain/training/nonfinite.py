"""A loss or gradient norm that is NaN or infinite: the ``on_nonfinite`` policy (``stop`` the run, ``skip`` the step
on every rank, or ``ignore`` it)."""

from __future__ import annotations

import math
from typing import Any

import torch

POLICIES = ("stop", "skip", "ignore")


class NonFiniteError(RuntimeError):
    """A loss or gradient norm was NaN or infinite (``on_nonfinite="stop"``)."""


def step_is_finite(policy: str, grad_norm: Any, step_loss: torch.Tensor, step: int, runtime, checkpoints) -> bool:
    """False when step ``step``'s gradient norm is NaN or infinite (``skip``); ``stop`` raises instead, naming the
    step, the rank(s) whose loss was bad, or the gradient norm, and the newest checkpoint ``checkpoints`` kept. The
    norm is global, so every rank calls this together."""
    if grad_norm is None or policy == "ignore" or math.isfinite(float(grad_norm)):
        return True
    # every rank is here together (the norm is the same everywhere): find which losses were bad
    losses = runtime.all_gather(step_loss.detach().float().reshape(1)).flatten().tolist()
    bad = [r for r, v in enumerate(losses) if not math.isfinite(v)]
    if bad:
        what = f"the loss was {losses[bad[0]]} on rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}"
    else:
        what = f"the gradient norm was {float(grad_norm)} (the loss was finite on every rank)"
    if policy == "stop":
        last = checkpoints.last_path()
        kept = f"; {last} still holds the newest checkpoint" if last.exists() else ""
        raise NonFiniteError(
            f"distrain: at step {step} {what}; training stopped before applying it (on_nonfinite='stop'){kept}. "
            "on_nonfinite='skip' drops such steps instead"
        )
    if runtime.is_global_zero:
        print(f"distrain: at step {step} {what}; the step is skipped on every rank (on_nonfinite='skip')", flush=True)
    return False
