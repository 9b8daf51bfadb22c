"""Lightning's stock callbacks. EarlyStopping: its rule on sequences of scores, a check after each validation
mid-epoch, a metric never logged, counts read from a hostile checkpoint (stopping on two ranks, at an epoch's end and
over a resume, is in test_lightning_api's shared run). LearningRateMonitor: Lightning's names, at each logging step
and each epoch's start, following the schedule."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distrain as L
from distrain.callbacks import EarlyStopping, LearningRateMonitor
from helpers import make_trainer


def _checks_until_stop(stopping: EarlyStopping, scores: list[float]) -> int | None:
    """The 0-based check at which ``stopping`` asks to stop, or None."""
    for i, score in enumerate(scores):
        if stopping._evaluate(score)[0]:
            return i
    return None


@pytest.mark.parametrize(
    "kwargs, scores, stops_at",
    [
        (dict(mode="min", patience=2), [3.0, 2.0, 2.0, 2.0], 3),  # equal is no improvement
        (dict(mode="min", patience=2, min_delta=0.5), [3.0, 2.6, 2.7, 2.0], 2),  # 2.6, 2.7: by less than 0.5
        (dict(mode="min", patience=2, min_delta=0.5), [3.0, 2.4, 1.8, 1.2], None),  # by more each time
        (dict(mode="max", patience=1), [0.1, 0.5, 0.4], 2),
        (dict(mode="max", patience=3), [0.1, 0.5, 0.4, 0.6, 0.6, 0.6], None),  # 0.6 resets the count
        (dict(mode="min", patience=0), [3.0, 3.0], 1),  # patience 0: the first check that does not improve
        (dict(mode="min", patience=9, stopping_threshold=1.0), [3.0, 1.5, 0.99], 2),
        (dict(mode="max", patience=9, stopping_threshold=0.9), [0.5, 0.91], 1),
        (dict(mode="min", patience=9, divergence_threshold=10.0), [3.0, 9.0, 10.5], 2),
        (dict(mode="min", patience=9), [3.0, math.nan], 1),  # not finite: at once
        (dict(mode="min", patience=9, check_finite=False), [3.0, math.inf, 2.0], None),
    ],
)
def test_the_stopping_rule_is_lightnings(kwargs, scores, stops_at):
    assert _checks_until_stop(EarlyStopping("m", **kwargs), scores) == stops_at


def test_bad_arguments_are_one_line_each():
    with pytest.raises(ValueError, match="mode must be 'min' or 'max', got 'lowest'"):
        EarlyStopping("val_loss", mode="lowest")
    with pytest.raises(ValueError, match="patience must be an integer >= 0, got -1"):
        EarlyStopping("val_loss", patience=-1)
    with pytest.raises(ValueError, match="min_delta must be a finite number"):
        EarlyStopping("val_loss", min_delta=math.nan)


def test_counts_from_a_hostile_checkpoint_are_taken_only_when_they_are_numbers_of_the_right_kind():
    stopping = EarlyStopping("val_loss", patience=4)
    stopping.load_state_dict({"wait_count": 2, "stopped_epoch": 1, "best_score": 0.5, "patience": 99})
    assert (stopping.wait_count, stopping.stopped_epoch, stopping.best_score, stopping.patience) == (2, 1, 0.5, 4)
    for hostile in ({"wait_count": -5, "best_score": math.nan}, {"wait_count": True, "best_score": "0"}, [1, 2], None):
        fresh = EarlyStopping("val_loss", patience=4)
        fresh.load_state_dict(hostile)
        assert (fresh.wait_count, fresh.best_score) == (0, math.inf)


class Plateau(L.Module):
    """Its validation score gets worse at every validation: 1, 2, 3, ..."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.validations = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val_score", float(self.validations + 1))

    def on_validation_end(self):
        self.validations += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)  # 8 steps an epoch


def test_a_check_after_each_validation_mid_epoch_stops_at_that_step(tmp_path, capsys):
    stopping = EarlyStopping("val_score", patience=2)
    trainer, _ = make_trainer(
        tmp_path, devices=1, max_epochs=3, val_check_interval=2, callbacks=[stopping], logger=False
    )
    trainer.fit(Plateau(), _loader(), _loader())
    # validations at steps 2, 4, 6: the first sets the best, the next two do not improve on it
    assert (trainer.global_step, trainer.current_epoch, stopping.stopped_epoch) == (6, 0, 0)
    assert "distrain: EarlyStopping: val_score did not improve in the last 2 checks (best 1): stopping" in (
        capsys.readouterr().out
    )


def test_a_metric_never_logged_is_one_line_naming_those_that_were(tmp_path):
    trainer, _ = make_trainer(tmp_path, devices=1, max_epochs=2, callbacks=[EarlyStopping("val_los")], logger=False)
    with pytest.raises(RuntimeError, match=r"EarlyStopping monitors 'val_los', which was never logged \(logged: .*"):
        trainer.fit(Plateau(), _loader(), _loader())
    lenient = EarlyStopping("val_los", strict=False)
    trainer, _ = make_trainer(tmp_path / "lenient", devices=1, max_epochs=2, callbacks=[lenient], logger=False)
    trainer.fit(Plateau(), _loader(), _loader())
    assert trainer.current_epoch == 2 and lenient.wait_count == 0


class TwoGroups(Plateau):
    """SGD with two parameter groups (the second named ``head``, with momentum) under a StepLR halving each 4 steps."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.net(x)), y)

    def configure_optimizers(self):
        groups = [{"params": self.net.parameters()}, {"params": self.head.parameters(), "lr": 0.2, "name": "head"}]
        optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("interval", [None, "step", "epoch"])
def test_learning_rates_reach_the_loggers_under_lightnings_names_as_the_schedule_moves(tmp_path, interval):
    monitor = LearningRateMonitor(logging_interval=interval, log_momentum=True, log_weight_decay=True)
    trainer, recorder = make_trainer(tmp_path, devices=1, max_epochs=2, log_every_n_steps=3, callbacks=[monitor])
    trainer.callbacks.remove(recorder)  # it reads a loss at every step: here there is one every third
    trainer.fit(TwoGroups(), _loader())  # 8 steps an epoch, the rate halved after steps 4, 8, 12
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["step"], r["lr-SGD/pg1"], r["lr-SGD/head"]) for r in records if "lr-SGD/pg1" in r]
    at_steps = [(step, 0.1 * 0.5 ** (step // 4), 0.2 * 0.5 ** (step // 4)) for step in range(3, 17, 3)]
    at_epochs = [(0, 0.1, 0.2), (8, 0.025, 0.05)]  # when each epoch starts
    expected = {None: sorted(at_steps + at_epochs), "step": at_steps, "epoch": at_epochs}[interval]
    # one approx per row: pytest 9.1 and later refuse approx of nested sequences
    assert sorted(logged) == [pytest.approx(row) for row in expected]
    last = [r for r in records if "lr-SGD/pg1" in r][-1]
    assert last["lr-SGD/pg1-momentum"] == last["lr-SGD/head-momentum"] == 0.9
    assert last["lr-SGD/pg1-weight_decay"] == 0.01


def test_a_second_optimizer_of_one_class_and_a_named_scheduler_take_lightnings_names(tmp_path):
    trainer, _ = make_trainer(tmp_path, devices=1, max_steps=1, logger=False)
    trainer.fit(Plateau(), _loader())
    a, b = (torch.optim.Adam(nn.Linear(1, 1).parameters(), lr=lr) for lr in (0.1, 0.2))
    c = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.3)
    trainer.optimizers = [a, b, c]
    trainer.lr_schedulers = [{"scheduler": torch.optim.lr_scheduler.StepLR(c, 1), "name": "warmup"}]
    assert LearningRateMonitor().stats(trainer) == {"lr-Adam": 0.1, "lr-Adam-1": 0.2, "warmup": 0.3}
    with pytest.raises(ValueError, match="logging_interval must be 'step', 'epoch' or None, got 'batch'"):
        LearningRateMonitor(logging_interval="batch")


def test_with_validation_every_other_epoch_early_stopping_checks_after_validation(tmp_path):
    """Lightning checks at an epoch's end only when every epoch validates; with check_val_every_n_epoch=2 it checks
    after each validation. Checked at every epoch's end, epoch 0 had no score yet (strict: an error), and a score
    read again without a new validation counted as one more check without improvement."""
    stopping = EarlyStopping("val_score", patience=2)
    trainer, _ = make_trainer(
        tmp_path, devices=1, max_epochs=12, check_val_every_n_epoch=2, callbacks=[stopping], logger=False
    )
    trainer.fit(Plateau(), _loader(), _loader())
    # validations after epochs 1, 3, 5: the first sets the best, the next two do not improve on it
    assert (trainer.current_epoch, stopping.stopped_epoch, stopping.wait_count) == (6, 5, 2)


class _Echo(L.LightningModule):
    """Predicts the sample's own index (the dataset is its indices), so each prediction shows which sample it is."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(1, 1)

    def predict_step(self, batch, batch_idx):
        return batch[0] * 1


def test_a_prediction_writer_gets_each_batchs_samples_with_workers_drawing_ahead_and_keeps_nothing_else(tmp_path):
    """Two workers draw batches ahead of the loop, from a shuffled order: each batch still comes with its own samples'
    indices. With ``return_predictions=False`` and a writer of batches only, nothing is kept; a writer at the epoch's
    end gets every batch's predictions and indices (a list per loader), whatever ``return_predictions`` says."""
    from distrain.callbacks import BasePredictionWriter

    class Writer(BasePredictionWriter):
        def __init__(self, interval):
            super().__init__(interval)
            self.batches, self.epoch = [], None

        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
            self.batches.append((batch_idx, dataloader_idx, list(batch_indices), prediction.tolist()))

        def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
            self.epoch = ([p.tolist() for p in predictions], batch_indices)

    data = TensorDataset(torch.arange(10.0))
    loader = DataLoader(data, batch_size=3, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(5))
    batches, epoch = Writer("batch"), Writer("epoch")
    trainer, _ = make_trainer(tmp_path, devices=1, callbacks=[batches, epoch], logger=False)
    assert trainer.predict(_Echo(), loader, return_predictions=False) is None
    assert [b[:2] for b in batches.batches] == [(0, 0), (1, 0), (2, 0), (3, 0)] and batches.epoch is None
    for _, _, indices, prediction in batches.batches:
        assert prediction == [float(i) for i in indices]  # the indices are this batch's samples
    assert sorted(i for b in batches.batches for i in b[2]) == list(range(10))
    assert sorted(i for b in batches.batches for i in b[2]) != [i for b in batches.batches for i in b[2]]  # shuffled
    predictions, indices = epoch.epoch
    assert indices == [[b[2] for b in batches.batches]] and predictions == [b[3] for b in batches.batches]
    assert trainer.predict_loop.epoch_batch_indices == []  # cleared once written, as Lightning's loop does
    only_batches = Writer("batch")
    trainer, _ = make_trainer(tmp_path, devices=1, callbacks=[only_batches], logger=False)
    assert trainer.predict(_Echo(), DataLoader(data, batch_size=4), return_predictions=False) is None
    assert trainer.predict_loop.predictions == [] and len(only_batches.batches) == 3  # nothing kept
    with pytest.raises(ValueError, match=r"`write_interval` should be one of \['batch', 'epoch', 'batch_and_epoch'\]"):
        Writer("step")


class _Averaged(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_weight_averaging_resumes_to_the_uninterrupted_average_and_is_refused_where_ranks_hold_parts(tmp_path):
    """A run resumed from a checkpoint mid-way ends with the uninterrupted run's averaged weights and buffers, to the
    bit (the average and when it last updated are in the checkpoint). Under a strategy whose ranks hold part of the
    model the average (a whole copy) is refused in one line naming the strategy."""
    from distrain.callbacks import EMAWeightAveraging, ModelCheckpoint

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 3, generator=g), torch.randn(24, 1, generator=g))

    def fit(root, steps, ckpt_path=None):
        torch.manual_seed(0)
        module = _Averaged()
        every = ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_train_steps=3, save_top_k=-1)
        averaging = EMAWeightAveraging(decay=0.8, update_starting_at_step=1)
        trainer, _ = make_trainer(root, devices=1, max_steps=steps, callbacks=[averaging, every], logger=False)
        trainer.fit(module, DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
        return {k: v.clone() for k, v in module.state_dict().items()}, averaging

    whole, averaging = fit(tmp_path / "whole", 8)
    assert averaging._latest_update_step == 8
    resumed, _ = fit(tmp_path / "resumed", 8, ckpt_path=str(tmp_path / "whole" / "ckpt" / "epoch=0-step=3"))
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
    stopped, _ = fit(tmp_path / "stopped", 3)
    assert not torch.equal(stopped["net.0.weight"], whole["net.0.weight"])  # the resume had something to do
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="fsdp", callbacks=[EMAWeightAveraging()], logger=False)
    with pytest.raises(ValueError, match=r"^EMAWeightAveraging keeps a whole copy of the model .* under FSDPStrategy"):
        trainer.fit(_Averaged(), DataLoader(data, batch_size=4))


class _SWAModule(L.LightningModule):
    def __init__(self, batch_norm: bool = False):
        super().__init__()
        middle = nn.BatchNorm1d(4) if batch_norm else nn.ReLU()
        self.net = nn.Sequential(nn.Linear(3, 4), middle, nn.Linear(4, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


def test_stochastic_weight_averaging_resumed_inside_its_epochs_ends_on_the_uninterrupted_weights(tmp_path):
    """Resumed from the checkpoint of an epoch inside the averaging (its SWALR schedule in place of the module's, the
    average half made), the run ends on the uninterrupted run's weights to the bit. A model with BatchNorm is refused
    in one line saying what to use."""
    from distrain.callbacks import ModelCheckpoint, StochasticWeightAveraging

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g))

    class Epochs(L.Callback):
        def __init__(self):
            self.started, self.ended = [], []

        def on_train_epoch_start(self, trainer, module):
            self.started.append(trainer.current_epoch)

        def on_train_epoch_end(self, trainer, module):
            self.ended.append(trainer.current_epoch)

    def fit(root, ckpt_path=None, module=None):
        torch.manual_seed(0)
        module, epochs = module or _SWAModule(), Epochs()
        swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=3)
        every = ModelCheckpoint(dirpath=str(root / "ckpt"), save_top_k=-1)
        trainer, _ = make_trainer(root, devices=1, max_epochs=5, callbacks=[swa, every, epochs], logger=False)
        trainer.fit(module, DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
        return {k: v.clone() for k, v in module.state_dict().items()}, trainer, epochs

    whole, trainer, _ = fit(tmp_path / "whole")
    assert type(trainer.lr_schedulers[0]["scheduler"]).__name__ == "SWALR"
    resumed, _, epochs = fit(tmp_path / "resumed", ckpt_path=str(tmp_path / "whole" / "ckpt" / "epoch=2-step=12"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    # the epochs left, each started and ended once: none for the epoch the checkpoint ended (Lightning's hooks)
    assert (epochs.started, epochs.ended) == ([3, 4], [3, 4])
    with pytest.raises(ValueError, match=r"^StochasticWeightAveraging: _SWAModule has a BatchNorm1d, .* EMAWeight"):
        fit(tmp_path / "bn", module=_SWAModule(batch_norm=True))


def test_device_stats_reach_the_loggers_under_lightnings_names_on_logging_steps(tmp_path):
    """On a CPU: the host's CPU, memory and swap use at the start and end of each training batch of a logging step
    (``DeviceStatsMonitor.on_train_batch_start/cpu_percent``...), and of validation's; none with ``cpu_stats=False``;
    without a logger, refused in one line as Lightning refuses it."""
    from distrain.callbacks import DeviceStatsMonitor
    from distrain.loggers import JSONLLogger

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g)), batch_size=4)

    def logged(**kw) -> list[dict]:
        kw = {"max_steps": 4, **kw}
        trainer, recorder = make_trainer(
            tmp_path, devices=1, log_every_n_steps=2, logger=JSONLLogger(str(tmp_path)), **kw
        )
        trainer.callbacks.remove(recorder)  # it reads a loss at every step; this run logs every other one
        trainer.fit(_SWAModule(), data, data)
        rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        (tmp_path / "metrics.jsonl").unlink()
        return [r for r in rows if any(k.startswith("DeviceStatsMonitor.") for k in r)]

    rows = logged(callbacks=[DeviceStatsMonitor()])

    def steps(name: str) -> list[int]:
        return [r["step"] for r in rows if f"DeviceStatsMonitor.{name}" in r]

    # the batches of optimizer steps 2 and 4 (the logging steps), at Lightning's step: those stepped before them
    assert steps("on_train_batch_start/cpu_percent") == steps("on_train_batch_end/cpu_vm_percent") == [1, 3]
    assert all(0 <= value <= 100 for r in rows for key, value in r.items() if key.startswith("DeviceStatsMonitor."))
    assert steps("on_validation_batch_end/cpu_swap_percent") == []  # the validation after step 4 counts towards 5
    rows = logged(callbacks=[DeviceStatsMonitor()], limit_train_batches=3, max_epochs=1)  # validated after step 3
    assert steps("on_validation_batch_start/cpu_percent") == steps("on_validation_batch_end/cpu_percent") == [3] * 4
    assert logged(callbacks=[DeviceStatsMonitor(cpu_stats=False)]) == []
    trainer, _ = make_trainer(tmp_path, devices=1, max_steps=1, logger=False, callbacks=[DeviceStatsMonitor()])
    with pytest.raises(ValueError, match=r"^Cannot use `DeviceStatsMonitor` callback with `Trainer\(logger=False\)`"):
        trainer.fit(_SWAModule(), data)


def test_every_stock_callback_and_profiler_can_be_sent_to_spawned_ranks():
    """``ddp_spawn`` pickles the Trainer, its callbacks and profiler, to each rank: each stock one survives the trip
    as Lightning's documentation constructs it (EMAWeightAveraging's average was a closure of torch's, which pickle
    cannot carry), and an EMA sent keeps its arithmetic."""
    import pickle

    from distrain.lightning import callbacks as cb
    from distrain.lightning import profilers

    made = [
        cb.BasePredictionWriter("epoch"), cb.EMAWeightAveraging(decay=0.9), cb.WeightAveraging(),
        cb.StochasticWeightAveraging(swa_lrs=1e-2), cb.DeviceStatsMonitor(), cb.ModelCheckpoint(monitor="val_loss"),
        cb.EarlyStopping("val_loss"), cb.LearningRateMonitor(), cb.Timer(), cb.TQDMProgressBar(refresh_rate=5),
        cb.GradientAccumulationScheduler({0: 2}), cb.ModelSummary(max_depth=2),
        profilers.SimpleProfiler(), profilers.AdvancedProfiler(), profilers.PassThroughProfiler(),
    ]  # fmt: skip
    for callback in made:
        assert type(pickle.loads(pickle.dumps(callback))) is type(callback), callback
    ema = pickle.loads(pickle.dumps(cb.EMAWeightAveraging(decay=0.9)))._kwargs["avg_fn"]
    averaged, current = torch.tensor([1.0]), torch.tensor([3.0])
    assert torch.equal(ema(averaged, current, 1), torch.optim.swa_utils.get_ema_avg_fn(0.9)(averaged, current, 1))


def test_a_timer_without_a_duration_keeps_the_time_and_stops_nothing(tmp_path):
    """Lightning's ``Timer()`` default: no duration, the training time kept, the run to its last step."""
    from distrain.callbacks import Timer

    timer = Timer()
    trainer, _ = make_trainer(tmp_path, devices=1, max_steps=3, logger=False, callbacks=[timer])
    data = DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=4)
    trainer.fit(_SWAModule(), data)
    assert trainer.global_step == 3 and timer.time_elapsed() > 0 and timer.time_remaining() is None
