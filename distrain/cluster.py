"""Who am I: rank, local rank, world size, node rank and the master address — read from the env.

One place knows every launcher's vocabulary. The rest of distrain asks ``detect_cluster()`` and
never reads launcher variables itself.
"""

from __future__ import annotations

import atexit
import gc
import os
import re
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class ClusterEnv:
    """A rank's place in the job, and which launcher told us."""

    source: str  # "local" | "distrain" | "torchrun" | "slurm" | "mpi" | "kubeflow"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    num_nodes: int = 1

    @property
    def launched_externally(self) -> bool:
        """True when some launcher already started every rank: we must not start more. A
        Kubeflow PyTorchJob starts one pod per node; the ranks of a node are ours to start."""
        return self.source not in ("local", "kubeflow")


def _int(env: dict, key: str) -> int:
    value = env[key]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {key}={value!r} is not an integer") from None


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """``gpu[01-03,07],cpu5`` → ``['gpu01', 'gpu02', 'gpu03', 'gpu07', 'cpu5']``."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            if "-" in part:
                lo, hi = part.split("-")
                hosts.extend(f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{part}")
    return hosts


def _slurm_port(job_id: str) -> int:
    # A port derived from the job id: every task computes the same one without talking.
    return 15000 + int(re.sub(r"\D", "", job_id or "0")[-4:] or 0) % 20000


def _mpi(env: dict) -> ClusterEnv | None:
    """mpirun: OpenMPI's OMPI_COMM_WORLD_* or MPICH/Intel MPI's PMI_* variables."""
    if "OMPI_COMM_WORLD_SIZE" in env:
        keys = (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        )
    elif "PMI_SIZE" in env:
        keys = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    else:
        return None
    rank, world = _int(env, keys[0]), _int(env, keys[1])
    if world <= 1:
        return None  # a singleton "MPI" process is just a local run
    local_rank, local_world = int(env.get(keys[2], rank)), int(env.get(keys[3], world))
    if world > local_world and "MASTER_ADDR" not in env:
        raise ValueError(
            f"mpirun across nodes ({keys[1]}={world}, {keys[3]}={local_world}): set MASTER_ADDR (and MASTER_PORT) "
            "to the first node's address with -x MASTER_ADDR=... so every rank finds rank 0"
        )
    return ClusterEnv(
        source="mpi",
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=rank // max(1, local_world),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", 29500)),
        num_nodes=max(1, world // max(1, local_world)),
    )


def detect_cluster(env: dict | None = None) -> ClusterEnv:
    env = dict(os.environ if env is None else env)
    torchrun_keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    if all(k in env for k in torchrun_keys):
        world = _int(env, "WORLD_SIZE")
        return ClusterEnv(
            source="distrain" if "DISTRAIN_LAUNCHED" in env else "torchrun",
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK"),
            world_size=world,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            node_rank=int(env.get("GROUP_RANK", env.get("NODE_RANK", 0))),
            master_addr=env["MASTER_ADDR"],
            master_port=_int(env, "MASTER_PORT"),
        )
    # Kubeflow PyTorchJob: node-level RANK/WORLD_SIZE (pod index / pod count) and no LOCAL_RANK
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")) and "LOCAL_RANK" not in env:
        return ClusterEnv(
            source="kubeflow",
            node_rank=_int(env, "RANK"),
            num_nodes=_int(env, "WORLD_SIZE"),
            master_addr=env["MASTER_ADDR"],
            master_port=_int(env, "MASTER_PORT"),
        )
    mpi = _mpi(env)
    if mpi is not None:
        return mpi
    # srun sets SLURM_PROCID per task; an interactive salloc shell (job name "bash"/"interactive")
    # is not a launcher — there we launch ranks ourselves.
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        nodes = expand_slurm_nodelist(env.get("SLURM_STEP_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1")))
        world = _int(env, "SLURM_NTASKS")
        local_world = int(env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or max(1, world // max(1, len(nodes))))
        return ClusterEnv(
            source="slurm",
            rank=_int(env, "SLURM_PROCID"),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=world,
            local_world_size=local_world,
            node_rank=int(env.get("SLURM_NODEID", 0)),
            master_addr=env.get("MASTER_ADDR", nodes[0] if nodes else "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", _slurm_port(env.get("SLURM_JOB_ID", "0")))),
        )
    return ClusterEnv(source="local")


def export_cluster_env(cluster: ClusterEnv) -> None:
    """Launchers like srun name ranks their own way; torch.distributed (env://) and the rest of
    distrain read the standard variables. Fill them in where the launcher did not."""
    if not cluster.launched_externally:
        return
    for key, value in {
        "RANK": cluster.rank,
        "LOCAL_RANK": cluster.local_rank,
        "WORLD_SIZE": cluster.world_size,
        "LOCAL_WORLD_SIZE": cluster.local_world_size,
        "NODE_RANK": cluster.node_rank,
        "MASTER_ADDR": cluster.master_addr,
        "MASTER_PORT": cluster.master_port,
    }.items():
        os.environ.setdefault(key, str(value))


def slurm_grace_s(env: dict | None = None) -> float | None:
    """How long SLURM gives this job between a preemption's SIGTERM and its SIGKILL: its partition's ``GraceTime``
    (seconds), as ``scontrol`` reports it. None outside a SLURM job, where the partition preempts nothing
    (``PreemptMode=OFF``), or where ``scontrol`` does not say."""
    import shutil
    import subprocess

    env = os.environ if env is None else env
    partition = env.get("SLURM_JOB_PARTITION")
    if not partition or "SLURM_JOB_ID" not in env or shutil.which("scontrol") is None:
        return None
    try:
        shown = subprocess.run(
            ["scontrol", "show", "partition", partition, "-o"], capture_output=True, text=True, timeout=10, env=env
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    fields = dict(field.split("=", 1) for field in shown.split() if "=" in field)
    grace, mode = fields.get("GraceTime", ""), fields.get("PreemptMode", "OFF")
    return float(grace) if grace.isdigit() and mode.upper() != "OFF" else None


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- replica groups (fault tolerance with torchft) --------------------------------------------------------
#: torchft's own names: which replica group this process belongs to, how many there are, where the lighthouse is
REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, LIGHTHOUSE = "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"
#: distrain's: the job's secret, which a group's peer-state server asks of every request (the launcher makes one
#: per job; never printed, logged or written to the run directory)
JOB_SECRET = "DISTRAIN_JOB_SECRET"


@dataclass(frozen=True)
class ReplicaGroup:
    """This process's replica group: ``ddp_torchft`` runs several groups, each a job of its own (its own ranks,
    process group and restarts), that average gradients with each other and go on when one is lost."""

    id: int
    count: int
    lighthouse: str


def replica_group(env: dict | None = None) -> ReplicaGroup | None:
    """The replica group the environment names (distrain's launcher sets it for each group it starts; one torchrun
    per group sets it by hand), or None when none is named."""
    env = dict(os.environ if env is None else env)
    if REPLICA_GROUP_ID not in env:
        return None
    missing = [k for k in (NUM_REPLICA_GROUPS, LIGHTHOUSE) if not env.get(k)]
    if missing:
        raise ValueError(
            f"{REPLICA_GROUP_ID}={env[REPLICA_GROUP_ID]} is set but {', '.join(missing)} is not: a replica group "
            f"needs all three ({REPLICA_GROUP_ID}, {NUM_REPLICA_GROUPS}, {LIGHTHOUSE}=http://host:port)"
        )
    group, count = _int(env, REPLICA_GROUP_ID), _int(env, NUM_REPLICA_GROUPS)
    if not 0 <= group < count:
        raise ValueError(f"{REPLICA_GROUP_ID}={group} is outside 0..{count - 1} ({NUM_REPLICA_GROUPS}={count})")
    return ReplicaGroup(group, count, env[LIGHTHOUSE])


def job_secret(env: dict | None = None) -> str:
    """The job's secret (``DISTRAIN_JOB_SECRET``): every replica group of a job holds the same one."""
    env = os.environ if env is None else env
    secret = env.get(JOB_SECRET, "")
    if not secret:
        raise ValueError(
            f"{JOB_SECRET} is not set: a replica group serves its live state only to the job's other groups, which "
            "prove it with this secret. distrain's launcher sets it for the groups it starts; for groups started by "
            "hand, set the same random value in each (python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return secret


def is_loopback_address(address: str) -> bool:
    """Whether the host of ``address`` (``http://host:port``) is this machine's loopback: a service there can be
    reached from this machine only, so every group that reaches it runs here."""
    from urllib.parse import urlsplit

    return is_loopback_host(urlsplit(address).hostname or "")


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 without brackets) is this machine's loopback."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def replica_run_dir(path: str) -> str:
    """Each replica group writes its own run directory (metrics, logs, checkpoints): ``<path>/replica_<id>``.
    Unchanged outside a replica group, and for a path already inside that group's."""
    group = replica_group()
    if group is None or f"replica_{group.id}" in os.path.normpath(path).split(os.sep):
        return path
    return os.path.join(path, f"replica_{group.id}")


def end_fast_at_exit() -> None:
    """Call when this process's work is done: at exit, skip the interpreter's final garbage collection. With torch
    loaded it walks millions of objects, ~2-3 s per process on 2 cores, paid by every rank of every run, and by a
    failed rank before its exit code reaches the launcher. The exit handlers still run (a tracker's flush, the
    process group's shutdown): registered last, the freeze runs first, so a handler's own collection is cheap
    too. Memory goes back with the process."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
