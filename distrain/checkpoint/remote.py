"""Checkpoints in object storage: ``s3://bucket/prefix`` (or any URL fsspec serves: ``gs://``, ``az://``,
``file://``) as a checkpoint directory.

Object storage has no rename, so nothing is committed by moving it. A checkpoint is written exactly as on disk, into
a local stage directory (every strategy, the atomic local commit, the manifest), and then copied up:

- its files first, its ``manifest.json`` last: a checkpoint counts only once its manifest is there, so a reader
  never takes half of one (an upload a kill interrupted leaves objects without a manifest, which the next save
  removes and names);
- then ``last``, an object that names the newest committed checkpoint;
- a checkpoint the run prunes loses its manifest first, then its other objects.

The copy goes up in the background (``Uploads``): training goes on once the checkpoint is on the local disk, and
the next save, the end of fit, or a failed run waits for it. One upload at a time, so the stage never holds more
than the checkpoint going up and the one being written.

A resume from a URL reads the manifest (bounded; every name one relative path under the checkpoint), downloads the
files it lists in parallel into a local cache, checks each one's size against it, and loads that copy through the
same safe-load path as a local checkpoint. Credentials are fsspec's (the environment, the usual AWS config): nothing
here takes, logs or writes one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from distrain.checkpoint import CheckpointError
from distrain.checkpoint.io import LAST, MANIFEST, STATE_FILE, describe_error, is_checkpoint_name
from distrain.config import ConfigError

#: a URL fsspec serves: a scheme of letters, digits, '+', '-', '.', then ://
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
#: the largest manifest or ``last`` object read (a hostile one could be anything)
MAX_INDEX_BYTES = 16 << 20
#: uploads and downloads at once
PARALLEL = 8
#: a failed transfer is tried again after 1, 2 and 4 seconds, then named
RETRIES = (1.0, 2.0, 4.0)


def is_url(path: Any) -> bool:
    return isinstance(path, str) and bool(_URL.match(path))


def at(url: str) -> tuple[RemoteDir, str]:
    """``<dir>/<name>`` (``<dir>/last`` for the one ``last`` names): the directory, and the checkpoint's name."""
    base, _, name = url.rstrip("/").rpartition("/")
    return RemoteDir(base), name


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "distrain" / "remote"


class RemoteDir:
    """A checkpoint directory at ``url``, with the local stage its checkpoints are written to first."""

    def __init__(self, url: str):
        import fsspec

        self.url = url.rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as e:  # no package for the scheme: s3fs, gcsfs, adlfs
            raise CheckpointError(f"checkpoint directory {self.url}: {e}") from None
        self.root = self.root.rstrip("/")
        if hasattr(self.fs, "auto_mkdir"):  # a local file system (file://): folders as object keys have them
            self.fs.auto_mkdir = True
        digest = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        #: where this run writes each checkpoint before it goes up
        self.stage = cache_root() / "stage" / digest
        #: where a resume downloads one
        self.downloads = cache_root() / "download" / digest

    def __repr__(self) -> str:
        return self.url

    # ---- writing -------------------------------------------------------------------------------
    def check_writable(self) -> None:
        """Write and delete one small object: a bucket that does not exist, missing credentials or a prefix
        without permission are said now, in one line, rather than after the first checkpoint's training."""
        probe = f"{self.root}/.distrain-probe-{os.getpid()}"
        try:
            self.fs.pipe_file(probe, b"distrain")
            self.fs.rm_file(probe)
        except Exception as e:  # noqa: BLE001 — every backend names its failures differently: said as it says them
            raise ConfigError(f"cannot write checkpoints to {self.url}: {describe_error(e)}") from None

    def upload(self, checkpoint: Path) -> int:
        """Copy a committed local checkpoint up: its files, then its manifest; then ``last`` names it. An upload
        that fails (after ``RETRIES``) leaves the previous checkpoint the newest committed one. The bytes sent."""
        name = checkpoint.name
        target = f"{self.root}/{name}"
        if checkpoint.is_file():  # a checkpoint file: up as a checkpoint directory's one file, as every other is
            sources = {STATE_FILE: checkpoint}
            manifest = {"files": {STATE_FILE: checkpoint.stat().st_size}}
        else:
            manifest = json.loads((checkpoint / MANIFEST).read_text())
            sources = {rel: checkpoint / rel for rel in manifest["files"]}
        self._forget(name)  # a checkpoint replaced under the same name: its old manifest goes first
        with ThreadPoolExecutor(PARALLEL) as pool:
            list(pool.map(lambda rel: self._retry(self.fs.put_file, str(sources[rel]), f"{target}/{rel}"), sources))
        self._retry(self.fs.pipe_file, f"{target}/{MANIFEST}", json.dumps(manifest, indent=0).encode())
        self.point_last(name)
        return sum(manifest["files"].values())

    def point_last(self, name: str) -> None:
        self._retry(self.fs.pipe_file, f"{self.root}/{LAST}", json.dumps({"checkpoint": name}).encode())

    def remove(self, name: str) -> None:
        """Delete a checkpoint: its manifest first (it stops counting), then its other objects."""
        if not is_checkpoint_name(name):
            raise CheckpointError(f"refusing to delete {self.url}/{name}: not a checkpoint name")
        self._forget(name)
        if self._retry(self.fs.exists, f"{self.root}/{name}"):
            self._retry(self.fs.rm, f"{self.root}/{name}", recursive=True)

    def remove_uncommitted(self, keep: str | None = None) -> list[str]:
        """Remove what uploads a kill interrupted left: checkpoints with objects but no manifest (``keep``: the one
        being written now). The names removed."""
        removed = []
        for name in self._names():
            if name != keep and not self._retry(self.fs.exists, f"{self.root}/{name}/{MANIFEST}"):
                self._retry(self.fs.rm, f"{self.root}/{name}", recursive=True)
                removed.append(name)
        return removed

    def _forget(self, name: str) -> None:
        manifest = f"{self.root}/{name}/{MANIFEST}"
        if self._retry(self.fs.exists, manifest):
            self._retry(self.fs.rm_file, manifest)

    def _names(self) -> list[str]:
        try:
            entries = self._retry(self.fs.ls, self.root, detail=True)
        except FileNotFoundError:
            return []
        names = [PurePosixPath(e["name"]).name for e in entries if e.get("type") == "directory"]
        return sorted(n for n in names if is_checkpoint_name(n))

    def _retry(self, transfer, *args, **kwargs):
        """``transfer(*args, **kwargs)``, tried again after each of ``RETRIES``; then one line that names it."""
        for attempt, pause in enumerate((*RETRIES, None)):
            try:
                return transfer(*args, **kwargs)
            except (FileNotFoundError, PermissionError):  # a missing bucket, a denied prefix: no retry mends it
                raise
            except Exception as e:  # noqa: BLE001 — a network failure is botocore's, aiohttp's or OSError
                if pause is None:
                    what = transfer.__name__.lstrip("_")  # fsspec's sync wrappers: _ls, _exists
                    raise CheckpointError(
                        f"{self.url}: {what} failed {attempt + 1} times: {describe_error(e)}; the previous checkpoint "
                        "stays the newest"
                    ) from None
                time.sleep(pause)
        return None

    # ---- reading -------------------------------------------------------------------------------
    def last_name(self) -> str | None:
        """The checkpoint ``last`` names, or None when there is none yet."""
        data = self._read_small(f"{self.root}/{LAST}")
        if data is None:
            return None
        try:
            name = json.loads(data)["checkpoint"]
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f"{self.url}/{LAST} is not what distrain writes there") from None
        if not is_checkpoint_name(name):
            raise CheckpointError(f"{self.url}/{LAST} names {name!r}, which is no checkpoint inside {self.url}")
        return name

    def fetch(self, name: str) -> Path:
        """Download checkpoint ``name`` (committed: its manifest is there) into the local cache; its local path."""
        if not is_checkpoint_name(name):
            raise CheckpointError(f"{name!r} is not a checkpoint name inside {self.url}")
        source = f"{self.root}/{name}"
        raw = self._read_small(f"{source}/{MANIFEST}")
        if raw is None:
            raise CheckpointError(f"{self.url}/{name} is not a committed checkpoint (it has no {MANIFEST})")
        files = _manifest_files(raw, f"{self.url}/{name}/{MANIFEST}")
        local = self.downloads / name
        local.mkdir(parents=True, exist_ok=True)
        for stale in [p for p in local.rglob("*") if p.is_file()]:
            stale.unlink()  # an earlier download of another checkpoint of that name

        def get(rel: str) -> None:
            path = local / rel
            size = self.fs.size(f"{source}/{rel}")  # before a byte comes down: no more than the manifest says
            if size == files[rel]:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._retry(self.fs.get_file, f"{source}/{rel}", str(path))
                size = path.stat().st_size  # (an object replaced meanwhile)
            if size != files[rel]:
                raise CheckpointError(f"{self.url}/{name}/{rel} is {size} bytes, its manifest says {files[rel]}")

        with ThreadPoolExecutor(PARALLEL) as pool:
            list(pool.map(get, files))
        (local / MANIFEST).write_bytes(raw)
        return local

    def _read_small(self, path: str) -> bytes | None:
        try:
            size = self.fs.size(path)
        except FileNotFoundError:
            return None
        if size is None or size > MAX_INDEX_BYTES:
            raise CheckpointError(f"{path} is {size} bytes: larger than any index distrain writes")
        return self.fs.cat_file(path)


class Uploads:
    """Jobs (a checkpoint's upload, then what the run prunes) run one at a time in a thread of their own. ``submit``
    waits for the job before it; ``wait`` for the last, raising its error. ``seconds`` and ``bytes``: what the
    uploads so far took (the benchmark's throughput)."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self.seconds = 0.0
        self.bytes = 0

    def submit(self, job: Callable[[], int]) -> None:
        """``job`` returns the bytes it sent."""
        self.wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="distrain-upload")
        self._pending = self._pool.submit(self._timed, job)

    def _timed(self, job: Callable[[], int]) -> None:
        started = time.perf_counter()
        sent = job()
        self.seconds += time.perf_counter() - started
        self.bytes += sent

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __getstate__(self) -> dict:
        """Sent to spawned ranks (a callback a notebook's earlier fit used): the counts, not the thread."""
        return {**self.__dict__, "_pool": None, "_pending": None}


def _manifest_files(raw: bytes, source: str) -> dict[str, int]:
    """A manifest's files, each a relative path inside the checkpoint and a size, or a one-line error."""
    try:
        files = json.loads(raw)["files"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{source} is not a manifest distrain writes") from None
    if not isinstance(files, dict):
        raise CheckpointError(f"{source} is not a manifest distrain writes")
    for rel, size in files.items():
        parts = PurePosixPath(rel).parts if isinstance(rel, str) else ()
        inside = bool(parts) and not PurePosixPath(rel).is_absolute() and all(p not in ("", ".", "..") for p in parts)
        if not inside or "\\" in rel or "\0" in rel or rel == MANIFEST:
            raise CheckpointError(f"{source} lists {rel!r}, which is not a file inside the checkpoint")
        if type(size) is not int or size < 0:
            raise CheckpointError(f"{source} gives {rel!r} the size {size!r}")
    return files
