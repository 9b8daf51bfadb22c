"""Hang diagnosis: every rank says where it is; a collective that fails names who was elsewhere.

Process-group init waits generously (``timeout``, default 30 min: nodes come up at different
times). Once the group is up, collectives get a tight ``collective_timeout`` (default 5 min),
except in phases known to be long on some ranks only (checkpoint IO: rank 0 writes while the
others wait), which get the init timeout back.

Each rank records its progress — step, phase, and a running count of phases entered — in the
rendezvous store when it enters a phase. When a collective times out, or a peer's connection
closes, the failing rank reads every rank's record and raises an error that names the rank(s)
that did not arrive and where they stopped:

    distrain: a collective did not complete on every rank.
      rank 1 stopped at step 7 (in optimizer step) and never reached this collective;
      ranks 0,2,3 waited at step 7 (in logging) for 300 s, the collective timeout (...).
      (RuntimeError on rank 0: ... Timed out waiting 300000ms for recv operation to complete)

All ranks run the same phases in the same order, so the phase count orders them: a rank with a
lower count is behind the others, one with a higher count went on without them.

The Trainer turns the error into this one in ``fit``; a custom loop calls
``runtime.explain_failure(error)``. On NCCL the watchdog ends the process on a timeout before
Python sees an error (TORCH_NCCL_ASYNC_ERROR_HANDLING's default), so there the diagnosis is the
flight recorder's dump (``enable_nccl_flight_recorder`` below).

Cost: one store write per phase change (a handful per optimizer step, none per micro-step).
TCPStore sends a write without waiting for a reply: 6-13 µs per new phase, 30-65 µs per
step, on our 2-core CPU machine (``python benchmarks/progress_marks.py``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import socket
import tempfile
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from distrain import compat

#: what torch/gloo/NCCL say when a collective gave up on a peer
_TIMEOUT_WORDS = ("timed out", "timeout")
_PEER_WORDS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
    "connection refused",
    "end of file",
)

#: ... and only errors that come from a backend (gloo's carry its source paths, or say "pair")
_BACKEND_WORDS = ("gloo", "nccl", "c10d", "processgroup", "pair closure")

_active: CollectiveWatch | None = None


def active() -> CollectiveWatch | None:
    """The watch of the process group distrain initialized in this process, if any."""
    return _active


def start(rank: int, world_size: int, init_timeout: timedelta) -> CollectiveWatch:
    global _active
    _active = CollectiveWatch(compat.default_store(), rank, world_size, init_timeout)
    return _active


def stop() -> None:
    global _active
    if _active is not None:
        _active.stacks.close()
    _active = None


def mark(step: int | None, phase: str) -> None:
    """Record where this rank is (no-op without a watched group)."""
    if _active is not None:
        _active.mark(step, phase)


def patient(phase: str):
    """Context for a phase whose collectives may wait as long as process-group init."""
    return _active.patient(phase) if _active is not None else contextlib.nullcontext()


def where(rank: int) -> str | None:
    """Where ``rank`` last said it was (``step 3 (in forward/backward)``); None without a watched group."""
    return _active.where(rank) if _active is not None else None


def explain(error: BaseException) -> CollectiveHangError | None:
    """The diagnosis of a collective that timed out or lost a peer; None for any other error."""
    return _active.explain(error) if _active is not None else None


class CollectiveWatch:
    def __init__(self, store: dist.Store, rank: int, world_size: int, init_timeout: timedelta):
        self.store: dist.Store | None = dist.PrefixStore("distrain/progress", store)
        self.rank, self.world_size = rank, world_size
        self.init_timeout = init_timeout
        self.collective_timeout = init_timeout
        self.step, self.phase = 0, "set-up"
        self._count = 0  # phases entered so far: the same sequence on every rank
        self._patient = 0
        self.stacks = StackDumps()
        self._publish()
        if self.store is not None:
            with contextlib.suppress(Exception):  # where a rank that fails can ask for this one's stack
                self.store.set(f"rank{rank}/stack", self.stacks.address)

    # ---- recording (the hot path: an equality check, and one store write per new phase) ------------
    def mark(self, step: int | None, phase: str) -> None:
        step = self.step if step is None else step
        if step == self.step and phase == self.phase:
            return
        self.step, self.phase = step, phase
        self._count += 1
        self._publish()

    def _publish(self, state: str = "running") -> None:
        if self.store is None:
            return
        try:
            self.store.set(f"rank{self.rank}", f"{self._count}|{self.step}|{state}|{self.phase}")
        except Exception:  # the store's host is gone; the next collective fails on its own
            self.store = None

    def where(self, rank: int) -> str | None:
        """Where ``rank`` last said it was: this rank's own mark, another's from the store (the launcher names a rank
        that died without a word by it); None when the store cannot say."""
        if rank == self.rank:
            return f"step {self.step} (in {self.phase})"
        if self.store is None:
            return None
        try:
            self.store.set_timeout(timedelta(seconds=10))  # an unreachable store must not hang a failure's report
            if not self.store.check([f"rank{rank}"]):
                return None
            _count, step, _state, phase = self.store.get(f"rank{rank}").decode().split("|", 3)
        except Exception:  # noqa: BLE001 — a report must never hide the failure it reports
            return None
        return f"step {step} (in {phase})"

    # ---- timeouts ------------------------------------------------------------------------------------
    def set_collective_timeout(self, timeout: timedelta) -> None:
        self.collective_timeout = timeout
        if not self._patient:
            compat.set_group_timeouts(timeout)

    @contextlib.contextmanager
    def patient(self, phase: str):
        """A phase whose collectives may wait as long as process-group init (checkpoint IO)."""
        previous = self.phase
        self.mark(None, phase)
        self._patient += 1
        if self._patient == 1:
            compat.set_group_timeouts(self.init_timeout)
        try:
            yield
        finally:
            self._patient -= 1
            if self._patient == 0:
                compat.set_group_timeouts(self.collective_timeout)
            self.mark(None, previous)

    # ---- diagnosis -------------------------------------------------------------------------------------
    def explain(self, error: BaseException) -> CollectiveHangError | None:
        """For a collective that timed out or lost a peer: an error naming the ranks that were
        elsewhere, and where. None for any other error."""
        if isinstance(error, CollectiveHangError) or not isinstance(error, RuntimeError):
            return None
        text = str(error).lower()
        if not isinstance(error, dist.DistError) and not any(w in text for w in _BACKEND_WORDS):
            return None  # e.g. a DataLoader's own timeout: not a collective's
        timed_out = any(w in text for w in _TIMEOUT_WORDS)
        if not timed_out and not any(w in text for w in _PEER_WORDS):
            return None
        self._publish("failed")
        here = f"at step {self.step} (in {self.phase})"
        if timed_out:
            if self._patient:  # checkpoint IO waits as long as init does
                how = (
                    f"waited {here} for {_seconds(self.init_timeout)} s, the init/checkpoint timeout "
                    "(distributed.timeout_seconds, Trainer(timeout=...))"
                )
            else:
                how = (
                    f"waited {here} for {_seconds(self.collective_timeout)} s, the collective timeout "
                    "(distributed.collective_timeout_seconds, Trainer(collective_timeout=...))"
                )
        else:
            how = f"were {here} when a peer's connection closed (a rank exited or crashed: see its log)"
        reports, unreadable = self._read_reports()
        if any(rep[0] == self._count and rep[2] != "failed" for rep in reports.values()):
            time.sleep(1.0)  # peers in this same collective time out within moments of us
            reports, unreadable = self._read_reports()
        lines = _describe(self._count, reports, how, self.world_size)
        culprits = _culprits(self._count, reports, self.world_size)
        if unreadable:
            lines.append(
                f"(could not read the other ranks' progress from the store: {unreadable}; "
                "rank 0 hosts it unless a launcher such as torchrun does — did it die?)"
            )
        for rank in list(culprits)[:4]:  # a stuck rank's own stack: where it is, not only that it is late
            lines += self._stack_of(rank)
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        lines.append(f"({type(error).__name__} on rank {self.rank}: {first_line[:300]})")
        headline = _headline(culprits, timed_out)
        return CollectiveHangError(
            f"distrain: a collective did not complete on every rank: {headline}\n  " + "\n  ".join(lines),
            culprits=culprits,
            peer_left=not timed_out,
        )

    def _stack_of(self, rank: int) -> list[str]:
        """The lines that show where ``rank`` is (its main thread, innermost call first), when it runs on this
        machine and is alive; nothing otherwise (a rank that exited has no stack: its exit shows elsewhere)."""
        if self.store is None:
            return []
        try:
            if not self.store.check([f"rank{rank}/stack"]):
                return []
            address = self.store.get(f"rank{rank}/stack").decode()
        except Exception:  # noqa: BLE001 — a diagnosis must never hide the real error
            return []
        return StackDumps.request(rank, address)

    def _read_reports(self) -> tuple[dict[int, tuple[int, int, str, str]], str | None]:
        reports = {self.rank: (self._count, self.step, "failed", self.phase)}
        if self.store is None:
            return reports, "the store is unreachable"
        try:
            self.store.set_timeout(timedelta(seconds=10))  # an unreachable store must not hang us too
            for r in range(self.world_size):
                key = f"rank{r}"
                if r != self.rank and self.store.check([key]):
                    count, step, state, phase = self.store.get(key).decode().split("|", 3)
                    reports[r] = (int(count), int(step), state, phase)
        except Exception as e:  # noqa: BLE001 — a diagnosis must never hide the real error
            return reports, f"{type(e).__name__}: {e}"
        return reports, None


class CollectiveHangError(RuntimeError):
    """A collective timed out or lost a peer; the message names the ranks that were elsewhere. ``culprits``: the
    ranks that did not arrive (behind, stuck inside the phase, silent, or gone ahead), each with where it was — never
    a rank that only waited."""

    def __init__(self, message: str, culprits: dict[int, str] | None = None, peer_left: bool = False):
        super().__init__(message)
        self.culprits = dict(culprits or {})
        self.peer_left = peer_left  # a peer's connection closed (it exited), rather than a timeout


def _culprits(my_count: int, reports: dict, world_size: int) -> dict[int, str]:
    """rank -> where it was, for every rank that did not reach the collective the others waited in: behind them,
    at the same phase but not in the collective, silent; or, when none is, the ranks that went on without it."""
    late = {
        r: f"step {step} (in {phase})"
        for r, (count, step, state, phase) in sorted(reports.items())
        if count < my_count or (count == my_count and state != "failed")
    }
    late.update({r: "no progress reported" for r in range(world_size) if r not in reports})
    if late:
        return dict(sorted(late.items()))
    return {
        r: f"step {step} (in {phase})" for r, (count, step, _s, phase) in sorted(reports.items()) if count > my_count
    }


def _headline(culprits: dict[int, str], timed_out: bool) -> str:
    """One line that names the rank(s) at fault, for the console: the others only waited for them."""
    if not culprits:
        return "every rank reached it and waited (different collectives on different ranks, or the network failed)"
    where = "; ".join(f"rank {r} at {w}" for r, w in list(culprits.items())[:4])
    more = f" and {len(culprits) - 4} more" if len(culprits) > 4 else ""
    if timed_out:
        return f"{_ranks(list(culprits))} never arrived ({where}{more})"
    return f"{_ranks(list(culprits))} left or crashed ({where}{more})"


def _describe(my_count: int, reports: dict, how: str, world_size: int) -> list[str]:
    """``reports``: rank -> (phases entered, step, state, phase) of every rank that reported."""
    waited = sorted(r for r, rep in reports.items() if rep[0] == my_count and rep[2] == "failed")
    busy = sorted(r for r, rep in reports.items() if rep[0] == my_count and rep[2] != "failed")
    behind: dict[tuple, list[int]] = {}
    ahead: dict[tuple, list[int]] = {}
    for r, (count, step, _state, phase) in sorted(reports.items()):
        if count < my_count:
            behind.setdefault((count, step, phase), []).append(r)
        elif count > my_count:
            ahead.setdefault((count, step, phase), []).append(r)
    silent = [r for r in range(world_size) if r not in reports]
    lines = []
    for (_, step, phase), ranks in sorted(behind.items()):
        lines.append(f"{_ranks(ranks)} stopped at step {step} (in {phase}) and never reached this collective;")
    for (_, step, phase), ranks in sorted(ahead.items()):
        lines.append(
            f"{_ranks(ranks)} went on to step {step} (in {phase}) without it: a different code path "
            "(a collective that only some ranks run?);"
        )
    if silent:
        lines.append(f"{_ranks(silent)} never reported progress (not started, or died before training);")
    if busy:
        lines.append(
            f"{_ranks(busy)} reached the same step and phase but not this collective: slow inside the "
            "phase (a long computation or IO before it)?"
        )
    lines.append(f"{_ranks(waited)} {how}.")
    if not (behind or ahead or silent or busy):
        lines.append(
            "Every rank reached this phase and waited, so none is behind: the ranks issued different "
            "collectives inside it, or the network failed."
        )
    return lines


class StackDumps:
    """Lets another rank of this machine ask this process for its Python stack, even when it is stuck in C code
    holding the GIL: ``faulthandler`` writes every thread's stack from its signal handler (SIGUSR2), into a file
    of this process's own. Costs nothing per step: nothing runs until a rank that failed asks.

    ``address`` (published in the store) is ``host|pid|main thread id|file``; ``request`` signals the process and
    reads what it wrote."""

    SIGNAL = getattr(signal, "SIGUSR2", None)

    def __init__(self):
        self.file = None
        if self.SIGNAL is None:  # not on this platform
            self.address = ""
            return
        fd, path = tempfile.mkstemp(prefix=f"distrain-stack-{os.getpid()}-", suffix=".txt")
        self.file = os.fdopen(fd, "a")  # appended to: a reader takes what came after its request
        self.named: str | None = path  # removed by close()
        if os.path.isdir(f"/proc/{os.getpid()}/fd"):
            # Linux: the file has no name, and goes with the process however it ends (a SIGKILL, os._exit); another
            # process of this user reads it through this process's descriptor
            os.unlink(path)
            self.named, path = None, f"/proc/{os.getpid()}/fd/{fd}"
        # a handler the program set for the signal still runs after the dump; the default one would end the process
        previous = signal.getsignal(self.SIGNAL)
        chain = callable(previous)
        faulthandler.register(self.SIGNAL, file=self.file, all_threads=True, chain=chain)
        self.address = f"{socket.gethostname()}|{os.getpid()}|{threading.main_thread().ident}|{path}"

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(Exception):
                faulthandler.unregister(self.SIGNAL)
                self.file.close()
                if self.named:
                    os.unlink(self.named)
            self.file = None

    @classmethod
    def request(cls, rank: int, address: str, wait: float = 2.0) -> list[str]:
        try:
            host, pid, main_thread, path = address.split("|", 3)
            if host != socket.gethostname() or cls.SIGNAL is None:
                return []
            before = os.path.getsize(path)
            os.kill(int(pid), cls.SIGNAL)
        except (ValueError, OSError):  # gone, or not ours to signal
            return []
        deadline, text = time.monotonic() + wait, ""
        while time.monotonic() < deadline:  # the handler writes at once; done when the file stops growing
            time.sleep(0.1)
            with open(path) as f:
                f.seek(before)
                now = f.read()
            if now and now == text:
                break
            text = now
        frames = _main_thread_frames(text, int(main_thread))
        if not frames:
            return []
        # where it is (the innermost frame, a library's too), then the user's own frames around it
        shown = frames[:1] + [f for f in frames[1:] if not library_frame(f)][:4]
        return [f"rank {rank} is here (its main thread, innermost call first):"] + [f"  {frame}" for frame in shown]


_LIBRARIES = tuple(
    {os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, os.path.dirname(os.__file__) + os.sep}
)


def library_frame(frame: str) -> bool:
    """A frame in distrain, the standard library or an installed package: not where a user looks first."""
    path = frame.split('"')[1] if frame.count('"') >= 2 else ""
    return path.startswith(_LIBRARIES) or "site-packages" in path or "dist-packages" in path


def _main_thread_frames(dump: str, main_thread: int) -> list[str]:
    """The frames ``faulthandler`` wrote for the main thread: ``File "x.py", line 3 in f`` lines."""
    frames: list[str] = []
    current = None
    for line in dump.splitlines():
        head = re.match(r"(?:Current thread|Thread) (0x[0-9a-f]+)", line.strip())
        if head:
            current = int(head.group(1), 16)
            continue
        if current == main_thread and line.strip().startswith("File "):
            frames.append(line.strip())
    return frames


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2,5'."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ",".join(str(a) if a == b else (f"{a},{b}" if b == a + 1 else f"{a}-{b}") for a, b in spans)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def _seconds(t: timedelta) -> str:
    return f"{t.total_seconds():g}"


def enable_nccl_flight_recorder(dump_dir: str | None, buffer_size: int = 2000) -> None:
    """Before an NCCL process group is created: keep the last ``buffer_size`` collectives of every
    rank in PyTorch's flight recorder and dump them when the NCCL watchdog sees a timeout, to
    ``<dump_dir>/rank_<N>``. Read the dumps with ``python -m torch.distributed.flight_recorder.fr_trace
    <dump_dir>`` (it names the rank that did not join). Variables the user set win."""
    import os

    names = {
        "buffer": ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),  # new name, older name
        "file": ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"),
    }
    if not any(n in os.environ for n in names["buffer"]):
        for n in names["buffer"]:
            os.environ[n] = str(buffer_size)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if dump_dir and not any(n in os.environ for n in names["file"]):
        os.makedirs(dump_dir, exist_ok=True)
        for n in names["file"]:
            os.environ[n] = os.path.join(os.path.abspath(dump_dir), "rank_")
