"""Recovery time: from a ``kill -9`` of one rank to training again, and where the seconds go.

    python benchmarks/recovery.py [--kill-at 12] [--steps 40]

Two ways a job survives a lost rank, each on the built-in GPT, as a user starts it:

- **restart from the last checkpoint**: ``distrain launch torchrun ... --max-restarts 1 --run -- --resume auto``
  on 2 ranks, a checkpoint every 5 steps. torchrun sees the dead rank, stops the other one, starts both again; they
  read the newest checkpoint and train on from there (the steps since it are trained again);
- **torchft replica groups**: ``distrain train --strategy ddp_torchft`` with 2 groups of 1 rank. The other group
  never stops; torchrun restarts the dead group, which takes the live state of the running one over HTTP.

A rank that trains again prints ``distrain: training again at step N, T s after the process started: <parts>``
(``distrain/training/startup.py``). The table shows, for each way: the kill → training-again time, measured here
(the time of the kill to the moment that line appears), split into "detection and restart" (from the kill to the new
process's start: the launcher noticing, stopping the others, starting again) and the new process's own parts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil

AGAIN = re.compile(r"distrain: training again at step (\d+), ([\d.]+) s after the process started: (.*)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _common(out: Path, steps: int) -> list[str]:
    return [
        f"output_dir={out}",
        f"training.max_steps={steps}",
        "logging.progress_bar=false",
        "logging.log_every_n_steps=1",
        "logging.plot_summary=false",
        "training.val_check_interval=0",
    ]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


class Run:
    """A job whose output lines are read as they come, each with the time it arrived."""

    def __init__(self, command: list[str]):
        self.proc = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip()))

    def wait_for(self, pattern: re.Pattern, after: float, timeout: float = 300) -> tuple[float, re.Match]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, line in list(self.lines):
                found = pattern.search(line)
                if found and at >= after:
                    return at, found
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        tail = "\n".join(line for _, line in self.lines[-30:])
        raise RuntimeError(f"no line matching {pattern.pattern!r} after the kill:\n{tail}")

    def finish(self, timeout: float = 600) -> None:
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        if self.proc.returncode != 0:
            tail = "\n".join(line for _, line in self.lines[-30:])
            raise RuntimeError(f"the job failed ({self.proc.returncode}):\n{tail}")


def _wait_for_step(run: Run, metrics: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.proc.poll() is None:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if max((json.loads(line).get("step", 0) for line in lines if line.strip()), default=0) >= step:
            return
        time.sleep(0.05)
    tail = "\n".join(line for _, line in run.lines[-30:])
    raise RuntimeError(f"{metrics} never reached step {step}:\n{tail}")


def _worker(launcher: subprocess.Popen, **env_wanted: str) -> psutil.Process:
    for proc in psutil.Process(launcher.pid).children(recursive=True):
        try:
            env, command = proc.environ(), " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "torch.distributed.run" in command or "LOCAL_RANK" not in env:
            continue
        if all(env.get(k) == v for k, v in env_wanted.items()):
            return proc
    raise RuntimeError(f"no worker with {env_wanted}")


def _measure(run: Run, victim: psutil.Process, name: str) -> dict:
    killed = time.time()
    victim.send_signal(signal.SIGKILL)
    at, found = run.wait_for(AGAIN, after=killed)
    run.finish()
    parts = [(p.rsplit(" ", 2)[0], float(p.rsplit(" ", 2)[1])) for p in found.group(3).split(", ")]
    process = float(found.group(2))
    return {"name": name, "step": int(found.group(1)), "total": at - killed, "process": process, "parts": parts}


def checkpoint_restart(root: Path, steps: int, kill_at: int) -> dict:
    out = root / "restart"
    command = ["distrain", "launch", "torchrun", "--nnodes", "1", "--nproc-per-node", "2"]
    command += ["--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--max-restarts", "1", "--run", "--"]
    command += ["--resume", "auto", *_common(out, steps), "checkpointing.save_every_n_steps=5"]
    run = Run(command)
    _wait_for_step(run, out / "metrics.jsonl", kill_at)
    return _measure(run, _worker(run.proc, LOCAL_RANK="1"), "restart from the last checkpoint (torchrun)")


def torchft_rejoin(root: Path, steps: int, kill_at: int) -> dict:
    out = root / "torchft"
    command = ["distrain", "train", "--strategy", "ddp_torchft", "--devices", "1"]
    command += [*_common(out, steps), "checkpointing.save_every_n_steps=null"]
    run = Run(command)
    _wait_for_step(run, out / "replica_1" / "metrics.jsonl", kill_at)
    return _measure(run, _worker(run.proc, REPLICA_GROUP_ID="1"), "torchft: the group rejoins (live state)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--kill-at", type=int, default=12)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for way in (checkpoint_restart, torchft_rejoin):
            rows.append(way(Path(tmp), args.steps, args.kill_at))
    names = [part for part, _ in rows[0]["parts"]]
    header = ["way", "kill → training again", "detection and restart", *names]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        seconds = dict(row["parts"])
        cells = [row["name"], f"{row['total']:.1f} s", f"{row['total'] - row['process']:.1f} s"]
        cells += [f"{seconds.get(name, 0.0):.1f} s" for name in names]
        print("| " + " | ".join(cells) + " |")
    print(f"\n{os.cpu_count()} CPU cores; torch threads 1 per rank; kill -9 of one rank after step {args.kill_at}")


if __name__ == "__main__":
    main()
