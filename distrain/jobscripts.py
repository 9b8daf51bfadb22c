"""Job files for the engines users already operate: torchrun commands, sbatch scripts, PyTorchJobs.

Each generator returns text; ``distrain launch`` prints or writes it. The training command inside
is always ``distrain train <args>``: the same run, whoever starts it.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import yaml

from distrain.run_dir import DEFAULT


def _train_command(train_args: list[str]) -> str:
    return shlex.join(["distrain", "train", *train_args])


def _with_output_dir(train_args: list[str], default: str = DEFAULT) -> tuple[list[str], str]:
    """The train arguments with an explicit output directory (the job script needs to know it), and it."""
    out_flags = [a for a in ("--output-dir", "--output_dir") if a in train_args]
    if out_flags:
        return train_args, train_args[train_args.index(out_flags[0]) + 1]
    return [*train_args, "--output-dir", default], default


#: what sbatch's --time takes: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES,
#: DAYS-HOURS:MINUTES:SECONDS, or no limit
_SLURM_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|(?i:infinite|unlimited)")


def check_slurm_time(value: str) -> str:
    """``value`` if sbatch's ``--time`` takes it; else a ValueError saying how to write it (``10m`` is refused by
    sbatch when the job is submitted, not when the script is written)."""
    if not _SLURM_TIME.fullmatch(value.strip()):
        raise ValueError(
            f"{value!r} is not a Slurm time: write MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS "
            "(e.g. 90, 1:30:00, 2-00:00:00)"
        )
    return value.strip()


#: torchrun, started as distrain's agent (``distributed/agent.py``): the same arguments, restarts and rendezvous, with
#: its stores listening on the address each was given, where torchrun's listen on every interface
TORCHRUN = ["python", "-m", "distrain.distributed.agent"]


def torchrun_command(
    nnodes: int | str, nproc_per_node: int, rdzv_endpoint: str, train_args: list[str], max_restarts: int = 0
) -> list[str]:
    """The command to run on each node (c10d rendezvous: no fixed node ranks needed). ``nnodes`` may be a range,
    ``MIN:MAX``: an elastic job that re-rendezvouses with the nodes it has (the run keeps its global batch)."""
    cmd = [
        *TORCHRUN,
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        "--rdzv-id=distrain",
    ]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    return cmd + ["-m", "distrain.cli", "train", *train_args]


#: what sbatch says where there is no controller to ask (SLURM's tools installed, no cluster configured or up)
_NO_CONTROLLER = ("Could not establish a configuration source", "Unable to contact slurm controller")


def refused_by_sbatch(script: str, folder: Path) -> str | None:
    """On a machine with SLURM's ``sbatch`` (a cluster's login node): what the controller says of ``script`` when it
    would refuse it (``sbatch --test-only``: a partition that does not exist, more nodes or time than it grants),
    its own words on one line; None when it would run it, or where there is no controller to ask."""
    import shutil
    import subprocess
    import tempfile

    if shutil.which("sbatch") is None:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch", dir=folder, delete=False) as file:
        file.write(script)
    try:
        checked = subprocess.run(
            ["sbatch", "--test-only", file.name], capture_output=True, text=True, timeout=30, cwd=folder
        )
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        os.unlink(file.name)
    said = [line.strip() for line in (checked.stderr + checked.stdout).splitlines() if line.strip()]
    if checked.returncode == 0 or any(words in line for line in said for words in _NO_CONTROLLER):
        return None
    return "; ".join(said)[:1000] or f"exit code {checked.returncode}"


def slurm_ranks_per_node(gpus_per_node: int, ranks_per_node: int | None) -> int:
    """The srun tasks (ranks) per node: one per GPU, or on a CPU partition (``gpus_per_node`` 0) ``ranks_per_node``
    (1 by default); a count that cannot be is a ``ValueError`` naming the flag."""
    if gpus_per_node < 0:
        raise ValueError(f"--gpus-per-node {gpus_per_node}: a count of GPUs, 0 for a CPU partition")
    if ranks_per_node is not None and ranks_per_node < 1:
        raise ValueError(f"--ranks-per-node {ranks_per_node}: at least 1")
    if gpus_per_node and ranks_per_node not in (None, gpus_per_node):
        raise ValueError(
            f"--ranks-per-node {ranks_per_node} with --gpus-per-node {gpus_per_node}: on GPUs each rank has its GPU "
            "(one rank per GPU); --ranks-per-node is for a CPU partition (--gpus-per-node 0)"
        )
    return gpus_per_node or ranks_per_node or 1


def sbatch_script(
    nodes: int,
    gpus_per_node: int,
    time: str,
    train_args: list[str],
    partition: str | None = None,
    min_nodes: int | None = None,
    ranks_per_node: int | None = None,
) -> str:
    """One srun task per GPU: srun starts every rank and distrain reads SLURM_* (no torchrun inside).
    ``min_nodes``: an elastic allocation (``--nodes=MIN-MAX``): the job starts (and each requeue restarts) on
    what SLURM grants (as many of MAX as are free), and the run keeps its global batch on however many nodes that
    is. ``gpus_per_node`` 0: a CPU partition: no GPU (gres) request, ``ranks_per_node`` tasks per node (1 by
    default), the job holding its nodes whole and each task its share of a node's CPUs (``SLURM_CPUS_ON_NODE``, known
    only once the job runs)."""
    time = check_slurm_time(time)
    ranks = slurm_ranks_per_node(gpus_per_node, ranks_per_node)
    partition_line = f"#SBATCH --partition={partition}\n" if partition else ""
    train_args, output_dir = _with_output_dir(train_args)
    node_count = [] if min_nodes else ["--num-nodes", str(nodes)]  # elastic: the allocation's count, from SLURM
    srun_command = _train_command([*train_args, *node_count, "--devices", str(ranks), "--resume", "auto"])
    nodes_directive = f"{min_nodes}-{nodes}" if min_nodes else str(nodes)
    # elastic: a task count per node in the header makes SLURM count the job's tasks from MIN (ntasks = MIN x
    # per node) and grant MIN nodes however many are free; srun takes the count per node instead
    tasks_line = "" if min_nodes else f"#SBATCH --ntasks-per-node={ranks}\n"
    srun = "srun --kill-on-bad-exit=1" + (f" --ntasks-per-node={ranks}" if min_nodes else "")
    if gpus_per_node:
        resources = f"#SBATCH --gpus-per-node={gpus_per_node}\n#SBATCH --cpus-per-task=8"
        per_task = "# One task per GPU"
    else:  # srun does not inherit sbatch's --cpus-per-task (SLURM 22.05+): it is given to srun itself
        resources = "#SBATCH --exclusive"
        per_task = (
            "# A CPU partition: the job holds its nodes whole, each task a share of a node's CPUs\n"
            f"export CPUS_PER_TASK=$((SLURM_CPUS_ON_NODE / {ranks}))\n"
            "export OMP_NUM_THREADS=$CPUS_PER_TASK"
        )
        srun += " --cpus-per-task=$CPUS_PER_TASK"
    return f"""#!/bin/bash
# Generated by `distrain launch slurm`. srun starts every rank itself and distrain reads
# SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS (no torchrun inside the allocation).
#SBATCH --job-name=distrain
#SBATCH --nodes={nodes_directive}
{tasks_line}{resources}
#SBATCH --time={time}
{partition_line}#SBATCH --requeue
#SBATCH --signal=USR1@120
#SBATCH --output=%x-%j.out

# Two minutes before the time limit (or on preemption) every task gets SIGUSR1: distrain finishes
# the step, writes a checkpoint and exits cleanly, leaving {output_dir}/PREEMPTED. The job is
# then requeued and `--resume auto` continues from the newest checkpoint.
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((15000 + SLURM_JOB_ID % 20000))
{per_task}

{srun} {srun_command}
if [ -f {shlex.quote(output_dir + "/PREEMPTED")} ]; then
  scontrol requeue "$SLURM_JOB_ID"
fi
"""


def pytorchjob_manifest(
    nodes: int, gpus_per_node: int, image: str, train_args: list[str], min_nodes: int | None = None
) -> str:
    """A Kubeflow PyTorchJob: one pod per node; distrain starts that node's ranks itself.

    Restarts resume as SLURM's requeue does: every start runs ``--resume auto``, and a run stopped by
    SIGTERM (preemption, eviction) — which checkpoints and exits 0 — leaves ``PREEMPTED`` in its run
    directory; the container then exits 143 (128 + SIGTERM) so ``restartPolicy: OnFailure`` starts it
    again."""
    train_args, output_dir = _with_output_dir(train_args)
    if min_nodes:  # elastic: the operator's torchrun rendezvous (PET_* variables) decides the pods in the job
        train = shlex.join([*TORCHRUN, f"--nproc-per-node={gpus_per_node}", "-m", "distrain.cli", "train",
                            *train_args, "--devices", str(gpus_per_node), "--resume", "auto"])  # fmt: skip
    else:
        train = _train_command(
            [*train_args, "--num-nodes", str(nodes), "--devices", str(gpus_per_node), "--resume", "auto"]
        )
    marker = shlex.quote(f"{output_dir}/PREEMPTED")
    command = ["sh", "-c", f"{train}; code=$?; if [ -f {marker} ]; then exit 143; fi; exit $code"]

    def replica(count: int) -> dict:
        return {
            "replicas": count,
            "restartPolicy": "OnFailure",
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "pytorch",
                            "image": image,
                            "command": command,
                            "resources": {"limits": {"nvidia.com/gpu": gpus_per_node}},
                            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                        }
                    ],
                    "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                }
            },
        }

    specs = {"Master": replica(1)}
    if nodes > 1:
        specs["Worker"] = replica(nodes - 1)
    manifest = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "distrain"},
        "spec": {"pytorchReplicaSpecs": specs},
    }
    if min_nodes:
        manifest["spec"]["elasticPolicy"] = {
            "rdzvBackend": "c10d",
            "minReplicas": min_nodes,
            "maxReplicas": nodes,
            "maxRestarts": 100,
        }
    return yaml.safe_dump(manifest, sort_keys=False)


SKY_CLOUDS = ("aws", "gcp", "azure", "kubernetes")


def parse_gpus(gpus: str) -> tuple[str, int]:
    """``A100:8`` → (``A100``, 8); ``H100`` → (``H100``, 1)."""
    name, _, count = gpus.partition(":")
    if not name or (count and (not count.isdigit() or int(count) < 1)):
        raise ValueError(f"--gpus {gpus!r}: expected NAME:COUNT, e.g. A100:8 or H100:8")
    return name, int(count or 1)


def skypilot_task(
    nodes: int,
    gpus: str,
    train_args: list[str],
    cloud: str | None = None,
    spot: bool = False,
    bucket: str | None = None,
    name: str = "distrain",
) -> str:
    """A SkyPilot task: ``nodes`` machines with ``gpus`` each; SkyPilot syncs this directory
    (``workdir``), runs ``./install.sh`` once per node (``setup``), then on every node starts
    torchrun from SkyPilot's own variables (``run``).

    Checkpoints go to ``--output-dir`` (default ``/checkpoints/<name>``: the ``bucket`` mounted there
    when one is given). With ``spot``, preempted jobs are recovered by SkyPilot's managed jobs
    (``sky jobs launch``), and ``--resume auto`` continues from the newest checkpoint — which needs
    a bucket: a recovered job runs on new machines.
    """
    if nodes < 1:
        raise ValueError(f"--nodes must be >= 1, got {nodes}")
    if cloud is not None and cloud not in SKY_CLOUDS:
        raise ValueError(f"--cloud must be one of {', '.join(SKY_CLOUDS)}, got {cloud!r}")
    accelerator, per_node = parse_gpus(gpus)
    train_args, _ = _with_output_dir(train_args, f"/checkpoints/{name}" if bucket else f"runs/{name}")
    train = shlex.join([*train_args, "--num-nodes", str(nodes), "--devices", str(per_node), "--resume", "auto"])
    resources: dict = {"accelerators": f"{accelerator}:{per_node}"}
    if cloud:
        resources["infra"] = "k8s" if cloud == "kubernetes" else cloud
    if spot:
        resources["use_spot"] = True
        # managed jobs (`sky jobs launch`) relaunch a preempted job, on other capacity if need be
        resources["job_recovery"] = {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 3}
    task: dict = {"name": name, "num_nodes": nodes, "resources": resources, "workdir": "."}
    if bucket:
        task["file_mounts"] = {"/checkpoints": {"name": bucket, "mode": "MOUNT_CACHED"}}
    task["setup"] = "set -e\n./install.sh\n"
    task["run"] = (
        "set -e\n"
        "# SkyPilot runs this on every node; its variables say which node this is and where the others are\n"
        'MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n1)\n'
        f"{shlex.join(TORCHRUN)} \\\n"
        '  --nnodes="$SKYPILOT_NUM_NODES" \\\n'
        '  --nproc-per-node="$SKYPILOT_NUM_GPUS_PER_NODE" \\\n'
        '  --node-rank="$SKYPILOT_NODE_RANK" \\\n'
        '  --master-addr="$MASTER_ADDR" --master-port=29500 \\\n'
        f"  -m distrain.cli train {train}\n"
    )
    header = (
        "# Generated by `distrain launch sky`. Start it with `sky launch -c NAME THIS_FILE`, or, for spot\n"
        "# instances, `sky jobs launch THIS_FILE`: SkyPilot relaunches a preempted job and `--resume auto`\n"
        "# continues from the newest checkpoint.\n"
    )
    return header + yaml.dump(task, Dumper=_BlockDumper, sort_keys=False, width=1000)


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (scripts) as YAML literal blocks, readable as the shell they are."""


_BlockDumper.add_representer(
    str,
    lambda dumper, s: dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None),
)


def sky_launch_command(path: str, spot: bool, name: str = "distrain") -> list[str]:
    """The SkyPilot command that starts the task: a managed job for spot (SkyPilot recovers it
    after a preemption), a cluster otherwise."""
    if spot:
        return ["sky", "jobs", "launch", "--yes", "--name", name, path]
    return ["sky", "launch", "--yes", "--cluster", name, path]
