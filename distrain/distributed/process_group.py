"""Starting and ending the default process group.

Start: ``init_process_group`` waits ``timeout`` for every rank (generous: nodes come up at
different times), then gives steady-state collectives the tight ``collective_timeout`` and starts
the hang watch (``watch.py``). End: ``shutdown`` is the one teardown path, used by the strategies,
the launchers' workers and at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distrain.distributed import watch


def init_process_group(
    backend: str,
    timeout: timedelta,
    collective_timeout: timedelta | None,
    device: torch.device | None = None,
    flight_recorder_dir: str | None = None,
) -> None:
    """Join (or, started by nobody, create) the default group from the standard env variables.
    A group that already exists is kept; only its collective timeout is set."""
    if not dist.is_initialized():
        kwargs = {}
        if "RANK" in os.environ:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        else:  # one process, started by nobody: a group of one with a store of its own, and the env left as
            rank, world = 0, 1  # it was (a later run in this process, ddp_spawn in a notebook, starts clean)
            kwargs["store"] = dist.HashStore()
        if "nccl" in backend:
            kwargs["device_id"] = device  # eager NCCL init: errors surface here, not mid-step
            watch.enable_nccl_flight_recorder(flight_recorder_dir)
        if "store" not in kwargs:
            kwargs["store"] = _key_space_of_a_new_group(rank, world, timeout)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
        watch.start(rank, world, timeout)
        # No barrier at exit: a peer that crashed must not make the survivors hang.
        atexit.register(shutdown, barrier=False)
    if watch.active() is not None:  # a group distrain started (now, or for an earlier strategy)
        watch.active().set_collective_timeout(collective_timeout or timeout)


def decide_before_strategy(decide: Callable[[], Any], accelerator: str, backend: str | None, timeout: timedelta) -> Any:
    """``decide()`` once for all the ranks an outside launcher started (torchrun, srun, mpirun), before the
    strategy exists — what ``strategy: auto`` becomes is such a decision. Every rank deciding on its own
    costs each the whole plan and lets them disagree (one rank's planner fails, it falls back alone); so
    the default group starts now, rank 0 decides, and every rank takes its decision or its error. The
    strategy keeps this group. On GPUs it carries gloo beside NCCL: whichever strategy is chosen finds
    what it needs (FSDP's CPU offload reduces on the host). Elsewhere (one process, or distrain's own
    launcher, whose ranks inherit the decision) ``decide()`` just runs."""
    from distrain.accelerators import resolve_accelerator
    from distrain.cluster import detect_cluster, export_cluster_env
    from distrain.distributed.collectives import decided_on_rank_zero

    cluster = detect_cluster()
    if cluster.source in ("local", "distrain", "kubeflow") or cluster.world_size == 1:
        return decide()
    export_cluster_env(cluster)
    device_kind = resolve_accelerator(accelerator)
    device = device_kind.device(cluster.local_rank)
    device_kind.setup_device(device)
    backend = backend or ("cpu:gloo,cuda:nccl" if device_kind.name == "cuda" else device_kind.backend)
    init_process_group(backend, timeout, None, device=device)
    return decided_on_rank_zero(decide)


def shutdown(barrier: bool = True) -> None:
    """Tear the process group down while the interpreter is fully alive.

    A DDP/FSDP wrapper caught in a reference cycle (module ↔ trainer) keeps gloo's worker threads
    alive until interpreter finalization, where destroying them aborts the process ("terminate
    called without an active exception") after a successful run. Collect such cycles first, then
    destroy the group; the barrier keeps rank 0 (the store host) from leaving while a peer still
    talks to it.

    A group something still holds (a live wrapper; at a program's exit the objects are frozen, not collected:
    ``end_fast_at_exit``) keeps its threads past ``destroy_process_group``, which does not join them. Such a thread
    ends a finished collective a moment after the caller's wait returned, and that releases the collective's tensors:
    it takes the GIL. Taken during interpreter finalization, that aborted a 2-node run's rank after its success (1 run
    in 15; torch issue 190489). So the interpreter waits a moment here, alive, without the GIL."""
    gc.collect()
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
        watch.stop()
        time.sleep(_THREADS_SETTLE)
    gc.collect()


@contextlib.contextmanager
def inherited_never_collected():
    """Fork inside this: the child never collects what it inherited. A forked child gets this process's objects but
    not its threads; garbage still waiting here (a DDP model of an earlier run in a reference cycle, whose Reducer
    holds a live gloo group) collected in the child would run the group's destructor there, which waits for threads
    that exist only here: forever. So everything is frozen (``gc.freeze``, as Python's docs advise before a fork)
    while the child is forked, and unfrozen after, here only: the child keeps its copy frozen, and this process
    collects its garbage where the threads are. A process that had frozen objects of its own keeps them so."""
    ours = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        yield
    finally:
        if ours:
            gc.unfreeze()


def in_a_forked_child() -> None:
    """The first call in a child this process forked (a ``ddp_fork`` rank, a planner simulation), while its one thread
    is the only one: the child computes on one CPU thread. torch's CPU threads are GNU OpenMP's, which cannot run a
    parallel region in a process forked after its parent ran one: the child waits forever for workers that exist only
    in the parent (a notebook has always computed something before its ``fit``). Set here, first, it also replaces
    torch's inherited thread pool on this thread; left to the first threads that ask for it (the autograd engine's
    start together), one of them read the pool while another was replacing it, and the child aborted ("Invalid
    thread pool!")."""
    torch.set_num_threads(1)


#: how long a process gives the threads of the group it ended to release their last collective (they wait for
#: the GIL only; a sleep hands it over)
_THREADS_SETTLE = 0.1


def _key_space_of_a_new_group(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """The rendezvous keys of the group this process starts now, apart from every earlier group's of the same job.

    One job can start several groups: ``verify`` and then ``fit`` in one script, two fits, a torchrun restart. Each
    group's ranks publish their gloo/NCCL addresses under the same names, and no barrier ends a group (a crashed peer
    must not hang the others): a rank that is quick to start the next group could read a peer's address of the last
    one, or join a store that peer is about to close and reopen on the same port. Both hung, now and then, a
    ``verify`` followed by a ``fit``. So the job's store is opened once per process and kept (its host keeps the
    port), and each group gets keys of its own: the restart of the job (torchrun's) and how many groups this
    process started, which every rank counts alike, as the ranks run the same script."""
    global _job_store, _groups_started
    address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world, os.getpid())
    if _job_store is None or _job_store[0] != address:
        # torchrun's agent keeps the job's store itself (its ranks are clients); elsewhere rank 0 hosts it
        hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0
        listener = narrow_listener(address[0], address[1]) if hosts else None
        store = dist.TCPStore(
            address[0],
            address[1],
            world,
            is_master=hosts,
            timeout=timeout,
            master_listen_fd=None if listener is None else listener.fileno(),
        )
        _job_store, _groups_started = (address, store, listener), 0
    _groups_started += 1
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"distrain/attempt{attempt}/group{_groups_started}", _job_store[1])


def narrow_listener(host: str, port: int) -> socket.socket | None:
    """Where the store listens: on the address ``MASTER_ADDR`` names, where that is this machine's. Given a host,
    torch's store still listens on every interface, and it answers whoever connects (it has no authentication):
    anyone on the network could read the ranks' addresses or write false ones. So a job on one machine (a loopback
    ``MASTER_ADDR``) listens on loopback only, and a job across machines on the address its peers were given.
    Torch's default stays where the address is not one this machine can listen on (a Kubernetes service's, a
    NAT's) and where a name resolves here to a loopback address (Debian maps the host name to 127.0.1.1, which the
    peers never reach)."""
    import ipaddress

    from distrain.cluster import is_loopback_host

    if is_loopback_host(host):
        host = "127.0.0.1" if host == "localhost" else host  # (a client tries each address "localhost" names)
        return socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=128
        )
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    if any(ipaddress.ip_address(address[0].split("%")[0]).is_loopback for *_, address in found):
        return None
    for family, *_, address in found:
        try:
            return socket.create_server(address[:2], family=family, backlog=128)
        except OSError:  # not an address of this machine
            continue
    return None


#: the job's rendezvous store, opened by the first group this process started (and where it is; and the socket it
#: listens on, when this process made it), kept for the next
_job_store: tuple[tuple, dist.Store, socket.socket | None] | None = None
#: how many groups this process started on that store
_groups_started = 0
