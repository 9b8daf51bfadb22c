"""Two real "hosts" on one machine: network namespaces joined by a veth pair (scripts/two_node_netns.sh).

2 nodes × 2 processes, c10d rendezvous across the namespaces, must give the very losses of 4
processes on one node. Needs root and iproute2 (CI has both; .ci/run installs iproute2).
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid

import pytest

pytestmark = pytest.mark.alone  # four ranks across network namespaces; rendezvous timeouts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "two_node_netns.sh")
TRAIN_ARGS = [
    "--max-steps",
    "4",
    "--seed",
    "3",
    "training.batch_size_per_gpu=2",
    "data.seq_len=32",
    "data.max_bytes=100000",
    "training.limit_val_batches=1",
    "logging.log_every_n_steps=1",
    "logging.progress_bar=false",
    "logging.use_tensorboard=false",
]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")


def _netns_available() -> str | None:
    """Why the test cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed (.ci/run installs it)"
    probe = f"dtnprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _losses(run_dir) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}


@pytest.mark.slow
def test_two_namespaced_nodes_train_like_four_local_processes(tmp_path):
    reason = _netns_available()
    if reason:
        pytest.skip(reason)
    netns_id = uuid.uuid4().hex[:6]  # unique names: a stale run's namespaces cannot get in the way
    env = {**_env(), "DISTRAIN_NETNS_ID": netns_id, "PYTHON": sys.executable}
    listening: set[tuple[str, str]] = set()  # (node, local address:port) of every listening socket, mid-run
    try:
        command = [SCRIPT, "run", "--nproc-per-node", "2", "--", *TRAIN_ARGS]
        proc = subprocess.Popen(
            [*command, "--output-dir", str(tmp_path / "two_nodes")],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        output = {"stdout": "", "stderr": ""}

        def read(name: str) -> None:
            output[name] = getattr(proc, name).read()

        readers = [threading.Thread(target=read, args=(name,), daemon=True) for name in output]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 400
        while proc.poll() is None and time.monotonic() < deadline:
            for node in "ab":
                ss = ["ip", "netns", "exec", f"dtn{netns_id}{node}", "ss", "-ltnH"]
                found = subprocess.run(ss, capture_output=True, text=True).stdout.splitlines()
                listening.update((node, line.split()[3]) for line in found if len(line.split()) > 3)
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for reader in readers:
            reader.join(timeout=10)
    finally:  # also after a timeout (SIGKILL skips the script's own clean-up)
        subprocess.run([SCRIPT, "down"], env=env, capture_output=True, timeout=60)
    assert proc.returncode == 0, output["stdout"][-4000:] + output["stderr"][-2000:]
    two = subprocess.CompletedProcess(command, proc.returncode, output["stdout"], output["stderr"])
    # every store and gloo socket listens on its node's address (the stores torchrun's agents host listened on every
    # interface): the rendezvous store on the endpoint node A was given, nothing on 0.0.0.0, * or [::]
    assert ("a", "10.200.0.1:29400") in listening, sorted(listening)
    assert any(node == "b" for node, _ in listening), sorted(listening)  # node B's gloo sockets
    wildcard = sorted((n, a) for n, a in listening if a.rsplit(":", 1)[0] in ("0.0.0.0", "*", "[::]"))
    assert not wildcard, sorted(listening)
    assert f"dtn{netns_id}a" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "[node-a]" in two.stdout and "[node-b]" in two.stdout and "4 process(es)" in two.stdout

    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "distrain.cli",
            "train",
            "--devices",
            "4",
            *TRAIN_ARGS,
            "--output-dir",
            str(tmp_path / "one_node"),
        ],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two_losses, one_losses = _losses(tmp_path / "two_nodes"), _losses(tmp_path / "one_node")
    assert len(two_losses) == 4
    assert two_losses == pytest.approx(one_losses, rel=1e-6, abs=0), (two_losses, one_losses)


@pytest.mark.slow
def test_doctor_explains_the_loopback_interface_across_namespaces():
    """The classic multi-node failure: no GLOO_SOCKET_IFNAME, the hostname resolves to 127.0.0.1,
    gloo tells its peers a loopback address. `distrain doctor` must say so."""
    reason = _netns_available()
    if reason:
        pytest.skip(reason)
    env = {
        **_env(),
        "DISTRAIN_NETNS_ID": uuid.uuid4().hex[:6],
        "PYTHON": sys.executable,
        "DISTRAIN_COMMAND": "doctor",
        "NETNS_GLOO_SOCKET_IFNAME": "",
    }
    try:
        proc = subprocess.run(
            [SCRIPT, "run", "--", "--timeout", "30"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
        )
    finally:
        subprocess.run([SCRIPT, "down"], env=env, capture_output=True, timeout=60)
    assert proc.returncode != 0
    assert "the rank check FAILED" in proc.stdout, proc.stdout[-3000:]
    assert "likely cause: wrong interface: a rank told its peers a loopback address" in proc.stdout, proc.stdout[-3000:]
    assert "MASTER_ADDR is 10.200.0.1" in proc.stdout and "GLOO_SOCKET_IFNAME" in proc.stdout
