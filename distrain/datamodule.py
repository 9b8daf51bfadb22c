"""``distrain.DataModule``: the data of a run in one object, as Lightning's ``LightningDataModule``.

A Lightning user's datamodule runs with its import changed. Its hooks run in every rank, in Lightning's order:
``prepare_data`` on local rank 0 of each node (the others wait for it: a download happens once per machine),
then ``setup(stage)`` (``set_up_stage``), then the loader the stage needs (``stage_loader``).
"""

from __future__ import annotations

import inspect
from typing import Any

from torch.utils.data import DataLoader

from distrain.module import AttributeDict, hyperparameters_of

#: the loader each stage reads, and what Lightning calls it
STAGE_LOADERS = {
    "fit": "train_dataloader",
    "validate": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}


class DataModule:
    """Subclass and define the loaders your stages need; ``prepare_data`` and ``setup`` are optional."""

    #: False: ``prepare_data`` runs on global rank 0 only (files on a disk every node shares)
    prepare_data_per_node: bool = True

    def __init__(self) -> None:
        self.trainer = None  # set when a Trainer uses it, in every rank
        self.hparams = AttributeDict()

    def save_hyperparameters(self, *args: Any, ignore: str | list[str] | None = None, logger: bool = True) -> None:
        """The calling ``__init__``'s arguments in ``self.hparams`` (``self.hparams.batch_size``), as Lightning's."""
        self.hparams = AttributeDict(hyperparameters_of(inspect.currentframe().f_back, args, ignore))

    def prepare_data(self) -> None:
        """Download or write files: runs on local rank 0 of each node only, before every rank's ``setup``.
        Do not set state here (the other ranks never run it)."""

    def setup(self, stage: str) -> None:
        """In every rank: build datasets. ``stage`` is "fit", "validate", "test" or "predict"."""

    def teardown(self, stage: str) -> None:
        """Last in each stage (``stage`` as in ``setup``), after the module's ``teardown``; in ``fit`` also when
        training failed."""

    def state_dict(self) -> dict[str, Any]:
        """What this datamodule needs to resume (a curriculum's level, a stream's shard), as Lightning's: kept in
        every checkpoint when not empty (rank 0's; plain values and tensors). The position in the data is the
        checkpoint's own concern, not this."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``state_dict``'s counterpart: on a resume, in every rank, after ``setup("fit")`` and before
        ``train_dataloader()`` (Lightning's order), with what the checkpoint kept."""


def is_datamodule(obj: Any) -> bool:
    """A ``DataModule`` (or an object with its shape: ``train_dataloader`` and ``setup``, not a loader itself)."""
    if isinstance(obj, DataModule):
        return True
    loader_like = isinstance(obj, DataLoader) or not callable(getattr(obj, "train_dataloader", None))
    return not loader_like and hasattr(obj, "setup")


def prepare(obj: Any, runtime) -> None:
    """``obj.prepare_data()`` on local rank 0 of each node (global rank 0 with ``prepare_data_per_node = False``), the
    other ranks waiting at a barrier until it is done. At the start of every stage (fit, validate, ...), as Lightning
    does: it should skip what is already there."""
    if not callable(getattr(obj, "prepare_data", None)):
        return
    rank = runtime.local_rank if getattr(obj, "prepare_data_per_node", True) else runtime.global_rank
    if rank == 0:
        obj.prepare_data()
    if runtime.world_size > 1:
        runtime.barrier("prepare_data")


def set_up_stage(stage: str, trainer, module, datamodule, datamodule_state=None) -> None:
    """In a rank, before the module is set up: ``prepare_data`` (module's and datamodule's), then ``setup(stage)`` of
    the datamodule, the callbacks and the module, then the datamodule's ``load_state_dict(datamodule_state)`` on a
    resume (all as Lightning)."""
    trainer.datamodule = datamodule  # self.trainer.datamodule, as Lightning modules read it
    trainer.module = module  # self.trainer in every hook from here on, setup(stage) included
    object.__setattr__(module, "_trainer", trainer)
    for source in (datamodule, module):
        if source is not None:
            prepare(source, trainer.runtime)
    if datamodule is not None:
        if not isinstance(getattr(type(datamodule), "trainer", None), property):  # a distrain.Module has its own
            datamodule.trainer = trainer
        datamodule.setup(stage)
    if getattr(trainer, "profiler", None) is not None:
        trainer.profiler.setup(stage, trainer.local_rank, trainer.log_dir)
    for callback in trainer.callbacks:
        callback.setup(trainer, module, stage)
    module.setup(stage)
    load_state = getattr(datamodule, "load_state_dict", None)  # a datamodule of Lightning's shape may lack the hook
    if callable(load_state) and datamodule_state is not None:
        load_state(datamodule_state)


def stage_loader(stage: str, module, dataloaders, datamodule) -> Any:
    """The stage's loader, once it is set up (``set_up_stage``): the one given, else the datamodule's, else the
    module's own (as Lightning)."""
    method = STAGE_LOADERS[stage]
    if dataloaders is not None:
        return one_loader(dataloaders, method)
    for source in (datamodule, module):
        if source is not None and callable(getattr(source, method, None)):
            return one_loader(getattr(source, method)(), method)
    raise ValueError(f"{stage}() needs dataloaders, a datamodule with {method}(), or a module that defines {method}()")


def optional_loader(source: Any, method: str) -> Any:
    """``source.method()`` where the source defines it (a module's own ``val_dataloader`` may be absent)."""
    fn = getattr(source, method, None) if source is not None else None
    return one_loader(fn(), method) if callable(fn) else None


def one_loader(loader: Any, method: str) -> Any:
    """``loader``, unless it is several (Lightning's list or dict of loaders, with ``dataloader_idx``): distrain
    reads one per stage, and says so in one line rather than iterating the loaders as if they were batches."""
    many = loader.values() if isinstance(loader, dict) else loader if isinstance(loader, (list, tuple)) else None
    if many is not None and any(isinstance(item, DataLoader) for item in many):
        raise ValueError(
            f"{method}: {len(loader)} loaders given; distrain reads one per stage (no dataloader_idx): join their "
            "datasets (torch.utils.data.ConcatDataset), or run validate/test once per loader"
        )
    return loader
