"""The global batch, in one place: micro-batch × accumulation × data-parallel ranks (``BatchLayout``), the
optimizer steps it takes over a data set, and what keeps it on another number of ranks.

Elastic world size: a run resumed on another number of ranks (a restart with fewer nodes, torchrun's
``--nnodes MIN:MAX`` re-rendezvous) keeps the global batch its checkpoint was trained with, so the loss curve
goes on as if nothing changed. The micro-batch stays when the new ranks can share the batch at that size
(the accumulation absorbs the change); else the largest micro-batch that splits it. When the global batch
does not split over the new ranks at all, the run takes the nearest smaller one that does, and says so."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchLayout:
    micro_batch: int
    accumulate: int
    data_parallel: int

    @classmethod
    def from_checkpoint(cls, saved, source) -> BatchLayout:
        """The layout a checkpoint recorded (``batch_layout``), or a one-line error naming ``source``: it is read from
        a file someone else may have written, and its numbers become this run's accumulation."""
        fields = ("micro_batch", "accumulate", "data_parallel")
        if not isinstance(saved, dict) or set(saved) != set(fields) or not all(_count(saved[f]) for f in fields):
            raise ValueError(f"{source}: its batch_layout {saved!r} is not {', '.join(fields)} as positive integers")
        return cls(**saved)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulate * self.data_parallel

    def steps_over(self, samples: int, epochs: int) -> int:
        """The optimizer steps ``epochs`` passes over ``samples`` take (a short last step counts)."""
        return math.ceil(samples / self.global_batch) * epochs

    def describe(self) -> str:
        return (
            f"{self.data_parallel} rank{'s' * (self.data_parallel > 1)} × micro-batch {self.micro_batch} × "
            f"accumulation {self.accumulate} = {self.global_batch}"
        )


def _count(value) -> bool:
    return type(value) is int and value > 0


def keep_global_batch(saved: BatchLayout, micro_batch: int, data_parallel: int) -> tuple[BatchLayout, str]:
    """The layout on ``data_parallel`` ranks that keeps ``saved``'s global batch, preferring ``micro_batch``; and
    the line that tells the user what changed."""
    per_rank = saved.global_batch // data_parallel
    exact = per_rank * data_parallel == saved.global_batch and per_rank > 0
    per_rank = max(per_rank, 1)
    micro = max(m for m in range(1, min(micro_batch, per_rank) + 1) if per_rank % m == 0)
    layout = BatchLayout(micro, per_rank // micro, data_parallel)
    note = (
        f"distrain: the checkpoint was trained with {saved.describe()}; on {data_parallel} ranks: {layout.describe()}"
    )
    if not exact:
        note += (
            f" (the global batch {saved.global_batch} does not split over {data_parallel} ranks: "
            f"{layout.global_batch} is the nearest that does)"
        )
    return layout, note


def resumed_micro_batch(trainer, checkpoint, saved: dict | None, loader) -> int | None:
    """A Trainer's fit resumed from a checkpoint trained on another number of data-parallel ranks (``saved``: its
    batch layout): the micro-batch and accumulation that keep its global batch here (``keep_global_batch``); the
    micro-batch to load with, or None to keep the loader's."""
    from distrain.data import micro_batch_size  # torch: only when a fit resumes

    micro = micro_batch_size(loader)
    if not saved or not micro or not trainer.loop.use_distributed_sampler:
        return None
    dp = trainer.data_parallel_size
    saved = BatchLayout.from_checkpoint(saved, checkpoint)
    if saved.data_parallel == dp:
        return None
    layout, note = keep_global_batch(saved, micro, dp)
    if trainer.is_global_zero:
        print(note, flush=True)
    trainer.loop.accumulation = {0: layout.accumulate}
    return layout.micro_batch
