"""Where a stage's time goes, by action: each of Lightning's hooks (the callbacks' and the module's), each step of the
strategy (``[Strategy]DDPStrategy.training_step``, ``validation_step``...), each training batch and epoch. Lightning's
``Trainer(profiler="simple" | "advanced")`` and its profiler classes: the report is printed on rank 0 when the stage
ends (``FIT Profiler Report``), or written by every rank to ``dirpath/{stage}-{filename}-{local rank}.txt`` where a
``filename`` is given (``dirpath`` defaults to the run's folder). ``profiler="pytorch"`` is refused in one line:
torch's own profiler runs around ``fit``, as torch documents it."""

from __future__ import annotations

import contextlib
import cProfile
import io
import math
import os
import pstats
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class Profiler:
    """Times actions (``profile(action)``, or ``start``/``stop``) and reports them per stage (``summary``)."""

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None) -> None:
        self.dirpath, self.filename = dirpath, filename
        self._stage: str | None = None
        self._local_rank: int | None = None
        self._log_dir: str | None = None

    def start(self, action_name: str) -> None:
        raise NotImplementedError

    def stop(self, action_name: str) -> None:
        raise NotImplementedError

    def summary(self) -> str:
        raise NotImplementedError

    @contextlib.contextmanager
    def profile(self, action_name: str) -> Iterator[None]:
        self.start(action_name)
        try:
            yield
        finally:
            self.stop(action_name)

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        self._stage, self._local_rank, self._log_dir = stage, local_rank, log_dir

    def describe(self, is_global_zero: bool = True) -> None:
        """The stage's report: to its file where a ``filename`` is given (every rank its own), else printed on
        rank 0."""
        summary = self.summary()
        if self.filename:
            parts = [p for p in (self._stage, self.filename, self._local_rank) if p is not None]
            (self._folder() / ("-".join(map(str, parts)) + ".txt")).write_text(summary)
        elif is_global_zero and summary:
            print(summary, flush=True)

    def teardown(self, stage: str | None) -> None:
        """A stage's actions are its own: the next stage's report starts empty."""

    def _folder(self) -> Path:
        """Where its files go: ``dirpath``, else the run's folder."""
        folder = Path(self.dirpath or self._log_dir or ".")
        folder.mkdir(parents=True, exist_ok=True)
        return folder


class PassThroughProfiler(Profiler):
    """Times nothing (Lightning's default)."""

    def start(self, action_name: str) -> None:
        pass

    def stop(self, action_name: str) -> None:
        pass

    def summary(self) -> str:
        return ""


class SimpleProfiler(Profiler):
    """The mean and total duration of each action, and (``extended``) its number of calls and share of the stage's
    time: Lightning's table."""

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None, extended: bool = True) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.extended = extended
        self.current_actions: dict[str, float] = {}
        self.recorded_durations: dict[str, list[float]] = defaultdict(list)
        self.start_time = time.perf_counter()

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        super().setup(stage, local_rank, log_dir)
        self.start_time = time.perf_counter()

    def start(self, action_name: str) -> None:
        if action_name in self.current_actions:
            raise ValueError(f"Attempted to start {action_name} which has already started.")
        self.current_actions[action_name] = time.perf_counter()

    def stop(self, action_name: str) -> None:
        end = time.perf_counter()
        if action_name not in self.current_actions:
            raise ValueError(f"Attempting to stop recording an action ({action_name}) which was never started.")
        self.recorded_durations[action_name].append(end - self.current_actions.pop(action_name))

    def summary(self) -> str:
        sep = os.linesep
        out = f"{self._stage.upper()} " if self._stage is not None else ""
        out += f"Profiler Report{sep}"
        if not self.recorded_durations:
            return out
        width = max(len(k) for k in self.recorded_durations)
        total_duration = time.perf_counter() - self.start_time
        rows = [(a, math.fsum(d) / len(d), len(d), math.fsum(d)) for a, d in self.recorded_durations.items()]

        def row(*cells: str) -> str:
            return f"{sep}|  {cells[0]:<{width}s}\t|" + "".join(f"  {c:<15}\t|" for c in cells[1:])

        if self.extended:
            header = row("Action", "Mean duration (s)", "Num calls", "Total time (s)", "Percentage %")
            rule = f"{sep}{'-' * len(header.expandtabs())}"
            out += rule + header + rule
            out += row("Total", "-", f"{sum(r[2] for r in rows)}", f"{total_duration:.5}", "100 %") + rule
            for action, mean, calls, total in sorted(rows, key=lambda r: r[3], reverse=True):
                out += row(action, f"{mean:.5}", f"{calls}", f"{total:.5}", f"{100.0 * total / total_duration:.5}")
        else:
            header = row("Action", "Mean duration (s)", "Total time (s)")
            rule = f"{sep}{'-' * len(header.expandtabs())}"
            out += rule + header + rule
            for action, mean, _, total in sorted(rows, key=lambda r: r[1], reverse=True):
                out += row(action, f"{mean:.5}", f"{total:.5}")
        return out + rule + sep

    def teardown(self, stage: str | None) -> None:
        self.current_actions.clear()
        self.recorded_durations.clear()


class AdvancedProfiler(Profiler):
    """Python's ``cProfile`` per action: the functions each action spent its time in, the ``line_count_restriction``
    first (a count, or a share of the lines), sorted by cumulative time."""

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        line_count_restriction: float = 1.0,
        dump_stats: bool = False,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.profiled_actions: dict[str, cProfile.Profile] = {}
        self.line_count_restriction = line_count_restriction
        self.dump_stats = dump_stats

    def start(self, action_name: str) -> None:
        self.profiled_actions.setdefault(action_name, cProfile.Profile()).enable()

    def stop(self, action_name: str) -> None:
        profiler = self.profiled_actions.get(action_name)
        if profiler is None:
            raise ValueError(f"Attempting to stop recording an action ({action_name}) which was never started.")
        profiler.disable()

    def summary(self) -> str:
        reports = {}
        for action, profiler in self.profiled_actions.items():
            stream = io.StringIO()
            pstats.Stats(profiler, stream=stream).strip_dirs().sort_stats("cumulative").print_stats(
                self.line_count_restriction
            )
            reports[action] = stream.getvalue()
            if self.dump_stats:
                profiler.dump_stats(str(self._folder() / f"{self._stage}-{action}.prof".replace("/", "_")))
        stage = f"{self._stage.upper()} " if self._stage is not None else ""
        return f"{stage}Profiler Report{os.linesep}" + "".join(
            f"{os.linesep}Profile stats for: {action}{os.linesep}{report}" for action, report in reports.items()
        )

    def teardown(self, stage: str | None) -> None:
        self.profiled_actions.clear()


#: ``Trainer(profiler=<name>)``
NAMED = {"simple": SimpleProfiler, "advanced": AdvancedProfiler}


def profiler_from(value: Any) -> Profiler | None:
    """``Trainer(profiler=...)``: None (no profiling), a name (``"simple"``, ``"advanced"``) or a ``Profiler``."""
    if value is None or isinstance(value, Profiler):
        return value
    if isinstance(value, str) and value.lower() in NAMED:
        return NAMED[value.lower()]()
    if value in ("pytorch", "xla"):
        raise ValueError(
            f"Trainer(profiler={value!r}): distrain runs 'simple' and 'advanced'; for torch's profiler, run "
            "torch.profiler.profile around fit (its traces show every rank's kernels and collectives)"
        )
    raise ValueError(f"Trainer(profiler={value!r}): give 'simple', 'advanced', a Profiler, or None")


def profile(trainer: Any, action_name: str):
    """``trainer.profiler.profile(action_name)``, or nothing where the trainer profiles nothing."""
    profiler = getattr(trainer, "profiler", None)
    return profiler.profile(action_name) if profiler is not None else contextlib.nullcontext()
