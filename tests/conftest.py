import fcntl
import glob
import importlib.util
import multiprocessing
import os
import shutil
import sys
import tempfile
import warnings
from contextlib import contextmanager
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
    if _OWNER == "main":  # no workers beside this process
        yield
        return
    with _turn(alone=item.get_closest_marker("alone") is not None):
        yield


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


def _end_leftover_ranks(session):
    """A test that failed or timed out can leave ranks behind (waiting on a peer that is gone); they
    would keep the session from ending (multiprocessing joins its children at exit). End them, and
    say so: a leftover is a bug to look at, not to wait for."""
    import psutil

    leftovers = []
    for process in psutil.Process().children(recursive=True):
        try:
            command = " ".join(process.cmdline())
            if "resource_tracker" not in command and "multiprocessing.forkserver" not in command:
                process.kill()
                leftovers.append(process)
        except psutil.Error:  # ended meanwhile
            continue
    if leftovers:
        names = ", ".join(f"{p.pid}" for p in leftovers)
        session.config.get_terminal_writer().line(f"killed {len(leftovers)} process(es) left by the tests: {names}")


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
