"""``lightning.pytorch.cli``: ``LightningCLI`` on jsonargparse, as Lightning's is (the ``cli`` extra installs it).

``python script.py fit --trainer.max_epochs=2 --model.lr=0.01 --data.batch_size=32``, ``--config cfg.yaml``,
``--print_config``; ``run=False`` parses the command line into ``cli.model``, ``cli.datamodule`` and ``cli.trainer``
and runs nothing. The arguments come from the classes' own signatures: the module's, the datamodule's and
distrain's Trainer's (Lightning's names). The parsed config is written to ``config.yaml`` in the run's folder when a
stage starts (``save_config_kwargs``: ``overwrite``, ``config_filename``)."""

from __future__ import annotations

import inspect
import os
import random
import sys
from collections.abc import Callable
from typing import Any

from distrain.callbacks import Callback
from distrain.lightning.trainer import Trainer, seed_everything
from distrain.trainer import Trainer as _CoreTrainer
from distrain.training.defaults import callback_list

__all__ = ["LightningCLI", "SaveConfigCallback"]

#: the stages a subcommand runs, and the options each takes beside the module and its data
SUBCOMMANDS = {
    "fit": "Train the module (and validate it when there is validation data).",
    "validate": "Run the module's validation_step over its validation data.",
    "test": "Run the module's test_step over its test data.",
    "predict": "Run the module's predict_step over its prediction data.",
}


def _jsonargparse():
    try:
        import jsonargparse
    except ImportError:
        raise ImportError(
            "LightningCLI needs jsonargparse, as Lightning's does: pip install 'distrain[cli]' (or jsonargparse)"
        ) from None
    return jsonargparse


class SaveConfigCallback(Callback):
    """Writes the parsed config to ``config_filename`` in the run's folder when fit starts (rank 0); an existing file
    is refused unless ``overwrite``, as Lightning does, so an earlier run's config is never lost. ``validate``,
    ``test`` and ``predict`` write none: they evaluate in the run they read from, whose config is the one it was
    trained with."""

    def __init__(self, parser, config, config_filename: str = "config.yaml", overwrite: bool = False) -> None:
        self.parser, self.config = parser, config
        self.config_filename, self.overwrite = config_filename, overwrite
        self.already_saved = False

    def setup(self, trainer, module, stage: str) -> None:
        if self.already_saved or stage != "fit" or not trainer.is_global_zero:
            return
        path = os.path.join(trainer.log_dir, self.config_filename)
        if os.path.exists(path) and not self.overwrite:
            raise RuntimeError(
                f"{path} exists already: LightningCLI does not overwrite it (an earlier run's config); pass "
                "save_config_kwargs={'overwrite': True}, or another default_root_dir"
            )
        os.makedirs(trainer.log_dir, exist_ok=True)
        self.parser.save(self.config, path, overwrite=True, multifile=False)
        self.already_saved = True


class LightningCLI:
    """Lightning's ``LightningCLI(model_class, datamodule_class, ...)``: parses the command line (and ``--config``
    files) into the module, the datamodule and the Trainer, then runs the subcommand's stage (``run=True``)."""

    def __init__(
        self,
        model_class: type | Callable[..., Any] | None = None,
        datamodule_class: type | Callable[..., Any] | None = None,
        save_config_callback: type[SaveConfigCallback] | None = SaveConfigCallback,
        save_config_kwargs: dict[str, Any] | None = None,
        trainer_class: type = Trainer,
        trainer_defaults: dict[str, Any] | None = None,
        seed_everything_default: bool | int = True,
        parser_kwargs: dict[str, Any] | None = None,
        subclass_mode_model: bool = False,
        subclass_mode_data: bool = False,
        args: list[str] | dict | None = None,
        run: bool = True,
        auto_configure_optimizers: bool = True,
    ) -> None:
        jsonargparse = _jsonargparse()
        if model_class is None:
            raise ValueError("LightningCLI needs a model_class (distrain has no registry of models to pick from)")
        self.model_class, self.datamodule_class = model_class, datamodule_class
        self.subclass_mode_model, self.subclass_mode_data = subclass_mode_model, subclass_mode_data
        self.trainer_class = trainer_class
        self.trainer_defaults = dict(trainer_defaults or {})
        self._default_callbacks = callback_list(self.trainer_defaults.pop("callbacks", None))
        self.seed_everything_default = seed_everything_default
        self.save_config_callback, self.save_config_kwargs = save_config_callback, dict(save_config_kwargs or {})
        self._jsonargparse = jsonargparse
        self.parser = self._make_parser(run, dict(parser_kwargs or {}))
        self.config = self.parser.parse_args(args if args is not None else sys.argv[1:])
        self.subcommand = self.config["subcommand"] if run else None
        self._stage_config = self.config[self.subcommand] if run else self.config
        self._instantiate()
        if run:
            self._run()

    @property
    def _trainer_signature(self) -> type:
        """Whose signature the Trainer's arguments are: the core Trainer's (``distrain.lightning.Trainer`` takes
        ``**kwargs``), else the class given."""
        return _CoreTrainer if issubclass(self.trainer_class, _CoreTrainer) else self.trainer_class

    # ---- the parser ---------------------------------------------------------------------------------------------
    def _make_parser(self, run: bool, parser_kwargs: dict[str, Any]):
        ArgumentParser = self._jsonargparse.ArgumentParser
        if not run:
            return self._add_arguments(ArgumentParser(**parser_kwargs))
        parser = ArgumentParser(**parser_kwargs)
        subcommands = parser.add_subcommands(required=True, dest="subcommand")
        self._subparsers = {}
        for name, about in SUBCOMMANDS.items():
            sub = self._subparsers[name] = self._add_arguments(ArgumentParser(description=about))
            sub.add_argument("--ckpt_path", type=str | None, default=None, help="A checkpoint: a path, best or last.")
            subcommands.add_subcommand(name, sub, help=about)
        return parser

    def _add_arguments(self, parser):
        parser.add_argument("-c", "--config", action=self._jsonargparse.ActionConfigFile, help="A YAML config file.")
        parser.add_argument(
            "--seed_everything",
            type=bool | int,
            default=self.seed_everything_default,
            help="Seed for Python, NumPy and torch, set before anything is built (True: a random one, False: none).",
        )
        # the Trainer's arguments are the core Trainer's signature (distrain.lightning.Trainer takes **kwargs)
        parser.add_class_arguments(self._trainer_signature, "trainer", fail_untyped=False, instantiate=False)
        parser.set_defaults({f"trainer.{k}": v for k, v in self.trainer_defaults.items()})
        _add_class(parser, self.model_class, "model", self.subclass_mode_model)
        if self.datamodule_class is not None:
            _add_class(parser, self.datamodule_class, "data", self.subclass_mode_data)
        return parser

    # ---- building and running -----------------------------------------------------------------------------------
    def _instantiate(self) -> None:
        config = self._stage_config
        seed = config["seed_everything"]
        if seed is True:  # a random seed, and the one the ranks a launcher starts find in PL_GLOBAL_SEED
            seed = int(os.environ.get("PL_GLOBAL_SEED") or random.randint(0, 2**31 - 1))
        if seed is not False:
            config["seed_everything"] = seed_everything(seed)  # before the module and its weights
        parser = self.parser if self.subcommand is None else self._subparsers[self.subcommand]
        built = parser.instantiate(config)
        self.model = built["model"]
        self.datamodule = built.get("data") if self.datamodule_class is not None else None
        # the signature's arguments only: jsonargparse also follows **strategy_kwargs into the code, as hidden keys
        named = inspect.signature(self._trainer_signature).parameters
        trainer_kwargs = {k: v for k, v in vars(built["trainer"]).items() if k in named}
        callbacks = [*self._default_callbacks, *callback_list(trainer_kwargs.pop("callbacks", None))]
        if self.save_config_callback is not None:
            callbacks.append(self.save_config_callback(parser, config, **self.save_config_kwargs))
        self.trainer = self.trainer_class(**trainer_kwargs, callbacks=callbacks)

    def _run(self) -> None:
        stage = getattr(self.trainer, self.subcommand)
        stage(self.model, datamodule=self.datamodule, ckpt_path=self._stage_config["ckpt_path"])


def _add_class(parser, cls, key: str, subclass_mode: bool) -> None:
    """``--key.*`` from ``cls``'s signature; in subclass mode, ``--key`` names any subclass (``class_path``)."""
    if subclass_mode:
        parser.add_subclass_arguments(cls, key, fail_untyped=False, required=True)
    else:
        parser.add_class_arguments(cls, key, fail_untyped=False)
