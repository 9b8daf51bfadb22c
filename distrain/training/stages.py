"""``validate``, ``test`` and ``predict``: which module and loaders a stage reads (``run_stage``, before any rank
starts), and the stage in each rank (``evaluate``, ``predict``); the loop that runs the batches is ``Evaluator``'s."""

from __future__ import annotations

import functools

from distrain.datamodule import STAGE_LOADERS, is_datamodule, stage_loader
from distrain.module import as_module
from distrain.training.arguments import TrainerState
from distrain.training.evaluation import length, limited


def run_stage(trainer, stage: str, model, dataloaders, ckpt_path, datamodule):
    """The loaders given, else the datamodule's (also in ``dataloaders``' place), else the module's own: made in
    every rank after ``prepare_data`` and ``setup(stage)``."""
    if model is None:
        if trainer.module is None:
            raise ValueError(f"{stage}() needs a model: pass one, or call fit() first (model=None is fit's)")
        model = trainer.module
        if ckpt_path is None:
            ckpt_path = trainer.checkpoints.best_or_current(stage)
    module = as_module(model)
    if datamodule is None and is_datamodule(dataloaders):
        dataloaders, datamodule = None, dataloaders
    if datamodule is module:
        datamodule = None
    method = STAGE_LOADERS[stage]
    source = datamodule if datamodule is not None else module
    if dataloaders is None and not callable(getattr(source, method, None)):
        raise ValueError(
            f"{stage}() needs dataloaders, a datamodule with {method}(), or a module that defines {method}()"
        )
    trainer._check_lightning_module(module)
    trainer._choose_run_dir(ckpt_path)
    if stage == "predict":
        return trainer._launch(functools.partial(predict, trainer), module, (dataloaders, datamodule), ckpt_path)
    step_name = "validation_step" if stage == "validate" else "test_step"
    return trainer._launch(
        functools.partial(evaluate, trainer), module, step_name, (dataloaders, datamodule), ckpt_path
    )


def evaluate(trainer, module, step_name: str, data: tuple, ckpt_path) -> list[dict]:
    stage = "validate" if step_name == "validation_step" else "test"
    dataloaders, datamodule = data
    trainer.state = TrainerState(stage, stage)
    trainer.runtime.seed_everything(trainer.seed)
    loader = stage_loader(stage, trainer, module, dataloaders, datamodule)
    trainer._attach(module, stage)
    loader = trainer._setup_loader(loader, even=False)
    if ckpt_path is not None:
        trainer.checkpoints.restore(trainer.checkpoints.resolve(ckpt_path), weights_only=True)
    try:
        with trainer._diagnosing_hangs():
            publish = lambda metrics: trainer.metrics.publish(metrics, trainer.global_step)  # noqa: E731
            name = "limit_val_batches" if stage == "validate" else "limit_test_batches"
            limit = limited(length(loader), getattr(trainer.loop, name), name)
            metrics = trainer.evaluator.run(module, trainer.model, step_name, loader, limit, publish)
        trainer.metrics.finalize()
    finally:
        trainer._teardown(stage, module, datamodule)
    return [metrics]


def predict(trainer, module, data: tuple, ckpt_path) -> list:
    dataloaders, datamodule = data
    trainer.state = TrainerState("predict", "predict")
    trainer.runtime.seed_everything(trainer.seed)
    loader = stage_loader("predict", trainer, module, dataloaders, datamodule)
    trainer._attach(module, "predict")
    loader = trainer._setup_loader(loader, even=False)
    if ckpt_path is not None:
        trainer.checkpoints.restore(trainer.checkpoints.resolve(ckpt_path), weights_only=True)
    try:
        with trainer._diagnosing_hangs():
            limit = limited(length(loader), trainer.loop.limit_predict_batches, "limit_predict_batches")
            predictions = trainer.evaluator.predict(module, trainer.model, loader, limit)
    finally:
        trainer._teardown("predict", module, datamodule)
    return predictions


def report(trainer, stage: str, results: list[dict], verbose: bool) -> list[dict]:
    if verbose and trainer.is_global_zero and results:
        shown = ", ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in results[0].items())
        print(f"distrain: {stage}: {shown or 'nothing logged'}", flush=True)
    return results
