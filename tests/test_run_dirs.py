"""Runs never clobber each other, and the console says how a run went: ``distrain train`` refuses a folder that holds
an earlier run unless --resume or --overwrite, the Trainer takes Lightning's ``version_N`` folders, and a finished run
ends with a summary of its numbers and files. In-process (``cli.main``, the Trainer), tiny runs."""

import json
import re
from pathlib import Path

import pytest

import distrain
from distrain import cli, run_dir
from helpers import TinyGPT, loader, make_trainer

# a Module of your own: no memory plan to wait for (the built-in GPT's takes seconds); the folder is the same
MODULE = """
from helpers import TinyGPT, loader


class Tiny(TinyGPT):
    def train_dataloader(self):
        return loader(4, n=16)

    def val_dataloader(self):
        return loader(4, n=4, shuffle=False)
"""
TINY = [
    "--strategy", "single", "--devices", "1", "--accelerator", "cpu", "logging.log_every_n_steps=1",
    "logging.progress_bar=false", "training.val_check_interval=1",
]  # fmt: skip


def _train(capsys, out: Path, *args: str) -> tuple[int, str, str]:
    module = out.parent / "tiny.py"
    module.write_text(MODULE)
    code = cli.main(["train", "--output-dir", str(out), *TINY, f"training.module={module}:Tiny", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _steps(run: Path) -> list[int]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if "loss" in r]


def test_a_run_ends_with_its_summary_and_a_second_one_there_is_refused_overwritten_or_resumed(tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, _ = _train(capsys, out, "--max-steps", "2")
    assert code == 0
    lines = stdout.splitlines()
    assert "step 1/2 | val_loss " in stdout and "step 2/2 | val_loss " in stdout  # validation reaches the console
    assert [line.split(" | ")[1].split()[0] for line in lines if line.startswith("step ")] == ["loss", "val_loss"] * 2
    end = lines.index(next(line for line in lines if line.startswith("distrain: done at step 2 in ")))
    summary = r"distrain: done at step 2 in \d+\.\d s: loss \d\.\d+, val_loss \d\.\d+, [\d,]+ tokens/s"
    assert re.fullmatch(summary, lines[end]), lines[end]
    assert lines[end + 1 :] == [
        f"  checkpoint   {out}/checkpoints/epoch=0-step=2",
        f"  plot         {out}/plots/summary.png",
        f"  tensorboard  tensorboard --logdir {out}/tensorboard",
    ]
    assert (out / "plots" / "summary.png").is_file() and len(list((out / "tensorboard").iterdir())) == 1

    # the same command again: one line, and the earlier run untouched
    metrics = (out / "metrics.jsonl").read_bytes()
    code, stdout, stderr = _train(capsys, out, "--max-steps", "2")
    assert code == 2 and not stdout
    assert stderr == (
        f"distrain: error: {out} holds an earlier run (checkpoints/, config.yaml, logs/, metrics.jsonl, plots/, "
        "tensorboard/): --resume last goes on with it, --overwrite removes it, or give another --output-dir\n"
    )
    assert (out / "metrics.jsonl").read_bytes() == metrics and len(list((out / "tensorboard").iterdir())) == 1

    # --overwrite says what it removes, and removes that only
    (out / "notes.txt").write_text("mine")
    code, stdout, _ = _train(capsys, out, "--max-steps", "1", "--overwrite", "logging.plot_summary=false")
    assert code == 0
    assert stdout.splitlines()[0] == (
        "distrain: --overwrite: removing the earlier run's checkpoints/, config.yaml, logs/, metrics.jsonl, plots/, "
        f"tensorboard/ from {out}"
    )
    assert (out / "notes.txt").read_text() == "mine" and not (out / "plots").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # what it moved aside is gone too
    assert _steps(out) == [1] and sorted(p.name for p in (out / "checkpoints").iterdir()) == ["epoch=0-step=1", "last"]
    run_dir.claim(out, "last", False, None)  # --resume goes on with it (tests/test_cli.py trains on)


def test_what_a_folder_holds_decides(tmp_path, capsys):
    """A failed start's config and logs are no run (they stay); checkpoints in a checkpoint folder of the run's own
    are; --resume with --overwrite is refused; --overwrite takes only checkpoints from such a folder."""
    out, elsewhere = tmp_path / "run", tmp_path / "ckpts"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "rank_0.log").write_text("a start that failed\n")
    (out / "config.yaml").write_text("{}\n")
    run_dir.claim(out, None, False, None)  # goes on: the next start appends to those logs
    (elsewhere / "epoch=0-step=4").mkdir(parents=True)
    (elsewhere / "epoch=0-step=4" / "state.pt").write_bytes(b"x")
    (elsewhere / "last").symlink_to("epoch=0-step=4")
    (elsewhere / "README").write_text("not a checkpoint")
    with pytest.raises(FileExistsError, match=f"{elsewhere}/epoch=0-step=4/, {elsewhere}/last"):
        run_dir.claim(out, None, False, str(elsewhere))
    with pytest.raises(FileExistsError, match="--resume auto and --overwrite: choose one"):
        run_dir.claim(out, "auto", True, str(elsewhere))
    run_dir.claim(out, None, True, str(elsewhere))
    assert sorted(p.name for p in elsewhere.iterdir()) == ["README"] and (out / "logs" / "rank_0.log").is_file()


class LogsItsLoss(TinyGPT):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, prog_bar=True)
        return loss


def _fit(root: Path, steps: int, ckpt_path=None) -> distrain.Trainer:
    trainer, _ = make_trainer(root, strategy="single", devices=1, max_steps=steps, val_check_interval=steps)
    trainer.fit(LogsItsLoss(), loader(4), loader(4, n=8, shuffle=False), ckpt_path=ckpt_path)
    return trainer


def test_the_trainer_takes_a_version_folder_and_a_resume_goes_on_in_its_run(tmp_path, capsys):
    """As Lightning's version_N: a notebook cell run again writes beside the earlier run, never over it."""
    assert _fit(tmp_path, 2).log_dir == str(tmp_path)
    stdout = capsys.readouterr().out
    # the training loss has one name on the console: the module's own (prog_bar) replaces distrain's `loss`
    assert "step 2/2 | train_loss " in stdout and " | loss " not in stdout, stdout
    summary = r"distrain: done at step 2 in [\d.]+ s: train_loss [\d.]+, val_loss [\d.]+, [\d,]+ tokens/s$"
    assert re.search(summary, stdout, re.M), stdout
    assert f"  checkpoint   {tmp_path}/checkpoints/epoch=0-step=2" in stdout.splitlines()
    again = _fit(tmp_path, 2)
    assert again.log_dir == str(tmp_path / "version_1")
    assert f"  checkpoint   {tmp_path}/version_1/checkpoints/epoch=0-step=2" in capsys.readouterr().out.splitlines()
    assert _steps(tmp_path) == [1, 2] and _steps(tmp_path / "version_1") == [1, 2]
    resumed = _fit(tmp_path, 3, ckpt_path="last")  # the newest run goes on
    assert resumed.log_dir == str(tmp_path / "version_1") and _steps(tmp_path / "version_1") == [1, 2, 3]
    first = str(tmp_path / "checkpoints" / "epoch=0-step=2")
    assert _fit(tmp_path, 3, ckpt_path=first).log_dir == str(tmp_path)  # a checkpoint goes on in its own run
    assert _steps(tmp_path) == [1, 2, 3]
    assert _fit(tmp_path, 1).log_dir == str(tmp_path / "version_2")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("version_")) == ["version_1", "version_2"]


def test_one_default_folder_for_the_cli_and_the_trainer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.train_parser().get_default("output_dir") is None  # the config's default applies
    from distrain.config import RunConfig

    assert RunConfig().output_dir == run_dir.DEFAULT == "runs/distrain"
    trainer = distrain.Trainer(accelerator="cpu", strategy="single", devices=1)
    assert trainer.default_root_dir == trainer.log_dir == str(tmp_path / run_dir.DEFAULT)


def test_a_resume_into_a_model_of_other_shapes_is_refused_before_the_plan_naming_the_parameters(tmp_path, capsys):
    """``--resume`` with keys that change the model's shapes (the experts, the sequence length that sizes the
    position embedding): one line naming the parameters, before the plan and any rank, the run's files untouched;
    the same from a sharded (DCP) checkpoint, whose metadata alone is read. The config that wrote it resumes."""
    import torch.distributed.checkpoint as dcp

    from distrain.checkpoint.state import read_model_weights, saved_model_shapes

    out = tmp_path / "run"
    gpt = ["--output-dir", str(out), *TINY, "--model-name", "gpt-tiny", "data.max_bytes=20000"]
    gpt += ["training.batch_size_per_gpu=2", "training.limit_val_batches=1", "checkpointing.export_hf=false"]
    mixture = ["data.seq_len=16", "training.n_experts=2", "training.top_k=1"]
    assert cli.main(["train", *gpt, *mixture, "--max-steps", "1"]) == 0
    capsys.readouterr()
    files = {p: p.read_bytes() for p in (out / "config.yaml", out / "metrics.jsonl")}
    logs = sorted((out / "logs").iterdir())

    sharded = tmp_path / "sharded"  # the same weights as a DCP checkpoint (what FSDP and tensor parallelism write)
    dcp.save({"model": read_model_weights(out / "checkpoints" / "last")}, checkpoint_id=str(sharded))
    assert saved_model_shapes(sharded) == saved_model_shapes(out / "checkpoints" / "last")
    cases = [
        ("last", ["training.n_experts=4"], "other shapes: gpt.blocks.0.mlp.router.weight (2, 128) in the checkpoint, "
         "(4, 128) here"),
        ("auto", ["training.n_experts=0"], "missing: gpt.blocks.0.mlp.fc.weight"),
        ("last", ["data.seq_len=32"], "other shapes: gpt.pos_emb.weight (16, 128) in the checkpoint, (32, 128) here"),
        (str(sharded), ["training.top_k=1", "training.n_experts=4"], "gpt.blocks.0.mlp.router.weight (2, 128)"),
    ]  # fmt: skip
    for resume, changed, named in cases:
        code = cli.main(["train", *gpt, *mixture, *changed, "--max-steps", "2", "--resume", resume])
        captured = capsys.readouterr()
        assert code == 2 and not captured.out, (changed, captured)
        assert captured.err.startswith("distrain: error: --resume ") and named in captured.err, captured.err
        assert "resume with the config that wrote it" in captured.err and captured.err.count("\n") == 1
        assert {p: p.read_bytes() for p in files} == files and sorted((out / "logs").iterdir()) == logs

    assert cli.main(["train", *gpt, *mixture, "--max-steps", "2", "--resume", "last"]) == 0
    assert _steps(out) == [1, 2]
