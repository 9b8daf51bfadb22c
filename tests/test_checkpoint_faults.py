"""Checkpoints survive what real runs meet: a rank killed mid-write, a full disk, a damaged file, a
checkpoint of another model, and a crafted file that tries to run code."""

import os
import pickle
import shutil
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


# ---- a rank killed while writing, then a torchrun restart ---------------------------------------------------
KILLED_IN_SAVE = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
import distrain
from distrain.checkpoint import io as ckpt_io
from helpers import TinyGPT, loader

out, strategy, crash = sys.argv[1], sys.argv[2], sys.argv[3] == "crash"
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
victim = 1 if strategy == "fsdp" else 0  # FSDP: a rank writing its shards; DDP: rank 0 writing state.pt
trainer = None
flush = ckpt_io._fsync_tree

def dies_while_writing(root):  # this rank's files are written, not yet flushed nor committed
    if crash and restart == 0 and trainer.global_step == 6 and trainer.global_rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    flush(root)

ckpt_io._fsync_tree = dies_while_writing
trainer = distrain.Trainer(accelerator="cpu", strategy=strategy, devices=2, max_steps=9, enable_progress_bar=False,
                           logger=False, default_root_dir=out, seed=7,
                           callbacks=[distrain.ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)])
distrain.seed_everything(0)
module = TinyGPT(dropout=0.1)
trainer.fit(module, loader(4))
state = distrain.checkpoint_state_of(module)
if trainer.global_rank == 0:
    torch.save(state, os.path.join(out, "final.pt"))
    open(os.path.join(out, "attempts"), "w").write(str(restart))
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_rank_killed_while_writing_resumes_from_the_previous_checkpoint(tmp_path, strategy):
    script = tmp_path / "train.py"
    script.write_text(KILLED_IN_SAVE.format(tests=os.path.dirname(__file__)))
    env = env_without_rank()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    ref = subprocess.run(
        [*torchrun, str(script), str(tmp_path / "ref"), strategy, "ok"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    cut = subprocess.run(
        [*torchrun, "--max-restarts", "1", str(script), str(tmp_path / "cut"), strategy, "crash"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cut.returncode == 0, cut.stderr[-3000:]
    assert (tmp_path / "cut" / "attempts").read_text() == "1"
    a = torch.load(tmp_path / "ref" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "cut" / "final.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    leftovers = [p.name for p in (tmp_path / "cut" / "checkpoints").iterdir() if p.name.startswith(".")]
    assert not leftovers, leftovers  # the interrupted write's temporary directory was cleaned up


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
    assert last.name.endswith("step=2") and ckpt_io.verify(last) is None
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


# ---- a crafted DCP .metadata never runs code --------------------------------------------------------------------
class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_crafted_dcp_metadata_is_refused_on_every_read_path(tmp_path):
    source = Path(__file__).parent / "data" / "previous" / "fsdp2-step3"
    crafted = tmp_path / "crafted"
    shutil.copytree(source, crafted)
    marker = tmp_path / "pwned"
    (crafted / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(Exception, match="refusing to load it"):  # distrain convert / HF export
        read_model_weights(crafted)
    with pytest.raises(Exception, match="refusing to load it"):  # load_from_checkpoint
        TinyGPT.load_from_checkpoint(str(crafted))
    trainer, _ = make_trainer(tmp_path, strategy="single", devices=1, max_steps=4, logger=False)
    with pytest.raises(Exception, match="refusing to load it"):  # resume
        trainer.fit(TinyGPT(), loader(4), ckpt_path=str(crafted))
    assert not marker.exists()
    # the real metadata still loads, through the same reader
    assert read_model_weights(source).keys() == TinyGPT().state_dict().keys()
