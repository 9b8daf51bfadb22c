"""Fault tolerance beyond restart: an elastic world size that keeps the global batch; asynchronous checkpoints;
per-step recovery of a replica group with torchft."""

from __future__ import annotations

import os
import signal

import pytest

import distrain
from helpers import TinyGPT, loader, make_trainer, run_ranks

GLOBAL_BATCH = 12  # splits over 4, 3 and 2 ranks


class StopAt(distrain.Callback):
    """SIGTERM to rank 0 after ``step``: every rank stops together and checkpoints (the preemption path)."""

    def __init__(self, step: int | None):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def _phase(rank, root, world, stop_at, max_steps, resume):
    trainer, rec = make_trainer(
        root,
        strategy="ddp",
        devices=world,
        max_steps=max_steps,
        gradient_clip_val=1.0,
        logger=False,
        callbacks=[StopAt(stop_at)],
    )
    distrain.seed_everything(0)  # as a script does before building its model
    module = TinyGPT(schedule=False)
    trainer.fit(module, loader(GLOBAL_BATCH // 4, n=240), ckpt_path="last" if resume else None)
    first = trainer.global_step - len(rec.losses) + 1
    return {first + i: loss for i, loss in enumerate(rec.losses)}, distrain.checkpoint_state_of(module)


@pytest.mark.slow
def test_resumed_on_4_3_2_4_ranks_the_global_batch_and_the_losses_stay(tmp_path):
    """The loader's micro-batch is 3 (global batch 12 on 4 ranks). Stopped by SIGTERM and resumed on 3 ranks
    (micro-batch 2 × accumulation 2), then 2 (3 × 2), then 4 again: the losses are those of a run that never
    stopped, within fp32 rounding (the reductions run over other numbers of ranks)."""
    reference, final = run_ranks(_phase, 4, tmp_path / "ref", 4, None, 8, False)[0]
    losses = {}
    for world, stop_at, resume in ((4, 2, False), (3, 4, True), (2, 6, True), (4, None, True)):
        done, weights = run_ranks(_phase, world, tmp_path / "run", world, stop_at, 8, resume)[0]
        losses.update(done)
    assert sorted(losses) == list(range(1, 9)), losses
    for step, loss in reference.items():
        assert abs(losses[step] - loss) <= 1e-5 * abs(loss), (step, losses[step], loss)
    for k, v in final.items():
        assert (weights[k] - v).norm() <= 1e-4 * v.norm(), k
