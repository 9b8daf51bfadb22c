"""Lightning's Trainer arguments: each one runs as Lightning's, or is refused in one line saying what to do; a keyword
that is neither a Trainer argument nor a strategy's option is refused naming it (it went to the strategy, and was
dropped on one process or failed inside the ranks). One process each (in this process), a few steps."""

from __future__ import annotations

import inspect
import os
import re
import time
from datetime import timedelta

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distrain as L
from distrain.callbacks import EarlyStopping, ModelCheckpoint, Timer
from distrain.strategies import DDPStrategy
from distrain.training.arguments import NOT_RUN
from helpers import make_trainer

#: Lightning 2.6's ``Trainer.__init__`` arguments
LIGHTNING_TRAINER_ARGUMENTS = """accelerator strategy devices num_nodes precision logger callbacks fast_dev_run
max_epochs min_epochs max_steps min_steps max_time limit_train_batches limit_val_batches limit_test_batches
limit_predict_batches overfit_batches val_check_interval check_val_every_n_epoch num_sanity_val_steps
log_every_n_steps enable_checkpointing enable_progress_bar enable_model_summary accumulate_grad_batches
gradient_clip_val gradient_clip_algorithm deterministic benchmark inference_mode use_distributed_sampler profiler
detect_anomaly barebones plugins sync_batchnorm reload_dataloaders_every_n_epochs default_root_dir
enable_autolog_hparams model_registry suggest_integrations""".split()


class Counted(L.Module):
    """Counts its steps per stage and epoch; its validation score is constant (early stopping stops at once)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.seen: dict[str, list[int]] = {"train": [], "val": [], "test": [], "predict": []}
        self.flags: dict[str, object] = {}

    def training_step(self, batch, batch_idx):
        self.seen["train"].append(self.current_epoch)
        self.flags.setdefault("deterministic", torch.are_deterministic_algorithms_enabled())
        self.flags.setdefault("warn_only", torch.is_deterministic_algorithms_warn_only_enabled())
        self.flags.setdefault("anomaly", torch.is_anomaly_enabled())
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        self.seen["val"].append(-1 if self.trainer.sanity_checking else self.current_epoch)
        self.log("val_score", 1.0)

    def test_step(self, batch, batch_idx):
        self.seen["test"].append(batch_idx)

    def predict_step(self, batch, batch_idx):
        self.seen["predict"].append(batch_idx)
        return batch[0]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _loader(n: int = 32) -> DataLoader:  # 8 batches of 4
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=4)


def _trainer(tmp_path, **kw):
    trainer, recorder = make_trainer(tmp_path, devices=1, logger=False, enable_checkpointing=False, **kw)
    trainer.callbacks.remove(recorder)  # it reads a loss at every step; these runs log every 50
    return trainer


def test_every_lightning_argument_is_a_trainer_argument_or_refused_unless_it_means_not_used():
    own = set(inspect.signature(L.Trainer).parameters)
    assert set(LIGHTNING_TRAINER_ARGUMENTS) <= own | set(NOT_RUN), set(LIGHTNING_TRAINER_ARGUMENTS) - own - set(NOT_RUN)
    for name, (unused, _) in NOT_RUN.items():
        L.Trainer(accelerator="cpu", devices=1, **{name: unused})  # Lightning's default: runs
        with pytest.raises(ValueError, match=rf"^Trainer\({name}=.*\): distrain does not run Lightning's {name}; "):
            L.Trainer(accelerator="cpu", devices=1, **{name: "something"})


@pytest.mark.parametrize(
    "strategy, devices, keyword, says",
    [
        ("auto", 1, "max_epoch", r"max_epoch is not an option of any strategy \(nor an argument here\); did you mean "
         r"max_epochs\?"),
        ("ddp", 2, "check_val_every_n_epochs", r"did you mean check_val_every_n_epoch\?"),
        ("ddp", 2, "sharding_strategy", r"sharding_strategy is not an option of strategy 'ddp' .*it is an option of "
         r"'fsdp', 'fsdp_cpu_offload'"),
        ("fsdp", 2, "find_unused_parameters", r"not an option of strategy 'fsdp' .*it is an option of 'ddp'"),
        ("single", 1, "bucket_cap_mb", r"bucket_cap_mb is not an option of strategy 'single'"),
        ("auto", 2, "typo_arg", r"^typo_arg is not an option of any strategy \(nor an argument here\)$"),
    ],
)  # fmt: skip
def test_a_keyword_that_is_no_argument_nor_option_is_one_line_naming_it(strategy, devices, keyword, says):
    with pytest.raises(ValueError, match=says):
        L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, **{keyword: 1})
    with pytest.raises(ValueError, match=rf"^{keyword} is not an option of"):  # the Runtime takes the same options
        L.Runtime(accelerator="cpu", devices=devices, strategy=strategy, **{keyword: 1})


def test_options_of_the_strategies_auto_may_choose_are_kept_for_it_and_torch_ddp_options_reach_ddp():
    L.Trainer(accelerator="cpu", devices=1, strategy="auto", sharding_strategy="FULL_SHARD", bucket_cap_mb=10)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", bucket_cap_mb=10, broadcast_buffers=False)
    assert (
        trainer.strategy.ddp_kwargs["bucket_cap_mb"] == 10 and trainer.strategy.ddp_kwargs["broadcast_buffers"] is False
    )
    with pytest.raises(ValueError, match="DDPStrategy: bucket_cap is not an option of DDPStrategy nor of torch's"):
        DDPStrategy(bucket_cap=10)
    with pytest.raises(ValueError, match="options of a DDPStrategy instance go to its constructor"):
        L.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(), bucket_cap_mb=10)


@pytest.mark.parametrize(
    "keyword, value, says",
    [
        ("gradient_clip_algorithm", "max", r"^gradient_clip_algorithm must be 'norm' or 'value', got 'max'"),
        ("fast_dev_run", -2, r"fast_dev_run is True, False or a number of batches >= 1, got -2"),
        ("limit_train_batches", 1.5, r"limit_train_batches is a number of batches or a fraction in \(0, 1\], got 1.5"),
        ("limit_train_batches", 0, r"limit_train_batches"),
        ("check_val_every_n_epoch", 0, r"check_val_every_n_epoch"),
        ("num_sanity_val_steps", -2, r"num_sanity_val_steps"),
        ("deterministic", "yes", r"deterministic is True, False, 'warn' or None, got 'yes'"),
        ("max_time", "3 hours", r"max_time is 'DD:HH:MM:SS', a timedelta or a dict"),
        ("max_time", {"hour": 1}, r"max_time \{'hour': 1\}: "),
        ("max_time", "00:00:00:00", r"max_time must be longer than zero"),
        ("precision", "transformer-engine", r"Transformer Engine's layers; distrain's float8 training is 'fp8'"),
        (
            "precision",
            "fp32",
            r"precision must be 32-true, 16-mixed, bf16-mixed, 16-true, bf16-true, 64-true or fp8 .*'fp32'",
        ),
    ],
)
def test_a_bad_value_is_one_line_naming_the_argument(keyword, value, says):
    with pytest.raises(ValueError, match=says):
        L.Trainer(accelerator="cpu", devices=1, **{keyword: value})


@pytest.mark.parametrize(
    "precision, runs, warns",
    [
        (32, "32-true", None),
        ("32", "32-true", None),
        ("bf16", "bf16-mixed", "precision='bf16' is Lightning's older spelling of 'bf16-mixed'"),
        # fp16 AMP needs a GPU: on a CPU Lightning's Trainer trains in bf16-mixed, saying so; distrain's refuses it
        (16, "bf16-mixed", "precision=16 is Lightning's older spelling of '16-mixed'"),
        ("16", "bf16-mixed", "AMP with fp16 needs a GPU, so it trains in precision='bf16-mixed' (as Lightning does)"),
        ("16-mixed", "bf16-mixed", "AMP with fp16 needs a GPU"),
    ],
)
def test_lightnings_spellings_of_a_precision_run_as_lightning_runs_them(precision, runs, warns, recwarn):
    from distrain.lightning import Trainer

    assert Trainer(accelerator="cpu", devices=1, precision=precision).runtime.precision.name == runs
    said = [str(w.message) for w in recwarn]
    assert (warns is None and not said) or any(warns in line for line in said), said
    if runs != "bf16-mixed" or precision == "bf16":  # distrain's own Trainer reads the spelling alike
        assert L.Trainer(accelerator="cpu", devices=1, precision=precision).runtime.precision.name == runs
    else:
        with pytest.raises(ValueError, match=r"precision='16-mixed' needs a CUDA GPU .* on CPU use 'bf16-mixed'"):
            L.Trainer(accelerator="cpu", devices=1, precision=precision)


def test_limits_cap_the_batches_of_each_stage_as_counts_or_fractions(tmp_path):
    module = Counted()
    trainer = _trainer(tmp_path, max_epochs=2, limit_train_batches=3, limit_val_batches=0.25)
    trainer.fit(module, _loader(), _loader())
    assert module.seen["train"] == [0, 0, 0, 1, 1, 1] and trainer.global_step == 6
    assert module.seen["val"] == [0, 0, 1, 1]  # a quarter of 8 batches, at each epoch's end
    trainer = _trainer(tmp_path / "eval", limit_val_batches=3, limit_test_batches=0.5, limit_predict_batches=1)
    trainer.validate(module, _loader(), verbose=False)
    trainer.test(module, _loader(), verbose=False)
    assert len(trainer.predict(module, _loader())) == 1
    assert module.seen["val"][4:] == [0, 0, 0] and module.seen["test"] == [0, 1, 2, 3] and module.seen["predict"] == [0]
    fraction = _trainer(tmp_path / "fraction", max_epochs=1, limit_train_batches=0.5)
    fraction.fit(Counted(), _loader())
    assert fraction.global_step == 4 and fraction.estimated_stepping_batches == 4


def test_validation_every_n_epochs_and_a_sanity_check_before_training(tmp_path):
    module, sanity = Counted(), SanityRecorder()
    trainer = _trainer(tmp_path, max_epochs=4, check_val_every_n_epoch=2, num_sanity_val_steps=2, callbacks=[sanity])
    trainer.fit(module, _loader(), _loader(8))
    assert module.seen["val"] == [-1, -1, 1, 1, 3, 3]  # two sanity batches, then epochs 1 and 3 (2 batches each)
    assert sanity.calls == ["start", "end", "train start"] and sanity.metrics_at_train_start == {}


def test_a_val_check_interval_longer_than_an_epoch_is_lightnings_error_unless_it_counts_across_epochs(tmp_path):
    """An int val_check_interval counts the batches of each epoch: one longer than the epoch would never validate, so
    Lightning refuses it, naming check_val_every_n_epoch=None, with which it counts the run's batches instead."""
    from distrain.lightning import Trainer

    def trainer(**kw):
        return Trainer(
            default_root_dir=tmp_path, logger=False, enable_checkpointing=False, enable_progress_bar=False, **kw
        )

    with pytest.raises(ValueError, match=r"`val_check_interval` \(10\) must be less than or equal to the number of"):
        trainer(max_epochs=2, val_check_interval=10, num_sanity_val_steps=0).fit(Counted(), _loader(), _loader(8))
    module = Counted()
    trainer(max_epochs=3, val_check_interval=10, check_val_every_n_epoch=None, num_sanity_val_steps=0).fit(
        module, _loader(), _loader(8)
    )
    assert module.seen["val"] == [1, 1, 2, 2]  # after the run's 10th and 20th batches (8 an epoch)


class SavedAt(L.Callback):
    def __init__(self):
        self.steps: list[int] = []

    def on_save_checkpoint(self, trainer, module, checkpoint):
        self.steps.append(trainer.global_step)


@pytest.mark.parametrize("every, saved", [(None, [8, 16]), (3, [3, 6, 9, 12, 15, 16])])
def test_model_checkpoint_saves_after_each_validation_inside_the_epochs_else_at_their_ends(tmp_path, every, saved):
    """Lightning's rule where save_on_train_epoch_end is not given, in distrain.Trainer too: validations inside the
    epochs (every 3 steps here) each get a checkpoint with their metrics; a run that validates at its epochs' ends
    saves there. distrain.Trainer ends every fit with a validation (step 16), so with a checkpoint."""
    saves = SavedAt()
    trainer, _ = make_trainer(
        tmp_path, devices=1, logger=False, max_epochs=2, val_check_interval=every, callbacks=[saves, ModelCheckpoint()]
    )
    trainer.fit(Counted(), _loader(), _loader(8))
    assert saves.steps == saved


class SanityRecorder(L.Callback):
    def __init__(self):
        self.calls: list[str] = []
        self.metrics_at_train_start = None

    def on_sanity_check_start(self, trainer, module):
        self.calls.append("start")

    def on_sanity_check_end(self, trainer, module):
        self.calls.append("end")

    def on_train_start(self, trainer, module):
        self.calls.append("train start")
        self.metrics_at_train_start = dict(trainer.callback_metrics)  # the sanity check's are dropped


def test_an_early_stop_waits_for_min_epochs_and_min_steps(tmp_path, capsys):
    # the score never improves: patience 0 asks to stop at the end of epoch 1 (its second check)
    for kw, epochs in ((dict(), 2), (dict(min_epochs=4), 4), (dict(min_steps=20), 3)):
        trainer = _trainer(
            tmp_path / str(epochs), max_epochs=9, callbacks=[EarlyStopping("val_score", patience=0)], **kw
        )
        trainer.fit(Counted(), _loader(), _loader(8))
        assert trainer.current_epoch == epochs, kw  # 8 steps an epoch: min_steps=20 ends in the third
    assert capsys.readouterr().out.count("training goes on until both are reached") == 2  # once a run


class Slow(Counted):
    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)


def test_max_time_stops_the_run_and_a_resumed_timer_spends_what_is_left(tmp_path, capsys):
    trainer = _trainer(tmp_path, max_epochs=5, max_time={"milliseconds": 50})
    trainer.fit(Slow(), _loader())
    assert 1 <= trainer.global_step < 8  # 20 ms a step: stopped within the first epoch
    assert "distrain: max_time 0:00:00.050000 reached" in capsys.readouterr().out
    timer = next(c for c in trainer.callbacks if isinstance(c, Timer))
    resumed = Timer("00:01:00:00")
    resumed.load_state_dict(timer.state_dict())
    assert timer.time_elapsed() >= 0.05 and resumed.time_elapsed() == timer.time_elapsed()
    assert resumed.time_remaining() == pytest.approx(3600 - timer.time_elapsed())
    for hostile in ({"time_elapsed": {"train": -3}}, {"time_elapsed": {"train": float("nan")}}, {"time_elapsed": 5}):
        fresh = Timer(timedelta(hours=1))
        fresh.load_state_dict(hostile)
        assert fresh.time_elapsed() == 0.0


def test_fast_dev_run_runs_n_batches_of_each_stage_and_writes_nothing(tmp_path):
    module = Counted()
    keep = ModelCheckpoint(dirpath=str(tmp_path / "kept"))
    trainer, _ = make_trainer(tmp_path, devices=1, max_epochs=10, fast_dev_run=2, callbacks=[keep])
    trainer.fit(module, _loader(), _loader())
    trainer.test(module, _loader(), verbose=False)
    assert module.seen["train"] == [0, 0] and module.seen["val"] == [0, 0] and module.seen["test"] == [0, 1]
    assert not (tmp_path / "kept").exists() and not list(tmp_path.rglob("metrics.jsonl"))
    assert not list(tmp_path.rglob("checkpoints"))


@pytest.mark.parametrize("deterministic", [True, "warn"])
def test_deterministic_and_detect_anomaly_are_set_in_the_rank(tmp_path, deterministic):
    module = Counted()
    try:
        trainer = _trainer(tmp_path, max_steps=1, deterministic=deterministic, detect_anomaly=True)
        trainer.fit(module, _loader())
    finally:  # process-wide flags, and this test ran in this process
        torch.use_deterministic_algorithms(False)
        torch.autograd.set_detect_anomaly(False)
    assert module.flags == {"deterministic": True, "warn_only": deterministic == "warn", "anomaly": True}


class BrokenValidation(Counted):
    def validation_step(self, batch, batch_idx):
        raise ValueError("validation_step is broken")


class EndsSeen(L.Callback):
    def __init__(self):
        self.calls: list[str] = []

    def on_exception(self, trainer, module, exception):
        self.calls.append(f"exception {type(exception).__name__}")

    def teardown(self, trainer, module, stage):
        self.calls.append(f"teardown {stage}")


def test_a_sanity_check_that_fails_stops_before_training_through_on_exception_and_teardown(tmp_path):
    module, ends = BrokenValidation(), EndsSeen()
    trainer = _trainer(tmp_path, max_epochs=1, num_sanity_val_steps=1, callbacks=[ends])
    with pytest.raises(ValueError, match="validation_step is broken"):
        trainer.fit(module, _loader(), _loader(8))
    assert module.seen["train"] == [] and ends.calls == ["exception ValueError", "teardown fit"]


def test_on_a_cpu_lightnings_trainer_counts_one_device_as_lightning_does(monkeypatch):
    """Lightning's CPU accelerator counts one device: ``Trainer()`` (devices="auto") and ``devices=-1`` train in one
    process there, so a migrated script's global batch stays Lightning's; distrain's own Trainer starts a rank per
    core (2 here). A count given, or Lightning's variable, is taken as it is."""
    from distrain.lightning import Trainer

    monkeypatch.delenv("PL_TRAINER_DEVICES", raising=False)
    assert Trainer(accelerator="cpu").world_size == Trainer(accelerator="cpu", devices=-1).world_size == 1
    assert Trainer().world_size == 1  # "auto" on a machine without a GPU
    assert Trainer(accelerator="cpu", devices=2).world_size == 2
    assert L.Trainer(accelerator="cpu").world_size == min(2, os.cpu_count() or 1)
    monkeypatch.setenv("PL_TRAINER_DEVICES", "2")
    assert Trainer(accelerator="cpu").world_size == 2


def test_a_profiler_reports_each_stage_by_action_on_the_console_or_in_each_ranks_file(tmp_path, capsys):
    """``profiler="simple"``: at the end of fit, Lightning's table with a row per action (the strategy's steps, each
    batch, each hook), its calls counted; validate's report starts empty. With a ``filename`` the report goes to
    ``dirpath/{stage}-{filename}-{rank}.txt`` instead; ``"advanced"`` gives cProfile's functions per action;
    ``"pytorch"`` is refused in one line."""
    from distrain.profilers import SimpleProfiler

    trainer = _trainer(tmp_path, max_steps=3, profiler="simple", num_sanity_val_steps=0, limit_val_batches=2)
    trainer.fit(Counted(), _loader(), _loader(8))
    out = capsys.readouterr().out
    assert "FIT Profiler Report" in out, out

    def calls(report: str, action: str) -> int:
        row = re.search(rf"^\|  {re.escape(action)}\s*\|\s*\S+\s*\|\s*(\d+)", report, re.M)
        return int(row.group(1)) if row else 0

    assert calls(out, "[Strategy]SingleDeviceStrategy.training_step") == calls(out, "run_training_batch") == 3
    assert calls(out, "[Strategy]SingleDeviceStrategy.validation_step") == 2  # the end of fit's validation
    assert calls(out, "[LightningModule]Counted.on_train_batch_end") == 3
    trainer.validate(Counted(), _loader(8))
    validate = capsys.readouterr().out.split("VALIDATE Profiler Report")[1]
    assert calls(validate, "[Strategy]SingleDeviceStrategy.validation_step") == 2  # its own calls only
    assert "training_step" not in validate

    written = _trainer(tmp_path, max_steps=2, profiler=SimpleProfiler(dirpath=tmp_path / "p", filename="perf"))
    written.fit(Counted(), _loader())
    assert "Profiler Report" not in capsys.readouterr().out
    assert calls((tmp_path / "p" / "fit-perf-0.txt").read_text(), "run_training_batch") == 2
    advanced = _trainer(tmp_path, max_steps=1, profiler="advanced")
    advanced.fit(Counted(), _loader())
    out = capsys.readouterr().out
    assert "Profile stats for: [Strategy]SingleDeviceStrategy.training_step" in out and "cumulative" in out, out
    with pytest.raises(ValueError, match=r"^Trainer\(profiler='pytorch'\): distrain runs 'simple' and 'advanced'"):
        _trainer(tmp_path, profiler="pytorch")
