"""A real SLURM of two nodes on this machine, for the tests: Debian's ``slurm-wlm`` and ``munge``, started from a
folder of their own (nothing in /etc changes). ``munged`` with a key made here and ``slurmctld`` run on this machine;
each node is a network namespace joined to a bridge, its ``slurmd`` started in it with ``nsenter --net`` (``ip netns
exec`` would remount /sys) and a mount namespace of its own where /etc/hosts also names the nodes (a job's
``MASTER_ADDR`` is its first node's name, as on a cluster with DNS). Jobs run as the real scheduler runs them:
``sbatch`` starts the batch script on the first node, ``srun`` its tasks on every node, ``scancel`` and ``scontrol``
signal and requeue them, and the ranks of two nodes talk over the bridge.

Needs root (``slurmd`` starts jobs as their user; namespaces) and the packages (``.ci/run`` installs them):
``why_not()`` says why a test must skip. docs/multi-node.md says how to start the same on a laptop.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from helpers import find_free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
#: how long a requeued job waits before ``wait_until_ended`` lets it start (SLURM's own wait: 2 minutes)
RELEASE_AFTER_S = 3.0
#: the states a job ends in (a requeued one is ``REQUEUED`` or ``PENDING`` again, not ended)
ENDED = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"
}  # fmt: skip
#: partition ``cpu``'s jobs are preempted (requeued) by partition ``urgent``'s, given this long from SIGTERM to
#: SIGKILL; partition ``tight`` gives none
GRACE_S = 30
NODES = 2
#: each node's interface, the same name in every namespace: a job's ``GLOO_SOCKET_IFNAME``
INTERFACE = "eth0"
#: a node that answers no ping for this long is declared down (SLURM's default, 300 s, would hold a test that long)
SLURMD_TIMEOUT_S = 6
#: how long the controller waits for a node's answer to one message (SLURM's default, 10 s): a ping to a lost node
#: waits this long before the node counts as not answering, so with the default the node was declared down 30 s
#: after it was lost, and with 3 s 13 s after (measured); every answer of a live node here comes in milliseconds
MESSAGE_TIMEOUT_S = 3
#: SIGTERM to SIGKILL when SLURM ends a job itself (its default, 30 s): a rank waiting on a lost node's collective
#: never ends its step, and the job stays COMPLETING that long; every checkpoint here is written in well under it
KILL_WAIT_S = 5


def why_not() -> str | None:
    """Why a real SLURM cannot start here, or None."""
    if os.geteuid() != 0:
        return "a real SLURM needs root: slurmd starts each job as its user, and its nodes are namespaces"
    missing = [d for d in (*DAEMONS, "sbatch", "mungekey", "ip", "nsenter", "unshare") if shutil.which(d) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge iproute2; .ci/run installs them)"
    return None


class SlurmCluster:
    """One controller on this machine and ``NODES`` nodes (``node0``, ``node1``), in ``folder``; ``env`` is what a
    client (``sbatch``, ``squeue``) needs, and what a job is given. Partitions: ``cpu`` (the default), preempted by
    ``urgent``, with ``GRACE_S``; ``tight``, with no grace."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.host = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1
        self.id = uuid.uuid4().hex[:5]  # unique names: a stale cluster's namespaces cannot get in the way
        self.subnet = f"10.{random.randint(202, 250)}.{random.randint(0, 255)}"
        self.nodes = [f"node{i}" for i in range(NODES)]
        self.env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf"), "GLOO_SOCKET_IFNAME": INTERFACE}
        self._pids: list[Path] = []

    def namespace(self, node: str) -> str:
        return f"dsn{self.id}{node[-1]}"

    def address(self, node: str) -> str:
        return f"{self.subnet}.{2 + self.nodes.index(node)}"

    # ---- start and stop ------------------------------------------------------------------------------------------
    def start(self) -> SlurmCluster:
        f = self.folder
        for sub in ("state", "spool", "log", "munge"):
            (f / sub).mkdir(parents=True, exist_ok=True)
        self._network_up()
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
        hosts = f / "hosts"
        hosts.write_text(Path("/etc/hosts").read_text() + "".join(f"{self.address(n)} {n}\n" for n in self.nodes))
        subprocess.run(["slurmctld", "-f", str(f / "slurm.conf")], check=True, capture_output=True, env=self.env)
        self._pids.append(f / "slurmctld.pid")
        for node in self.nodes:
            self.start_node(node)
        self._wait_for_nodes()
        return self

    def start_node(self, node: str) -> None:
        """``node``'s slurmd, in its namespace; it takes its jobs there."""
        f = self.folder
        command = self.on_node(node, f"exec slurmd -N {node} -f {f / 'slurm.conf'}")
        subprocess.run(command, check=True, capture_output=True, env=self.env)
        self._pids.append(f / f"slurmd-{node}.pid")

    def on_node(self, node: str, command: str) -> list[str]:
        """The argv that runs the shell ``command`` on ``node``: in its namespaces, as its slurmd runs jobs."""
        inside = f"mount --bind {self.folder / 'hosts'} /etc/hosts && {command}"
        return ["nsenter", f"--net=/run/netns/{self.namespace(node)}", "unshare", "--mount", "--", "sh", "-c", inside]

    def remote_shell(self) -> Path:
        """An ``rsh`` for the nodes (what OpenMPI's ``plm_rsh_agent`` calls as ``AGENT HOST COMMAND...``): the
        command runs on that node, as ssh would run it there."""
        agent = self.folder / "node-shell"
        cases = "".join(f"    {n}) ns={self.namespace(n)} ;;\n" for n in self.nodes)
        agent.write_text(
            "#!/bin/sh\n"
            'host="$1"; shift\n'
            'case "$host" in\n'
            f"{cases}"
            '    *) echo "node-shell: no node $host" >&2; exit 255 ;;\n'
            "esac\n"
            f'exec nsenter --net=/run/netns/$ns unshare --mount -- sh -c "mount --bind {self.folder / "hosts"} '
            '/etc/hosts && exec $*"\n'
        )
        agent.chmod(0o755)
        return agent

    def kill_node(self, node: str) -> None:
        """The node dies: its slurmd and every process of its jobs, at once (SIGKILL)."""
        pids = self._run_quiet("ip", "netns", "pids", self.namespace(node)).split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass

    def lose_node(self, node: str) -> None:
        """The node is lost as one that loses power is: off the network first (no packet in or out, so its peers get
        no reset and their collectives wait), then its slurmd and every process of its jobs killed. The controller
        declares it down once ``SLURMD_TIMEOUT_S`` has passed without an answer to its pings."""
        self._ip("link", "set", f"dsv{self.id}{node[-1]}", "down")
        self.kill_node(node)

    def restore_node(self, node: str) -> None:
        """The node back: on the network, its slurmd started again, and the controller told it may take jobs."""
        self._ip("link", "set", f"dsv{self.id}{node[-1]}", "up")
        self.start_node(node)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self.run("scontrol", "update", f"nodename={node}", "state=resume")
            state = self.run("sinfo", "-h", "-n", node, "-o", "%T").stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"{node} did not come back: {state}")

    def stop(self) -> None:
        """Every daemon ended, and every job's process with them; the namespaces and the bridge removed."""
        subprocess.run(["scancel", "--full", "--user", "root"], capture_output=True, env=self.env, timeout=30)
        for pid_file in reversed(self._pids):
            try:
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                pass
        time.sleep(0.5)
        self._network_down()

    def _network_up(self) -> None:
        bridge = f"dsb{self.id}"
        self._ip("link", "add", bridge, "type", "bridge")
        self._ip("addr", "add", f"{self.subnet}.1/24", "dev", bridge)
        self._ip("link", "set", bridge, "up")
        for node in self.nodes:
            ns, veth = self.namespace(node), f"dsv{self.id}{node[-1]}"
            self._ip("netns", "add", ns)
            self._ip("link", "add", veth, "type", "veth", "peer", "name", INTERFACE, "netns", ns)
            self._ip("link", "set", veth, "master", bridge)
            self._ip("link", "set", veth, "up")
            self._ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", INTERFACE)
            self._ip("-n", ns, "link", "set", INTERFACE, "up")
            self._ip("-n", ns, "link", "set", "lo", "up")

    def _network_down(self) -> None:
        for node in self.nodes:
            self.kill_node(node)
            self._run_quiet("ip", "netns", "del", self.namespace(node))
        self._run_quiet("ip", "link", "del", f"dsb{self.id}")

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    @staticmethod
    def _run_quiet(*args: str) -> str:
        return subprocess.run(list(args), capture_output=True, text=True).stdout

    def _config(self, munge_socket: Path) -> str:
        f = self.folder
        nodes = "".join(
            f"NodeName={n} NodeAddr={self.address(n)} CPUs={self.cpus} RealMemory=1000 State=UNKNOWN\n"
            for n in self.nodes
        )
        return f"""ClusterName=distrain-tests
SlurmctldHost={self.host}({self.subnet}.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={f / "state"}
SlurmdSpoolDir={f / "spool"}/%n
SlurmctldPidFile={f / "slurmctld.pid"}
SlurmdPidFile={f}/slurmd-%n.pid
SlurmctldLogFile={f / "log" / "slurmctld.log"}
SlurmdLogFile={f}/log/slurmd-%n.log
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
SlurmdTimeout={SLURMD_TIMEOUT_S}
MessageTimeout={MESSAGE_TIMEOUT_S}
KillWait={KILL_WAIT_S}
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}PartitionName=cpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={GRACE_S}
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
PartitionName=tight Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=0
"""

    def _wait_for_nodes(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-N", "-p", "cpu", "-o", "%T").stdout.split()
            if len(states) == NODES and all(s in ("idle", "mixed", "allocated") for s in states):
                return
            time.sleep(0.2)
        logs = "\n".join(p.read_text()[-1500:] for p in (self.folder / "log").glob("*.log"))
        raise RuntimeError(f"the SLURM nodes did not come up in {timeout:g} s (states {states}):\n{logs}")

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
        return self._field(job, "JobState")

    def nodes_of(self, job: str) -> str:
        """The nodes the job ran on, as SLURM writes a node list: ``node[0-1]``."""
        return self._field(job, "NodeList")

    def restarts(self, job: str) -> int:
        return int(self._field(job, "Restarts") or 0)

    def _field(self, job: str, name: str) -> str:
        shown = self.run("scontrol", "show", "job", "-o", job).stdout
        return next((f.split("=", 1)[1] for f in shown.split() if f.startswith(f"{name}=")), "")

    def wait_until_ended(self, job: str, timeout: float = 240.0, release_requeued: bool = True) -> str:
        """The job's final state, once it has one (``wait_until``)."""
        return self.wait_until(job, lambda state: state in ENDED, timeout, release_requeued)

    def wait_until(
        self, job: str, done: Callable[[str], bool], timeout: float = 240.0, release_requeued: bool = True
    ) -> str:
        """The job's state once ``done(state)`` holds. A job requeued waits 2 minutes before it may start again
        (SLURM's own delay): ``release_requeued`` makes it eligible after ``RELEASE_AFTER_S``, as an administrator
        would (``StartTime=now``)."""
        deadline, pending_since = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            state = self.state(job)
            if done(state):
                return state
            pending_since = (pending_since or time.monotonic()) if state == "PENDING" else None
            # not at once: slurmd refuses a batch job it killed moments ago ("already killed, do not launch")
            if pending_since and time.monotonic() - pending_since > RELEASE_AFTER_S and release_requeued:
                self.run("scontrol", "update", f"jobid={job}", "StartTime=now")
            time.sleep(0.2)
        raise TimeoutError(f"SLURM job {job} still {self.state(job)} after {timeout:g} s")
