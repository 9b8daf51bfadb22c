"""A rank that holds the others back is named while the run goes on: in the metrics (``straggler_rank`` and its
split) and on the console, and no rank is named while they keep pace (``distrain/training/stragglers.py``)."""

import contextlib
import io
import json
import os
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import distrain
from distrain.training.stragglers import PERSISTS_STEPS, find_straggler
from helpers import IndexedTokens, TinyGPT, run_ranks

pytestmark = pytest.mark.alone  # a straggler is timed against its peers; a busy neighbour makes one

STEPS, WINDOW, BATCH = 28, 4, 4
SLEEP_S = 0.1
#: every rank's every step is this much longer: a tiny step (~10 ms) made a few ms of noise on one rank, a
#: scheduler's hiccup on 2 cores, 20% of it, and named a straggler in a window where the ranks kept pace
BALANCED_S = 0.02
#: the steps (1-based) in which a rank's loader is slow: rank 1 over two windows (a slow disk on one host), then
#: rank 0 and rank 1 for one window each (a busy machine's noise, moving from rank to rank)
SLOW_DATA = {1: {*range(5, 13), *range(25, 29)}, 0: set(range(21, 25))}


class SlowLoader(IndexedTokens):
    """Each rank's loader sleeps for every sample of its steps in ``SLOW_DATA``."""

    reads = 0

    def __getitem__(self, i):
        SlowLoader.reads += 1
        if (SlowLoader.reads - 1) // BATCH + 1 in SLOW_DATA[int(os.environ["RANK"])]:
            time.sleep(SLEEP_S / BATCH)
        return super().__getitem__(i)


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(SLEEP_S)
        return grad


class SlowComputeOnRankOne(TinyGPT):
    """Rank 1's forward is slow in steps 13-16, its backward in steps 17-20: a rank short of compute."""

    def training_step(self, batch, batch_idx):
        time.sleep(BALANCED_S)
        slow = self.global_rank == 1 and 3 * WINDOW <= self.global_step < 5 * WINDOW
        if slow and self.global_step < 4 * WINDOW:
            time.sleep(SLEEP_S)
        loss = super().training_step(batch, batch_idx)
        return SlowBackward.apply(loss) if slow and self.global_step >= 4 * WINDOW else loss


def _fit(rank, tmp):
    trainer = distrain.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_steps=STEPS,
        log_every_n_steps=WINDOW,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_plots=False,
        default_root_dir=tmp,
    )
    console = io.StringIO()  # what rank 0 prints (capfd does not see ranks forked from a server started earlier)
    with contextlib.redirect_stdout(console):
        trainer.fit(SlowComputeOnRankOne(), DataLoader(SlowLoader(), batch_size=BATCH, shuffle=False))
    return console.getvalue()


@pytest.mark.slow
def test_a_rank_slow_over_a_span_is_named_with_its_split_and_noise_names_none(tmp_path):
    """Rank 1 slow in its loader over two windows (steps 5-12) is named once the span reaches ``PERSISTS_STEPS``,
    with its split, again when its cause turns to compute (its forward in 13-16, its backward in 17-20), and said to
    have caught up; a window in which rank 0 is slow, then one in which rank 1 is, names nobody (noise that moves from
    rank to rank), and neither does a window in which the ranks keep pace."""
    assert PERSISTS_STEPS == 2 * WINDOW  # what the steps above are laid out for
    console = run_ranks(_fit, 2, str(tmp_path))[0]
    records = [json.loads(line) for line in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in records if "data_wait_s" in r}
    assert sorted(by_step) == [4, 8, 12, 16, 20, 24, 28]
    for record in by_step.values():  # every window has each rank's split, over the ranks
        for part in ("data_wait_s", "compute_s", "sync_s"):
            assert record[f"{part}_min"] <= record[f"{part}_mean"] <= record[part]
    unnamed = [step for step in (4, 8, 24, 28) if "straggler_rank" in by_step[step]]
    assert not unnamed, unnamed  # kept pace (4), slow for one window only (8: not yet; 24: rank 0; 28: rank 1)
    slow_data, slow_forward, slow_backward = by_step[12], by_step[16], by_step[20]
    assert slow_data["straggler_rank"] == slow_forward["straggler_rank"] == slow_backward["straggler_rank"] == 1
    # the split says why: its loader, then its compute (forward, then backward)
    assert slow_data["straggler_data_wait_s"] > 0.6 * SLEEP_S > slow_data["straggler_compute_s"]
    for slow in (slow_forward, slow_backward):
        assert slow["straggler_compute_s"] > 0.6 * SLEEP_S > slow["straggler_data_wait_s"]
        assert slow["straggler_excess"] > 0.2
    # the fast rank waited in the gradient all-reduce: its sync is the longest; so did rank 1 while rank 0 was slow
    for slow in (slow_data, slow_backward, by_step[24], by_step[28]):
        assert slow["sync_s"] - slow["sync_s_min"] > 0.5 * SLEEP_S
    # named when the span is long enough (over all of it), again when its cause changes, once while it stays
    named = [line for line in console.splitlines() if "is a straggler" in line]
    assert len(named) == 2, named
    assert "distrain: rank 1 is a straggler over steps 5-12: its data wait" in named[0]
    assert "slow in its data loading;" in named[0]
    assert "over steps 13-16" in named[1] and "slow in its compute;" in named[1]
    assert "distrain: no straggler over steps 21-24 (rank 1 caught up)" in console
    assert console.count("no straggler") == 1, console


def test_the_straggler_is_the_rank_whose_own_time_exceeds_the_others_by_the_threshold():
    # [data wait, compute, sync] seconds per step, per rank
    balanced = [[0.001, 0.010, 0.030], [0.002, 0.011, 0.028], [0.001, 0.010, 0.030]]
    assert find_straggler(balanced, 0.2) is None
    slow = [[0.001, 0.010, 0.030], [0.001, 0.030, 0.010], [0.001, 0.010, 0.030], [0.001, 0.011, 0.029]]
    found = find_straggler(slow, 0.2)
    assert (found.rank, found.others_compute_s) == (1, 0.010)
    assert abs(found.excess_s - 0.020) < 1e-9
    assert find_straggler(slow, 0.6) is None  # 0.020 s is under 60% of the 0.041 s step
    assert find_straggler(slow, 0) is None  # 0: the check is off
    assert find_straggler([[0.5, 0.5, 0.0]], 0.2) is None  # one rank: nobody to compare with
