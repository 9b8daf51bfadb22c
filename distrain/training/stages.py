"""``validate``, ``test`` and ``predict``: which module and loaders a stage reads (``stage_call``, before any rank
starts), and the stage in each rank (``evaluate``, ``predict``); fit's validations (``sanity_check``,
``validate_during_fit``); what every stage does with its loaders (``setup_loader``) and last (``teardown``). The loop
that runs the batches is ``Evaluator``'s."""

from __future__ import annotations

import functools

from torch.utils.data import DataLoader

from distrain.datamodule import STAGE_LOADERS, is_datamodule, set_up_stage, stage_loader
from distrain.module import as_module, check_hooks
from distrain.runtime import isolated_rng
from distrain.training.arguments import TrainerState
from distrain.training.assembly import choose_run_dir
from distrain.training.evaluation import length, limited
from distrain.training.hooks import call_callbacks
from distrain.training.stage_setup import attach, build


def stage_call(trainer, stage: str, model, dataloaders, ckpt_path, datamodule) -> tuple:
    """What ``validate``, ``test`` or ``predict`` launches in the ranks: ``(function, module, *arguments)``, checked
    before any rank starts. The loaders given, else the datamodule's (also in ``dataloaders``' place), else the
    module's own: made in every rank after ``prepare_data`` and ``setup(stage)``."""
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
    check_hooks(module)
    choose_run_dir(trainer, ckpt_path)
    if stage == "predict":
        return functools.partial(predict, trainer), module, (dataloaders, datamodule), ckpt_path
    step_name = "validation_step" if stage == "validate" else "test_step"
    return functools.partial(evaluate, trainer), module, step_name, (dataloaders, datamodule), ckpt_path


def begin(trainer, stage: str, module, data: tuple, ckpt_path):
    """``validate``, ``test`` or ``predict`` in a rank up to its first batch: the module set up for the stage
    (``stage_setup``), the checkpoint's weights read into it where one is named, and the stage's loader, returned."""
    dataloaders, datamodule = data
    trainer.state = TrainerState(stage, stage)
    trainer.seed_streams(stage_start=True)
    set_up_stage(stage, trainer, module, datamodule)
    build(trainer, module)
    loader = stage_loader(stage, module, dataloaders, datamodule)
    attach(trainer, module, stage)
    loader = setup_loader(trainer, loader, even=False)
    checkpoint = trainer.checkpoint_at(ckpt_path) if ckpt_path is not None else None
    if checkpoint is not None:
        trainer.checkpoints.restore(checkpoint, weights_only=True)
    return loader


def evaluate(trainer, module, step_name: str, data: tuple, ckpt_path) -> list[dict]:
    stage = "validate" if step_name == "validation_step" else "test"
    loader = begin(trainer, stage, module, data, ckpt_path)
    try:
        with trainer.runtime.diagnosing_hangs():
            publish = lambda metrics: trainer.metrics.publish(  # noqa: E731
                metrics, trainer.global_step, epoch=trainer.current_epoch
            )
            name = "limit_val_batches" if stage == "validate" else "limit_test_batches"
            limit = limited(length(loader), getattr(trainer.loop, name), name)
            metrics = trainer.evaluator.run(module, trainer.model, step_name, loader, limit, publish)
        trainer.metrics.finalize()
    finally:
        teardown(trainer, stage, module, data[1])
    return [metrics]


def predict(trainer, module, data: tuple, ckpt_path, keep: bool = True) -> list:
    """This rank's predictions; kept (``keep``: ``return_predictions``) or for a writer that writes them all at the
    epoch's end, else none (an empty list)."""
    from distrain.callbacks.prediction_writer import BasePredictionWriter

    loader = begin(trainer, "predict", module, data, ckpt_path)
    writers = [cb for cb in trainer.callbacks if isinstance(cb, BasePredictionWriter)]
    keep = keep or any(writer.interval.on_epoch for writer in writers)
    try:
        with trainer.runtime.diagnosing_hangs():
            limit = limited(length(loader), trainer.loop.limit_predict_batches, "limit_predict_batches")
            predictions = trainer.evaluator.predict(module, trainer.model, loader, limit, keep)
    finally:
        teardown(trainer, "predict", module, data[1])
    return predictions


def report(trainer, stage: str, results: list[dict], verbose: bool) -> list[dict]:
    if verbose and trainer.is_global_zero and results:
        shown = ", ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in results[0].items())
        print(f"distrain: {stage}: {shown or 'nothing logged'}", flush=True)
    return results


def sanity_check(trainer, loader) -> None:
    """Lightning's sanity check: a few validation batches before training (``num_sanity_val_steps``; -1: all),
    so a broken ``validation_step`` fails in seconds; its metrics are dropped."""
    steps = trainer.loop.num_sanity_val_steps
    with isolated_rng():  # as Lightning's: training draws the numbers it would have drawn without a sanity check
        trainer.sanity_checking, trainer.state.stage = True, "sanity_check"
        call_callbacks(trainer, "on_sanity_check_start")
        try:
            limit = None if steps == -1 else steps
            trainer.evaluator.run(
                trainer.module, trainer.model, "validation_step", loader, limit, publish=lambda metrics: None
            )
        finally:
            trainer.sanity_checking, trainer.state.stage = False, "train"
        call_callbacks(trainer, "on_sanity_check_end")


def validate_during_fit(trainer, loader) -> None:
    """A validation in fit: its metrics go to the loggers and the console, and checkpoints can monitor them."""
    trainer.runtime.mark_phase(None, "validation")
    trainer.loop_state.last_val_step = trainer.global_step
    limit = limited(length(loader), trainer.loop.limit_val_batches, "limit_val_batches")
    publish = lambda metrics: trainer.metrics.validation_done(  # noqa: E731
        metrics, trainer.global_step, trainer.loop.max_steps, trainer.current_epoch
    )
    trainer.state.stage = "validate"
    try:
        trainer.evaluator.run(trainer.module, trainer.model, "validation_step", loader, limit, publish)
    finally:
        trainer.state.stage = "train"


def teardown(trainer, stage: str, module, datamodule) -> None:
    """Last in every stage, whether it finished or failed: the datamodule's, the callbacks' and the module's
    ``teardown(stage)``, in Lightning's order, as each ``setup(stage)`` was called; then the profiler's report."""
    if datamodule is not None:
        datamodule.teardown(stage)
    call_callbacks(trainer, "teardown", stage)
    module.teardown(stage)
    if trainer.profiler is not None:  # the stage's report, then the next stage's starts empty
        trainer.profiler.describe(trainer.is_global_zero)
        trainer.profiler.teardown(stage)


def setup_loader(
    trainer, loader, shuffle_seed: int = 0, even: bool = True, batch_size: int | None = None, shuffle=None
):
    """``loader`` sharded over the data-parallel ranks (``use_distributed_sampler``), resumable mid-epoch; a loader
    that is not a DataLoader as it is."""
    if not trainer.loop.use_distributed_sampler or not isinstance(loader, DataLoader):
        return loader
    from distrain.data import with_distributed_sampler

    # sharded over the ranks that see different data: a tensor-parallel group or a pipeline shares its batches
    dp_size, dp_rank = trainer.runtime.strategy.data_parallel_size, trainer.runtime.strategy.data_parallel_rank
    draws = trainer.continues_script_streams
    return with_distributed_sampler(loader, dp_size, dp_rank, shuffle_seed, even, batch_size, shuffle, draws)
