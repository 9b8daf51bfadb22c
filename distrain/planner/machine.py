"""The rates a plan times its options with (``resolve_hardware``): a GPU's from the table in ``timing.py``, this
CPU's measured once per machine and kept, since a plan's step time must not depend on how busy the machine was in
the second the plan started.

Measured afresh at every start, the same config was predicted anywhere from 77 ms to 295 ms per step on a shared
machine, and the DDP and FSDP plans of one model differed 2× in compute alone. So the rates
(``timing.cpu_hardware``) are measured in ``ROUNDS`` rounds, each figure taken as the median of its rounds (one
disturbed round moves nothing), and kept in ``~/.cache/distrain/rates/<key>.json``. The key is what the figures
depend on: the CPU's model and core count, the ranks per node (the cores each rank gets), torch's version.
``distrain plan --measure`` measures again and replaces them.

Rates measured while other jobs shared the cores would make every later plan predict its steps too slow (2.2-2.3×,
measured once on 2 cores), and ``auto`` decide on those numbers. So a process's first plan times this CPU's matmuls
alone (a tenth of a second on 2 cores): where they now run ``FASTER`` times the kept rate, the kept rates were
measured busy, and are measured again (said on the console). A CPU slower now than its kept rate is busy now: its
kept rates stand.

The file is read as untrusted bytes: JSON only, at most ``MAX_BYTES``, every figure a positive finite number;
anything else is measured again, never an error.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from distrain.planner import kept, timing
from distrain.planner.timing import Hardware, cpu_hardware, cpu_matmul_flops, cpu_source

ROUNDS = 3
MAX_BYTES = 16 * 2**10
#: a CPU whose matmuls run this many times its kept rate (checked once per process) has its rates measured again:
#: quiet measurements of one machine differ by a tenth or two, one made beside other jobs by 2× or more
FASTER = 1.5
#: the measured figures of a Hardware (the rest are constants, or say where the figures came from)
MEASURED = (
    "matmul_flops",
    "memory_bandwidth",
    "op_seconds",
    "intra_bandwidth",
    "inter_bandwidth",
    "collective_seconds",
    "blocking_collective_seconds",
    "blocking_bandwidth",
    "element_seconds",
    "softmax_element_seconds",
)
assert set(MEASURED) <= {f.name for f in fields(Hardware)}


def directory() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "distrain" / "rates"


def kept_file(ranks_per_node: int) -> Path:
    """Where this machine's rates for ``ranks_per_node`` ranks are kept."""
    return directory() / f"{_key(ranks_per_node)}.json"


def cpu_rates(ranks_per_node: int, measure: bool = False) -> Hardware:
    """This CPU's rates with ``ranks_per_node`` ranks: as kept, or (none kept, ``measure``, or kept ones this CPU
    now beats by ``FASTER``: measured while it was busy) measured and kept."""
    path = kept_file(ranks_per_node)
    if not measure:
        rates = _read(path, ranks_per_node)
        if rates is not None and not _measured_while_busy(rates, ranks_per_node, path):
            return rates
    rounds = [cpu_hardware(ranks_per_node) for _ in range(ROUNDS)]
    figures = {name: float(statistics.median(getattr(r, name) for r in rounds)) for name in MEASURED}
    when = time.strftime("%Y-%m-%d %H:%M")
    kept.write_json(path, {"key": path.stem, "ranks_per_node": ranks_per_node, "measured": when, "rates": figures})
    return replace(rounds[0], **figures, source=_source(rounds[0].source, when, path))


#: kept rates this process has checked against the CPU, by file: their matmul rate
_CHECKED: dict[Path, float] = {}


def _measured_while_busy(rates: Hardware, ranks_per_node: int, path: Path) -> bool:
    """Whether this CPU's matmuls now run ``FASTER`` times the kept rate or more: the kept rates were measured while
    other work shared the cores, and every plan would have predicted its steps that much too slow (2.2-2.3× once,
    on 2 cores). Said on the console, and measured again. A CPU slower now than its kept rate is busy now: the kept
    rates stay, the machine's own."""
    if _CHECKED.get(path) == rates.matmul_flops:  # checked in this process already: one check per process
        return False
    now = cpu_matmul_flops(ranks_per_node)
    if now < FASTER * rates.matmul_flops:
        _CHECKED[path] = rates.matmul_flops
        return False
    print(
        f"distrain: this CPU's matmuls run {now / rates.matmul_flops:.1f}× the rate kept in {path}: those rates were "
        "measured while other work shared its cores; measuring them again",
        flush=True,
    )
    return True


def _key(ranks_per_node: int) -> str:
    inputs = [_cpu_model(), os.cpu_count(), platform.machine(), ranks_per_node, torch.__version__]
    return hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:16]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _source(measured: str, when: str, path: Path) -> str:
    return f"{measured}, median of {ROUNDS} rounds on {when}, kept in {path} (`distrain plan --measure` measures again)"


def _read(path: Path, ranks_per_node: int) -> Hardware | None:
    values = kept.read_json(path, MAX_BYTES)
    if not isinstance(values, dict) or set(values) != {"key", "ranks_per_node", "measured", "rates"}:
        return None
    rates, when = values["rates"], values["measured"]
    if values["key"] != path.stem or values["ranks_per_node"] != ranks_per_node or not isinstance(when, str):
        return None
    if not isinstance(rates, dict) or set(rates) != set(MEASURED):
        return None
    if not all(type(v) is float and math.isfinite(v) and v > 0 for v in rates.values()):
        return None
    return Hardware(**rates, source=_source(cpu_source(ranks_per_node), when[:40], path))


def resolve_hardware(
    gpu: bool,
    precision: str,
    ranks_per_node: int,
    gpu_type: str | None = None,
    bandwidth: float | None = None,
    inter_node_bandwidth: float | None = None,
    measure: bool = False,
) -> Hardware:
    """The rates a plan uses: a GPU's from the table (``gpu_type``, else this machine's GPU, else the
    H100), a CPU's as measured once on this machine and kept (``measure``: again); links as given, else as
    ``distrain doctor`` measured them."""
    if gpu:
        if gpu_type is None and torch.cuda.is_available():
            gpu_type = next((k for k in timing.GPU_TABLE if k.lower() in torch.cuda.get_device_name().lower()), None)
        hw = timing.gpu_hardware(gpu_type, precision)
        backend = "nccl"
    else:
        hw = cpu_rates(ranks_per_node, measure)
        backend = "gloo"
    measured = timing.measured_links()
    if bandwidth is None and measured and measured.get("backend") == backend:
        hw = replace(
            hw,
            intra_bandwidth=measured["bus_bandwidth"],
            collective_seconds=measured["latency"],
            source=hw.source + "; links: distrain doctor",
        )
    if bandwidth is not None:
        hw = replace(hw, intra_bandwidth=bandwidth, source=hw.source + "; links: --bandwidth")
    if inter_node_bandwidth is not None:
        hw = replace(hw, inter_bandwidth=inter_node_bandwidth)
    return hw
