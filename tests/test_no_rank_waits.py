"""A decision that can fail fails on every rank together, within seconds, naming the rank and the cause:
checkpoint names, strategy "auto" under an outside launcher, ranks that run different strategies, non-finite
checks under local SGD, fp16 overflow checks over sharded gradients. (DeepSpeed's universal conversion on
rank 0: tests/test_safe_load.py.)"""

from __future__ import annotations

import os
import time

import pytest
import torch

import distrain
from helpers import TinyGPT, loader, make_trainer, run_ranks

pytestmark = pytest.mark.alone  # every rank must fail within seconds (tests/conftest.py)


def _timed(fn):
    start = time.monotonic()
    try:
        return None, fn(), time.monotonic() - start
    except Exception as error:  # noqa: BLE001 — what each rank saw is the result
        return f"{type(error).__name__}: {error}", None, time.monotonic() - start


# ---- ModelCheckpoint names, made on rank 0 ---------------------------------------------------------------------
def _named(rank, root, filename):
    checkpoints = distrain.ModelCheckpoint(filename=filename, every_n_train_steps=2, save_top_k=-1)
    trainer, _ = make_trainer(root, strategy="ddp", devices=2, max_steps=2, logger=False, callbacks=[checkpoints])
    import warnings

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        error, _, seconds = _timed(lambda: trainer.fit(TinyGPT(), loader(4)))
    names = sorted(p.name for p in (root / "checkpoints").glob("*") if p.name != "last")
    return error, seconds, names, [str(w.message) for w in warned if "not logged yet" in str(w.message)]


def test_a_metric_not_logged_yet_names_the_checkpoint_as_zero(tmp_path):
    """``{val_loss}`` before the first validation: 0, as in Lightning (it raised KeyError on rank 0
    while the others waited in the broadcast)."""
    results = run_ranks(_named, 2, tmp_path, "{step}-{val_loss:.3f}")
    for error, _, names, _ in results:
        assert error is None and names == ["2-0.000"], (error, names)
    assert len(results[0][3]) == 1 and "val_loss not logged yet at step 2" in results[0][3][0]  # said once


def test_a_name_that_cannot_be_made_fails_every_rank_at_once(tmp_path):
    results = run_ranks(_named, 2, tmp_path, "{step:q}")
    for rank, (error, seconds, _, _) in enumerate(results):
        assert error is not None and "cannot be formatted" in error and "{step:q}" in error, (rank, error)
        assert seconds < 10, (rank, seconds)
    assert "raised on rank 0" in results[1][0]


# ---- strategy "auto" under torchrun / srun / mpirun: rank 0 plans, every rank takes its decision -----------
def _auto(rank, root, fail_on):
    from distrain.config import build_config
    from distrain.planner import decide

    plans = []
    original = decide._planned

    def counted(config, job):
        plans.append(rank)
        if rank == fail_on:
            raise RuntimeError(f"planner broke on rank {rank}")
        return original(config, job)

    decide._planned = counted
    os.environ.pop(decide.PLANNED_ENV, None)
    os.environ["DISTRAIN_PLAN_CACHE"] = str(root / "plans")  # this case's own: no plan kept by another
    config = build_config(None, {"distributed.strategy": "auto", "distributed.devices": 2, "output_dir": str(root)}, [])
    start = time.monotonic()
    decision = decide.for_config(config)
    return plans, decision.strategy, decision.messages, time.monotonic() - start


@pytest.mark.parametrize("fail_on", [None, 0, 1])
def test_auto_under_an_outside_launcher_is_planned_once_and_shared(tmp_path, fail_on):
    """run_ranks gives each rank the variables torchrun sets. Rank 0 alone plans; a planner that breaks
    on rank 0 sends every rank to the same fallback; one that would break on rank 1 is never called."""
    results = run_ranks(_auto, 2, tmp_path, fail_on)
    assert [r[0] for r in results] == [[0], []]  # only rank 0 planned
    assert results[0][1] == results[1][1]
    if fail_on == 0:
        assert results[0][1] == "ddp" and "could not plan this run" in results[1][2][0]
    else:
        assert results[0][1] != "auto"


def _different_strategies(rank):
    runtime = distrain.Runtime(strategy="ddp" if rank == 0 else "fsdp", devices=2, accelerator="cpu")
    return _timed(runtime.setup_environment)


def test_ranks_running_different_strategies_are_stopped_at_setup():
    for rank, (error, _, seconds) in enumerate(run_ranks(_different_strategies, 2)):
        assert error is not None and "rank 0: DDPStrategy, rank 1: FSDPStrategy" in error, (rank, error)
        assert seconds < 10


# ---- non-finite checks when gradients are not the same on every rank ---------------------------------------------
class NaNOnRankOne(TinyGPT):
    """Rank 1's loss is NaN at step ``at``; rank 0's never is."""

    def __init__(self, at: int):
        super().__init__(schedule=False)
        self.at = at

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_rank == 1 and self.trainer.global_step + 1 == self.at:
            return loss * float("nan")
        return loss


def _local_sgd(rank, root, at):
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # each rank a "node" of its own: after step 8, purely local SGD
    trainer, _ = make_trainer(
        root,
        strategy="ddp",
        devices=2,
        max_steps=at + 2,
        logger=False,
        enable_checkpointing=False,
        ddp_comm_hook="post_localsgd",
        collective_timeout=60,
    )
    error, _, seconds = _timed(lambda: trainer.fit(NaNOnRankOne(at), loader(2)))
    return error, seconds, trainer.global_step


def test_a_nan_under_local_sgd_stops_every_rank_at_its_step(tmp_path):
    """post_localsgd averages gradients within subgroups once local SGD starts (step 8): the ranks' norms
    differ, and a NaN on one rank alone stopped that rank while the other went on and waited."""
    results = run_ranks(_local_sgd, 2, tmp_path, 10)
    for rank, (error, seconds, step) in enumerate(results):
        assert error is not None and "NonFiniteError" in error and "at step 10" in error, (rank, error)
        assert step == 9 and seconds < 60, (rank, step, seconds)


def _overflow_on_rank_one(rank, root, clip):
    """FSDP: each rank holds a shard of the gradients; an overflow in rank 1's shard only. A CPU GradScaler
    stands in for fp16's (16-mixed needs CUDA): the agreement under test is the same."""

    class Overflow(distrain.Callback):
        def __init__(self):
            self.scales, self.changed = [], []

        def on_before_optimizer_step(self, trainer, module, optimizer):
            self.before = [p.detach().to_local().clone() for p in module.parameters()]

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            after = [p.detach().to_local() for p in module.parameters()]
            self.changed.append(any(not torch.equal(a, b) for a, b in zip(self.before, after)))
            self.scales.append(trainer.runtime.precision.scaler.get_scale())

    class OverflowsOnRankOne(TinyGPT):
        """Step 2 on rank 1: a loss that is finite, but not once scaled (fp16's overflow, in fp32's range)."""

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * 1e37 if self.trainer.global_rank == 1 and self.trainer.global_step == 1 else loss

    probe = Overflow()
    trainer, _ = make_trainer(
        root,
        strategy="fsdp",
        devices=2,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        callbacks=[probe],
        gradient_clip_val=clip,
    )
    trainer.runtime.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer.fit(OverflowsOnRankOne(schedule=False), loader(4))
    return probe.changed, probe.scales, type(trainer.runtime.precision.scaler).__name__


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clipping", "clipping"])
def test_an_overflow_in_one_ranks_shard_skips_the_step_on_every_rank(tmp_path, clip):
    """With clipping the overflow's norm is infinite: the scaler's skip, not a non-finite step to stop at (the
    run stopped with on_nonfinite='stop'; with 'skip', scaler.update() never ran and the next step failed)."""
    results = run_ranks(_overflow_on_rank_one, 2, tmp_path, clip)
    for rank, (changed, scales, scaler) in enumerate(results):
        assert scaler == "ShardedGradScaler", (rank, scaler)
        assert changed == [True, False, True], (rank, changed)  # step 2 skipped on both ranks
        assert scales == [256.0, 128.0, 128.0], (rank, scales)


# ---- the one way a failure reaches the others: shared_outcome -----------------------------------------------------
def _outcomes(rank):
    from datetime import timedelta

    from distrain.distributed import SharedFailure, init_process_group, shared_outcome

    init_process_group("gloo", timedelta(seconds=30), timedelta(seconds=30))

    class Local(Exception):  # defined here: no other process can unpickle it
        pass

    seen = {"results": shared_outcome(lambda: rank * 10)}

    def fail_on(ranks, error):
        def action():
            if rank in ranks:
                raise error
            return rank

        return action

    for name, ranks, error in (("one", {1}, ValueError("bad value")), ("two", {0, 2}, Local("mine"))):
        start = time.monotonic()
        try:
            shared_outcome(fail_on(ranks, error))
            seen[name] = "returned"
        except SharedFailure as failure:
            local = type(failure.local).__name__ if failure.local else None
            seen[name] = ([(r, cls.__name__, text) for r, cls, text in failure.failures], local, str(failure))
        seen[name + " seconds"] = time.monotonic() - start
    return seen


def test_a_failure_on_some_ranks_is_raised_on_every_rank_naming_each():
    """Every rank gets every rank's result, or every rank raises naming the ranks that failed and why (a class the
    others cannot unpickle arrives as RuntimeError, its description kept); this rank's own error rides along."""
    seen = run_ranks(_outcomes, 3)
    for rank, s in enumerate(seen):
        assert s["results"] == [0, 10, 20]
        failures, local, text = s["one"]
        assert failures == [(1, "ValueError", "bad value")] and text == "rank 1 failed: ValueError: bad value"
        assert local == ("ValueError" if rank == 1 else None)
        failures, local, _ = s["two"]
        assert failures == [(0, "RuntimeError", "mine"), (2, "RuntimeError", "mine")], failures
        assert local == ("Local" if rank in (0, 2) else None)
        assert s["one seconds"] < 10 and s["two seconds"] < 10
