"""Time per optimizer step of each option: the traced work on the device's rates, plus the bytes the
option communicates over the links between ranks.

- Compute: each traced operation of forward, backward (activation checkpointing's recomputation
  included) and the optimizer step costs its FLOPs at the matmul rate, or its bytes at the memory
  bandwidth, plus a fixed cost per operation (``work.py``). Sharded optimizer state steps 1/N of
  the bytes.
- Communication (ring algorithms, per rank, as nccl-tests reports bus bandwidth): an all-reduce of S
  bytes moves 2(N-1)/N·S, an all-gather or reduce-scatter (N-1)/N·S. What each option sends per
  step is in ``collectives``; each collective also pays a fixed latency, and FSDP and DeepSpeed copy
  their tensors into and out of flat buffers on the way (memory traffic, counted with compute).
- On a GPU, NCCL runs beside compute: the step takes the longer of the two, plus the collectives
  that cannot overlap (the first all-gather, the last reduction). On a CPU, gloo's copies take the
  same cores as compute: the two add up.

The rates come from this machine (measured in two to three seconds: one large matmul, one large add,
a tiny op, and gloo all-reduces between threads, idle and between matmuls; a plan takes them as measured once
per machine and kept, ``machine.py``), from ``distrain doctor``'s
measurement, or, for a GPU plan, from the table below (listed peaks × the efficiencies stated in docs/plan.md, "Time").
Tensor parallelism's collectives, which the next computation waits for, take the figures measured between
matmuls: on a CPU gloo's threads then wait for cores the ranks' compute holds.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch

from distrain.planner import kept

#: what a GPU achieves of its listed rates in a training step, fitted to runs others measured and published
#: (docs/plan.md, "Against published runs"; ``benchmarks/plan_published.py``, which prints the table). Matmuls: 0.6
#: of the listed peak, fitted on llm-foundry's H100 runs (MPT-1B to 70B at 2k to 32k tokens, FSDP on 8 to 128
#: GPUs); a large bf16 GEMM alone reaches 0.8 (788-798 TFLOP/s measured on an H200), a whole step's matmuls less
#: (smaller GEMMs, clocks under sustained power). Memory: 0.7 of the listed bandwidth
MATMUL_EFFICIENCY = 0.6
MEMORY_EFFICIENCY = 0.7
#: a GPU whose published runs show another matmul efficiency. A100: 0.75, fitted on torchtitan's five A100 runs
#: (Llama 2 13B and 70B, Llama 3 8B and 70B, FSDP on 64 GPUs; their mean plan / published is 1.0 at 0.74-0.75);
#: cuBLAS's large bf16 GEMMs run at about 0.8 of its 312 TFLOP/s. Held out: llm-foundry's A100 runs and
#: Megatron-LM's 22B run (another source each). H200: 0.8, not fitted to a run: the rate a lone 8192³ bf16 GEMM
#: reaches on one (788-798 TFLOP/s measured, issue 57), which a step's matmuls cannot beat. At the H100's 0.6 every
#: H200 run planned 9-22% slow (torchtitan's community runs and distrain's own on one H200); at 0.8 they plan at
#: 0.88-1.02, none fitted. The H100's constant comes from 2023's software and, for torchtitan's rows, 500-W H100s;
#: the H200 rows from 2025-26's software on 700-W parts: which of the two makes the difference, no run tells apart
MATMUL_EFFICIENCY_BY_GPU = {"A100": 0.75, "H200": 0.8}
#: the fused attention kernels' rate, a share of the listed peak: 0.36, fitted on llm-foundry's 32k-token H100 runs,
#: where attention is half the FLOPs and which planned 23-25% fast at the matmuls' rate; FlashAttention-3's paper
#: (Shah et al. 2024, arXiv 2407.08608) measures FlashAttention-2 at about 35% of an H100's peak
ATTENTION_EFFICIENCY = 0.36
#: a GPU the attention kernels were written for. A100: 0.65, from FlashAttention-2's paper (Dao 2023, arXiv
#: 2307.08691: up to 73% of an A100's peak forward and 63% backward at head dimension 128; the backward is 2.5 times
#: the forward's FLOPs). Not fitted to any run: llm-foundry's 32k-token A100 runs are held out
ATTENTION_EFFICIENCY_BY_GPU = {"A100": 0.65}
#: a GPU's dense bf16 tensor-core peak (FLOP/s), memory bandwidth (B/s), and the NCCL all-reduce bus
#: bandwidth between the GPUs of one node (B/s, measured by nccl-tests on NVLink/PCIe systems)
GPU_TABLE = {
    "H200": (989e12, 4.8e12, 360e9),
    "H100": (989e12, 3.35e12, 360e9),
    "A100": (312e12, 2.0e12, 230e9),
    "L40S": (362e12, 0.86e12, 20e9),
    "A10G": (125e12, 0.6e12, 20e9),
    "L4": (121e12, 0.3e12, 20e9),
    "V100": (125e12, 0.9e12, 130e9),
    "T4": (65e12, 0.32e12, 10e9),
}
DEFAULT_GPU = "H100"
#: GPUs with float8 tensor cores (Ada, Hopper): their dense float8 peak is twice their dense bf16 one (NVIDIA's
#: datasheets: H100 SXM 1,979 against 989 TFLOP/s). A float8 matmul is planned at the bf16 matmuls' share of that
#: peak, with no constant of its own: checked on torchtitan's float8 runs (``TH3``, ``TH6``: +32% and +31% planned
#: against +28% and +29% published over the same compiled bf16 runs, docs/plan.md)
FLOAT8_GPUS = ("H200", "H100", "L40S", "L4")
#: between nodes (B/s per GPU): 400 Gb/s InfiniBand or RoCE per GPU, at 80%
DEFAULT_INTER_NODE = 40e9
#: device ↔ host (offload): PCIe gen4/5 x16 as achieved
HOST_LINK = 20e9
#: bytes/s a rank's optimizer step moves in host memory when its state is offloaded (DeepSpeed's CPU Adam)
HOST_OPTIMIZER_BANDWIDTH = 10e9
GPU_COLLECTIVE_LATENCY = 20e-6
GPU_OP_SECONDS = 4e-6  # a kernel launch: what a step of many tiny kernels is bound by
#: where ``distrain doctor`` keeps the links it measured; None: ``$XDG_CACHE_HOME/distrain/links.json``, the
#: variable read when the file is (a process that set it after importing distrain gets its own)
MEASURED_FILE: Path | None = None


def measured_file() -> Path:
    if MEASURED_FILE is not None:
        return MEASURED_FILE
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "distrain" / "links.json"


@dataclass(frozen=True)
class Hardware:
    """Rates of one rank and of the links between ranks."""

    matmul_flops: float
    memory_bandwidth: float
    op_seconds: float
    intra_bandwidth: float
    """All-reduce bus bandwidth between the ranks of one node (B/s)."""
    inter_bandwidth: float
    """Between nodes."""
    collective_seconds: float
    host_bandwidth: float = HOST_LINK
    blocking_collective_seconds: float | None = None
    blocking_bandwidth: float | None = None
    """Latency and bus bandwidth of a collective that the next computation waits for (tensor parallelism's),
    measured with the ranks computing in between: on a CPU gloo's threads then wait for cores that compute
    holds (milliseconds per call, against a tenth of one between idle ranks). None: the idle figures."""
    attention_flops: float | None = None
    """The fused attention kernels' rate (FLOP/s); None: the matmuls' (a CPU's kernel is its matmuls)."""
    float8_flops: float | None = None
    """The float8 matmuls' rate (FLOP/s); None: the matmuls' (a device without float8 tensor cores)."""
    overlap: bool = False
    """Communication runs beside compute (GPU) instead of taking its cores (CPU)."""
    element_seconds: float = 0.0
    softmax_element_seconds: float = 0.0
    """Seconds per element of an operation that computes per element (tanh, dropout's random numbers) and of a
    softmax, beyond its memory pass (its bytes are counted as any operation's): a CPU core's, measured. 0 on a GPU,
    where they run at memory speed."""
    source: str = ""


# ---- the rates ----------------------------------------------------------------------------------------
def gpu_hardware(name: str | None, precision: str) -> Hardware:
    """A GPU's listed rates × the stated efficiencies. fp32 matmuls run as TF32 at half the bf16 rate."""
    key = next((k for k in GPU_TABLE if name and k.lower() in name.lower()), None)
    if name and key is None:
        raise ValueError(f"--gpu-type {name!r} is not in the planner's table; choose from {', '.join(GPU_TABLE)}")
    key = key or DEFAULT_GPU
    flops, memory, nvlink = GPU_TABLE[key]
    if precision in ("32-true", "32", "64-true"):
        flops /= 2
    if precision == "fp8" and key not in FLOAT8_GPUS:
        raise ValueError(
            f"precision='fp8' needs float8 tensor cores, which the {key} lacks ({', '.join(FLOAT8_GPUS)} have "
            "them): plan it with --precision bf16-mixed"
        )
    matmul = MATMUL_EFFICIENCY_BY_GPU.get(key, MATMUL_EFFICIENCY)
    return Hardware(
        matmul_flops=flops * matmul,
        float8_flops=2 * flops * matmul if key in FLOAT8_GPUS else None,
        attention_flops=flops * ATTENTION_EFFICIENCY_BY_GPU.get(key, ATTENTION_EFFICIENCY),
        memory_bandwidth=memory * MEMORY_EFFICIENCY,
        op_seconds=GPU_OP_SECONDS,
        intra_bandwidth=nvlink,
        inter_bandwidth=DEFAULT_INTER_NODE,
        collective_seconds=GPU_COLLECTIVE_LATENCY,
        overlap=True,
        source=f"{key} (listed peaks × {matmul} matmul, {MEMORY_EFFICIENCY} memory)",
    )


def cpu_hardware(ranks_per_node: int) -> Hardware:
    """This CPU's rates with the threads each rank gets, all ranks busy at once (as in training);
    the link: gloo all-reduces between ``ranks_per_node`` threads of this process."""
    cores = os.cpu_count() or 1
    threads = _threads_per_rank(ranks_per_node)
    # the ranks of a node run at once and share the cores' caches and memory bandwidth: each measurement
    # runs as that many copies side by side (threads of this process: torch releases the GIL in its
    # kernels), and ranks beyond the cores share them in time
    copies, share = min(ranks_per_node, cores), min(1.0, cores / max(1, ranks_per_node))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = _matmul_flops(copies, share)
        n = 1 << 23
        x, y, outs = torch.randn(n), torch.randn(n), [torch.empty(n) for _ in range(copies)]
        memory = 3 * 4 * n / _side_by_side(lambda out: torch.add(x, y, out=out), copies, outs) * share
        # per element beyond the memory pass (4 bytes read, 4 written), which the bytes already count; at least a
        # picosecond (a kept figure is positive)
        wide, memory_pass = torch.randn(1024, 8192), 8 / memory  # a 32 MB activation; rows as long as a vocabulary
        element = _side_by_side(lambda _: torch.tanh(wide), copies) / wide.numel() / share - memory_pass
        softmax = _side_by_side(lambda _: torch.log_softmax(wide, -1), copies) / wide.numel() / share - memory_pass
        element, softmax = max(1e-12, element), max(1e-12, softmax)
        # a tiny op's cost is the interpreter's and the dispatcher's: alone (side by side, threads would wait
        # for each other's GIL, which separate rank processes do not)
        tiny = torch.ones(4)
        op = _best(lambda: [tiny.add(1) for _ in range(200)]) / 200 / share
        bandwidth, latency, blocking, blocking_bandwidth = gloo_allreduce(min(max(2, ranks_per_node), 4))
    finally:
        torch.set_num_threads(previous)
    return Hardware(
        matmul_flops=flops,
        memory_bandwidth=memory,
        op_seconds=op,
        intra_bandwidth=bandwidth,
        inter_bandwidth=bandwidth,
        collective_seconds=latency,
        blocking_collective_seconds=blocking,
        blocking_bandwidth=blocking_bandwidth,
        element_seconds=element,
        softmax_element_seconds=softmax,
        source=cpu_source(ranks_per_node),
    )


def cpu_matmul_flops(ranks_per_node: int) -> float:
    """This CPU's matmul rate alone, measured as ``cpu_hardware`` measures it, best of 3 (a tenth of a second on 2
    cores): what a plan checks its kept rates against."""
    cores = os.cpu_count() or 1
    previous = torch.get_num_threads()
    torch.set_num_threads(_threads_per_rank(ranks_per_node))
    try:
        return _matmul_flops(min(ranks_per_node, cores), min(1.0, cores / max(1, ranks_per_node)), repeats=3)
    finally:
        torch.set_num_threads(previous)


def _matmul_flops(copies: int, share: float, repeats: int = 5) -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return 2 * 1024**3 / _side_by_side(lambda _: a @ b, copies, repeats=repeats) * share


def _threads_per_rank(ranks_per_node: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, ranks_per_node))


def cpu_source(ranks_per_node: int) -> str:
    threads = _threads_per_rank(ranks_per_node)
    return f"this CPU, measured ({threads} thread{'s' if threads > 1 else ''} per rank; gloo all-reduce)"


def _best(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _side_by_side(fn, copies: int, args: list | None = None, repeats: int = 5) -> float:
    """Seconds of one ``fn(args[i])`` while ``copies`` threads run it at once (the slowest thread's best)."""
    args = args or [None] * copies
    if copies <= 1:
        return _best(lambda: fn(args[0]), repeats)
    results: list[float] = []
    threads = [threading.Thread(target=lambda a=a: results.append(_best(lambda: fn(a), repeats))) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(results)


def gloo_allreduce(ranks: int, size: int = 16 << 20) -> tuple[float, float, float, float]:
    """(bus bandwidth B/s, latency s) of gloo all-reduces among ``ranks`` threads of this process (the real
    gloo transport over loopback, without starting processes), and the same between computations: from what
    a small and a 1 MiB all-reduce add to a loop of matmuls that every rank runs (tensor parallelism's
    pattern)."""
    import torch.distributed as dist

    store = dist.HashStore()
    groups: dict[int, object] = {}
    results: dict[int, tuple[float, float]] = {}
    blocking: dict[int, tuple[float, float]] = {}

    def rank(r: int) -> None:
        pg = dist.ProcessGroupGloo(store, r, ranks, timedelta(seconds=60))
        big, small = torch.ones(size // 4), torch.ones(1)
        for t in (big, small, big):  # connections and first-use costs
            pg.allreduce([t]).wait()
        results[r] = (_best(lambda: pg.allreduce([big]).wait(), 3), _best(lambda: pg.allreduce([small]).wait(), 10))
        a, medium = torch.randn(512, 512), torch.ones(1 << 18)

        def computing(tensor: torch.Tensor | None) -> float:
            start = time.perf_counter()
            for _ in range(20):
                a @ a
                if tensor is not None:
                    pg.allreduce([tensor]).wait()
            return time.perf_counter() - start

        # alternated, so each sees the same load; the mean of rounds (contention is measured, not the best case)
        rounds = [(computing(small), computing(medium), computing(None)) for _ in range(3)]
        blocking[r] = tuple(sum(run[i] - run[2] for run in rounds) / len(rounds) / 20 for i in (0, 1))
        groups[r] = pg

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    big = max(v[0] for v in results.values())
    small = max(v[1] for v in results.values())
    share = 2 * (ranks - 1) / ranks
    busy_small = max(small, max(v[0] for v in blocking.values()))
    busy_medium = max(v[1] for v in blocking.values())
    busy_bandwidth = min(size / big * share, share * 4 * (1 << 18) / max(1e-6, busy_medium - busy_small))
    return size / big * share, small, busy_small, busy_bandwidth


def measured_links() -> dict | None:
    """``distrain doctor``'s last measurement on this machine, or None."""
    links = kept.read_json(measured_file(), 2**16)
    return links if isinstance(links, dict) else None


def save_measured_links(backend: str, world: int, bus_bandwidth: float, latency: float) -> Path | None:
    data = {"backend": backend, "world": world, "bus_bandwidth": bus_bandwidth, "latency": latency}
    # None: a read-only home, where the plan measures or assumes instead
    return measured_file() if kept.write_json(measured_file(), data) else None


# ---- the step -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Collective:
    kind: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter`` or ``all_to_all``."""
    size: float
    """Bytes of the whole (unsharded) tensor set; an all-to-all's: one rank's (it keeps 1/N, sends the rest)."""
    ranks: int
    passes: int
    """Times the whole set goes over the link in one optimizer step (FSDP gathers it in each forward and backward)."""
    calls_per_pass: int
    """Collectives per pass: one per FSDP unit or per bucket."""
    inter_node: bool = False
    copied: bool = False
    """Copied into or out of a flat buffer (FSDP, DeepSpeed) on the way: memory traffic beside the link's."""
    every: int = 1
    """Optimizer steps per occurrence: semi-synchronous replica groups meet once every ``sync_every`` steps, and
    every rank waits for the meeting (it overlaps nothing)."""

    @property
    def calls(self) -> int:
        return self.passes * self.calls_per_pass

    @property
    def awaited(self) -> bool:
        """The next computation needs what it brings: an all-to-all carries the tokens to their experts and back.
        Nothing runs beside it (on a GPU it is not hidden under compute; on a CPU it costs what a collective between
        two computations costs, ``Hardware.blocking_collective_seconds``)."""
        return self.kind == "all_to_all"


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on every rank, by part."""

    compute: float
    optimizer: float
    communication: float
    seconds: float
    awaited: float = 0.0
    """The part of ``communication`` the computations wait for (``Collective.awaited``): never overlapped."""

    def __add__(self, other: StepTime) -> StepTime:
        return StepTime(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def scaled(self, factor: float) -> StepTime:
        return StepTime(*(max(0.0, a * factor) for a in self.astuple()))

    def astuple(self) -> tuple[float, float, float, float, float]:
        return (self.compute, self.optimizer, self.communication, self.seconds, self.awaited)


def beside(compute: float, communication: float, awaited: float) -> float:
    """Compute and communication run side by side (a GPU): the longer of the two, but for the collectives the
    computations wait for (``awaited``), which nothing hides."""
    return max(compute, communication - awaited) + awaited


def step_at_depth(times: dict[int, StepTime], depth: int, overlap: bool) -> StepTime:
    """The step of a model ``depth`` blocks deep from its steps at two shallow depths (``times``). Compute, the
    optimizer step and communication are each affine in depth; the step's seconds are not where compute and
    communication overlap (``overlap``: the step takes the longer of the two). A shallow model's step can be bound by
    its communication (the embeddings' and head's gathers weigh more there) and the deep one's by compute: a line
    through two communication-bound seconds made a deep step shorter than its own compute. So the parts are
    extrapolated and the overlap taken again at depth. What the seconds add beyond it is the collectives left
    exposed: the first gather and the last reduction, one unit's each, which a deeper model cut into more units does
    not make larger. It is extrapolated where it grows with depth and held at the deeper depth's where it shrinks
    (a line would take it below zero)."""

    def overlapped(t: StepTime) -> float:
        return beside(t.compute, t.communication, t.awaited) if overlap else t.compute + t.communication

    (d1, t1), (d2, t2) = sorted(times.items())

    def at_depth(a: float, b: float) -> float:
        return a + (b - a) * (depth - d1) / (d2 - d1)

    compute, optimizer, communication, awaited = (
        at_depth(getattr(t1, part), getattr(t2, part)) for part in ("compute", "optimizer", "communication", "awaited")
    )
    exposed = [t.seconds - overlapped(t) - t.optimizer for t in (t1, t2)]
    beyond = at_depth(*exposed) if exposed[1] >= exposed[0] else exposed[1]
    step = StepTime(compute, optimizer, communication, 0.0, awaited)
    return replace(step, seconds=overlapped(step) + optimizer + beyond)


#: DDP's gradient buckets (``bucket_cap_mb=25``): one all-reduce call each
DDP_BUCKET_BYTES = 25 << 20


def buckets(size: float, bucket: float) -> int:
    """Collective calls to send ``size`` bytes in buckets of ``bucket``."""
    return max(1, -(-int(size) // max(1, int(bucket))))


def collective_seconds(c: Collective, hw: Hardware, blocking: bool = False) -> float:
    """``blocking``: the next computation waits for it (see ``Hardware.blocking_collective_seconds``)."""
    if c.ranks <= 1:
        return 0.0
    share = (c.ranks - 1) / c.ranks * (2 if c.kind == "all_reduce" else 1)
    bandwidth = hw.inter_bandwidth if c.inter_node else hw.intra_bandwidth
    latency = hw.collective_seconds
    if blocking and hw.blocking_collective_seconds:
        latency = hw.blocking_collective_seconds
        bandwidth = hw.inter_bandwidth if c.inter_node else min(bandwidth, hw.blocking_bandwidth or bandwidth)
    return (c.passes * c.size * share / bandwidth + c.calls * latency) / c.every


def copy_seconds(c: Collective, hw: Hardware) -> float:
    """The copies into and out of the flat buffers a collective uses: each pass reads and writes the set."""
    return c.passes * 2 * c.size / hw.memory_bandwidth / c.every if c.copied else 0.0


def work_seconds(work, hw: Hardware, memory_share: float = 1.0) -> float:
    """A phase's operations on this hardware; ``memory_share``: the part of its bytes this rank moves."""
    per_element = work.elements * hw.element_seconds + work.softmax_elements * hw.softmax_element_seconds
    return (
        work.flops / hw.matmul_flops
        + work.float8_flops / (hw.float8_flops or hw.matmul_flops)
        + work.attention_flops / (hw.attention_flops or hw.matmul_flops)
        + work.bytes * memory_share / hw.memory_bandwidth
        + work.ops * hw.op_seconds
        + per_element * memory_share
    )


def step_time(
    job, trace, sent: list[Collective], hw: Hardware, shard: float = 1.0, offload: bool = False, host_gathers: int = 0
) -> StepTime:
    """One optimizer step of a data-parallel option: ``accumulate`` forward/backward passes of the traced
    micro-step, the optimizer step (on ``shard`` of the state), and the collectives ``sent``. ``offload``: the
    optimizer steps on the host; gradients go there and parameters come back over PCIe, and ``host_gathers`` times
    more per step when the parameters live on the host (copied in at each gather)."""
    compute = job.accumulate * work_seconds(trace.work.forward_backward, hw)
    if not offload:
        optimizer = work_seconds(trace.work.step, hw, shard)
    else:
        moved = (trace.grad_bytes + trace.param_bytes) * shard + trace.param_bytes * shard * host_gathers
        optimizer = moved / hw.host_bandwidth + trace.work.step.bytes * shard / HOST_OPTIMIZER_BANDWIDTH
    compute += sum(copy_seconds(c, hw) for c in sent)
    comm_parts = [collective_seconds(c, hw, blocking=c.awaited) for c in sent]
    comm = sum(comm_parts)
    meetings = sum(p for p, c in zip(comm_parts, sent) if c.every > 1)  # between steps: nothing overlaps them
    awaited = sum(p for p, c in zip(comm_parts, sent) if c.awaited)
    if hw.overlap:  # NCCL beside compute: the first gather and the last reduction stay exposed
        exposed = sum(p / max(1, c.calls) for p, c in zip(comm_parts, sent) if c.every == 1 and not c.awaited)
        seconds = beside(compute, comm - meetings, awaited) + exposed + meetings + optimizer
    else:
        seconds = compute + comm + optimizer
    return StepTime(compute, optimizer, comm, seconds, awaited)
