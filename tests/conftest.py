import faulthandler
import fcntl
import glob
import importlib.util
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest

# the tests' shared helpers (tests/helpers.py) import as `helpers`, in spawned ranks too; the planner's
# measuring harness, shared with benchmarks/plan_accuracy.py, as `plan_measure`
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 cores: ranks must not fight over threads
# which pytest process this is: "main", or the xdist worker ("gw0", "gw1") that `-n 2` starts. A rank a
# test starts inherits its test process's folders; a worker makes its own, never sharing the main process's.
_OWNER = os.environ.get("PYTEST_XDIST_WORKER", "main")
# plans kept between starts (distrain/planner/cache.py): the session's own, not the user's, and none left after
if os.environ.get("DISTRAIN_TEST_OWNER") != _OWNER:
    os.environ["DISTRAIN_TEST_OWNER"] = _OWNER
    os.environ["DISTRAIN_PLAN_CACHE"] = tempfile.mkdtemp(prefix="distrain-plans-")
# what the workers share: the turns of tests marked `alone`, and the tables they report (made by the main process)
if "DISTRAIN_TEST_SHARED" not in os.environ:
    os.environ["DISTRAIN_TEST_SHARED"] = tempfile.mkdtemp(prefix="distrain-tests-")
_SHARED = Path(os.environ["DISTRAIN_TEST_SHARED"])

# tests/helpers.run_ranks forks its ranks from a server that has imported these once (see START_METHOD). Where no GPU
# is (the CPU suite) the server also imports what nearly every rank would import for itself, seconds of one core each
# on 2 cores: torch._dynamo (torch imports it at a process's first optimizer), Hugging Face's modeling code and
# DeepSpeed (the strategy × model matrix, `verify`, the DeepSpeed tests); test_matrix.py went from 176 to 129 CPU
# seconds. Not on a GPU machine: there a module that asks CUDA in a server that forks is a risk not worth taking.
_PRELOAD = ["helpers", "distrain.trainer"]
if not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd")):
    _PRELOAD += [
        m
        for m in ("torch._dynamo", "transformers.modeling_utils", "deepspeed")
        if importlib.util.find_spec(m.split(".")[0])
    ]
multiprocessing.set_forkserver_preload(_PRELOAD)


def report(lines: list[str]) -> None:
    """Tables a test wants shown at the end of the session (the strategy × model matrix): written to the
    shared folder, since a worker has no terminal; the main process prints them."""
    with open(_SHARED / f"report-{_OWNER}.txt", "a") as out:
        out.write("\n".join([*lines, ""]) + "\n")


def pytest_terminal_summary(terminalreporter):
    reports = sorted(_SHARED.glob("report-*.txt"))
    if reports:
        terminalreporter.section("distrain matrix")
        for path in reports:
            for line in path.read_text().splitlines():
                terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    if "distrain-plans-" in os.environ.get("DISTRAIN_PLAN_CACHE", ""):
        shutil.rmtree(os.environ["DISTRAIN_PLAN_CACHE"], ignore_errors=True)
    _end_leftover_ranks(session)


def pytest_unconfigure(config):
    if _OWNER == "main":  # after the summary printed the reports
        shutil.rmtree(_SHARED, ignore_errors=True)


# ---- tests that run alone -----------------------------------------------------------------------------------
# `pytest -n 2` (docs/testing.md; CI runs serially) runs two test files at once (pytest-xdist, `--dist
# loadfile`: a file's shared rank
# processes start once). A test marked `alone` (hang and straggler detection, measured rates and times: whatever
# a busy neighbour would skew) waits until the other worker's current test ends, and no test starts beside it. A
# reader-writer lock on two files: `gate` stops new tests while an `alone` test waits for `room` to empty.
@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: the wait is not part of any test's time limit
def pytest_runtest_protocol(item, nextitem):
    watchdog = item.config.stash.get(_WATCHDOG, None)
    # no workers beside the main process: no turns to take
    with nullcontext() if _OWNER == "main" else _turn(alone=item.get_closest_marker("alone") is not None):
        if watchdog is not None:
            watchdog.running = (item.nodeid, time.monotonic())
        try:
            yield
        finally:
            if watchdog is not None:
                watchdog.running = None


@contextmanager
def _turn(alone: bool):
    with open(_SHARED / "gate", "a") as gate, open(_SHARED / "room", "a") as room:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if alone:
            fcntl.flock(room, fcntl.LOCK_EX)  # holding the gate: no test enters while this one waits
            fcntl.flock(gate, fcntl.LOCK_UN)
        else:
            fcntl.flock(gate, fcntl.LOCK_UN)
            fcntl.flock(room, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)


# ---- a test stuck where its time limit cannot reach it -----------------------------------------------------------
# pytest-timeout (`timeout` in pyproject.toml) ends a test by raising in its main thread. A test stuck in native code
# (a C++ wait, a wait on a child) or in a finalizer, where the exception is swallowed, never sees it: the session then
# hangs until CI's 90 minutes run out, nothing lands, and the log stops at the last dot. A watchdog thread acts
# `_STUCK_GRACE` seconds past the limit: it prints the test's name and every thread's stack, ends the processes below
# this one (the ranks or tools the test waits on: ended, the wait returns and the test fails as it should), and if the
# test is still running `_STUCK_GRACE` seconds later, ends the session with that diagnosis rather than hang.
_STUCK_GRACE = float(os.environ.get("DISTRAIN_TEST_STUCK_GRACE", 60))


class _Watchdog:
    def __init__(self, limit: float, out_fd: int):
        self.limit, self.out_fd = limit, out_fd
        self.running: tuple[str, float] | None = None  # the test's node id, and when it started
        threading.Thread(target=self._watch, name="distrain-test-watchdog", daemon=True).start()

    def _say(self, text: str) -> None:
        os.write(self.out_fd, f"\n{text}\n".encode())

    def _watch(self) -> None:
        acted_on = None
        while True:
            time.sleep(min(5.0, _STUCK_GRACE / 4))
            running = self.running
            if running is None or running == acted_on:
                if running is not None and time.monotonic() - running[1] > self.limit + 2 * _STUCK_GRACE:
                    self._say(f"{running[0]} is still stuck: ending the test session (exit 1)")
                    os._exit(1)
                continue
            if time.monotonic() - running[1] > self.limit + _STUCK_GRACE:
                acted_on = running
                self._say(f"{running[0]} outlived its {self.limit:.0f} s limit; its threads' stacks:")
                faulthandler.dump_traceback(file=self.out_fd, all_threads=True)
                ended = _end_processes_below()
                self._say(f"ended the processes it started: {', '.join(ended) or 'none'}")


def _end_processes_below() -> list[str]:
    """Kills every process below this one but the fork server and multiprocessing's resource tracker (shared by all
    tests); returns their ids and the start of their command lines."""
    import psutil

    ended = []
    for process in psutil.Process().children(recursive=True):
        try:
            command = " ".join(process.cmdline())
            if "resource_tracker" not in command and "multiprocessing.forkserver" not in command:
                process.kill()
                ended.append(f"{process.pid} ({command[:80]})")
        except psutil.Error:  # ended meanwhile
            continue
    return ended


def pytest_configure(config):
    limit = float(config.getini("timeout") or 0) if config.pluginmanager.hasplugin("timeout") else 0.0
    if limit > 0:
        config.stash[_WATCHDOG] = _Watchdog(limit, os.dup(2))  # fd 2 as it is between tests: the terminal


_WATCHDOG = pytest.StashKey[_Watchdog]()


def _end_leftover_ranks(session):
    """A test that failed or timed out can leave ranks behind (waiting on a peer that is gone); they
    would keep the session from ending (multiprocessing joins its children at exit). End them, and
    say so: a leftover is a bug to look at, not to wait for."""
    leftovers = _end_processes_below()
    if leftovers:
        session.config.get_terminal_writer().line(
            f"killed {len(leftovers)} process(es) left by the tests: {', '.join(leftovers)}"
        )


@pytest.fixture(autouse=True)
def _no_process_group_left_behind(request):
    """A process group a test started in the test process ends with it: left behind, it makes every later test in
    that process a rank of a one-rank job (which tests run later depends on the order, and on the worker). The test
    that left one is named in the session's warnings, to end its group itself."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        warnings.warn(f"{request.node.nodeid} left a process group in the test process", stacklevel=1)
