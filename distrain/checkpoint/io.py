"""Checkpoint directories on disk: written so that a crash, a full disk or a failing rank never costs
the previous checkpoint, and read without unpickling code (``safe_load``).

Writing (``write_checkpoint``, every rank together): rank 0 makes a temporary directory beside the
target, every rank writes its files into it and flushes the files it wrote (its own only: on a
network file system a rank can flush nothing else), then rank 0 records every file's size in
``manifest.json`` and commits the directory onto the target name. Each phase ends in an agreement
(one ``all_gather_object`` of "did it work?"), so a rank that fails — an exception, ENOSPC — is known
to every rank at once instead of leaving them in a barrier: the temporary directory is removed and
the error names the rank and the cause.

Committing is crash-safe on every file system:
- a new name: one ``rename`` of the finished directory (atomic on POSIX, NFS included);
- over an existing checkpoint: ``renameat2(RENAME_EXCHANGE)`` swaps the two in one step where the
  file system has it (ext4, xfs, btrfs, tmpfs); elsewhere (NFS, Lustre, GPFS, overlayfs) the old one
  is first renamed to ``.<name>.replaced``, then the new one into place. A crash between the two
  renames leaves the old checkpoint under that name; ``recover`` (run before every resume and every
  write) puts it back, so the name always resolves to a complete checkpoint.
``last`` is a pointer (a symlink, replaced atomically) moved only after the commit; older
checkpoints are removed only after that.

A checkpoint named as a file (``epoch=0-step=8.ckpt``, ``model.pt``: ``FILE_SUFFIXES``) whose state is one file
(every strategy that keeps the whole state on a rank: one process, DDP) is that file, as Lightning writes it:
``torch.load(path)["state_dict"]`` reads it (``lightning_layout``). It is committed by one ``rename`` of the finished
file onto the name, atomic over an older one. Sharded state keeps the directory under the same name, as Lightning's
sharded strategies do.

A checkpoint is intact when every file its manifest lists is there at its recorded size
(``find_damage``: one ``stat`` per file, nothing read) — what a crash or a full disk mid-write leaves
behind. A bit flipped inside a file is not found there (torch.load does not check zip CRCs either).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import warnings
import zipfile
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from distrain.checkpoint import CheckpointError, safe_load
from distrain.checkpoint.lightning_layout import lightning_keys
from distrain.distributed.collectives import SharedFailure, shared_outcome

STATE_FILE = "state.pt"
META_FILE = "meta.pt"
MANIFEST = "manifest.json"
LAST = "last"
REPLACED = ".replaced"  # suffix of a checkpoint being replaced (no RENAME_EXCHANGE)
WRITING = ".tmp-all-ranks"  # suffix of a checkpoint being written
#: every checkpoint's ``format`` entry: what a distrain checkpoint file is told apart by
CHECKPOINT_FORMAT = "distrain/1"
#: names of checkpoints written as one file where the state is one (Lightning's ``.ckpt``; torch's own)
FILE_SUFFIXES = (".ckpt", ".pt", ".pth")
#: the largest pickle (the structure, not the tensors' bytes) read to tell a checkpoint file apart
MAX_PICKLE_BYTES = 64 << 20

__all__ = ["CheckpointError", "write_checkpoint", "find_damage", "recover", "point_last", "load_file"]


def is_stateful(obj: Any) -> bool:
    return hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")


# ---- writing ---------------------------------------------------------------------------------------------
Writer = Callable[[Path], Iterable[Path]]
"""Writes this rank's files into the temporary directory; returns the files it wrote itself."""


def then(future: Future, after: Callable[[Any], Any]) -> Future:
    """A future of ``after(future.result())``."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(after(f.result()))
        except BaseException as e:  # noqa: BLE001 — handed to whoever waits
            out.set_exception(e)

    future.add_done_callback(done)
    return out


class Pending:
    """A checkpoint being written in the background: ``complete()`` (every rank together) waits for the
    writes, then flushes and commits as a synchronous save does. Until then the name, ``last`` and every
    older checkpoint are as they were: a crash meanwhile costs this checkpoint only. ``written()``: whether this
    rank's writes have finished (``complete()`` would not wait for them)."""

    def __init__(self, complete: Callable[[], None], written: Callable[[], bool] = lambda: True):
        self._complete: Callable[[], None] | None = complete
        self.written = written

    def complete(self) -> None:
        complete, self._complete = self._complete, None
        if complete is not None:
            complete()


def write_checkpoint(
    path: str | os.PathLike,
    write: Callable[[Path], Any],
    is_global_zero: bool,
    gather: Callable[[Any], list],
    finish: Writer | None = None,
    background: bool = False,
) -> Pending | None:
    """Every rank calls this together. ``write(tmp)`` writes this rank's files into the temporary
    directory (files written through DCP are flushed by DCP itself); once all ranks have, rank 0 runs
    ``finish(tmp)``, writes the manifest and commits. ``gather`` is ``all_gather_object`` over the ranks.
    ``background``: ``write`` only starts the writing (it returns a ``Future`` of its files) and the commit
    waits for ``Pending.complete()``; training goes on meanwhile."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}{WRITING}")

    def prepare() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        recover(path.parent)  # a crash of an earlier commit here: its old checkpoint back in place
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    written: list = []

    def start() -> None:
        written.append(write(tmp))

    def flush() -> None:
        files = written[0].result() if isinstance(written[0], Future) else written[0]
        _fsync_files(files or ())  # this rank's files are on disk before rank 0 commits them

    def commit() -> None:
        if finish is not None:
            _fsync_files(finish(tmp) or ())
        if _one_file(tmp, path):
            commit_file(tmp / STATE_FILE, path)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        _write_manifest(tmp)
        commit_dir(tmp, path)

    _agree(prepare if is_global_zero else None, "preparing", path, tmp, is_global_zero, gather)
    _agree(start, "writing", path, tmp, is_global_zero, gather)

    def complete() -> None:
        _agree(flush, "writing", path, tmp, is_global_zero, gather)
        _agree(commit if is_global_zero else None, "committing", path, tmp, is_global_zero, gather)

    pending = Pending(complete, written=lambda: not isinstance(written[0], Future) or written[0].done())
    if background:
        return pending
    pending.complete()
    return None


def _agree(action, what: str, path: Path, tmp: Path, is_global_zero: bool, gather) -> None:
    """Run ``action`` here, then learn how it went on every rank; any failure fails all of them."""

    def why(error: BaseException) -> str:
        text = describe_error(error)
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else None
        if free is not None and free < 1 << 20:  # torch's zip writer hides ENOSPC behind "unexpected pos"
            text += f" (the disk is full: {free} bytes free under {path.parent})"
        return text

    try:
        shared_outcome(action, gather, why)
    except SharedFailure as failure:
        if is_global_zero:
            shutil.rmtree(tmp, ignore_errors=True)
        (rank, _, cause), rest = failure.failures[0], failure.failures[1:]
        others = f" (and on rank{'s' if len(rest) > 1 else ''} {', '.join(str(r) for r, _, _ in rest)})" if rest else ""
        raise CheckpointError(
            f"checkpoint {path} was not written: rank {rank} failed while {what} it{others}: "
            f"{cause}; the previous checkpoint there, if any, is intact"
        ) from None


def describe_error(error: BaseException) -> str:
    """One line; DCP's CheckpointException carries each rank's own error."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(
            f"on rank {rank}: {describe_error(wrapped[0] if isinstance(wrapped, tuple) else wrapped)}"
            for rank, wrapped in sorted(failures.items())
        )
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def save_state_file(plain: dict[str, Any], directory: Path) -> list[Path]:
    """A whole checkpoint's state as ``directory/state.pt`` (the one file of a full checkpoint), with Lightning's keys
    beside distrain's (``lightning_keys``); the files written."""
    import torch

    torch.save(lightning_keys(plain), directory / STATE_FILE)
    return [directory / STATE_FILE]


def _one_file(tmp: Path, path: Path) -> bool:
    """Whether the checkpoint is committed as one file: named as one, its state one file, and no directory there."""
    return (
        path.suffix in FILE_SUFFIXES
        and [p.name for p in tmp.iterdir()] == [STATE_FILE]
        and not (path.is_dir() and not path.is_symlink())
    )


def commit_file(file: Path, path: Path) -> None:
    """A finished, flushed file onto ``path`` in one ``rename`` (atomic over an older checkpoint file)."""
    os.replace(file, path)
    _fsync_dir(path.parent)


def _write_manifest(tmp: Path) -> None:
    """Every file of the finished checkpoint and its size: what ``find_damage`` checks."""
    files = {
        str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file() and p.name != MANIFEST
    }
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"files": files}, indent=0))
    _fsync_files([manifest])
    _fsync_dir(tmp)


def commit_dir(tmp: Path, path: Path) -> None:
    """Move a finished temporary directory onto ``path``; see the module's docstring for why each step
    is safe to crash in."""
    if not (path.exists() or path.is_symlink()):
        os.replace(tmp, path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp, ignore_errors=True)  # now the old checkpoint
    else:  # a file system without RENAME_EXCHANGE
        replaced = path.with_name(f".{path.name}{REPLACED}")
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(path, replaced)
        _fsync_dir(path.parent)  # a crash from here on: `recover` puts the old one back
        try:
            os.replace(tmp, path)
        except BaseException:
            os.replace(replaced, path)
            raise
        _fsync_dir(path.parent)
        shutil.rmtree(replaced, ignore_errors=True)
    _fsync_dir(path.parent)


def recover(directory: Path) -> None:
    """Undo what a crash in the middle of a commit left in ``directory``: a checkpoint renamed away to be
    replaced goes back to its name when nothing took its place (else it is removed); a half-written
    temporary directory is removed. Call it where no rank is writing (rank 0, before a resume or a write)."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if not entry.name.startswith("."):
            continue
        if entry.name.endswith(REPLACED):
            original = entry.with_name(entry.name[1 : -len(REPLACED)])
            if original.exists():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                os.replace(entry, original)
                _fsync_dir(directory)
        elif entry.name.endswith(WRITING):
            shutil.rmtree(entry, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """``renameat2(a, b, RENAME_EXCHANGE)`` (Linux ≥ 3.15, glibc ≥ 2.28; ext4, xfs, btrfs, tmpfs)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _fsync_files(files: Iterable[Path]) -> None:
    directories = set()
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        directories.add(Path(file).parent)
    for directory in directories:
        _fsync_dir(directory)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def point_last(dirpath: str | os.PathLike, target: str | os.PathLike, name: str = LAST) -> None:
    """Make ``dirpath/last`` (or ``dirpath/<name>``: Lightning's ``last.ckpt``) a symlink to ``target``, replaced
    atomically. A real directory there — what ``aws s3 sync``, ``gsutil cp -r`` or ``rsync -L`` make of the link in a
    copied run — is a checkpoint of its own, and a file there (Lightning's own ``last.ckpt``) someone's: either is
    kept, renamed ``last.copy`` (``last.copy-2``, … when taken), and said once."""
    dirpath = Path(dirpath)
    link = dirpath / name
    tmp = dirpath / f".{name}.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, dirpath), tmp)
    if link.exists() and not link.is_symlink():
        kind = "directory" if link.is_dir() else "file"
        kept = next(
            dirpath / copy
            for n in range(1, 1 << 16)
            if not (dirpath / (copy := f"{name}.copy" + (f"-{n}" if n > 1 else ""))).exists()
        )
        os.replace(link, kept)
        warnings.warn(
            f"distrain: {link} was a {kind}, not a link (a synced or copied run?): "
            f"kept as {kept}; "
            f"`{name}` now links to {target}",
            stacklevel=2,
        )
    os.replace(tmp, link)
    _fsync_dir(dirpath)


def is_checkpoint_name(name: str) -> bool:
    """A name a checkpoint directory may have inside its run's checkpoint directory: one path component, not
    hidden (the names ``write_checkpoint`` and ``recover`` use start with a dot), not ``last``."""
    return (
        isinstance(name, str)
        and bool(name)
        and name == Path(name).name
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and not name.startswith(".")
        and name != LAST
    )


def is_checkpoint(path: Path) -> bool:
    """A real directory (not a link) holding what distrain writes into every checkpoint, or a checkpoint file."""
    return (
        path.is_dir()
        and not path.is_symlink()
        and any((path / marker).is_file() for marker in (MANIFEST, STATE_FILE, META_FILE))
    ) or is_checkpoint_file(path)


def is_checkpoint_file(path: Path) -> bool:
    """A real file (not a link) named as a checkpoint file, written by ``torch.save`` (a zip archive) and holding a
    distrain checkpoint: its pickle (read as bytes, never run) names ``CHECKPOINT_FORMAT``. Anyone's other file there
    (a model someone saved beside the checkpoints, Lightning's own checkpoint) is not one, and is never deleted."""
    if path.suffix not in FILE_SUFFIXES or not path.is_file() or path.is_symlink():
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [info for info in archive.infolist() if info.filename.endswith("/data.pkl")]
            if len(pickles) != 1 or pickles[0].file_size > MAX_PICKLE_BYTES:
                return False
            return CHECKPOINT_FORMAT.encode() in archive.read(pickles[0])
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def remove_checkpoint(path: str | os.PathLike, within: str | os.PathLike) -> None:
    """Delete a checkpoint directory that sits directly inside ``within``; anything else (a path elsewhere, a link,
    a directory that is no checkpoint) is refused: a deletion must never reach outside the run's own checkpoints."""
    path = Path(path)
    if not (path.exists() or path.is_symlink()):  # removed by hand meanwhile
        return
    if path.parent.resolve() != Path(within).resolve() or not is_checkpoint_name(path.name):
        raise CheckpointError(f"refusing to delete {path}: it is not a checkpoint inside {within}")
    if not is_checkpoint(path):
        raise CheckpointError(f"refusing to delete {path}: it is not a checkpoint")
    if path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


# ---- reading -----------------------------------------------------------------------------------------------
def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory (``last`` links followed; Lightning's file names too: ``as_named_by_lightning``), or a
    clear error."""
    path = as_named_by_lightning(Path(path))
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    return path.resolve()


def as_named_by_lightning(path: Path) -> Path:
    """Lightning's name of a checkpoint, a ``.ckpt`` file (``checkpoints/last.ckpt``, ``epoch=0-step=4.ckpt``), as
    the directory distrain wrote beside it under the same name without ``.ckpt`` (``last``, ``epoch=0-step=4``).
    A path that exists is itself; the name never leaves the folder it was given in."""
    if path.suffix == ".ckpt" and not path.exists() and not path.is_symlink():
        directory = path.with_suffix("")
        if directory.exists():
            return directory
    return path


def load_file(file: Path) -> Any:
    """One checkpoint file, weights-only (``safe_load``); a damaged file is a CheckpointError naming it
    (and the newest intact checkpoint beside it)."""
    try:
        return safe_load.load_torch_file(file)
    except safe_load.UnsafeCheckpointError:
        raise
    except Exception as e:  # a truncated or corrupt file
        raise CheckpointError(describe_damage(file, e)) from None


def read_state_file(path: str | os.PathLike) -> dict[str, Any]:
    path = resolve_checkpoint(path)
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a distrain checkpoint: {STATE_FILE} is missing")
    return load_file(file)


def describe_damage(file: Path, error: BaseException) -> str:
    """One line: which file is damaged, why, and the newest intact checkpoint next to it."""
    checkpoint = _checkpoint_of(Path(file))
    cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    intact = newest_intact(checkpoint.parent, exclude=checkpoint) if checkpoint is not None else None
    where = f"the newest intact checkpoint is {intact}" if intact else "no intact checkpoint is left beside it"
    return f"checkpoint file {file} is damaged or incomplete ({type(error).__name__}: {cause[:200]}); {where}"


def _checkpoint_of(file: Path) -> Path | None:
    """The checkpoint a file belongs to: the directory it sits in (perhaps in a subdirectory, e.g. DeepSpeed's), or,
    in none, itself (a checkpoint file)."""
    for parent in [file.parent, *file.parents]:
        if (parent / STATE_FILE).exists() or (parent / META_FILE).exists():
            return parent.resolve()
    if file.suffix in FILE_SUFFIXES:
        return file.resolve()
    return None


def checkpoints_newest_first(dirpath: Path, exclude: Path | None = None) -> list[Path]:
    """The checkpoints (directories and files) in ``dirpath``, the most recently written first."""
    if not dirpath.is_dir():
        return []
    found = [p for p in dirpath.iterdir() if not p.name.startswith(".") and is_checkpoint(p)]
    found = [p.resolve() for p in found if exclude is None or p.resolve() != exclude]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def newest_intact(dirpath: Path, exclude: Path | None = None) -> Path | None:
    return next((p for p in checkpoints_newest_first(dirpath, exclude) if find_damage(p) is None), None)


def find_damage(path: Path) -> str | None:
    """What is damaged or missing in a checkpoint directory, or None when it is whole. With a manifest
    (every checkpoint distrain writes): each file there at its recorded size — a ``stat`` per file,
    nothing read. Without one (older checkpoints): each torch file's zip directory opens, and DCP's
    shard files are as long as ``.metadata`` says. A checkpoint file: its zip directory opens."""
    try:
        if path.is_file():
            zipfile.ZipFile(path).close()  # reads the central directory at the end: a truncated file has none
            return None
        manifest = path / MANIFEST
        if manifest.is_file():
            for name, size in json.loads(manifest.read_text())["files"].items():
                file = path / name
                if Path(name).is_absolute() or ".." in Path(name).parts or type(size) is not int:
                    return f"{manifest} lists {name!r}, which is not a file of the checkpoint"
                if not file.is_file():
                    return f"{file} is missing"
                if file.stat().st_size != size:
                    return f"{file}: {file.stat().st_size} bytes, {size} when it was written"
            return None
        for file in sorted(path.rglob("*.pt")):
            zipfile.ZipFile(file).close()  # reads the central directory at the end: a truncated file has none
        if (path / ".metadata").is_file():
            safe_load.read_dcp_metadata(path)  # checks each storage entry against its file's size
    except Exception as e:  # noqa: BLE001 — any failure to read it means it is not intact
        return f"{type(e).__name__}: {e}"
    return None


def warn_fallback(wanted: Path, problem: str, used: Path) -> None:
    warnings.warn(
        f"distrain: {wanted} is damaged ({problem}); resuming from {used}, the newest intact checkpoint", stacklevel=3
    )
