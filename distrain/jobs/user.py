"""A ``distrain.Module`` of your own (``training.module=package.module:Class`` or ``path/to/file.py:Class``): it
brings its data (``train_dataloader()``, optionally ``val_dataloader()``); ``Trainer.fit`` plans it (strategy
auto) from the module itself."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from distrain.config import ConfigError
from distrain.jobs.common import announce

if TYPE_CHECKING:
    from distrain.config import RunConfig


class UserModuleJob:
    plannable = False

    def __init__(self, config: RunConfig):
        """Imported and built before any rank starts; its layers built in ``__init__`` draw from
        ``training.seed``, as a script's would."""
        from distrain.runtime import seed_everything
        from distrain.strategies.layers import block_classes

        t = config.training
        self.config = config
        self.strategy = config.distributed.strategy
        seed_everything(t.seed)
        self.module = load_user_module(t.module, t.module_args)
        self.block_classes = block_classes(self.module)
        self.parameter_count = sum(p.numel() for p in self.module.parameters())

    def fit(self, trainer, resume: str | None) -> None:
        self.prepare(trainer)
        trainer.fit(self.module, datamodule=self.module, ckpt_path=resume)

    def prepare(self, trainer):
        """The module and its own loaders."""
        announce(trainer, self.config, self.strategy, self.config.training.module)
        val = self.module.val_dataloader() if callable(getattr(self.module, "val_dataloader", None)) else None
        return self.module, self.module.train_dataloader(), val


def load_user_module(spec: str, args: dict):
    """``package.module:Class`` or ``path/to/file.py:Class`` → an instance built with ``args``."""
    import importlib
    import importlib.util

    from distrain.module import Module

    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(f"training.module {spec!r}: write it as package.module:Class or path/to/file.py:Class")
    try:
        if where.endswith(".py"):
            if not Path(where).is_file():
                raise ConfigError(f"training.module {spec!r}: no such file {where}")
            loader_spec = importlib.util.spec_from_file_location(Path(where).stem, where)
            source = importlib.util.module_from_spec(loader_spec)
            sys.modules[loader_spec.name] = source  # spawned ranks unpickle the module's class by this name
            loader_spec.loader.exec_module(source)
            folder = str(Path(where).resolve().parent)
            if folder not in sys.path:  # spawned ranks (ddp_spawn) start with our sys.path and import it by name
                sys.path.append(folder)
        else:
            source = importlib.import_module(where)
    except ImportError as e:
        raise ConfigError(f"training.module {spec!r}: cannot import {where} ({e})") from None
    cls = getattr(source, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Module)):
        raise ConfigError(f"training.module {spec!r}: {where} has no distrain.Module subclass named {name!r}")
    if not callable(getattr(cls, "train_dataloader", None)):
        raise ConfigError(
            f"training.module {spec!r}: {name} must define train_dataloader() (the CLI has no data "
            "for a module of your own)"
        )
    try:
        return cls(**args)
    except TypeError as e:
        raise ConfigError(f"training.module_args {args!r} do not fit {name}: {e}") from None
