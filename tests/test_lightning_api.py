"""Modules written to Lightning 2.x's documented LightningModule / LightningDataModule API run with the import changed.

One ``run_ranks`` call (2 gloo ranks) trains every case under DDP (one under FSDP too); the single-process references
run here. Where the module is deterministic the losses match one process within fp32 rounding.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import distrain as L  # was: import lightning as L
from helpers import env_without_rank, make_trainer, run_ranks

ROOT = Path(__file__).resolve().parents[1]


def regression_data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


# ---- a LightningModule with its own loaders, a loss dict, a per-step scheduler and checkpoint hooks ---------------
class LitRegressor(L.Module):
    def __init__(self, lr: float = 0.1, hidden: int = 8, batch_size: int = 4):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, self.hparams.hidden), nn.Tanh(), nn.Linear(self.hparams.hidden, 1))
        self.restored = None

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=True, sync_dist=True)
        return {"loss": loss, "batch_mean": x.mean()}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    def train_dataloader(self):
        return DataLoader(regression_data(32), batch_size=self.hparams.batch_size)

    def val_dataloader(self):
        return DataLoader(regression_data(16, seed=1), batch_size=self.hparams.batch_size)

    def test_dataloader(self):
        return DataLoader(regression_data(16, seed=2), batch_size=self.hparams.batch_size)

    def predict_dataloader(self):
        return DataLoader(regression_data(8, seed=3), batch_size=self.hparams.batch_size)

    def on_train_epoch_end(self):
        self.log("epochs_done", float(self.current_epoch + 1))  # an epoch value, as in Lightning

    def on_save_checkpoint(self, checkpoint):
        checkpoint["my_counter"] = self.global_step * 10

    def on_load_checkpoint(self, checkpoint):
        self.restored = checkpoint.get("my_counter")


# ---- the same module recording every hook: the order is compared with Lightning's documented pseudo-code ----------
RECORDED = [
    "prepare_data", "setup", "configure_model", "configure_optimizers", "on_fit_start", "on_train_start",
    "on_train_epoch_start", "on_train_batch_start", "training_step", "on_before_zero_grad", "on_before_backward",
    "on_after_backward", "on_before_optimizer_step", "on_train_batch_end", "on_validation_start",
    "on_validation_epoch_start", "on_validation_batch_start", "validation_step", "on_validation_batch_end",
    "on_validation_epoch_end", "on_validation_end", "on_train_epoch_end", "on_train_end", "on_fit_end", "teardown",
]  # fmt: skip


class DoubleRegressor(LitRegressor):
    """Keeps its own loss of each step, with the batch's dtype checked: float64 in 64-true."""

    def __init__(self, batch_size: int):
        super().__init__(batch_size=batch_size)
        self.own_losses = []

    def training_step(self, batch, batch_idx):
        assert batch[0].dtype == torch.float64 and torch.zeros(1).dtype == torch.float64
        out = super().training_step(batch, batch_idx)
        self.own_losses.append(out["loss"].item())
        return out


class HookRecorder(LitRegressor):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls: list[str] = []


def _recording(name):
    def hook(self, *args, **kwargs):
        self.calls.append(f"{name}({args[0]})" if name in ("setup", "teardown") else name)
        return getattr(LitRegressor, name)(self, *args, **kwargs)

    return hook


for _name in RECORDED:
    setattr(HookRecorder, _name, _recording(_name))


class CallbackRecorder(L.Callback):
    """Notes each Lightning callback hook it gets (``cb.`` before the name) in the module's own record of its hooks,
    so the two orders can be read together."""

    def __init__(self, calls: list[str]):
        self.calls = calls


def _callback_recording(name):
    def hook(self, trainer, module, *args):
        self.calls.append(f"cb.{name}({args[0]})" if name in ("setup", "teardown") else f"cb.{name}")

    return hook


#: every hook of Lightning 2.x's Callback but the sanity check's (distrain runs none) and state_dict's pair
LIGHTNING_CALLBACK_HOOKS = ["setup", "teardown", "on_fit_start", "on_fit_end", "on_train_start", "on_train_end"]
LIGHTNING_CALLBACK_HOOKS += ["on_exception", "on_save_checkpoint", "on_load_checkpoint", "on_train_epoch_start"]
LIGHTNING_CALLBACK_HOOKS += ["on_train_epoch_end", "on_train_batch_start", "on_train_batch_end", "on_before_backward"]
LIGHTNING_CALLBACK_HOOKS += ["on_after_backward", "on_before_optimizer_step", "on_before_zero_grad"]
for _stage in ("validation", "test", "predict"):
    for _when in ("start", "epoch_start", "batch_start", "batch_end", "epoch_end", "end"):
        LIGHTNING_CALLBACK_HOOKS.append(f"on_{_stage}_{_when}")
for _name in LIGHTNING_CALLBACK_HOOKS:
    setattr(CallbackRecorder, _name, _callback_recording(_name))


def with_callback_hooks(module_calls: list[str]) -> list[str]:
    """Lightning's order of a callback's hooks among the module's: each just before the module's hook of the same
    name, but ``on_train_epoch_end`` (distrain calls it after the module's: a checkpoint saved there resumes at the
    next epoch); the module's own steps and ``configure_*`` have none."""
    has_hook = {name.split("(")[0] for name in module_calls} & set(LIGHTNING_CALLBACK_HOOKS)
    out = []
    for call in module_calls:
        name = call.split("(")[0]
        if name == "on_train_epoch_end":
            out += [call, f"cb.{call}"]
        else:
            out += [f"cb.{call}", call] if name in has_hook else [call]
    return out


#: the validation score of each epoch: better (lower) by more than 0.01 only at epochs 1 and 5
SCORES = [5.0, 4.0, 4.0, 3.9999, 4.5, 1.0, 1.0]


class ScoredRegressor(LitRegressor):
    """Logs the epoch's score from ``SCORES`` as its validation metric, so when early stopping stops is known."""

    def validation_step(self, batch, batch_idx):
        self.log("val_score", torch.tensor(SCORES[self.current_epoch]), sync_dist=True)


def _stopped_early(tmp, max_epochs: int, **kw):
    L.seed_everything(0)
    stopping = L.EarlyStopping("val_score", patience=2, min_delta=0.01)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer, _ = _fit(
            tmp, ScoredRegressor(batch_size=4), "ddp", 2, max_epochs=max_epochs, callbacks=[stopping], **kw
        )
    return trainer.global_step, trainer.current_epoch, stopping.state_dict(), printed.getvalue()


class NotesTheStep(L.Callback):
    """Adds a key of its own to each checkpoint (Lightning's ``Callback.on_save_checkpoint``) and reads it back on
    resume (``on_load_checkpoint``)."""

    def __init__(self):
        self.loaded = None

    def on_save_checkpoint(self, trainer, module, checkpoint):
        checkpoint["noted"] = {"step": trainer.global_step, "rank": trainer.global_rank}

    def on_load_checkpoint(self, trainer, module, checkpoint):
        self.loaded = checkpoint.get("noted")


def lightning_fit_order(epochs: int, batches: int, val_batches: int) -> list[str]:
    """Lightning's "Hooks" pseudo-code (LightningModule docs), with no sanity check and validation at epoch end:

    fit(): prepare_data (local rank 0), setup("fit"), configure_model, configure_optimizers, on_fit_start,
    on_train_start, fit_loop per epoch, on_train_end, on_fit_end, teardown("fit").
    fit_loop(): on_train_epoch_start; per batch: on_train_batch_start, training_step, on_before_zero_grad,
    on_before_backward, backward, on_after_backward, on_before_optimizer_step, optimizer_step, on_train_batch_end;
    val_loop when due; on_train_epoch_end.
    val_loop(): on_validation_start, on_validation_epoch_start, per batch: on_validation_batch_start,
    validation_step, on_validation_batch_end; on_validation_epoch_end, on_validation_end."""
    calls = ["prepare_data", "setup(fit)", "configure_model", "configure_optimizers", "on_fit_start", "on_train_start"]
    for _ in range(epochs):
        calls.append("on_train_epoch_start")
        for _ in range(batches):
            calls += ["on_train_batch_start", "training_step", "on_before_zero_grad", "on_before_backward"]
            calls += ["on_after_backward", "on_before_optimizer_step", "on_train_batch_end"]
        calls += ["on_validation_start", "on_validation_epoch_start"]
        calls += ["on_validation_batch_start", "validation_step", "on_validation_batch_end"] * val_batches
        calls += ["on_validation_epoch_end", "on_validation_end", "on_train_epoch_end"]
    return calls + ["on_train_end", "on_fit_end", "teardown(fit)"]


# ---- manual optimization: a GAN-like toy with two optimizers, clipping and accumulation by hand --------------------
class ToyGAN(L.Module):
    def __init__(self, lr: float = 0.05, accumulate: int = 2):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Linear(2, 4)
        self.discriminator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.losses: list[tuple[float, float]] = []

    def training_step(self, batch, batch_idx):
        real, noise = batch
        opt_g, opt_d = self.optimizers()
        # the discriminator: every batch, clipped
        fake = self.generator(noise).detach()
        d_loss = F.softplus(-self.discriminator(real)).mean() + F.softplus(self.discriminator(fake)).mean()
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt_d.step()
        opt_d.zero_grad()
        # the generator: gradients accumulated over `accumulate` batches by hand
        g_loss = F.softplus(-self.discriminator(self.generator(noise))).mean()
        self.manual_backward(g_loss / self.hparams.accumulate)
        if (batch_idx + 1) % self.hparams.accumulate == 0:
            opt_g.step()
            opt_g.zero_grad()
            self.lr_schedulers().step()
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, prog_bar=True, sync_dist=True)
        self.losses.append((d_loss.detach().item(), g_loss.detach().item()))

    def configure_optimizers(self):
        opt_g = torch.optim.SGD(self.generator.parameters(), lr=self.hparams.lr)
        opt_d = torch.optim.SGD(self.discriminator.parameters(), lr=self.hparams.lr)
        return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, step_size=1, gamma=0.9)]


def gan_data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(n, 4, generator=g) + 2.0, torch.randn(n, 2, generator=g))


# ---- an LSTM carrying its hidden state across batches, reset at each epoch's end -----------------------------------
class StatefulLSTM(L.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 6, batch_first=True)
        self.head = nn.Linear(6, 1)
        self.hidden = None
        self.resets = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        out, hidden = self.lstm(x, self.hidden)
        self.hidden = tuple(h.detach() for h in hidden)  # carried to the next batch
        return F.mse_loss(self.head(out[:, -1]), y)

    def on_train_epoch_end(self):
        self.hidden = None
        self.resets += 1

    def configure_optimizers(self):
        return [torch.optim.Adam(self.parameters(), lr=0.01)]


def sequence_data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 5, 3, generator=g)
    return TensorDataset(x, x.sum(dim=(1, 2)).unsqueeze(1) / 5)


# ---- a LightningDataModule: prepare_data writes a file once per node, setup(stage) reads it -------------------------
class FileDataModule(L.DataModule):  # was: L.LightningDataModule
    def __init__(self, root: str, batch_size: int = 4):
        super().__init__()
        self.save_hyperparameters(ignore="root")
        self.root = Path(root)
        self.stages: list[str] = []
        self.order: list[str] = []  # its setup and teardown among the callbacks' and the module's (StageRecorder)

    def prepare_data(self):
        self.root.mkdir(parents=True, exist_ok=True)
        torch.save(regression_data(32), self.root / "data.pt")
        with open(self.root / "prepared.log", "a") as f:
            f.write("prepared\n")

    def setup(self, stage):
        self.stages.append(stage)
        self.order.append("setup datamodule")
        data = torch.load(self.root / "data.pt", weights_only=False)
        self.train_set, self.val_set = torch.utils.data.random_split(data, [24, 8], torch.Generator().manual_seed(0))

    def teardown(self, stage):
        self.order.append("teardown datamodule")

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)


class StageRecorder(L.Callback):
    """Each stage's ``setup`` and ``teardown``, as the callback sees them."""

    def __init__(self):
        self.calls: list[str] = []
        self.order: list[str] = []  # shared with an OrderedRegressor and a FileDataModule: who went first

    def setup(self, trainer, module, stage):
        self.calls.append(f"setup {stage}")
        self.order.append("setup callback")

    def teardown(self, trainer, module, stage):
        self.calls.append(f"teardown {stage}")
        self.order.append("teardown callback")


class OrderedRegressor(LitRegressor):
    """Notes its ``setup`` and ``teardown`` in the list it shares with a callback and a datamodule; its ``setup``
    reads ``self.trainer``, as Lightning's docs do (``self.trainer.datamodule`` there)."""

    def __init__(self, **hparams):
        super().__init__(**hparams)
        self.order: list[str] = []

    def setup(self, stage):
        self.order.append(f"setup module of {self.trainer.world_size} ranks")

    def teardown(self, stage):
        self.order.append("teardown module")


class CountingDataModule(L.DataModule):
    """A datamodule with state of its own (Lightning's ``state_dict``/``load_state_dict``): how many training loaders
    it has made, which a resumed run must go on counting from."""

    def __init__(self, batch_size: int = 4):
        super().__init__()
        self.batch_size, self.loaders_made, self.events = batch_size, 0, []

    def setup(self, stage):
        self.events.append(f"setup {stage}")

    def train_dataloader(self):
        self.loaders_made += 1
        self.events.append(f"train_dataloader {self.loaders_made}")
        return DataLoader(regression_data(32), batch_size=self.batch_size)

    def state_dict(self):
        return {"loaders_made": self.loaders_made}

    def load_state_dict(self, state):
        self.events.append(f"load_state_dict {state}")
        self.loaders_made = state["loaders_made"]


# ---- a batch sampler of the user's own, a step without batch_idx, on_train_batch_start returning -1 ---------------
class PairsFirst(Sampler):
    """A batch sampler with torch's BatchSampler signature that sorts each batch's indices (a user's own kind)."""

    def __init__(self, sampler, batch_size, drop_last):
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __iter__(self):
        batch = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.batch_size:
                yield sorted(batch)
                batch = []
        if batch and not self.drop_last:
            yield sorted(batch)

    def __len__(self):
        whole, rest = divmod(len(self.sampler), self.batch_size)
        return whole + (rest > 0 and not self.drop_last)


class ShortEpochs(LitRegressor):
    """``training_step(self, batch)`` with no batch_idx; -1 from on_train_batch_start at ``stop_at`` on ``rank``
    only (Lightning: skip the rest of the epoch) — every rank must skip, or the others would wait in the step."""

    def __init__(self, stop_at: int, rank: int, batch_size: int):
        super().__init__(batch_size=batch_size)
        self.stop_at, self.rank = stop_at, rank
        self.seen: list[int] = []
        self.epoch_ends = 0

    def training_step(self, batch):
        x, y, i = batch
        self.seen.extend(i.tolist())
        return F.mse_loss(self(x), y)

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == self.stop_at and self.global_rank == self.rank:
            return -1
        return None

    def on_train_epoch_end(self):
        self.epoch_ends += 1

    def train_dataloader(self):
        data = TensorDataset(*regression_data(32).tensors, torch.arange(32))  # x, y, the sample's index
        sampler = torch.utils.data.RandomSampler(data)
        return DataLoader(data, batch_sampler=PairsFirst(sampler, self.hparams.batch_size, drop_last=False))


def _short_epochs(tmp, rank_that_stops: int, batch: int):
    L.seed_everything(0)
    module = ShortEpochs(stop_at=3, rank=rank_that_stops, batch_size=batch)
    _, rec = _fit(tmp, module, "ddp", 2 if batch == 4 else 1, max_epochs=2)
    return rec.losses, module.seen, module.global_step, module.epoch_ends


# ---- the runs ------------------------------------------------------------------------------------------------------
# ---- torchmetrics Metrics in self.log, as Lightning's first tutorial logs them ---------------------------------------
def classes_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x[:, :3].argmax(1))


class MetricClassifier(L.Module):
    """A forward()-ed Metric logged per step and per epoch, an update()-d one per validation epoch, and a
    MetricCollection through log_dict; what each step's own batch accuracy was, by hand."""

    def __init__(self):
        super().__init__()
        from torchmetrics import MetricCollection
        from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

        self.net = nn.Linear(4, 3)
        self.train_acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=3, average="micro")
        self.test_metrics = MetricCollection(
            {"acc": MulticlassAccuracy(num_classes=3, average="micro"), "f1": MulticlassF1Score(num_classes=3)},
            prefix="test_",
        )
        self.own_step_accuracy = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.train_acc(logits.argmax(1), y)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=False)
        self.own_step_accuracy.append((logits.argmax(1) == y).float().mean().item())
        return F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_acc.update(self.net(x).argmax(1), y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_metrics.update(self.net(x).argmax(1), y)
        self.log_dict(self.test_metrics)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class StepMetrics(L.Callback):
    def __init__(self):
        self.train_acc = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.train_acc.append(trainer.callback_metrics["train_acc"])


def _metric_objects(tmp, batch):
    """Fit, then the epoch values the ranks reported beside the accuracy of the final weights over the whole
    validation and test sets, computed by hand."""
    from torchmetrics.functional.classification import multiclass_f1_score

    L.seed_everything(0)
    model, steps = MetricClassifier(), StepMetrics()
    train, val, test = classes_data(32, 1), classes_data(16, 2), classes_data(12, 3)
    trainer, recorder = make_trainer(
        tmp, strategy="ddp", devices=2, logger=False, max_epochs=2, callbacks=[steps], enable_checkpointing=False
    )
    trainer.fit(model, DataLoader(train, batch_size=batch), DataLoader(val, batch_size=batch))
    reported_val = trainer.callback_metrics["val_acc"]
    reset = model.val_acc.update_count
    validated = trainer.validate(model, DataLoader(val, batch_size=batch), verbose=False)[0]["val_acc"]
    tested = trainer.test(model, DataLoader(test, batch_size=batch), verbose=False)[0]
    with torch.no_grad():
        val_preds, test_preds = model.net(val.tensors[0]).argmax(1), model.net(test.tensors[0]).argmax(1)
    by_hand = {
        "val_acc": (val_preds == val.tensors[1]).float().mean().item(),
        "test_acc": (test_preds == test.tensors[1]).float().mean().item(),
        "test_f1": multiclass_f1_score(test_preds, test.tensors[1], num_classes=3).item(),
    }
    return (steps.train_acc, model.own_step_accuracy), (reported_val, validated, tested, reset), by_hand


# ---- trainer.save_checkpoint under `if trainer.is_global_zero:` (Lightning's docs' manual save) --------------------
class SavesOnOneRank(LitRegressor):
    """At step 2 only ``saver`` calls save_checkpoint (Lightning's docs: rank 0), at step 3 every rank; what each
    rank's weights were then, and the line a refusal gave."""

    def __init__(self, folder: str, saver: int, **kw):
        super().__init__(**kw)
        self.folder, self.saver = folder, saver
        self.weights_at, self.refused = {}, None

    def on_train_batch_start(self, batch, batch_idx):
        step = self.global_step
        if step in (2, 3) and not self.trainer.strategy.traits.collective_forward:  # DDP's: whole on each rank
            self.weights_at[step] = {k: v.detach().clone() for k, v in self.state_dict().items()}
        if step == 2 and self.global_rank == self.saver:
            try:
                self.trainer.save_checkpoint(f"{self.folder}/alone.ckpt")
            except RuntimeError as e:  # a sharded state: refused, and no collective was entered
                self.refused = str(e)
        if step == 3:
            self.trainer.save_checkpoint(f"{self.folder}/together.ckpt")


def _saved_by_one_rank(tmp, batch, rank):
    from distrain.checkpoint.state import read_model_weights
    from distrain.distributed import arrival

    arrival.WAIT_S = 1.0  # the wait for ranks that never come: short here
    out = {}
    for strategy, saver in (("ddp", 0), ("ddp", 1), ("fsdp", 0)):
        folder = tmp / f"manual-{strategy}-{saver}"
        L.seed_everything(0)
        module = SavesOnOneRank(str(folder), saver, batch_size=batch)
        _fit(folder, module, strategy, 2, max_steps=5)
        saved = {name: folder / f"{name}.ckpt" for name in ("alone", "together") if (folder / f"{name}.ckpt").exists()}
        same = {
            name: all(torch.equal(v, module.weights_at[step][k].cpu()) for k, v in read_model_weights(path).items())
            for name, step in (("alone", 2), ("together", 3))
            if (path := saved.get(name)) is not None and module.weights_at
        }
        files = sorted(name for name, path in saved.items() if path.is_file())  # one file where the state is
        out[f"{strategy}-{saver}"] = (sorted(saved), same, module.refused, module.global_step, files)
    return out


def _fit(tmp, module, strategy, devices, loader=None, ckpt_path=None, **kw):
    kw.setdefault("enable_checkpointing", False)
    trainer, rec = make_trainer(tmp, strategy=strategy, devices=devices, logger=False, **kw)
    if not module.automatic_optimization:  # no "loss" to record: training_step returns nothing
        trainer.callbacks.remove(rec)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, rec


def _final(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _cases(rank, tmp, batch):
    """Every case on this rank (2 ranks: DDP, and FSDP for the regressor); ``batch`` per rank."""
    tmp = Path(tmp)
    out = {}
    # hook order, loss dicts, the module's own loaders (fit(model) with none given), one name on the progress bar
    L.seed_everything(0)
    model = HookRecorder(batch_size=batch)
    trainer, rec = _fit(tmp / "hooks", model, "ddp", 2, max_epochs=2, callbacks=[CallbackRecorder(model.calls)])
    out["hooks"] = (model.calls, rec.losses, dict(trainer.progress_bar_metrics), dict(trainer.callback_metrics))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model.print("hello from", model.global_rank)
    gathered = model.all_gather({"rank": torch.tensor([float(rank)])})["rank"]
    where = (model.global_rank, model.local_rank, str(model.device), model.trainer.is_global_zero, trainer.num_devices)
    out["services"] = (printed.getvalue(), gathered.tolist(), where, model.global_step, model.current_epoch)
    # the same under FSDP
    L.seed_everything(0)
    sharded = LitRegressor(batch_size=batch)
    _, rec = _fit(tmp / "fsdp", sharded, "fsdp", 2, max_epochs=2)
    _, again = _fit(tmp / "fsdp-again", sharded, "fsdp", 2, max_steps=3)  # a second fit: the module sharded already
    out["fsdp"] = (rec.losses, again.losses)
    # in double precision: float64 weights and batches
    L.seed_everything(0)
    module = DoubleRegressor(batch_size=batch)
    _fit(tmp / "fsdp64", module, "fsdp", 2, max_epochs=1, precision="64-true")
    out["fsdp64"] = (module.own_losses, sorted({str(p.dtype) for p in module.parameters()}))
    # on_save_checkpoint / on_load_checkpoint across a resume; hparams back through load_from_checkpoint
    L.seed_everything(0)
    trainer, _ = _fit(
        tmp / "ckpt", LitRegressor(hidden=6, batch_size=batch), "ddp", 2, max_steps=3, enable_checkpointing=True
    )
    resumed = LitRegressor(hidden=6, batch_size=batch)
    again, _ = make_trainer(tmp / "ckpt", strategy="ddp", devices=2, logger=False, max_steps=5)
    again.fit(resumed, ckpt_path="last")
    last = str(again.checkpoints.last_path())
    loaded = LitRegressor.load_from_checkpoint(last) if rank == 0 else None
    out["ckpt"] = (resumed.restored, loaded and (loaded.hparams.hidden, loaded.hparams["lr"], loaded.restored))
    # validate / test / predict with the module's own loaders
    val = again.validate(resumed)
    test = again.test(resumed)
    preds = again.predict(resumed)
    out["eval"] = (val[0]["val_loss"], test[0]["test_loss"], sum(len(p) for p in preds))
    # manual optimization: two optimizers, clipping and accumulation by hand
    L.seed_everything(0)
    gan = ToyGAN()
    _fit(tmp / "gan", gan, "ddp", 2, DataLoader(gan_data(), batch_size=batch), max_epochs=1)
    out["gan"] = (gan.losses, _final(gan), gan.global_step)
    # an LSTM carrying hidden state across batches
    L.seed_everything(0)
    lstm = StatefulLSTM()
    _, rec = _fit(tmp / "lstm", lstm, "ddp", 2, DataLoader(sequence_data(), batch_size=batch), max_epochs=2)
    out["lstm"] = (rec.losses, lstm.resets, lstm.hidden)
    # a DataModule: positionally, then as datamodule= for validate/test/predict
    L.seed_everything(0)
    dm = FileDataModule(str(tmp / "dm"), batch_size=batch)
    model = OrderedRegressor(batch_size=batch)
    stages = StageRecorder()
    dm.order = model.order = stages.order
    evaluating = CallbackRecorder([])
    trainer, rec = _fit(tmp / "dmrun", model, "ddp", 2, dm, max_epochs=1, callbacks=[stages, evaluating])
    evaluating.calls.clear()  # from here: validate, test and predict
    seen = model.trainer
    seen_by_module = (seen.datamodule is dm, len(seen.train_dataloader), seen.sanity_checking)
    trainer.validate(model, datamodule=dm, verbose=False)
    trainer.test(model, dm)  # a datamodule in the loaders' place, as Lightning allows
    rows = sum(len(p) for p in trainer.predict(model, None, dm))  # Lightning's order: dataloaders, datamodule
    prepared = (tmp / "dm" / "prepared.log").read_text().count("prepared")
    out["dm"] = (rec.losses, dm.stages, prepared, rows, seen_by_module)
    out["callback_stages"] = stages.calls
    out["setup_teardown_order"] = stages.order
    out["evaluation_callback_hooks"] = evaluating.calls
    # a datamodule's own state: in the checkpoint, given back on resume after setup and before its loader
    _fit(tmp / "dmstate", LitRegressor(batch_size=batch), "ddp", 2, CountingDataModule(batch), max_steps=3,
         enable_checkpointing=True, callbacks=[NotesTheStep()])  # fmt: skip
    resumed_dm = CountingDataModule(batch)
    note = NotesTheStep()
    again, _ = make_trainer(tmp / "dmstate", strategy="ddp", devices=2, logger=False, max_steps=5, callbacks=[note])
    again.fit(LitRegressor(batch_size=batch), resumed_dm, ckpt_path="last")
    out["callback_checkpoint_note"] = note.loaded
    from distrain.checkpoint.state import read_checkpoint_meta

    kept = read_checkpoint_meta(again.checkpoints.last_path()).get("datamodule")
    out["dm_state"] = (resumed_dm.events, kept, "datamodule" in read_checkpoint_meta(last))
    out["short"] = _short_epochs(tmp / "short", 1, batch)
    # early stopping: in one go, and over a resume that must go on counting
    out["early"] = _stopped_early(tmp / "early", 7)
    leg = _stopped_early(tmp / "early-legs", 3, enable_checkpointing=True)
    out["early_legs"] = (leg, _stopped_early(tmp / "early-legs", 7, enable_checkpointing=True, ckpt_path="last"))
    out["metric_objects"] = _metric_objects(tmp / "metrics", batch)
    out["saved_by_one_rank"] = _saved_by_one_rank(tmp, batch, rank)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lightning")
    return run_ranks(_cases, 2, str(tmp), 4)


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) and a, (a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), (a, b)


def test_hook_order_matches_lightning(two_ranks):
    calls, _, _, _ = two_ranks[0]["hooks"]
    # 32 samples, 4 per rank: 4 steps an epoch; validation: 16 samples, 2 batches a rank
    assert [c for c in calls if not c.startswith("cb.")] == lightning_fit_order(epochs=2, batches=4, val_batches=2)
    assert "prepare_data" not in two_ranks[1]["hooks"][0]  # local rank 0 of the node only


def test_a_callback_gets_every_lightning_hook_of_fit_beside_the_modules(two_ranks):
    """Lightning's docs' first callback overrides ``on_train_start``, which distrain never called on a callback, nor
    ``on_fit_end``, ``on_train_batch_start``, ``on_before_backward``, ``on_before_zero_grad`` or any validation hook
    but ``on_validation_end``: the callback ran without a word."""
    calls, _, _, _ = two_ranks[0]["hooks"]
    assert calls == with_callback_hooks(lightning_fit_order(epochs=2, batches=4, val_batches=2))


def test_a_callback_gets_the_hooks_of_validate_test_and_predict_and_of_checkpoints(two_ranks):
    """The evaluation stages' hooks and the checkpoint pair reach a callback as they reach the module (distrain
    called none of them on a callback; ``on_validation_end`` only inside ``fit``)."""
    expected = []
    for stage, hooks in (("validate", "validation"), ("test", "test"), ("predict", "predict")):
        batch = [f"cb.on_{hooks}_batch_start", f"cb.on_{hooks}_batch_end"]  # 8 samples, 4 a batch, 2 ranks
        expected += [f"cb.setup({stage})", f"cb.on_{hooks}_start", f"cb.on_{hooks}_epoch_start", *batch]
        expected += [f"cb.on_{hooks}_epoch_end", f"cb.on_{hooks}_end", f"cb.teardown({stage})"]
    for rank in (0, 1):
        assert two_ranks[rank]["evaluation_callback_hooks"] == expected
        # the checkpoint of step 3 (rank 0 writes what is not sharded) came back to every rank
        assert two_ranks[rank]["callback_checkpoint_note"] == {"step": 3, "rank": 0}


def test_early_stopping_ends_every_rank_at_the_epoch_its_patience_runs_out_and_a_resume_goes_on_counting(two_ranks):
    """``SCORES`` improve by more than 0.01 at epochs 1 and 5 only: with patience 2 the run stops at the end of epoch
    3 (4 epochs of 4 steps), on both ranks, with no step of epoch 4. A run that stops after epoch 2 and resumes keeps
    the count (1 check without improvement, best 4.0) and stops at the same place; counting afresh, it would find
    3.9999 an improvement on nothing and train all 7 epochs."""
    for rank in (0, 1):
        step, epoch, state, printed = two_ranks[rank]["early"]
        assert (step, epoch) == (16, 4)
        assert state == {"wait_count": 2, "stopped_epoch": 3, "best_score": 4.0, "patience": 2}
        first_leg, resumed = two_ranks[rank]["early_legs"]
        assert first_leg[:3] == (12, 3, {"wait_count": 1, "stopped_epoch": 0, "best_score": 4.0, "patience": 2})
        assert resumed[:3] == (step, epoch, state)
    said = "distrain: EarlyStopping: val_score did not improve in the last 2 checks (best 4): stopping"
    assert said in two_ranks[0]["early"][3] and said in two_ranks[0]["early_legs"][1][3]
    assert "EarlyStopping" not in two_ranks[1]["early"][3]  # said once, by rank 0


def test_loss_dicts_step_schedulers_and_parity_with_one_process(two_ranks, tmp_path):
    calls, losses, bar, metrics = two_ranks[0]["hooks"]
    assert "train_loss" in bar and "loss" not in bar  # one name for the training loss on the progress bar
    assert metrics["epochs_done"] == 2.0  # logged in on_train_epoch_end
    L.seed_everything(0)
    module = LitRegressor(batch_size=8)
    trainer, single = _fit(tmp_path, module, "single", 1, max_epochs=2)
    _close(single.losses, losses)
    # the epoch mean of train_loss (on_epoch=True, sync_dist=True) and the validation loss: the same
    _close(
        [trainer.callback_metrics["train_loss"], trainer.callback_metrics["val_loss"]],
        [metrics["train_loss"], metrics["val_loss"]],
    )
    _close(single.losses, two_ranks[0]["fsdp"][0])  # FSDP too
    _, single_again = _fit(tmp_path / "again", module, "single", 1, max_steps=3)  # and a second fit of the module
    _close(single_again.losses, two_ranks[0]["fsdp"][1])


def test_double_precision_under_fsdp_matches_one_process_in_float64(two_ranks, tmp_path):
    """``precision="64-true"`` (Lightning's, also spelled 64): float64 weights, batches and losses, FSDP on 2 ranks
    as one process to float64's rounding, far below float32's."""
    (first, dtypes), (second, _) = two_ranks[0]["fsdp64"], two_ranks[1]["fsdp64"]
    assert dtypes == ["torch.float64"]
    L.seed_everything(0)
    module = DoubleRegressor(batch_size=8)
    _fit(tmp_path, module, "single", 1, max_epochs=1, precision=64)
    assert module.net[0].weight.dtype == torch.float64 and len(module.own_losses) == len(first) == 4
    mean_of_ranks = [(a + b) / 2 for a, b in zip(first, second)]  # each rank's loss: the mean over its half
    assert max(abs(a - b) for a, b in zip(module.own_losses, mean_of_ranks)) < 1e-12, (module.own_losses, first)


def test_own_batch_sampler_a_step_without_batch_idx_and_a_skipped_epoch_rest(two_ranks, tmp_path):
    """The user's batch sampler is sharded (re-created around distrain's sampler): the ranks see disjoint
    samples, each step the same ones one process sees with twice the batch. -1 from on_train_batch_start on
    rank 1 alone ends the epoch on both ranks after 3 of 4 steps, as -1 on the one process does."""
    (losses, seen0, steps, ends), (_, seen1, _, _) = two_ranks[0]["short"], two_ranks[1]["short"]
    assert (steps, ends) == (6, 2)  # 3 steps in each of 2 epochs
    assert not set(seen0[:12]) & set(seen1[:12]) and len(set(seen0[:12] + seen1[:12])) == 24
    single_losses, single_seen, single_steps, single_ends = _short_epochs(tmp_path, 0, 8)
    assert (single_steps, single_ends) == (6, 2)
    _close(single_losses, losses)
    for step in range(6):  # the same samples in each step
        assert sorted(seen0[4 * step : 4 * step + 4] + seen1[4 * step : 4 * step + 4]) == sorted(
            single_seen[8 * step : 8 * step + 8]
        )


class BatchStarts(ShortEpochs):
    def on_train_batch_start(self, batch, batch_idx):
        self.starts.append((batch_idx, int(batch[2][0])))  # the index given, and the batch's first sample


def test_on_train_batch_start_sees_each_micro_batch_of_an_accumulation_window_once(tmp_path):
    module = BatchStarts(stop_at=-1, rank=0, batch_size=4)
    module.starts = []
    _fit(tmp_path, module, "single", 1, max_epochs=1, accumulate_grad_batches=2)
    firsts = module.seen[::4]  # training_step's batches, in order: 8 of 4 samples
    assert module.starts == list(enumerate(firsts)), (module.starts, firsts)


def test_a_batch_sampler_distrain_cannot_recreate_is_refused_in_one_line():
    class Buckets(Sampler):  # not BatchSampler's signature
        def __init__(self, lengths):
            self.sampler, self.lengths = torch.utils.data.SequentialSampler(lengths), lengths

        def __iter__(self):
            return iter([[0, 1], [2, 3]])

        def __len__(self):
            return 2

    loader = DataLoader(regression_data(4), batch_sampler=Buckets([1, 2, 3, 4]))
    from distrain.data import with_distributed_sampler

    with pytest.raises(
        ValueError, match=r"Buckets\(sampler, batch_size=…, drop_last=…\).*use_distributed_sampler=False"
    ):
        with_distributed_sampler(loader, 2, 0, seed=0)
    assert with_distributed_sampler(loader, 1, 0, seed=0) is loader  # one process: its own order, untouched


def test_a_torchmetrics_metric_is_logged_as_lightning_logs_it(two_ranks):
    """``self.log("val_acc", self.val_acc)``: per step, the value its forward returned on this rank's batch; per
    epoch, its compute() over every rank's samples (its own synchronization), then reset; a MetricCollection through
    log_dict by its prefixed names."""
    for rank_result in two_ranks:
        (step_values, own), (reported_val, validated, tested, reset), by_hand = rank_result["metric_objects"]
        assert len(step_values) == len(own) == 8 and step_values == pytest.approx(own, abs=1e-7)
        assert reset == 0  # reset once the epoch's value was computed
        assert reported_val == validated == pytest.approx(by_hand["val_acc"], abs=1e-7)  # the fit's last validation
        assert tested == pytest.approx({"test_acc": by_hand["test_acc"], "test_f1": by_hand["test_f1"]}, abs=1e-6)
    assert [r["metric_objects"][1][1:3] for r in two_ranks] == [two_ranks[0]["metric_objects"][1][1:3]] * 2
    assert two_ranks[0]["metric_objects"][0][0] != two_ranks[1]["metric_objects"][0][0]  # each rank's own batches


def test_save_checkpoint_on_one_rank_writes_where_the_state_is_whole_and_is_refused_where_it_is_sharded(two_ranks):
    """Lightning's documentation saves by hand under ``if trainer.global_rank == 0:``; gloo aborted the job there
    (Lightning hangs). Under DDP the rank that called writes the checkpoint alone, as the weights were; under FSDP the
    call is refused in one line naming it, and training goes on; a call by every rank is written together. A ``.ckpt``
    name is one file where the state is whole (DDP), as Lightning writes it, and a directory of shards under FSDP."""
    for rank, rank_result in enumerate(two_ranks):
        result = rank_result["saved_by_one_rank"]
        for saver in (0, 1):
            saved, same, refused, steps, files = result[f"ddp-{saver}"]
            assert saved == files == ["alone", "together"] and refused is None and steps == 5
            if rank == 0:  # the weights are rank 0's to compare (each rank holds them the same)
                assert same == {"alone": True, "together": True}
        saved, same, refused, steps, files = result["fsdp-0"]
        assert saved == ["together"] and files == [] and steps == 5  # each rank's shards: a directory
        if rank == 0:
            assert re.fullmatch(
                r"trainer\.save_checkpoint\('.*/alone\.ckpt'\) was called on rank 0 alone \(no other rank called it "
                r"within 1 s\): under FSDPStrategy each rank holds part of the state, so every rank must call it "
                r"\(not under `if trainer\.is_global_zero:`\)",
                refused,
            ), refused
        else:
            assert refused is None


def test_module_services_on_each_rank(two_ranks):
    for rank in (0, 1):
        printed, gathered, where, step, epoch = two_ranks[rank]["services"]
        assert printed == ("hello from 0\n" if rank == 0 else "")  # self.print: global rank 0 only
        assert gathered == [[0.0], [1.0]]  # self.all_gather: every rank's tensor, stacked
        assert where == (rank, rank, "cpu", rank == 0, 2)
        assert (step, epoch) == (8, 2)


class Plateau(LitRegressor):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        # threshold=10: no epoch counts as an improvement, so each epoch's end halves the learning rate
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=10)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}


def test_scheduler_monitoring_a_metric_steps_with_it(tmp_path):
    model = Plateau(batch_size=8)
    trainer, _ = _fit(tmp_path, model, "single", 1, max_epochs=2)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)


def test_checkpoint_hooks_and_hparams_survive(two_ranks):
    restored, loaded = two_ranks[0]["ckpt"]
    assert restored == 30  # on_save_checkpoint at step 3, given back by on_load_checkpoint on resume
    assert loaded == (6, 0.1, 50)  # load_from_checkpoint: hparams (attribute and key), then on_load_checkpoint
    val, test, preds = two_ranks[0]["eval"]
    assert val > 0 and test > 0 and preds == 4  # 8 predict samples over 2 ranks


def test_manual_optimization_two_optimizers_matches_one_process(two_ranks, tmp_path):
    L.seed_everything(0)
    gan = ToyGAN()
    _fit(tmp_path, gan, "single", 1, DataLoader(gan_data(), batch_size=8), max_epochs=1)
    ddp_losses, ddp_weights, steps = two_ranks[0]["gan"]
    assert len(ddp_losses) == len(gan.losses) == 4
    assert steps == gan.global_step == 6  # as in Lightning: every optimizer's step counts (4 + 2)
    for k, v in _final(gan).items():  # the same weights after 4 discriminator and 2 generator steps
        torch.testing.assert_close(ddp_weights[k], v, rtol=1e-5, atol=1e-6)
    assert two_ranks[1]["gan"][1].keys() == ddp_weights.keys()


def test_lstm_hidden_state_across_batches_matches_one_process(two_ranks, tmp_path):
    L.seed_everything(0)
    lstm = StatefulLSTM()
    _, single = _fit(tmp_path, lstm, "single", 1, DataLoader(sequence_data(), batch_size=8), max_epochs=2)
    losses, resets, hidden = two_ranks[0]["lstm"]
    _close(single.losses, losses)
    assert resets == 2 and hidden is None


def test_datamodule_prepares_once_per_node_and_sets_up_every_rank(two_ranks):
    for rank in (0, 1):
        losses, stages, prepared, rows, seen_by_module = two_ranks[rank]["dm"]
        assert seen_by_module == (True, 3, False)  # self.trainer.datamodule, .train_dataloader, .sanity_checking
        assert stages == ["fit", "validate", "test", "predict"]
        assert len(losses) == 3 and rows == 4  # 24 training samples, 4 per rank; 8 to predict, 4 per rank
    assert two_ranks[0]["dm"][2] == 4  # prepare_data: on local rank 0 only, once per stage


def test_a_callback_is_torn_down_after_every_stage_it_was_set_up_for(two_ranks):
    """Lightning calls a callback's ``teardown(stage)`` after fit, validate, test and predict alike; distrain called
    it after fit only, so what a callback opened in ``setup("validate")`` stayed open."""
    stages = ["fit", "validate", "test", "predict"]
    for rank in (0, 1):
        assert two_ranks[rank]["callback_stages"] == [f"{hook} {s}" for s in stages for hook in ("setup", "teardown")]


def test_setup_and_teardown_go_datamodule_callbacks_module_and_setup_sees_the_trainer(two_ranks):
    """Lightning's order in every stage, both ways: the datamodule, the callbacks, then the module. distrain set the
    callbacks up after the module, tore the datamodule down last, and a module's ``setup`` that read ``self.trainer``
    failed ("not attached to a Trainer")."""
    each_stage = ["setup datamodule", "setup callback", "setup module of 2 ranks"]
    each_stage += ["teardown datamodule", "teardown callback", "teardown module"]
    for rank in (0, 1):
        assert two_ranks[rank]["setup_teardown_order"] == each_stage * 4  # fit, validate, test, predict


def test_a_datamodules_own_state_is_kept_and_given_back_before_its_loader_on_resume(two_ranks):
    """Lightning's ``DataModule.state_dict`` goes into the checkpoint; a resumed run's fresh datamodule gets it in
    ``load_state_dict`` after ``setup("fit")`` and before ``train_dataloader()``, on every rank (distrain used to call
    neither). A datamodule without state (the regressor's own loaders) adds nothing to a checkpoint."""
    for rank in (0, 1):
        events, kept, without_datamodule = two_ranks[rank]["dm_state"]
        assert events == ["setup fit", "load_state_dict {'loaders_made': 1}", "train_dataloader 2"], rank
        assert kept == {"loaders_made": 2} and without_datamodule is False


# ---- what is not supported: refused before any rank starts, in one line -------------------------------------------
class MovesItsOwnBatches(LitRegressor):
    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return batch


def test_unsupported_lightning_hook_is_refused_in_one_line(tmp_path):
    trainer, _ = make_trainer(tmp_path, strategy="single", devices=1, max_steps=1, logger=False)
    with pytest.raises(NotImplementedError) as err:
        trainer.fit(MovesItsOwnBatches())
    message = str(err.value)
    assert "\n" not in message and "MovesItsOwnBatches.transfer_batch_to_device" in message
    assert "collate_fn" in message


def test_manual_optimization_refusals(tmp_path):
    trainer, _ = make_trainer(tmp_path, strategy="single", devices=1, max_steps=1, accumulate_grad_batches=2)
    with pytest.raises(ValueError, match="accumulate by hand"):
        trainer.fit(ToyGAN(), DataLoader(gan_data(), batch_size=4))
    trainer, _ = make_trainer(tmp_path, strategy="single", devices=1, max_steps=1, gradient_clip_val=1.0)
    with pytest.raises(ValueError, match="self.clip_gradients"):
        trainer.fit(ToyGAN(), DataLoader(gan_data(), batch_size=4))
    trainer, _ = make_trainer(tmp_path, strategy="fsdp", devices=2, max_steps=1)
    with pytest.raises(NotImplementedError, match="automatic_optimization=False is not supported with FSDP"):
        trainer.fit(ToyGAN(), DataLoader(gan_data(), batch_size=4))


def test_several_validation_loaders_are_refused_in_one_line(tmp_path):
    class TwoValLoaders(LitRegressor):
        def val_dataloader(self):
            return [super().val_dataloader(), super().val_dataloader()]

    trainer, _ = make_trainer(tmp_path, strategy="single", devices=1, max_steps=1, logger=False)
    with pytest.raises(ValueError, match=r"val_dataloader: 2 loaders given; distrain reads one per stage") as err:
        trainer.fit(TwoValLoaders())
    assert "\n" not in str(err.value)


def test_several_optimizers_need_manual_optimization(tmp_path):
    class TwoOptimizers(LitRegressor):
        def configure_optimizers(self):
            return [
                torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                torch.optim.SGD(self.net[2].parameters(), lr=0.1),
            ]

    trainer, _ = make_trainer(tmp_path, strategy="single", devices=1, max_steps=1, logger=False)
    with pytest.raises(ValueError, match="several need manual optimization"):
        trainer.fit(TwoOptimizers())


def test_a_search_when_fit_starts_leaves_a_fit_as_a_fresh_one_at_the_suggested_rate(tmp_path):
    """``LearningRateFinder`` under distrain.Trainer: the search's steps (past two epoch ends) leave nothing behind,
    neither weights, optimizer, the module's StepLR, progress, random streams nor logged values, so the fit logs the
    losses of a fresh fit of the same module at the suggested rate, which the module's ``hparams.lr`` holds."""
    from distrain.callbacks import LearningRateFinder

    class WritesToItsExperiment(
        LitRegressor
    ):  # TensorBoard's writer in the fit, a logger that keeps nothing in the search
        def training_step(self, batch, batch_idx):
            self.logger.experiment.add_scalar("batch", float(batch_idx), self.global_step)
            return super().training_step(batch, batch_idx)

    finder = LearningRateFinder(min_lr=1e-4, max_lr=1.0, num_training_steps=20, early_stop_threshold=None)
    trainer, searched = make_trainer(tmp_path / "s", strategy="single", devices=1, max_steps=10, callbacks=[finder])
    model = WritesToItsExperiment()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.fit(model)
    lrs = finder.optimal_lr.results["lr"]
    assert len(lrs) == len(finder.optimal_lr.results["loss"]) == 20
    assert lrs[0] == 1e-4 and lrs[-1] == pytest.approx(1.0) and lrs == sorted(lrs)
    suggested = finder.optimal_lr.suggestion()
    assert model.hparams.lr == suggested and 1e-4 < suggested < 1.0
    fresh, unsearched = make_trainer(tmp_path / "f", strategy="single", devices=1, max_steps=10)
    unsearched_model = WritesToItsExperiment()
    unsearched_model.hparams.lr = suggested
    unsearched_model.load_state_dict(initial)
    fresh.fit(unsearched_model)
    assert searched.losses == unsearched.losses and len(searched.losses) == 10
    assert trainer.callback_metrics["val_loss"] == fresh.callback_metrics["val_loss"]
    # the search logged nothing: the run's loggers hold the fit's steps, as the unsearched run's do
    rows = [_loss_rows(Path(t.log_dir) / "metrics.jsonl") for t in (trainer, fresh)]
    assert rows[0] == rows[1] and [step for step, _ in rows[0]] == list(range(1, 11))


def test_a_fit_resumed_with_the_finder_goes_on_as_the_uninterrupted_one(tmp_path, capsys):
    """A resumed fit does not search again: its checkpoint holds the rate the first search set (and the scheduler's
    moves since), and it ends on the weights of the fit never interrupted, bit for bit."""
    from distrain.callbacks import LearningRateFinder

    def fit(folder, max_steps, ckpt_path=None):
        finder = LearningRateFinder(min_lr=1e-4, max_lr=1.0, num_training_steps=20, early_stop_threshold=None)
        trainer, _ = make_trainer(
            tmp_path / folder, strategy="single", devices=1, max_steps=max_steps, callbacks=[finder], logger=False
        )
        torch.manual_seed(0)
        model = LitRegressor()
        trainer.fit(model, ckpt_path=ckpt_path)
        return _final(model)

    whole = fit("whole", 10)
    fit("legs", 6)
    assert "lr_find skipped" not in capsys.readouterr().out
    resumed = fit("legs", 10, ckpt_path="last")
    assert "lr_find skipped: this fit goes on from step 6" in capsys.readouterr().out
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)


def _loss_rows(metrics: Path) -> list[tuple[int, float]]:
    import json

    records = map(json.loads, metrics.read_text().splitlines())
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def test_lr_find_refusals_each_in_one_line(tmp_path):
    from distrain.callbacks import LearningRateFinder
    from distrain.tuner import Tuner

    class NoRate(LitRegressor):
        def __init__(self):
            super().__init__()
            self.hparams.pop("lr")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer, _ = make_trainer(tmp_path, strategy="single", devices=1, max_steps=1, logger=False)
    with pytest.raises(AttributeError, match=r"should have one of these fields: \('lr', 'learning_rate'\)"):
        Tuner(trainer).lr_find(NoRate(), num_training=3)
    with pytest.raises(AttributeError, match="set to rate, but could not find"):
        Tuner(trainer).lr_find(LitRegressor(), num_training=3, attr_name="rate")
    assert Tuner(trainer).lr_find(NoRate(), num_training=3, update_attr=False).results["lr"][0] == 1e-8
    with pytest.raises(ValueError, match="automatic optimization"):
        Tuner(trainer).lr_find(ToyGAN(), DataLoader(gan_data(), batch_size=4), num_training=3, update_attr=False)
    with pytest.raises(ValueError, match="`mode` should be either of"):
        LearningRateFinder(mode="cubic")
    with pytest.raises(NotImplementedError, match="distrain plan"):
        Tuner(trainer).scale_batch_size(LitRegressor())
    searching, _ = make_trainer(tmp_path, strategy="single", devices=1, callbacks=[LearningRateFinder()])
    with pytest.raises(ValueError, match="already configured with a `LearningRateFinder`"):
        Tuner(searching).lr_find(LitRegressor())
    smoke, _ = make_trainer(tmp_path, strategy="single", devices=1, fast_dev_run=True)
    with pytest.warns(UserWarning, match="Skipping learning rate finder since `fast_dev_run` is enabled"):
        assert Tuner(smoke).lr_find(LitRegressor()) is None
    spawned, _ = make_trainer(tmp_path, strategy="ddp_spawn", devices=2, max_steps=1)
    with pytest.raises(ValueError, match="lr_find with ranks spawned or forked from this process"):
        Tuner(spawned).lr_find(LitRegressor())


def test_hparams_read_as_attributes_and_keys():
    model = LitRegressor(lr=0.3)
    assert model.hparams.lr == model.hparams["lr"] == 0.3 and model.hparams.hidden == 8
    with pytest.raises(AttributeError, match="hparams has no 'missing'"):
        _ = model.hparams.missing

    class Partial(L.Module):
        def __init__(self, a: int = 1, b: int = 2, net: nn.Module | None = None):
            super().__init__()
            self.save_hyperparameters(ignore=["net"])

    assert dict(Partial(a=5).hparams) == {"a": 5, "b": 2}
    assert model.device == torch.device("cpu") and model.global_step == 0 and model.current_epoch == 0
    model.freeze()
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert dict(FileDataModule("unused", batch_size=2).hparams) == {"batch_size": 2}


@pytest.mark.parametrize(
    "form",
    ["optimizer", "list", "lists", "dict", "dict_monitor", "list_of_dicts"],
)
def test_configure_optimizers_forms(form):
    from distrain.training.optimizers import parse_optimizers

    p = nn.Linear(2, 2)
    opt = torch.optim.SGD(p.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    conf = {
        "optimizer": opt,
        "list": [opt],
        "lists": ([opt], [sched]),
        "dict": {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 2}},
        "dict_monitor": {"optimizer": opt, "lr_scheduler": sched, "monitor": "val_loss"},
        "list_of_dicts": [{"optimizer": opt, "lr_scheduler": sched}],
    }[form]
    optimizers, schedulers = parse_optimizers(conf)
    assert optimizers == [opt]
    if form == "dict":
        assert schedulers[0]["interval"] == "step" and schedulers[0]["frequency"] == 2
    if form == "dict_monitor":
        assert schedulers[0]["monitor"] == "val_loss" and schedulers[0]["interval"] == "epoch"


def test_example_runs_and_two_runs_log_the_same_losses(tmp_path):
    """examples/lightning_style.py on 2 CPU ranks, twice (side by side): seed_everything before the model is built
    makes the runs' losses identical."""
    script = str(ROOT / "examples" / "lightning_style.py")
    runs = [
        subprocess.Popen(
            [sys.executable, script, "--root", str(tmp_path / run)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env_without_rank(),
            cwd=tmp_path,
        )
        for run in ("a", "b")
    ]
    outputs = []
    for proc in runs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        outputs.append([line for line in stdout.splitlines() if re.match(r"step \d+ epoch \d+ loss |val_loss ", line)])
    assert len(outputs[0]) == 7  # 6 steps (self.print: rank 0 only), then the validation loss
    assert outputs[0] == outputs[1]
    assert os.path.isdir(tmp_path / "a")
