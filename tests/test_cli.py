"""The CLI as a user sees it: a subprocess, and the files in the run directory."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def distrain(*args, cwd=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "distrain.cli", *args], capture_output=True, text=True, cwd=cwd or ROOT, timeout=timeout
    )


def test_bad_key_is_one_clear_line(tmp_path):
    cfg = tmp_path / "x.yaml"
    cfg.write_text("training:\n  lerning_rate: 0.1\n")
    proc = distrain("train", "--config", str(cfg), "--output-dir", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "training.lerning_rate" in proc.stderr and str(cfg) in proc.stderr and "learning_rate" in proc.stderr
    assert not (tmp_path / "out").exists()  # failed before any process started


def test_wrong_type_names_key_and_file(tmp_path):
    cfg = tmp_path / "x.json"
    cfg.write_text(json.dumps({"training": {"batch_size_per_gpu": "eight"}}))
    proc = distrain("train", "--config", str(cfg))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "training.batch_size_per_gpu" in proc.stderr and str(cfg) in proc.stderr and "int" in proc.stderr


def test_wrong_type_on_the_command_line(tmp_path):
    proc = distrain("train", "training.max_grad_norm=[1]")
    assert proc.returncode == 2 and "training.max_grad_norm" in proc.stderr and "command line" in proc.stderr


def test_missing_config_file(tmp_path):
    proc = distrain("train", "--config", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "nope.yaml" in proc.stderr and "not found" in proc.stderr


def test_spec_layout_mode_alias_and_print_config(tmp_path):
    proc = distrain(
        "train",
        "--config",
        os.path.join(ROOT, "configs", "ddp.yaml"),
        "--mode",
        "ddp_spawn",
        "--output_dir",
        str(tmp_path),
        "training.learning_rate=3e-4",
        "--print-config",
    )
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["distributed"]["strategy"] == "ddp_spawn"
    assert cfg["training"]["learning_rate"] == 3e-4 and cfg["output_dir"] == str(tmp_path)


@pytest.mark.slow
def test_train_writes_run_dir_and_resumes(tmp_path):
    out = tmp_path / "run"
    common = [
        "--output-dir",
        str(out),
        "--devices",
        "2",
        "training.model_name=gpt-tiny",
        "data.seq_len=32",
        "training.batch_size_per_gpu=4",
        "logging.log_every_n_steps=2",
        "checkpointing.save_every_n_steps=3",
        "training.val_check_interval=4",
        "training.limit_val_batches=2",
        "data.max_bytes=200000",
        "logging.progress_bar=false",
    ]
    proc = distrain("train", "--max-steps", "6", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert yaml.safe_load((out / "config.yaml").read_text())["training"]["max_steps"] == 6
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6]
    for r in train:
        assert r["tokens_per_sec"] > 0 and r["samples_per_sec"] > 0 and r["lr"] > 0 and "mem_peak_rss_mb" in r
    assert any("val_loss" in r for r in records)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    ckpts = out / "checkpoints"
    assert (ckpts / "last").resolve().name == "epoch=0-step=6"
    state = torch.load(ckpts / "last" / "state.pt", weights_only=True)
    assert state["progress"]["global_step"] == 6 and len(state["rng"]) == 2
    assert state["config"]["training"]["max_steps"] == 6

    proc = distrain("train", "--max-steps", "8", "--resume", "last", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2, 4, 6, 8]  # continued, not restarted


def test_resume_last_without_checkpoint_is_an_error(tmp_path):
    proc = distrain("train", "--output-dir", str(tmp_path), "--resume", "last")
    assert proc.returncode == 2 and "no checkpoint" in proc.stderr


@pytest.mark.slow
def test_two_nodes_through_our_own_launcher(tmp_path):
    """NODE_RANK + MASTER_ADDR/PORT on each "node" (here: two processes on loopback): one group of 2."""
    from distrain.cluster import find_free_port

    port = str(find_free_port())
    procs = []
    for node in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node))
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "distrain.cli",
                    "train",
                    "--num-nodes",
                    "2",
                    "--devices",
                    "1",
                    "--strategy",
                    "ddp",
                    "--max-steps",
                    "4",
                    "--output-dir",
                    str(tmp_path / f"node{node}"),
                    "data.max_bytes=100000",
                    "logging.progress_bar=false",
                    "logging.log_every_n_steps=2",
                ],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[1][1][-2000:]
    assert "2 process(es)" in outs[0][0] and "done at step 4" in outs[0][0]
    assert (tmp_path / "node0" / "checkpoints" / "last").exists()
    # node 1 holds rank 1 only: rank 0 writes the run dir; rank 1 writes its own log
    assert [str(p.relative_to(tmp_path / "node1")) for p in (tmp_path / "node1").rglob("*") if p.is_file()] == [
        "logs/rank_1.log"
    ]


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_cleanly(tmp_path):
    """The signal reaches rank 0 only; both ranks stop at the same step, `last` is written, exit 0."""
    import signal
    import time

    out = tmp_path / "run"
    args = [
        "train",
        "--devices",
        "2",
        "--output-dir",
        str(out),
        "--max-steps",
        "100000",
        "data.seq_len=32",
        "data.max_bytes=200000",
        "logging.progress_bar=false",
        "logging.log_every_n_steps=1",
        "training.val_check_interval=100000",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "distrain.cli", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert "stopped by signal" in stdout and (out / "PREEMPTED").exists()
    state = torch.load(out / "checkpoints" / "last" / "state.pt", weights_only=True)
    stopped_at = state["progress"]["global_step"]
    assert 3 <= stopped_at < 100000
    resumed = distrain("train", *args[1:-2], "--resume", "last", "--max-steps", str(stopped_at + 2))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"done at step {stopped_at + 2}" in resumed.stdout and not (out / "PREEMPTED").exists()


BOOM = """
import sys
sys.path.insert(0, {tests!r})
from matrix_models import MLP


class Boom(MLP):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == 1 and self.trainer.global_step == 1:
            raise ValueError("boom on rank 1")
        return super().training_step(batch, batch_idx)
"""


@pytest.mark.slow
def test_an_error_in_one_rank_reaches_the_console_in_three_lines(tmp_path):
    """Which rank failed first, its exception and message, where its whole output is; every rank's
    output is in logs/rank_N.log."""
    (tmp_path / "boom.py").write_text(BOOM.format(tests=os.path.dirname(__file__)))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "distrain.cli",
            "train",
            "--strategy",
            "ddp",
            "--devices",
            "2",
            "--max-steps",
            "4",
            "--output-dir",
            "run",
            "training.module=boom.py:Boom",
            "logging.progress_bar=false",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("[distrain]")]
    assert ours[0] == "[distrain] rank 1 failed first at step 2 (in forward/backward): ValueError: boom on rank 1", (
        proc.stderr
    )
    assert ours[1] == "[distrain]   its whole output and traceback: run/logs/rank_1.log"
    assert "exited with code -15" not in proc.stderr and "Traceback" not in proc.stderr
    log = (tmp_path / "run" / "logs" / "rank_1.log").read_text()
    assert "Traceback" in log and "ValueError: boom on rank 1" in log
    assert "on 2 process(es)" in (tmp_path / "run" / "logs" / "rank_0.log").read_text()  # rank 0's output too
