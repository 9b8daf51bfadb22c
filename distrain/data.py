"""Distributed, resumable sampling and the built-in byte-level corpus.

The data position is global: "how many samples of this epoch's global order were consumed". Rank
``r`` of ``W`` takes every W-th index of that order starting at ``r``, so one batch step over all
ranks always covers a contiguous slice of the global order. That is what makes a single process
with accumulation k see the same samples per optimizer step as k ranks, and what lets a run
resume on another world size without skipping or repeating a sample.
"""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from distrain import compat


class ResumableDistributedSampler(DistributedSampler):
    """torch's DistributedSampler, plus ``set_start(samples_consumed)`` for mid-epoch resume."""

    def __init__(
        self,
        dataset,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int | None = 0,
        drop_last: bool = False,
        even: bool = True,
    ):
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed or 0, drop_last=drop_last
        )
        self.start = 0
        #: ``seed=None``: each epoch's order comes from a seed drawn from torch's generator when the epoch's first
        #: batch is fetched, as torch's ``RandomSampler`` draws it (Lightning's order on one process); the drawn seed
        #: is kept here, for a checkpoint to carry (None: not drawn yet this epoch)
        self.draws_seed = seed is None
        self.drawn_seed: int | None = None
        # even=False (evaluation): no padding duplicates, so each sample is counted exactly once
        # and ranks may get one sample more or less.
        self.even = even
        if not even:
            self.total_size = len(dataset)

    def set_start(self, samples_consumed: int) -> None:
        """Skip the first ``samples_consumed`` samples of this epoch's global order (all ranks)."""
        if samples_consumed % self.num_replicas:
            raise ValueError(
                f"cannot resume at global sample {samples_consumed} on {self.num_replicas} ranks: "
                "it is not a whole step of this world size (change the per-rank batch so the global batch matches)"
            )
        self.start = samples_consumed

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.drawn_seed = None  # a new epoch draws its own order

    def global_order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            if self.draws_seed and self.drawn_seed is None:
                self.drawn_seed = int(torch.empty((), dtype=torch.int64).random_().item())  # RandomSampler's draw
            g.manual_seed(self.drawn_seed if self.draws_seed else self.seed + self.epoch)
            indices = torch.randperm(len(self.dataset), generator=g).tolist()
        else:
            indices = list(range(len(self.dataset)))
        if self.drop_last:
            return indices[: self.total_size]
        padding = self.total_size - len(indices)  # repeat the head so every rank gets equal counts
        return indices + (indices * math.ceil(padding / max(1, len(indices))))[:padding]

    def __iter__(self) -> Iterator[int]:
        order = self.global_order()[self.start :]
        return iter(order[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return len(range(self.rank, self.total_size - self.start, self.num_replicas))


def with_distributed_sampler(
    loader: DataLoader,
    num_replicas: int,
    rank: int,
    seed: int,
    even: bool = True,
    batch_size: int | None = None,
    shuffle: bool | None = None,
    torch_draws: bool = False,
) -> DataLoader:
    """The same DataLoader, re-built around a ResumableDistributedSampler.

    Shuffling is kept as the user asked (a RandomSampler means shuffle). A batch sampler of the user's own
    is re-created around the distributed sampler, as Lightning does: ``cls(sampler, batch_size=…,
    drop_last=…)``, torch's BatchSampler signature. Iterable datasets are returned unchanged — they own
    their own sharding. ``batch_size``: another micro-batch than the loader's (an elastic resume keeping the
    global batch). ``shuffle``: shuffle (True) or not (False) whatever the loader says; None: as it says.
    ``torch_draws``: random numbers come from torch's generator as in a loader torch built (Lightning's): each
    epoch's iterator draws its workers' base seed from it, and on one rank a shuffled order draws its seed from it
    as ``RandomSampler`` does; otherwise the loader has a private generator and the order comes from ``seed``.
    """
    if isinstance(loader.dataset, IterableDataset) or distributed_sampler(loader) is not None:
        return loader
    own_batches = loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler
    if own_batches and not isinstance(getattr(loader.batch_sampler, "sampler", None), Sampler):
        if num_replicas == 1:
            return loader
        raise ValueError(
            f"the DataLoader's batch sampler {type(loader.batch_sampler).__name__} has no `sampler` attribute, so "
            f"distrain cannot shard it across {num_replicas} ranks (it re-creates a batch sampler around its "
            "distributed sampler, as Lightning does); shard it yourself and pass use_distributed_sampler=False"
        )
    sampler = loader.batch_sampler.sampler if own_batches else loader.sampler
    if not (
        type(sampler) is SequentialSampler
        or compat.plain_random_sampler(sampler)
        or type(sampler) is DistributedSampler
    ):
        if num_replicas == 1:
            return loader  # nothing to shard; the user's sampler decides the order
        raise ValueError(
            f"the DataLoader uses a {type(sampler).__name__}, which distrain cannot shard across {num_replicas} ranks "
            "without changing what it samples; shard it yourself and pass use_distributed_sampler=False"
        )
    if shuffle is None:
        shuffle = isinstance(sampler, (RandomSampler, DistributedSampler)) and getattr(sampler, "shuffle", True)
    drop_last = getattr(loader.batch_sampler, "drop_last", False) if own_batches else loader.drop_last
    draws_order = torch_draws and num_replicas == 1 and compat.plain_random_sampler(sampler)
    if draws_order and sampler.generator is not None:
        return loader  # its order comes from its own generator: nothing to shard, its sampler decides
    sampler = ResumableDistributedSampler(
        loader.dataset,
        num_replicas=num_replicas,
        rank=rank,
        shuffle=shuffle,
        seed=None if draws_order else seed,
        drop_last=drop_last,
        even=even,
    )
    if own_batches:
        rebuilt = _rebuilt(loader.batch_sampler, sampler, batch_size, drop_last, must=num_replicas > 1)
        if rebuilt is None:
            return loader  # one process, and a batch sampler that is not BatchSampler-like: its own order
        batching = dict(batch_sampler=rebuilt)
    else:
        batching = dict(batch_size=batch_size or loader.batch_size, sampler=sampler, drop_last=drop_last)
    # A private generator: creating the iterator must not draw from the global RNG, or a resumed run's dropout
    # stream would be shifted by one draw. It also seeds the workers (``seed_workers``): per rank and epoch. With
    # ``torch_draws``, torch's generator as the loader had it.
    distributed = _rebatched(loader, loader.generator if torch_draws else torch.Generator(), **batching)
    if torch_draws:
        return distributed
    distributed.distrain_worker_seed = (seed, rank)
    seed_workers(distributed, epoch=0)
    return distributed


def _rebatched(loader: DataLoader, generator: torch.Generator | None, **batching: Any) -> DataLoader:
    """A DataLoader as ``loader`` but for how it batches (``batching``: a sampler and batch size, or a batch
    sampler) and its ``generator``."""
    return DataLoader(
        loader.dataset,
        **batching,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
    )


class SeenBatches:
    """A batch sampler whose batches are kept as they are drawn (``seen``): the samples each batch of a loader holds,
    which Lightning's prediction writers are given. Drawn in the loading process, with workers too, which draw ahead:
    batch ``i``'s samples are ``seen[i]``. Its ``sampler``, ``batch_size`` and ``drop_last`` are the wrapped one's."""

    def __init__(self, batch_sampler: Any):
        self.batch_sampler = batch_sampler
        self.seen: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        self.seen = []
        for batch in self.batch_sampler:
            self.seen.append(list(batch))
            yield batch

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __getattr__(self, name: str) -> Any:
        if name == "batch_sampler":  # not yet set (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)


def with_seen_batches(loader: Any) -> tuple[Any, SeenBatches | None]:
    """``loader`` re-built to keep the samples of each batch it draws, and what keeps them; ``(loader, None)`` where
    its batches are not drawn by a batch sampler of a plain DataLoader (an iterable dataset, a DataLoader
    subclass, batching of its own)."""
    if type(loader) is not DataLoader or loader.batch_sampler is None:
        return loader, None
    seen = SeenBatches(loader.batch_sampler)
    rebuilt = _rebatched(loader, loader.generator, batch_sampler=seen)
    if hasattr(loader, "distrain_worker_seed"):  # its workers seeded as before (the generator is the same)
        rebuilt.distrain_worker_seed = loader.distrain_worker_seed
    return rebuilt, seen


def _rebuilt(
    batch_sampler: Sampler, sampler: Sampler, batch_size: int | None, drop_last: bool, must: bool
) -> Sampler | None:
    """The user's batch sampler class, drawing from ``sampler`` instead of its own (None where that fails and
    sharding is not a ``must``)."""
    cls = type(batch_sampler)
    try:
        return cls(sampler, batch_size=batch_size or batch_sampler.batch_size, drop_last=drop_last)
    except (TypeError, AttributeError) as error:
        if not must:
            return None
        raise ValueError(
            f"distrain shards the DataLoader's batch sampler by re-creating it around its distributed sampler as "
            f"{cls.__name__}(sampler, batch_size=…, drop_last=…), as Lightning does, and that failed ({error}); "
            f"give {cls.__name__} torch's BatchSampler signature, or shard it yourself and pass "
            "use_distributed_sampler=False"
        ) from None


def distributed_sampler(loader: Any) -> ResumableDistributedSampler | None:
    """The distrain sampler a loader draws from: its own, or its batch sampler's (None: it shards itself)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        if isinstance(sampler, ResumableDistributedSampler):
            return sampler
    return None


def micro_batch_size(loader: Any) -> int | None:
    """Samples per batch of a loader: its batch_size, or its batch sampler's (None: unknown)."""
    return getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None), "batch_size", None)


def seed_workers(loader: DataLoader, epoch: int) -> None:
    """Seed this epoch's DataLoader workers from (seed, rank, epoch): random augmentation in workers
    differs between ranks and epochs, and a run resumed at an epoch repeats that epoch's streams.
    (torch seeds each worker from a base seed drawn from the loader's generator when an epoch's
    iterator starts.) Loaders distrain did not build are left alone."""
    owner = getattr(loader, "distrain_worker_seed", None)
    if owner is not None:
        seed, rank = owner
        loader.generator.manual_seed((seed * 1_000_003 + rank * 7_919 + epoch * 104_729) % 2**63)


def move_to_device(batch: Any, device: torch.device, floating: torch.dtype | None = None) -> Any:
    """``batch``'s tensors (in any nesting of dicts, lists, tuples and namedtuples) on ``device``; ``floating``: its
    floating-point tensors also in that dtype (a "true" precision's, as Lightning converts a batch). A copy to the
    CPU completes before it returns (one that did not could be read before the device wrote it)."""
    if isinstance(batch, torch.Tensor):
        dtype = floating if floating is not None and batch.is_floating_point() else None
        return batch.to(device, dtype, non_blocking=torch.device(device).type != "cpu")
    if isinstance(batch, dict):
        return type(batch)({k: move_to_device(v, device, floating) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to_device(v, device, floating) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device, floating) for v in batch)
    if hasattr(batch, "to"):  # e.g. transformers' BatchEncoding
        return batch.to(device)
    return batch


def batch_size_of(batch: Any) -> int:
    """Leading dimension of the first tensor found in the batch (1 if none)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    for value in values:
        size = batch_size_of(value)
        if size:
            return size
    return 1


def tokens_in_batch(batch: Any) -> int | None:
    """Token count when the batch carries integer token ids (B × T), else None."""
    if isinstance(batch, dict):
        batch = batch.get("input_ids", next(iter(batch.values()), None))
    elif isinstance(batch, (list, tuple)) and batch:
        batch = batch[0]
    if isinstance(batch, torch.Tensor) and batch.dim() == 2 and not batch.is_floating_point():
        return batch.numel()
    return None


# ---------------------------------------------------------------------------------------------
# built-in corpus: Python's own standard library, read byte by byte — no download, ever.


def load_corpus(source: str = "builtin:stdlib", max_bytes: int = 4_000_000) -> torch.Tensor:
    """A 1-D uint8 tensor of the first ``max_bytes`` bytes of text, identical on every rank of the same Python.
    Only those bytes are read: a corpus of any size costs ``max_bytes`` of memory."""
    if max_bytes < 0:
        raise ValueError(f"data.max_bytes must be >= 0, got {max_bytes}")
    if source == "builtin:stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        data = bytearray()  # the modules joined by newlines, cut at max_bytes
        for i, file in enumerate(sorted(root.glob("*.py"))):  # top-level modules only: stable and plenty
            if i:
                data += b"\n"
            data += _read_head(file, max_bytes - len(data))
            if len(data) >= max_bytes:
                break
        data = data[:max_bytes]
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"data.dataset: {source!r} is neither 'builtin:stdlib' nor an existing text file")
        data = bytearray(_read_head(path, max_bytes))
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _read_head(path: Path, n: int) -> bytes:
    """The first ``n`` bytes of a file (fewer if it is shorter), reading no more than that."""
    if n <= 0:
        return b""
    with open(path, "rb") as f:
        chunks, left = [], n
        while left:  # read() may return less than asked (a pipe, a network file system) before the end
            chunk = f.read(left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    return b"".join(chunks)


class ByteBlocks(Dataset):
    """Non-overlapping blocks of ``seq_len + 1`` bytes → (inputs, next-byte targets)."""

    def __init__(self, data: torch.Tensor, seq_len: int):
        if len(data) < seq_len + 1:
            raise ValueError(f"corpus has {len(data)} bytes, fewer than one block of seq_len+1={seq_len + 1}")
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int):
        block = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return block[:-1], block[1:]


def byte_datasets(source: str, seq_len: int, max_bytes: int, val_fraction: float) -> tuple[ByteBlocks, ByteBlocks]:
    data = load_corpus(source, max_bytes)
    split = int(len(data) * (1 - val_fraction))
    return ByteBlocks(data[:split], seq_len), ByteBlocks(data[split:], seq_len)
