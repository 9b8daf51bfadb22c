"""Loss spikes and non-finite losses (``on_anomaly``): a poisoned sample is found to be the data's fault, recorded
with its index and skipped or rolled back from; a transient fault on one rank is found to be that rank's, and a
rollback then ends bit-identical to a run without the fault (``distrain/training/anomalies.py``)."""

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import distrain
from distrain.training.anomalies import LossWatch
from helpers import params_of, run_ranks

POISONED = 45  # global position 45: step 12 (positions 44-47, 2 ranks × 2 samples), rank 1's first sample
STEPS = 16


class Regression(Dataset):
    def __init__(self, poisoned: int | None):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 8, generator=g)
        self.y = self.x @ torch.randn(8, generator=g) + 0.01 * torch.randn(64, generator=g)
        if poisoned is not None:
            self.y[poisoned] = 1000.0  # a corrupt label

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Fit(distrain.Module):
    """A small regression; ``fault_at``: at that step, once, rank 1's loss comes out 2**20 times too large, as a
    flipped exponent bit would make it (the next computation is right again)."""

    def __init__(self, fault_at: int | None = None):
        super().__init__()
        # dropout: skip and rollback must leave the RNG streams alike (a skip kept the re-run's state, so every
        # later mask differed from the rollback's)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.25), nn.Linear(16, 1))
        self.fault_at = fault_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        if self.fault_at == self.global_step + 1 and self.global_rank == 1:
            self.fault_at = None
            loss = loss * 2**20
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(root: Path, policy: str | None, poisoned: int | None = None, fault_at: int | None = None, strategy="ddp"):
    trainer = distrain.Trainer(
        accelerator="cpu",
        strategy=strategy,
        devices=2,
        max_steps=STEPS,
        log_every_n_steps=4,
        on_anomaly=policy,
        callbacks=[distrain.ModelCheckpoint(dirpath=str(root / "checkpoints"), every_n_train_steps=5)],
        enable_progress_bar=False,
        enable_plots=False,
        logger=False,
        default_root_dir=str(root),
        seed=3,
    )
    torch.manual_seed(0)  # the same initial weights in every run of the process
    module = Fit(fault_at)
    trainer.fit(module, DataLoader(Regression(poisoned), batch_size=2, shuffle=False))
    whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in params_of(module).items()}
    return whole, trainer.progress.skipped_steps


def _runs(rank, tmp):
    console = io.StringIO()  # what rank 0 prints (capfd does not see ranks forked from a server started earlier)
    with contextlib.redirect_stdout(console):
        out = _all_runs(Path(tmp))
    return {**out, "console": console.getvalue()}


def _all_runs(tmp: Path) -> dict:
    out = {
        "clean": _fit(tmp / "clean", None),
        "data_skip": _fit(tmp / "data_skip", "skip", poisoned=POISONED),
        "data_rollback": _fit(tmp / "data_rollback", "rollback", poisoned=POISONED),
        "fsdp_rollback": _fit(tmp / "fsdp_rollback", "rollback", poisoned=POISONED, strategy="fsdp"),
        "fault_rollback": _fit(tmp / "fault_rollback", "rollback", fault_at=12),
    }
    try:
        _fit(tmp / "data_stop", "stop", poisoned=POISONED)
    except distrain.trainer.AnomalyError as e:
        out["stop"] = str(e)
    return out


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "anomalies.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_bad_data_and_a_transient_fault_are_told_apart_recorded_and_handled(tmp_path):
    results = run_ranks(_runs, 2, str(tmp_path))
    out = results[0]
    assert results[1]["data_skip"][1] == out["data_skip"][1] == 1  # every rank skipped the same one step

    # the poisoned sample: same loss again when re-run, so the data is at fault; its index is recorded
    (row,) = _rows(tmp_path / "data_skip")
    assert (row["step"], row["kind"], row["verdict"], row["ranks"], row["action"]) == (12, "spike", "data", [1], "skip")
    assert row["per_rank"] == {"1": {"samples": [POISONED, POISONED + 2]}}
    assert row["rerun_losses"] == row["losses"] and row["suspect_ranks"] == []
    # a rollback replays steps 11 and 12 from step 10's checkpoint without the poisoned step: deterministic, it
    # ends exactly where skipping it did
    (row,) = _rows(tmp_path / "data_rollback")
    assert (row["verdict"], row["action"]) == ("data", "rollback")
    skipped, rolled_back = out["data_skip"][0], out["data_rollback"][0]
    assert all(torch.equal(skipped[k], rolled_back[k]) for k in skipped)
    assert not all(torch.equal(skipped[k], out["clean"][0][k]) for k in skipped)  # the step did not count
    fsdp = out["fsdp_rollback"]  # FSDP re-runs and rolls back alike
    assert fsdp[1] == 1 and all(torch.allclose(fsdp[0][k], rolled_back[k], atol=1e-6) for k in rolled_back)

    # a transient fault on rank 1: the re-run disagrees there, so rank 1 is named; the rollback replays the step
    (row,) = _rows(tmp_path / "fault_rollback")
    assert (row["verdict"], row["suspect_ranks"], row["ranks"]) == ("hardware", [1], [1])
    assert math.isclose(row["losses"][1] / row["rerun_losses"][1], 2**20, rel_tol=1e-4)
    assert out["fault_rollback"][1] == 0  # nothing skipped: it ends bit-identical to the run without the fault
    assert all(torch.equal(out["clean"][0][k], out["fault_rollback"][0][k]) for k in out["clean"][0])

    # stop: before applying the step, naming it, the rank, the verdict and where the samples are
    assert out["stop"].startswith("distrain: at step 12 the loss spiked on rank 1")
    assert "the data is at fault" in out["stop"] and "on_anomaly='stop'" in out["stop"]
    assert str(tmp_path / "data_stop" / "anomalies.jsonl") in out["stop"]

    console = out["console"]
    assert "rank 1's hardware is suspect" in console and "training rolls back to" in console
    assert "distrain: step 12 skipped: its samples were at fault before the rollback" in console


def test_a_spike_is_judged_against_the_recent_losses_of_every_rank():
    watch = LossWatch(window=10, threshold=6.0)
    assert watch.judge(1, [1.0, float("nan")]).ranks == [1]  # a non-finite loss at once, history or not
    for step in range(7):
        watch.add([1.0 - 0.01 * step, 1.01 - 0.01 * step])
    assert watch.judge(8, [50.0, 1.0]) is None  # too little history to judge a spike yet
    watch.add([0.93, 0.94])
    spike = watch.judge(9, [0.92, 50.0])
    assert (spike.kind, spike.ranks, spike.step) == ("spike", [1], 9) and spike.zscores[1] > 6
    assert watch.judge(9, [0.92, 0.99]) is None  # within the noise of the window
    flat = LossWatch(window=10, threshold=6.0)
    for _ in range(8):
        flat.add([2.0, 2.0])
    assert flat.judge(9, [2.001, 2.0]) is None  # a flat curve does not make every wobble a spike


def test_on_anomaly_is_refused_where_a_step_cannot_be_rerun_and_checked_in_the_config():
    from distrain.config import ConfigError, build_config

    with pytest.raises(ValueError, match="on_anomaly must be one of stop, skip, rollback"):
        distrain.Trainer(accelerator="cpu", on_anomaly="retry", logger=False)
    with pytest.raises(ValueError, match="on_anomaly is not supported with DeepSpeedStrategy"):
        distrain.Trainer(accelerator="cpu", strategy="deepspeed_stage_2", on_anomaly="skip", logger=False)
    with pytest.raises(ConfigError, match="training.on_anomaly must be stop, skip, rollback or null"):
        build_config(cli_items=["training.on_anomaly=retry"])
    assert build_config(cli_items=["training.on_anomaly=rollback"]).training.on_anomaly == "rollback"
