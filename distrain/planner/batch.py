"""Elastic world size: a run resumed on another number of ranks (a restart with fewer nodes, torchrun's
``--nnodes MIN:MAX`` re-rendezvous) keeps the global batch its checkpoint was trained with, so the loss curve
goes on as if nothing changed. The micro-batch stays when the new ranks can share the batch at that size
(the accumulation absorbs the change); else the largest micro-batch that splits it. When the global batch
does not split over the new ranks at all, the run takes the nearest smaller one that does, and says so."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchLayout:
    micro_batch: int
    accumulate: int
    data_parallel: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulate * self.data_parallel

    def describe(self) -> str:
        return (
            f"{self.data_parallel} rank{'s' * (self.data_parallel > 1)} × micro-batch {self.micro_batch} × "
            f"accumulation {self.accumulate} = {self.global_batch}"
        )


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
