"""Which rank holds the others back: each rank's step, split into its parts, compared across the ranks.

In synchronous training every rank's step takes the same wall time, because the fast ranks wait for the slowest one
inside the step's collectives. The wall time therefore says nothing about who is slow. What a rank spends *before it
can meet the others* does, and two parts of a step are each rank's own:

- **data wait**: how long the loop waited for the step's batches (a slow disk, a loader worker short of CPU);
- **compute**: ``training_step`` up to its loss, then the backward up to the last gradient this rank produced.
  Neither has a collective under single and DDP: DDP's all-reduces run beside the backward, and a rank waits for
  the others only after its last gradient. Under FSDP, ZeRO-3 and tensor parallelism the forward also waits for
  parameter all-gathers, and a sharded gradient comes from a reduce-scatter, so there a rank slow in compute
  shows only in part (its data wait always shows). On CUDA only the forward is timed (CUDA events): the host
  runs ahead of the backward's kernels.

The rest of the step (the wait for the gradient synchronization, and the optimizer) is where the fast ranks do
their waiting; it is logged as ``sync_s``.

A rank is slow over a logging window when its own time (data wait + compute) exceeds the median of the other
ranks' by more than ``threshold`` of the step time; it is named a straggler once it was the slow one in windows in a
row over ``PERSISTS_STEPS`` steps (one window of 8 steps or more, or several shorter ones). The excess is measured
against the step time, not against the others' own time, so a millisecond of jitter in a tiny forward is never news.
The window's parts come from every rank in the all-gather that already carries the memory readings on logging
steps, so finding stragglers costs no collective of its own. A step costs two clock readings and one per parameter's
gradient (CUDA events on a GPU, so the forward is its kernels' time, not their launch).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

#: the per-rank parts of a step, as logged (seconds per step, means over the logging window)
PARTS = ("data_wait_s", "compute_s", "sync_s")
#: a rank is named once it was the slow one in logging windows in a row over at least this many steps: with a
#: window of a step, a busy machine named a new "straggler" nearly every step, from rank to rank
PERSISTS_STEPS = 8


class StepTimer:
    """This rank's parts of its steps since the last window: ``data_waited`` after the batches came,
    ``forward_started`` / ``forward_ended`` around each ``training_step``, ``step_ended`` after each step, and
    the backward's last local gradient through ``watch_gradients``' hooks."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._hooks: list = []
        self._last_gradient = 0.0  # when this rank last produced a gradient (host clock)
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.window_start = now
        self.steps = 0
        self.data_wait = 0.0
        self.compute = 0.0
        self._events: list[tuple] = []  # CUDA: (start, end) event pairs, read once the window closes
        self._forward_from: float | torch.cuda.Event | None = None
        self._backward_from: float | None = None

    def watch_gradients(self, parameters) -> None:
        """Time each parameter's gradient as the backward produces it (a clock reading each, on the host). The
        last one ends this rank's own part of the backward; what follows is waiting for the other ranks in the
        gradient synchronization. On CUDA the host runs ahead of the kernels, so there only the forward is timed;
        a sharded parameter (FSDP, ZeRO-3) gets its gradient from a reduce-scatter, not a backward: the hooks never
        fire, and the backward counts as synchronization."""
        if self.cuda:
            return

        def produced(_):
            self._last_gradient = time.perf_counter()

        self._hooks = [p.register_post_accumulate_grad_hook(produced) for p in parameters if p.requires_grad]

    def unwatch(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def data_waited(self, seconds: float) -> None:
        self.data_wait += seconds

    def forward_started(self) -> None:
        self._backward_done()
        if self.cuda:
            self._forward_from = torch.cuda.Event(enable_timing=True)
            self._forward_from.record()
        else:
            self._forward_from = time.perf_counter()

    def forward_ended(self) -> None:
        start, self._forward_from = self._forward_from, None
        if start is None:  # a forward the timer did not see start (a pipeline's pieces)
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((start, end))
        else:
            self._backward_from = now = time.perf_counter()
            self.compute += now - start

    def _backward_done(self) -> None:
        """The micro-batch's backward, up to its last gradient, into this rank's compute."""
        start, self._backward_from = self._backward_from, None
        if start is not None and self._last_gradient > start:
            self.compute += self._last_gradient - start

    def step_ended(self) -> None:
        self._backward_done()
        self.steps += 1

    def window(self) -> list[float]:
        """This rank's mean seconds per step of each of ``PARTS`` since the last window, and starts a new one.
        Called on logging steps, after the device was synchronized (the CUDA events have completed)."""
        now = time.perf_counter()
        steps = max(self.steps, 1)
        compute = self.compute + sum(a.elapsed_time(b) / 1000 for a, b in self._events)
        step_time = (now - self.window_start) / steps
        data_wait, compute = self.data_wait / steps, compute / steps
        self._reset(now)
        return [data_wait, compute, max(step_time - data_wait - compute, 0.0)]


@dataclass
class Straggler:
    rank: int
    data_wait_s: float
    compute_s: float
    others_data_wait_s: float  # the median over the other ranks
    others_compute_s: float
    step_s: float

    @property
    def excess_s(self) -> float:
        return (self.data_wait_s + self.compute_s) - (self.others_data_wait_s + self.others_compute_s)

    @property
    def cause(self) -> str:
        """Where most of its excess is: ``"data"`` (its loader) or ``"compute"`` (its forward and backward)."""
        data, compute = self.data_wait_s - self.others_data_wait_s, self.compute_s - self.others_compute_s
        return "data" if data > compute else "compute"

    def metrics(self) -> dict[str, float]:
        return {
            "straggler_rank": self.rank,
            "straggler_data_wait_s": round(self.data_wait_s, 6),
            "straggler_compute_s": round(self.compute_s, 6),
            "straggler_excess": round(self.excess_s / self.step_s, 3),
        }

    def line(self, first_step: int, last_step: int) -> str:
        return (
            f"distrain: rank {self.rank} is a straggler over steps {first_step}-{last_step}: its data wait "
            f"{self.data_wait_s:.3f} s + compute {self.compute_s:.3f} s a step, against "
            f"{self.others_data_wait_s:.3f} s + {self.others_compute_s:.3f} s on the other ranks (median; "
            f"+{self.excess_s:.3f} s, "
            f"{100 * self.excess_s / self.step_s:.0f}% of a {self.step_s:.3f} s step): slow in its "
            f"{'data loading' if self.cause == 'data' else 'compute'}; the others wait for it in the step's "
            "collectives. Training goes on"
        )


def find_straggler(per_rank: list[list[float]], threshold: float) -> Straggler | None:
    """The rank whose own time (data wait + compute, the first two of ``PARTS``) exceeds the median of the other
    ranks' by more than ``threshold`` of the step time; None on one rank, or when no rank does."""
    if len(per_rank) < 2 or threshold <= 0:
        return None
    own = [data + compute for data, compute, _ in per_rank]
    worst = max(range(len(own)), key=own.__getitem__)
    others = [row for r, row in enumerate(per_rank) if r != worst]
    step = max(sum(row) for row in per_rank)  # every rank's step lasts as long: each rank's parts add up to it
    if step <= 0 or own[worst] - statistics.median(d + f for d, f, _ in others) <= threshold * step:
        return None
    data, compute, _ = per_rank[worst]
    return Straggler(
        worst, data, compute, statistics.median(r[0] for r in others), statistics.median(r[1] for r in others), step
    )
