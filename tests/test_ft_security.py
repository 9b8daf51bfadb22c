"""What a ddp_torchft job exposes: its servers listen on loopback only, a group's live state goes only to requests
that carry the job's secret, and the secret is written nowhere."""

from __future__ import annotations

import http.client
import io
import re
import struct
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch

from helpers import env_without_rank

pytestmark = pytest.mark.alone  # torchft's heartbeats with a one-second timeout (tests/conftest.py)

pytest.importorskip("torchft")

SECRET = "the-job-secret-" + "x" * 32
#: a value no answer but the state itself holds: its bytes in a response body are a leak
MARKER = 1234.5


def _request(port: int, method: str, path: str, authorization: str | None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path, headers={"Authorization": authorization} if authorization else {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.fixture(scope="module")
def serving():
    """A transport that holds a state at step 3 and serves it, as a running group's does."""
    from distrain.checkpoint.peer_state import peer_state_transport

    timeout = timedelta(seconds=10)
    transport = peer_state_transport(timeout, SECRET)
    state = {"model": {"w": torch.full((64,), MARKER)}, "progress": {"global_step": 3}}
    transport.send_checkpoint(dst_ranks=[1], step=3, state_dict=state, timeout=timeout)
    yield transport, state, timeout
    transport.shutdown()


@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "FOO"])
@pytest.mark.parametrize("path", ["/checkpoint/3/full", "/checkpoint/3/metadata", "/checkpoint/3/0", "/", "/x/../y"])
def test_the_peer_state_server_refuses_every_request_without_the_job_secret(serving, method, path):
    """torchft's own server hands the whole live state (weights, optimizer, data position) to a plain GET. Without
    the secret, or with a wrong one, every path and method is a 403 with no state in its body."""
    transport, _, _ = serving
    port = int(transport.metadata().rsplit(":", 1)[1].split("/")[0])
    leak = struct.pack("<f", MARKER) * 4
    for authorization in (None, "Bearer wrong", f"Bearer {SECRET}x", SECRET, f"Basic {SECRET}"):
        status, body = _request(port, method, path, authorization)
        assert status == 403, (method, path, authorization, status)
        assert leak not in body


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # torch's, on reading the bytes
def test_the_peer_state_server_serves_the_job_secret_on_loopback_and_names_it_when_refused(serving):
    from torchft.checkpointing._serialization import _streaming_load

    from distrain.checkpoint.peer_state import peer_state_transport

    transport, state, timeout = serving
    address = transport.metadata()
    # what torchft passes on through its manager and lighthouse (which serve it to anyone): never the secret
    assert address.startswith("http://127.0.0.1:") and SECRET not in address, address
    assert transport._server.socket.getsockname()[0] == "127.0.0.1"
    port = int(address.rsplit(":", 1)[1].split("/")[0])

    status, body = _request(port, "GET", "/checkpoint/3/full", f"Bearer {SECRET}")
    assert status == 200
    served = _streaming_load(io.BytesIO(body), weights_only=True)
    assert torch.equal(served["model"]["w"], state["model"]["w"]) and served["progress"] == state["progress"]

    receiver = peer_state_transport(timeout, SECRET)
    try:
        received = receiver.recv_checkpoint(src_rank=0, metadata=address, step=3, timeout=timeout)
        assert torch.equal(received["model"]["w"], state["model"]["w"])
    finally:
        receiver.shutdown()
    stranger = peer_state_transport(timeout, "another job's secret")
    try:
        with pytest.raises(RuntimeError, match="DISTRAIN_JOB_SECRET") as refused:
            stranger.recv_checkpoint(src_rank=0, metadata=address, step=3, timeout=timeout)
        assert "\n" not in str(refused.value) and SECRET not in str(refused.value)
    finally:
        stranger.shutdown()


def test_a_group_started_without_the_job_secret_is_one_line_naming_it(monkeypatch):
    from distrain.strategies.fault_tolerant import TorchFTStrategy

    for key, value in {
        "REPLICA_GROUP_ID": "0",
        "NUM_REPLICA_GROUPS": "2",
        "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:9",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("DISTRAIN_JOB_SECRET", raising=False)
    strategy = TorchFTStrategy(replica_groups=2, ft_timeout=1.0)
    with pytest.raises(RuntimeError, match="DISTRAIN_JOB_SECRET is not set") as error:
        strategy.setup_environment()
    assert "\n" not in str(error.value) and "replica group 0" in str(error.value)


@pytest.mark.parametrize(
    "address, loopback",
    [
        ("http://127.0.0.1:29510", True),
        ("http://localhost:29510", True),
        ("http://[::1]:29510", True),
        ("http://10.0.0.5:29510", False),
        ("http://lighthouse:29510", False),
    ],
)
def test_only_a_lighthouse_on_loopback_puts_the_groups_on_loopback(address, loopback):
    from distrain.cluster import is_loopback_address

    assert is_loopback_address(address) is loopback


# ---- a short job: 2 groups of 1 rank ------------------------------------------------------------------------
def _processes(launcher: psutil.Process) -> list[tuple[str, psutil.Process]]:
    """Every process of the job, named by its part: the launcher (the lighthouse), each group's torchrun agent (the
    group's store) and the ranks."""
    found = [("launcher", launcher)]
    for proc in launcher.children(recursive=True):
        try:
            agent = "distrain.distributed.agent" in " ".join(proc.cmdline())
            rank = "LOCAL_RANK" in proc.environ()
        except psutil.Error:
            continue
        found.append((f"{'agent' if agent else 'rank' if rank else 'other'} pid {proc.pid}", proc))
    return found


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """``distrain train`` of 2 replica groups, as a user starts it. While it runs: every socket the launcher
    (lighthouse) and the ranks (manager server, peer-state server, gloo) listen on, and each rank's secret."""
    out = tmp_path_factory.mktemp("ft_security") / "run"
    command = ["distrain", "train", "--strategy", "ddp_torchft", "--devices", "1", f"output_dir={out}"]
    command += ["training.max_steps=12", "logging.progress_bar=false", "logging.log_every_n_steps=1"]
    command += ["checkpointing.save_every_n_steps=4"]
    env = env_without_rank()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    launcher = psutil.Process(proc.pid)
    listening: dict[str, set] = {}  # who -> {(ip, port)}
    secrets_seen: set[str] = set()
    command_lines: list[str] = []
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        for who, p in _processes(launcher):
            try:
                sockets = {(c.laddr.ip, c.laddr.port) for c in p.net_connections("inet") if c.status == "LISTEN"}
                environ = p.environ() if who != "launcher" else {}
                command_lines.append(" ".join(p.cmdline()))
            except psutil.Error:
                continue
            listening.setdefault(who, set()).update(sockets)
            if environ.get("DISTRAIN_JOB_SECRET"):
                secrets_seen.add(environ["DISTRAIN_JOB_SECRET"])
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    reader.join(timeout=10)
    return {
        "out": out,
        "code": proc.returncode,
        "output": "".join(output),
        "listening": listening,
        "secrets": secrets_seen,
        "command_lines": command_lines,
    }


@pytest.mark.slow
def test_every_service_of_a_job_listens_on_loopback_only(job):
    """Every socket of every process of the job: the lighthouse (in the launcher), each group's store (in its torchrun
    agent: torchrun's ``--standalone`` listened on '::' twice a group), and in each rank torchft's manager server,
    the peer-state server and gloo's sockets: no one on another machine can join the quorum, stop a group, write
    false addresses into a group's store or read its state."""
    assert job["code"] == 0, job["output"][-3000:]
    listening = job["listening"]
    assert listening.get("launcher"), "the lighthouse was never seen listening"
    agents = [who for who in listening if who.startswith("agent") and listening[who]]
    assert len(agents) == 2, listening  # one per group, each seen holding its group's store
    ranks = [who for who in listening if who.startswith("rank")]
    assert len(ranks) >= 2, listening
    # rank 0 of a group: its manager server and peer-state server at least (and gloo's)
    assert all(len(listening[who]) >= 2 for who in ranks), listening
    loopback = ("127.0.0.1", "::1")
    exposed = {who: sorted(s for s in sockets if s[0] not in loopback) for who, sockets in listening.items()}
    assert not any(exposed.values()), exposed


@pytest.mark.slow
def test_the_job_secret_is_shared_by_the_groups_and_written_or_printed_nowhere(job):
    assert job["code"] == 0, job["output"][-3000:]
    # the groups did hand the state over with it: step 0 starts every group from the first one's weights
    took_over = re.search(r"replica group \d took over the live state of a running group", job["output"])
    assert took_over, job["output"][-3000:]
    assert len(job["secrets"]) == 1, "every rank holds the one secret of the job"
    secret = next(iter(job["secrets"]))
    assert len(secret) >= 32
    assert secret not in job["output"]
    assert not any(secret in line for line in job["command_lines"])  # any user's ps shows argv
    files = [f for f in Path(job["out"]).rglob("*") if f.is_file()]
    assert any(f.name == "config.yaml" for f in files) and any(f.name == "metrics.jsonl" for f in files), files
    assert any(f.name == "state.pt" for f in files), files  # the checkpoints, with the progress and data position
    holding = [str(f) for f in files if secret.encode() in f.read_bytes()]
    assert not holding, holding
