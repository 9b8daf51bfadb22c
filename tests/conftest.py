import multiprocessing
import os
import shutil
import sys
import tempfile

# the tests' shared helpers (tests/helpers.py) import as `helpers`, in spawned ranks too; the planner's
# measuring harness, shared with benchmarks/plan_accuracy.py, as `plan_measure`
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 cores: ranks must not fight over threads
# plans kept between starts (distrain/planner/cache.py): the session's own, not the user's, and none left after
# (a rank that imports this file inherits the session's folder: make one only where none is set)
if "DISTRAIN_PLAN_CACHE" not in os.environ:
    os.environ["DISTRAIN_PLAN_CACHE"] = tempfile.mkdtemp(prefix="distrain-plans-")

# tests/helpers.run_ranks forks its ranks from a server that has imported these once (see START_METHOD)
multiprocessing.set_forkserver_preload(["helpers", "distrain.trainer"])

_REPORTS: list[str] = []


def report(lines: list[str]) -> None:
    """Tables a test wants shown at the end of the session (the strategy × model matrix)."""
    _REPORTS.extend([*lines, ""])


def pytest_terminal_summary(terminalreporter):
    if _REPORTS:
        terminalreporter.section("distrain matrix")
        for line in _REPORTS:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    if "distrain-plans-" in os.environ.get("DISTRAIN_PLAN_CACHE", ""):
        shutil.rmtree(os.environ["DISTRAIN_PLAN_CACHE"], ignore_errors=True)
    _end_leftover_ranks(session)


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
