"""``distrain.lightning``: Lightning's module paths, names, strategy names and overridable hooks, so that a Lightning
script moves by its imports alone. One process each (the 2-rank runs: tests/test_lightning_examples.py)."""

from __future__ import annotations

import copy
import importlib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distrain
import distrain.lightning as pl
from distrain.strategies import registry
from helpers import make_trainer


def _data(n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))


def _loader(n: int = 32, batch_size: int = 4) -> DataLoader:
    return DataLoader(_data(n), batch_size=batch_size)


class Regressor(pl.LightningModule):
    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


# ---- the namespace ---------------------------------------------------------------------------------------------------
def test_the_import_edit_is_mechanical_and_leaves_other_words_alone():
    source = (
        "import lightning as L\nimport lightning.pytorch as pl\nimport pytorch_lightning\n"
        "from lightning.pytorch.callbacks import ModelCheckpoint\nfrom pytorch_lightning.loggers import CSVLogger\n"
        "logs = 'lightning_logs'  # lightning_fabric stays\n"
    )
    assert pl.migrate(source) == (
        "import distrain.lightning as L\nimport distrain.lightning as pl\nimport distrain.lightning\n"
        "from distrain.lightning.callbacks import ModelCheckpoint\nfrom distrain.lightning.loggers import CSVLogger\n"
        "logs = 'lightning_logs'  # lightning_fabric stays\n"
    )
    # code only: a link in a comment or a docstring, text and an attribute of that name stay; a string that is a
    # module path (LightningCLI's class_path) moves; source Python cannot read is edited word by word
    code = (
        '"""See https://lightning.ai/docs/pytorch/stable/api/pytorch_lightning.core.hooks.html"""\n'
        "# 1. [setup()](https://lightning.ai/docs/pytorch/stable/common/lightning_module.html) \f\n"
        "trainer = lightning.pytorch.Trainer(); L = pytorch_lightning . LightningModule\n"
        'print("Using lightning"); self.lightning = 1\n'
        "defaults = {'class_path': 'lightning.pytorch.callbacks.ModelCheckpoint', 'x': r\"pytorch_lightning\"}\n"
    )
    assert pl.migrate(code) == code.replace("trainer = lightning.pytorch", "trainer = distrain.lightning").replace(
        "L = pytorch_lightning", "L = distrain.lightning"
    ).replace("'lightning.pytorch.callbacks", "'distrain.lightning.callbacks").replace(
        'r"pytorch_lightning"', 'r"distrain.lightning"'
    )
    assert pl.migrate("import lightning as L\nif (:\n") == "import distrain.lightning as L\nif (:\n"


@pytest.mark.parametrize(
    "path, names",
    [
        (
            "distrain.lightning",
            "Trainer LightningModule LightningDataModule Callback seed_everything cli_lightning_logo",
        ),
        ("distrain.lightning.core", "LightningModule LightningDataModule"),
        ("distrain.lightning.trainer", "Trainer"),
        (
            "distrain.lightning.callbacks",
            "Callback ModelCheckpoint EarlyStopping LearningRateMonitor Timer TQDMProgressBar RichProgressBar",
        ),
        ("distrain.lightning.loggers", "Logger TensorBoardLogger CSVLogger WandbLogger MLFlowLogger"),
        ("distrain.lightning.strategies", "DDPStrategy FSDPStrategy DeepSpeedStrategy ModelParallelStrategy Strategy"),
        ("distrain.lightning.utilities", "rank_zero_only rank_zero_info rank_zero_warn grad_norm AttributeDict"),
        ("distrain.lightning.utilities.imports", "_TORCHVISION_AVAILABLE"),
        ("distrain.lightning.utilities.deepspeed", "convert_zero_checkpoint_to_fp32_state_dict"),
        ("distrain.lightning.utilities.types", "STEP_OUTPUT OptimizerLRScheduler EVAL_DATALOADERS TRAIN_DATALOADERS"),
        (
            "distrain.lightning.demos",
            "BoringModel BoringDataModule RandomDataset RandomDictDataset RandomIterableDataset",
        ),
    ],
)
def test_lightnings_names_are_at_lightnings_paths(path, names):
    module = importlib.import_module(path)
    for name in names.split():
        assert getattr(module, name) is not None, (path, name)
    assert pl.LightningModule is distrain.LightningModule is distrain.Module
    assert distrain.pytorch is pl and issubclass(pl.Trainer, distrain.Trainer)


def test_a_lightning_name_distrain_lacks_is_refused_in_one_line_where_it_is_imported():
    with pytest.raises(ImportError, match=r"callbacks\.ModelPruning: distrain has no counterpart"):
        from distrain.lightning.callbacks import ModelPruning  # noqa: F401
    with pytest.raises(ImportError, match=r"loggers\.NeptuneLogger"):
        from distrain.lightning.loggers import NeptuneLogger  # noqa: F401


# ---- strategy names --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("start", ["ddp", "ddp_spawn", "ddp_fork", "ddp_notebook"])
@pytest.mark.parametrize("flag", [True, False])
def test_lightnings_find_unused_parameters_names_build_the_ddp_they_mean(start, flag):
    strategy = registry.make_strategy(f"{start}_find_unused_parameters_{str(flag).lower()}", 2)
    plain = registry.make_strategy(start, 2)
    assert type(strategy) is type(plain) and strategy.start_method == plain.start_method
    assert strategy.ddp_kwargs["find_unused_parameters"] is flag
    explicit = registry.make_strategy("ddp_find_unused_parameters_true", 2, find_unused_parameters=False)
    assert explicit.ddp_kwargs["find_unused_parameters"] is False  # a keyword of the run's own wins
    assert f"{start}_find_unused_parameters_true" not in registry.names()  # listed once, under its own name


def test_an_alias_in_a_config_file_means_the_same_and_xla_is_refused_in_one_line():
    config = distrain.build_config(cli_items=["distributed.strategy=ddp_spawn_find_unused_parameters_true"])
    options = registry.options_from_config(config.distributed.strategy, config, set())
    assert options["find_unused_parameters"] is True
    for name in ("xla", "single_xla", "xla_fsdp"):
        with pytest.raises(ValueError, match="XLA .* is not supported"):
            registry.make_strategy(name, 2)


# ---- the Trainer's Lightning defaults --------------------------------------------------------------------------------
def test_pl_trainer_variables_are_defaults_and_the_scripts_own_keyword_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("PL_TRAINER_DEVICES", "1")
    monkeypatch.setenv("PL_TRAINER_MAX_EPOCHS", "3")
    monkeypatch.setenv("PL_TRAINER_ACCELERATOR", "cpu")
    trainer = pl.Trainer(max_epochs=2, default_root_dir=str(tmp_path))
    assert trainer.world_size == 1 and trainer.max_epochs == 2
    monkeypatch.setenv("PL_TRAINER_MAX_EPOCS", "3")
    with pytest.raises(ValueError, match="max_epocs"):
        pl.Trainer(default_root_dir=str(tmp_path))


def test_seed_everything_keeps_the_seed_for_the_ranks_and_the_sampler(monkeypatch):
    # set, then removed: monkeypatch restores only what it recorded, and seed_everything writes the variable itself
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    monkeypatch.delenv("PL_GLOBAL_SEED")
    assert pl.seed_everything(123) == 123
    import os

    assert os.environ["PL_GLOBAL_SEED"] == "123"
    a = torch.rand(3)
    pl.seed_everything()
    assert torch.equal(a, torch.rand(3))


# ---- the hooks a user overrides --------------------------------------------------------------------------------------
class WarmUp(Regressor):
    """Lightning's docs' learning-rate warm-up in ``optimizer_step``, a counted ``optimizer_zero_grad`` and
    ``lr_scheduler_step``, and value clipping in ``configure_gradient_clipping``."""

    def __init__(self):
        super().__init__()
        self.calls = {"zero_grad": 0, "scheduler": 0}

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)}

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        assert isinstance(optimizer, torch.optim.SGD)
        for group in optimizer.param_groups:
            group["lr"] = self.lr * min(1.0, (self.trainer.global_step + 1) / 4)
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self.calls["zero_grad"] += 1
        optimizer.zero_grad()

    def lr_scheduler_step(self, scheduler, metric):
        self.calls["scheduler"] += 1
        scheduler.step()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="value")


def _by_hand(module: WarmUp, epochs: int) -> nn.Module:
    net = copy.deepcopy(module.net)
    opt = torch.optim.SGD(net.parameters(), lr=module.lr)
    schedule = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    step = 0
    for _ in range(epochs):
        for x, y in _loader():
            F.mse_loss(net(x), y).backward()
            torch.nn.utils.clip_grad_value_(net.parameters(), 0.5)
            for group in opt.param_groups:
                group["lr"] = module.lr * min(1.0, (step + 1) / 4)
            opt.step()
            opt.zero_grad()
            step += 1
        schedule.step()  # an epoch's scheduler
    return net


def test_overridden_step_hooks_run_and_train_as_the_same_loop_written_by_hand(tmp_path):
    module = WarmUp()
    expected = _by_hand(module, epochs=2)
    trainer, _ = make_trainer(tmp_path, devices=1, max_epochs=2, logger=False, enable_checkpointing=False)
    trainer.fit(module, _loader())
    assert module.calls == {"zero_grad": 16, "scheduler": 2}
    for got, want in zip(module.net.parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


class DoublesItsGradients(Regressor):
    """Lightning's ``backward`` override: here the gradient of twice the loss, in automatic and manual optimization."""

    calls = 0

    def backward(self, loss, *args, **kwargs):
        DoublesItsGradients.calls += 1
        (2 * loss).backward(*args, **kwargs)


def test_an_overridden_backward_runs_the_backward_where_the_strategy_can_and_is_refused_where_not(tmp_path):
    module = DoublesItsGradients()
    net = copy.deepcopy(module.net)
    opt = torch.optim.SGD(net.parameters(), lr=module.lr)
    for x, y in _loader():
        (2 * F.mse_loss(net(x), y)).backward()
        opt.step()
        opt.zero_grad()
    trainer, _ = make_trainer(tmp_path, devices=1, max_epochs=1, logger=False, enable_checkpointing=False)
    trainer.fit(module, _loader())
    assert DoublesItsGradients.calls == 8
    torch.testing.assert_close(module.net.weight, net.weight)
    for strategy in ("deepspeed_stage_2", "pipeline"):
        trainer, _ = make_trainer(tmp_path / strategy, strategy=strategy, devices=2, max_steps=1, logger=False)
        with pytest.raises(NotImplementedError, match=r"DoublesItsGradients.backward: \w+Strategy runs the backward"):
            trainer.fit(DoublesItsGradients(), _loader())


class SkipsOddSteps(Regressor):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if batch_idx % 2 == 0:
            optimizer.step(closure=optimizer_closure)


def test_a_step_the_override_leaves_out_is_not_applied(tmp_path):
    module = SkipsOddSteps()
    net = copy.deepcopy(module.net)
    opt = torch.optim.SGD(net.parameters(), lr=module.lr)
    for i, (x, y) in enumerate(_loader()):
        F.mse_loss(net(x), y).backward()
        if i % 2 == 0:
            opt.step()
        opt.zero_grad()
    trainer, _ = make_trainer(tmp_path, devices=1, max_epochs=1, logger=False, enable_checkpointing=False)
    trainer.fit(module, _loader())
    torch.testing.assert_close(module.net.weight, net.weight)


class GAN(pl.LightningModule):
    """Lightning's GAN example's shape: two optimizers toggled in turn, an LR scheduler built on
    ``self.optimizers()`` (torch's schedulers check ``isinstance(..., Optimizer)``)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.generator, self.discriminator = nn.Linear(4, 4), nn.Linear(4, 1)
        self.seen: list[tuple[bool, bool]] = []

    def on_train_start(self):
        opt_g, _ = self.optimizers()
        self.schedule = torch.optim.lr_scheduler.StepLR(opt_g, 1, 0.5)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        assert isinstance(opt_g, torch.optim.Optimizer) and isinstance(opt_d, torch.optim.Adam)
        self.toggle_optimizer(opt_g)
        self.seen.append((self.generator.weight.requires_grad, self.discriminator.weight.requires_grad))
        g_loss = self.discriminator(self.generator(x)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        with self.toggled_optimizer(opt_d):
            self.seen.append((self.generator.weight.requires_grad, self.discriminator.weight.requires_grad))
            d_loss = self.discriminator(x).mean() - self.discriminator(self.generator(x).detach()).mean()
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            opt_d.step()
        self.schedule.step()

    def configure_optimizers(self):
        return torch.optim.Adam(self.generator.parameters(), 0.01), torch.optim.Adam(self.discriminator.parameters())


def test_toggled_optimizers_and_a_scheduler_on_self_optimizers(tmp_path):
    module = GAN()
    trainer, recorder = make_trainer(tmp_path, devices=1, max_steps=6, logger=False, enable_checkpointing=False)
    trainer.callbacks.remove(recorder)  # it reads a loss the loop has not: training_step returns none
    trainer.fit(module, _loader())
    assert module.seen[:2] == [(True, False), (False, True)] and len(set(module.seen[::2])) == 1
    assert module.generator.weight.requires_grad and module.discriminator.weight.requires_grad  # given back
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**3)  # 3 batches, 2 steps each


# ---- validate / test / predict as Lightning's ------------------------------------------------------------------------
def test_test_with_no_model_evaluates_the_best_checkpoint_of_the_fit(tmp_path):
    checkpoint = pl.callbacks.ModelCheckpoint(monitor="val_loss", mode="max", save_top_k=1, save_last=False)
    trainer, _ = make_trainer(tmp_path, devices=1, max_epochs=3, logger=False, callbacks=[checkpoint])
    module = Regressor()
    trainer.fit(module, _loader(), _loader(16))
    assert checkpoint.best_model_path and "epoch=0" in checkpoint.best_model_path  # the worst loss: the first epoch
    current = trainer.test(module, _loader(16))[0]["test_loss"]  # a model given, no ckpt_path: as it is
    with pytest.warns(UserWarning, match="evaluates the best checkpoint"):
        best = trainer.test(dataloaders=_loader(16))[0]["test_loss"]
    fresh = Regressor()
    expected = trainer.test(fresh, _loader(16), ckpt_path=checkpoint.best_model_path)[0]["test_loss"]
    assert best == pytest.approx(expected)
    assert current < best
    torch.testing.assert_close(module.net.weight, fresh.net.weight)  # the best weights went into the fitted model
    assert trainer.validate(ckpt_path="best", dataloaders=_loader(16))[0]["val_loss"] == pytest.approx(best)


def test_stage_methods_say_what_they_lack(tmp_path):
    trainer, _ = make_trainer(tmp_path, devices=1, max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"test\(\) needs a model: pass one, or call fit\(\) first"):
        trainer.test(dataloaders=_loader())
    trainer.fit(Regressor(), _loader())
    with pytest.raises(FileNotFoundError, match="ckpt_path='best' needs a ModelCheckpoint"):
        trainer.validate(ckpt_path="best", dataloaders=_loader())
    assert trainer.validate(dataloaders=_loader(8))[0]["val_loss"] >= 0  # no checkpoint kept: the weights as they are


# ---- loggers and utilities -------------------------------------------------------------------------------------------
def test_trainer_logger_is_tensorboard_with_its_writer_and_the_graph_when_asked(tmp_path, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    trainer = pl.Trainer(
        default_root_dir=str(tmp_path), accelerator="cpu", devices=1, max_steps=2, enable_checkpointing=False
    )
    assert isinstance(trainer.logger, pl.loggers.TensorBoardLogger) and trainer.logger is trainer.loggers[0]
    assert Path(trainer.logger.log_dir) == tmp_path / "lightning_logs" / "version_0"  # Lightning's default
    trainer.logger._log_graph = True  # as Lightning's tutorials set it
    module = Regressor()
    module.example_input_array = torch.zeros(2, 4)
    trainer.fit(module, _loader())
    assert isinstance(module.logger.experiment, SummaryWriter)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trainer.logger.log_dir))
    events.Reload()
    assert events.Graph() is not None
    monkeypatch.setenv("RANK", "1")  # another rank: Lightning's stand-in, which does nothing
    assert isinstance(trainer.logger.experiment, pl.loggers.DummyExperiment)
    trainer.logger.experiment.add_image("x", torch.zeros(3, 2, 2), 0)
    assert pl.utilities.rank_zero_only(lambda: 1)() is None


@pytest.mark.parametrize(
    "logger, folder",
    [
        (True, "lightning_logs/version_{}"),
        (lambda: pl.loggers.CSVLogger("logs/"), "logs/lightning_logs/version_{}"),
        (lambda: pl.loggers.TensorBoardLogger("tb_logs", name="my_model"), "tb_logs/my_model/version_{}"),
        (False, "."),
    ],
    ids=["default", "csv", "tensorboard", "none"],
)
def test_a_run_writes_and_checkpoints_in_lightnings_folders_and_last_resumes_the_newest_run(
    tmp_path, monkeypatch, logger, folder
):
    """Lightning's paths, relative to the working directory (``default_root_dir``'s default): the run's folder is its
    first logger's (``lightning_logs/version_N`` for the default), its checkpoints in ``checkpoints`` there, so
    ``lightning_logs/version_0/checkpoints/...`` loads; each Trainer is a new version, and ``ckpt_path="last"``
    resumes the newest earlier run's last checkpoint (Lightning would start over)."""
    monkeypatch.chdir(tmp_path)

    def fit(steps, ckpt_path=None):
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            enable_progress_bar=False,
            logger=logger() if callable(logger) else logger,
            callbacks=[pl.callbacks.ModelCheckpoint(save_last=True)],
        )
        trainer.fit(Regressor(), _loader(), ckpt_path=ckpt_path)
        return trainer

    first = fit(3)
    assert Path(first.log_dir).resolve() == (tmp_path / folder.format(0)).resolve()
    saved = Path(first.checkpoint_callback.best_model_path)
    assert saved.resolve() == (tmp_path / folder.format(0) / "checkpoints" / "epoch=0-step=3.ckpt").resolve()
    loaded = Regressor.load_from_checkpoint(f"{folder.format(0)}/checkpoints/epoch=0-step=3.ckpt")
    torch.testing.assert_close(loaded.net.weight, first.lightning_module.net.weight, rtol=0, atol=0)
    again = fit(5, ckpt_path="last")
    assert again.global_step == 5
    if folder != ".":
        assert Path(again.log_dir).resolve() == (tmp_path / folder.format(1)).resolve()


class _SavingRegressor(Regressor):
    def __init__(self, lr: float = 0.05, layers: tuple = (4, 1), wandb_api_key: str = "hunter2"):
        super().__init__(lr)
        self.save_hyperparameters()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def test_csv_logger_writes_lightnings_metrics_csv_and_hparams_yaml_in_the_next_version(tmp_path):
    """The first tutorial reads ``pd.read_csv(f"{trainer.logger.log_dir}/metrics.csv")``: a header of every key
    (sorted), a row per logged step with its epoch, validation rows too; hparams.yaml beside it."""
    import csv

    import yaml

    from distrain.config import REDACTED

    (tmp_path / "runs" / "version_0").mkdir(parents=True)
    (tmp_path / "runs" / "version_4").mkdir()
    (tmp_path / "runs" / "version_9").write_text("a file, not a version")
    logger = pl.loggers.CSVLogger(str(tmp_path), name="runs")
    assert logger.version == 5 and logger.log_dir == str(tmp_path / "runs" / "version_5")
    assert logger.save_dir == str(tmp_path)
    trainer, recorder = make_trainer(tmp_path, devices=1, max_epochs=2, logger=logger, log_every_n_steps=2)
    trainer.callbacks.remove(recorder)  # it reads the loss at every step; the loggers have it every other
    trainer.fit(_SavingRegressor(), _loader(), _loader(8))
    with open(tmp_path / "runs" / "version_5" / "metrics.csv", newline="") as f:
        header, *lines = list(csv.reader(f))
    rows = [dict(zip(header, line, strict=True)) for line in lines]
    assert header == sorted(header) and {"epoch", "step", "train_loss", "val_loss"} <= set(header)
    assert len(rows) == 8 + 2  # every other of 16 steps, and a validation after each epoch
    validation = [(r["epoch"], r["step"]) for r in rows if r["val_loss"]]
    assert validation == [("0", "8"), ("1", "16")] and all(r["train_loss"] == "" for r in rows if r["val_loss"])
    assert [r["step"] for r in rows if r["train_loss"]] == [str(s) for s in range(2, 17, 2)]
    assert {r["epoch"] for r in rows if r["train_loss"] and int(r["step"]) > 8} == {"1"}
    hparams = yaml.safe_load((tmp_path / "runs" / "version_5" / "hparams.yaml").read_text())
    assert hparams == {"lr": 0.05, "layers": [4, 1], "wandb_api_key": REDACTED}  # a secret never reaches a file


def test_csv_logger_widens_its_header_for_a_late_key_and_flushes_when_told(tmp_path):
    import csv

    logger = pl.loggers.CSVLogger(tmp_path, name=None, version="run", prefix="train", flush_logs_every_n_steps=2)
    path = tmp_path / "run" / "metrics.csv"
    logger.log_metrics({"loss": torch.tensor(1.5)}, step=0)
    assert not path.exists()  # kept until the second step
    logger.log_metrics({"loss": 1.25}, step=1)
    assert path.read_text().splitlines() == ["step,train-loss", "0,1.5", "1,1.25"]
    logger.log_metrics({"acc": 0.5}, step=2)
    logger.finalize()
    with open(path, newline="") as f:
        assert list(csv.reader(f)) == [
            ["step", "train-acc", "train-loss"],
            ["0", "", "1.5"],
            ["1", "", "1.25"],
            ["2", "0.5", ""],
        ]
    assert (tmp_path / "run" / "hparams.yaml").read_text() == "{}\n"
    with pytest.raises(ValueError, match="flush_logs_every_n_steps must be an int >= 1, got 0"):
        pl.loggers.CSVLogger(tmp_path, flush_logs_every_n_steps=0)


def test_grad_norm(tmp_path):
    net = nn.Linear(3, 2)
    net(torch.ones(1, 3)).sum().backward()
    norms = pl.utilities.grad_norm(net, norm_type=2)
    assert norms["grad_2.0_norm/weight"] == pytest.approx(float(net.weight.grad.norm()))
    total = torch.cat([net.weight.grad.flatten(), net.bias.grad.flatten()]).norm()
    assert norms["grad_2.0_norm_total"] == pytest.approx(float(total))


# ---- ModelCheckpoint with Lightning's arguments ----------------------------------------------------------------------
def test_lightnings_checkpoint_names_weights_only_and_versions(tmp_path):
    from distrain.checkpoint.io import CheckpointError
    from distrain.checkpoint.state import read_checkpoint_meta

    def run(max_epochs, **kwargs):
        checkpoint = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="val_loss", **kwargs)
        trainer, _ = make_trainer(tmp_path, devices=1, max_epochs=max_epochs, logger=False, callbacks=[checkpoint])
        trainer.fit(Regressor(), _loader(), _loader(8))
        return trainer, checkpoint

    trainer, checkpoint = run(2, filename="{epoch}-{val_loss:.2f}", save_weights_only=True, save_top_k=-1)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name not in ("last", "last.ckpt"))
    assert [n.split("-val_loss=")[0] for n in names] == ["epoch=0", "epoch=1"], names
    meta = read_checkpoint_meta(checkpoint.best_model_path)
    assert meta["weights_only"] is True and "optimizers" not in meta and "lr_schedulers" not in meta
    assert trainer.test(Regressor(), _loader(8), ckpt_path=checkpoint.best_model_path)[0]["test_loss"] >= 0
    again, _ = make_trainer(tmp_path / "again", devices=1, max_epochs=3, logger=False)
    with pytest.raises(CheckpointError, match=r"holds the weights only .* fit cannot resume from it"):
        again.fit(Regressor(), _loader(), ckpt_path=checkpoint.best_model_path)
    run(1, save_top_k=-1)  # the default name, Lightning's, twice in one folder: the second is versioned
    run(1, save_top_k=-1)
    assert {"epoch=0-step=8.ckpt", "epoch=0-step=8-v1.ckpt"} <= {p.name for p in (tmp_path / "ckpt").iterdir()}


class _ValLossAtEachSave(distrain.Callback):
    """The monitored value each epoch's checkpoint is ranked by (saved at the epoch's end, after validation)."""

    def __init__(self):
        self.at_epoch: list[float] = []

    def on_train_epoch_end(self, trainer, module):
        self.at_epoch.append(float(trainer.callback_metrics["val_loss"]))


@pytest.mark.parametrize("mode, top_k", [("min", 2), ("max", -1), (None, 1)])
def test_the_kept_checkpoints_are_told_as_lightnings_callback_tells_them(tmp_path, mode, top_k):
    """``best_k_models`` (path → monitored value), ``best_model_score``, ``kth_best_model_path`` and ``kth_value``, as
    Lightning 2.6.6 gives them for the same three callbacks (checked there: the same values to the last digit on its
    tutorial's regression); without a monitor: None, {}, "" and inf."""
    monitored = {} if mode is None else {"monitor": "val_loss", "mode": mode}
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=top_k, **monitored)
    values = _ValLossAtEachSave()
    trainer, _ = make_trainer(tmp_path, devices=1, max_epochs=3, logger=False, callbacks=[values, checkpoint])
    trainer.fit(Regressor(), _loader(), _loader(8))
    if mode is None:
        assert (checkpoint.best_model_score, checkpoint.best_k_models, checkpoint.kth_best_model_path) == (None, {}, "")
        assert checkpoint.kth_value == torch.tensor(float("inf"))
        return
    by_path = {str(tmp_path / "ckpt" / f"epoch={e}-step={8 * (e + 1)}.ckpt"): v for e, v in enumerate(values.at_epoch)}
    ranked = sorted(by_path, key=by_path.get, reverse=mode == "max")
    kept = ranked if top_k < 0 else ranked[:top_k]
    assert {p: float(v) for p, v in checkpoint.best_k_models.items()} == pytest.approx({p: by_path[p] for p in kept})
    assert checkpoint.best_model_path == kept[0] and float(checkpoint.best_model_score) == pytest.approx(
        by_path[kept[0]]
    )
    assert checkpoint.kth_best_model_path == kept[-1] and float(checkpoint.kth_value) == pytest.approx(
        by_path[kept[-1]]
    )
    assert isinstance(checkpoint.best_model_score, torch.Tensor)


def test_lightnings_ckpt_file_names_resume_and_load_what_was_saved_under_them(tmp_path):
    """Lightning's documentation resumes from ``checkpoints/last.ckpt`` and loads ``epoch=0-step=8.ckpt``: under
    ``distrain.lightning`` those are the checkpoints' own paths (one file each, which ``torch.load`` opens, as
    Lightning's; ``last.ckpt`` a link to the newest), the callback reports them as Lightning's does, and distrain's
    ``last`` finds the newest too. A file of someone else's where the link goes is kept, not replaced."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "last.ckpt").write_bytes(b"a checkpoint Lightning wrote")

    def fit(folder, max_epochs, ckpt_path=None, name_last=None, **options):
        checkpoint = pl.callbacks.ModelCheckpoint(dirpath=str(ckpt), **{"save_last": True, "save_top_k": -1, **options})
        if name_last:
            checkpoint.CHECKPOINT_NAME_LAST = name_last
        trainer, _ = make_trainer(folder, devices=1, max_epochs=max_epochs, logger=False, callbacks=[checkpoint])
        distrain.seed_everything(0)
        module = Regressor()
        trainer.fit(module, DataLoader(_data(), batch_size=4, shuffle=True), ckpt_path=ckpt_path)
        return trainer, module

    with pytest.warns(UserWarning, match=r"last\.ckpt was a file, not a link .* kept as .*last\.ckpt\.copy"):
        trainer, first = fit(tmp_path / "first", 1)
    assert (ckpt / "last.ckpt.copy").read_bytes() == b"a checkpoint Lightning wrote"
    callback = trainer.checkpoint_callback
    assert (callback.best_model_path, callback.last_model_path) == (
        str(ckpt / "epoch=0-step=8.ckpt"),
        str(ckpt / "last.ckpt"),
    )
    assert (
        os.path.isfile(callback.best_model_path)
        and os.path.realpath(callback.last_model_path) == callback.best_model_path
    )
    # common/checkpointing_basic.rst's reading blocks (lines 138, 192, 220), verbatim: a checkpoint is one file, in
    # Lightning's layout, beside distrain's own entries
    CKPT_PATH = checkpoint = callback.best_model_path
    checkpoint = torch.load(checkpoint, map_location=lambda storage, loc: storage)
    assert checkpoint["hyper_parameters"] == dict(first.hparams)
    checkpoint = torch.load(CKPT_PATH)
    assert {"state_dict", "epoch", "global_step", "pytorch-lightning_version", "hyper_parameters"} <= set(checkpoint)
    encoder_weights = {k: v for k, v in checkpoint["state_dict"].items() if k.startswith("net.")}
    assert encoder_weights.keys() == first.state_dict().keys() and (checkpoint["epoch"], checkpoint["global_step"]) == (
        0,
        8,
    )
    for name, value in first.state_dict().items():
        torch.testing.assert_close(encoder_weights[name], value, rtol=0, atol=0)
    for name in ("last.ckpt", "last", "epoch=0-step=8.ckpt", str(ckpt / "epoch=0-step=8.ckpt")):
        loaded = Regressor.load_from_checkpoint(ckpt / name)
        torch.testing.assert_close(loaded.net.weight, first.net.weight, rtol=0, atol=0)
    resumed_trainer, resumed = fit(tmp_path / "resumed", 2, ckpt_path=str(ckpt / "last.ckpt"))
    assert resumed_trainer.global_step == 16
    _, whole = fit(tmp_path / "whole", 2)  # the same two epochs without a stop
    torch.testing.assert_close(resumed.net.weight, whole.net.weight, rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match=r"epoch=7-step=64\.ckpt"):
        Regressor.load_from_checkpoint(ckpt / "epoch=7-step=64.ckpt")
    again, _ = make_trainer(tmp_path / "again", devices=1, max_epochs=3, logger=False)
    with pytest.raises(FileNotFoundError, match=r"checkpoint not found: .*nothing\.ckpt"):
        again.fit(Regressor(), _loader(), ckpt_path=str(ckpt / "nothing.ckpt"))
    # Lightning's class attribute: the link named by the epoch, the one before it removed; without save_last no
    # last_model_path (""), as Lightning's; the same name again is versioned before the extension
    trainer, _ = fit(tmp_path / "by-epoch", 2, name_last="{epoch}-last")
    assert trainer.checkpoint_callback.last_model_path == str(ckpt / "epoch=1-last.ckpt")
    assert not (ckpt / "epoch=0-last.ckpt").exists() and (ckpt / "epoch=1-last.ckpt").is_symlink()
    resumed, _ = fit(tmp_path / "by-epoch-resumed", 3, str(ckpt / "epoch=1-last.ckpt"), name_last="{epoch}-last")
    assert resumed.global_step == 24 and (ckpt / "epoch=2-last.ckpt").is_symlink()
    assert not (ckpt / "epoch=1-last.ckpt").exists()  # the resumed run knew the link its checkpoint had made
    trainer, _ = fit(tmp_path / "no-last", 1, save_last=False)
    assert trainer.checkpoint_callback.last_model_path == ""
    versioned = ckpt / "epoch=0-step=8-v3.ckpt"  # -v1: the whole run's, -v2: by-epoch's
    assert trainer.checkpoint_callback.best_model_path == str(versioned)
    # Lightning's default callback (save_last=None) makes no last.ckpt and has no last_model_path, as Lightning's;
    # distrain's own `last` stays, for ckpt_path="last"
    default = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
        default_root_dir=str(tmp_path / "default"),
    )  # fmt: skip
    default.fit(Regressor(), _loader())
    callback, folder = default.checkpoint_callback, tmp_path / "default" / "checkpoints"
    assert callback.last_model_path == "" and callback.best_model_path == str(folder / "epoch=0-step=8.ckpt")
    assert not (folder / "last.ckpt").exists() and (folder / "last").is_symlink()


def test_checkpoints_after_each_validation_and_by_time(tmp_path):
    from datetime import timedelta

    after_validation = pl.callbacks.ModelCheckpoint(save_on_train_epoch_end=False, save_top_k=-1, save_last=False)
    trainer, _ = make_trainer(
        tmp_path / "v", devices=1, max_epochs=1, val_check_interval=4, logger=False, callbacks=[after_validation]
    )
    trainer.fit(Regressor(), _loader(), _loader(8))
    assert sorted(p.name for p in (tmp_path / "v" / "checkpoints").iterdir()) == [
        "epoch=0-step=4.ckpt",
        "epoch=0-step=8.ckpt",
    ]
    by_time = pl.callbacks.ModelCheckpoint(train_time_interval=timedelta(0), save_top_k=-1, verbose=True)
    trainer, _ = make_trainer(tmp_path / "t", devices=1, max_steps=3, logger=False, callbacks=[by_time])
    trainer.fit(Regressor(), _loader())
    assert {f"epoch=0-step={s}.ckpt" for s in (1, 2, 3)} <= {p.name for p in (tmp_path / "t" / "checkpoints").iterdir()}
    with pytest.raises(ValueError, match="train_time_interval must be a timedelta"):
        pl.callbacks.ModelCheckpoint(train_time_interval=60)


# ---- LightningCLI --------------------------------------------------------------------------------------------------
class CLIData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return _loader(batch_size=self.batch_size)

    def test_dataloader(self):
        return _loader(8, batch_size=self.batch_size)


CLI_SCRIPT = """
import json, os, sys
import torch
sys.path.insert(0, {tests!r})
from distrain.lightning.cli import LightningCLI
from test_lightning_namespace import CLIData, Regressor

cli = LightningCLI(Regressor, CLIData, run=False)
cli.trainer.fit(cli.model, datamodule=cli.datamodule)
with open(os.path.join({out!r}, f"rank{{cli.trainer.global_rank}}.json"), "w") as f:
    json.dump({{"seed": cli.config["seed_everything"], "lr": cli.model.lr}}, f)
"""


def test_lightning_cli_parses_the_command_line_runs_the_subcommand_and_keeps_its_config(tmp_path, capsys):
    from distrain.lightning.cli import LightningCLI

    common = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.enable_progress_bar=false"]
    root = f"--trainer.default_root_dir={tmp_path / 'run'}"
    cli = LightningCLI(Regressor, CLIData, args=["fit", *common, root, "--model.lr=0.2", "--trainer.max_steps=3"])
    assert cli.subcommand == "fit" and cli.model.lr == 0.2 and cli.trainer.global_step == 3
    saved = (tmp_path / "run" / "lightning_logs" / "version_0" / "config.yaml").read_text()  # Lightning's place
    assert "lr: 0.2" in saved and "max_steps: 3" in saved and "seed_everything: " in saved
    # the saved config runs again, and a stage from it evaluates the run's last checkpoint
    config = str(tmp_path / "run" / "lightning_logs" / "version_0" / "config.yaml")
    tested = LightningCLI(Regressor, CLIData, args=["test", "--config", config, "--ckpt_path", "last"])
    assert tested.model.lr == 0.2 and tested.trainer.callback_metrics["test_loss"] >= 0
    with pytest.raises(SystemExit):
        LightningCLI(Regressor, CLIData, args=["fit", "--model.lr=0.3", "--print_config"])
    assert "lr: 0.3" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # jsonargparse's one-line refusal names the key
        LightningCLI(Regressor, CLIData, args=["fit", "--model.learning_rate=0.3"])
    assert "learning_rate" in capsys.readouterr().err


@pytest.mark.slow
def test_lightning_cli_ranks_agree_on_the_random_seed(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "train.py"
    script.write_text(CLI_SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path)))
    args = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp", "--model.lr=0.01"]
    args += ["--trainer.max_steps=2", f"--trainer.default_root_dir={tmp_path / 'run'}"]
    run = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["lr"] == 0.01 and isinstance(ranks[0]["seed"], int)


# ---- Lightning's random streams --------------------------------------------------------------------------------------
class DrawsInFit(pl.LightningModule):
    """Draws as Lightning's users draw inside fit: its data made in the loader hooks, noise and dropout in
    ``training_step``, a shuffled loader (the 2-rank and Lightning-reference runs: tests/test_lightning_examples.py)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x + 0.1 * torch.randn_like(x)), y)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self.net(batch[0]), batch[1]))

    def train_dataloader(self):
        return DataLoader(_data(64, seed=int(torch.randint(100, ()))), batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(_data(16, seed=int(torch.randint(100, ()))), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_lightning_run_resumed_mid_epoch_goes_on_with_the_order_and_streams_it_had(tmp_path):
    """On one process a shuffled epoch's order comes from torch's generator, drawn as ``RandomSampler`` draws it
    (Lightning's order); a run resumed mid-epoch reads on in that order, with the streams its checkpoint saved, and
    draws nothing more at the resume: its losses are the uninterrupted run's."""
    ckpt = tmp_path / "ckpt"

    def fit(folder, ckpt_path=None):
        pl.seed_everything(3)
        module = DrawsInFit()
        every = pl.callbacks.ModelCheckpoint(dirpath=str(ckpt), every_n_train_steps=3, save_top_k=-1)
        trainer = pl.Trainer(
            default_root_dir=str(folder), max_epochs=2, logger=False, enable_progress_bar=False, callbacks=[every]
        )
        trainer.fit(module, ckpt_path=ckpt_path)
        return module.losses

    whole = fit(tmp_path / "whole")
    assert len(whole) == 16
    for step in (3, 9):  # mid-epoch in the first epoch and in the second
        resumed = fit(tmp_path / f"from-{step}", ckpt_path=str(ckpt / f"epoch={step // 8}-step={step}.ckpt"))
        assert resumed == whole[step:], step


# ---- plugins=: precision plugins and cluster environments ------------------------------------------------------------
class _Losses(distrain.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def _fit_losses(tmp_path, **kwargs) -> tuple[pl.Trainer, list[float]]:
    recorder = _Losses()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=4, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        num_sanity_val_steps=0, default_root_dir=str(tmp_path), callbacks=[recorder], **kwargs,
    )  # fmt: skip
    distrain.seed_everything(0)
    trainer.fit(Regressor(), _loader())
    return trainer, recorder.losses


def test_a_precision_plugin_trains_as_its_precision_and_one_overriding_a_hook_is_refused(tmp_path):
    from distrain.lightning.plugins import DoublePrecision, MixedPrecision, Precision

    _, bf16 = _fit_losses(tmp_path / "a", precision="bf16-mixed")
    trainer, plugin = _fit_losses(tmp_path / "b", plugins=[MixedPrecision("bf16-mixed", "cpu")])
    _, fp32 = _fit_losses(tmp_path / "c")
    assert trainer.precision == "bf16-mixed" and plugin == bf16 and plugin != fp32  # bf16's own rounding

    class Declared(Precision):  # the documentation's way: the class attribute, no hook
        precision = "64-true"

    assert pl.Trainer(plugins=[Declared()], logger=False).precision == "64-true"
    assert pl.Trainer(plugins=DoublePrecision(), logger=False).precision == "64-true"

    class ScalesItsOwnLoss(Precision):
        def backward(self, tensor, model, optimizer, *args, **kwargs):
            (tensor * 2).backward()

    with pytest.raises(
        ValueError, match=r"^Trainer\(plugins=\[ScalesItsOwnLoss\(\)\]\): .* never call ScalesItsOwnLoss's backward"
    ):
        pl.Trainer(plugins=[ScalesItsOwnLoss()])
    with pytest.raises(ValueError, match=r"precision='bf16-mixed'.*a precision plugin of '64-true': choose one"):
        pl.Trainer(precision="bf16-mixed", plugins=[DoublePrecision()])
    with pytest.raises(ValueError, match=r"^Trainer\(plugins=\[Regressor\]\): distrain takes a precision plugin"):
        pl.Trainer(plugins=[Regressor()])


def test_a_cluster_environment_that_starts_the_ranks_places_this_one(tmp_path, monkeypatch):
    """Lightning's interface (one leaving an abstract method out cannot be made), its answers as the process group's
    variables when the Trainer is made, and an answer that fails named in one line."""
    from distrain.cluster import find_free_port
    from distrain.lightning.plugins.environments import ClusterEnvironment

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(key, "")  # recorded as absent (or as it was), so that what the plugin sets goes after
        monkeypatch.delenv(key)
    port = find_free_port()

    class Scheduler(ClusterEnvironment):  # a scheduler of the user's that starts one process for the job
        creates_processes_externally = True
        main_address, main_port = "127.0.0.1", port

        @staticmethod
        def detect():
            return True

        def world_size(self):
            return int(os.environ.get("SCHEDULER_TASKS", 1))

        def set_world_size(self, size):
            pass

        def global_rank(self):
            return 0

        def set_global_rank(self, rank):
            pass

        def local_rank(self):
            return 0

        def node_rank(self):
            return 0

    trainer, losses = _fit_losses(tmp_path / "placed", plugins=[Scheduler()])
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == ("0", "1", str(port))
    assert trainer.world_size == 1 and len(losses) == 4
    monkeypatch.setenv("SCHEDULER_TASKS", "two")
    with pytest.raises(ValueError, match=r"^Trainer\(plugins=\[Scheduler\(\)\]\): asked for WORLD_SIZE, it raised "):
        pl.Trainer(plugins=[Scheduler()], logger=False)

    for key in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key)
    from distrain.lightning.plugins.environments import LightningEnvironment, TorchElasticEnvironment

    for own in (LightningEnvironment(), TorchElasticEnvironment()):  # what distrain reads anyway: nothing placed
        pl.Trainer(plugins=[own], logger=False)
        assert "MASTER_PORT" not in os.environ and "MASTER_ADDR" not in os.environ, type(own).__name__

    class Incomplete(ClusterEnvironment):
        creates_processes_externally = True

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


def test_slurm_environment_stops_on_its_signal_and_is_lightnings_default_under_srun(tmp_path, monkeypatch, capsys):
    """``requeue_signal`` stops the run at a step with a checkpoint, as SIGUSR1 does (a job without a SLURM_JOB_ID is
    not requeued, and says so); under srun a Trainer without the plugin behaves as with ``SLURMEnvironment()``."""
    import signal

    from distrain.lightning.plugins.environments import SLURMEnvironment

    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)

    class HangsUp(Regressor):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 2:
                os.kill(os.getpid(), signal.SIGHUP)  # the default action would end the process
            return super().training_step(batch, batch_idx)

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=6, logger=False, enable_progress_bar=False,
        default_root_dir=str(tmp_path), plugins=[SLURMEnvironment(requeue_signal=signal.SIGHUP)],
    )  # fmt: skip
    before = signal.getsignal(signal.SIGHUP)  # the default, or ignored under nohup
    trainer.fit(HangsUp(), _loader())
    assert trainer.preempted == signal.SIGHUP and trainer.global_step == 3
    assert (tmp_path / "checkpoints" / "epoch=0-step=3.ckpt").is_file()
    assert "stopped by signal 1, but SLURM_JOB_ID is None: not requeued" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGHUP) is before  # put back after fit
    assert pl.Trainer(logger=False).slurm is None
    monkeypatch.setenv("SLURM_NTASKS", "1")
    default = pl.Trainer(logger=False).slurm
    assert (default.auto_requeue, default.requeue_signal) == (True, signal.SIGUSR1)
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")  # an allocation's shell: Lightning starts the ranks there
    assert pl.Trainer(logger=False).slurm is None
    for bad, said in ((dict(requeue_signal=signal.SIGKILL), "cannot catch"), (dict(auto_requeue="yes"), "True or")):
        with pytest.raises(ValueError, match=said):
            SLURMEnvironment(**bad)


def test_checkpoints_lightning_wrote_resume_with_lightnings_numbers(tmp_path, monkeypatch):
    """A run from before the move: checkpoints Lightning 2.6.6 itself wrote (``tests/data/lightning_written``: its
    ``make.py`` under Lightning; Adam and a StepLR, whose states are keyed by position there) resume under
    ``distrain.lightning``. Saved at an epoch's end, to the weights Lightning's own resume ends with, to the last bit;
    saved mid-epoch, after the batches it had trained on, to Lightning's uninterrupted run (Lightning's own resume
    starts its loader over, and warns). A counter or an optimizer state that is not one is refused in one line."""
    import importlib.util

    from distrain.checkpoint.io import CheckpointError

    here = Path(__file__).resolve().parent / "data" / "lightning_written"
    monkeypatch.setenv("WRITTEN_BY", "distrain")
    monkeypatch.chdir(tmp_path)  # Lightning's default_root_dir: the working directory
    spec = importlib.util.spec_from_file_location("lightning_written", here / "make.py")
    written = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(written)
    reference = json.loads((here / "reference.json").read_text())

    def resume(checkpoint):
        torch.manual_seed(1)  # another init: everything comes from the checkpoint
        module = written.Regression()
        trainer = written.trainer(None, 2)
        trainer.fit(module, written.loader(), ckpt_path=checkpoint)
        return trainer.global_step, written.weights(module)

    assert resume(here / "epoch_end.ckpt") == (16, reference["resumed"]["epoch_end"]["weights"])
    assert resume(here / "mid_epoch.ckpt") == (16, reference["whole"])
    assert reference["resumed"]["mid_epoch"]["weights"] != reference["whole"]  # Lightning's own resume differs
    loaded = written.Regression.load_from_checkpoint(here / "mid_epoch.ckpt")
    assert loaded.hparams.lr == 0.05
    original = torch.load(here / "mid_epoch.ckpt", weights_only=True)
    for damage, said in (
        (lambda c: c["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"].update(processed=-3), "processed"),
        (lambda c: c["optimizer_states"].append(c["optimizer_states"][0]), "2 optimizer states"),
        (lambda c: c["optimizer_states"][0]["param_groups"][0]["params"].pop(), "group 0, holds 3 parameters"),
        (lambda c: c["optimizer_states"][0]["param_groups"][0]["params"].append([1]), "otherwise than by position"),
        (
            lambda c: c["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"].update(processed=2**40),
            "1099511627776 processed batches exceed this run's epoch of 8",
        ),
    ):
        crafted = copy.deepcopy(original)
        damage(crafted)
        torch.save(crafted, tmp_path / "crafted.ckpt")
        with pytest.raises(CheckpointError, match=rf"crafted\.ckpt \(written by Lightning\): .*{said}"):
            resume(tmp_path / "crafted.ckpt")


# ---- the lines of Lightning's other documentation pages (trainer, training tricks, progress bar, debugging) ----------
def test_lightnings_submodule_paths_import_the_same_names():
    """``from lightning.pytorch.callbacks.early_stopping import EarlyStopping`` and the like (Lightning's API pages
    and most scripts import from the submodule): each submodule path gives its package's name; a name the package
    lacks is refused there, in its one line; ``lightning.fabric`` gives the seed and the cluster environments."""
    namespace: dict = {}
    exec(
        pl.migrate(
            "from lightning.pytorch.callbacks.early_stopping import EarlyStopping\n"
            "from lightning.pytorch.callbacks.progress.tqdm_progress import TQDMProgressBar\n"
            "from lightning.pytorch.trainer.trainer import Trainer\n"
            "from lightning.pytorch.loggers.csv_logs import CSVLogger\n"
            "from lightning.pytorch.strategies.ddp import DDPStrategy\n"
            "from lightning.pytorch.core.module import LightningModule\n"
            "from lightning.pytorch.plugins.precision.amp import MixedPrecision\n"
            "from lightning.fabric.plugins.environments import SLURMEnvironment\n"
            "from lightning.fabric.utilities.seed import seed_everything\n"
            "import lightning.pytorch.callbacks.model_checkpoint\n"
            "Checkpoint = lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint\n"
        ),
        namespace,
    )
    assert namespace["EarlyStopping"] is pl.callbacks.EarlyStopping and namespace["Trainer"] is pl.Trainer
    assert namespace["Checkpoint"] is pl.callbacks.ModelCheckpoint and namespace["CSVLogger"] is pl.loggers.CSVLogger
    assert (
        namespace["TQDMProgressBar"] is pl.callbacks.TQDMProgressBar and namespace["LightningModule"] is distrain.Module
    )
    assert namespace["SLURMEnvironment"] is pl.plugins.environments.SLURMEnvironment
    assert namespace["seed_everything"] is pl.seed_everything
    with pytest.raises(
        ImportError, match=r"^distrain\.lightning\.callbacks\.ModelPruning: distrain has no counterpart"
    ):
        exec(pl.migrate("from lightning.pytorch.callbacks.pruning import ModelPruning"), {})
    with pytest.raises(ImportError, match=r"^distrain\.lightning\.fabric\.Fabric: distrain has no counterpart"):
        exec(pl.migrate("from lightning.fabric import Fabric"), {})


class _Seen(distrain.Callback):
    """The first sample of each training and validation batch, by epoch."""

    def __init__(self):
        self.train: dict[int, list[float]] = {}
        self.val: dict[int, list[float]] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.train.setdefault(trainer.current_epoch, []).append(float(batch[0][0, 0]))

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self.val.setdefault(trainer.current_epoch, []).append(float(batch[0][0, 0]))


def test_overfit_batches_trains_and_validates_on_the_same_first_batches_in_order(tmp_path):
    """Lightning's ``overfit_batches`` (its first page's and its trainer page's line): that many batches of the
    training data, in its own order though its loader shuffles, every epoch; as many of the validation data."""
    seen = _Seen()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=3, overfit_batches=2, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, default_root_dir=str(tmp_path), callbacks=[seen],
    )  # fmt: skip
    trainer.fit(Regressor(), DataLoader(_data(), batch_size=4, shuffle=True), _loader(16))
    first = [float(_data()[i][0][0]) for i in (0, 4)]
    assert seen.train == {0: first, 1: first, 2: first} and trainer.global_step == 6
    assert seen.val == {e: [float(_data(16)[i][0][0]) for i in (0, 4)] for e in range(3)}
    with pytest.raises(ValueError, match=r"^overfit_batches is a number of batches or a fraction in \[0, 1\]"):
        pl.Trainer(overfit_batches=1.5, logger=False)


def test_gradient_clipping_by_value_clamps_each_gradient_element(tmp_path):
    """``gradient_clip_algorithm="value"`` (the training-tricks page): each gradient element clamped to the value
    before the step, as torch's ``clip_grad_value_``; refused under DeepSpeed, whose engine clips by norm."""
    distrain.seed_everything(0)
    module = Regressor(lr=1.0)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, gradient_clip_val=0.5, gradient_clip_algorithm="value",
        logger=False, enable_progress_bar=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(module, _loader())
    by_hand = nn.Linear(4, 1)
    by_hand.load_state_dict({k.removeprefix("net."): v for k, v in before.items()})
    x, y = next(iter(_loader()))
    F.mse_loss(by_hand(x), y).backward()
    assert max(float(p.grad.abs().max()) for p in by_hand.parameters()) > 0.5  # clamping changes this step
    with torch.no_grad():
        for p in by_hand.parameters():
            p -= p.grad.clamp(-0.5, 0.5)
    for name, value in by_hand.state_dict().items():
        torch.testing.assert_close(module.net.state_dict()[name], value, rtol=0, atol=1e-7)
    from distrain.strategies.deepspeed import DeepSpeedStrategy

    with pytest.raises(ValueError, match=r"^gradient_clip_algorithm='value' under DeepSpeed: the engine clips by"):
        DeepSpeedStrategy.clip_gradient_values(None, None, None, 0.5)


class _Normed(Regressor):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))


def test_sync_batchnorm_converts_the_batch_norms_and_is_refused_on_cpu_ranks(tmp_path):
    """``Trainer(sync_batchnorm=True)`` (the trainer page): the model's batch norms become torch's SyncBatchNorm,
    with the same parameters (one process trains as without); on CPU ranks, where torch's SyncBatchNorm raises at its
    first forward, it is refused in one line before any rank starts."""
    losses = {}
    for sync in (False, True):
        distrain.seed_everything(0)
        module, recorder = _Normed(), _Losses()
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=3, sync_batchnorm=sync, logger=False, enable_progress_bar=False,
            enable_checkpointing=False, default_root_dir=str(tmp_path), callbacks=[recorder],
        )  # fmt: skip
        trainer.fit(module, _loader())
        assert isinstance(module.net[1], nn.SyncBatchNorm) == sync
        losses[sync] = recorder.losses
    assert losses[True] == losses[False] and len(losses[True]) == 3
    with pytest.raises(ValueError, match=r"^sync_batchnorm=True on cpu: torch's SyncBatchNorm synchronizes on GPUs"):
        pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", sync_batchnorm=True, logger=False)


def test_a_gradient_accumulation_schedule_and_the_progress_bars_and_model_summary_take_lightnings_arguments(
    tmp_path, capsys
):
    """``GradientAccumulationScheduler(scheduling={...})`` (the gradient-accumulation page) steps as its schedule
    says, and beside ``accumulate_grad_batches`` is Lightning's error; ``TQDMProgressBar(refresh_rate=..., leave=...)``
    and ``ModelSummary(max_depth=-1)`` (the progress-bar and debugging pages) take Lightning's arguments: the summary
    names every layer and the totals; ``enable_autolog_hparams=False`` keeps the hyperparameters out of the logs."""
    schedule = pl.callbacks.GradientAccumulationScheduler(scheduling={1: 2})
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
        default_root_dir=str(tmp_path), callbacks=[schedule, pl.callbacks.ModelSummary(max_depth=-1),
                                                   pl.callbacks.TQDMProgressBar(refresh_rate=0, leave=True)],
    )  # fmt: skip
    trainer.fit(_Normed(), _loader())
    assert trainer.global_step == 8 + 4  # 8 batches an epoch: 1 each in epoch 0, 2 each from epoch 1
    out = capsys.readouterr()
    assert "train:" not in out.err  # refresh_rate=0: no bar
    summary = out.out[out.out.index("  | Name") :].splitlines()
    assert [line.split("|")[1].strip() for line in summary[2:6]] == ["net", "net.0", "net.1", "net.2"]
    assert {"65        Total params", "0         Non-trainable params"} <= set(summary)
    with pytest.raises(ValueError, match=r"You have set `accumulate_grad_batches` and are using the"):
        pl.Trainer(accumulate_grad_batches=2, callbacks=[schedule], logger=False)
    with pytest.raises(IndexError, match="epoch -1 should be an integer >= 0"):
        pl.callbacks.GradientAccumulationScheduler(scheduling={-1: 2})
    for autolog in (True, False):
        folder = tmp_path / f"autolog-{autolog}"
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=1, enable_autolog_hparams=autolog, enable_progress_bar=False,
            enable_checkpointing=False, logger=pl.loggers.CSVLogger(str(folder)), default_root_dir=str(folder),
        )  # fmt: skip
        trainer.fit(_Hyper(), _loader())
        hparams = (Path(trainer.logger.log_dir) / "hparams.yaml").read_text()
        assert ("lr: 0.05" in hparams) == autolog, hparams


class _Hyper(Regressor):
    def __init__(self, lr: float = 0.05):
        super().__init__(lr)
        self.save_hyperparameters()
