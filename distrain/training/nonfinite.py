"""A loss or gradient norm that is NaN or infinite: the ``on_nonfinite`` policy (``stop`` the run, ``skip`` the step
on every rank, or ``ignore`` it).

Checked on the host, a step's norm is a host-device sync: the host waits for the backward to finish before it
can launch the optimizer step, and the device runs dry meanwhile. An optimizer that follows GradScaler's protocol
(``_step_supports_amp_scaling``: torch's fused Adam, AdamW, SGD and Adagrad) takes a ``found_inf`` tensor instead and
skips the step on the device when it is 1. With such an optimizer the loop checks on the device
(``DeviceCheck``): no bad step is ever applied, and the host reads the flag one step later, when the device is long
past it."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

POLICIES = ("stop", "skip", "ignore")


class NonFiniteError(RuntimeError):
    """A loss or gradient norm was NaN or infinite (``on_nonfinite="stop"``)."""


def step_is_finite(policy: str, grad_norm: Any, step_loss: torch.Tensor, step: int, runtime, checkpoints) -> bool:
    """False when step ``step``'s gradient norm is NaN or infinite (``skip``); ``stop`` raises instead
    (``report_nonfinite``). The norm is global, so every rank calls this together."""
    if grad_norm is None or policy == "ignore" or math.isfinite(float(grad_norm)):
        return True
    report_nonfinite(policy, grad_norm, step_loss, step, runtime, checkpoints)
    return False


def report_nonfinite(policy: str, grad_norm: Any, step_loss: torch.Tensor, step: int, runtime, checkpoints) -> None:
    """Step ``step`` was not applied: ``stop`` raises, naming the step, the rank(s) whose loss was bad, or the
    gradient norm, and the newest checkpoint ``checkpoints`` kept; ``skip`` says so on rank 0. Every rank calls this
    together (one all-gather)."""
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


class DeviceCheck:
    """``on_nonfinite`` checked on the device, for an optimizer that skips a step itself when handed ``found_inf``.

    ``guarding`` hands the optimizer ``found_inf`` (the global gradient norm is not finite, so alike on every rank)
    and starts copying it to the host without waiting. ``settle`` reads it: the loop calls it at the next step's
    optimizer step, before a logging step's metrics, before any checkpoint is written, and at the end of fit, so
    every rank settles at the same point and no checkpoint or log line ever counts a bad step as applied. A bad
    step under ``stop`` then raises as the host check would, with ``global_step`` back at the steps applied; under
    ``skip`` it is counted and reported one step later than the host check would. The optimizer's own hooks
    (``on_before_optimizer_step``, ``optimizer_step``) run for a bad step, as they do under fp16's GradScaler."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._pending: tuple | None = None

    def applies(self, optimizer, grad_norm: Any) -> bool:
        return (
            self.trainer.loop.on_nonfinite != "ignore"
            and isinstance(grad_norm, torch.Tensor)
            # the optimizer's own flag: a wrapper that forwards attributes would take ``found_inf`` itself, and its
            # optimizer would never see it
            and vars(optimizer).get("_step_supports_amp_scaling", False)
            and getattr(optimizer, "found_inf", None) is None  # a GradScaler's step hands it its own
        )

    @contextlib.contextmanager
    def guarding(self, optimizer, grad_norm: torch.Tensor, step_loss: torch.Tensor, step: int) -> Iterator[None]:
        bad = torch.isfinite(grad_norm).logical_not()
        flag, ready = bad.to("cpu", non_blocking=True), None  # one byte, 0 or 1, on its way before the step
        if bad.is_cuda:  # the copy lands when the device gets there: an event says when
            ready = torch.cuda.Event()
            ready.record()
        optimizer.found_inf = bad.float()
        try:
            yield
        finally:
            del optimizer.found_inf
        self._pending = (step, flag, ready, grad_norm, step_loss)

    def settle(self) -> None:
        """Read the last guarded step's flag; report a bad one by its policy (every rank together)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, flag, ready, grad_norm, step_loss = pending
        if ready is not None:
            ready.synchronize()
        if not flag.untyped_storage()[0]:  # a byte of host memory the copy has filled: no tensor op, no sync
            return
        t = self.trainer
        if t.loop.on_nonfinite == "stop":
            t.progress.global_step = step - 1  # the bad step was never applied: it does not count
        report_nonfinite(t.loop.on_nonfinite, grad_norm, step_loss, step, t.runtime, t.checkpoints)
        t.progress.skipped_steps += 1
