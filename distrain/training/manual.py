"""Manual optimization (``automatic_optimization = False``): ``training_step`` steps the optimizers itself, through
``ManualOptimizer``; the loop runs one batch a step (``manual_step``) and the gradients are averaged over the ranks
once, when an optimizer steps (``optimizers.sync_gradients``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from distrain.data import batch_size_of, tokens_in_batch
from distrain.module import loss_of, run_step
from distrain.training.hooks import call_hook
from distrain.training.metrics import StepResult
from distrain.training.optimizers import LoopOptimizer, sync_gradients
from distrain.training.outcomes import StepOutcome


class ManualOptimizer(LoopOptimizer):
    """What ``self.optimizers()`` hands out under manual optimization: ``step()`` averages the gradients over the
    ranks (once, however many ``manual_backward`` calls made them), steps through the precision plugin and counts
    the step in ``global_step``."""

    def step(self, closure=None) -> Any:
        trainer = self._trainer
        result = closure() if closure is not None else None
        sync_gradients(trainer, self.optimizer)
        call_hook(trainer, "on_before_optimizer_step", self.optimizer)
        trainer.runtime.optimizer_step(self.optimizer, trainer.model)
        self.optimizer._distrain_synced = False
        trainer.progress.global_step += 1
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        call_hook(self._trainer, "on_before_zero_grad", self.optimizer)
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.optimizer._distrain_synced = False

    @contextlib.contextmanager
    def toggle_model(self, sync_grad: bool = True):
        """Lightning's accumulation helper: here gradients are synced at ``step()`` only, so nothing to do."""
        yield


def manual_step(
    trainer,
    micro_batches: list[tuple[int, Any]],
    skips_rest_of_epoch: Callable[[int, Any], bool],
    done: Callable[[], bool],
) -> Any:
    """One batch under manual optimization: ``training_step`` steps the optimizers itself (each ``step()``
    counts in ``global_step``, as in Lightning). ``skips_rest_of_epoch(batch_idx, batch)``: the batch's
    ``on_train_batch_start`` said -1 on some rank; ``done()``: the run ends at this step. It is called on the module,
    not through the strategy's wrapper: the gradients stay local through any number of ``manual_backward`` calls and
    are averaged over the ranks once, when an optimizer steps (``ManualOptimizer``)."""
    rt = trainer.runtime
    ((batch_idx, batch),) = micro_batches  # accumulate_grad_batches is 1 (checked when fit starts)
    rt.mark_phase(trainer.global_step + 1, "manual training_step")
    batch = rt.to_device(batch)
    trainer.metrics.collector.current_batch_size = batch_size_of(batch)
    if skips_rest_of_epoch(batch_idx, batch):
        return StepOutcome.SKIP_REST_OF_EPOCH
    before = trainer.global_step
    with rt.autocast():
        output = run_step(trainer.module, "training_step", batch, batch_idx)
    samples = batch_size_of(batch)
    trainer.progress.samples_in_epoch += samples * trainer.data_parallel_size
    if trainer.global_step == before:  # no optimizer stepped in this batch: still a logged step of the loop
        return output
    loss = loss_of(output).detach().float() if output is not None else None
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    result = StepResult(
        trainer.global_step, trainer.current_epoch, loss, lr, None, samples, tokens_in_batch(batch) or 0
    )
    trainer.metrics.step_done(result, final=done(), max_steps=trainer.loop.max_steps)
    return output
