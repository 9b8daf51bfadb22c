"""Collectives on the default group, as plain functions: a no-op on one process, and on the
device the backend moves (NCCL: CUDA tensors; gloo: CPU ones). Results come back on the caller's
device; inputs are never modified."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def comm_device(device: torch.device) -> torch.device:
    """Where a tensor must be for the default group's backend to move it."""
    return device if "nccl" in dist.get_backend() and device.type == "cuda" else torch.device("cpu")


def _work_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to(comm_device(tensor.device), copy=True)


def all_reduce(tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
    if op not in (*_OPS, "mean"):
        raise ValueError(f"all_reduce op must be mean, sum, max or min, got {op!r}")
    if not _active():
        return tensor
    work = _work_copy(tensor)
    dist.all_reduce(work, op=_OPS.get(op, dist.ReduceOp.SUM))
    if op == "mean":
        work = work / dist.get_world_size()
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


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's tensor stacked along a new leading dimension."""
    if not _active():
        return tensor.unsqueeze(0)
    work = _work_copy(tensor).contiguous()
    out = [torch.empty_like(work) for _ in range(dist.get_world_size())]
    dist.all_gather(out, work)
    return torch.stack(out).to(tensor.device)


def all_gather_object(obj: Any) -> list:
    if not _active():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
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


def decided_on_rank_zero(decide: Callable[[], Any]) -> Any:
    """``decide()`` run on rank 0 alone, its result handed to every rank. When it raises, every rank
    raises it (rank 0 the original, the others a copy that says it came from rank 0): a decision that
    fails must never leave the other ranks waiting for it. Call it on every rank together."""
    if not _active():
        return decide()
    outcome = None
    if dist.get_rank() == 0:
        try:
            outcome = ("ok", decide())
        except Exception as error:  # noqa: BLE001 — shared below, then raised on every rank
            outcome = ("error", (type(error), str(error)))
            failure = error
    kind, value = broadcast(outcome)
    if kind == "ok":
        return value
    if dist.get_rank() == 0:
        raise failure
    raise _copy_of(*value)


def _copy_of(cls: type, message: str) -> Exception:
    text = f"{message} (raised on rank 0)"
    try:
        return cls(text)
    except Exception:  # noqa: BLE001 — an exception class that takes other arguments
        return RuntimeError(f"{cls.__name__}: {text}")


def barrier() -> None:
    if _active():
        dist.barrier()
