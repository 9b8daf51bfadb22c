"""What the machine is doing, read on logging steps: the host through psutil, the GPU through NVML
and torch's allocator.

Every rank reads its own numbers (``SystemMonitor.sample``); ``MetricsLogger`` gathers them and
rank 0 logs, for each reading, the maximum over ranks under the plain name and ``_min`` /
``_mean`` beside it, so a straggler (a rank at 40% GPU utilization while the others are at 95%, a
rank with less memory left) shows up in the curves. Readings are cheap: a few microseconds for
psutil, well under a millisecond per NVML query, taken only every ``log_every_n_steps``.
"""

from __future__ import annotations

import math
import warnings

import torch

#: the host, on every machine (psutil)
HOST_KEYS = ("host_rss_mb", "host_cpu_percent", "host_mem_available_mb")
#: the GPU as NVML sees it (every process on it, not only this one's tensors)
NVML_KEYS = ("gpu_util_percent", "gpu_mem_used_mb", "gpu_mem_total_mb", "gpu_power_w", "gpu_temp_c")

_MB = 2**20


class SystemMonitor:
    """Per-rank readings with a fixed set of keys (so ranks can gather them as one tensor); a
    reading that is unavailable is NaN and is left out of the logged record."""

    def __init__(self, device: torch.device, announce: bool = True):
        import psutil

        self.device = device
        self._psutil = psutil
        self._process = psutil.Process()
        self._process.cpu_percent(None)  # the first call only starts the measurement window
        self.nvml_error: str | None = None
        self.keys: tuple[str, ...] = HOST_KEYS
        if device.type == "cuda":
            self.nvml_error = _nvml_problem(device)
            self.keys = HOST_KEYS + NVML_KEYS
            if self.nvml_error and announce:  # once, on the rank that says things
                warnings.warn(
                    f"distrain: GPU utilization, power and temperature are not logged: NVML is unavailable "
                    f"({self.nvml_error}); logging torch's memory numbers only (pip install nvidia-ml-py)",
                    stacklevel=2,
                )

    def sample(self) -> dict[str, float]:
        """This rank's readings now: ``keys`` in order, NaN where unavailable."""
        out = {"host_rss_mb": self._process.memory_info().rss / _MB}
        # this process's CPU time over the wall time since the last sample (100 = one core busy)
        out["host_cpu_percent"] = self._process.cpu_percent(None)
        out["host_mem_available_mb"] = self._psutil.virtual_memory().available / _MB
        if self.device.type == "cuda":
            out.update(dict.fromkeys(NVML_KEYS, math.nan))
            if self.nvml_error is None:
                out.update(_nvml_readings(self.device))
        return {k: round(float(out[k]), 1) for k in self.keys}


def _nvml_problem(device: torch.device) -> str | None:
    """None when NVML answers for ``device``; otherwise why not, in a few words."""
    try:
        torch.cuda.utilization(device)
        return None
    except ModuleNotFoundError:
        return "the nvidia-ml-py package is not installed"
    except Exception as e:  # driver not loaded, a MIG slice or a container without NVML access, ...
        return f"{type(e).__name__}: {e}"


def _nvml_readings(device: torch.device) -> dict[str, float]:
    # torch.cuda's NVML helpers map torch's device index to NVML's (CUDA_VISIBLE_DEVICES, UUIDs):
    # public torch.cuda functions, checked on torch 2.13.0
    return {
        "gpu_util_percent": torch.cuda.utilization(device),
        "gpu_mem_used_mb": torch.cuda.device_memory_used(device) / _MB,
        "gpu_mem_total_mb": torch.cuda.get_device_properties(device).total_memory / _MB,
        "gpu_power_w": torch.cuda.power_draw(device) / 1000,
        "gpu_temp_c": torch.cuda.temperature(device),
    }


def across_ranks(names: list[str], per_rank: list[list[float]]) -> dict[str, float]:
    """Each reading over the ranks: the maximum under its own name (the fullest, busiest or hottest
    rank), with ``_min`` and ``_mean`` beside it. NaN readings are left out."""
    out: dict[str, float] = {}
    for i, name in enumerate(names):
        values = [r[i] for r in per_rank if not math.isnan(r[i])]
        if values:
            out[name] = highest = max(values)
            out[f"{name}_min"] = lowest = min(values)
            # rounded (seconds as well as megabytes), then kept between the two: rounding, or a sum's own
            # rounding, could put the mean of equal readings just outside them
            out[f"{name}_mean"] = min(max(round(sum(values) / len(values), 6), lowest), highest)
    return out
