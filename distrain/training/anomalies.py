"""Loss spikes and non-finite losses: caught before the step is applied, re-run to tell bad data from bad hardware,
then stopped at, skipped or rolled back from (``Trainer(on_anomaly=...)``, ``training.on_anomaly``).

After each step's forward and backward, and before its optimizer step, the ranks share their losses (one small
all-gather, and so one host sync, a step: the price of the switch, paid only when it is on). A loss is anomalous when
it is not finite, or when its robust z-score against the recent losses of every rank (median and MAD over a window,
so one earlier spike does not hide the next) is above the threshold.

An anomalous step is run again on every rank: the same weights (nothing was applied yet), the same batches, the same
RNG state. Megatron's rerun machine has the idea; here it is one switch:
- the re-run gives the same losses: the data is at fault. The samples of the ranks whose loss was anomalous are
  written to ``<run dir>/anomalies.jsonl``;
- a rank's loss changes: the same inputs gave another result there, so that rank's hardware is suspect, and it is
  named.
Then ``stop`` ends the run before the step is applied (naming the step, the rank and the verdict), ``skip`` drops the
step on every rank (``skipped_steps``), and ``rollback`` loads the newest checkpoint and trains on from it. A step
whose data was at fault is then skipped when the replay reaches it, so a rollback does not meet the same samples
again; one the hardware spoiled is replayed.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from distrain.data import batch_size_of
from distrain.runtime import set_rng_state
from distrain.training.optimizers import step_schedulers

POLICIES = ("stop", "skip", "rollback")
#: how far a re-run's loss may move and still be the same result (GPU kernels that add in another order)
SAME_RESULT = 1e-4
#: the fewest earlier losses (per rank, pooled) before a spike is judged; a non-finite loss is judged at once
MIN_HISTORY = 8


class AnomalyError(RuntimeError):
    """A loss spike or a non-finite loss under ``on_anomaly="stop"``."""


@dataclass
class Anomaly:
    step: int
    kind: str  # "spike" or "not finite"
    ranks: list[int]  # whose loss was anomalous
    losses: list[float]  # every rank's loss
    median: float | None  # of the window, for a spike
    zscores: dict[int, float] = field(default_factory=dict)
    rerun_losses: list[float] = field(default_factory=list)
    changed: list[int] = field(default_factory=list)  # the ranks whose re-run gave another loss: hardware suspect

    @property
    def verdict(self) -> str:
        return "hardware" if self.changed else "data"

    def describe(self) -> str:
        rank = self.ranks[0]
        if self.kind == "spike":
            what = (
                f"the loss spiked on rank {rank} ({self.losses[rank]:.4g} against a median of {self.median:.4g} over "
                f"the last steps, robust z-score {self.zscores[rank]:.1f})"
            )
        else:
            what = f"the loss was {self.losses[rank]} on rank {rank}"
        if len(self.ranks) > 1:
            what += f" (and on rank{'s' * (len(self.ranks) > 2)} {', '.join(map(str, self.ranks[1:]))})"
        if self.changed:
            bad = self.changed[0]
            why = (
                f"run again from the same state on the same batch it gave {self.rerun_losses[bad]:.4g} on rank {bad}: "
                f"rank {bad}'s hardware is suspect (the same inputs gave another result)"
            )
        else:
            why = "run again from the same state on the same batch it gave the same losses: the data is at fault"
        return f"at step {self.step} {what}; {why}"


class LossWatch:
    """The robust z-score of each rank's loss against the pooled losses of the last ``window`` steps."""

    def __init__(self, window: int, threshold: float):
        self.threshold = threshold
        self.history: deque[float] = deque(maxlen=window * 8)  # pooled over ranks: up to 8 ranks' worth a step
        self.window = window

    def judge(self, step: int, losses: list[float]) -> Anomaly | None:
        bad = [r for r, v in enumerate(losses) if not math.isfinite(v)]
        if bad:
            return Anomaly(step, "not finite", bad, losses, None)
        recent = list(self.history)[-self.window * len(losses) :]
        if len(recent) < MIN_HISTORY * len(losses):
            return None
        median = statistics.median(recent)
        # 1.4826 × MAD estimates the standard deviation of normal noise; a floor keeps a flat curve from making
        # every wobble infinite
        spread = max(1.4826 * statistics.median(abs(v - median) for v in recent), 1e-3 * abs(median), 1e-8)
        zscores = {r: (v - median) / spread for r, v in enumerate(losses)}
        spiked = sorted((r for r, z in zscores.items() if z > self.threshold), key=lambda r: -zscores[r])
        if not spiked:
            return None
        return Anomaly(step, "spike", spiked, losses, median, zscores)

    def add(self, losses: list[float]) -> None:
        self.history.extend(losses)


class AnomalyGuard:
    """The trainer's side: ``inspect`` after a step's backward, ``skips`` before a step is read."""

    def __init__(self, trainer, policy: str, window: int, threshold: float):
        self.trainer = trainer
        self.policy = policy
        self.watch = LossWatch(window, threshold)
        self._data_faults: set[tuple[int, int]] = set()  # (epoch, sample position) of steps whose data was at fault

    def skips(self, epoch: int, position: int) -> bool:
        """The step that starts at this data position had bad data (found before a rollback): skip it."""
        return (epoch, position) in self._data_faults

    def check(self, step_loss: torch.Tensor, micro_batches: list, position: int, rng: Any) -> str:
        """``inspect`` for the step whose backward just ran from the RNG state ``rng``; a rollback is done here (the
        newest checkpoint loaded) before it is returned. A skipped step leaves every RNG stream where it found them
        (``rng``): the next step draws what this one drew, so skip and rollback (whose replay never runs the step) go
        on with the same dropout masks and end bit-identical."""
        t = self.trainer
        rt, optimizer = t.runtime, t.optimizers[0]

        def rerun() -> torch.Tensor:  # the same weights (nothing applied yet), batches and RNG state
            optimizer.zero_grad(set_to_none=True)
            set_rng_state(rng)
            return rt.strategy.run_step(t.model, micro_batches)[0]

        rt.mark_phase(None, "anomaly check")
        action = self.inspect(step_loss, micro_batches, position, rerun)
        if action == "skip":  # a skipped step consumes no randomness, as a rollback's replay, which never runs it
            set_rng_state(rng)
        if action == "rollback":
            optimizer.zero_grad(set_to_none=True)
            t.checkpoints.complete_pending()
            t.checkpoints.restore(t.checkpoints.resolve("last"))
        return action

    def skip_bad_data(self, micro_batches: list) -> None:
        """A step whose samples were found at fault before a rollback: not run this time. It still counts, as a
        skipped step does, and its samples are consumed."""
        t = self.trainer
        for _, batch in micro_batches:
            t.progress.samples_in_epoch += batch_size_of(batch) * t.data_parallel_size
        t.progress.skipped_steps += 1
        t.progress.global_step += 1
        step_schedulers(t, "step")
        if t.is_global_zero:
            print(
                f"distrain: step {t.global_step} skipped: its samples were at fault before the rollback "
                f"(on_anomaly, {self.path})",
                flush=True,
            )

    def inspect(
        self, step_loss: torch.Tensor, micro_batches: list, position: int, rerun: Callable[[], torch.Tensor]
    ) -> str:
        """``"apply"``, ``"skip"`` or ``"rollback"`` for the step whose backward just ran (``stop`` raises).
        ``position``: the step's first sample in the epoch's global order; ``rerun``: the step's forward and
        backward again, from the state it started in."""
        t = self.trainer
        rt = t.runtime
        losses = rt.all_gather(step_loss.detach().float().reshape(1)).flatten().tolist()
        anomaly = self.watch.judge(t.global_step + 1, losses)
        if anomaly is None:
            self.watch.add(losses)
            return "apply"
        anomaly.rerun_losses = rt.all_gather(rerun().detach().float().reshape(1)).flatten().tolist()
        anomaly.changed = [
            r for r, (a, b) in enumerate(zip(losses, anomaly.rerun_losses)) if not _same(a, b, SAME_RESULT)
        ]
        samples = self._samples(micro_batches, position)
        every_rank = rt.all_gather_object(samples if rt.global_rank in anomaly.ranks else None)
        action = self.policy
        last = t.checkpoints.last_path()
        if action == "rollback" and not t.runtime.decided_on_rank_zero(last.exists):
            action = "skip"  # nothing to roll back to yet
        self._record(anomaly, every_rank, action)
        message = f"distrain: {anomaly.describe()}"
        if action == "stop":
            kept = f"; {last} holds the newest checkpoint" if last.exists() else ""
            raise AnomalyError(
                f"{message}; training stopped before applying it (on_anomaly='stop'){kept}. Its samples are in "
                f"{self.path}; on_anomaly='skip' or 'rollback' trains on without them"
            )
        if action == "rollback" and anomaly.verdict == "data":
            self._data_faults.add((t.current_epoch, position))
        if t.is_global_zero:
            then = {
                "skip": "the step is skipped on every rank",
                "rollback": f"training rolls back to {last.resolve()}"
                + (" and skips this step's samples there" if anomaly.verdict == "data" else " and replays the step"),
            }[action]
            if self.policy == "rollback" and action == "skip":
                then += " (no checkpoint to roll back to yet)"
            print(f"{message}; {then} (on_anomaly='{self.policy}', recorded in {self.path})", flush=True)
        return action

    @property
    def path(self) -> Path:
        return Path(self.trainer.log_dir) / "anomalies.jsonl"

    def _samples(self, micro_batches: list, position: int) -> dict[str, Any]:
        """This rank's samples in the step: their indices in the dataset where distrain's sampler shards it (the
        rank's share of the global order from ``position`` on), else the loader's batch indices."""
        from distrain.data import batch_size_of, distributed_sampler

        sampler = distributed_sampler(self.trainer.train_dataloader)
        if sampler is None:
            return {"batches": [batch_idx for batch_idx, _ in micro_batches]}
        count = sum(batch_size_of(batch) for _, batch in micro_batches)
        order = sampler.global_order()
        picks = range(
            position + sampler.rank, position + sampler.rank + count * sampler.num_replicas, sampler.num_replicas
        )
        return {"samples": [order[i] for i in picks if i < len(order)]}

    def _record(self, anomaly: Anomaly, every_rank: list, action: str) -> None:
        t = self.trainer
        if not t.is_global_zero:
            return
        row = {
            "step": anomaly.step,
            "epoch": t.current_epoch,
            "kind": anomaly.kind,
            "verdict": anomaly.verdict,
            "ranks": anomaly.ranks,
            "suspect_ranks": anomaly.changed,
            "losses": [_number(v) for v in anomaly.losses],
            "rerun_losses": [_number(v) for v in anomaly.rerun_losses],
            "median": anomaly.median,
            "action": action,
            "per_rank": {str(r): every_rank[r] for r in anomaly.ranks},
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _same(a: float, b: float, tolerance: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.isnan(a) == math.isnan(b) and (math.isnan(a) or a == b)
    return abs(a - b) <= tolerance * max(abs(a), abs(b), 1e-12)


def _number(v: float) -> float | str:
    return v if math.isfinite(v) else str(v)  # JSON has no NaN or infinity
