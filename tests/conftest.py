import os
import sys

# the tests' shared helpers (tests/helpers.py) import as `helpers`, in spawned ranks too
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 cores: ranks must not fight over threads

_REPORTS: list[str] = []


def report(lines: list[str]) -> None:
    """Tables a test wants shown at the end of the session (the strategy × model matrix)."""
    _REPORTS.extend([*lines, ""])


def pytest_terminal_summary(terminalreporter):
    if _REPORTS:
        terminalreporter.section("distrain matrix")
        for line in _REPORTS:
            terminalreporter.write_line(line)
