"""Checkpoints survive what real runs meet: a rank killed mid-write, a kill at any point of a commit on a file
system without RENAME_EXCHANGE, a full disk, a damaged file, a checkpoint of another model. (A crafted file
that tries to run code: tests/test_safe_load.py.)"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import distrain
from distrain.checkpoint import io as ckpt_io
from distrain.checkpoint.state import read_model_weights
from helpers import TinyGPT, env_without_rank, loader, make_trainer, params_of, run_ranks

# ---- the commit never leaves the name without a checkpoint ------------------------------------------------


def test_replacing_a_checkpoint_never_leaves_the_name_empty(tmp_path, monkeypatch):
    old, new = tmp_path / "ckpt", tmp_path / ".ckpt.tmp"
    for d, text in ((old, "old"), (new, "new")):
        d.mkdir()
        (d / "state.pt").write_text(text)
    # a crash right after the first rename of a two-rename swap would leave nothing at the name
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("crash")))
    ckpt_io.commit_dir(new, old)
    assert (old / "state.pt").read_text() == "new"
    assert not new.exists()


# ---- SIGKILL at any point of a commit, on a file system without RENAME_EXCHANGE (NFS, Lustre, GPFS) ----------
#: what a commit does to the file system; the child dies just before the k-th of these (or after the last)
_COMMIT_OPS = [(os, "replace"), (os, "rename"), (os, "symlink"), (os, "mkdir"), (os, "fsync"), (shutil, "rmtree")]
_COMMIT_OPS += [(torch, "save")]
_KILL_STEP = 3  # the save this many steps in is the one killed


class _KillAt(distrain.Callback):
    """Before ModelCheckpoint saves at ``_KILL_STEP``: count file-system operations, die before the k-th."""

    def __init__(self, kill_before: int | None, log: Path):
        self.kill_before, self.log, self.count = kill_before, log, 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step != _KILL_STEP:
            return
        for owner, name in _COMMIT_OPS:
            setattr(owner, name, self._counted(getattr(owner, name), name))

    def _counted(self, op, name):
        def counted(*args, **kwargs):
            self.count += 1
            names = " ".join(Path(str(a)).name for a in args[:2] if isinstance(a, str | Path))
            with open(self.log, "a") as log:
                log.write(f"{self.count} {name} {names}\n")
            if self.count == self.kill_before:
                os.kill(os.getpid(), signal.SIGKILL)
            return op(*args, **kwargs)

        return counted


def _commit_run(
    root: Path, steps: int, filename: str, count_ops: bool = False, kill_before: int | None = None, resume: bool = False
):
    """``count_ops``: file-system operations from step 3's save on are counted (and, with ``kill_before``, one
    kills the process); they stay replaced, so only a child or a monkeypatched test process may count."""
    checkpoints = distrain.ModelCheckpoint(filename=filename, every_n_train_steps=1, save_top_k=1)
    callbacks = [_KillAt(kill_before, root / "ops.log")] if count_ops else []
    trainer, rec = make_trainer(
        root, strategy="single", devices=1, max_steps=steps, logger=False, callbacks=[*callbacks, checkpoints]
    )
    distrain.seed_everything(0)
    module = TinyGPT(dropout=0.1)  # dropout: a resume must restore the RNG streams too
    trainer.fit(module, loader(4), ckpt_path="auto" if resume else None)
    return params_of(module), rec.losses


def _killed_child(root: Path, filename: str, kill_before: int) -> None:
    ckpt_io._exchange = lambda a, b: False  # as on NFS: renameat2(RENAME_EXCHANGE) is not there
    _commit_run(root, _KILL_STEP, filename, count_ops=True, kill_before=kill_before)
    os._exit(0)


@pytest.mark.slow
@pytest.mark.parametrize("filename", ["ckpt", "{step}"], ids=["overwrite-one-name", "new-name-each-step"])
def test_sigkill_anywhere_in_a_commit_without_rename_exchange_resumes_exactly(tmp_path, filename, monkeypatch):
    """Every file-system operation of the commit at step 3 is a place to die (≥ 10 trials per naming,
    every phase: preparing, writing, flushing, the manifest, each rename, removing the replaced one,
    moving `last`, deleting the older checkpoint). Each trial resumes with ``auto`` from the newest
    intact checkpoint and finishes bit-identical to a run that was never killed."""
    import multiprocessing

    final = _KILL_STEP + 2
    reference, _ = _commit_run(tmp_path / "reference", final, filename)
    dry = tmp_path / "dry"
    with monkeypatch.context() as patch:  # the same operations the children will do, counted, no one killed
        patch.setattr(ckpt_io, "_exchange", lambda a, b: False)
        for owner, name in _COMMIT_OPS:
            patch.setattr(owner, name, getattr(owner, name))  # _KillAt replaces them: put them back after
        _commit_run(dry, _KILL_STEP, filename, count_ops=True)
    ops = (dry / "ops.log").read_text().splitlines()
    assert any("replace" in op and "replaced" in op for op in ops) == (filename == "ckpt"), ops
    trials = list(range(1, len(ops) + 2))  # before each operation, and after the last
    assert len(trials) >= 10, ops
    fork = multiprocessing.get_context("fork")
    for kill_before in trials:
        root = tmp_path / f"kill-{kill_before}"
        child = fork.Process(target=_killed_child, args=(root, filename, kill_before))
        child.start()
        child.join(120)
        assert child.exitcode == (-signal.SIGKILL if kill_before <= len(ops) else 0), (kill_before, child.exitcode)
        leftovers = sorted(p.name for p in (root / "checkpoints").iterdir())
        resumed, losses = _commit_run(root, final, filename, resume=True)
        for k in reference:
            assert torch.equal(reference[k], resumed[k]), (kill_before, ops[kill_before - 1 : kill_before], k)
        # `auto` follows `last`: step 3 once `last` points at it (overwriting one name: once it is renamed in)
        moved = ("tmp-all-ranks ckpt",) if filename == "ckpt" else (" last",)
        done = kill_before > len(ops) or any(
            " replace " in f" {op} " and op.endswith(moved) for op in ops[: kill_before - 1]
        )
        assert len(losses) == final - (_KILL_STEP if done else _KILL_STEP - 1), (kill_before, leftovers, losses)
        assert not [p.name for p in (root / "checkpoints").iterdir() if p.name.startswith(".") and "last" not in p.name]


# ---- a rank killed while writing, then a torchrun restart ---------------------------------------------------
KILLED_IN_SAVE = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
import distrain
from torch.distributed.checkpoint import FileSystemWriter
from distrain.checkpoint import io as ckpt_io
from helpers import TinyGPT, loader

out, strategy, crash, background = sys.argv[1], sys.argv[2], sys.argv[3] == "crash", sys.argv[4] == "async"
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
victim = 1 if strategy == "fsdp" or background else 0  # a rank writing its shards; DDP: rank 0 writing state.pt
trainer = None
flush = ckpt_io._fsync_files
write_shards = FileSystemWriter.write_data
shard_writes = []

def dies_while_writing(files):  # this rank's files are written, not yet flushed nor committed
    if crash and not background and restart == 0 and trainer.global_step == 6 and trainer.global_rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    flush(files)

def dies_in_the_background(self, *args):  # in DCP's writing thread, while training goes on
    shard_writes.append(self.path)
    if crash and restart == 0 and len(shard_writes) == 3 and int(os.environ["RANK"]) == victim:  # the step-6 save
        os.kill(os.getpid(), signal.SIGKILL)
    return write_shards(self, *args)

ckpt_io._fsync_files = dies_while_writing
FileSystemWriter.write_data = dies_in_the_background
trainer = distrain.Trainer(accelerator="cpu", strategy=strategy, devices=2, max_steps=9, enable_progress_bar=False,
                           logger=False, default_root_dir=out, seed=7, async_save=background,
                           callbacks=[distrain.ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)])
distrain.seed_everything(0)
module = TinyGPT(dropout=0.1)
trainer.fit(module, loader(4))
state = distrain.checkpoint_state_of(module)
if trainer.global_rank == 0:
    torch.save(state, os.path.join(out, "final.pt"))
    open(os.path.join(out, "attempts"), "w").write(str(restart))
"""


def _torchrun(script: Path, out: Path, strategy: str, mode: str, background: str, *launcher: str):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *launcher]
    done = subprocess.run(
        [*command, str(script), str(out), strategy, mode, background],
        env=env_without_rank(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def synchronous_finish(tmp_path_factory):
    """strategy → the final weights of a run that was never interrupted, its checkpoints written synchronously."""
    root = tmp_path_factory.mktemp("reference")
    script = root / "train.py"
    script.write_text(KILLED_IN_SAVE.format(tests=os.path.dirname(__file__)))
    finals: dict[str, dict] = {}

    def final(strategy: str) -> dict:
        if strategy not in finals:
            _torchrun(script, root / strategy, strategy, "ok", "sync")
            finals[strategy] = torch.load(root / strategy / "final.pt", weights_only=True)
        return finals[strategy]

    return final


@pytest.mark.slow
@pytest.mark.parametrize("background", ["sync", "async"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_rank_killed_while_writing_resumes_from_the_previous_checkpoint(
    tmp_path, strategy, background, synchronous_finish
):
    """SIGKILL in a rank while it writes the step-6 checkpoint (async: in DCP's writing thread, while training goes
    on); torchrun restarts the job, which resumes from step 4 and finishes bit-identical to a run never killed,
    whose checkpoints were written synchronously."""
    script = tmp_path / "train.py"
    script.write_text(KILLED_IN_SAVE.format(tests=os.path.dirname(__file__)))
    _torchrun(script, tmp_path / "cut", strategy, "crash", background, "--max-restarts", "1")
    assert (tmp_path / "cut" / "attempts").read_text() == "1"
    a = synchronous_finish(strategy)
    b = torch.load(tmp_path / "cut" / "final.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    leftovers = [p.name for p in (tmp_path / "cut" / "checkpoints").iterdir() if p.name.startswith(".")]
    assert not leftovers, leftovers  # the interrupted write's temporary directory was cleaned up


def _background_saves(rank, root):
    """FSDP on 2 ranks, a checkpoint every 4 steps written in the background: what is on disk at step 6, two steps
    after the step-4 checkpoint's writes began (at step 5 each rank waits for its own writes to finish, so that the
    assertion does not depend on how fast the disk is)."""
    seen = {}

    class Look(distrain.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 5:
                while trainer.checkpoints.writing is not None and not trainer.checkpoints.writing.written():
                    time.sleep(0.01)
            if trainer.global_step == 6:
                last = Path(root) / "checkpoints" / "last"
                seen.update(last=last.resolve().name if last.exists() else None)
                seen.update(damage=ckpt_io.find_damage(last.resolve()) if last.exists() else "no last")

    checkpoints = distrain.ModelCheckpoint(dirpath=str(Path(root) / "checkpoints"), every_n_train_steps=4)
    trainer, _ = make_trainer(
        root, strategy="fsdp", devices=2, max_steps=7, logger=False, async_save=True, callbacks=[checkpoints, Look()]
    )
    trainer.fit(TinyGPT(), loader(4))
    return seen


def test_a_checkpoint_written_in_the_background_is_committed_before_the_next_save(tmp_path):
    """``async_save``: a checkpoint counts once its writes finish, not at the next save: ``last`` points at the
    step-4 checkpoint, whole, at step 6 (before, it waited for the step-8 save, and a job killed between the two
    resumed from the one before, or from the start)."""
    for seen in run_ranks(_background_saves, 2, tmp_path / "run"):
        assert seen == {"last": "epoch=0-step=4", "damage": None}, seen


# ---- a full disk ---------------------------------------------------------------------------------------------
#: a tmpfs of this size holds one TinyGPT checkpoint (~440 KB as DDP's state.pt, ~690 KB as FSDP's shards),
#: not two
DISK = {"ddp": "660k", "fsdp": "1040k"}


@pytest.fixture
def small_disk(tmp_path, request):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK[request.param]}", "tmpfs", str(disk)], check=True)
    yield disk, request.param
    subprocess.run(["umount", str(disk)], check=False)


def _fill_the_disk(rank, root, disk, strategy):
    checkpoints = distrain.ModelCheckpoint(dirpath=str(disk / "checkpoints"), every_n_train_steps=2, save_top_k=-1)
    trainer, _ = make_trainer(
        root, strategy=strategy, devices=2, max_steps=6, logger=False, timeout=120, callbacks=[checkpoints]
    )
    started = time.time()
    try:
        trainer.fit(TinyGPT(), loader(4))
    except distrain.CheckpointError as e:
        return str(e), time.time() - started, trainer.global_step
    return None, time.time() - started, trainer.global_step


@pytest.mark.slow
@pytest.mark.parametrize("small_disk", ["ddp", "fsdp"], indirect=True)
def test_disk_full_during_a_save_fails_every_rank_and_keeps_the_previous_checkpoint(tmp_path, small_disk):
    disk, strategy = small_disk
    results = run_ranks(_fill_the_disk, 2, tmp_path / "run", disk, strategy)
    for message, _, step in results:
        assert message is not None and step == 4, (message, step)
        assert "failed while writing" in message and ("No space left" in message or "the disk is full" in message)
        assert "the previous checkpoint there, if any, is intact" in message
    assert abs(results[0][1] - results[1][1]) < 10  # both learned of it together, not after a 30-minute barrier
    checkpoints = disk / "checkpoints"
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".")]  # the temporary directory is gone
    last = (checkpoints / "last").resolve()
    assert last.name.endswith("step=2") and ckpt_io.find_damage(last) is None
    assert all(torch.isfinite(v).all() for v in read_model_weights(last).values())


# ---- a damaged file; a checkpoint of another model ---------------------------------------------------------
def _train(tmp, steps, ckpt_path=None, **kw):
    trainer, rec = make_trainer(
        tmp,
        strategy="single",
        devices=1,
        max_steps=steps,
        logger=False,
        callbacks=[distrain.ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)],
        **kw,
    )
    distrain.seed_everything(0)
    module = TinyGPT(dropout=0.1)
    trainer.fit(module, loader(4), ckpt_path=ckpt_path)
    return params_of(module)


def test_truncated_checkpoint_is_named_and_auto_falls_back_to_the_newest_intact_one(tmp_path):
    reference = _train(tmp_path / "ref", 6)
    _train(tmp_path / "run", 4)  # checkpoints at steps 2 and 4; `last` → step 4
    last = (tmp_path / "run" / "checkpoints" / "last").resolve()
    state = last / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # a crash mid-copy, a disk that filled
    with pytest.raises(distrain.CheckpointError) as info:
        _train(tmp_path / "run", 6, ckpt_path="last")
    message = str(info.value)
    assert "\n" not in message and str(last) in message and "step=2" in message, message
    with pytest.warns(UserWarning, match="resuming from .*step=2"):
        resumed = _train(tmp_path / "run", 6, ckpt_path="auto")
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)  # steps 3-6 redone exactly


def test_checkpoint_of_another_model_names_the_mismatched_keys(tmp_path):
    _train(tmp_path, 2)

    class Wider(TinyGPT):
        def __init__(self):
            super().__init__()
            from distrain.models.gpt import GPT, GPTConfig

            self.gpt = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=48, block_size=16))

    trainer, _ = make_trainer(tmp_path, strategy="single", devices=1, max_steps=4, logger=False)
    with pytest.raises(distrain.CheckpointError) as info:
        trainer.fit(Wider(), loader(4), ckpt_path="last")
    message = str(info.value)
    assert "\n" not in message and "does not fit" in message
    assert (
        "missing: gpt.blocks.2" in message
        and "other shapes: gpt.tok_emb.weight (256, 32) in the checkpoint, (256, 48) here" in message
    ), message
