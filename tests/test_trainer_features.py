"""Loop features on one process (cheap) and the Runtime for hand-written loops (2 ranks)."""

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distrain
from helpers import TinyGPT, loader, make_trainer, params_of, run_ranks


def test_accumulation_schedule_per_epoch(tmp_path):
    trainer, rec = make_trainer(
        tmp_path, strategy="single", devices=1, max_epochs=3, accumulate_grad_batches={0: 1, 1: 2, 2: 4}, logger=False
    )
    trainer.fit(TinyGPT(), loader(8, n=64))  # 8 batches per epoch
    assert trainer.global_step == 8 + 4 + 2


def test_bf16_mixed_on_cpu_trains(tmp_path):
    trainer, rec = make_trainer(
        tmp_path,
        strategy="single",
        devices=1,
        max_steps=15,
        precision="bf16-mixed",
        enable_checkpointing=False,
        logger=False,
    )
    distrain.seed_everything(0)
    trainer.fit(TinyGPT(lr=1e-2, schedule=False), loader(8))
    assert sum(rec.losses[-3:]) < sum(rec.losses[:3]) - 0.3


def test_fp16_mixed_refused_on_cpu():
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        distrain.Trainer(accelerator="cpu", precision="16-mixed")


def test_validate_test_predict_and_load_from_checkpoint(tmp_path):
    trainer, _ = make_trainer(tmp_path, strategy="single", devices=1, max_steps=4, logger=False)
    distrain.seed_everything(0)
    module = TinyGPT(lr=5e-3)
    trainer.fit(module, loader(8))
    restored = TinyGPT.load_from_checkpoint(str(tmp_path / "checkpoints" / "last"))
    assert restored.hparams["lr"] == 5e-3
    val = trainer.validate(module, loader(8, shuffle=False))[0]["val_loss"]
    val2 = make_trainer(tmp_path, strategy="single", devices=1, logger=False)[0].validate(
        restored, loader(8, shuffle=False)
    )[0]["val_loss"]
    assert val == pytest.approx(val2, rel=1e-6)
    preds = trainer.predict(module, loader(8, shuffle=False))
    assert len(preds) == 12 and preds[0].shape == (8, 16)


class PlainRegressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.lin(x), y)


def test_plain_module_with_loss_forward(tmp_path):
    distrain.seed_everything(0)
    x = torch.randn(64, 4)
    data = TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))
    trainer, rec = make_trainer(
        tmp_path, strategy="single", devices=1, max_steps=40, logger=False, enable_checkpointing=False
    )
    trainer.fit(
        distrain.LossModule(PlainRegressor(), learning_rate=0.05), DataLoader(data, batch_size=16, shuffle=True)
    )
    assert rec.losses[-1] < rec.losses[0] / 4
    with pytest.raises(TypeError, match="LossModule"):
        trainer.fit(PlainRegressor(), DataLoader(data))


def _custom_loop(rank, tmp):
    rt = distrain.Runtime(accelerator="cpu", strategy="ddp", devices=2)

    def main(rt):
        torch.manual_seed(rank)  # different init per rank: setup must broadcast rank 0's weights
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = rt.setup(model, opt)
        data = TensorDataset(torch.arange(16.0).view(8, 2).repeat(1, 2), torch.ones(8, 1))
        dl = rt.setup_dataloaders(DataLoader(data, batch_size=2))
        seen = []
        for i, (x, y) in enumerate(dl):
            seen.append(x[:, 0].tolist())
            with rt.no_backward_sync(model, enabled=i % 2 == 0):
                rt.backward(nn.functional.mse_loss(model(x), y))
            if i % 2 == 1:
                rt.clip_gradients(model, opt, 1.0)
                opt.step()
                opt.zero_grad()
        total = rt.all_reduce(torch.tensor(float(len(seen))), op="sum")
        gathered = rt.all_gather(torch.tensor([rank]))
        obj = rt.broadcast({"from": rt.global_rank})
        rt.barrier()
        rt.save(f"{tmp}/rt-test-{rt.world_size}", {"model": model, "opt": opt, "step": 3})
        restored = {"model": nn.Linear(4, 1), "step": 0}
        rt.load(f"{tmp}/rt-test-{rt.world_size}", restored, strict=False)
        same = all(torch.equal(a, b) for a, b in zip(restored["model"].parameters(), model.module.parameters()))
        return seen, float(total), gathered.flatten().tolist(), obj, restored["step"], same, params_of(model.module)

    return rt.launch(main)


@pytest.mark.slow
def test_runtime_for_hand_written_loops(tmp_path):
    r0, r1 = run_ranks(_custom_loop, 2, tmp_path)
    assert {tuple(v) for b in r0[0] for v in [b]}.isdisjoint({tuple(v) for v in r1[0]})
    assert r0[1] == r1[1] == 4.0  # 2 batches per rank, summed over ranks
    assert r0[2] == [0, 1] and r1[3] == {"from": 0}
    assert r0[4] == 3 and r0[5] and r1[5]
    for k in r0[6]:
        assert torch.equal(r0[6][k], r1[6][k])  # replicas identical after synced steps


def test_model_checkpoint_keeps_top_k_by_monitored_metric(tmp_path):
    ckpt = distrain.ModelCheckpoint(
        dirpath=str(tmp_path / "ck"),
        filename="{step}-{val_loss:.4f}",
        monitor="val_loss",
        mode="min",
        save_top_k=2,
        every_n_train_steps=2,
    )
    trainer, _ = make_trainer(
        tmp_path, strategy="single", devices=1, max_steps=8, val_check_interval=2, callbacks=[ckpt], logger=False
    )
    distrain.seed_everything(0)
    trainer.fit(TinyGPT(lr=1e-2, schedule=False), loader(8), loader(8, n=32, shuffle=False))
    kept = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name != "last")
    scores = sorted(float(name.split("-")[1]) for name in kept)
    assert len(kept) == 2 and (tmp_path / "ck" / "last").resolve().name.startswith("8-")
    assert ckpt.best_model_path.endswith(f"{scores[0]:.4f}")
    assert all(float(s) <= scores[1] for s in scores)


def test_init_module_builds_on_device_and_can_skip_init(tmp_path):
    trainer = distrain.Trainer(accelerator="cpu", devices=1, precision="bf16-true", logger=False)
    with trainer.init_module():
        model = nn.Linear(8, 8)
    assert model.weight.dtype == torch.bfloat16 and model.weight.device.type == "cpu"
    torch.manual_seed(0)
    with trainer.init_module():
        reference = nn.Linear(64, 64)
    torch.manual_seed(0)
    with trainer.init_module():
        again = nn.Linear(64, 64)
    assert torch.equal(again.weight, reference.weight)  # the control: same seed, same bf16 draws
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with trainer.init_module(empty_init=True):
        skipped = nn.Linear(64, 64)
    assert skipped.weight.dtype == torch.bfloat16
    assert torch.equal(torch.get_rng_state(), before)  # no initializer drew a random number
    assert not torch.equal(skipped.weight, reference.weight)


def test_ddp_spawn_with_configure_model_returns_weights(tmp_path):
    from test_fsdp import LazyGPT

    trainer, _ = make_trainer(tmp_path, strategy="ddp_spawn", devices=2, max_steps=2, logger=False)
    module = LazyGPT()
    trainer.fit(module, loader(4))
    saved = LazyGPT.load_from_checkpoint(str(tmp_path / "checkpoints" / "last"))
    assert all(torch.equal(v, params_of(module)[k]) for k, v in params_of(saved).items())


def test_ddp_spawn_parent_saves_a_checkpoint_that_resumes(tmp_path):
    """After fit under ddp_spawn the trained run comes back to the parent: it saves (optimizer state
    included), evaluates and resumes from there."""
    trainer, _ = make_trainer(
        tmp_path / "spawn", strategy="ddp_spawn", devices=2, max_steps=3, logger=False, enable_checkpointing=False
    )
    distrain.seed_everything(0)
    module = TinyGPT()
    trainer.fit(module, loader(4))
    trainer.save_checkpoint(tmp_path / "saved")
    state = torch.load(tmp_path / "saved" / "state.pt", weights_only=True)
    assert state["progress"]["global_step"] == 3 and state["optimizers"][0]["state"]
    for k, v in module.state_dict().items():
        assert torch.equal(state["model"][k], v), k
    resumed, rec = make_trainer(tmp_path / "resume", strategy="single", devices=1, max_steps=5, logger=False)
    resumed.fit(TinyGPT(), loader(8), ckpt_path=str(tmp_path / "saved"))
    assert resumed.global_step == 5 and len(rec.losses) == 2


class _RestoredCheckpointState(distrain.Callback):
    """What each ModelCheckpoint holds once a resume has read the checkpoint (before the first new step)."""

    def __init__(self, *watched):
        self.watched, self.seen = watched, []

    def on_fit_start(self, trainer, module):
        self.seen = [[(score, Path(path).name) for score, path in cb.saved] for cb in self.watched]


def _two_checkpoints(root):
    by_val = distrain.ModelCheckpoint(
        dirpath=str(root / "by_val"), filename="val-{step}", monitor="val_loss", save_top_k=2, every_n_train_steps=2
    )
    newest = distrain.ModelCheckpoint(
        dirpath=str(root / "newest"), filename="new-{step}", save_top_k=3, every_n_train_steps=2
    )
    return by_val, newest


def test_two_model_checkpoints_keep_their_own_state_across_a_resume(tmp_path):
    """Lightning's key (``ModelCheckpoint{'monitor': ...}``): two checkpoint callbacks that watch different things
    are saved apart, and a resume gives each its own ranking. Under one key the survivor's state went to both,
    and the other's ranking was lost."""
    first = _two_checkpoints(tmp_path)
    assert first[0].state_key != first[1].state_key and "'monitor': 'val_loss'" in first[0].state_key
    kw = dict(strategy="single", devices=1, val_check_interval=2, logger=False)
    trainer, _ = make_trainer(tmp_path, max_steps=4, callbacks=list(first), **kw)
    trainer.fit(TinyGPT(), loader(8), loader(8, n=32, shuffle=False))
    again = _two_checkpoints(tmp_path)
    seen = _RestoredCheckpointState(*again)
    trainer, _ = make_trainer(tmp_path, max_steps=6, callbacks=[*again, seen], **kw)
    trainer.fit(TinyGPT(), loader(8), loader(8, n=32, shuffle=False), ckpt_path=str(tmp_path / "newest" / "last"))
    by_val, newest = seen.seen
    assert by_val and all(name.startswith("val-") for _, name in by_val), by_val
    assert newest and all(name.startswith("new-") for _, name in newest), newest


def test_two_model_checkpoints_alike_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="two ModelCheckpoint callbacks keep their state under one key"):
        make_trainer(tmp_path, callbacks=[distrain.ModelCheckpoint(), distrain.ModelCheckpoint()], logger=False)


def test_a_checkpoint_saved_under_the_class_name_still_resumes_its_ranking(tmp_path):
    """Checkpoints written before the key told instances apart hold ``callbacks["ModelCheckpoint"]``: a run with
    one ModelCheckpoint still takes that state."""
    ckpt, _ = _two_checkpoints(tmp_path)
    kw = dict(strategy="single", devices=1, val_check_interval=2, logger=False)
    trainer, _ = make_trainer(tmp_path, max_steps=4, callbacks=[ckpt], **kw)
    trainer.fit(TinyGPT(), loader(8), loader(8, n=32, shuffle=False))
    last = (tmp_path / "by_val" / "last").resolve()
    state = torch.load(last / "state.pt", weights_only=True)
    state["callbacks"] = {"ModelCheckpoint": state["callbacks"][ckpt.state_key]}
    torch.save(state, last / "state.pt")
    (last / "manifest.json").unlink()  # its recorded size no longer holds; an older checkpoint has none
    again, _ = _two_checkpoints(tmp_path)
    seen = _RestoredCheckpointState(again)
    trainer, _ = make_trainer(tmp_path, max_steps=6, callbacks=[again, seen], **kw)
    trainer.fit(TinyGPT(), loader(8), loader(8, n=32, shuffle=False), ckpt_path=str(last))
    (restored,) = seen.seen
    assert restored and all(name.startswith("val-") for _, name in restored), restored
