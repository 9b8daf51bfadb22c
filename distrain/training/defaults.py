"""What a Trainer runs beside the loop unless told otherwise: its default callbacks (checkpoints, the progress bar,
the summary plot, parameter histograms) and loggers (JSON lines, TensorBoard)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from distrain.callbacks import Callback, ModelCheckpoint, PlotSummary, ProgressBar
from distrain.cluster import replica_run_dir
from distrain.loggers import JSONLLogger, Logger, TensorBoardLogger


def callback_list(callbacks: Iterable[Callback] | Callback | None) -> list[Callback]:
    """A callback, an iterable of them, or None, as a new list."""
    return [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])


def default_callbacks(
    callbacks: Iterable[Callback] | Callback | None,
    checkpointing: bool,
    progress_bar: bool,
    plots: bool,
    histogram_every_n_steps: int | None,
    checkpoint_class: type[ModelCheckpoint] = ModelCheckpoint,
) -> list[Callback]:
    """The user's callbacks, and the defaults they did not give one of: a ``checkpoint_class`` (its folder in the
    replica group's run directory of a fault-tolerant run), a ``ProgressBar``, a ``PlotSummary`` and, when asked,
    ``ParameterHistograms``; the checkpoint callbacks last. Two that would keep their state under one key are
    refused."""
    callbacks = callback_list(callbacks)
    if checkpointing and not any(isinstance(c, ModelCheckpoint) for c in callbacks):
        callbacks.append(checkpoint_class())
    for cb in callbacks:
        if isinstance(cb, ModelCheckpoint) and cb.remote is not None:  # in object storage: the group's own prefix
            cb.write_to(replica_run_dir(cb.remote.url))
        elif isinstance(cb, ModelCheckpoint) and cb.dirpath is not None:
            cb.dirpath = Path(replica_run_dir(str(cb.dirpath)))
    if progress_bar and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(ProgressBar())
    if plots and not any(isinstance(c, PlotSummary) for c in callbacks):
        callbacks.append(PlotSummary())  # <log_dir>/plots/summary.png when training ends
    if histogram_every_n_steps is not None:  # weights and gradients, gathered one parameter at a time
        from distrain.callbacks.histograms import ParameterHistograms

        callbacks.append(ParameterHistograms(histogram_every_n_steps))
    check_state_keys(callbacks)
    # checkpoints last, as Lightning orders them: a checkpoint saved in a hook holds what the other callbacks did in
    # it (EarlyStopping's count at an epoch's end), so a run resumed from it goes on from there
    return [c for c in callbacks if not isinstance(c, ModelCheckpoint)] + [
        c for c in callbacks if isinstance(c, ModelCheckpoint)
    ]


def default_loggers(logger: bool | Logger | Iterable[Logger], root: str) -> list[Logger]:
    """``logger=True``: TensorBoard (first: ``trainer.logger``, as Lightning's default) and JSON lines under ``root``;
    False: none; else the user's."""
    if logger is True:
        return [TensorBoardLogger(root), JSONLLogger(root)]
    if not logger:
        return []
    return [logger] if isinstance(logger, Logger) else list(logger)


def check_state_keys(callbacks: list[Callback]) -> None:
    """Two callbacks with state under one key would overwrite each other's in every checkpoint (and a resume would
    give both the survivor's): refused before anything runs, as Lightning refuses it."""
    seen: dict[str, Callback] = {}
    for cb in callbacks:
        if type(cb).state_dict is Callback.state_dict:  # keeps no state
            continue
        if cb.state_key in seen:
            raise ValueError(
                f"two {type(cb).__name__} callbacks keep their state under one key ({cb.state_key!r}), so each "
                "checkpoint would hold only one of them; make them differ in what the key is made of (for "
                "ModelCheckpoint: monitor, mode, every_n_train_steps or every_n_epochs)"
            )
        seen[cb.state_key] = cb
