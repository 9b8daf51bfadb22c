"""`distrain doctor`: a passing rank check with bandwidth figures, and an explained failure."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest


def doctor(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "distrain.cli", "doctor", *args], capture_output=True, text=True, timeout=180, env=env
    )


def test_report_without_ranks():
    proc = doctor()
    assert proc.returncode == 0, proc.stderr
    assert "torch" in proc.stdout and "process-group backends: gloo" in proc.stdout and "no rank check" in proc.stdout


@pytest.mark.slow
def test_doctor_devices_2_all_reduce_and_bandwidth(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    proc = doctor("--devices", "2", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "all-reduce across 2 ranks (gloo): OK" in proc.stdout
    rows = re.findall(r"(\d+ [KM]iB) \|\s+(\d+)us \|\s+[\d.]+ \|\s+([\d.]+) \|", proc.stdout)
    assert [size for size, _, _ in rows] == ["1 KiB", "64 KiB", "1 MiB", "16 MiB"]
    assert float(rows[-1][2]) > 0
    # kept for the planner's step times: the largest message's bus bandwidth, the smallest one's time
    links = json.loads((tmp_path / "distrain" / "links.json").read_text())
    assert links["backend"] == "gloo" and links["world"] == 2
    assert links["bus_bandwidth"] == pytest.approx(float(rows[-1][2]) * 1e9, rel=0.01)
    assert links["latency"] == pytest.approx(int(rows[0][1]) / 1e6, abs=1e-6)
    plan = subprocess.run(
        [sys.executable, "-m", "distrain.cli", "plan", "--devices", "2", "--accelerator", "cpu", "--json"]
        + ["--model-name", "gpt-tiny"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert plan.returncode == 0, plan.stderr
    assert "links: distrain doctor" in json.loads(plan.stdout)["rates"]


@pytest.mark.slow
def test_port_in_use_is_explained_and_nothing_hangs():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(busy.getsockname()[1])}
        proc = doctor("--devices", "2", "--timeout", "20", env=env)
    assert proc.returncode == 1
    assert "FAILED on rank 0" in proc.stderr and "already in use" in proc.stderr


@pytest.mark.slow
def test_wrong_interface_is_explained():
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["GLOO_SOCKET_IFNAME"] = "nosuch0"  # a typo'd interface: gloo cannot create its device
    proc = doctor("--devices", "2", "--timeout", "20", env=env)
    assert proc.returncode == 1
    assert "FAILED on rank 0" in proc.stderr and "Unable to find address for: nosuch0" in proc.stderr
    assert "likely cause: wrong interface: GLOO_SOCKET_IFNAME=nosuch0 names no usable network interface" in proc.stderr
    assert "(it has: lo" in proc.stderr  # the interfaces to choose from
