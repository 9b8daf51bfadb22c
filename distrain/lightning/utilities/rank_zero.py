"""Lightning's rank-zero helpers: a function, a message or a warning on global rank 0 only."""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any

from distrain.distributed.collectives import global_rank

log = logging.getLogger("distrain")


def rank_zero_only(fn: Callable) -> Callable:
    """``fn`` runs on global rank 0; elsewhere the call does nothing and returns None."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs) if global_rank() == 0 else None

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
