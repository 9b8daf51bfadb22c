"""Run directories: the default one, and what a new run does with a folder that already holds an earlier run.

A new run never writes over an earlier one (metrics appended to its ``metrics.jsonl``, a second TensorBoard event
file beside its own, its checkpoint replaced), whichever way it was started:

- ``distrain train`` refuses such a folder in one line, unless ``--resume`` (go on with that run) or ``--overwrite``
  (say which files of the earlier run it removes, then remove those and nothing else). A command line names its
  folder, and a job script that restarts passes ``--resume auto``: a second fresh run there is more likely a slip.
- The ``Trainer`` writes its run into ``default_root_dir`` while that holds no run, else into the next
  ``version_N`` inside it, as Lightning's ``version_N`` folders: a notebook cell run again gets a folder of its own.
  A resume (``ckpt_path="last"``/``"auto"``, or a checkpoint inside one of its runs) goes on in that run's folder.

Start-up leftovers alone (``config.yaml``, ``logs/``) do not make a folder an earlier run: a start that failed
before training leaves them, and the next start appends to those logs. They are also what ranks write before they
meet, so ranks that look at the folder at different moments (under torchrun each rank chooses for itself) see the
same runs.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

#: ``distrain train --output-dir`` and ``Trainer(default_root_dir=...)`` when none is given (relative to the cwd)
DEFAULT = "runs/distrain"

#: what a run writes into its folder (``replica_<id>/`` and ``version_<n>/`` hold runs of their own)
RUN_FILES = (
    "metrics.jsonl",
    "tensorboard",
    "checkpoints",
    "plots",
    "PREEMPTED",
    "flight_recorder",
    "mlflow.db",
    "wandb",
    "deepspeed_config.json",
    "hf",
    "config.yaml",
    "logs",
)
STARTUP_FILES = ("config.yaml", "logs")
_VERSION = re.compile(r"version_(\d+)")
_REPLICA = re.compile(r"replica_\d+")


def run_files(directory: str | os.PathLike, versions: bool = True) -> list[Path]:
    """The earlier run's files in ``directory`` (its replica groups' and, with ``versions``, its versions'
    folders), or [] when it holds no run."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    entries = [
        p
        for p in sorted(directory.iterdir())
        if p.name in RUN_FILES or _REPLICA.fullmatch(p.name) or (versions and _VERSION.fullmatch(p.name))
    ]
    return entries if any(_holds_run(p) for p in entries) else []


def _holds_run(path: Path) -> bool:
    if path.name in STARTUP_FILES:
        return False
    if _REPLICA.fullmatch(path.name) or _VERSION.fullmatch(path.name):
        return bool(run_files(path))
    return not path.is_dir() or any(path.iterdir())  # an empty folder records nothing


# ---- distrain train --------------------------------------------------------------------------------------------
def claim(directory: str | os.PathLike, resume: str | None, overwrite: bool, checkpoint_dir: str | None) -> None:
    """``distrain train``'s rule, applied before anything is written: an earlier run in ``directory`` (or
    checkpoints in a ``checkpoint_dir`` of its own) is refused unless ``resume``; ``overwrite`` removes exactly
    those files, after naming them. Raises FileExistsError (one line)."""
    if resume and overwrite:
        raise FileExistsError(f"--resume {resume} and --overwrite: choose one (go on with the run, or replace it)")
    found = run_files(directory)
    extra = Path(checkpoint_dir) if checkpoint_dir and "://" not in checkpoint_dir else None  # a URL: no run's own
    if extra is not None and Path(directory).resolve() not in (extra.resolve(), *extra.resolve().parents):
        found += _checkpoints_in(extra)
    if not found or resume:
        return
    names = ", ".join(_shown(p, directory) for p in found)
    if not overwrite:
        raise FileExistsError(
            f"{directory} holds an earlier run ({names}): --resume last goes on with it, --overwrite removes it, "
            "or give another --output-dir"
        )
    print(f"distrain: --overwrite: removing the earlier run's {names} from {directory}", flush=True)
    # moved aside first, one rename each, then removed: under torchrun or srun the other ranks start at once, and
    # one that already makes its logs/ makes a fresh one instead of failing the removal of the old
    aside = Path(directory) / f".overwritten-{os.getpid()}"
    aside.mkdir(parents=True)  # (the run's folder may not be there: only checkpoints elsewhere were)
    for path in found:
        if path.parent == aside.parent:
            path.rename(aside / path.name)
        elif path.is_dir() and not path.is_symlink():  # a checkpoint in a checkpoint folder of the run's own
            shutil.rmtree(path)
        else:
            path.unlink()
    shutil.rmtree(aside)


def _checkpoints_in(directory: Path) -> list[Path]:
    """The checkpoints (and ``last``) in a checkpoint folder outside the run's: only those are the run's."""
    from distrain.checkpoint.io import LAST, is_checkpoint

    if not directory.is_dir():
        return []
    return [p for p in sorted(directory.iterdir()) if p.name == LAST or is_checkpoint(p)]


def _shown(path: Path, directory) -> str:
    name = str(path) if path.parent != Path(directory) else path.name
    return name + "/" if path.is_dir() and not path.is_symlink() else name


def starts_the_run() -> bool:
    """Whether this process is the one that decides about the run's folder: not a rank that distrain's launcher
    started (it runs the same command line), not one replica group of several, not a restart of the run by
    torchrun (it goes on with the run), and rank 0 of an outside launcher (each rank runs the command line; when
    rank 0 refuses, the launcher ends the others)."""
    from distrain.cluster import detect_cluster, replica_group

    if os.environ.get("DISTRAIN_LAUNCHED") or replica_group() is not None:
        return False
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        return False
    cluster = detect_cluster()
    return cluster.rank == 0 and cluster.node_rank == 0 and os.environ.get("NODE_RANK", "0") == "0"


# ---- the Trainer -----------------------------------------------------------------------------------------------
def choose(root: str, ckpt_path) -> str:
    """The folder a Trainer's run writes in, inside ``root`` (see the module's docstring). A replica group of a
    fault-tolerant run keeps its ``replica_<id>`` folder: the groups choose apart, and a version would split them."""
    from distrain.cluster import replica_group

    if replica_group() is not None:
        return root
    runs = ([root] if run_files(root, versions=False) else []) + [str(p) for _, p in versions(root) if run_files(p)]
    if ckpt_path in ("last", "auto"):
        return runs[-1] if runs else root
    if ckpt_path is not None:
        checkpoint = Path(ckpt_path).resolve()
        inside = [run for run in runs if Path(run).resolve() in checkpoint.parents]
        if inside:
            return inside[-1]
    if not runs:
        return root
    newest = max((n for n, p in versions(root) if str(p) in runs), default=0)
    return os.path.join(root, f"version_{newest + 1}")


def versions(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """The ``version_N`` folders in ``root`` as (N, path), lowest N first: a Trainer's runs (``choose``), a logger's
    (``next_version``), a Lightning resume's earlier runs."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _VERSION.fullmatch(p.name)) and p.is_dir())


def next_version(root: str | os.PathLike) -> int:
    """One more than the highest ``version_N`` folder in ``root`` (0 where there is none), as Lightning's loggers
    number their runs."""
    return max((n for n, _ in versions(root)), default=-1) + 1
