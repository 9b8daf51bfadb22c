"""Lightning's module paths over distrain, so that a Lightning 2.x script moves by one mechanical edit of its
imports (``migrate``): ``lightning``, ``lightning.pytorch`` and ``pytorch_lightning`` → ``distrain.lightning``, whose
top level also holds the names of Lightning's (``L.Trainer``, ``L.LightningModule``, ``L.pytorch``...). Only names
live here: each is distrain's own class or a small adapter over it, and the training loop (``distrain/trainer.py``)
knows nothing of this package. A Lightning name distrain has no counterpart for is refused on import, in one line
that says so (``_refuse.py``)."""

from __future__ import annotations

import io
import re
import sys
import tokenize

from distrain.callbacks import Callback
from distrain.datamodule import DataModule as LightningDataModule
from distrain.lightning import (
    accelerators,
    callbacks,
    core,
    fabric,
    loggers,
    plugins,
    profilers,
    strategies,
    trainer,
    tuner,
    utilities,
)
from distrain.lightning.plugins import environments, precision
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
    "pytorch",
    "seed_everything",
    "strategies",
    "utilities",
]

#: ``import lightning as L`` then ``L.pytorch.callbacks``: Lightning's top level and ``lightning.pytorch`` are one here
pytorch = sys.modules[__name__]

# the module names a Lightning script imports, longest first: ``lightning`` alone is the package's top level
_LIGHTNING_MODULES = re.compile(r"\b(pytorch_lightning|lightning\.pytorch|lightning)\b(?![_\w])")
#: a string that is itself a module path of Lightning's (a LightningCLI ``class_path``)
_MODULE_PATH = re.compile(r"(pytorch_lightning|lightning)(\.[A-Za-z_]\w*)*")


def migrate(source: str) -> str:
    """A Lightning script's source with its imports switched to distrain (the one edit a migration takes):
    ``lightning``, ``lightning.pytorch`` and ``pytorch_lightning`` → ``distrain.lightning``. Only the
    code is edited: comments and text stay as written (a link to lightning.ai, ``"lightning_logs"``), but for a
    string that is itself a module path (``"lightning.pytorch.callbacks.ModelCheckpoint"``, a LightningCLI
    ``class_path``). Source Python cannot read is edited word by word."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return _LIGHTNING_MODULES.sub("distrain.lightning", source)
    starts = [0]
    for line in io.StringIO(source):  # the lines as tokenize reads them (splitlines also cuts at \f, \x1c, ...)
        starts.append(starts[-1] + len(line))
    offset = lambda position: starts[position[0] - 1] + position[1]  # noqa: E731
    edits = []  # (start, end, text), in order
    for i, token in enumerate(tokens):
        after_dot = i > 0 and tokens[i - 1].string == "."  # an attribute of that name (``x.lightning``) stays
        if token.type == tokenize.NAME and token.string in ("lightning", "pytorch_lightning") and not after_dot:
            end = token.end
            if token.string == "lightning" and [t.string for t in tokens[i + 1 : i + 3]] == [".", "pytorch"]:
                end = tokens[i + 2].end  # lightning.pytorch as one
            edits.append((offset(token.start), offset(end), "distrain.lightning"))
        elif token.type == tokenize.STRING:
            quote = token.string.lstrip("rRbBuUfF")[:1]
            text = token.string[token.string.index(quote) :].strip(quote)
            if _MODULE_PATH.fullmatch(text):
                switched = token.string.replace(text, _LIGHTNING_MODULES.sub("distrain.lightning", text))
                edits.append((offset(token.start), offset(token.end), switched))
    for start, end, text in reversed(edits):
        source = source[:start] + text + source[end:]
    return source


#: Lightning's public submodules, by the package that holds their names here: ``from lightning.pytorch.callbacks.
#: early_stopping import EarlyStopping`` reads ``EarlyStopping`` from ``distrain.lightning.callbacks``, and a name that
#: module lacks is refused there, in its one line
_SUBMODULES = {
    callbacks: (
        "batch_size_finder callback checkpoint device_stats_monitor early_stopping finetuning "
        "gradient_accumulation_scheduler lambda_function lr_finder lr_monitor model_checkpoint model_summary "
        "on_exception_checkpoint prediction_writer progress progress.progress_bar progress.rich_progress "
        "progress.tqdm_progress pruning rich_model_summary spike stochastic_weight_avg throughput_monitor timer "
        "weight_averaging"
    ),
    loggers: "comet csv_logs litlogger logger mlflow neptune tensorboard wandb",
    strategies: "ddp deepspeed fsdp model_parallel parallel single_device strategy",
    core: "datamodule hooks module optimizer saving mixins mixins.hparams_mixin",
    accelerators: "accelerator cpu cuda mps xla",
    precision: "amp bitsandbytes deepspeed double fsdp half precision transformer_engine xla",
    environments: "cluster_environment kubeflow lightning lsf mpi slurm torchelastic xla",
    trainer: "trainer",
    profilers: "advanced base profiler pytorch simple xla",
    tuner: "tuning lr_finder batch_size_scaling",
}


def _alias_submodules() -> None:
    for module, names in _SUBMODULES.items():
        for name in names.split():
            parts = name.split(".")
            for depth in range(1, len(parts) + 1):  # ``progress``, then ``progress.tqdm_progress``: each this module
                sys.modules.setdefault(f"{module.__name__}.{'.'.join(parts[:depth])}", module)
            for part in parts:  # and its attribute, as an imported submodule is its package's
                if part not in vars(module):
                    setattr(module, part, module)
    for path, module in _FABRIC.items():
        sys.modules.setdefault(f"{__name__}.fabric.{path}", module)


#: ``lightning.fabric``'s modules a Lightning script takes names from (the cluster environments, the seed)
_FABRIC = {
    "plugins": plugins,
    "plugins.environments": environments,
    "utilities": utilities,
    "utilities.seed": fabric,
    "utilities.rank_zero": utilities.rank_zero,
}


_alias_submodules()


def cli_lightning_logo() -> None:
    """Lightning's examples print its logo first; distrain prints nothing."""
