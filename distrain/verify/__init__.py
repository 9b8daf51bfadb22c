"""``distrain verify`` / ``Trainer.verify``: prove a model and layout right before the expensive run.

A few optimizer steps of the exact configuration — strategy, layout, precision, activation checkpointing,
accumulation, compile — on the ranks at hand (CPU/gloo without a GPU), observed by a ``Probe``; then the
same steps in one process on the same global batch (each of its micro-batches as many samples as all the
data-parallel ranks' together, so a loss summed where it should be averaged shows), from the same initial
weights. ``report.compare`` sets them side by side: losses, each parameter's gradients and weights (by
module), the first step and parameter past the precision's tolerance; and the checks that need no
reference: each rank's samples, replicated parameters, the optimizer's coverage, a checkpoint round trip
(written by the run, read by one process), and the precision each stage really uses, read from the live
objects. Cost: the run's steps, the reference's, and reading one checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path

from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from distrain.verify.probe import Probe
from distrain.verify.report import Report, compare

__all__ = ["verify", "Report"]


def verify(trainer, module, train_loader, steps: int = 3, label: str | None = None) -> Report | None:
    """Run ``steps`` steps of ``module`` under ``trainer`` and against one process; the report on the process
    that started the run (rank 0, or the parent of spawned ranks), None on the others. ``trainer`` is used up:
    its checkpointing and plots are off, and it stops after ``steps``."""
    from distrain import distributed
    from distrain.callbacks import ModelCheckpoint, PlotSummary
    from distrain.checkpoint import safe_load
    from distrain.checkpoint.state import read_model_weights

    if steps < 1:
        raise ValueError(f"verify needs at least 1 step, got {steps}")
    work = Path(trainer.default_root_dir) / "verify"
    reference_module = copy.deepcopy(module)  # untouched by the run: the reference builds it as one process would
    probe = Probe(work / "run.pt", save_checkpoint_to=work / "checkpoint")
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, (ModelCheckpoint, PlotSummary))] + [probe]
    trainer.loop.max_steps, trainer.loop.max_epochs = steps, None
    trainer.metrics.log_every_n_steps = 1
    trainer.metrics.summarize = False  # the report is what this run says
    trainer.fit(module, train_loader)
    distributed.shutdown()  # the reference runs alone, in this process (after a barrier: no rank is left waiting)
    trainer.runtime.teardown()  # and the runtime knows it: a later run of this trainer starts a group of its own
    if not trainer.is_global_zero or trainer.strategy.data_parallel_rank != 0:  # one report for the job
        return None
    run = safe_load.load_torch_file(work / "run.pt")
    reference = _reference(trainer, reference_module, train_loader, run["data_parallel_size"], steps, work)
    weights = read_model_weights(run["checkpoint"]) if run["checkpoint"] else None
    return compare(run, reference, weights, label or _label(trainer))


def _reference(trainer, module, loader, data_parallel: int, steps: int, work: Path) -> dict:
    """One process, the same global batch: micro-batches ``data_parallel`` times larger, the same accumulation."""
    from distrain.checkpoint import safe_load

    loop = trainer.loop
    probe = Probe(work / "reference.pt")
    with _as_one_process():
        one = type(trainer)(
            accelerator=trainer.runtime.accelerator.name,
            strategy="single",
            devices=1,
            precision=trainer.runtime.precision.name,
            max_steps=steps,
            accumulate_grad_batches=dict(loop.accumulation),
            gradient_clip_val=loop.gradient_clip_val,
            on_nonfinite=loop.on_nonfinite,
            use_distributed_sampler=loop.use_distributed_sampler,
            seed=trainer.seed,
            log_every_n_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_plots=False,
            default_root_dir=str(work / "reference"),
            callbacks=[probe],
        )
        one.metrics.summarize = False
        one.fit(module, _global_batch_loader(loader, data_parallel))
    return safe_load.load_torch_file(work / "reference.pt")


#: what launchers set that makes a process one rank of many (torchrun, distrain's launcher, SLURM, MPI)
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR")
_RANK_PREFIXES = ("MASTER_PORT", "TORCHELASTIC_", "DISTRAIN_LAUNCHED", "SLURM_", "OMPI_COMM_WORLD_", "PMI_")


@contextlib.contextmanager
def _as_one_process():
    """The reference is one process, even inside a rank a launcher started: its variables are hidden."""
    saved = dict(os.environ)
    for key in list(os.environ):
        if key in _RANK_VARIABLES or key.startswith(_RANK_PREFIXES):
            del os.environ[key]
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _global_batch_loader(loader, data_parallel: int):
    if not isinstance(loader, DataLoader) or loader.batch_size is None or data_parallel == 1:
        return loader
    own_sampler = type(loader.sampler) not in (RandomSampler, SequentialSampler)
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size * data_parallel,
        shuffle=isinstance(loader.sampler, RandomSampler),
        sampler=loader.sampler if own_sampler else None,
        collate_fn=loader.collate_fn,
        drop_last=loader.drop_last,
    )


def _label(trainer) -> str:
    return f"{type(trainer.strategy).__name__}{trainer.strategy.layout_note}"
