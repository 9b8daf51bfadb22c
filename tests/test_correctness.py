"""Ranks never silently disagree: evaluation in lockstep, decisions made once, metrics reduced by
agreed names, non-finite steps stopped or skipped on every rank alike, partial windows that step."""

import math
import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from step_overhead import HostReads
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import distrain
from helpers import START_METHOD, IndexedTokens, TinyGPT, loader, make_trainer, run_ranks


# ---- evaluation and prediction in lockstep ------------------------------------------------------------
class CountingGPT(TinyGPT):
    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.log("val_samples", len(batch[0]), reduce_fx="sum")

    def predict_step(self, batch, batch_idx):
        return batch[2]  # the sample ids this rank predicted


def _evaluate_few(rank, tmp, n):
    trainer, _ = make_trainer(tmp, strategy="fsdp", devices=3, logger=False, collective_timeout=20)
    module = CountingGPT()
    data = DataLoader(IndexedTokens(n), batch_size=2)
    metrics = trainer.validate(module, data)[0]
    ids = [i for batch_ids in trainer.predict(module, data) for i in batch_ids.tolist()]
    return metrics, ids


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 7])
def test_fsdp_validation_and_predict_with_fewer_or_uneven_samples(tmp_path, n):
    """3 ranks, 2 samples (one rank has none) or 7 (2+2 / 2+1 / 2+1 in batches): every forward runs
    on every rank, and each sample counts exactly once."""
    results = run_ranks(_evaluate_few, 3, tmp_path, n)
    assert all(r[0]["val_samples"] == n for r in results)
    assert sorted(i for r in results for i in r[1]) == list(range(n))


# ---- decisions every rank must share ---------------------------------------------------------------------
def _checkpoint_named_by_throughput(rank, tmp):
    ckpt = distrain.ModelCheckpoint(
        filename="step={step}-tok={tokens_per_sec:.0f}", every_n_train_steps=2, save_top_k=-1
    )
    trainer, _ = make_trainer(tmp, strategy="fsdp", devices=2, max_steps=4, logger=False, callbacks=[ckpt])
    trainer.fit(TinyGPT(), loader(4))
    return ckpt.last_model_path


def test_checkpoint_named_by_a_per_rank_metric_lands_in_one_directory(tmp_path):
    paths = run_ranks(_checkpoint_named_by_throughput, 2, tmp_path)
    assert paths[0] == paths[1]
    saved = sorted(p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step="))
    assert [p.name.split("-")[0] for p in saved] == ["step=2", "step=4"]
    for directory in saved:  # both ranks' shards in each
        assert {f.name for f in directory.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}


class RankZeroLogs(TinyGPT):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_rank == 0:  # a name only one rank logs, reduced across ranks
            self.log("only_rank0", 10.0, sync_dist=True)
        self.log("rank", float(self.trainer.global_rank), sync_dist=True)
        return loss


def _log_on_one_rank(rank, tmp):
    trainer, _ = make_trainer(tmp, strategy="ddp", devices=2, max_steps=2, logger=False, collective_timeout=20)
    trainer.fit(RankZeroLogs(), loader(4))
    return trainer.callback_metrics["only_rank0"], trainer.callback_metrics["rank"]


def test_step_metric_logged_on_one_rank_is_reduced_without_a_hang(tmp_path):
    for only_rank0, rank in run_ranks(_log_on_one_rank, 2, tmp_path):
        assert only_rank0 == 10.0  # the mean over the ranks that logged it
        assert rank == 0.5


class StopOnRankOne(distrain.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == 2:
            trainer.should_stop = True


def _stop_on_one_rank(rank, tmp):
    trainer, _ = make_trainer(
        tmp, strategy="ddp", devices=2, max_steps=10, logger=False, collective_timeout=20, callbacks=[StopOnRankOne()]
    )
    trainer.fit(TinyGPT(), loader(4))
    return trainer.global_step


def test_should_stop_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    steps = run_ranks(_stop_on_one_rank, 2, tmp_path)
    assert steps[0] == steps[1] == 3  # agreed asynchronously: the step after the request


class ConversionCounter(torch.Tensor):
    """Counts conversions to Python numbers (a host sync on an accelerator)."""

    conversions = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.tolist):
            ConversionCounter.conversions += 1
        return super().__torch_function__(func, types, args, kwargs or {})


class LogsEveryMicroStep(TinyGPT):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("probe", loss.detach().as_subclass(ConversionCounter), sync_dist=True)
        return loss


def test_logged_values_stay_on_the_device_until_a_logging_step(tmp_path):
    trainer = distrain.Trainer(
        accelerator="cpu",
        strategy="single",
        devices=1,
        max_steps=3,
        log_every_n_steps=3,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(LogsEveryMicroStep(), loader(4))
    # six micro-steps, three optimizer steps, one logging step: the logged values are never turned into
    # numbers one by one (the logging step converts all of them together, from one stacked tensor)
    assert ConversionCounter.conversions == 0


class CountedSteps(distrain.Callback):
    """Counts ``reads`` (``benchmarks/step_overhead.HostReads``: the host reads of tensor values, each a host-device
    sync on an accelerator) from the start of step ``first`` to the end of step ``last``."""

    def __init__(self, reads, first: int, last: int):
        self.reads, self.first, self.last = reads, first, last

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.reads.counting = self.first <= trainer.global_step + 1 <= self.last

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.reads.counting = False


class Regression(distrain.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused
        self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        # SGD: its for-each step reads nothing on the host itself (Adam's reads each parameter's step count)
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9, fused=self.fused, foreach=not self.fused)


@pytest.mark.parametrize("fused,reads_per_step", [(True, 0), (False, 1)])
def test_steps_that_do_not_log_never_read_a_tensor_on_the_host(tmp_path, fused, reads_per_step):
    """With the default safety on (the non-finite check, metrics, the hang watch), a step that does not log reads
    nothing back from the device when the optimizer can skip a bad step there (torch's fused SGD and Adam); the
    for-each one is checked on the host, one read (the gradient norm) per step."""
    reads = HostReads()
    trainer = distrain.Trainer(
        accelerator="cpu",
        strategy="single",
        devices=1,
        max_steps=10,
        log_every_n_steps=10,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        callbacks=[CountedSteps(reads, first=2, last=9)],
    )
    data = torch.utils.data.TensorDataset(torch.randn(40, 8), torch.randn(40, 1))
    with reads:
        trainer.fit(Regression(fused), DataLoader(data, batch_size=4))
    assert trainer.global_step == 10
    assert reads.count == 8 * reads_per_step


# ---- non-finite values -----------------------------------------------------------------------------------
class NaNAt(TinyGPT):
    """The loss becomes NaN at optimizer step ``step`` on rank ``rank`` (one micro-batch). ``fused``: torch's fused
    AdamW, which skips a step on the device when handed ``found_inf`` (the loop's device check); else its for-each
    one, which the loop checks on the host."""

    def __init__(self, step, rank=0, fused=False):
        super().__init__()
        self.nan_step, self.nan_rank, self.fused = step, rank, fused

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step + 1 == self.nan_step and self.trainer.global_rank == self.nan_rank:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1, fused=self.fused or None)


# the host check on one process (ddp's under local SGD: test_no_rank_waits); the device check on every layout
NAN_LAYOUTS = [("single", 1, False), ("single", 1, True), ("ddp", 2, True), ("fsdp", 2, True)]


def _nan_run(rank, tmp, strategy, policy, devices, fused):
    ckpt = distrain.ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)
    trainer, rec = make_trainer(
        tmp, strategy=strategy, devices=devices, max_steps=5, logger=False, on_nonfinite=policy, callbacks=[ckpt]
    )
    module = NaNAt(step=3, rank=devices - 1, fused=fused)
    try:
        trainer.fit(module, loader(4))
    except distrain.NonFiniteError as e:
        return "error", str(e), trainer.global_step
    weights = distrain.checkpoint_state_of(module)
    finite = all(torch.isfinite(v).all() for v in weights.values())
    return "done", finite, trainer.global_step, rec.losses, trainer.progress.skipped_steps


@pytest.mark.parametrize("strategy,devices,fused", NAN_LAYOUTS)
def test_nan_loss_stops_at_that_step_naming_the_rank(tmp_path, strategy, devices, fused):
    results = (
        run_ranks(_nan_run, devices, tmp_path, strategy, "stop", devices, fused)
        if devices > 1
        else [_nan_run(0, tmp_path, strategy, "stop", 1, fused)]
    )
    for kind, message, step in results:
        assert kind == "error"
        assert step == 2  # the bad step was not applied
        assert f"at step 3 the loss was nan on rank {devices - 1}" in message, message
        assert "still holds the newest checkpoint" in message
    last = (tmp_path / "checkpoints" / "last").resolve()
    assert last.name.endswith("step=2")
    from distrain.checkpoint.state import read_model_weights

    assert all(torch.isfinite(v).all() for v in read_model_weights(last).values())


class PoisonWeight(distrain.Callback):
    """Writes ``value`` into one weight on ``rank`` after step ``step``, before that step's checkpoint."""

    def __init__(self, step: int, rank: int, value: float):
        self.step, self.rank, self.value = step, rank, value

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            with torch.no_grad():
                list(module.parameters())[-1].view(-1)[3] = self.value


def _poisoned_run(rank, tmp, poison_rank, value):
    poison = PoisonWeight(4, poison_rank, value)
    ckpt = distrain.ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
    trainer, _ = make_trainer(
        tmp, strategy="ddp", devices=2, max_steps=4, logger=False, on_nonfinite="ignore", callbacks=[poison, ckpt]
    )
    trainer.fit(TinyGPT(), loader(4))
    return trainer.checkpoints.last_path().resolve().name


@pytest.mark.parametrize("poison_rank,value", [(1, float("nan")), (0, float("inf")), (1, float("-inf"))])
def test_a_checkpoint_with_non_finite_weights_never_becomes_last(tmp_path, poison_rank, value):
    """One weight of one rank NaN or ±inf at step 4 (on_nonfinite='ignore' lets it through): the step-4 checkpoints
    (the step's and the end's) are written but ``last`` stays at step 2, on every rank alike."""
    names = run_ranks(_poisoned_run, 2, tmp_path, poison_rank, value)
    assert names == ["epoch=0-step=2", "epoch=0-step=2"], names


@pytest.mark.parametrize("strategy,devices,fused", NAN_LAYOUTS)
def test_nan_step_is_skipped_on_every_rank(tmp_path, strategy, devices, fused):
    results = (
        run_ranks(_nan_run, devices, tmp_path, strategy, "skip", devices, fused)
        if devices > 1
        else [_nan_run(0, tmp_path, strategy, "skip", 1, fused)]
    )
    for kind, finite, step, losses, skipped in results:
        assert kind == "done" and finite and step == 5 and skipped == 1
        assert math.isnan(losses[2]) and all(math.isfinite(v) for i, v in enumerate(losses) if i != 2)


class Forwarding:
    """A wrapper that forwards attributes to its optimizer (as some engines' wrappers do)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __getattr__(self, name):
        return getattr(self.optimizer, name)


def test_the_device_check_takes_only_an_optimizer_that_reads_found_inf_itself():
    """``found_inf`` set on a wrapper never reaches the optimizer inside: such a step would be applied while the
    loop thought it skipped, so a wrapper is checked on the host."""
    from types import SimpleNamespace

    from distrain.training.nonfinite import DeviceCheck

    params = [nn.Parameter(torch.ones(2))]
    fused = torch.optim.AdamW(params, fused=True)
    check = DeviceCheck(SimpleNamespace(loop=SimpleNamespace(on_nonfinite="skip")))
    norm = torch.tensor(float("nan"))
    assert check.applies(fused, norm)
    assert not check.applies(Forwarding(fused), norm)
    assert not check.applies(torch.optim.AdamW(params, foreach=True), norm)  # no found_inf: the host checks


# ---- the last window of an epoch ----------------------------------------------------------------------------
class LinearJob(distrain.Module):
    """y = w·x with SGD(lr=1): the final weight is w0 minus the sum of the step gradients."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(1, 1, bias=False)
        nn.init.constant_(self.w.weight, 0.0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.w(x) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


class Stream(IterableDataset):
    def __init__(self, values):
        self.values = values

    def __iter__(self):
        for v in self.values:
            yield torch.tensor([v]), torch.tensor([0.0])


class GradientsClearAtEpochEnd(distrain.Callback):
    def on_train_epoch_end(self, trainer, module):
        assert all(p.grad is None for p in module.parameters()), "gradients leaked past the epoch's end"


def test_a_short_last_window_steps_with_the_mean_of_its_micro_batches(tmp_path):
    # one sample per batch, accumulate 2: windows [1, 2], [3, 4], [5] — the last one alone
    values = [0.1, 0.2, 0.3, 0.4, 0.5]
    trainer, _ = make_trainer(
        tmp_path,
        strategy="single",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        callbacks=[GradientsClearAtEpochEnd()],
    )
    module = LinearJob()
    nn.init.constant_(module.w.weight, 0.01)
    trainer.fit(module, DataLoader(Stream(values), batch_size=1))
    w = 0.01
    for window in ([0.1, 0.2], [0.3, 0.4], [0.5]):  # d/dw (w·x)² = 2x²w, the mean over the window
        w -= sum(2 * x * x * w for x in window) / len(window)
    assert trainer.global_step == 3
    assert module.w.weight.item() == pytest.approx(w, rel=1e-6)


def _uneven_streams(rank, tmp):
    values = [[0.1, 0.2, 0.3, 0.4, 0.5], [0.1, 0.2, 0.3]][rank]  # 5 batches on rank 0, 3 on rank 1
    trainer, _ = make_trainer(
        tmp,
        strategy="ddp",
        devices=2,
        max_epochs=2,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        collective_timeout=20,
        callbacks=[GradientsClearAtEpochEnd()],
    )
    module = LinearJob()
    nn.init.constant_(module.w.weight, 0.01)
    trainer.fit(module, DataLoader(Stream(values), batch_size=1))
    return trainer.global_step, module.w.weight.item()


def test_ranks_with_uneven_iterable_data_agree_on_every_window(tmp_path):
    (steps0, w0), (steps1, w1) = run_ranks(_uneven_streams, 2, tmp_path)
    # windows of the shorter rank: [2, 1] per epoch; rank 0's extra batches are dropped
    assert steps0 == steps1 == 4 and w0 == w1


# ---- hangs outside fit ---------------------------------------------------------------------------------------
class SlowValidation(TinyGPT):
    """Rank 1 stays in its first validation step until rank 0 has diagnosed the hang (at most 30 s), then ends."""

    def __init__(self, diagnosed: Path):
        super().__init__()
        self.diagnosed = diagnosed

    def validation_step(self, batch, batch_idx):
        if self.trainer.global_rank == 1 and batch_idx == 0:
            deadline = time.monotonic() + 30
            while not self.diagnosed.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os._exit(0)
        super().validation_step(batch, batch_idx)


def _validate_with_a_slow_rank(rank, tmp, port):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        OMP_NUM_THREADS="1",
    )
    trainer, _ = make_trainer(tmp, strategy="ddp", devices=2, logger=False, collective_timeout=3)
    try:
        trainer.validate(SlowValidation(Path(tmp, "error-0")), loader(4))
    except distrain.CollectiveHangError as e:
        Path(tmp, f"error-{rank}").write_text(str(e))
    os._exit(0)  # the group is broken: no orderly shutdown to wait for


@pytest.mark.slow
@pytest.mark.alone  # a collective timeout of 3 s
def test_a_hang_in_validate_is_diagnosed(tmp_path):
    from distrain.cluster import find_free_port

    mp.start_processes(
        _validate_with_a_slow_rank, args=(tmp_path, find_free_port()), nprocs=2, start_method=START_METHOD
    )
    message = (tmp_path / "error-0").read_text()
    assert "a collective did not complete on every rank" in message and "rank 1" in message, message


# ---- DataLoader workers: random augmentation differs across ranks, and resumes --------------------------------
class Augmented(TensorDataset):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x + torch.randint(0, 1000, (1,)).float(), y  # worker-side randomness


class RecordsInputs(LinearJob):
    def __init__(self):
        super().__init__()
        self.inputs = []

    def training_step(self, batch, batch_idx):
        self.inputs.append(batch[0].flatten().tolist())
        return super().training_step(batch, batch_idx)


def _augmented_run(rank, tmp, epochs, resume):
    data = Augmented(torch.zeros(8, 1), torch.zeros(8, 1))
    trainer, _ = make_trainer(tmp, strategy="ddp", devices=2, max_epochs=epochs, logger=False)
    module = RecordsInputs()
    trainer.fit(module, DataLoader(data, batch_size=2, num_workers=1), ckpt_path="last" if resume else None)
    return module.inputs


@pytest.mark.slow
def test_worker_randomness_is_per_rank_and_resumes(tmp_path):
    full = run_ranks(_augmented_run, 2, tmp_path / "full", 2, False)
    assert full[0] != full[1]  # each rank draws its own augmentation
    run_ranks(_augmented_run, 2, tmp_path / "cut", 1, False)
    resumed = run_ranks(_augmented_run, 2, tmp_path / "cut", 2, True)
    for rank in range(2):  # the second epoch, resumed from the first one's end, sees the same values
        assert resumed[rank] == full[rank][len(full[rank]) // 2 :]
