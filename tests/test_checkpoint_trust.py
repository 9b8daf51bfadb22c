"""A checkpoint that runs no code still must not delete, read or change anything outside itself.

The class, not the examples: every allowed name of a DCP ``.metadata`` under every opcode that could change it; every
way a storage entry could point outside its checkpoint or past its file; every path a checkpoint's own fields could
make the run delete; a ``last`` that a sync turned into a directory; checkpoint names that only the loop decides."""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from test_safe_load import _dcp_copy  # a copy of a real FSDP checkpoint to craft from

import distrain
from distrain.checkpoint import CheckpointError, safe_load
from distrain.checkpoint.io import point_last, remove_checkpoint
from helpers import TinyGPT, loader, make_trainer, run_ranks

PREVIOUS = Path(__file__).parent / "data" / "previous"
ROOT = Path(__file__).resolve().parents[1]


# ---- .metadata: no opcode changes an allowed name ------------------------------------------------------------
def _text(value: str) -> bytes:
    raw = value.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _global(module: str, name: str) -> bytes:
    return _text(module) + _text(name) + b"\x93"  # STACK_GLOBAL


def _state(key: str = "pwned") -> bytes:
    return b"}" + _text(key) + _text("yes") + b"s"  # EMPTY_DICT, key, value, SETITEM


ALLOWED = sorted(safe_load._DCP_METADATA_GLOBALS)


def _attacks(module: str, name: str) -> dict[str, bytes]:
    """Pickles that, loaded by a plain unpickler, change ``module.name`` itself or use it to reach further."""
    g = _global(module, name)
    proto = b"\x80\x04"
    return {
        "BUILD dict": proto + g + _state() + b"b.",
        "BUILD slots": proto + g + b"N" + _state() + b"\x86b.",  # (None, {...}): setattr on the object
        "BUILD __dict__ key": proto + g + _state("__class__") + b"b.",
        "SETITEM": proto + g + _text("pwned") + _text("yes") + b"s.",
        "SETITEMS": proto + g + b"(" + _text("pwned") + _text("yes") + b"u.",
        "APPEND": proto + g + _text("pwned") + b"a.",
        "APPENDS": proto + g + b"(" + _text("pwned") + b"e.",
        "ADDITEMS": proto + g + b"(" + _text("pwned") + b"\x90.",
        "REDUCE non-tuple": proto + g + b"]" + b"R.",  # a list where the arguments' tuple goes
        "NEWOBJ": proto + g + b")\x81.",
        "NEWOBJ_EX": proto + g + b")}\x92.",
        "INST": b"(i" + module.encode() + b"\n" + name.encode() + b"\n.",
        "OBJ": proto + b"(" + g + b"o.",
        "PERSID": b"P" + name.encode() + b"\n.",
        "BINPERSID": proto + _text(name) + b"Q.",
        "EXT1": proto + b"\x82\x01.",
    }


def _snapshot(obj) -> dict:
    """What an attack would change: the object's own attributes (a class's, a function's, an instance's)."""
    try:
        return {k: id(v) for k, v in vars(obj).items()}
    except TypeError:  # no __dict__ (a dtype): what it is and which attributes it has
        return {"repr": repr(obj), **dict.fromkeys(dir(obj))}


@pytest.mark.parametrize("module,name", ALLOWED, ids=[f"{m}.{n}" for m, n in ALLOWED])
def test_no_opcode_changes_an_allowed_name(tmp_path, module, name):
    """Each opcode that could change a live object, aimed at each name the metadata may use: refused in one line
    naming the file, and the name's attributes are what they were (torch's own unpickler is the bar)."""
    target = getattr(importlib.import_module(module), name)
    before = _snapshot(target)
    layout = torch.serialization._get_layout
    layout_before = dict(vars(layout))
    for attack, payload in _attacks(module, name).items():
        (tmp_path / ".metadata").write_bytes(payload)
        with pytest.raises(CheckpointError) as error:
            safe_load.read_dcp_metadata(tmp_path)
        text = str(error.value)
        assert "\n" not in text and str(tmp_path / ".metadata") in text, (attack, text)
        assert _snapshot(target) == before, attack
        assert not hasattr(target, "pwned"), attack
    assert vars(layout).keys() == layout_before.keys()
    assert pathlib_name_is_honest()


def pathlib_name_is_honest() -> bool:
    from pathlib import PurePosixPath

    return PurePosixPath("/a/b").name == "b" and PurePosixPath("/a/b").parent == PurePosixPath("/a")


def test_build_on_a_shared_object_made_inside_the_pickle_is_refused(tmp_path):
    """Objects an allowed call returns but does not make — an enum member, a layout from ``_get_layout`` — are the
    process's own singletons: BUILD on them is refused too."""
    enum = _global("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
    layout = _global("torch.serialization", "_get_layout")
    member = enum + b"K\x01\x85R"  # _MEM_FORMAT_ENCODING(1)
    strided = layout + _text("torch.strided") + b"\x85R"
    for made in (member, strided):
        (tmp_path / ".metadata").write_bytes(b"\x80\x04" + made + _state() + b"b.")
        with pytest.raises(safe_load.UnsafeCheckpointError, match="BUILD"):
            safe_load.read_dcp_metadata(tmp_path)
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    assert not hasattr(_MEM_FORMAT_ENCODING(1), "pwned") and not hasattr(torch.strided, "pwned")


def test_a_record_takes_only_its_own_fields(tmp_path):
    """BUILD on a record this load made (a ``_StorageInfo``) may set its fields, nothing else."""
    info = _global("torch.distributed.checkpoint.filesystem", "_StorageInfo") + b")\x81"
    (tmp_path / ".metadata").write_bytes(b"\x80\x04" + info + _state("__class__") + b"b.")
    with pytest.raises(safe_load.UnsafeCheckpointError, match="attributes it does not have"):
        safe_load.read_dcp_metadata(tmp_path)


def test_real_metadata_of_every_kind_still_reads(tmp_path):
    """The checks cost nothing to a real checkpoint: tensors, byte entries, nested containers, channels-last."""
    import torch.distributed.checkpoint as dcp

    state = {
        "w": torch.randn(3, 4),
        "cl": torch.randn(1, 2, 3, 3).to(memory_format=torch.channels_last),
        "lr": 0.1,
        "x": {"a": [1, 2], "b": (3, "s")},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
        loaded = {"w": torch.zeros(3, 4), "cl": torch.zeros(1, 2, 3, 3), "lr": 0.0, "x": {"a": None, "b": None}}
        safe_load.dcp_load(loaded, tmp_path, no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["cl"], state["cl"])
    assert loaded["lr"] == 0.1 and loaded["x"] == {"a": [1, 2], "b": (3, "s")}
    assert safe_load.read_dcp_metadata(PREVIOUS / "fsdp2-step3").state_dict_metadata


# ---- storage entries: inside the checkpoint, within the file, no unbounded size ------------------------------------
def _rewrite(checkpoint: Path, change) -> None:
    """Unpickle the real metadata (our own copy, so plain pickle is fine), change it, write it back."""
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
    change(metadata)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))


def _first_tensor_entry(metadata):
    return next(k for k in metadata.storage_data if k.fqn.startswith("model."))


def _entry_to(**fields):
    def change(metadata):
        key = _first_tensor_entry(metadata)
        metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], **fields)

    return change


def _grow_first_tensor(metadata):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    fqn = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))
    metadata.state_dict_metadata[fqn].size = torch.Size([1 << 20, 1 << 20])  # 4 TiB of float32


@pytest.fixture
def outside(tmp_path) -> Path:
    secret = tmp_path / "elsewhere" / "secret.bin"
    secret.parent.mkdir()
    torch.save(torch.arange(4.0), secret)
    return secret


STORAGE_ATTACKS = {
    "absolute path": lambda outside: _entry_to(relative_path=str(outside)),
    "dot-dot": lambda outside: _entry_to(relative_path="../../elsewhere/secret.bin"),
    "subdirectory": lambda outside: _entry_to(relative_path="sub/__0_0.distcp"),
    "/dev/zero, 400 MiB": lambda outside: _entry_to(relative_path="/dev/zero", offset=0, length=400 << 20),
    "past the file's end": lambda outside: _entry_to(offset=0, length=1 << 38),
    "negative offset": lambda outside: _entry_to(offset=-10),
    "float length": lambda outside: _entry_to(length=1e3),
    "transforms": lambda outside: _entry_to(transform_descriptors=["zstandard"]),
    "4 TiB tensor": lambda outside: _grow_first_tensor,
}


@pytest.mark.parametrize("attack", list(STORAGE_ATTACKS))
def test_storage_entries_stay_inside_the_checkpoint_and_its_files(tmp_path, outside, attack):
    """Refused before a byte of storage is read, in one line naming the .metadata, by every reader: the metadata
    reader, DCP's load (resume, Module.load_from_checkpoint) and distrain convert."""
    from distrain.checkpoint.state import read_model_weights

    crafted = _dcp_copy(tmp_path)
    _rewrite(crafted, STORAGE_ATTACKS[attack](outside))
    with pytest.raises(CheckpointError) as error:
        safe_load.read_dcp_metadata(crafted)
    text = str(error.value)
    assert "\n" not in text and str(crafted) in text, text
    with pytest.raises(CheckpointError):
        read_model_weights(crafted)
    with pytest.raises(CheckpointError):
        TinyGPT.load_from_checkpoint(str(crafted))


def test_a_storage_file_that_is_a_link_is_refused(tmp_path, outside):
    crafted = _dcp_copy(tmp_path)
    shard = sorted(crafted.glob("*.distcp"))[0]
    shutil.copy(shard, outside)
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(safe_load.UnsafeCheckpointError, match="a link"):
        safe_load.read_dcp_metadata(crafted)


def test_convert_refuses_an_entry_outside_in_one_line(tmp_path, outside):
    crafted = _dcp_copy(tmp_path)
    _rewrite(crafted, _entry_to(relative_path=str(outside)))
    out = subprocess.run(
        [sys.executable, "-m", "distrain.cli", "convert", str(crafted), str(tmp_path / "w.safetensors")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "outside the checkpoint" in out.stderr and not (tmp_path / "w.safetensors").exists()


def test_a_manifest_naming_files_outside_makes_the_checkpoint_damaged(tmp_path, outside):
    from distrain.checkpoint.io import find_damage

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    torch.save({}, checkpoint / "state.pt")
    for name in (str(outside), "../elsewhere/secret.bin"):
        (checkpoint / "manifest.json").write_text(f'{{"files": {{"{name}": {outside.stat().st_size}}}}}')
        assert "not a file of the checkpoint" in find_damage(checkpoint)


# ---- the callback deletes only its own checkpoints --------------------------------------------------------------
def _fit(root: Path, steps: int, ckpt_path=None, keep: int = 2, **kw):
    trainer, _ = make_trainer(
        root,
        strategy="single",
        devices=1,
        max_steps=steps,
        logger=False,
        callbacks=[distrain.ModelCheckpoint(every_n_train_steps=1, save_top_k=keep)],
        **kw,
    )
    trainer.fit(TinyGPT(), loader(4), ckpt_path=ckpt_path)
    return trainer


def test_a_resume_from_another_run_deletes_nothing_of_it(tmp_path):
    """Run B resumes from run A's checkpoint into its own directory: A keeps every checkpoint it had."""
    _fit(tmp_path / "a", 3, keep=3)
    a = tmp_path / "a" / "checkpoints"
    before = sorted(p.name for p in a.iterdir())
    assert len(before) == 4  # three kept, and `last`
    b = _fit(tmp_path / "b", 6, ckpt_path=str(a / "last"), keep=1)
    assert sorted(p.name for p in a.iterdir()) == before
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["epoch=0-step=6", "last"]
    assert Path(b.checkpoint_callback.best_model_path).parent == tmp_path / "b" / "checkpoints"


def test_a_resumed_run_goes_on_ranking_the_checkpoint_it_resumed_from(tmp_path):
    """A checkpoint's record of the kept checkpoints holds itself: resumed from the newest of two kept (steps 2 and
    3), the run removes both as steps 4 and 5 take their places. The record used to be taken before its own entry was
    added, so step 3 was never ranked again and stayed on disk for good."""
    _fit(tmp_path, 3, keep=2)
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=0-step=2", "epoch=0-step=3", "last"]
    trainer = _fit(tmp_path, 5, ckpt_path="last", keep=2)
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=0-step=4", "epoch=0-step=5", "last"]
    assert trainer.checkpoint_callback.best_model_path == str(ckpts / "epoch=0-step=5")


def _crafted_callback_state(checkpoint: Path, saved: list, best) -> None:
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    (key,) = [k for k in state["callbacks"] if "ModelCheckpoint" in k]
    state["callbacks"][key] = {"saved": saved, "best_model_path": best}
    torch.save(state, checkpoint / "state.pt")
    (checkpoint / "manifest.json").unlink()  # its recorded size no longer holds; an older checkpoint has none


def test_paths_a_checkpoint_names_are_never_deleted(tmp_path):
    """A crafted ``saved`` list — an absolute directory, ``..``, the run's own root, a link, ``last``, a file —
    survives the resume and every save after it; a name of a real sibling checkpoint is still managed."""
    _fit(tmp_path, 2, keep=5)
    ckpts = tmp_path / "checkpoints"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "state.pt").write_bytes(b"x")  # looks like a checkpoint, but outside
    link = ckpts / "linked"
    link.symlink_to(victim)
    saved = [
        [9.0, str(victim)],
        [8.0, "../victim"],
        [7.0, str(tmp_path)],
        [6.0, "linked"],
        [5.0, "last"],
        [4.0, ".."],
        [3.0, 12],
        ["x", "epoch=0-step=1"],
        [float("nan"), "epoch=0-step=1"],
        [1.0, "epoch=0-step=1"],
    ]
    _crafted_callback_state(ckpts / "epoch=0-step=2", saved, str(victim))
    trainer = _fit(tmp_path, 4, ckpt_path=str(ckpts / "epoch=0-step=2"), keep=1)
    assert (victim / "state.pt").exists() and link.is_symlink() and (tmp_path / "checkpoints").is_dir()
    # step 1 (a valid name in the list) and step 3 went; step 2, which the crafted list left out, is unknown: kept
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=0-step=2", "epoch=0-step=4", "last", "linked"]
    assert trainer.checkpoint_callback.best_model_path == str(ckpts / "epoch=0-step=4")


def test_remove_checkpoint_refuses_anything_but_a_checkpoint_inside(tmp_path):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "state.pt").write_bytes(b"x")
    (ckpts / "plain").mkdir()
    (ckpts / "link").symlink_to(tmp_path / "other")
    # files named as checkpoint files: a model someone saved there, a text file, a link to a checkpoint file
    torch.save({"model": {"w": torch.ones(2)}, "format": "mine"}, ckpts / "model.pt")
    (ckpts / "notes.ckpt").write_text("format: distrain/1")
    torch.save({"format": "distrain/1", "model": {}}, tmp_path / "theirs.ckpt")
    (ckpts / "linked.ckpt").symlink_to(tmp_path / "theirs.ckpt")
    kept = (tmp_path / "other", ckpts / "plain", ckpts / "link", ckpts / ".." / "other", ckpts / "model.pt")
    for path in (*kept, ckpts / "notes.ckpt", ckpts / "linked.ckpt", ckpts / ".." / "theirs.ckpt"):
        with pytest.raises(CheckpointError, match="refusing to delete"):
            remove_checkpoint(path, within=ckpts)
    assert (tmp_path / "other" / "state.pt").exists() and (ckpts / "plain").is_dir()
    assert all(p.exists() for p in (ckpts / "model.pt", ckpts / "notes.ckpt", tmp_path / "theirs.ckpt"))
    torch.save({"format": "distrain/1", "model": {}}, ckpts / "ours.ckpt")  # a checkpoint file inside: removed
    remove_checkpoint(ckpts / "ours.ckpt", within=ckpts)
    assert not (ckpts / "ours.ckpt").exists() and (ckpts / "linked.ckpt").is_symlink()


# ---- names: the loop decides them ------------------------------------------------------------------------------
class LogsStep(TinyGPT):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("step", 1234.0)
        self.log("epoch", 0.5)
        return loss


def test_checkpoint_names_come_from_the_loop_not_from_metrics(tmp_path):
    """Before and after a resume, and with a user metric called ``step``: ``epoch=0-step=N``."""
    first, _ = make_trainer(
        tmp_path,
        strategy="single",
        devices=1,
        max_steps=2,
        logger=False,
        callbacks=[distrain.ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)],
    )
    first.fit(LogsStep(), loader(4))
    second, _ = make_trainer(
        tmp_path,
        strategy="single",
        devices=1,
        max_steps=4,
        logger=False,
        callbacks=[distrain.ModelCheckpoint(every_n_train_steps=1, save_top_k=-1)],
    )
    second.fit(LogsStep(), loader(4), ckpt_path="last")
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [f"epoch=0-step={s}" for s in (1, 2, 3, 4)] + ["last"], names


@pytest.mark.parametrize("filename", ["{epoch}/{step}", "../x-{step}", ".hidden-{step}", "last", "/abs/{step}"])
def test_a_name_that_is_not_one_directory_inside_is_refused(tmp_path, filename):
    trainer, _ = make_trainer(
        tmp_path,
        strategy="single",
        devices=1,
        max_steps=1,
        logger=False,
        callbacks=[distrain.ModelCheckpoint(filename=filename)],
    )
    with pytest.raises(ValueError, match="not one directory name inside"):
        trainer.fit(TinyGPT(), loader(4))
    assert not (tmp_path / "x-1").exists() and not Path("/abs").exists()


# ---- `last` made a directory by a sync ---------------------------------------------------------------------------
def test_point_last_keeps_a_real_directory_and_links(tmp_path):
    (tmp_path / "new").mkdir()
    for n in range(2):
        (tmp_path / "last").unlink(missing_ok=True)  # the link the first round made
        (tmp_path / "last").mkdir()
        (tmp_path / "last" / "state.pt").write_bytes(bytes([n]))
        with pytest.warns(UserWarning, match="was a directory"):
            point_last(tmp_path, tmp_path / "new")
        assert (tmp_path / "last").is_symlink() and (tmp_path / "last").resolve() == tmp_path / "new"
    assert (tmp_path / "last.copy" / "state.pt").read_bytes() == b"\x00"
    assert (tmp_path / "last.copy-2" / "state.pt").read_bytes() == b"\x01"


def _synced_run(rank, root: Path, steps: int):
    trainer, _ = make_trainer(root, strategy="ddp", devices=2, max_steps=steps, logger=False)
    trainer.fit(TinyGPT(), loader(4), ckpt_path="auto")
    return trainer.global_step, sorted(p.name for p in (root / "checkpoints").iterdir())


def test_a_synced_copy_of_a_run_resumes_and_saves(tmp_path):
    """``aws s3 sync`` / ``rsync -L`` made ``last`` a directory: ``--resume auto`` on the copy trains on and saves."""
    run_ranks(_synced_run, 2, tmp_path / "run", 2)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-rL", str(tmp_path / "run"), str(copy)], check=True)
    assert (copy / "checkpoints" / "last").is_dir() and not (copy / "checkpoints" / "last").is_symlink()
    step, names = run_ranks(_synced_run, 2, copy, 4)[0]
    assert step == 4 and "last.copy" in names and (copy / "checkpoints" / "last").is_symlink()


class FailsAfterCommit(distrain.ModelCheckpoint):
    def _keep_top_k(self, score, path):
        raise OSError("disk gone")  # only rank 0 gets here


def _fails_after_commit(rank, root: Path):
    import time

    trainer, _ = make_trainer(
        root,
        strategy="ddp",
        devices=2,
        max_steps=2,
        logger=False,
        callbacks=[FailsAfterCommit(every_n_train_steps=1)],
        collective_timeout=120,
    )
    start = time.monotonic()
    try:
        trainer.fit(TinyGPT(), loader(4))
    except OSError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


def test_a_failure_after_the_commit_reaches_every_rank_at_once(tmp_path):
    """Rank 0 alone moves ``last`` and removes old checkpoints: when that fails, rank 1 learns it at once instead of
    waiting in a barrier for the collective timeout (120 s here)."""
    results = run_ranks(_fails_after_commit, 2, tmp_path)
    assert results[0][0] == "disk gone" and results[1][0] == "disk gone (raised on rank 0)", results
    assert all(seconds < 60 for _, seconds in results), results


# ---- the loop's numbers from a checkpoint: counts, or a one-line refusal --------------------------------------------
def _crafted_state(checkpoint: Path, change) -> None:
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    change(state)
    torch.save(state, checkpoint / "state.pt")
    (checkpoint / "manifest.json").unlink()


@pytest.mark.parametrize(
    "field,value",
    [("global_step", -5), ("samples_in_epoch", 2.5), ("epoch", "0"), ("skipped_steps", None), ("epoch_done", 3)],
)
def test_progress_fields_must_be_counts(tmp_path, field, value):
    _fit(tmp_path, 1)
    checkpoint = tmp_path / "checkpoints" / "epoch=0-step=1"
    _crafted_state(checkpoint, lambda state: state["progress"].__setitem__(field, value))
    with pytest.raises(CheckpointError) as error:
        _fit(tmp_path, 3, ckpt_path=str(checkpoint))
    assert str(checkpoint) in str(error.value) and field in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "layout",
    [
        {"micro_batch": -1, "accumulate": 1, "data_parallel": 7},
        {"micro_batch": 4, "accumulate": 1.5, "data_parallel": 7},
        {"micro_batch": 4, "accumulate": 1, "data_parallel": 7, "extra": 1},
        "4x1x7",
    ],
)
def test_a_batch_layout_that_is_not_counts_is_refused(tmp_path, layout):
    _fit(tmp_path, 1)
    checkpoint = tmp_path / "checkpoints" / "epoch=0-step=1"
    _crafted_state(checkpoint, lambda state: state.__setitem__("batch_layout", layout))
    with pytest.raises(ValueError, match="batch_layout") as error:
        _fit(tmp_path, 3, ckpt_path=str(checkpoint))
    assert str(checkpoint) in str(error.value)


# ---- tracker runs: continued only from this run's own checkpoints, and only by a run id ---------------------------
class RunIdLogger(distrain.loggers.Logger):
    """Stands in for a tracker: its run id travels in checkpoints, as W&B's and MLflow's do."""

    def __init__(self, run_id: str):
        self.run_id = run_id

    def log_metrics(self, metrics, step) -> None:
        pass

    def state_dict(self) -> dict:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict) -> None:
        self.run_id = state["run_id"]


def test_another_runs_checkpoint_does_not_continue_its_tracker_run(tmp_path):
    def fit(root: Path, run_id: str, steps: int, ckpt_path=None) -> RunIdLogger:
        tracker = RunIdLogger(run_id)
        trainer, _ = make_trainer(root, strategy="single", devices=1, max_steps=steps, logger=tracker)
        trainer.fit(TinyGPT(), loader(4), ckpt_path=ckpt_path)
        return tracker

    fit(tmp_path / "a", "run-a", 2)
    assert fit(tmp_path / "a", "fresh", 3, ckpt_path="last").run_id == "run-a"  # its own: the same tracker run
    last_of_a = str(tmp_path / "a" / "checkpoints" / "last")
    assert fit(tmp_path / "b", "run-b", 4, ckpt_path=last_of_a).run_id == "run-b"  # another run's: its own run


@pytest.mark.parametrize("hostile", ["../../etc", "a/b", "https://host/x", "x" * 500, 12, ["id"]])
def test_a_tracker_run_id_that_is_not_one_starts_a_new_run(tmp_path, hostile):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    wandb_logger = distrain.loggers.WandbLogger(save_dir=str(tmp_path), mode="offline")
    mlflow_logger = distrain.loggers.MLFlowLogger(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    own_id, own_run = wandb_logger.id, mlflow_logger.run_id
    with pytest.warns(UserWarning, match="is not a run id"):
        wandb_logger.load_state_dict({"id": hostile})
    with pytest.warns(UserWarning, match="is not a run id"):
        mlflow_logger.load_state_dict({"run_id": hostile})
    assert wandb_logger.id == own_id and mlflow_logger.run_id == own_run
    wandb_logger.load_state_dict({"id": "abc123xy"})  # a real one is taken
    assert wandb_logger.id == "abc123xy"
