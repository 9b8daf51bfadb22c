"""When to save: every n steps / epochs, the best k by a monitored metric, and always ``last``."""

from __future__ import annotations

import math
import re
import string
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

from distrain.callbacks.base import Callback
from distrain.checkpoint import CheckpointError
from distrain.checkpoint.io import (
    LAST,
    describe_error,
    is_checkpoint,
    is_checkpoint_name,
    point_last,
    remove_checkpoint,
)
from distrain.checkpoint.remote import RemoteDir, Uploads, is_url


class ModelCheckpoint(Callback):
    """Checkpoints are directories ``dirpath/<filename>``; ``dirpath/last`` links to the newest.

    ``save_top_k``: keep the k best by ``monitor`` (or, with no monitor, the k newest); -1 keeps all.
    ``filename`` may use ``{epoch}``, ``{step}`` and any logged metric, e.g. ``"{epoch}-{val_loss:.3f}"``;
    ``auto_insert_metric_name``: each field written as ``name=value`` (Lightning's default, there).

    Lightning's other arguments: ``save_weights_only`` (the model's weights and the run's records, without the
    optimizer and scheduler states: such a checkpoint is evaluated or fine-tuned from, never resumed),
    ``every_n_epochs``, ``save_on_train_epoch_end`` (False: save after each validation of fit instead; None, the
    default, decides as Lightning does: after each validation where fit validates inside its epochs),
    ``train_time_interval`` (a ``timedelta``: save when that much time passed since the last save, rank 0's clock),
    ``enable_version_counter`` (a name that exists gets ``-v1``, ``-v2``... rather than replacing it), ``verbose``.
    """

    #: appended to each checkpoint's name (Lightning's: ``.ckpt``, a directory named as Lightning's sharded
    #: strategies name theirs)
    FILE_EXTENSION = ""
    #: with ``save_last``, a second link to the newest checkpoint under this name (a ``filename``-style pattern) plus
    #: ``FILE_EXTENSION``, which ``last_model_path`` gives (Lightning's ``last.ckpt``); None: ``last`` alone
    CHECKPOINT_NAME_LAST: str | None = None

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str | None = "epoch={epoch}-step={step}",
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool | str = True,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        save_weights_only: bool = False,
        auto_insert_metric_name: bool = False,
        save_on_train_epoch_end: bool | None = None,
        train_time_interval: timedelta | None = None,
        enable_version_counter: bool = False,
        verbose: bool = False,
    ):
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint mode must be 'min' or 'max', got {mode!r}")
        if save_last not in (True, False, None, "link"):
            raise ValueError(f"ModelCheckpoint save_last must be True, False, None or 'link', got {save_last!r}")
        if train_time_interval is not None and not isinstance(train_time_interval, timedelta):
            raise ValueError(f"ModelCheckpoint train_time_interval must be a timedelta, got {train_time_interval!r}")
        #: a URL (``s3://bucket/prefix``): each checkpoint is written to its local stage, then copied up
        self.remote = RemoteDir(dirpath) if is_url(dirpath) else None
        self.dirpath = self.remote.stage if self.remote else Path(dirpath) if dirpath else None
        #: rank 0's uploads, in the background
        self.uploads = Uploads()
        filename = filename or "{epoch}-{step}"  # Lightning's None
        self.auto_insert_metric_name = auto_insert_metric_name
        self.filename = _with_metric_names(filename) if auto_insert_metric_name else filename
        self.save_weights_only = save_weights_only
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.train_time_interval = train_time_interval
        self.enable_version_counter = enable_version_counter
        self.verbose = verbose
        self._last_time_save = time.monotonic()
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = bool(save_last)  # "link": distrain's ``last`` is a link already
        #: whether the CHECKPOINT_NAME_LAST link is made (Lightning's subclass: only when its save_last asks)
        self.names_last = self.save_last
        self.every_n_train_steps = every_n_train_steps
        self.every_n_epochs = every_n_epochs if every_n_epochs is not None else (None if every_n_train_steps else 1)
        self.saved: list[tuple[float, str]] = []  # (score, path) of kept checkpoints
        self.best_model_path: str | None = None
        #: the newest checkpoint, where ``last`` points (with ``CHECKPOINT_NAME_LAST``: that link's path, or "")
        self.last_model_path: str | None = None
        self._newest: str | None = None  # never removed by save_top_k: `last` points at it
        self._last_link: str | None = None  # CHECKPOINT_NAME_LAST's link, as last named
        self._saving_link: str | None = None  # the one the checkpoint being written will have
        self._saving: tuple[float, str] | None = None  # (score, path) of the checkpoint being written
        self._last_saved_step = -1
        self._warned = False
        self._warned_names = False

    def write_to(self, url: str) -> None:
        """Checkpoints in object storage at ``url`` (``Trainer(default_root_dir=<url>)`` chose it)."""
        self.remote = RemoteDir(url)
        self.dirpath = self.remote.stage

    # ---- the kept checkpoints as Lightning's ModelCheckpoint tells them (read-only) ---------------------------------
    @property
    def best_k_models(self) -> dict:
        """Each kept checkpoint's path and its ``monitor`` value (a tensor), as Lightning's; empty without a monitor."""
        return {path: self._value(score) for score, path in self._top_k()} if self.monitor is not None else {}

    @property
    def best_model_score(self):
        """The best kept checkpoint's ``monitor`` value (a tensor); None without a monitor or before a save."""
        kept = self._top_k()
        return self._value(kept[0][0]) if self.monitor is not None and kept else None

    @property
    def kth_best_model_path(self) -> str:
        """The worst of the ``save_top_k`` kept (the next to go); "" without a monitor, as in Lightning."""
        kept = self._top_k()
        return kept[-1][1] if self.monitor is not None and kept else ""

    @property
    def kth_value(self):
        """``kth_best_model_path``'s value; infinitely bad (inf for mode "min") while there is none."""
        import torch

        kept = self._top_k()
        if self.monitor is not None and kept:
            return self._value(kept[-1][0])
        return torch.tensor(math.inf if self.mode == "min" else -math.inf)

    def _top_k(self) -> list[tuple[float, str]]:
        """The ranked checkpoints within ``save_top_k`` (``saved`` also keeps the one ``last`` points at)."""
        return self.saved if self.save_top_k < 0 else self.saved[: self.save_top_k]

    def _value(self, score: float):
        """A score (higher is better) as the monitored value it came from."""
        import torch

        return torch.tensor(score if self.mode == "max" else -score)

    @property
    def state_key(self) -> str:
        """Two checkpoint callbacks that watch different things keep their states apart (Lightning's key)."""
        return self._generate_state_key(
            monitor=self.monitor,
            mode=self.mode,
            every_n_train_steps=self.every_n_train_steps,
            every_n_epochs=self.every_n_epochs,
        )

    def setup(self, trainer, module, stage: str) -> None:
        """With no ``dirpath`` given: ``checkpoints`` in the run's log directory. A URL: on one node (each node's
        stage holds its own ranks' files only), and writable, said before the first checkpoint's training."""
        if self.dirpath is None:
            self.dirpath = Path(trainer.log_dir) / "checkpoints"
        if self.remote is not None and stage == "fit":
            if trainer.num_nodes > 1:
                raise ValueError(
                    f"ModelCheckpoint(dirpath={self.remote.url!r}): checkpoints in object storage are written from "
                    f"one node; this run has {trainer.num_nodes} (give a shared file system path)"
                )
            if trainer.is_global_zero:
                self.remote.check_writable()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        """Saves every ``every_n_train_steps`` optimizer steps, and when ``train_time_interval`` has passed."""
        if self.every_n_train_steps and trainer.global_step % self.every_n_train_steps == 0:
            self.save(trainer)
        elif self.train_time_interval is not None:  # rank 0's clock decides for all: the ranks save together
            due = lambda: time.monotonic() - self._last_time_save >= self.train_time_interval.total_seconds()  # noqa: E731
            if trainer.runtime.decided_on_rank_zero(due):
                self.save(trainer)

    def on_train_epoch_end(self, trainer, module) -> None:
        """Saves at the end of every ``every_n_epochs``-th epoch (each epoch unless ``every_n_train_steps`` is
        given), or after each validation of fit instead (``_saves_on_train_epoch_end``)."""
        if self._saves_on_train_epoch_end(trainer) and self._epoch_due(trainer):
            self.save(trainer)

    def on_validation_end(self, trainer, module) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking and not self._saves_on_train_epoch_end(trainer):
            if self._epoch_due(trainer):
                self.save(trainer)

    def _saves_on_train_epoch_end(self, trainer) -> bool:
        """``save_on_train_epoch_end``; where not given, Lightning's rule: at the epoch's end when fit validates at
        most once an epoch, at its end, else after each validation (``val_check_interval`` inside the epoch,
        ``check_val_every_n_epoch`` above 1), so that a checkpoint has the metrics of the validation just run."""
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        if trainer.check_val_every_n_epoch != 1:
            return False
        if trainer.val_dataloaders is None or trainer.loop.limit_val_batches == 0:
            return True
        return trainer.val_check_interval in (None, 1.0)

    def _epoch_due(self, trainer) -> bool:
        return bool(self.every_n_epochs) and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    def on_train_end(self, trainer, module) -> None:
        """Saves when training ends, with ``save_last``: a finished run can be resumed or inspected."""
        if self.save_last:  # a finished run can always be resumed or inspected
            self.save(trainer)

    def on_fit_end(self, trainer, module) -> None:
        """The last upload is in object storage before fit returns; one that failed fails the run, on every rank."""
        if self.remote is not None:
            trainer.runtime.decided_on_rank_zero(self.uploads.wait)

    def teardown(self, trainer, module, stage: str) -> None:
        """A failed run still finishes the upload in flight (a committed checkpoint to resume from), and says when
        that failed too, without hiding the run's own error."""
        try:
            self.uploads.wait()
        except Exception as e:  # noqa: BLE001 — the run's own error is the one raised
            print(f"distrain: {e}", file=sys.stderr, flush=True)

    def _score(self, trainer) -> float:
        if self.monitor is None:
            return float(trainer.global_step)  # "best" = newest
        if self.monitor not in trainer.callback_metrics:
            # e.g. a step checkpoint before the first validation: save it, rank it worst
            if trainer.is_global_zero and not self._warned:
                warnings.warn(
                    f"ModelCheckpoint(monitor={self.monitor!r}): no such metric logged yet at step "
                    f"{trainer.global_step} (logged: {', '.join(sorted(trainer.callback_metrics)) or 'nothing'}); "
                    "ranking this checkpoint last",
                    stacklevel=2,
                )
                self._warned = True
            return -math.inf
        value = float(trainer.callback_metrics[self.monitor])
        return value if self.mode == "max" else -value

    def save(self, trainer) -> None:
        """Save a checkpoint now, every rank together (nothing when one was saved at this step already): named by
        ``format_name`` on rank 0, scored by ``monitor``. Once it is on disk, ``last`` points at it and the
        checkpoints beyond ``save_top_k`` are removed; one with non-finite weights is kept but not made ``last``."""
        if trainer.global_step == self._last_saved_step:
            return
        self._last_saved_step = trainer.global_step
        score = self._score(trainer)
        # Rank 0 names the checkpoint and every rank writes there: a name may use metrics that
        # differ per rank (step time, tokens/s), and a sharded checkpoint needs every rank's shards.
        # A name that cannot be made (a bad format) fails on every rank, not on rank 0 alone.
        # The second `last` link's name too (a pattern may use metrics), decided once with it: the checkpoint records
        # it, and the commit (perhaps steps later, for an asynchronous save) makes that one.
        name, link = trainer.runtime.decided_on_rank_zero(lambda: self._new_names(trainer))
        path = self.dirpath / name
        # the checkpoint's own record of the kept ones (``state_dict``) counts it: resumed from, it is still ranked
        self._saving = (score, str(path))
        self._saving_link = link  # the `last` link this save makes: a resume moves it on
        try:
            then = lambda finite: self._committed(trainer, path, score, finite, link)  # noqa: E731
            trainer.checkpoints.save(path, then=then, weights_only=self.save_weights_only)
        finally:
            self._saving = None
        self._last_time_save = time.monotonic()
        if self.verbose and trainer.is_global_zero:
            print(f"distrain: step {trainer.global_step}: checkpoint saved to {path}", flush=True)

    def _committed(self, trainer, path: Path, score: float, finite: bool, link: str | None) -> None:
        """Once the checkpoint is on disk under its name: ``last`` (and ``link``, CHECKPOINT_NAME_LAST's) moves to it,
        and only then are older ones removed."""
        if not finite:  # kept for a post-mortem, but never what a resume picks up
            if trainer.is_global_zero:
                warnings.warn(
                    f"distrain: the checkpoint at step {trainer.global_step} holds non-finite weights: written to "
                    f"{path}, but `last` still points at {self._newest}",
                    stacklevel=2,
                )
            return
        self._newest = str(path)
        if self.CHECKPOINT_NAME_LAST is None:
            self.last_model_path = self._newest
        elif link is not None:
            self.last_model_path = str(self.dirpath / link)
        else:
            self.last_model_path = ""  # Lightning's, without save_last

        def after_commit() -> str | None:
            if self.save_last:
                point_last(self.dirpath, path)
                if link is not None:
                    point_last(self.dirpath, path, name=link)
                    before = self.dirpath / self._last_link if self._last_link not in (None, link) else None
                    if before is not None and before.is_symlink():  # a pattern with {epoch}: the link before goes
                        before.unlink()
                    self._last_link = link
            stale = self._keep_top_k(score, str(path))
            if self.remote is None:
                self._remove(stale)
            else:  # up in the background (after the upload before it), then the pruned ones go
                self.uploads.submit(lambda: self._upload(path, stale))
            return self.best_model_path, self.saved

        # rank 0 alone moves `last` and removes stale checkpoints; a failure there (a full disk, a `last` that a
        # sync made a directory) reaches every rank at once instead of leaving them in a barrier until the timeout.
        # Every rank knows the kept ones after (best_model_score, best_k_models), as in Lightning
        self.best_model_path, self.saved = trainer.runtime.decided_on_rank_zero(after_commit)

    def _new_names(self, trainer) -> tuple[str, str | None]:
        """The checkpoint's name (``format_name``'s and ``FILE_EXTENSION``; with ``enable_version_counter``, a name
        that exists already gets ``-v1``, ``-v2``... before the extension) and its second `last` link's (None: none)."""
        link = self._last_link_name(trainer)
        name = base = self.format_name(trainer)
        version = 1
        while self.enable_version_counter and (self.dirpath / (name + self.FILE_EXTENSION)).exists():
            name, version = f"{base}-v{version}", version + 1
        name += self.FILE_EXTENSION
        if not is_checkpoint_name(name) or name == link:
            raise ValueError(
                f"ModelCheckpoint(filename={self.filename!r}) gives {name!r}, which is not one directory name inside "
                f"{self.dirpath} (no '/', not empty, not starting with '.', not a name of `last`)"
            )
        return name, link

    def _last_link_name(self, trainer) -> str | None:
        """``CHECKPOINT_NAME_LAST`` formatted, with ``FILE_EXTENSION``: the second link's name (None: no such link)."""
        if self.CHECKPOINT_NAME_LAST is None or not self.names_last:
            return None
        pattern = self.CHECKPOINT_NAME_LAST
        name = self._format(_with_metric_names(pattern) if self.auto_insert_metric_name else pattern, trainer)
        name += self.FILE_EXTENSION
        if not is_checkpoint_name(name):
            raise ValueError(
                f"ModelCheckpoint.CHECKPOINT_NAME_LAST={self.CHECKPOINT_NAME_LAST!r} gives {name!r}, which is not one "
                f"directory name inside {self.dirpath}"
            )
        return name

    def format_name(self, trainer) -> str:
        """The checkpoint's name from ``filename``. A metric it uses that is not logged yet (``{val_loss}``
        before the first validation) is 0, as in Lightning, and said once."""
        fields = {**trainer.callback_metrics, "epoch": trainer.current_epoch, "step": trainer.global_step}
        used = {
            field.split(".")[0].split("[")[0] for _, field, _, _ in string.Formatter().parse(self.filename) if field
        }
        missing = sorted(used - fields.keys())
        if missing and not self._warned_names:
            warnings.warn(
                f"ModelCheckpoint(filename={self.filename!r}): {', '.join(missing)} not logged yet at step "
                f"{trainer.global_step}; 0 stands in for {'them' if len(missing) > 1 else 'it'} in the name",
                stacklevel=3,
            )
            self._warned_names = True
        return self._format(self.filename, trainer, **dict.fromkeys(missing, 0))

    def _format(self, pattern: str, trainer, **missing) -> str:
        # the loop's own epoch and step win over logged metrics of those names (a resumed run's restored metrics
        # would name the checkpoint `epoch=0.0-step=5`; a user metric called `step` would rename every one)
        fields = {**trainer.callback_metrics, "epoch": trainer.current_epoch, "step": trainer.global_step, **missing}
        try:
            return pattern.format(**fields)
        except (ValueError, KeyError, IndexError, AttributeError, TypeError) as e:
            raise ValueError(f"ModelCheckpoint(filename={pattern!r}) cannot be formatted: {e}") from None

    def _upload(self, path: Path, stale: list[str]) -> int:
        """Up, manifest last, then `last`; what a killed upload left goes first, the pruned ones after."""
        try:
            for name in self.remote.remove_uncommitted(keep=path.name):
                print(f"distrain: removed {self.remote.url}/{name}: an upload that never committed", flush=True)
            sent = self.remote.upload(path)
            self._remove(stale)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 — a denied prefix, a bucket gone: one line, as the others
            raise CheckpointError(
                f"{self.remote.url}: uploading {path.name}: {describe_error(e)}; the previous checkpoint stays the "
                "newest"
            ) from None
        return sent

    def _enters_top_k(self, score: float) -> bool:
        """Whether a checkpoint scored ``score`` is among the ``save_top_k`` best kept (strictly better than the
        worst of a full set, as Lightning ranks a tie)."""
        kept = [s for s, _ in self._top_k()]
        return self.save_top_k < 0 or len(kept) < self.save_top_k or score > min(kept)

    def _keep_top_k(self, score: float, path: str) -> list[str]:
        """Ranks ``path`` among the kept ones; the checkpoints to remove now."""
        self.saved = _ranked(self.saved, score, path)
        stale = []
        if self.save_top_k >= 0:
            # never delete what `last` points to
            stale = [p for _, p in self.saved[self.save_top_k :] if p != self._newest]
            self.saved = [sp for sp in self.saved[: self.save_top_k]] + [
                sp for sp in self.saved[self.save_top_k :] if sp[1] == self._newest
            ]
        self.best_model_path = self.saved[0][1] if self.saved else None
        return stale

    def _remove(self, stale: list[str]) -> None:
        for path in stale:
            if self.remote is not None:
                self.remote.remove(Path(path).name)
            remove_checkpoint(path, within=self.dirpath)

    def state_dict(self) -> dict:
        """The kept checkpoints with their scores, and the best one: by name, inside ``dirpath``. Taken while a
        checkpoint of this callback is being written, the list holds that one too: a run resumed from it goes on
        ranking it (it was left on disk, never deleted, and the best could point past it). What was removed after
        the save is not there on a resume, and is dropped then (``load_state_dict``)."""
        saved, best, link = self.saved, self.best_model_path, self._last_link
        if self._saving is not None:
            saved = _ranked(saved, *self._saving)
            best, link = saved[0][1], self._saving_link or link
        # names, not paths: the list means something only inside this run's own checkpoint directory
        state = {"saved": [[s, Path(p).name] for s, p in saved], "best_model_path": Path(best).name if best else None}
        return {**state, "last_link": link} if link else state

    def load_state_dict(self, state: dict) -> None:
        """The checkpoints this callback goes on ranking — and later deletes — are only checkpoint directories inside
        its own ``dirpath``. A checkpoint is someone else's file: an entry naming another run's checkpoint (a run
        started with ``--resume`` from another output directory) or any other directory is dropped, never deleted."""
        entries = state.get("saved", []) if isinstance(state, dict) else []
        saved = []
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], (int, float)):
                path = self._own_checkpoint(entry[1])
                if path is not None and not math.isnan(entry[0]):
                    saved.append((float(entry[0]), path))
        self.saved = saved
        best = self._own_checkpoint(state.get("best_model_path")) if isinstance(state, dict) else None
        self.best_model_path = best if best is not None else (self.saved[0][1] if self.saved else None)
        # the `last` link of a CHECKPOINT_NAME_LAST pattern, moved on (its old name removed) at the next save: only a
        # link by that name inside dirpath, to one of its checkpoints
        link = state.get("last_link") if isinstance(state, dict) else None
        ours = isinstance(link, str) and is_checkpoint_name(link) and self.dirpath is not None
        if ours and (self.dirpath / link).is_symlink():
            ours = self._own_checkpoint(str((self.dirpath / link).resolve())) is not None
        self._last_link = link if ours and (self.dirpath / link).is_symlink() else None

    def _own_checkpoint(self, entry) -> str | None:
        """``dirpath/<name>`` for a name (or a path whose directory is ``dirpath``) of a checkpoint directory that
        is there now; None for anything else."""
        if not isinstance(entry, str) or self.dirpath is None or "\0" in entry:
            return None
        name = Path(entry).name
        if entry != name and Path(entry).parent.resolve() != self.dirpath.resolve():
            return None
        candidate = self.dirpath / name
        if not is_checkpoint_name(name) or not is_checkpoint(candidate):
            return None
        return str(candidate)


def _with_metric_names(filename: str) -> str:
    """Lightning's ``auto_insert_metric_name``: each ``{name...}`` field of ``filename`` as ``name={name...}``."""
    return re.sub(r"\{([^{}:!\[.]+)([^{}]*)\}", lambda m: f"{m.group(1)}={{{m.group(1)}{m.group(2)}}}", filename)


def _ranked(saved: list[tuple[float, str]], score: float, path: str) -> list[tuple[float, str]]:
    """``saved`` with ``path`` (once) at ``score``, best first."""
    ranked = [(s, p) for s, p in saved if p != path] + [(score, path)]
    return sorted(ranked, key=lambda sp: sp[0], reverse=True)


__all__ = ["ModelCheckpoint", "LAST"]
