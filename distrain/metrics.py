"""Collecting what ``Module.log`` records, reducing it across ranks, and measuring throughput."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Entry:
    value: float
    on_step: bool
    on_epoch: bool
    sync_dist: bool
    prog_bar: bool
    batch_size: int


class MetricCollector:
    """Training logs default to per-step; evaluation logs to a per-epoch sample-weighted mean."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.stage = "train"
        self.current_batch_size = 1
        self.step_entries: dict[str, _Entry] = {}
        self.epoch_sums: dict[str, list[float]] = {}  # name -> [sum of value*weight, sum of weights]
        self.prog_bar: set[str] = set()
        self.epoch_sync: set[str] = set()
        self.epoch_summed: set[str] = set()  # reduce_fx="sum": totals, not means
        self.muted = False  # padding steps that only keep collectives matched

    def log(self, name, value, on_step, on_epoch, sync_dist, prog_bar, batch_size, reduce_fx="mean") -> None:
        if self.muted:
            return
        training = self.stage == "train"
        on_step = training if on_step is None else on_step
        on_epoch = (not training) if on_epoch is None else on_epoch
        value = float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else float(value)
        weight = batch_size or self.current_batch_size
        entry = _Entry(value, on_step, on_epoch, sync_dist, prog_bar, weight)
        if on_step:
            self.step_entries[name] = entry
        if on_epoch:
            acc = self.epoch_sums.setdefault(name, [0.0, 0.0])
            if reduce_fx == "sum":
                acc[0] += value
                acc[1] += 1
                self.epoch_summed.add(name)
            else:
                acc[0] += value * weight
                acc[1] += weight
            if sync_dist or not training:
                self.epoch_sync.add(name)
        if prog_bar:
            self.prog_bar.add(name)

    def pop_step_metrics(self, reduce: bool) -> dict[str, float]:
        """The latest per-step values; ``sync_dist`` ones averaged over ranks when ``reduce``."""
        entries, self.step_entries = self.step_entries, {}
        synced = sorted(n for n, e in entries.items() if e.sync_dist)
        out = {n: e.value for n, e in entries.items()}
        if reduce and synced:
            values = self.runtime.all_reduce(torch.tensor([entries[n].value for n in synced], dtype=torch.float64))
            out.update(zip(synced, values.tolist()))
        return out

    def pop_epoch_metrics(self) -> dict[str, float]:
        """Sample-weighted means; evaluation metrics and sync_dist ones over all ranks' samples."""
        sums, self.epoch_sums = self.epoch_sums, {}
        sync, self.epoch_sync = self.epoch_sync, set()
        summed, self.epoch_summed = self.epoch_summed, set()
        # every rank must reduce the same names in the same order, even one that logged none
        if self.runtime.world_size > 1:
            gathered = self.runtime.all_gather_object((sorted(sync), sorted(summed)))
            names = sorted(set().union(*(g[0] for g in gathered)))
            summed = set().union(*(g[1] for g in gathered))
        else:
            names = sorted(sync)
        out = {n: s if n in summed else s / w for n, (s, w) in sums.items() if w}
        if names:
            totals = torch.tensor([sums.get(n, [0.0, 0.0]) for n in names], dtype=torch.float64)
            totals = self.runtime.all_reduce(totals, op="sum")
            out.update({n: s if n in summed else s / w for n, (s, w) in zip(names, totals.tolist()) if w})
        return out


class Throughput:
    """Samples/s, tokens/s, step-time mean/std and MFU over the window since the last report."""

    def __init__(self, world_size: int, flops_per_token: float | None = None, peak_flops: float | None = None):
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.reset()

    def reset(self) -> None:
        self.window_start = time.perf_counter()
        self.last = self.window_start
        self.step_times: list[float] = []
        self.samples = 0
        self.tokens = 0

    def step(self, samples: int, tokens: int | None) -> None:
        now = time.perf_counter()
        self.step_times.append(now - self.last)
        self.last = now
        self.samples += samples * self.world_size
        self.tokens += (tokens or 0) * self.world_size

    def compute(self) -> dict[str, Any]:
        self.last = time.perf_counter()  # called after a device sync: the window's true end
        elapsed = max(self.last - self.window_start, 1e-9)
        out: dict[str, Any] = {"samples_per_sec": self.samples / elapsed}
        if self.tokens:
            out["tokens_per_sec"] = self.tokens / elapsed
            if self.flops_per_token and self.peak_flops:
                out["mfu"] = out["tokens_per_sec"] * self.flops_per_token / (self.peak_flops * self.world_size)
        if self.step_times:
            out["step_time"] = statistics.fmean(self.step_times)
            out["step_time_std"] = statistics.pstdev(self.step_times) if len(self.step_times) > 1 else 0.0
        self.reset()
        return out
