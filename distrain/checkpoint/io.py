"""Checkpoint directories on disk: written so that a crash, a full disk or a failing rank never costs
the previous checkpoint, and read without unpickling code.

Writing (``write_checkpoint``, every rank together): rank 0 makes a temporary directory beside the
target, every rank writes its files into it and flushes them to disk, then rank 0 commits it onto
the target name. Each of the three phases ends in an agreement (one ``all_gather_object`` of "did it
work?"), so a rank that fails — an exception, ENOSPC — is known to every rank at once instead of
leaving them in a barrier: the temporary directory is removed and the error names the rank and the
cause. Committing over an existing checkpoint exchanges the two directories in one atomic
``renameat2(RENAME_EXCHANGE)``, so the name always holds a complete checkpoint; only then is the old
one deleted. ``last`` is a symlink, replaced atomically once the new checkpoint is committed.

Reading: ``torch.load(weights_only=True)`` rebuilds only tensors and plain containers; DCP's
``.metadata`` goes through a restricted unpickler (``compat.SafeFileSystemReader``). A damaged
checkpoint (truncated, corrupt) is reported in one line naming the file, with the newest intact one.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import uuid
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "state.pt"
META_FILE = "meta.pt"
LAST = "last"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the rank or file at fault."""


def is_stateful(obj: Any) -> bool:
    return hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")


# ---- writing ---------------------------------------------------------------------------------------------
def write_checkpoint(
    path: str | os.PathLike,
    write: Callable[[Path], None],
    is_global_zero: bool,
    gather: Callable[[Any], list],
    finish: Callable[[Path], None] | None = None,
) -> None:
    """Every rank calls this together. ``write(tmp)`` writes this rank's files into the temporary
    directory; once all ranks have, rank 0 runs ``finish(tmp)`` and commits it onto ``path``.
    ``gather`` is ``all_gather_object`` over the ranks."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-all-ranks")

    def prepare() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    def write_and_flush() -> None:
        write(tmp)
        _fsync_tree(tmp)  # this rank's files are on disk before rank 0 commits them

    def commit() -> None:
        if finish is not None:
            finish(tmp)
            _fsync_tree(tmp)
        commit_dir(tmp, path)

    for what, action in (
        ("preparing", prepare if is_global_zero else None),
        ("writing", write_and_flush),
        ("committing", commit if is_global_zero else None),
    ):
        _agree(action, what, path, tmp, is_global_zero, gather)


def _agree(action, what: str, path: Path, tmp: Path, is_global_zero: bool, gather) -> None:
    """Run ``action`` here, then learn how it went on every rank; any failure fails all of them."""
    error = None
    if action is not None:
        try:
            action()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 — reported on every rank below (DCP's error is a BaseException)
            error = _describe(e)
            free = shutil.disk_usage(path.parent).free if path.parent.exists() else None
            if free is not None and free < 1 << 20:  # torch's zip writer hides ENOSPC behind "unexpected pos"
                error += f" (the disk is full: {free} bytes free under {path.parent})"
    failed = [(rank, e) for rank, e in enumerate(gather(error)) if e]
    if failed:
        if is_global_zero:
            shutil.rmtree(tmp, ignore_errors=True)
        rank, cause = failed[0]
        others = (
            f" (and on rank{'s' if len(failed) > 2 else ''} {', '.join(str(r) for r, _ in failed[1:])})"
            if len(failed) > 1
            else ""
        )
        raise CheckpointError(
            f"checkpoint {path} was not written: rank {rank} failed while {what} it{others}: "
            f"{cause}; the previous checkpoint there, if any, is intact"
        )


def _describe(error: BaseException) -> str:
    """One line; DCP's CheckpointException carries each rank's own error."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(
            f"on rank {rank}: {_describe(wrapped[0] if isinstance(wrapped, tuple) else wrapped)}"
            for rank, wrapped in sorted(failures.items())
        )
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def commit_dir(tmp: Path, path: Path) -> None:
    """Move a finished temporary directory onto ``path``. An existing checkpoint there is exchanged
    with it atomically (the name never goes missing), then deleted."""
    if path.exists() or path.is_symlink():
        if _exchange(tmp, path):
            shutil.rmtree(tmp, ignore_errors=True)  # now the old checkpoint
        else:  # a file system without RENAME_EXCHANGE: a moment without ``path`` (``recover`` repairs it)
            trash = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(path, trash)
            os.replace(tmp, path)
            shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, path)
    _fsync_dir(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """``renameat2(a, b, RENAME_EXCHANGE)`` (Linux ≥ 3.15, glibc ≥ 2.28; ext4, xfs, btrfs, tmpfs)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(directory))


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
    _fsync_dir(dirpath)


def remove_checkpoint(path: str | os.PathLike) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---- reading -----------------------------------------------------------------------------------------------
def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory (``last`` links followed), or a clear error."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    return path.resolve()


def load_file(file: Path) -> Any:
    """``torch.load(weights_only=True)`` of one checkpoint file; a damaged file is a CheckpointError
    naming it (and the newest intact checkpoint beside it)."""
    import pickle

    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # a pickle naming code: never run
        first = str(e).strip().splitlines()[0]
        raise CheckpointError(
            f"{file}: refusing to load: it holds Python objects other than tensors and plain containers, "
            f"which could run code (torch.load with weights_only=True: {first})"
        ) from None
    except Exception as e:  # a truncated or corrupt file
        raise CheckpointError(damaged(file, e)) from None


def read_state_file(path: str | os.PathLike) -> dict[str, Any]:
    path = resolve_checkpoint(path)
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a distrain checkpoint: {STATE_FILE} is missing")
    return load_file(file)


def damaged(file: Path, error: BaseException) -> str:
    """One line: which file is damaged, why, and the newest intact checkpoint next to it."""
    checkpoint = _checkpoint_of(Path(file))
    cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    intact = newest_intact(checkpoint.parent, exclude=checkpoint) if checkpoint is not None else None
    where = f"the newest intact checkpoint is {intact}" if intact else "no intact checkpoint is left beside it"
    return f"checkpoint file {file} is damaged or incomplete ({type(error).__name__}: {cause[:200]}); {where}"


def _checkpoint_of(file: Path) -> Path | None:
    """The checkpoint directory a file belongs to (it may sit in a subdirectory, e.g. DeepSpeed's)."""
    for parent in [file.parent, *file.parents]:
        if (parent / STATE_FILE).exists() or (parent / META_FILE).exists():
            return parent.resolve()
    return None


def checkpoints_newest_first(dirpath: Path, exclude: Path | None = None) -> list[Path]:
    """The checkpoint directories in ``dirpath``, the most recently written first."""
    if not dirpath.is_dir():
        return []
    found = [
        p
        for p in dirpath.iterdir()
        if p.is_dir()
        and not p.is_symlink()
        and not p.name.startswith(".")
        and ((p / STATE_FILE).exists() or (p / META_FILE).exists())
    ]
    found = [p.resolve() for p in found if exclude is None or p.resolve() != exclude]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def newest_intact(dirpath: Path, exclude: Path | None = None) -> Path | None:
    return next((p for p in checkpoints_newest_first(dirpath, exclude) if verify(p) is None), None)


def verify(path: Path) -> str | None:
    """None if the checkpoint's files are whole, else what is wrong. Checks structure, not every
    byte: each zip (``torch.save``) file's directory and CRCs, and that DCP's shard files are as long
    as ``.metadata`` says — what a crash or a full disk mid-write leaves behind."""
    try:
        for file in sorted(path.rglob("*")):
            if file.is_file() and file.suffix == ".pt":
                with zipfile.ZipFile(file) as archive:
                    bad = archive.testzip()
                    if bad is not None:
                        return f"{file}: corrupt record {bad}"
        if (path / ".metadata").is_file():
            from distrain import compat

            for name, needed in compat.dcp_storage_extents(path).items():
                if not (path / name).is_file() or (path / name).stat().st_size < needed:
                    return f"{path / name}: shorter than its .metadata says ({needed} bytes)"
    except Exception as e:  # noqa: BLE001 — any failure to read it means it is not intact
        return f"{type(e).__name__}: {e}"
    return None


def warn_fallback(wanted: Path, problem: str, used: Path) -> None:
    warnings.warn(
        f"distrain: {wanted} is damaged ({problem}); resuming from {used}, the newest intact checkpoint", stacklevel=3
    )
