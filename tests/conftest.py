import multiprocessing
import os
import sys

# the tests' shared helpers (tests/helpers.py) import as `helpers`, in spawned ranks too; the planner's
# measuring harness, shared with benchmarks/plan_accuracy.py, as `plan_measure`
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 cores: ranks must not fight over threads

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
