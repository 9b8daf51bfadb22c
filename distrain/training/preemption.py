"""Stopping on a signal, on every rank at the same step.

SIGTERM (torchrun or Kubernetes stopping us) and SIGUSR1 (SLURM before the time limit or a
preemption) end the run at the next optimizer step with a checkpoint, instead of killing it
mid-step. A signal reaches the ranks at different moments, so each step starts an asynchronous
max-reduction of "signal received?" and reads the one started a step earlier, which has long
finished: agreement without a blocking collective per step. A callback setting ``should_stop`` on
some ranks only is agreed the same way.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_ASKED = 0.5  # a stop asked for by the code (should_stop), not by a signal: below every signal number


class StopAgreement:
    def __init__(self, runtime, signals: tuple[int, ...] = SIGNALS):
        self.runtime = runtime
        self.signals = signals  # each stops the run; Lightning's SLURMEnvironment adds its requeue_signal
        self.received: int | None = None  # a signal this rank got
        self.preempted: int | None = None  # the signal every rank agreed to stop on
        self._pending: Callable[[], float] | None = None
        self._previous_handlers: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread

        def handler(signum, frame):
            self.received = signum

        for signum in self.signals:
            self._previous_handlers[signum] = signal.signal(signum, handler)

    def uninstall(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}

    def requested(self, local: bool = False) -> bool:
        """Call once per optimizer step on every rank: True on all of them at the same step once any
        rank got a signal or asked to stop (``local``, a callback's ``should_stop``). On several ranks
        that is one step after the request; on one process, at once. The strategy says how its ranks
        agree (``Strategy.agree_to_stop``): torchft's replica groups agree across groups too."""
        mine = float(self.received or 0) or (_ASKED if local else 0.0)
        flag = self._collect()
        agreed = self.runtime.strategy.agree_to_stop(mine)
        if not callable(agreed):
            return self._decide(agreed)
        self._pending = agreed
        return flag

    def requested_now(self, local: bool = False) -> bool:
        """At an epoch's end, on every rank: as ``requested``, but waits for this agreement instead of reading it a
        step later, so a stop asked after the epoch's last step (early stopping on its validation) ends the run at
        this boundary. Replica groups agree only with a step's gradients (torchft): they stop one step later."""
        flag = self.requested(local)
        return self._collect() or flag

    def finish(self) -> None:
        """Collect the reduction still in flight: no collective may be left behind."""
        self._collect()

    def abandon(self) -> None:
        """After a failed collective: the reduction in flight can never finish either."""
        self._pending = None

    def _collect(self) -> bool:
        pending, self._pending = self._pending, None
        return self._decide(pending() if pending is not None else 0.0)

    def _decide(self, flag: float) -> bool:
        if flag >= 1:  # a signal number
            self.preempted = int(flag)
        return bool(flag)
