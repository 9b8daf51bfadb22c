"""Hang diagnosis on real gloo ranks: a rank that stalls or leaves makes the others fail within
the collective timeout, with an error that names it and where it stopped."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

import distrain
from distrain.distributed.watch import StackDumps, _describe, _ranks
from helpers import TinyGPT, console_of_a_faulty_rank, env_without_rank, loader, make_trainer, run_ranks

pytestmark = pytest.mark.alone  # collective timeouts of seconds: a busy neighbour would be a stall (tests/conftest.py)

TIMEOUT = 3.0  # distributed.collective_timeout_seconds for these runs
MARGIN = 6.0  # diagnosis and unwinding on a busy 2-core machine


class Stall(distrain.Callback):
    """Rank ``rank`` stops at optimizer step ``step``: "sleep" hangs inside the optimizer step,
    "exit" leaves the job right after the step (a rank that ran out of data, or crashed)."""

    def __init__(self, rank: int, step: int, how: str, marker: str):
        self.rank, self.step, self.how, self.marker = rank, step, how, marker

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if self.how == "sleep" and trainer.global_rank == self.rank and trainer.global_step + 1 == self.step:
            Path(self.marker).write_text(str(time.time()))
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # hung for good: only the launcher's SIGTERM ends it
            time.sleep(120)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.how == "exit" and trainer.global_rank == self.rank and trainer.global_step == self.step:
            Path(self.marker).write_text(str(time.time()))
            os._exit(0)


def _train_with_a_stalled_rank(rank, out, how):
    trainer, _ = make_trainer(
        out,
        strategy="ddp",
        devices=3,
        max_steps=8,
        collective_timeout=TIMEOUT,
        enable_checkpointing=False,
        logger=False,
        callbacks=[Stall(1, 3, how, os.path.join(out, "stalled"))],
    )
    try:
        trainer.fit(TinyGPT(), loader(4))
    finally:
        Path(out, f"failed-{rank}").write_text(str(time.time()))
        # The first rank to raise makes the launcher SIGTERM the others: wait (bounded) until the
        # other healthy rank has recorded when it failed too, so the test sees both
        deadline = time.time() + 30
        while time.time() < deadline and not all(Path(out, f"failed-{r}").exists() for r in (0, 2)):
            time.sleep(0.05)


def _fail_with(tmp_path, how) -> tuple[str, dict[int, float]]:
    with pytest.raises(mp.ProcessRaisedException) as info:
        run_ranks(_train_with_a_stalled_rank, 3, str(tmp_path), how)
    stalled_at = float((tmp_path / "stalled").read_text())
    after = {int(f.name.split("-")[1]): float(f.read_text()) - stalled_at for f in tmp_path.glob("failed-*")}
    return str(info.value), after


@pytest.mark.slow
def test_a_hung_rank_is_named_within_the_collective_timeout(tmp_path):
    message, after = _fail_with(tmp_path, "sleep")
    assert "CollectiveHangError" in message, message
    assert "rank 1 stopped at step 3 (in optimizer step)" in message, message
    # ranks 0 and 2 finished step 3's optimizer step and waited in its loss all-reduce (the one that
    # timed out first closes its connections: the other may see a closed peer instead)
    assert re.search(r"ranks 0,2 (waited|were) at step 3 \(in logging\)", message), message
    if "ranks 0,2 waited" in message:
        assert "for 3 s, the collective timeout (distributed.collective_timeout_seconds" in message, message
    assert set(after) >= {0, 2} and 1 not in after  # the hung rank never got out of its sleep
    for rank in (0, 2):  # the collective timeout, not process-group init's 30 minutes
        assert TIMEOUT - 1.0 <= after[rank] < TIMEOUT + MARGIN, after


@pytest.mark.slow
def test_a_rank_that_leaves_is_named_at_once(tmp_path):
    message, after = _fail_with(tmp_path, "exit")
    assert "rank 1 stopped at step 3 (in callbacks after the step (checkpointing))" in message, message
    assert "ranks 0,2 were at step 4 (in forward/backward) when a peer's connection closed" in message, message
    for rank in (0, 2):  # no timeout to wait for: the peer's socket closed
        assert after[rank] < MARGIN, after


HUNG_SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
import distrain
from helpers import TinyGPT, loader

class Hang(distrain.Callback):  # hung in Python: SIGTERM only sets distrain's stop flag
    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_rank == 1 and trainer.global_step + 1 == 3:
            time.sleep(600)

trainer = distrain.Trainer(accelerator="cpu", strategy="ddp", devices=3, max_steps=6, collective_timeout={timeout},
                           enable_progress_bar=False, logger=False, enable_checkpointing=False, callbacks=[Hang()])
trainer.fit(TinyGPT(), loader(4))
"""


@pytest.mark.slow
def test_under_distrains_own_launcher_the_job_ends_with_the_diagnosis(tmp_path):
    """strategy="ddp" re-runs the script per rank: rank 0 fails with the diagnosis and the launcher
    stops the hung rank too (SIGTERM, then SIGKILL), instead of waiting for it forever."""
    script = tmp_path / "train.py"
    script.write_text(HUNG_SCRIPT.format(tests=os.path.dirname(__file__), timeout=TIMEOUT))
    env = env_without_rank()
    start = time.time()
    # in its own folder: the script names no default_root_dir, so its run goes to ./runs/distrain
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    elapsed = time.time() - start
    assert proc.returncode != 0
    assert "rank 1 stopped at step 3 (in optimizer step)" in proc.stderr, proc.stderr[-3000:]
    assert elapsed < 90, elapsed  # start-up + the collective timeout + the launcher's 3 s grace; not 600 s


SHORT = 1.5  # the collective timeout of the next test; its slow parts take twice as long


class SlowSave(distrain.DDPStrategy):
    def save_checkpoint(self, path, state, background=False):
        if self.is_global_zero:
            time.sleep(2 * SHORT)  # a big checkpoint on slow storage; the other ranks wait in a barrier
        return super().save_checkpoint(path, state, background)


def _slow_start_and_slow_save(rank, out):
    if rank == 1:
        time.sleep(2 * SHORT)  # this node came up late: init waits for it
    trainer, _ = make_trainer(
        out,
        strategy=SlowSave(collective_timeout=SHORT),
        devices=2,
        max_steps=2,
        logger=False,
        callbacks=[distrain.ModelCheckpoint(every_n_train_steps=2)],
    )
    trainer.fit(TinyGPT(), loader(4))
    return trainer.global_step


@pytest.mark.slow
def test_late_start_and_slow_checkpoint_write_are_not_hangs(tmp_path):
    """Process-group init and checkpoint IO keep the generous timeout; only the rest is tight."""
    assert run_ranks(_slow_start_and_slow_save, 2, str(tmp_path)) == [2, 2]
    assert (tmp_path / "checkpoints" / "last").exists()


def test_the_message_sorts_ranks_into_behind_ahead_silent_busy_and_waiting():
    # ranks 3 (this one), 0 and 6 are in phase 9 of the run, 6 has not failed (yet); 1 is behind,
    # 2 went ahead, 4 and 5 never reported
    reports = {
        3: (9, 4, "failed", "logging"),
        0: (9, 4, "failed", "logging"),
        6: (9, 4, "running", "logging"),
        1: (7, 4, "running", "optimizer step"),
        2: (10, 4, "running", "stop-signal check"),
    }
    lines = _describe(9, reports, "waited at step 4 (in logging) for 3 s", 7)
    assert lines == [
        "rank 1 stopped at step 4 (in optimizer step) and never reached this collective;",
        "rank 2 went on to step 4 (in stop-signal check) without it: a different code path "
        "(a collective that only some ranks run?);",
        "ranks 4,5 never reported progress (not started, or died before training);",
        "rank 6 reached the same step and phase but not this collective: slow inside the phase "
        "(a long computation or IO before it)?",
        "ranks 0,3 waited at step 4 (in logging) for 3 s.",
    ]
    assert _ranks([0, 1, 2, 3, 5, 7, 8]) == "ranks 0-3,5,7,8" and _ranks([4]) == "rank 4"
    everyone_waited = _describe(9, {0: (9, 4, "failed", "logging"), 1: (9, 4, "failed", "logging")}, "waited", 2)
    assert "none is behind" in everyone_waited[-1]


FR_VARS = (
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_FR_DUMP_TEMP_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
)


def test_nccl_flight_recorder_dumps_into_the_run_dir(tmp_path, monkeypatch):
    """What an NCCL run sets before its process group exists (no GPU here: the settings only)."""
    from distrain.distributed.watch import enable_nccl_flight_recorder

    for name in FR_VARS:  # recorded, so the test leaves the environment as it found it
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    trainer, _ = make_trainer(tmp_path, accelerator="cpu", devices=1)
    trainer.runtime.setup_environment()
    dump_dir = trainer.strategy.flight_recorder_dir
    assert dump_dir == str(tmp_path / "flight_recorder")
    enable_nccl_flight_recorder(dump_dir)
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{dump_dir}/rank_"
    assert os.path.isdir(dump_dir)
    # the user's own choice (here: recorder off) wins
    for name in FR_VARS:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")
    enable_nccl_flight_recorder(dump_dir)
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0" and "TORCH_FR_BUFFER_SIZE" not in os.environ


@pytest.mark.slow
def test_the_console_names_a_stuck_rank_and_shows_where_it_is(tmp_path):
    """Rank 1 loops forever in the user's code at step 3: the console's first line names rank 1, never rank 0 (which
    only waited), and shows rank 1's own stack down to the user's function."""
    console, elapsed = console_of_a_faulty_rank(tmp_path, "stuck_in_user_code()", TIMEOUT)
    first = console.splitlines()[0]
    assert first.startswith("[distrain] rank 1 at step 3 (in forward/backward)") and "rank 0 failed" not in console
    assert "rank 1 is here" in console and "in stuck_in_user_code" in console, console
    assert "train.py" in console and "in training_step" in console, console
    assert elapsed < 90, elapsed


STACK_CHILD = """
import sys, time
from distrain.distributed.watch import StackDumps

def waiting_in_the_users_code():
    dumps = StackDumps()
    print(dumps.address, flush=True)
    if sys.argv[1] == "close":
        dumps.close()
        print("closed", flush=True)
    time.sleep(120)

waiting_in_the_users_code()
"""


@pytest.mark.parametrize("ending", ["close", "SIGKILL"])
def test_a_ranks_stack_file_is_readable_while_it_lives_and_gone_however_it_ends(tmp_path, ending):
    """Another process reads a live rank's stack through its file; the file is gone after ``close`` and after a
    SIGKILL too (a rank killed or crashed must not leave one behind per run)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    child = subprocess.Popen([sys.executable, "-c", STACK_CHILD, ending], stdout=subprocess.PIPE, text=True, env=env)
    try:
        address = child.stdout.readline().strip()
        if ending == "close":
            assert child.stdout.readline().strip() == "closed"
            assert list(tmp.iterdir()) == []
            return
        time.sleep(0.5)  # in its sleep
        shown = StackDumps.request(1, address)
        assert shown[0].startswith("rank 1 is here") and any("waiting_in_the_users_code" in f for f in shown), shown
        child.kill()
        child.wait(timeout=30)
        assert list(tmp.iterdir()) == []
    finally:
        child.kill()
        child.wait(timeout=30)
