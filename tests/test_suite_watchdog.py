"""The suite's own watchdog (tests/conftest.py): a test stuck where pytest-timeout's exception cannot reach it (native
code with the alarm never delivered to Python) is named with its stacks, the processes it waits on are ended so the
session goes on, and a test still stuck after that ends the session instead of hanging CI until its limit."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

STUCK_TESTS = """
import signal, subprocess, time
import torch.distributed  # as in the suite: imported before any test (conftest's teardown imports it)

def _alarm_blocked():  # as native code that never returns to Python: pytest-timeout's SIGALRM stays pending
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})

def test_waits_on_a_child():
    _alarm_blocked()
    try:
        subprocess.Popen(["sleep", "600"]).wait()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})  # the pending alarm fails the test

def test_after_it():
    pass

def test_stuck_with_nothing_to_end():
    _alarm_blocked()
    time.sleep(600)

def test_never_reached():
    pass
"""


def test_a_stuck_test_is_named_with_its_stacks_its_children_ended_and_a_hopeless_one_ends_the_session(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_stuck.py").write_text(STUCK_TESTS)
    env = {**os.environ, "DISTRAIN_TEST_STUCK_GRACE": "1"}
    env.pop("DISTRAIN_TEST_SHARED", None)  # the sub-session's own folders
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o", "timeout=1", "-o", "addopts="],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "test_stuck.py::test_waits_on_a_child outlived its 1 s limit; its threads' stacks:" in out, out
    assert "line 11 in test_waits_on_a_child" in out, out  # the main thread's stack, at the wait
    assert "(sleep 600)" in out.split("ended the processes it started:")[1].splitlines()[0], out
    assert "test_waits_on_a_child FAILED" in out and "test_after_it PASSED" in out, out  # the session went on
    assert "test_stuck.py::test_stuck_with_nothing_to_end is still stuck: ending the test session (exit 1)" in out
    assert "test_never_reached" not in out.split("ending the test session")[1], out
