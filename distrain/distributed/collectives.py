"""Collectives on the default group, as plain functions: a no-op on one process, and on the
device the backend moves (NCCL: CUDA tensors; gloo: CPU ones). Results come back on the caller's
device; inputs are never modified."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def global_rank() -> int:
    """This process's global rank: the process group's once it exists, else the launcher's ``RANK`` (0 alone)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def comm_device(device: torch.device) -> torch.device:
    """Where a tensor must be for the default group's backend to move it."""
    return device if "nccl" in dist.get_backend() and device.type == "cuda" else torch.device("cpu")


def _work_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to(comm_device(tensor.device), copy=True)


def all_reduce(tensor: torch.Tensor, op: str = "mean", group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``tensor`` reduced over ``group``'s ranks (every rank: None)."""
    if op not in (*_OPS, "mean"):
        raise ValueError(f"all_reduce op must be mean, sum, max or min, got {op!r}")
    if not _active():
        return tensor
    work = _work_copy(tensor)
    dist.all_reduce(work, op=_OPS.get(op, dist.ReduceOp.SUM), group=group)
    if op == "mean":
        work = work / dist.get_world_size(group)
    return work.to(tensor.device)


def all_reduce_async(tensor: torch.Tensor, op: str = "max") -> Callable[[], torch.Tensor]:
    """Start an all-reduce that overlaps with what follows; call the returned function for the
    result. Every rank must start the same ones in the same order."""
    if not _active():
        return lambda: tensor
    work = _work_copy(tensor)
    handle = dist.all_reduce(work, op=_OPS[op], async_op=True)

    def result() -> torch.Tensor:
        handle.wait()
        return work.to(tensor.device)

    return result


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The tensor of every rank of ``group`` (None: every rank) stacked along a new leading dimension."""
    if not _active():
        return tensor.unsqueeze(0)
    work = _work_copy(tensor).contiguous()
    out = [torch.empty_like(work) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, work, group=group)
    return torch.stack(out).to(tensor.device)


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list:
    if not _active():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(obj: Any, src: int = 0) -> Any:
    """A tensor (returned on the caller's device) or any picklable object, from rank ``src``."""
    if not _active():
        return obj
    if isinstance(obj, torch.Tensor):
        work = _work_copy(obj)
        dist.broadcast(work, src)
        return work.to(obj.device)
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


class SharedFailure(Exception):
    """Raised on every rank by ``shared_outcome`` when the action failed on one rank or more."""

    def __init__(self, failures: list[tuple[int, type, str]], local: BaseException | None):
        self.failures = failures
        """(rank, error class, its description) of each rank whose action failed, in rank order."""
        self.local = local
        """This rank's own error, when its action was one of them."""
        rank, cls, text = failures[0]
        super().__init__(f"rank {rank} failed: {cls.__name__}: {text}")


def shared_outcome(
    action: Callable[[], Any] | None,
    gather: Callable[[Any], list] | None = None,
    describe: Callable[[BaseException], str] = str,
) -> list:
    """How a failure on one rank reaches the others, for any step every rank waits on: ``action`` runs here (None:
    this rank has nothing to do), then every rank learns how it went on every rank. Returns each rank's result; when
    it failed anywhere, every rank raises ``SharedFailure`` naming the ranks and their errors (``describe``d where
    they happened), so no rank is left waiting for one that failed. ``gather``: ``all_gather_object`` over the
    ranks concerned (the default group's by default). Call it on every rank together."""
    outcome, local = ("ok", None), None
    if action is not None:
        try:
            outcome = ("ok", action())
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # noqa: BLE001 — shared below, then raised on every rank
            outcome, local = ("error", (_picklable(type(error)), describe(error))), error
    outcomes = (gather or all_gather_object)(outcome)
    failures = [(rank, *value) for rank, (kind, value) in enumerate(outcomes) if kind == "error"]
    if failures:
        raise SharedFailure(failures, local)
    return [value for _, value in outcomes]


def _picklable(cls: type) -> type:
    """The class itself when the other ranks can unpickle it (one defined inside a function cannot), else
    RuntimeError: the description says what it was."""
    try:
        pickle.loads(pickle.dumps(cls))
    except Exception:  # noqa: BLE001
        return RuntimeError
    return cls


def decided_on_rank_zero(decide: Callable[[], Any]) -> Any:
    """``decide()`` run on rank 0 alone, its result handed to every rank (``shared_outcome``). When it raises, every
    rank raises it (rank 0 the original, the others a copy that says it came from rank 0): a decision that fails
    must never leave the other ranks waiting for it. Call it on every rank together."""
    if not _active():
        return decide()
    try:
        return shared_outcome(decide if dist.get_rank() == 0 else None)[0]
    except SharedFailure as failure:
        if failure.local is not None:
            raise failure.local from None
        _, cls, message = failure.failures[0]
        raise _copy_of(cls, message) from None


def _copy_of(cls: type, message: str) -> Exception:
    text = f"{message} (raised on rank 0)"
    try:
        return cls(text)
    except Exception:  # noqa: BLE001 — an exception class that takes other arguments
        return RuntimeError(f"{cls.__name__}: {text}")


def barrier() -> None:
    if _active():
        dist.barrier()
