"""Validation, test and prediction loops.

Under strategies whose forward runs collectives (FSDP, ZeRO-3: each layer all-gathers its
parameters), every rank must run as many forwards as the busiest one, or the others wait forever.
A rank that runs out of batches repeats its last one (one that got none at all: a stand-in made
from the dataset's first sample) with its results dropped, so each sample still counts exactly once.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from distrain.data import batch_size_of, move_to_device, with_seen_batches
from distrain.module import run_step
from distrain.training.metrics import MetricsLogger

DEFAULT_LOSS_NAMES = {"validation_step": "val_loss", "test_step": "test_loss"}
#: the prefix of Lightning's hooks around each step (``on_validation_start``, ``on_test_batch_end``, ...)
HOOK_PREFIXES = {"validation_step": "validation", "test_step": "test", "predict_step": "predict"}


@dataclass
class PredictLoop:
    """What Lightning's ``trainer.predict_loop`` tells its prediction writers while ``predict`` runs: the samples
    (dataset indices) of the batch under way, ``current_batch_indices``; of each batch so far,
    ``epoch_batch_indices`` (a list per loader, as Lightning lays it out); and the ``predictions`` kept, on the CPU.
    Indices are known where a plain DataLoader's batch sampler draws the batches, else empty (Lightning's too)."""

    current_batch_indices: list[int] = field(default_factory=list)
    epoch_batch_indices: list[list[list[int]]] = field(default_factory=list)
    predictions: list = field(default_factory=list)


class Evaluator:
    def __init__(
        self,
        runtime,
        metrics: MetricsLogger,
        call_callbacks: Callable[..., None],
        profile: Callable[[str], Any] = lambda action: contextlib.nullcontext(),
    ):
        self.runtime = runtime
        self.metrics = metrics
        self.call_callbacks = call_callbacks  # (hook name, *args): each callback's hook, with the trainer and module
        self.profile = profile  # (action): a context that times it (the trainer's profiler)
        self.predict_loop = PredictLoop()

    def _hook(self, module, step_name: str, when: str, *args: Any) -> None:
        """Lightning's ``on_<stage>_<when>``: the callbacks', then the module's, where it has one."""
        name = f"on_{HOOK_PREFIXES[step_name]}_{when}"
        self.call_callbacks(name, *args)
        fn = getattr(module, name, None)
        if callable(fn):
            fn(*args)

    def run(
        self, module, model, step_name: str, loader, limit: int | None, publish: Callable[[dict], None]
    ) -> dict[str, float]:
        """``step_name`` (validation_step or test_step) over ``loader``: the epoch metrics, reduced
        over every rank's samples, handed to ``publish`` before the ``on_<stage>_end`` hooks (they read
        ``trainer.callback_metrics``, as in Lightning). ``model`` is the strategy-wrapped module, or None
        to call ``module`` directly."""
        rt = self.runtime
        collector = self.metrics.collector
        was_training = module.training
        module.eval()
        stage, collector.stage = collector.stage, "validate"
        training_epoch = collector.stash_epoch()  # validation inside a training epoch: the epoch's values wait
        default_name = DEFAULT_LOSS_NAMES[step_name]
        step, collective = self._step_function(module, model, step_name)
        self._hook(module, step_name, "start")
        self._hook(module, step_name, "epoch_start")
        with torch.no_grad():
            for batch_idx, batch, padding in self._lockstep(loader, limit, collective):
                collector.muted = padding
                collector.current_batch_size = batch_size_of(batch)
                batch = rt.to_device(batch)
                if not padding:
                    self._hook(module, step_name, "batch_start", batch, batch_idx)
                with rt.autocast():
                    output = step(batch, batch_idx)
                if isinstance(output, torch.Tensor) and output.dim() == 0 and default_name not in collector.epoch_sums:
                    collector.log(default_name, output, sync_dist=True)
                if not padding:
                    self._hook(module, step_name, "batch_end", output, batch, batch_idx)
        collector.muted = False
        self._hook(module, step_name, "epoch_end")  # what it logs is in this epoch's metrics
        metrics = collector.pop_epoch_metrics()
        publish(metrics)
        self._hook(module, step_name, "end")
        collector.restore_epoch(training_epoch)
        collector.stage = stage
        module.train(was_training)
        return metrics

    def predict(self, module, model, loader, limit: int | None = None, keep: bool = True) -> list:
        """This rank's predictions, in its sampler order (of its first ``limit`` batches), moved to the CPU as each
        is made; none kept (an empty list) unless ``keep``. ``predict_loop`` follows the batches' samples."""
        module.eval()
        step, collective = self._step_function(module, model, "predict_step")
        record = self.predict_loop = PredictLoop(epoch_batch_indices=[[]])
        loader, seen = with_seen_batches(loader)
        self._hook(module, "predict_step", "start")
        self._hook(module, "predict_step", "epoch_start")
        with torch.no_grad(), self.runtime.autocast():
            for batch_idx, batch, padding in self._lockstep(loader, limit, collective):
                batch = self.runtime.to_device(batch)
                if not padding:
                    if seen is not None:
                        record.current_batch_indices = seen.seen[batch_idx]
                        record.epoch_batch_indices[0].append(record.current_batch_indices)
                    self._hook(module, "predict_step", "batch_start", batch, batch_idx)
                output = step(batch, batch_idx)
                if not padding:
                    self._hook(module, "predict_step", "batch_end", output, batch, batch_idx)
                    if keep:
                        record.predictions.append(move_to_device(output, torch.device("cpu")))
        self._hook(module, "predict_step", "epoch_end")
        record.epoch_batch_indices = []  # as Lightning's loop leaves them once the epoch's writers have run
        self._hook(module, "predict_step", "end")
        return record.predictions

    def _step_function(self, module, model, step_name: str):
        """Through the strategy's wrapper where forwards communicate (every rank must run them: sharded parameters,
        DDP's buffers), else the module's own step."""
        traits = self.runtime.strategy.traits
        action = f"[Strategy]{type(self.runtime.strategy).__name__}.{step_name}"
        if (traits.collective_forward or traits.forward_syncs_buffers) and model is not None:
            step, collective = (lambda batch, i: model(step_name, batch, i)), True
        else:
            step, collective = (lambda batch, i: run_step(module, step_name, batch, i)), False

        def profiled(batch, i):
            with self.profile(action):
                return step(batch, i)

        return profiled, collective

    def _lockstep(self, loader, limit: int | None, collective: bool) -> Iterator[tuple[int, Any, bool]]:
        """``(batch_idx, batch, padding)``: this rank's batches; where forwards communicate, followed by
        stand-in batches (``padding``, their results dropped) until the busiest rank is done, so every
        rank runs every forward — also a rank that got no sample at all."""
        batches = iter(loader) if limit is None else itertools.islice(loader, limit)
        if not collective:
            yield from ((i, batch, False) for i, batch in enumerate(batches))
            return
        local = length(loader)
        if local is None:  # an iterable loader: count by reading (evaluation sets are small)
            batches = list(batches)
            local = len(batches)
        local = local if limit is None else min(limit, local)
        busiest = int(self.runtime.all_reduce(torch.tensor(local), op="max"))
        last = None
        for i, batch in enumerate(batches):
            last = batch
            yield i, batch, False
        for i in range(local, busiest):
            if last is None:
                last = _stand_in_batch(loader, self.runtime.global_rank)
            yield i, last, True


def length(loader) -> int | None:
    """The loader's number of batches, or None when it has no length."""
    try:
        return len(loader)
    except TypeError:
        return None


def limited(batches: int | None, limit: int | float | None, name: str) -> int | None:
    """How many of a loader's ``batches`` (None: unknown) a stage reads: ``limit`` is a count, or a fraction of the
    loader (which then needs a length), as Lightning's ``limit_*_batches``; None: all."""
    if limit is None or (isinstance(limit, float) and limit == 1.0):
        return batches
    if isinstance(limit, float):
        if batches is None:
            raise ValueError(f"{name}={limit} is a fraction of the loader, which has no length: give a number")
        return int(batches * limit)
    return limit if batches is None else min(batches, limit)


def _stand_in_batch(loader, rank: int):
    """A batch for a rank that got no evaluation sample: the dataset's first sample, collated as the
    loader would. Its results are never counted."""
    dataset = getattr(loader, "dataset", None)
    collate = getattr(loader, "collate_fn", None)
    try:
        return collate([dataset[0]])
    except Exception as e:
        raise RuntimeError(
            f"rank {rank} has no evaluation batch, but its forward must run (the model's layers all-gather their "
            f"parameters on every rank) and its loader cannot make a stand-in batch ({type(e).__name__}: {e}); "
            "give every rank at least one sample (e.g. fewer ranks, or a larger evaluation set)"
        ) from None
