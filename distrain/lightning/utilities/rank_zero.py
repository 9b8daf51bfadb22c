"""Lightning's rank-zero helpers: a function, a message or a warning on global rank 0 only."""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

log = logging.getLogger("distrain")


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def rank_zero_only(fn: Callable) -> Callable:
    """``fn`` runs on global rank 0; elsewhere the call does nothing and returns None."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs) if _rank() == 0 else None

    return wrapped


@rank_zero_only
def rank_zero_info(*args: Any, **kwargs: Any) -> None:
    log.info(*args, **kwargs)


@rank_zero_only
def rank_zero_debug(*args: Any, **kwargs: Any) -> None:
    log.debug(*args, **kwargs)


@rank_zero_only
def rank_zero_warn(message: str | Warning, category: type[Warning] = UserWarning, stacklevel: int = 4, **kw) -> None:
    warnings.warn(message, category, stacklevel=stacklevel, **kw)
