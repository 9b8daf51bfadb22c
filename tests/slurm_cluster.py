"""A real SLURM on this machine, for the tests: Debian's ``slurm-wlm`` and ``munge``, started from a folder of their
own (nothing in /etc changes): ``munged`` with a key made here, ``slurmctld``, and one ``slurmd`` node with this
machine's CPUs, on ports chosen free. Jobs run as the real scheduler runs them: ``sbatch`` starts the batch script,
``srun`` its tasks, ``scancel`` and ``scontrol`` signal and requeue them.

Needs root (``slurmd`` starts jobs as their user) and the packages (``.ci/run`` installs them):
``why_not()`` says why a test must skip. docs/multi-node.md says how to start the same on a laptop.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from helpers import find_free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
#: how long a requeued job waits before ``wait_until_ended`` lets it start (SLURM's own wait: 2 minutes)
RELEASE_AFTER_S = 3.0
#: the states a job ends in (a requeued one is ``REQUEUED`` or ``PENDING`` again, not ended)
ENDED = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"
}  # fmt: skip


def why_not() -> str | None:
    """Why a real SLURM cannot start here, or None."""
    if os.geteuid() != 0:
        return "a real SLURM needs root: slurmd starts each job as its user (CI runs as root)"
    missing = [d for d in (*DAEMONS, "sbatch", "mungekey") if shutil.which(d) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge; .ci/run installs them)"
    return None


#: partition ``cpu``'s jobs are preempted (requeued) by partition ``urgent``'s, given this long from SIGTERM to
#: SIGKILL; partition ``tight`` gives none
GRACE_S = 30


class SlurmCluster:
    """One controller and one node, in ``folder``; ``env`` is what a client (``sbatch``, ``squeue``) needs.
    Partitions: ``cpu`` (the default), preempted by ``urgent``, with ``GRACE_S``; ``tight``, with no grace."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.node = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1
        self.env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
        self._pids: list[Path] = []

    # ---- start and stop ------------------------------------------------------------------------------------------
    def start(self) -> SlurmCluster:
        f = self.folder
        for sub in ("state", "spool", "log", "munge"):
            (f / sub).mkdir(parents=True, exist_ok=True)
        key, sock = f / "munge" / "munge.key", f / "munge" / "munge.sock"
        subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True, capture_output=True)
        os.chmod(key, 0o600)
        munge_pid = f / "munge" / "munged.pid"
        subprocess.run(
            ["munged", f"--key-file={key}", f"--socket={sock}", f"--pid-file={munge_pid}",
             f"--log-file={f / 'munge' / 'munged.log'}", f"--seed-file={f / 'munge' / 'seed'}", "--force"],
            check=True, capture_output=True,
        )  # fmt: skip
        self._pids.append(munge_pid)
        (f / "slurm.conf").write_text(self._config(sock))
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([daemon, "-f", str(f / "slurm.conf")], check=True, capture_output=True, env=self.env)
            self._pids.append(f / f"{daemon}.pid")
        self._wait_for_node()
        return self

    def stop(self) -> None:
        """Every daemon ended, and every job's process with them (``slurmd`` started them)."""
        subprocess.run(["scancel", "--full", "--user", "root"], capture_output=True, env=self.env, timeout=30)
        for pid_file in reversed(self._pids):
            try:
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                pass
        time.sleep(0.5)

    def _config(self, munge_socket: Path) -> str:
        f = self.folder
        return f"""ClusterName=distrain-tests
SlurmctldHost={self.node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={f / "state"}
SlurmdSpoolDir={f / "spool"}
SlurmctldPidFile={f / "slurmctld.pid"}
SlurmdPidFile={f / "slurmd.pid"}
SlurmctldLogFile={f / "log" / "slurmctld.log"}
SlurmdLogFile={f / "log" / "slurmd.log"}
SlurmctldPort={find_free_port()}
SlurmdPort={find_free_port()}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN
PartitionName=cpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={GRACE_S}
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
PartitionName=tight Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=0
"""

    def _wait_for_node(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-N", "-p", "cpu", "-o", "%T").stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.2)
        logs = "\n".join(p.read_text()[-1500:] for p in (self.folder / "log").glob("*.log"))
        raise RuntimeError(f"the SLURM node did not come up in {timeout:g} s (state {state!r}):\n{logs}")

    # ---- jobs ----------------------------------------------------------------------------------------------------
    def run(self, *command: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(list(command), capture_output=True, text=True, env=self.env, cwd=cwd, timeout=60)

    def submit(self, script: Path) -> str:
        """The job's id; the script runs in its own folder, with this process's environment (sbatch's default)."""
        done = self.run("sbatch", "--parsable", str(script), cwd=script.parent)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {script}: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def state(self, job: str) -> str:
        """The job's state as the controller holds it (``scontrol``, which also shows a job requeued or ended):
        ``PENDING``, ``RUNNING``, ``REQUEUED``, ``COMPLETED``..."""
        shown = self.run("scontrol", "show", "job", "-o", job).stdout
        return next((f.split("=", 1)[1] for f in shown.split() if f.startswith("JobState=")), "")

    def restarts(self, job: str) -> int:
        shown = self.run("scontrol", "show", "job", "-o", job).stdout
        return int(next((f.split("=", 1)[1] for f in shown.split() if f.startswith("Restarts=")), "0"))

    def wait_until_ended(self, job: str, timeout: float = 240.0, release_requeued: bool = True) -> str:
        """The job's final state, once it has one. A job requeued waits 2 minutes before it may start again
        (SLURM's own delay): ``release_requeued`` makes it eligible after ``RELEASE_AFTER_S``, as an administrator
        would (``StartTime=now``)."""
        deadline, pending_since = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            state = self.state(job)
            if state in ENDED:
                return state
            pending_since = (pending_since or time.monotonic()) if state == "PENDING" else None
            # not at once: slurmd refuses a batch job it killed moments ago ("already killed, do not launch")
            if pending_since and time.monotonic() - pending_since > RELEASE_AFTER_S and release_requeued:
                self.run("scontrol", "update", f"jobid={job}", "StartTime=now")
            time.sleep(0.5)
        raise TimeoutError(f"SLURM job {job} still {self.state(job)} after {timeout:g} s")
