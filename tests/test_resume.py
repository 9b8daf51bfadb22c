"""Stop mid-run, resume from `last` ⇒ the same final weights as a run that never stopped."""

from pathlib import Path

import pytest
import torch

import distrain
from distrain.checkpoint.io import CheckpointError
from helpers import TinyGPT, loader, make_trainer, params_of, run_ranks

# 96 samples, per-rank batch 4 × accumulation 2 → 6 steps per epoch on 2 ranks (12 on 1):
# stopping at step 5 and resuming from step 4 crosses mid-epoch state; 9 steps cross an epoch.
TOTAL, CRASH_AT, SAVE_EVERY = 9, 5, 2


class CrashAt(distrain.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise KeyboardInterrupt("simulated crash")


def _run(tmp, strategy, devices, crash: bool, resume: bool):
    callbacks = [distrain.ModelCheckpoint(every_n_train_steps=SAVE_EVERY, save_top_k=-1)]
    if crash:
        callbacks.append(CrashAt(CRASH_AT))
    trainer, rec = make_trainer(
        tmp,
        strategy=strategy,
        devices=devices,
        max_steps=TOTAL,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        callbacks=callbacks,
        logger=False,
    )
    distrain.seed_everything(0)
    module = TinyGPT(dropout=0.1)  # dropout: the RNG streams must be restored too
    try:
        trainer.fit(module, loader(4), ckpt_path="last" if resume else None)
    except KeyboardInterrupt:
        return None
    return params_of(module), rec.losses, trainer.optimizers[0].state_dict()["state"]


def _rank(rank, tmp, crash, resume):
    return _run(tmp, "ddp", 2, crash, resume)


def _assert_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_single_process_is_bit_identical(tmp_path):
    ref, ref_losses, ref_opt = _run(tmp_path / "ref", "single", 1, crash=False, resume=False)
    assert _run(tmp_path / "cut", "single", 1, crash=True, resume=False) is None
    resumed, losses, opt = _run(tmp_path / "cut", "single", 1, crash=False, resume=True)
    _assert_identical(ref, resumed)
    assert losses == ref_losses[-len(losses) :] and len(losses) == TOTAL - 4
    for i in ref_opt:
        _assert_identical(ref_opt[i], opt[i])


@pytest.mark.slow
def test_resume_ddp_is_bit_identical(tmp_path):
    ref = run_ranks(_rank, 2, tmp_path / "ref", False, False)
    assert run_ranks(_rank, 2, tmp_path / "cut", True, False) == [None, None]
    resumed = run_ranks(_rank, 2, tmp_path / "cut", False, True)
    for rank in range(2):
        _assert_identical(ref[rank][0], resumed[rank][0])
        assert resumed[rank][1] == ref[rank][1][-len(resumed[rank][1]) :]


def test_last_is_never_half_written(tmp_path, monkeypatch):
    """A crash while a checkpoint is written leaves `last` pointing at the previous, loadable one."""
    trainer, _ = make_trainer(tmp_path, strategy="single", devices=1, max_steps=2, logger=False)
    distrain.seed_everything(0)
    module = TinyGPT()
    trainer.fit(module, loader(4))
    last = tmp_path / "checkpoints" / "last"
    before = last.resolve()

    def broken_save(obj, f, *a, **k):
        Path(f).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(CheckpointError, match="disk full"):
        trainer.save_checkpoint(tmp_path / "checkpoints" / "broken")
    assert not (tmp_path / "checkpoints" / "broken").exists()
    assert last.resolve() == before
    monkeypatch.undo()
    reloaded = TinyGPT.load_from_checkpoint(str(last))
    _assert_identical(params_of(reloaded), params_of(module))


def test_loading_refuses_pickled_code(tmp_path, capsys):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    bad = tmp_path / "bad"
    bad.mkdir()
    torch.save({"model": Evil()}, bad / "state.pt")
    with pytest.raises(CheckpointError, match="refusing to load.*weights_only=True"):
        TinyGPT.load_from_checkpoint(str(bad))
    assert "pwned" not in capsys.readouterr().out


def _epochs_run(tmp, crash_at, resume, epochs=3):
    callbacks = [distrain.ModelCheckpoint(every_n_epochs=1, save_top_k=-1)]
    if crash_at:
        callbacks.append(CrashAt(crash_at))
    trainer, rec = make_trainer(tmp, strategy="single", devices=1, max_epochs=epochs, callbacks=callbacks, logger=False)
    distrain.seed_everything(0)
    module = TinyGPT(schedule=False)
    opt_sched = module.configure_optimizers
    # an epoch-interval scheduler: stepping it twice at a resumed epoch end would show in the lr
    module.configure_optimizers = lambda: (
        lambda o: {"optimizer": o, "lr_scheduler": torch.optim.lr_scheduler.StepLR(o, 1, 0.5)}
    )(opt_sched())
    try:
        trainer.fit(module, loader(16, n=64), ckpt_path="last" if resume else None)
    except KeyboardInterrupt:
        return None
    return params_of(module), rec.losses, trainer.optimizers[0].param_groups[0]["lr"]


def test_resume_from_an_epoch_end_checkpoint_starts_the_next_epoch(tmp_path):
    ref, ref_losses, ref_lr = _epochs_run(tmp_path / "ref", None, False)
    assert _epochs_run(tmp_path / "cut", 6, False) is None  # 4 steps/epoch: dies in epoch 1, last = end of epoch 0
    params, losses, lr = _epochs_run(tmp_path / "cut", None, True)
    assert len(losses) == 8 and losses == ref_losses[4:]
    assert lr == ref_lr
    _assert_identical(ref, params)
