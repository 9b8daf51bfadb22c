"""Fault tolerance beyond restart: an elastic world size that keeps the global batch; asynchronous checkpoints;
per-step recovery of a replica group with torchft."""

from __future__ import annotations

import io
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import psutil
import pytest
import torch

import distrain
from helpers import TinyGPT, env_without_rank, loader, make_trainer, run_ranks

pytestmark = pytest.mark.alone  # torchft's heartbeats and timeouts, and three to four ranks per run (tests/conftest.py)

GLOBAL_BATCH = 12  # splits over 4, 3 and 2 ranks


class StopAt(distrain.Callback):
    """SIGTERM to rank 0 after ``step``: every rank stops together and checkpoints (the preemption path)."""

    def __init__(self, step: int | None):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def _phase(rank, root, world, stop_at, max_steps, resume):
    trainer, rec = make_trainer(
        root,
        strategy="ddp",
        devices=world,
        max_steps=max_steps,
        gradient_clip_val=1.0,
        logger=False,
        callbacks=[StopAt(stop_at)],
    )
    distrain.seed_everything(0)  # as a script does before building its model
    module = TinyGPT(schedule=False)
    trainer.fit(module, loader(GLOBAL_BATCH // 4, n=240), ckpt_path="last" if resume else None)
    first = trainer.global_step - len(rec.losses) + 1
    return {first + i: loss for i, loss in enumerate(rec.losses)}, distrain.checkpoint_state_of(module)


@pytest.mark.slow
def test_resumed_on_4_3_2_4_ranks_the_global_batch_and_the_losses_stay(tmp_path):
    """The loader's micro-batch is 3 (global batch 12 on 4 ranks). Stopped by SIGTERM and resumed on 3 ranks
    (micro-batch 2 × accumulation 2), then 2 (3 × 2), then 4 again: the losses are those of a run that never
    stopped, within fp32 rounding (the reductions run over other numbers of ranks)."""
    reference, final = run_ranks(_phase, 4, tmp_path / "ref", 4, None, 8, False)[0]
    losses = {}
    for world, stop_at, resume in ((4, 2, False), (3, 4, True), (2, 6, True), (4, None, True)):
        done, weights = run_ranks(_phase, world, tmp_path / "run", world, stop_at, 8, resume)[0]
        losses.update(done)
    assert sorted(losses) == list(range(1, 9)), losses
    for step, loss in reference.items():
        assert abs(losses[step] - loss) <= 1e-5 * abs(loss), (step, losses[step], loss)
    for k, v in final.items():
        assert (weights[k] - v).norm() <= 1e-4 * v.norm(), k


# ---- per-step fault tolerance: replica groups with torchft (strategy ddp_torchft) ------------------------------
FT_STEPS = 250
#: a step of 4 samples of 32 tokens: the default's 8 of 128 took 0.2 s on these 2 cores (4 processes training), and
#: the run that kills a group needs its steps to outlast a restart, not a model's compute (250 small steps: 30 s of
#: the three runs side by side, where 100 of the default took 48)
SMALL_STEPS = ["data.seq_len=32", "training.batch_size_per_gpu=4", "data.max_bytes=200000"]


def _train(
    out: Path, strategy: str = "ddp_torchft", devices: int = 1, *overrides: str, small_steps: bool = True
) -> subprocess.Popen:
    """``distrain train`` on the built-in GPT, as a user starts it (the launcher starts a lighthouse and the groups).
    ``small_steps=False``: the default batch, for a test whose window (a signal landing mid-run, a restart coming
    back before the others end) is counted in steps that must take time."""
    command = ["distrain", "train", "--strategy", strategy, "--devices", str(devices), f"output_dir={out}"]
    command += [f"training.max_steps={FT_STEPS}", "training.gradient_accumulation_steps=2"]
    command += ["logging.progress_bar=false", "logging.log_every_n_steps=1", "checkpointing.save_every_n_steps=null"]
    command += [*(SMALL_STEPS if small_steps else []), "logging.plot_summary=false", "logging.use_tensorboard=false"]
    return subprocess.Popen(
        [*command, *overrides], env=env_without_rank(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    output, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, output[-4000:]
    return output


def _steps(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps: dict[int, dict] = {}
    for row in rows:
        if "loss" in row:
            assert row["step"] not in steps, f"step {row['step']} logged twice in {run_dir}"
            steps[row["step"]] = row
    return steps


def _final_val_loss(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "val_loss" in r][-1]["val_loss"]


def _last_state(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last" / "state.pt", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Two replica groups of one rank that never fail, and DDP on two ranks: the same global batch."""
    root = tmp_path_factory.mktemp("ft")
    runs = [_train(root / "ft"), _train(root / "ddp", "ddp", 2)]  # side by side: each waits on its peers mostly
    for run in runs:
        _finish(run)
    return root


@pytest.mark.slow
def test_replica_groups_without_failures_train_exactly_as_ddp(uninterrupted):
    """Every step's loss (the mean of the two groups' own) is DDP's within fp32 rounding, and both groups end
    with bit-identical weights and optimizer states, DDP's within rounding: the cross-group average is the gradient
    all-reduce, and step 0 waits for both groups (no step taken at half the batch)."""
    groups = [_steps(uninterrupted / "ft" / f"replica_{g}") for g in (0, 1)]
    ddp = _steps(uninterrupted / "ddp")
    assert sorted(groups[0]) == sorted(groups[1]) == sorted(ddp) == list(range(1, FT_STEPS + 1))
    for step, row in ddp.items():
        mean = (groups[0][step]["loss"] + groups[1][step]["loss"]) / 2
        assert abs(mean - row["loss"]) <= 1e-5 * abs(row["loss"]), (step, mean, row["loss"])
    a, b = (_last_state(uninterrupted / "ft" / f"replica_{g}") for g in (0, 1))
    reference = _last_state(uninterrupted / "ddp")
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
        assert (value - reference["model"][name]).norm() <= 1e-4 * reference["model"][name].norm(), name
    assert _flat(a["optimizers"]) == _flat(b["optimizers"])
    # each group validates its share of the set, as DDP's ranks do: the mean of the groups' is DDP's
    val = sum(_final_val_loss(uninterrupted / "ft" / f"replica_{g}") for g in (0, 1)) / 2
    ddp_val = _final_val_loss(uninterrupted / "ddp")
    assert abs(val - ddp_val) <= 1e-4 * abs(ddp_val), (val, ddp_val)


def _flat(state) -> list:
    """A nested state as a list of leaves (tensors as bytes), to compare bit for bit."""
    if isinstance(state, dict):
        return [(k, _flat(v)) for k, v in sorted(state.items(), key=lambda kv: str(kv[0]))]
    if isinstance(state, (list, tuple)):
        return [_flat(v) for v in state]
    return state.numpy().tobytes() if isinstance(state, torch.Tensor) else state


def _worker_of_group(launcher: subprocess.Popen, group: str, local_rank: str | None = None) -> psutil.Process | None:
    for proc in psutil.Process(launcher.pid).children(recursive=True):
        try:
            env, command = proc.environ(), " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if env.get("REPLICA_GROUP_ID") == group and "LOCAL_RANK" in env and "distributed.agent" not in command:
            if local_rank is None or env["LOCAL_RANK"] == local_rank:
                return proc
    return None


def _signal_group_one(launcher: subprocess.Popen, out: Path, step: int, sig: int, local_rank: str | None = None):
    """Once replica group 1 has logged ``step``: ``sig`` to its rank (its ``local_rank``), and to no other process."""
    _wait_for_step(out / "replica_1", step)
    worker = _worker_of_group(launcher, "1", local_rank)
    assert worker is not None, f"no rank {local_rank or ''} of replica group 1 found"
    worker.send_signal(sig)


@pytest.mark.slow
def test_a_replica_group_killed_mid_run_rejoins_with_the_live_state(uninterrupted, tmp_path):
    """kill -9 of group 1's rank at a random step. Group 0 never stops: each of its steps is logged once, those
    before the kill are the uninterrupted run's to the bit, at most the step in flight is dropped, and it trains on
    alone once the lighthouse misses group 1's heartbeats (2 s; a restart usually takes longer: Python and torch
    load; on a fast machine it can be back first, and the next quorum holds both groups). torchrun restarts group 1,
    which takes group 0's live state over HTTP (no checkpoint: none is written before the end) and trains on in
    lockstep: both groups end with bit-identical weights and optimizer states. The final validation loss is the
    uninterrupted run's within 5%: one dropped step's batch and a few steps at half the batch (measured: under 1%)."""
    kill_at = random.Random().randint(3, 12)
    out = tmp_path / "run"
    launcher = _train(out)
    metrics = out / "replica_1" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if max((json.loads(line).get("step", 0) for line in lines), default=0) >= kill_at:
            break
        time.sleep(0.05)
    worker = _worker_of_group(launcher, "1")
    assert worker is not None, "no rank of replica group 1 found"
    worker.send_signal(signal.SIGKILL)
    output = _finish(launcher)

    took_over = re.findall(r"replica group 1 took over the live state of a running group at step (\d+)", output)
    assert len(took_over) >= 2 and int(took_over[-1]) >= kill_at, (kill_at, took_over, output[-3000:])
    pattern = r"replica group 0 at step (\d+): (\d) of 2 replica groups"
    quorums = [(int(step), int(groups)) for step, groups in re.findall(pattern, output)]
    alone = [step for step, groups in quorums if groups == 1]
    if alone:  # the lighthouse missed group 1's heartbeats before it was back: group 0 went on without it
        assert min(alone) > kill_at, (kill_at, quorums)
        assert quorums[-1] == (int(took_over[-1]) + 1, 2), quorums  # and took it back when it returned
    else:  # a restart within the heartbeat timeout (a fast machine): group 0's next quorum held both groups
        assert quorums == [(1, 2)], quorums
    survivor = _steps(out / "replica_0")
    assert sorted(survivor) == list(range(1, FT_STEPS + 1))
    reference = _steps(uninterrupted / "ft" / "replica_0")
    for step in range(1, kill_at):
        assert survivor[step]["loss"] == reference[step]["loss"], step
    a, b = _last_state(out / "replica_0"), _last_state(out / "replica_1")
    assert a["progress"]["global_step"] == b["progress"]["global_step"] == FT_STEPS
    assert a["progress"]["dropped_steps"] <= 1, a["progress"]
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    assert _flat(a["optimizers"]) == _flat(b["optimizers"])
    val = sum(_final_val_loss(out / f"replica_{g}") for g in (0, 1)) / 2
    val_reference = sum(_final_val_loss(uninterrupted / "ft" / f"replica_{g}") for g in (0, 1)) / 2
    assert abs(val - val_reference) <= 0.05 * val_reference, (val, val_reference)


@pytest.mark.slow
def test_a_restarted_group_of_two_ranks_rejoins(tmp_path):
    """Groups of 2 ranks: kill -9 of group 1's second rank. torchrun restarts both of the group's ranks, and the
    second one must find the group's new manager server, not the killed one's (torchrun's store keeps the old
    address across the restart: it waited on it until ft_timeout, then failed every restart alike). The group takes
    the live state back and both groups end in lockstep."""
    steps, kill_at = 60, 4  # small steps: 60 leave the kill room to land mid-run
    out = tmp_path / "run"
    launcher = _train(out, "ddp_torchft", 2, f"training.max_steps={steps}", "distributed.max_restarts=1")
    try:
        _signal_group_one(launcher, out, kill_at, signal.SIGKILL, local_rank="1")
        output = _finish(launcher, timeout=300)
    finally:
        launcher.kill()
    took_over = re.findall(r"replica group 1 took over the live state of a running group at step (\d+)", output)
    # on a loaded machine group 0 may finish before the restart is back: then the group takes its final state
    ended = "replica group 1 restarted after the other groups had finished" in output
    assert ended or (took_over and int(took_over[-1]) >= kill_at), (took_over, output[-3000:])
    a, b = _last_state(out / "replica_0"), _last_state(out / "replica_1")
    assert a["progress"]["global_step"] == b["progress"]["global_step"] == steps
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name


@pytest.mark.slow
def test_a_group_killed_twice_ends_with_the_jobs_final_state_never_alone(tmp_path):
    """kill -9 of group 1 mid-run (it rejoins with the live state), then again at the last steps: its second restart
    comes when group 0 has finished. It must not train alone from its own state (it did, 60 solo steps behind exit
    0): it takes group 0's final checkpoint and ends there, so both groups end with the same weights."""
    steps = 100  # long enough that the first restart lands mid-run (a restart takes seconds: Python, torch)
    out = tmp_path / "run"
    launcher = _train(
        out, "ddp_torchft", 1, f"training.max_steps={steps}", "distributed.max_restarts=2", small_steps=False
    )
    try:
        for kill_at in (6, steps - 1):
            _signal_group_one(launcher, out, kill_at, signal.SIGKILL)
            if kill_at == 6:  # the restarted group is back in the job before the second kill
                _wait_for_step(out / "replica_1", kill_at + 2)
        output = _finish(launcher, timeout=300)
    finally:
        launcher.kill()
    ended = re.findall(
        r"replica group 1 restarted after the other groups had finished: it takes the final state at step (\d+)", output
    )
    rejoined = re.findall(r"replica group 1 took over the live state of a running group at step (\d+)", output)
    assert rejoined and (ended or int(rejoined[-1]) >= steps - 1), output[-4000:]
    a, b = _last_state(out / "replica_0"), _last_state(out / "replica_1")
    assert a["progress"]["global_step"] == b["progress"]["global_step"] == steps
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    assert _flat(a["optimizers"]) == _flat(b["optimizers"])


@pytest.mark.slow
def test_a_group_whose_restarts_ran_out_fails_the_job_naming_it(tmp_path):
    """max_restarts=0: group 1 killed once is not restarted; group 0 finishes, and the job exits non-zero naming
    group 1 (an exit 0 would hide that one group's work was lost)."""
    out = tmp_path / "run"
    launcher = _train(out, "ddp_torchft", 1, "training.max_steps=20", "distributed.max_restarts=0", small_steps=False)
    try:
        _signal_group_one(launcher, out, 4, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode != 0, output[-3000:]
    assert "replica groups that failed (after their restarts): group 1: exit code" in output, output[-3000:]
    assert _last_state(out / "replica_0")["progress"]["global_step"] == 20


def _wait_for_step(run_dir: Path, step: int, timeout: float = 180) -> None:
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if max((json.loads(line).get("step", 0) for line in lines), default=0) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"{run_dir} did not reach step {step}")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_stops_every_group_at_a_step_and_resume_goes_on(tmp_path, sig):
    """SIGTERM (a preemption) or SIGINT (Ctrl-C) to ``distrain train``: every rank of every group stops at the same
    step with a checkpoint and the job exits 0 (torchrun is not signalled: it would end its ranks and exit 1, and a
    SIGINT would crash them into a restart); ``--resume auto`` then trains both groups to the end."""
    out, steps = tmp_path / "run", 30  # the stop comes at step 3 or a little later: 30 leave room to resume
    launcher = _train(out, "ddp_torchft", 1, f"training.max_steps={steps}", small_steps=False)
    _wait_for_step(out / "replica_0", 3)
    launcher.send_signal(sig)
    output = _finish(launcher, timeout=120)
    stopped = re.findall(r"stopped by signal 15 at step (\d+)", output)
    assert len(stopped) == 2 and stopped[0] == stopped[1] and int(stopped[0]) < steps, output[-3000:]
    a, b = _last_state(out / "replica_0"), _last_state(out / "replica_1")
    assert a["progress"]["global_step"] == b["progress"]["global_step"] == int(stopped[0])
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    resumed = _finish(
        _train(out, "ddp_torchft", 1, f"training.max_steps={steps}", "--resume", "auto", small_steps=False)
    )
    assert resumed.count(f"done at step {steps}") == 2, resumed[-3000:]


@pytest.mark.slow
def test_a_signal_that_reaches_one_group_only_stops_every_group_at_the_same_step(tmp_path):
    """SIGUSR1 (SLURM's warning before the time limit) to group 1's rank alone, mid-run: a group's process group holds
    its own ranks only, so the groups agree through the gradients' all-reduce across groups. Both groups stop at
    the same step, name the signal, write bit-identical final states, and the job exits 0; before, group 1 stopped at
    once and group 0 trained on without it."""
    out, steps = tmp_path / "run", 40
    launcher = _train(out, "ddp_torchft", 1, f"training.max_steps={steps}", small_steps=False)
    try:
        _signal_group_one(launcher, out, 3, signal.SIGUSR1)
        output = _finish(launcher, timeout=120)
    finally:
        launcher.kill()
    stopped = re.findall(rf"stopped by signal {int(signal.SIGUSR1)} at step (\d+)", output)
    assert len(stopped) == 2 and stopped[0] == stopped[1] and int(stopped[0]) < steps, output[-3000:]
    a, b = _last_state(out / "replica_0"), _last_state(out / "replica_1")
    assert a["progress"]["global_step"] == b["progress"]["global_step"] == int(stopped[0])
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name


def test_an_unreachable_lighthouse_is_one_line_naming_its_address_before_any_group_starts(tmp_path):
    """Said by the launching process at once (a port where nothing listens is not waited on), and no group starts."""
    unreachable = "distributed.lighthouse=http://127.0.0.1:9"  # the discard port: nothing listens
    proc = _train(tmp_path / "run", "ddp_torchft", 1, unreachable, "distributed.max_restarts=0")
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode != 0
    lines = [line for line in output.splitlines() if "no torchft lighthouse answers at http://127.0.0.1:9" in line]
    assert len(lines) == 1 and "Connection refused" in lines[0], output[-3000:]
    assert "replica groups of" not in output and not (tmp_path / "run" / "replica_0").exists(), output[-3000:]


@pytest.mark.parametrize(
    "override, key",
    [
        ("distributed.min_replicas=3", "distributed.min_replicas"),
        ("distributed.replica_groups=0", "distributed.replica_groups"),
        ("distributed.lighthouse=lighthouse:29510", "distributed.lighthouse"),
        ("distributed.max_restarts=-1", "distributed.max_restarts"),
    ],
)
def test_bad_replica_group_settings_name_the_key(tmp_path, override, key):
    result = subprocess.run(
        ["distrain", "train", "--strategy", "ddp_torchft", f"output_dir={tmp_path}", override],
        env=env_without_rank(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert key in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "replica_0").exists()


class _Runs:
    """What a crafted peer state would run when unpickled: it makes a directory."""

    def __init__(self, how: str, marker: Path):
        self.how, self.marker = how, str(marker)

    def __reduce__(self):
        if self.how == "mkdir":
            return os.mkdir, (self.marker,)
        if self.how == "exec":
            return exec, (f"import os; os.mkdir({self.marker!r})",)
        return subprocess.call, (["mkdir", self.marker],)


def _serve(payload: bytes) -> tuple[HTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}/checkpoint/"


@pytest.mark.parametrize("how", ["mkdir", "exec", "subprocess"])
def test_a_peer_state_that_names_code_is_refused_and_never_runs(tmp_path, how):
    """What answers on the address a quorum names is a peer we did not choose. torchft's own transport would run the
    code in its answer (checked here, so the test can fail); distrain's reads it weights-only and refuses it in one
    line naming the address. A real state crosses intact."""
    from torch.distributed._serialization import _streaming_save
    from torchft.checkpointing import HTTPTransport

    from distrain.checkpoint.peer_state import peer_state_transport
    from distrain.checkpoint.safe_load import UnsafeCheckpointError

    buffer = io.BytesIO()
    _streaming_save({"model": {"w": torch.ones(2)}, "progress": _Runs(how, tmp_path / "ran")}, buffer)
    server, address = _serve(buffer.getvalue())
    timeout = timedelta(seconds=10)
    transport = peer_state_transport(timeout)
    try:
        with pytest.raises(UnsafeCheckpointError) as refused:
            transport.recv_checkpoint(src_rank=0, metadata=address, step=3, timeout=timeout)
        assert "\n" not in str(refused.value) and f"{address}3/full" in str(refused.value), str(refused.value)
        assert not (tmp_path / "ran").exists()
        HTTPTransport._load_from_address(f"{address}3/full", timeout)  # torchft's own reader runs it
        assert (tmp_path / "ran").exists()

        sender = peer_state_transport(timeout)
        state = {"model": {"w": torch.arange(6.0)}, "progress": {"global_step": 3, "epoch": 0}}
        sender.send_checkpoint(dst_ranks=[1], step=3, state_dict=state, timeout=timeout)
        received = transport.recv_checkpoint(src_rank=0, metadata=sender.metadata(), step=3, timeout=timeout)
        assert torch.equal(received["model"]["w"], state["model"]["w"]) and received["progress"] == state["progress"]
        sender.shutdown()
    finally:
        transport.shutdown()
        server.shutdown()
