"""The training data of an epoch as the loop reads it: ``(batch_idx, batch)`` pairs from where the data position
says (a resume reads on mid-epoch), and those pairs in windows of one optimizer step each."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from distrain.data import distributed_sampler, micro_batch_size, seed_workers
from distrain.training.checkpointing import TrainProgress


def epoch_batches(
    loader,
    progress: TrainProgress,
    epoch: int,
    data_parallel_size: int,
    limit: int | None,
    streams_continue: bool,
    iterator_drew: bool,
    epoch_start: Callable[[], Any],
) -> Iterator[tuple[int, Any]]:
    """This epoch's ``(batch_idx, batch)`` pairs from where ``progress`` says, at most ``limit`` in the epoch.
    ``epoch_start`` (the ``on_train_epoch_start`` hooks) runs once the sampler knows the epoch and before the loader
    is iterated, which may draw from torch's generator; not for an epoch a resumed checkpoint ended.
    ``streams_continue``: the script's random streams go on as Lightning's (``distrain.lightning``), so an iterator
    that drew its seed already draws nothing now: before the checkpoint this run resumes mid-epoch, or
    (``iterator_drew``) in a search the streams were set back from."""
    sampler = distributed_sampler(loader)
    seed_workers(loader, epoch)
    resumed = progress.samples_in_epoch > 0
    drew_already = streams_continue and (resumed or iterator_drew)
    if sampler is not None:
        sampler.set_epoch(epoch)
        sampler.set_start(progress.samples_in_epoch)
        if sampler.draws_seed and resumed:
            sampler.drawn_seed = progress.order_seed  # the order this epoch began with
    elif resumed:
        raise RuntimeError(
            "this checkpoint was saved mid-epoch, and this train loader has no distrain sampler to skip the "
            "samples already seen (use_distributed_sampler=False, an IterableDataset or a custom batch "
            "sampler); resume from an epoch-end checkpoint, or let distrain shard the data"
        )
    per_step = (micro_batch_size(loader) or 1) * data_parallel_size
    if not progress.epoch_done:  # resumed from a checkpoint of the epoch's end: it started (and ended) before
        epoch_start()
    start = progress.samples_in_epoch // per_step
    if drew_already:
        batches = enumerate(_iterated_without_drawing(loader), start=start)
    else:
        batches = enumerate(loader, start=start)
    if sampler is not None and sampler.draws_seed:
        batches = _noting_order_seed(batches, sampler, progress)
    return batches if limit is None else itertools.islice(batches, max(0, limit - start))


def optimizer_steps(batches: Iterable, accumulate: int, runtime, loader, timer) -> Iterator[list]:
    """The epoch's ``(batch_idx, batch)`` pairs in windows of ``accumulate``, one per optimizer step, counted from
    where the epoch (re)starts. The last window of an epoch may be shorter: it still steps, its gradient the mean
    over the micro-batches it has (``Trainer.train_step``).

    With distrain's sampler every rank has the same number of batches. Without it (an iterable dataset, a sampler of
    your own) ranks may run out at different times, so they agree on each window's length (one small all-reduce per
    step): batches beyond the shortest rank's are dropped, and the epoch ends for all when one rank has none left."""
    batches = iter(batches)
    agree = runtime.world_size > 1 and distributed_sampler(loader) is None
    while True:
        waited = time.perf_counter()
        window = list(itertools.islice(batches, accumulate))
        timer.data_waited(time.perf_counter() - waited)
        if agree:
            shortest = int(runtime.all_reduce(torch.tensor(len(window)), op="min"))
            window = window[:shortest]
        if not window:
            return
        yield window


def _iterated_without_drawing(loader) -> Iterator:
    """``loader``'s batches from an iterator that drew nothing from torch's generator: a DataLoader draws its
    workers' base seed from its ``generator``, torch's when it has none."""
    if not isinstance(loader, torch.utils.data.DataLoader) or loader.generator is not None:
        return iter(loader)
    loader.generator = torch.Generator()
    try:
        return iter(loader)
    finally:
        loader.generator = None


def _noting_order_seed(batches: Iterator, sampler, progress: TrainProgress) -> Iterator:
    """``batches``, noting in ``progress`` the seed the sampler drew this epoch's order with (a checkpoint carries
    it: a resumed epoch reads on in the same order)."""
    for pair in batches:
        progress.order_seed = sampler.drawn_seed
        yield pair
