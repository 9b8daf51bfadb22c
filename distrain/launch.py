"""Starting one process per rank on this node.

Three ways, chosen by the strategy name:
- ``popen`` ("ddp"): the user's command is run again once per extra rank, with the env set, and
  this process becomes rank 0 — the same script then works unchanged under torchrun or srun.
- ``spawn`` ("ddp_spawn"): torch.multiprocessing spawns fresh interpreters; the function's result
  and the trained weights come back to the parent.
- ``fork`` ("ddp_fork"): like spawn but forks, so it works for functions defined in a notebook.
When a launcher (torchrun, srun, our own popen) already started the ranks, nothing is launched.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from distrain import distributed
from distrain.cluster import find_free_port, is_loopback_address, is_loopback_host
from distrain.distributed import watch


def _rank_env(rank: int, nprocs: int, node_rank: int, num_nodes: int, addr: str, port: int) -> dict[str, str]:
    env = {
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "RANK": str(node_rank * nprocs + rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nprocs * num_nodes),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "NODE_RANK": str(node_rank),
        "DISTRAIN_LAUNCHED": "1",
    }
    # every rank on this machine: gloo listens on loopback (by default, where the host name resolves: maybe every
    # network the machine is on); a choice of the user's own stands
    loopback = loopback_interface() if is_loopback_host(addr) else None
    if loopback is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = loopback
    return env


def loopback_interface() -> str | None:
    """The name of the interface that holds 127.0.0.1 (gloo is given an interface, not an address)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addresses):
            return name
    return None


def _master(num_nodes: int) -> tuple[str, int]:
    """Where rank 0 listens. One node: any free local port. Several: every node must be told the
    same address and port, so they must come from the environment."""
    if num_nodes > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"num_nodes={num_nodes}: set {', '.join(missing)} on every node (the same MASTER_ADDR/PORT everywhere, "
                "NODE_RANK 0..N-1), or start the job with torchrun/srun"
            )
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", 0)) or find_free_port()


def _command_of_this_process() -> list[str]:
    """The command that started us, so ranks 1..N-1 can run the very same thing."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:  # python -m package.module
        name = spec.name.removesuffix(".__main__")
        return [sys.executable, "-m", name, *sys.argv[1:]]
    script = sys.argv[0]
    if not script or script == "-c" or not os.path.exists(script):
        raise RuntimeError(
            "strategy='ddp' re-runs your script once per rank, but this process was not started from a "
            "script file (interactive shell or notebook?). Use strategy='ddp_fork' or 'ddp_spawn' there."
        )
    return [sys.executable, os.path.abspath(script), *sys.argv[1:]]


class SubprocessLauncher:
    """Rank 0 is this process; ranks 1..N-1 are the same command, started with their env."""

    #: the ranks are this script: ``launch()`` with no function starts the others and makes this process rank 0
    starts_this_script = True

    def __init__(self, nprocs: int, num_nodes: int = 1, node_rank: int = 0):
        self.nprocs = nprocs
        self.num_nodes = num_nodes
        self.node_rank = node_rank
        self.procs: list[subprocess.Popen] = []
        self._started = False
        self._started_at = time.time()  # failure records older than this are an earlier run's
        self._stopping = False  # set before we stop the others ourselves: their exit is not news
        self._report_lock, self._reported = threading.Lock(), False
        #: where each rank's output and failure record go (the Trainer: ``<run dir>/logs``); None: the console
        self.log_dir: str | None = None
        #: what the memory plan says about a rank the kernel killed (``Runtime.explain_out_of_memory``)
        self.explain_memory: Callable[[bool], str] | None = None

    def launch(self, fn: Callable, *args: Any, collect=None, restore=None, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` here, as rank 0 (``collect``/``restore`` bring a spawned rank's state back: this
        process trained it itself)."""
        if not self._started:  # also with one process per node: this process needs its rank env
            self._started_at = time.time()
            self._start_others()
            self._started = True
        try:
            return fn(*args, **kwargs)
        except BaseException as error:
            # a rank that left makes rank 0's collective fail at once: give its exit a moment to show, so the
            # summary names it (and its exit code) rather than rank 0, which only lost its peer
            self._record_exits(wait=2.0 if getattr(error, "peer_left", False) else 0.0)
            self._kill_others()  # they would wait for rank 0 in a collective until the timeout
            summary = failure_summary(self.log_dir, since=self._started_at)
            if summary:  # the first failure may be another rank's: this one's error may be its consequence
                self._report(summary)
                error.distrain_reported = True
            raise

    def _start_others(self) -> None:
        addr, port = _master(self.num_nodes)
        os.environ.update(_rank_env(0, self.nprocs, self.node_rank, self.num_nodes, addr, port))
        if self.nprocs == 1:
            return
        command = _command_of_this_process()
        for local_rank in range(1, self.nprocs):
            env = {**os.environ, **_rank_env(local_rank, self.nprocs, self.node_rank, self.num_nodes, addr, port)}
            output = None
            if self.log_dir is not None:  # the whole output, C libraries' included; the console keeps rank 0's
                rank = self.node_rank * self.nprocs + local_rank
                output = open(rank_log(self.log_dir, rank), "ab")  # noqa: SIM115 (the child owns it)
                env["DISTRAIN_LAUNCHED_CHILD"] = "1"
                # a death in native code (SIGABRT, SIGSEGV) writes every thread's Python stack into the log, where
                # ``last_words`` finds the line that was running; a user's own setting stands
                env.setdefault("PYTHONFAULTHANDLER", "1")
            self.procs.append(
                subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT if output else None)
            )
        atexit.register(self._wait_for_others)
        threading.Thread(target=self._watch_others, daemon=True).start()

    def _watch_others(self) -> None:
        # If another rank dies, rank 0 would wait in its next collective until the timeout.
        # Say which rank failed first, how, and where its output is, and stop the job now.
        while True:
            for local_rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and code != 0 and not self._stopping:
                    self._stopping = True
                    rank = self.node_rank * self.nprocs + local_rank
                    summary = failure_summary(self.log_dir, wait_for=rank, since=self._started_at)
                    # it died without a word: its record, made here or (the same) by rank 0's own failure meanwhile
                    record_exit(self.log_dir, rank, code, since=self._started_at, explain_memory=self.explain_memory)
                    summary = failure_summary(self.log_dir, since=self._started_at) or summary
                    self._report(summary or f"[distrain] rank {rank} {describe_exit(code)}; stopping the other ranks")
                    self._kill_others()
                    os._exit(code if code > 0 else 1)
            if all(p.poll() is not None for p in self.procs):
                return
            time.sleep(0.5)

    def _report(self, summary: str) -> None:
        """The job's failure, once: the watching thread and rank 0's own error may both get here."""
        with self._report_lock:
            if not self._reported:
                self._reported = True
                print(summary, file=sys.stderr, flush=True)

    def _record_exits(self, wait: float) -> None:
        """A failure record for each other rank that already exited with an error and wrote none (killed, or
        ``os._exit``), waiting up to ``wait`` s for one to exit."""
        deadline = time.monotonic() + wait
        while True:
            exited = [(i, p.poll()) for i, p in enumerate(self.procs, start=1) if p.poll() not in (None, 0)]
            if exited or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        for local_rank, code in exited:
            rank = self.node_rank * self.nprocs + local_rank
            record_exit(self.log_dir, rank, code, since=self._started_at, explain_memory=self.explain_memory)

    def _kill_others(self, grace: float = 3.0) -> None:
        """SIGTERM, then SIGKILL whatever still runs after ``grace`` s: a rank that hangs outside
        a collective never acts on SIGTERM (distrain's handler only asks for a stop at the next step). The job has
        failed: no rank can checkpoint with the others any more, so the grace is for a rank to exit and flush its
        log (well under a second), not for a step to end; a hung rank waited out 10 s of it for nothing."""
        self._stopping = True
        alive = [proc for proc in self.procs if proc.poll() is None]
        for proc in alive:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()

    def _wait_for_others(self) -> None:
        for local_rank, proc in enumerate(self.procs, start=1):
            code = proc.wait()
            if code != 0 and not self._stopping:
                print(f"[distrain] rank {local_rank} exited with code {code}", file=sys.stderr, flush=True)


class MultiprocessingLauncher:
    """spawn/fork N workers; rank 0's return value and ``collect()`` payload come back to us."""

    starts_this_script = False  # the ranks run a function, in processes of their own

    def __init__(self, nprocs: int, start_method: str, num_nodes: int = 1, node_rank: int = 0):
        if start_method == "fork" and torch.cuda.is_initialized():
            raise RuntimeError(
                "strategy='ddp_fork' cannot fork once CUDA is initialized in this process; "
                "do not touch CUDA before trainer.fit(), or use strategy='ddp_spawn'"
            )
        self.nprocs = nprocs
        self.start_method = start_method
        self.num_nodes = num_nodes
        self.node_rank = node_rank

    def launch(
        self,
        fn: Callable,
        *args: Any,
        collect: Callable[[], dict] | None = None,
        restore: Callable[[dict], None] | None = None,
        **kwargs: Any,
    ) -> Any:
        if self.start_method == "fork":
            _no_group_across_fork()
        addr, port = _master(self.num_nodes)
        outdir = tempfile.mkdtemp(prefix="distrain-launch-")
        # forked ranks never collect what they inherit (distributed.inherited_never_collected)
        forking = distributed.inherited_never_collected() if self.start_method == "fork" else contextlib.nullcontext()
        try:
            with forking:
                mp.start_processes(
                    _worker,
                    args=(
                        self.start_method,
                        self.nprocs,
                        self.node_rank,
                        self.num_nodes,
                        addr,
                        port,
                        outdir,
                        fn,
                        args,
                        kwargs,
                        collect,
                    ),
                    nprocs=self.nprocs,
                    start_method=self.start_method,
                )
            result_file = Path(outdir) / "result.pkl"
            if not result_file.exists():  # not global rank 0 on this node
                return None
            # Written a moment ago by our own child process, in a private temp dir.
            result = pickle.loads(result_file.read_bytes())
            state_file = Path(outdir) / "state.pt"
            if restore is not None and state_file.exists():
                restore(torch.load(state_file, weights_only=True))
            return result
        finally:
            shutil.rmtree(outdir, ignore_errors=True)


def _no_group_across_fork() -> None:
    """A process group does not survive fork: its gloo worker threads stay behind, so a forked rank that
    inherited it would wait forever on its first collective. An earlier one-process run in this
    session (a notebook) leaves its group of one: close it. A process that is itself a rank of a larger
    group must not fork ranks of its own."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        raise RuntimeError(
            f"strategy='ddp_fork' cannot start ranks from a process that is rank {dist.get_rank()} of a "
            f"{dist.get_world_size()}-process group; use strategy='ddp' (or ddp_spawn) there"
        )
    distributed.shutdown(barrier=False)


def _worker(local_rank, start_method, nprocs, node_rank, num_nodes, addr, port, outdir, fn, args, kwargs, collect):
    if start_method == "fork":
        distributed.in_a_forked_child()
    os.environ.update(_rank_env(local_rank, nprocs, node_rank, num_nodes, addr, port))
    result = fn(*args, **kwargs)
    payload = collect() if collect is not None else None  # on every rank: gathering it may take collectives
    if int(os.environ["RANK"]) == 0:
        if payload is not None:
            torch.save(payload, Path(outdir) / "state.pt")
        (Path(outdir) / "result.pkl").write_bytes(pickle.dumps(result))
    distributed.shutdown()


class ReplicaGroupLauncher:
    """``ddp_torchft``: this process supervises and trains nothing. It starts torchft's lighthouse (unless one is
    given), then one torchrun per replica group running this same command; torchrun restarts a group whose rank died
    (``max_restarts``), and the restarted group rejoins the others. SIGTERM or SIGINT here becomes SIGTERM to every
    rank: each group stops at a step, checkpoints and ends with success (``--resume auto`` goes on). When every
    group has ended this process exits with the worst status, so code after ``fit`` runs only in the groups.

    The groups are on this machine: the lighthouse distrain starts listens on 127.0.0.1 only (it has no
    authentication), and so, with a lighthouse on loopback, do the groups' own servers and gloo's sockets. Each job
    has a secret of its own (``DISTRAIN_JOB_SECRET``), which a group asks of every request for its live state; it is
    passed in the groups' environment only (torchrun's restarts inherit it), never printed or written."""

    starts_this_script = False  # this process supervises: the groups' torchruns run the script

    #: the lighthouse forms a quorum without a group that heartbeats but has not asked to join after this long
    JOIN_TIMEOUT_MS = 10_000
    #: a group whose manager sent no heartbeat for this long is lost: the others go on without it (torchft: 5 s)
    HEARTBEAT_TIMEOUT_MS = 2_000

    def __init__(self, nprocs: int, replica_groups: int, min_replicas: int, lighthouse: str | None, max_restarts: int):
        self.nprocs, self.replica_groups, self.min_replicas = nprocs, replica_groups, min_replicas
        self.lighthouse, self.max_restarts = lighthouse, max_restarts

    def launch(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        import secrets

        from distrain.cluster import JOB_SECRET, LIGHTHOUSE, NUM_REPLICA_GROUPS, REPLICA_GROUP_ID

        os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at INFO
        server, address = None, self.lighthouse
        if address is None:
            from torchft.coordination import LighthouseServer

            # for this machine's groups only: whoever reaches a lighthouse can join the quorum or stop a group
            server = LighthouseServer(
                bind="127.0.0.1:0",
                min_replicas=self.min_replicas,
                join_timeout_ms=self.JOIN_TIMEOUT_MS,
                heartbeat_timeout_ms=self.HEARTBEAT_TIMEOUT_MS,
            )
            address = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"  # address() names the hostname
        secret = secrets.token_urlsafe(32)  # this job's; a group serves its live state only to requests that carry it
        loopback = loopback_interface() if is_loopback_address(address) else None
        python, *command = _command_of_this_process()
        # torchrun, with the stores its agent hosts on loopback (torch's own listen on every interface)
        torchrun = [python, "-m", "distrain.distributed.agent", "--standalone", f"--nproc-per-node={self.nprocs}"]
        torchrun.append(f"--max-restarts={self.max_restarts}")
        print(
            f"distrain: {self.replica_groups} replica groups of {self.nprocs} rank(s), torchft lighthouse at {address}",
            flush=True,
        )
        groups = []
        for group in range(self.replica_groups):
            env = {**os.environ, REPLICA_GROUP_ID: str(group), NUM_REPLICA_GROUPS: str(self.replica_groups)}
            env[LIGHTHOUSE] = address
            env[JOB_SECRET] = secret  # the environment only: not argv (any user's ps shows it), not the run dir
            if loopback is not None:  # gloo listens where the host name resolves (maybe every peer's network)
                env.setdefault("GLOO_SOCKET_IFNAME", loopback)
            # the groups share this machine's cores (torchrun sets no thread count for one rank per group)
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (self.replica_groups * self.nprocs))))
            for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(key, None)  # torchrun sets the group's own
            # a session of its own: a Ctrl-C in the terminal reaches this process only, which tells the groups
            groups.append(subprocess.Popen([*torchrun, *command], env=env, start_new_session=True))

        def forward(signum, frame):
            # SIGTERM to the ranks, not to torchrun: each rank stops at the next step, checkpoints and exits 0, so
            # torchrun ends with success (torchrun itself would end its ranks and exit 1, and a SIGINT would crash them)
            import psutil

            for proc in groups:
                try:
                    ranks = psutil.Process(proc.pid).children()
                except psutil.NoSuchProcess:
                    continue
                for rank in ranks:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        rank.send_signal(signal.SIGTERM)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            codes = [proc.wait() for proc in groups]
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if server is not None:
                server.shutdown()
        failed = [f"group {g}: exit code {c}" for g, c in enumerate(codes) if c != 0]
        if failed:
            print(f"[distrain] replica groups that failed (after their restarts): {'; '.join(failed)}", file=sys.stderr)
        raise SystemExit(max((c for c in codes if c > 0), default=1 if failed else 0))


# ---- each rank's output and failure, kept in <run dir>/logs ------------------------------------------------
def rank_log(log_dir: str, rank: int) -> str:
    os.makedirs(log_dir, exist_ok=True)
    return os.path.join(log_dir, f"rank_{rank}.log")


def tee_output(log_dir: str, rank: int) -> None:
    """Copy what this process prints (Python's stdout and stderr) into ``logs/rank_N.log`` too."""
    path = rank_log(log_dir, rank)
    out, err = sys.stdout, sys.stderr
    if isinstance(out, _Tee):
        if out.path == path:
            return
        out, err = out.stream, getattr(err, "stream", err)  # a forked rank inherits its parent's copy
    log = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)
    sys.stdout, sys.stderr = _Tee(out, log, path), _Tee(err, log, path)


class _Tee:
    def __init__(self, stream, log, path: str):
        self.stream, self.log, self.path = stream, log, path

    def write(self, text: str) -> int:
        self.log.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.log.flush()
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def record_failure(
    log_dir: str | None, rank: int, error: BaseException, explain_memory: Callable[[bool], str] | None = None
) -> None:
    """Write this rank's failure (when, what, where this rank was, the traceback) for the launcher's summary. A
    collective that failed because of other ranks (``CollectiveHangError``) records them as the culprits, and its
    diagnosis; an out-of-memory error, what the memory plan says (``explain_memory``, planned only now)."""
    if log_dir is None:
        return
    import traceback

    lines = str(error).strip().splitlines()
    record = {"time": time.time(), "rank": rank, "type": type(error).__name__, "message": (lines or [""])[0][:500]}
    here = watch.where(rank)
    if here is not None:
        record["where"] = here
    culprits = getattr(error, "culprits", None)
    if culprits is not None:  # this rank only waited
        record["culprits"] = {str(r): where for r, where in culprits.items()}
        record["detail"] = [line[:300] for line in lines[1:40]]
    with open(rank_log(log_dir, rank), "a") as log:
        log.write("".join(traceback.format_exception(error)))
    _write_record(log_dir, rank, record)
    error.distrain_recorded = True
    if explain_memory is not None and out_of_memory(error):  # written again with the plan, which takes seconds
        record["memory"] = error.distrain_memory_plan = explain_memory(False)
        with open(rank_log(log_dir, rank), "a") as log:
            log.write(f"distrain: {record['memory']}\n")
        _write_record(log_dir, rank, record)
        if hasattr(error, "add_note"):  # Python 3.11+: its traceback says it too (a run of one process has no summary)
            error.add_note(f"distrain: {record['memory']}")


def out_of_memory(error: BaseException) -> bool:
    """An allocation that failed: torch's ``OutOfMemoryError``, or an error that says so (a library's on the GPU,
    torch's CPU allocator); not a collective's diagnosis, which may quote a peer's "out of memory?" exit."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    first = (str(error).strip().splitlines() or [""])[0].lower()
    said = "out of memory" in first or "can't allocate memory" in first
    return isinstance(error, RuntimeError) and not hasattr(error, "culprits") and said


def _write_record(log_dir: str, rank: int, record: dict) -> None:
    """Whole or not at all (a summary may read it meanwhile: an out-of-memory record is written twice)."""
    import json

    path = os.path.join(log_dir, f"rank_{rank}.error.json")
    with open(f"{path}.{os.getpid()}.tmp", "w") as f:
        json.dump(record, f)
    os.replace(f.name, path)


#: what an exit code says, as a shell shows a signal's death (128 + N) or Python's Popen (-N)
_SIGNAL_HINTS = {
    signal.SIGKILL: "killed by SIGKILL (out of memory? the kernel's OOM killer sends it)",
    signal.SIGSEGV: "crashed with SIGSEGV (a segmentation fault in native code)",
    signal.SIGABRT: "aborted (SIGABRT: a native library gave up, e.g. NCCL's watchdog)",
    signal.SIGBUS: "crashed with SIGBUS (shared memory full? /dev/shm)",
    signal.SIGTERM: "terminated (SIGTERM) from outside",
}


def describe_exit(code: int) -> str:
    """``137`` → ``exited with code 137: killed by SIGKILL (out of memory? ...)``."""
    number = -code if code < 0 else code - 128 if 128 < code < 160 else None
    try:
        sig = signal.Signals(number) if number else None
    except ValueError:
        sig = None
    if sig is None:
        return f"exited with code {code}"
    return f"exited with code {code}: {_SIGNAL_HINTS.get(sig, f'killed by {sig.name}')}"


_exit_records = threading.Lock()  # the launcher's watching thread and rank 0's own failure may both record an exit


def record_exit(
    log_dir: str | None, rank: int, code: int, since: float, explain_memory: Callable[[bool], str] | None = None
) -> bool:
    """A record for a rank that exited with ``code`` and wrote none of its own since ``since`` (killed, or
    ``os._exit``): where it was (its last progress mark, from the store) and, for a SIGKILL (the kernel's OOM
    killer), what the memory plan says (``explain_memory``). False when it had written one, or there is nowhere to
    write."""
    with _exit_records:
        if log_dir is None or _written_since(os.path.join(log_dir, f"rank_{rank}.error.json"), since):
            return False
        record = {"time": time.time(), "rank": rank, "type": "exit", "message": describe_exit(code)}
        where = watch.where(rank)
        if where is not None:
            record["where"] = where
        if explain_memory is not None and code in (-signal.SIGKILL, 128 + signal.SIGKILL):
            record["memory"] = explain_memory(True)  # the host's memory ran out
        said = last_words(rank_log(log_dir, rank))
        if said:
            record["said"] = said
        os.makedirs(log_dir, exist_ok=True)
        _write_record(log_dir, rank, record)
        return True


#: how much of a log's end ``last_words`` reads: a native library's message and a stack dump fit in it
_LAST_BYTES = 16384


def last_words(log_path: str) -> list[str]:
    """What a rank that died without a Python exception last wrote, from its log's end: a native library's message
    (C++'s ``terminate called after throwing ...`` and its ``what():``, Python's ``Fatal Python error: ...``) and,
    from the stack ``faulthandler`` dumped of the thread that died, its innermost frame and the innermost one of the
    user's code. At most 4 lines, each cut to 300 characters; none where the log holds none (a SIGKILL says
    nothing)."""
    from distrain.distributed.watch import library_frame

    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - _LAST_BYTES))
            text = f.read(_LAST_BYTES).decode("utf-8", "replace")
    except OSError:
        return []
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines()]
    said = [line for line in lines if line.startswith(("terminate called", "what():", "Fatal Python error:"))][-2:]
    dumped = [i for i, line in enumerate(lines) if line.startswith("Current thread")]
    if dumped:  # the last dump; its frames run innermost first until the next blank line or thread
        frames = []
        for line in lines[dumped[-1] + 1 :]:
            if not line.startswith("File "):
                break
            frames.append(line)
        users = [f for f in frames[1:] if not library_frame(f)]
        said += frames[:1] + users[:1]
    return ["".join(c if c.isprintable() else "?" for c in line)[:300] for line in said]


def _written_since(path: str, since: float) -> bool:
    try:
        return os.path.getmtime(path) >= since
    except OSError:
        return False


def failure_summary(log_dir: str | None, wait_for: int | None = None, since: float = 0.0) -> str | None:
    """Which rank failed first, how, and where its whole output is; the later failures (often the
    consequence of the first: a peer that left) in one line each. Records an earlier run left in the same
    directory (a resumed run's: older than ``since``, when this run started) are not this run's."""
    if log_dir is None:
        return None
    import json

    expected = os.path.join(log_dir, f"rank_{wait_for}.error.json") if wait_for is not None else None
    deadline = time.monotonic() + 3.0  # a dying rank writes its record just before it exits
    while expected is not None and not _written_since(expected, since) and time.monotonic() < deadline:
        time.sleep(0.1)
    records = []
    for name in os.listdir(log_dir) if os.path.isdir(log_dir) else []:
        if name.endswith(".error.json"):
            try:
                with open(os.path.join(log_dir, name)) as f:
                    record = json.load(f)
            except (OSError, ValueError):
                continue
            if record.get("time", 0) >= since:
                records.append(record)
    if not records:
        return None
    records.sort(key=lambda r: r["time"])
    # the culprit: the first rank that failed on its own (an exception, a death); a rank whose collective failed
    # because of others only waited — when every record is such, the ranks they name are the culprits
    own = [r for r in records if "culprits" not in r]
    waited = [r for r in records if "culprits" in r]
    culprits = {int(k): w for r in waited for k, w in r["culprits"].items()}
    if own:
        first = own[0]
        where = first.get("where") or culprits.get(first["rank"])  # its own mark, else where the others saw it
        memory = f"; {first['memory']}" if first.get("memory") else ""  # one line: the console's first
        lines = [
            f"[distrain] rank {first['rank']} failed first{f' at {where}' if where else ''}: "
            + (first["message"] if first["type"] == "exit" else f"{first['type']}: {first['message']}")
            + memory,
            *(f"[distrain]   it said: {line}" for line in first.get("said", [])),
            f"[distrain]   its whole output and traceback: {rank_log(log_dir, first['rank'])}",
        ]
        others = [r for r in records if r is not first]
    else:
        first = waited[0]
        stuck = ", ".join(f"rank {r} at {w}" for r, w in sorted(culprits.items())) or "no rank"
        lines = [f"[distrain] {stuck}: did not arrive in a collective that rank {first['rank']} waited in"]
        lines += [f"[distrain] {line.rstrip()}" for line in first.get("detail", []) if not line.strip().startswith("(")]
        lines += [f"[distrain]   output: {', '.join(rank_log(log_dir, r) for r in sorted(culprits))}"]
        others = waited
    for r in others:
        consequence = " (it waited for the ranks above)" if "culprits" in r else ""
        lines.append(f"[distrain]   then rank {r['rank']}: {r['type']}: {r['message'][:160]}{consequence}")
    return "\n".join(lines)
