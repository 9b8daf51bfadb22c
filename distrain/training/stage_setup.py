"""A stage's module set up in each rank, in Lightning's order: ``setup(stage)`` ran, then ``build`` (the layers of
``configure_model``, from random streams alike on every rank), the loaders, then ``attach`` (the strategy wraps the
module, and for fit builds its optimizers on the wrapped parameters)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from distrain.data import micro_batch_size
from distrain.module import Module, StepRouter
from distrain.strategies.base import LoopFacts
from distrain.training.manual import ManualOptimizer
from distrain.training.optimizers import LoopOptimizer, parse_optimizers


def build(trainer, module: Module) -> None:
    """A stage's module, once its ``setup(stage)`` ran and before its loaders are made (Lightning's order):
    ``configure_model``'s layers, from random streams alike on every rank."""
    trainer.checkpoints.begin_stage()
    trainer.seed_streams(stage_start=False)  # every rank builds identical weights
    trainer.process_settings.apply()
    _own_memory(module)
    configure(trainer, module)


def configure(trainer, module: Module) -> None:
    """``configure_model``, once per module, under the strategy's initialization (sharded, or on the meta device)."""
    if not getattr(module, "_distrain_configured", False):
        with trainer.runtime.init_module():
            module.configure_model()
        object.__setattr__(module, "_distrain_configured", True)


def attach(trainer, module: Module, stage: str, train_loader=None, before_backward=None) -> None:
    """The built module set up by the strategy: wrapped, and for fit with its optimizers; ``before_backward(output)``
    (fit's) runs between each ``training_step`` and its backward."""
    rt = trainer.runtime
    # asked only once a rank ran out of memory
    rt.memory_plan = functools.partial(_memory_plan_of_fit, trainer) if stage == "fit" else None
    if stage != "fit":
        if not rt.strategy.traits.collective_forward:
            trainer.model = None
            module.to(rt.device)
        elif trainer.model is None or rt.strategy.unwrap(trainer.model).module is not module:  # not fit's
            trainer.model = rt.strategy.setup(StepRouter.of(module)).model  # no optimizer
        return
    # The optimizers are built on the model as set up: sharding strategies replace its parameters
    loop = LoopFacts(
        micro_batch_size=micro_batch_size(train_loader),
        accumulate=trainer.loop.accumulate_for(0),
        max_accumulate=max(trainer.loop.accumulation.values()),
        gradient_clip_val=trainer.loop.gradient_clip_val,
        total_steps=trainer.estimated_stepping_batches,
        run_dir=trainer.log_dir,
        live_state=(trainer.checkpoints.live_state, trainer.checkpoints.load_live_state),
    )
    manual = not module.automatic_optimization
    configure_optimizers = lambda: parse_optimizers(module.configure_optimizers(), manual)  # noqa: E731
    trainer.model, trainer.optimizers, trainer.lr_schedulers = rt.strategy.setup(
        StepRouter.of(module, before_backward), configure_optimizers, loop
    )
    trainer.loop_optimizers = [(ManualOptimizer if manual else LoopOptimizer)(trainer, o) for o in trainer.optimizers]


def _own_memory(module: nn.Module) -> None:
    """Spawned ranks receive the module through torch.multiprocessing, which puts its tensors in shared
    memory: every rank would then update the same weights (each step applied once per rank). Each rank
    takes its own copy."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_shared():
                tensor.data = tensor.data.clone()


def _memory_plan_of_fit(trainer, host: bool) -> str:
    """``planner/oom.py``'s plan of this fit, imported only once a rank ran out of memory."""
    from distrain.planner.oom import memory_plan_of_fit

    return memory_plan_of_fit(trainer, host)
