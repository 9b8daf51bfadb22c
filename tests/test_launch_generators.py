"""`distrain launch`: the generated job files parse and carry the right counts."""

import os
import subprocess

import yaml

from helpers import run_cli


def distrain(*args, cwd):
    """``distrain ARGS`` in ``cwd``, in-process (``helpers.run_cli``): what is tested here is what main() prints and
    writes, and a subprocess costs seconds of imports on 2 cores."""
    return run_cli(list(args), cwd)


def test_torchrun_command(tmp_path):
    proc = distrain(
        "launch",
        "torchrun",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "--rdzv-endpoint",
        "h0:29400",
        "--",
        "--strategy",
        "fsdp",
        "training.learning_rate=1e-4",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.split()
    # torchrun as distrain's agent (its stores listen on the address each was given, not on every interface)
    assert out[:3] == ["python", "-m", "distrain.distributed.agent"] and "--nnodes=2" in out
    assert "--nproc-per-node=4" in out
    assert "--rdzv-backend=c10d" in out and "--rdzv-endpoint=h0:29400" in out
    assert out[-4:] == ["train", "--strategy", "fsdp", "training.learning_rate=1e-4"]


def test_sbatch_script(tmp_path):
    proc = distrain(
        "launch",
        "slurm",
        "--nodes",
        "3",
        "--gpus-per-node",
        "8",
        "--time",
        "02:00:00",
        "--partition",
        "gpu",
        "--",
        "--config",
        "configs/ddp.yaml",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "distrain.sbatch").read_text()
    directives = dict(
        line[len("#SBATCH --") :].split("=", 1)
        for line in text.splitlines()
        if line.startswith("#SBATCH --") and "=" in line
    )
    assert directives["nodes"] == "3" and directives["ntasks-per-node"] == "8" and directives["gpus-per-node"] == "8"
    assert directives["time"] == "02:00:00" and directives["partition"] == "gpu" and "#SBATCH --requeue" in text
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "--num-nodes 3 --devices 8" in srun and "--resume auto" in srun and "configs/ddp.yaml" in srun
    assert subprocess.run(["bash", "-n", str(tmp_path / "distrain.sbatch")]).returncode == 0


def test_sbatch_script_for_a_cpu_partition(tmp_path):
    """``--gpus-per-node 0``: no GPU (gres) request, which a CPU partition refuses ("Invalid generic resource"),
    ``--ranks-per-node`` tasks per node, each given its share of the node's CPUs by srun itself; a GPU count with
    another rank count, or a negative count, is one line and no file."""
    args = ("launch", "slurm", "--nodes", "2", "--gpus-per-node", "0", "--ranks-per-node", "3", "--time", "30")
    proc = distrain(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "distrain.sbatch").read_text()
    assert "gpus" not in text and "gres" not in text and "--cpus-per-task=8" not in text, text
    assert "#SBATCH --ntasks-per-node=3" in text and "#SBATCH --exclusive" in text
    assert "export CPUS_PER_TASK=$((SLURM_CPUS_ON_NODE / 3))" in text
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert srun.startswith("srun --kill-on-bad-exit=1 --cpus-per-task=$CPUS_PER_TASK distrain train")
    assert "--num-nodes 2 --devices 3" in srun
    # what the script computes, as bash computes it on a node of 16 CPUs running 3 tasks
    line = next(line for line in text.splitlines() if line.startswith("export CPUS_PER_TASK="))
    cpus = subprocess.run(
        ["bash", "-c", f"{line}; echo $CPUS_PER_TASK"], env={"SLURM_CPUS_ON_NODE": "16"},
        capture_output=True, text=True,
    )  # fmt: skip
    assert cpus.stdout.strip() == "5", cpus
    assert subprocess.run(["bash", "-n", str(tmp_path / "distrain.sbatch")]).returncode == 0
    one = distrain("launch", "slurm", "--nodes", "1", "--gpus-per-node", "0", "--time", "30", "--output", "one",
                   cwd=tmp_path)  # fmt: skip
    assert one.returncode == 0 and "#SBATCH --ntasks-per-node=1" in (tmp_path / "one").read_text()
    for bad, said in (
        (("--gpus-per-node", "4", "--ranks-per-node", "2"), "--ranks-per-node is for a CPU partition"),
        (("--gpus-per-node", "-1"), "--gpus-per-node -1: a count of GPUs, 0 for a CPU partition"),
        (("--gpus-per-node", "0", "--ranks-per-node", "0"), "--ranks-per-node 0: at least 1"),
    ):
        proc = distrain("launch", "slurm", "--nodes", "1", *bad, "--time", "30", "--output", "bad", cwd=tmp_path)
        assert proc.returncode == 2 and said in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert not (tmp_path / "bad").exists()


def test_pytorchjob_manifest(tmp_path):
    proc = distrain(
        "launch",
        "k8s",
        "--nodes",
        "4",
        "--gpus-per-node",
        "2",
        "--image",
        "reg/distrain:1",
        "--",
        "--strategy",
        "ddp",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    job = yaml.safe_load((tmp_path / "pytorchjob.yaml").read_text())
    assert job["kind"] == "PyTorchJob"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 3
    container = specs["Worker"]["template"]["spec"]["containers"][0]
    assert container["image"] == "reg/distrain:1" and container["resources"]["limits"]["nvidia.com/gpu"] == 2
    shell, flag, script = container["command"]
    assert (shell, flag) == ("sh", "-c") and script.startswith("distrain train --strategy ddp")
    assert "--num-nodes 4 --devices 2 --resume auto" in script and specs["Worker"]["restartPolicy"] == "OnFailure"
    # a preempted run checkpoints and exits 0; the pod must fail so that OnFailure restarts it
    fake = tmp_path / "bin"
    fake.mkdir()
    for preempted, code, expected in ((True, 0, 143), (False, 0, 0), (False, 3, 3)):
        marker = "mkdir -p runs/distrain && touch runs/distrain/PREEMPTED; " if preempted else "rm -rf runs; "
        (fake / "distrain").write_text(f"#!/bin/sh\n{marker}exit {code}\n")
        (fake / "distrain").chmod(0o755)
        env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
        assert subprocess.run([shell, flag, script], cwd=tmp_path, env=env).returncode == expected


def test_elastic_job_files(tmp_path):
    """MIN:MAX node counts for torchrun, SLURM and Kubernetes: the run then takes the count each rendezvous gives
    (no fixed --num-nodes) and keeps its global batch."""
    proc = distrain(
        "launch",
        "torchrun",
        "--nnodes",
        "1:4",
        "--nproc-per-node",
        "8",
        "--rdzv-endpoint",
        "h0:1",
        "--max-restarts",
        "3",
        cwd=tmp_path,
    )
    assert "--nnodes=1:4" in proc.stdout.split() and "--max-restarts=3" in proc.stdout.split(), proc.stderr
    args = ("--nodes", "4", "--min-nodes", "2", "--gpus-per-node", "8")
    assert distrain("launch", "slurm", *args, "--time", "01:00:00", cwd=tmp_path).returncode == 0
    text = (tmp_path / "distrain.sbatch").read_text()
    assert "#SBATCH --nodes=2-4" in text
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "--num-nodes" not in srun
    # the tasks per node on srun, not in the header: there SLURM would count the job's tasks from MIN and grant MIN
    # nodes however many are free (the real controller in test_schedulers.py shows it)
    assert "--ntasks-per-node" not in text.split("srun ")[0] and srun.startswith(
        "srun --kill-on-bad-exit=1 --ntasks-per-node=8"
    )
    assert distrain("launch", "k8s", *args, "--image", "reg/d:1", cwd=tmp_path).returncode == 0
    job = yaml.safe_load((tmp_path / "pytorchjob.yaml").read_text())
    assert job["spec"]["elasticPolicy"] == {
        "rdzvBackend": "c10d",
        "minReplicas": 2,
        "maxReplicas": 4,
        "maxRestarts": 100,
    }
    script = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"][2]
    assert script.startswith("python -m distrain.distributed.agent --nproc-per-node=8 -m distrain.cli train")
    assert "--num-nodes" not in script


def test_docker_files_have_no_secrets_or_ssh():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dockerfile = open(os.path.join(root, "docker", "Dockerfile")).read()
    compose = yaml.safe_load(open(os.path.join(root, "docker", "docker-compose.yaml")))
    assert "openssh" not in dockerfile.lower() and "passwd" not in dockerfile.lower()
    assert "USER trainer" in dockerfile
    assert set(compose["services"]) == {"node0", "node1"}


SLURM = ("launch", "slurm", "--nodes", "2", "--gpus-per-node", "4", "--time", "01:00:00", "--")
K8S = ("launch", "k8s", "--image", "img", "--gpus-per-node", "2", "--nodes")


def test_a_job_that_cannot_run_is_refused_before_its_file_is_written(tmp_path):
    """The run a job file starts is resolved and checked as `distrain train` will on the cluster, with the
    launcher's node and device counts: a wrong key, a layout the nodes cannot hold, or a strategy the job's
    starter cannot start is one line naming it, and no file."""
    cases = [
        ((*SLURM, "training.lerning_rate=1e-4"), "training.lerning_rate"),
        ((*SLURM, "--strategy", "model_parallel", "distributed.tensor_parallel_size=3"), "tensor_parallel_size"),
        (
            (
                "launch",
                "slurm",
                "--nodes",
                "1",
                "--gpus-per-node",
                "4",
                "--time",
                "1:00:00",
                "--",
                "--strategy",
                "ddp_torchft",
            ),
            "started by srun",
        ),  # fmt: skip
        (
            (
                "launch",
                "torchrun",
                "--nnodes",
                "1",
                "--nproc-per-node",
                "2",
                "--rdzv-endpoint",
                "h:1",
                "--",
                "--strategy",
                "ddp_torchft",
            ),
            "started by torchrun",
        ),  # fmt: skip
        ((*K8S, "2", "--", "--strategy", "ddp_torchft"), "distributed.num_nodes=2"),
        (("launch", "sky", "--nodes", "1", "--gpus", "H100:8", "--", "--strategy", "ddp_torchft"), "by torchrun"),
    ]
    for args, named in cases:
        proc = distrain(*args, cwd=tmp_path)
        assert proc.returncode == 2 and named in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert not any(tmp_path.iterdir()), (args, list(tmp_path.iterdir()))
    # a PyTorchJob pod on one node runs distrain, which starts the replica groups itself
    proc = distrain(*K8S, "1", "--", "--strategy", "ddp_torchft", cwd=tmp_path)
    assert proc.returncode == 0 and (tmp_path / "pytorchjob.yaml").exists(), proc.stderr
    # and `distrain train` itself refuses ddp_torchft over nodes in the same words, before starting anything
    proc = distrain("train", "--strategy", "ddp_torchft", "--num-nodes", "2", cwd=tmp_path)
    assert proc.returncode == 2 and "distributed.num_nodes=2 with strategy ddp_torchft" in proc.stderr, proc.stderr
