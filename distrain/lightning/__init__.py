"""Lightning's module paths over distrain, so that a Lightning 2.x script moves by one mechanical edit of its
imports (``migrate``): ``lightning.pytorch`` and ``pytorch_lightning`` → ``distrain.lightning``, ``lightning`` →
``distrain``. Only names live here: each is distrain's own class or a small adapter over it, and the training loop
(``distrain/trainer.py``) knows nothing of this package. A Lightning name distrain has no counterpart for is refused
on import, in one line that says so (``_refuse.py``)."""

from __future__ import annotations

import re

from distrain.callbacks import Callback
from distrain.datamodule import DataModule as LightningDataModule
from distrain.lightning import callbacks, loggers, strategies, utilities
from distrain.lightning.trainer import Trainer, seed_everything
from distrain.module import Module as LightningModule

__all__ = [
    "Callback",
    "LightningDataModule",
    "LightningModule",
    "Trainer",
    "callbacks",
    "cli_lightning_logo",
    "loggers",
    "migrate",
    "seed_everything",
    "strategies",
    "utilities",
]

# the module names a Lightning script imports, longest first: ``lightning`` alone is the package's top level
_LIGHTNING_MODULES = re.compile(r"\b(pytorch_lightning|lightning\.pytorch|lightning)\b(?![_\w])")


def migrate(source: str) -> str:
    """A Lightning script's source with its imports switched to distrain (the one edit a migration takes):
    ``lightning.pytorch`` and ``pytorch_lightning`` → ``distrain.lightning``, ``lightning`` → ``distrain``."""
    return _LIGHTNING_MODULES.sub(lambda m: "distrain" if m.group(1) == "lightning" else "distrain.lightning", source)


def cli_lightning_logo() -> None:
    """Lightning's examples print its logo first; distrain prints nothing."""
