"""How long a rank took from its process start to its first step, in parts: the recovery time a user waits for
after a failure (a restart from the last checkpoint, a replica group that rejoins), and what to cut in it.

Marks are wall-clock times (``time.time``, comparable with the process's start time the OS keeps), taken once
each; a rank that resumed or was restarted says, on rank 0, where the seconds went before it trained again.
"""

from __future__ import annotations

import os
import time

_marks: list[tuple[str, float]] = []


def mark(part: str) -> None:
    """The end of ``part`` (the time since the previous mark, or since the process started); the first time only:
    a process that fits again is not starting."""
    if all(name != part for name, _ in _marks):
        _marks.append((part, time.time()))


def process_started() -> float:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # psutil is a dependency, but an environment may predate it
        return _marks[0][1] if _marks else time.time()


def restarted() -> bool:
    """torchrun restarted this rank's process after a failure (elastic restarts, torchft groups)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def parts() -> list[tuple[str, float]]:
    """Each part's seconds, in order, the first counted from the process's start."""
    out, before = [], process_started()
    for part, at in _marks:
        out.append((part, max(at - before, 0.0)))
        before = at
    return out


def line(step: int) -> str:
    """``distrain: training again at step 21, 7.9 s after the process started: imports and config 4.1 s, ...``"""
    timeline = parts()
    total = sum(seconds for _, seconds in timeline)
    shown = ", ".join(f"{part} {seconds:.1f} s" for part, seconds in timeline)
    return f"distrain: training again at step {step}, {total:.1f} s after the process started: {shown}"
