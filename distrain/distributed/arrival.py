"""Whether every rank made a call, asked without a collective: a collective entered by one rank alone waits for the
others forever (or gloo aborts the process on the next mismatched message). The ranks count themselves in the
rendezvous store instead, and the first to decide, all arrived or waited out, decides for every rank that comes."""

from __future__ import annotations

import time

from distrain import compat

#: how long a rank waits for the others to make the same call: ranks running the same code reach it within a step's
#: skew; a call made under ``if trainer.is_global_zero:`` is never joined
WAIT_S = 10.0


def called_by_every_rank(call: str, rank: int, world_size: int, wait_s: float | None = None) -> tuple[bool, int]:
    """``(True, -1)``: every rank made the call named ``call`` (a name every rank gives the same call, unique per
    call: e.g. with the step in it), go on together; ``(False, r)``: rank ``r`` went on alone (not all came in
    ``wait_s``), and every other rank that makes the call later must do nothing of it."""
    wait_s = WAIT_S if wait_s is None else wait_s
    store = compat.default_store()
    key = f"distrain/arrival/{call}"
    decided = f"{key}/decided"
    arrived = store.add(key, 1)
    deadline = time.monotonic() + wait_s
    while arrived < world_size and time.monotonic() < deadline:
        if store.check([decided]):  # decided already, by a rank that waited out its time
            break
        time.sleep(0.02)
        arrived = store.add(key, 0)
    mine = "together" if arrived >= world_size else f"alone:{rank}"
    decision = store.compare_set(decided, "", mine).decode()  # the first decision stands
    if decision == "together":
        return True, -1
    return False, int(decision.split(":")[1])
