"""Atomic checkpoint directories and safe loading.

A checkpoint is a directory. It is written under a temporary name next to its final place and
renamed into place only when complete, so a crash mid-save never leaves a half-written
checkpoint where a resume would look for one. Reading never unpickles code:
``torch.load(weights_only=True)`` only rebuilds tensors and plain containers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "state.pt"
LAST = "last"


def is_stateful(obj: Any) -> bool:
    return hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")


def write_checkpoint_dir(path: str | os.PathLike, files: dict[str, Any]) -> None:
    """Write ``{filename: object}`` as one checkpoint directory, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        for name, obj in files.items():
            with open(tmp / name, "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
        commit_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def directory_of_all_ranks(
    path: str | os.PathLike, is_global_zero: bool, barrier: Callable, finish: Callable[[Path], None] | None = None
):
    """A checkpoint directory every rank writes into (its own shards): rank 0 makes an empty temp
    directory under a name every rank derives alike, yields it to every rank, and once all have
    written runs ``finish(tmp)`` (rank 0 only) and commits it onto ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-all-ranks")
    if is_global_zero:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier("checkpoint tmp dir")
    yield tmp
    barrier("checkpoint shards written")
    if is_global_zero:
        if finish is not None:
            finish(tmp)
        commit_dir(tmp, path)
    barrier("checkpoint committed")


def commit_dir(tmp: Path, path: Path) -> None:
    """Move a finished temp directory onto ``path``; an older checkpoint there is replaced."""
    if path.exists() or path.is_symlink():
        trash = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(path, trash)
        os.replace(tmp, path)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def point_last(dirpath: str | os.PathLike, target: str | os.PathLike) -> None:
    """Make ``dirpath/last`` a symlink to ``target``, replaced atomically."""
    dirpath = Path(dirpath)
    link = dirpath / LAST
    tmp = dirpath / f".{LAST}.tmp-{uuid.uuid4().hex[:8]}"
    os.symlink(os.path.relpath(target, dirpath), tmp)
    os.replace(tmp, link)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory (``last`` links followed), or a clear error."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    return path.resolve()


def read_state_file(path: str | os.PathLike) -> dict[str, Any]:
    path = resolve_checkpoint(path)
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a distrain checkpoint: {STATE_FILE} is missing")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a pickle with code in it, or a truncated file
        raise RuntimeError(f"cannot load checkpoint {file} safely (weights_only=True): {e}") from None
