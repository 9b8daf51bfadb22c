"""``distrain doctor``: what this machine and job look like, and whether the ranks can talk.

Without ranks it prints versions, devices, the launcher variables and the backends. Under a
launcher, or with ``--devices N``, every rank also runs an all-reduce check and a bandwidth test;
a failure is explained by its most likely cause.
"""

from __future__ import annotations

import ipaddress
import os
import platform
import re
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

ENV_PREFIXES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "OMPI_COMM_WORLD_",
    "PMI_",
    "NCCL_",
    "GLOO_",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
)
SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 24)


def environment_report() -> str:
    from distrain._version import __version__
    from distrain.cluster import detect_cluster

    lines = [
        f"distrain {__version__}, torch {torch.__version__}, "
        f"Python {platform.python_version()} on {platform.platform()}"
    ]
    lines.append(f"CPU cores: {os.cpu_count()}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB")
    else:
        lines.append("CUDA: not available (training runs on CPU with gloo)")
    backends = [
        name
        for name, ok in (
            ("gloo", dist.is_gloo_available()),
            ("nccl", dist.is_nccl_available()),
            ("mpi", dist.is_mpi_available()),
        )
        if ok
    ]
    lines.append(f"process-group backends: {', '.join(backends) or 'none'}")
    try:
        cluster = detect_cluster()
        lines.append(
            f"launcher: {cluster.source} (rank {cluster.rank} of {cluster.world_size}, node {cluster.node_rank})"
        )
    except ValueError as e:
        lines.append(f"launcher: misconfigured: {e}")
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    lines.append("environment: " + (", ".join(f"{k}={v}" for k, v in env.items()) or "no launcher variables set"))
    return "\n".join(lines)


def likely_cause(error: BaseException) -> str:
    """The usual reasons ranks cannot meet, matched on what torch/gloo/NCCL say."""
    text = f"{type(error).__name__}: {error}".lower()
    port = os.environ.get("MASTER_PORT", "?")
    addr = os.environ.get("MASTER_ADDR", "?")
    if "address already in use" in text or "eaddrinuse" in text:
        return f"port {port} on {addr} is already in use: pick another MASTER_PORT (or stop the old job)"
    interfaces = ", ".join(name for _, name in socket.if_nameindex())
    if "unable to find address for" in text or "no socket interface found" in text:
        chosen = ", ".join(
            f"{k}={os.environ[k]}" for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k in os.environ
        )
        return (
            f"wrong interface: {chosen or 'the socket interface setting'} names no usable network interface on "
            f"this host (it has: {interfaces}); set it to the interface the nodes share"
        )
    if _LOOPBACK_PEER.search(text) and not _is_loopback(addr):
        return (
            f"wrong interface: a rank told its peers a loopback address (127.x) although MASTER_ADDR is {addr}: "
            "its hostname resolves to loopback, so gloo/NCCL picked `lo`. Set GLOO_SOCKET_IFNAME (NCCL: "
            f"NCCL_SOCKET_IFNAME) on every node to the interface the nodes share (this host has: {interfaces})"
        )
    if "timed out" in text or "timeout" in text:
        return (
            f"the ranks did not all arrive at {addr}:{port}: a rank did not start, MASTER_ADDR is unreachable "
            "from some node (firewall, wrong address), or the world size is larger than the ranks started"
        )
    if "connection refused" in text or "no route" in text or "unreachable" in text:
        return (
            f"nothing answers at {addr}:{port}: rank 0 is not running there, or the address is wrong; on a "
            "multi-homed host set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface the nodes share"
        )
    if "world_size" in text or "world size" in text or "num_nodes" in text:
        return "the launcher's world size and --num-nodes × --devices disagree (see the numbers above)"
    return "see the error above"


_LOOPBACK_PEER = re.compile(r"remote=\[?(127\.\d+\.\d+\.\d+|::1)\]?")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _check(runtime) -> dict:
    """In every rank: one exact all-reduce, then timed all-reduces by message size."""
    device = runtime.device
    world = runtime.world_size
    total = runtime.all_reduce(torch.tensor([float(runtime.global_rank)], device=device), op="sum")
    ok = int(total.item()) == world * (world - 1) // 2
    warm = torch.ones(256, device=device)
    for _ in range(200):  # the first ~100 ms after start-up run several times slower (measured on gloo)
        dist.all_reduce(warm)
    rows = []
    for size in SIZES:
        t = torch.ones(size // 4, dtype=torch.float32, device=device)
        iters = max(5, min(100, (1 << 27) // size))
        for _ in range(5):  # and the first of a new size
            dist.all_reduce(t)
        # Each op timed alone; the median is the figure. On a shared or virtual machine some ops
        # wait for the scheduler (a 4 ms tick at HZ=250: see p90), and a mean is mostly those.
        times = []
        for _ in range(iters):
            runtime.accelerator.synchronize(device)
            start = time.perf_counter()
            dist.all_reduce(t)
            runtime.accelerator.synchronize(device)
            times.append(time.perf_counter() - start)
        median, p90 = statistics.median(times), statistics.quantiles(times, n=10)[-1]
        algbw = size / median / 1e9
        rows.append((size, median * 1e6, algbw, algbw * 2 * (world - 1) / world, p90 * 1e6))
    runtime.barrier()
    return {"ok": ok, "sum": float(total.item()), "world": world, "rows": rows}


def run(devices, num_nodes: int, timeout_s: float) -> int:
    from distrain.cluster import detect_cluster
    from distrain.runtime import Runtime

    cluster = detect_cluster()
    if not cluster.launched_externally and devices is None:
        print(environment_report())
        print("\n(no rank check: run under a launcher, or with --devices N)")
        return 0
    try:
        runtime = Runtime(
            accelerator="auto",
            strategy="ddp",
            devices=devices or "auto",
            num_nodes=num_nodes,
            timeout=timedelta(seconds=timeout_s),
        )
        result = runtime.launch(_check)
    except Exception as e:  # noqa: BLE001 — every failure gets an explanation
        print(
            f"distrain doctor: the rank check FAILED on rank {os.environ.get('RANK', '?')}: {type(e).__name__}: {e}",
            file=sys.stderr,
        )
        print(f"likely cause: {likely_cause(e)}", file=sys.stderr)
        return 1
    if runtime.is_global_zero:
        print(environment_report())
        status = (
            "OK"
            if result["ok"]
            else f"WRONG (sum {result['sum']}, expected {result['world'] * (result['world'] - 1) // 2})"
        )
        print(f"\nall-reduce across {result['world']} ranks ({runtime.strategy.backend}): {status}")
        print(f"\n{'size':>8} | {'time/op':>10} | {'algbw GB/s':>10} | {'busbw GB/s':>10} | {'p90 time':>10}")
        for size, us, algbw, busbw, p90 in result["rows"]:
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            print(f"{label:>8} | {us:>8.0f}us | {algbw:>10.3f} | {busbw:>10.3f} | {p90:>8.0f}us")
        print("(time/op: the median of single all-reduces; p90: 1 in 10 took longer)")
        if result["ok"] and result["world"] > 1:  # `distrain plan` times collectives with these links
            from distrain.planner.timing import save_measured_links

            largest, smallest = result["rows"][-1], result["rows"][0]
            saved = save_measured_links(runtime.strategy.backend, result["world"], largest[3] * 1e9, smallest[1] / 1e6)
            if saved:
                print(f"(kept for `distrain plan`'s step times: {saved})")
    return 0 if result["ok"] else 1
