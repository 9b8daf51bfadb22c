"""Real schedulers. distrain's sbatch file on a real SLURM (tests/slurm_cluster.py: slurmctld, a slurmd node, munge),
as written by ``distrain launch slurm``: checked by the controller itself, run by sbatch and srun, ended as SLURM
ends jobs (requeued, or cancelled and submitted again), and resumed to the weights of the same job never preempted,
bit for bit. And OpenMPI's ``mpirun`` starting the ranks, against torchrun."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distrain.checkpoint.state import read_model_weights
from helpers import env_without_rank, run_cli
from slurm_cluster import SlurmCluster, why_not

pytestmark = [pytest.mark.alone, pytest.mark.slow]  # a scheduler's timing; the node's CPUs are the job's

#: a small run whose steps SLURM can signal in the middle of: 24 steps, a checkpoint every 8. Its strategy is
#: named: ``auto`` picks the layout its measured rates predict fastest, and a busy machine can make that a 2-stage
#: pipeline in one job and DDP in the next (equal within fp32 rounding, not bit for bit: 5.4136338 and 5.4136333)
TRAIN = [
    "--seed", "3", "--strategy", "ddp", "training.max_steps=24", "data.max_bytes=20000", "data.seq_len=16",
    "training.batch_size_per_gpu=4", "checkpointing.save_every_n_steps=8", "logging.log_every_n_steps=1",
    "logging.progress_bar=false", "logging.use_tensorboard=false", "logging.plot_summary=false",
]  # fmt: skip
#: OpenMPI as srun runs the tasks here (TaskPlugin=task/none): unbound, and its daemons without the topology in
#: shared memory (hwloc maps it at an address picked from the daemon's own memory map, and a daemon crashed doing
#: so in CI, where the "nodes" are namespaces of one machine)
MPIRUN = ["mpirun", "--allow-run-as-root", "--bind-to", "none", "--mca", "rtc_hwloc_vmhole", "none"]
#: every job runs on both nodes of the test cluster, a rank on each: the ranks talk across the bridge
NODES, RANKS_PER_NODE = 2, 1


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = why_not()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    # the jobs run `distrain` from this venv, without this test process's rank variables
    cluster.env = {k: v for k, v in cluster.env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cluster.env["PATH"] = f"{os.path.dirname(sys.executable)}:{cluster.env['PATH']}"
    yield cluster
    cluster.stop()


def _job_file(folder: Path, *launch: str) -> Path:
    """``distrain launch slurm`` on a CPU partition (the nodes have no GPU), writing ``folder/distrain.sbatch``."""
    folder.mkdir(parents=True, exist_ok=True)
    args = ["--nodes", str(NODES), "--gpus-per-node", "0", "--ranks-per-node", str(RANKS_PER_NODE), "--time", "10"]
    args += launch
    written = run_cli(["launch", "slurm", *args, "--", "--output-dir", str(folder / "run"), *TRAIN], cwd=folder)
    assert written.returncode == 0, written.stderr
    return folder / "distrain.sbatch"


def _steps_logged(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return max((json.loads(line).get("step", 0) for line in lines if line.startswith("{")), default=0)


@pytest.fixture(scope="module")
def never_preempted(slurm, tmp_path_factory):
    """The job run once, start to end: its folder."""
    folder = tmp_path_factory.mktemp("never-preempted")
    job = slurm.submit(_job_file(folder, "--partition", "tight"))  # its GraceTime: 0 s
    assert slurm.wait_until_ended(job) == "COMPLETED"
    (folder / "job").write_text(job)
    return folder


def test_a_job_the_cluster_cannot_grant_is_refused_in_sbatchs_words_and_no_file_is_written(
    slurm, tmp_path, monkeypatch
):
    """``distrain launch slurm`` on a machine with a controller asks it first (``sbatch --test-only``): a partition
    that does not exist, or more nodes than the cluster has, is one line with the controller's own words."""
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    for bad, said in (
        (("--nodes", "1", "--partition", "nonesuch"), "invalid partition specified: nonesuch"),
        (("--nodes", "3"), "Requested node configuration is not available"),  # the cluster has 2
    ):
        proc = run_cli(["launch", "slurm", "--gpus-per-node", "0", "--time", "10", *bad], cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("distrain: error: sbatch --test-only refused the job: ") and said in proc.stderr
        assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())  # nothing written, not even half


def test_the_sbatch_file_runs_as_written_on_a_cpu_partition(slurm, never_preempted, tmp_path):
    """The controller accepts the CPU file as written (it refused the one with a GPU request: no such gres on this
    cluster), and the job trains on its 2 nodes' tasks, started by srun, to its last step. Its partition gives a
    preempted job no time to checkpoint (GraceTime 0): that is said once, at the first checkpoint."""
    accepted = slurm.run("sbatch", "--test-only", str(never_preempted / "distrain.sbatch"))
    assert accepted.returncode == 0 and "to start at" in accepted.stderr, accepted.stderr
    gpu = run_cli(["launch", "slurm", "--nodes", "1", "--gpus-per-node", "2", "--time", "10"], cwd=tmp_path)
    assert gpu.returncode == 0, gpu.stderr
    refused = slurm.run("sbatch", "--test-only", str(tmp_path / "distrain.sbatch"))
    assert refused.returncode != 0 and "generic resource" in refused.stderr.lower(), refused.stderr
    run = never_preempted / "run"
    assert _steps_logged(run) == 24 and not (run / "PREEMPTED").exists()
    output = "".join(p.read_text() for p in never_preempted.glob("distrain-*.out"))
    assert "done at step 24" in output, output[-3000:]
    assert slurm.nodes_of((never_preempted / "job").read_text()) == "node[0-1]"  # a rank on each node
    warned = [line for line in output.splitlines() if "GraceTime" in line]
    assert len(warned) == 1 and "partition tight gives a preempted job 0 s (GraceTime)" in warned[0], warned


#: how a scheduler ends the job (given its id), and the signal its ranks get
ENDINGS = {
    "scancel-usr1": (lambda slurm, job, folder: slurm.run("scancel", "--signal=USR1", job), 10),
    "scontrol-requeue": (lambda slurm, job, folder: slurm.run("scontrol", "requeue", job), 15),
    # a job of a partition with a higher PriorityTier needs the node: PreemptMode=REQUEUE
    "preempted-by-priority": (
        lambda slurm, job, folder: slurm.run(
            "sbatch", "--partition=urgent", "--exclusive", "--output=/dev/null", "--wrap=sleep 1", cwd=folder
        ),
        15,
    ),
}


def _submitted_until_step_5(slurm, folder: Path) -> tuple[str, Path, float]:
    """The job of ``folder``'s file submitted and running, 5 of its 24 steps logged: its id, its run folder and a
    deadline two minutes from its submission."""
    job = slurm.submit(_job_file(folder))
    run = folder / "run"
    deadline = time.monotonic() + 120
    while _steps_logged(run) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _steps_logged(run) >= 5, slurm.state(job)
    return job, run, deadline


def _assert_same_final_weights(run: Path, reference: Path) -> None:
    ours, theirs = (read_model_weights(folder / "checkpoints" / "last") for folder in (run, reference))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_job_ended_by_the_scheduler_is_requeued_and_ends_bit_identical(slurm, never_preempted, tmp_path, ending):
    """In the middle of the run, ``scancel --signal=USR1`` (what SLURM sends before a time limit or a preemption,
    ``--signal=USR1@120``): every rank finishes its step and checkpoints it, the job leaves ``PREEMPTED``, and its
    script requeues it. Or SLURM ends the job with SIGTERM and requeues it itself, once: ``scontrol requeue``, or a
    job of a higher-priority partition that needs the node (``PreemptMode=REQUEUE``, its ``GraceTime`` from SIGTERM
    to SIGKILL); the ranks checkpoint the same way. Each time ``--resume auto`` goes on from that checkpoint to the
    weights of the job never preempted."""
    end, signal_number = ENDINGS[ending]
    job, run, deadline = _submitted_until_step_5(slurm, tmp_path)
    signalled = end(slurm, job, tmp_path)
    assert signalled.returncode == 0, signalled.stderr
    while not (run / "PREEMPTED").exists() and time.monotonic() < deadline:  # the first attempt's end
        time.sleep(0.1)
    assert (run / "PREEMPTED").read_text().strip() == str(signal_number)  # as the run recorded it
    # requeued by its script, released at once, resumed to the end
    assert slurm.wait_until_ended(job) == "COMPLETED" and slurm.restarts(job) == 1
    assert not (run / "PREEMPTED").exists() and _steps_logged(run) == 24
    log = (run / "logs" / "rank_0.log").read_text()  # both attempts' (the job's output file holds the last one's)
    assert "GraceTime" not in log  # its checkpoints take far less than the partition's grace
    stopped = re.search(rf"stopped by signal {signal_number} at step (\d+) \(`last` resumes it\)", log)
    resumed = re.search(r"done at step 24 \(resumed from step (\d+)\)", log)
    assert stopped and resumed and 5 <= int(stopped.group(1)) == int(resumed.group(1)) < 24, log[-3000:]
    _assert_same_final_weights(run, never_preempted / "run")


def test_a_job_cancelled_mid_run_checkpoints_and_its_resubmission_ends_bit_identical(slurm, never_preempted, tmp_path):
    """``scancel`` with no signal named (SIGTERM to every task, SIGKILL after ``KillWait``): the job ends
    ``CANCELLED`` and is not requeued, and every rank first finishes its step and checkpoints it. The same file
    submitted again goes on from that checkpoint (``--resume auto``) to the weights of the job never cancelled."""
    job, run, deadline = _submitted_until_step_5(slurm, tmp_path)
    cancelled = slurm.run("scancel", job)
    assert cancelled.returncode == 0, cancelled.stderr
    assert slurm.wait_until_ended(job) == "CANCELLED" and slurm.restarts(job) == 0
    while slurm.run("squeue", "-h", "-j", job).stdout.strip() and time.monotonic() < deadline:  # still completing
        time.sleep(0.1)
    stopped = re.search(
        r"stopped by signal 15 at step (\d+) \(`last` resumes it\)", (run / "logs" / "rank_0.log").read_text()
    )
    assert stopped and 5 <= int(stopped.group(1)) < 24
    again = slurm.submit(tmp_path / "distrain.sbatch")
    assert slurm.wait_until_ended(again) == "COMPLETED" and _steps_logged(run) == 24
    assert not (run / "PREEMPTED").exists()
    resumed = re.search(r"done at step 24 \(resumed from step (\d+)\)", (run / "logs" / "rank_0.log").read_text())
    assert resumed and resumed.group(1) == stopped.group(1)
    _assert_same_final_weights(run, never_preempted / "run")


#: a Lightning script as its users write one for SLURM: its own sbatch file runs it under srun, and Lightning's
#: SLURMEnvironment (here with SIGHUP for its signal) stops, requeues and resumes it. argv: root, devices, num_nodes
LIGHTNING_SCRIPT = """
import os, signal, sys, time
import torch
from torch.utils.data import DataLoader, TensorDataset
import distrain.lightning as L
from distrain.lightning.plugins.environments import SLURMEnvironment

class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(0.2)  # a step slow enough for SLURM's signal to land mid-run, at no cost in CPU
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

L.seed_everything(3)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g))
plugins = [SLURMEnvironment(requeue_signal=signal.SIGHUP)] if "SLURM_JOB_ID" in os.environ else []
trainer = L.Trainer(
    accelerator="cpu", devices=int(sys.argv[2]), num_nodes=int(sys.argv[3]), max_steps=24, log_every_n_steps=1,
    default_root_dir=sys.argv[1], enable_progress_bar=False, plugins=plugins,
)
trainer.fit(Regression(), DataLoader(data, batch_size=4, shuffle=True))
if trainer.is_global_zero and trainer.global_step == 24:
    torch.save(trainer.lightning_module.state_dict(), os.path.join(sys.argv[1], "final.pt"))
"""


def test_a_lightning_script_under_its_own_sbatch_requeues_itself_on_its_signal_and_resumes(slurm, tmp_path):
    """Lightning's auto-requeue, as its users' own job files rely on it: ``srun python train.py`` with
    ``plugins=[SLURMEnvironment(requeue_signal=SIGHUP)]``. ``scancel --signal=HUP`` mid-run: every rank stops at one
    step with a checkpoint, rank 0 requeues the job (``scontrol requeue``), and the requeued job's ``fit`` (no
    ``ckpt_path`` in the script) goes on from that checkpoint, in a new version folder as in Lightning, to the
    weights of the same script never stopped (distrain's own launcher, 2 ranks on this machine), bit for bit."""
    (tmp_path / "train.py").write_text(LIGHTNING_SCRIPT)
    alone = {k: v for k, v in env_without_rank().items() if not k.startswith("SLURM_")} | {"OMP_NUM_THREADS": "1"}
    local = subprocess.Popen(  # beside the job, which mostly sleeps
        [sys.executable, "train.py", str(tmp_path / "local"), "2", "1"],
        cwd=tmp_path, env=alone, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    job_file = tmp_path / "train.sbatch"
    job_file.write_text(
        f"#!/bin/bash\n#SBATCH --nodes={NODES}\n#SBATCH --ntasks-per-node=1\n#SBATCH --output=%x-%j.out\n"
        f"export OMP_NUM_THREADS=1\nsrun {sys.executable} train.py {tmp_path / 'slurm'} 1 {NODES}\n"
    )
    job = slurm.submit(job_file)
    first = tmp_path / "slurm" / "lightning_logs" / "version_0"
    deadline = time.monotonic() + 120
    while _steps_logged(first) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _steps_logged(first) >= 5, slurm.state(job)
    signalled = slurm.run("scancel", "--signal=HUP", job)
    assert signalled.returncode == 0, signalled.stderr
    assert slurm.wait_until_ended(job) == "COMPLETED" and slurm.restarts(job) == 1
    output = "".join(p.read_text() for p in tmp_path.glob("*.out"))  # the requeued start's
    stopped = re.search(
        r"stopped by signal 1 at step (\d+): requeued SLURM job (\d+)", (first / "logs" / "rank_0.log").read_text()
    )
    assert stopped and stopped.group(2) == job and 5 <= int(stopped.group(1)) < 24, output[-3000:]
    assert f"resuming {first / 'checkpoints' / 'last'}" in output, output[-3000:]
    _, errors = local.communicate(timeout=300)
    assert local.returncode == 0, errors[-3000:]
    ours = torch.load(tmp_path / "slurm" / "final.pt", weights_only=True)
    reference = torch.load(tmp_path / "local" / "final.pt", weights_only=True)
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)


def test_the_partitions_grace_time_is_read_from_the_controller(slurm, monkeypatch):
    """What a rank under SLURM reads of its partition: the seconds from a preemption's SIGTERM to its SIGKILL, which
    a checkpoint must fit in (a save that takes longer is said once, on rank 0); nothing where the partition
    preempts nothing, or outside SLURM."""
    from distrain.cluster import slurm_grace_s
    from slurm_cluster import GRACE_S

    job = {"SLURM_JOB_ID": "1", **slurm.env}
    assert slurm_grace_s({**job, "SLURM_JOB_PARTITION": "cpu"}) == GRACE_S
    assert slurm_grace_s({**job, "SLURM_JOB_PARTITION": "tight"}) == 0
    assert slurm_grace_s({**job, "SLURM_JOB_PARTITION": "urgent"}) is None  # PreemptMode=OFF
    assert slurm_grace_s({**job, "SLURM_JOB_PARTITION": "nonesuch"}) is None
    assert slurm_grace_s({k: v for k, v in job.items() if k != "SLURM_JOB_ID"}) is None


def _losses(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def test_mpirun_starts_the_ranks_and_trains_as_torchrun_does(tmp_path):
    """``mpirun -np 2 distrain train`` (OpenMPI; distrain reads its OMPI_COMM_WORLD_* variables) gives the losses
    and final weights of ``torchrun --nproc-per-node 2`` on the same run, bit for bit."""
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (apt-get install openmpi-bin; .ci/run installs it)")
    env = {**env_without_rank(), "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    starters = {
        "mpirun": [*MPIRUN, "--oversubscribe", "-np", "2", "distrain"],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     "-m", "distrain.cli"],
    }  # fmt: skip
    for name, starter in starters.items():
        done = subprocess.run(
            [*starter, "train", "--output-dir", str(tmp_path / name), *TRAIN],
            env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, (name, done.stderr[-3000:])
        assert "on 2 process(es)" in done.stdout, (name, done.stdout[-2000:])
    assert _losses(tmp_path / "mpirun") == _losses(tmp_path / "torchrun") and len(_losses(tmp_path / "mpirun")) == 24
    a, b = (read_model_weights(tmp_path / name / "checkpoints" / "last") for name in starters)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_mpirun_across_two_hosts_trains_as_srun_does(slurm, never_preempted, tmp_path):
    """``mpirun -H node0,node1`` (OpenMPI starting a rank on each node through its remote shell, as ssh would)
    gives the losses and final weights of the same two-node run under srun, bit for bit (with the threads per rank
    the sbatch file gives: a rank with other threads sums its matmuls in another order, and differs in the last bit
    from step 13 on)."""
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not installed (apt-get install openmpi-bin; .ci/run installs it)")
    mpirun = [
        *MPIRUN, "--mca", "plm_rsh_agent", str(slurm.remote_shell()),
        "--mca", "oob_tcp_if_include", f"{slurm.subnet}.0/24", "-H", ",".join(slurm.nodes), "-np", str(NODES),
        "-x", f"MASTER_ADDR={slurm.nodes[0]}", "-x", "GLOO_SOCKET_IFNAME", "-x", "PATH",
        "-x", f"OMP_NUM_THREADS={slurm.cpus // RANKS_PER_NODE}",  # what the sbatch file gives each task
    ]  # fmt: skip
    done = subprocess.run(
        [*mpirun, "distrain", "train", "--output-dir", str(tmp_path / "run"), *TRAIN],
        env=slurm.env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reference = never_preempted / "run"
    assert _losses(tmp_path / "run") == _losses(reference) and len(_losses(reference)) == 24
    a, b = (read_model_weights(run / "checkpoints" / "last") for run in (tmp_path / "run", reference))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_node_lost_mid_run_requeues_the_job_which_goes_on_with_the_node_left_and_the_global_batch(
    slurm, never_preempted, tmp_path
):
    """An elastic job (``--min-nodes 1`` of 2) loses a node after its first checkpoint, as a node loses power: off
    the network, then its slurmd and its rank killed. The controller finds it down, ends the job ``NODE_FAIL`` and
    requeues it; it starts again on the node left, and ``--resume auto`` goes on from the checkpoint with one rank
    accumulating what two made (the same global batch): it ends on the never-preempted job's weights within fp32
    rounding (one rank sums in another order than two), and the lost node comes back for the next job."""
    script, deadline = _job_file(tmp_path, "--min-nodes", "1"), time.monotonic() + 120
    while (
        slurm.run("sinfo", "-h", "-N", "-p", "cpu", "-o", "%T").stdout.split() != ["idle"] * 2
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)  # both nodes free (the job before may still be completing): it starts on both
    job, run = slurm.submit(script), tmp_path / "run"
    while _steps_logged(run) < 10 and time.monotonic() < deadline:  # past its first checkpoint (step 8)
        time.sleep(0.05)
    assert _steps_logged(run) >= 10 and slurm.nodes_of(job) == "node[0-1]", slurm.state(job)
    slurm.lose_node("node1")
    try:
        assert slurm.wait_until_ended(job) == "COMPLETED" and slurm.restarts(job) >= 1
        assert slurm.nodes_of(job) == "node0"  # the node left
    finally:
        slurm.restore_node("node1")
    log = (run / "logs" / "rank_0.log").read_text()
    resumed = re.search(r"done at step 24 \(resumed from step (\d+)\)", log)
    assert resumed and int(resumed.group(1)) >= 8, log[-3000:]
    ours, theirs = (read_model_weights(folder / "checkpoints" / "last") for folder in (run, never_preempted / "run"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.allclose(ours[name], theirs[name], rtol=1e-4, atol=1e-6), name
