"""What the loop measures and where it goes.

``MetricCollector`` receives ``Module.log`` calls and reduces them across ranks; ``Throughput``
times optimizer steps; ``MetricsLogger`` turns a finished step into one record (loss, lr, grad
norm, throughput, memory, the module's own values), keeps the views callbacks read
(``callback_metrics``, ``progress_bar_metrics``) and sends records to the loggers on rank 0.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from distrain.loggers import Logger, TensorBoardLogger
from distrain.training.monitor import SystemMonitor, across_ranks
from distrain.training.stragglers import PARTS, PERSISTS_STEPS, StepTimer, Straggler, find_straggler


@dataclass
class _Entry:
    value: torch.Tensor | float  # a tensor stays on its device until the values are needed
    sync_dist: bool


class MetricCollector:
    """Training logs default to per-step; evaluation logs to a per-epoch sample-weighted mean.

    Logged tensors stay on their device (no host sync per micro-step); they become numbers once per
    logging step or epoch, when they are also reduced across ranks — by names every rank agrees on,
    since a collective over lists that differ between ranks would mismatch or hang."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.stage = "train"
        self.current_batch_size = 1
        self.step_entries: dict[str, _Entry] = {}
        self.epoch_sums: dict[str, list] = {}  # name -> [sum of value*weight, sum of weights]
        self.prog_bar: set[str] = set()
        self.epoch_sync: set[str] = set()
        self.epoch_summed: set[str] = set()  # reduce_fx="sum": totals, not means
        #: torchmetrics Metrics logged on_epoch, by name: their own compute() is the epoch value (``_metric_object``)
        self.epoch_objects: dict[str, Any] = {}
        self.muted = False  # padding steps that only keep collectives matched
        #: Lightning's names for a value logged both on_step and on_epoch (``distrain.lightning``): ``name_step`` and
        #: ``name_epoch``, and the callbacks' ``name`` the newer of the two (``aliases``); distrain's keep ``name``
        self.forks = False
        self.forked: set[str] = set()

    def log(
        self,
        name: str,
        value: Any,
        *,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        sync_dist: bool = False,
        prog_bar: bool = False,
        batch_size: int | None = None,
        reduce_fx: str = "mean",
    ) -> None:
        if self.muted:
            return
        training = self.stage == "train"
        on_step = training if on_step is None else on_step
        on_epoch = (not training) if on_epoch is None else on_epoch
        step_name = epoch_name = name
        if self.forks and on_step and on_epoch:
            step_name, epoch_name = f"{name}_step", f"{name}_epoch"
            self.forked.add(name)
        if prog_bar:
            self.prog_bar.update({step_name, epoch_name})
        if _metric_object(value):
            # as Lightning logs one: the step's value is what its forward returned (none after update() alone); the
            # epoch's, its compute() (its own reduction across ranks) at the epoch's end, then reset()
            if on_epoch:
                self.epoch_objects[epoch_name] = value
            if not on_step or value._forward_cache is None:
                return
            value = value._forward_cache
        if hasattr(value, "full_tensor"):  # a DTensor (tensor parallelism): its whole value
            value = value.full_tensor()
        value = value.detach().float().mean() if isinstance(value, torch.Tensor) else float(value)
        weight = batch_size or self.current_batch_size
        if on_step:
            self.step_entries[step_name] = _Entry(value, sync_dist)
        if on_epoch:
            acc = self.epoch_sums.setdefault(epoch_name, [0.0, 0.0])
            if reduce_fx == "sum":
                acc[0] = acc[0] + value
                acc[1] += 1
                self.epoch_summed.add(epoch_name)
            else:
                acc[0] = acc[0] + value * weight
                acc[1] += weight
            if sync_dist or not training or self.runtime.strategy.traits.metrics_elsewhere:
                self.epoch_sync.add(epoch_name)

    def aliases(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Lightning's callback metrics also hold a forked value under its own name: its newest step value, and once
        its epoch ends the epoch's."""
        return {
            name: metrics[name + suffix]
            for name in self.forked
            for suffix in ("_step", "_epoch")
            if name + suffix in metrics
        }

    def stash_epoch(self) -> tuple:
        """Set the epoch values aside (and start empty): an evaluation inside a training epoch keeps its own, so
        neither mixes into the other. ``restore_epoch`` puts them back."""
        stashed = (self.epoch_sums, self.epoch_sync, self.epoch_summed, self.epoch_objects)
        self.epoch_sums, self.epoch_sync, self.epoch_summed, self.epoch_objects = {}, set(), set(), {}
        return stashed

    def restore_epoch(self, stashed: tuple) -> None:
        self.epoch_sums, self.epoch_sync, self.epoch_summed, self.epoch_objects = stashed

    def pop_step_metrics(self, reduce: bool) -> dict[str, Any]:
        """The latest per-step values. With ``reduce`` (logging steps): plain numbers, ``sync_dist``
        ones averaged over the ranks that logged them; without: as logged (tensors stay on the device)."""
        entries, self.step_entries = self.step_entries, {}
        if not reduce:
            return {n: e.value for n, e in entries.items()}
        gather_all = self.runtime.strategy.traits.metrics_elsewhere  # values may live on other ranks than rank 0
        synced = sorted(n for n, e in entries.items() if e.sync_dist or gather_all)
        if self.runtime.world_size > 1:  # a rank that did not log a name this step still takes part
            synced = sorted(set().union(*self.runtime.all_gather_object(synced)))
        out = {n: e.value for n, e in entries.items() if n not in synced}
        if synced:
            # [value, 1] per name this rank logged, [0, 0] for the others: the mean over those that did
            counts = self.runtime.strategy.traits.counts_metrics  # a model-parallel peer's copy counts once
            rows = [[entries[n].value, 1.0] if n in entries and counts else [0.0, 0.0] for n in synced]
            sums = self.runtime.all_reduce(_as_tensor(rows, self.runtime.device), op="sum").tolist()
            out.update({n: total / count for n, (total, count) in zip(synced, sums) if count})
        return {n: float(v) for n, v in out.items()}

    def pop_epoch_metrics(self) -> dict[str, float]:
        """Sample-weighted means; evaluation metrics and sync_dist ones over all ranks' samples."""
        sums, self.epoch_sums = self.epoch_sums, {}
        sync, self.epoch_sync = self.epoch_sync, set()
        summed, self.epoch_summed = self.epoch_summed, set()
        objects, self.epoch_objects = self.epoch_objects, {}
        computed = {}
        for name in sorted(objects):  # each rank the same names in the same order: compute() syncs the ranks' states
            computed[name] = float(objects[name].compute())
            objects[name].reset()
        # every rank must reduce the same names in the same order, even one that logged none
        if self.runtime.world_size > 1:
            gathered = self.runtime.all_gather_object((sorted(sync), sorted(summed)))
            names = sorted(set().union(*(g[0] for g in gathered)))
            summed = set().union(*(g[1] for g in gathered))
        else:
            names = sorted(sync)
        local = {n: (float(s), w) for n, (s, w) in sums.items()}
        out = {n: s if n in summed else s / w for n, (s, w) in local.items() if w}
        if names:
            counts = self.runtime.strategy.traits.counts_metrics  # a model-parallel peer's copy counts once
            rows = [sums.get(n, [0.0, 0.0]) if counts else [0.0, 0.0] for n in names]
            totals = self.runtime.all_reduce(_as_tensor(rows, self.runtime.device), op="sum").tolist()
            out.update({n: s if n in summed else s / w for n, (s, w) in zip(names, totals) if w})
        return {**out, **computed}


def _metric_object(value: Any) -> bool:
    """A torchmetrics ``Metric`` (or one of a ``MetricCollection``'s): torchmetrics is asked only where a script
    imported it."""
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(value, torchmetrics.Metric)


def console(line: str) -> None:
    """A line for the user (rank 0 calls it), above a progress bar when one is drawn (tqdm redraws it below)."""
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def _step_line(step: int, max_steps: int, metrics: dict[str, Any]) -> str:
    """``step 4/6 | loss 2.31 | lr 0.0003 | ...``: the numbers of one step's record."""
    total = f"/{max_steps}" if max_steps > 0 else ""
    return " | ".join([f"step {step}{total}", *(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, float))])


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def _as_tensor(rows: list[list], device: torch.device) -> torch.Tensor:
    """Rows of tensors and numbers → one float64 tensor on ``device`` (one transfer, no host sync)."""
    return torch.stack(
        [torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in row]) for row in rows]
    )


class Throughput:
    """Samples/s, tokens/s, step-time mean/std and MFU over the window since the last report."""

    def __init__(
        self,
        world_size: int,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        data_parallel_size: int | None = None,
    ):
        self.world_size = world_size  # devices, for MFU
        #: ranks that see different samples: the global count is a rank's times this
        self.data_parallel_size = data_parallel_size or world_size
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.started = time.perf_counter()
        self.total_samples = self.total_tokens = 0  # since fit started: the closing summary's rate
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
        self.samples += samples * self.data_parallel_size
        self.tokens += (tokens or 0) * self.data_parallel_size
        self.total_samples += samples * self.data_parallel_size
        self.total_tokens += (tokens or 0) * self.data_parallel_size

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


@dataclass
class StepResult:
    """One optimizer step, as the loop hands it over."""

    step: int
    epoch: int
    loss: torch.Tensor | None  # this rank's step loss (mean over its micro-batches), on the device; None: not returned
    lr: float
    grad_norm: Any  # a tensor, a lazy norm (DeepSpeed's), or None without clipping
    samples: int  # this rank's samples in the step
    tokens: int
    skipped_steps: int = 0  # steps dropped so far for non-finite gradients


class MetricsLogger:
    def __init__(
        self, runtime, loggers: list[Logger], log_every_n_steps: int, print_steps: bool, straggler_threshold: float
    ):
        self.runtime = runtime
        self.loggers = loggers
        self.autolog_hparams = True  # the module's hyperparameters go to the loggers (Trainer(enable_autolog_hparams))
        self.log_every_n_steps = log_every_n_steps
        self.print_steps = print_steps  # a line per logged step when there is no progress bar
        self.collector = MetricCollector(runtime)
        self.throughput: Throughput | None = None
        self.monitor: SystemMonitor | None = None  # host/GPU readings (monitor.py), made when first needed
        self.timer: StepTimer | None = None  # this rank's step, in parts (stragglers.py), made when fit starts
        self.straggler_threshold = straggler_threshold
        self.straggler: Straggler | None = None  # the one named in the last window, if any
        self._window_first_step = 1
        self._suspect: tuple[int, int] | None = None  # (rank, first step) of windows in a row that found that rank
        #: the latest value of everything logged: what callbacks (ModelCheckpoint's monitor) read
        self.callback_metrics: dict[str, float] = {}
        self.logged_metrics: dict[str, Any] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        #: the training loss's one name on the console: the module's own (``train_loss``, prog_bar=True), else ``loss``
        self.loss_name = "loss"
        self.validation: dict[str, float] = {}  # the latest validation during fit, for the closing summary
        self.summarize = True  # the closing summary (``distrain verify``'s runs have their report instead)

    def start_fit(self, flops_per_token: float | None, run_config: dict | None, module=None) -> None:
        rt = self.runtime
        peak = rt.accelerator.peak_flops(rt.device, rt.precision.compute_dtype)
        if self.monitor is None:  # now: its CPU-utilization window starts with training
            self.monitor = SystemMonitor(rt.device, announce=rt.is_global_zero)
        self.throughput = Throughput(rt.world_size, flops_per_token, peak, rt.strategy.data_parallel_size)
        self.timer = StepTimer(rt.device)
        if rt.is_global_zero:
            # the run's config (the CLI's), else the module's save_hyperparameters(), as Lightning logs them
            params = run_config or dict(getattr(module, "hparams", None) or {})
            for lg in self.loggers:
                if params and self.autolog_hparams:
                    lg.log_hyperparams(params)
                if module is not None:
                    lg.log_graph(module)  # a logger asked to (TensorBoardLogger(log_graph=True)) draws it

    def logs_at(self, step: int, final: bool) -> bool:
        """Whether step ``step`` is a logging step (every ``log_every_n_steps``, and the final one)."""
        return final or step % self.log_every_n_steps == 0

    def step_done(self, result: StepResult, final: bool, max_steps: int) -> None:
        """After each optimizer step. Values are reduced across ranks only on logging steps (and the
        final one): one small all-reduce for the loss, one for the module's ``sync_dist`` values."""
        rt = self.runtime
        self.throughput.step(result.samples, result.tokens or None)
        self.timer.step_ended()
        logging_step = self.logs_at(result.step, final)
        logged = self.collector.pop_step_metrics(reduce=logging_step)
        if not logging_step:
            self.callback_metrics.update({**logged, **self.collector.aliases(logged)})
            return
        rt.accelerator.synchronize(rt.device)  # CUDA is async: time what really ran
        metrics = {
            "epoch": result.epoch,
            **({"loss": rt.all_reduce(result.loss).item()} if result.loss is not None else {}),
            "lr": result.lr,
            **logged,
            **self.throughput.compute(),
            **self.memory_stats(self.timer.window()),
        }
        metrics.update(self._stragglers(metrics.pop("step_parts", None), result.step))
        metrics.update(rt.strategy.metrics())
        if result.grad_norm is not None:
            metrics["grad_norm"] = float(result.grad_norm)
        if result.skipped_steps:
            metrics["skipped_steps"] = result.skipped_steps
        # one name for the training loss on the console: the module's own (e.g. train_loss, prog_bar=True) replaces
        # distrain's `loss` in the progress bar, the step lines and the closing summary (the loggers keep both)
        own = {k: v for k, v in logged.items() if k in self.collector.prog_bar}
        self.loss_name = next((k for k in own if k.endswith("loss")), "loss")
        self.progress_bar_metrics = {
            **({"loss": metrics["loss"]} if self.loss_name == "loss" and "loss" in metrics else {}),
            **({"tok/s": round(metrics["tokens_per_sec"])} if "tokens_per_sec" in metrics else {}),
            **own,
        }
        self.publish(metrics, result.step)
        if self.print_steps and rt.is_global_zero:
            # in the loggers, too many for one line (a straggler has a console line of its own)
            machine = ("mem", "host_", "gpu_", *PARTS, "straggler_")
            loss = {self.loss_name: metrics[self.loss_name]} if self.loss_name in metrics else {}
            rest = {k: v for k, v in metrics.items() if not k.startswith(machine) and k not in ("loss", *loss)}
            console(_step_line(result.step, max_steps, {**loss, **rest}))

    def validation_done(self, metrics: dict[str, Any], step: int, max_steps: int, epoch: int) -> None:
        """A validation during fit: to the loggers, and one line on the console (above the progress bar)."""
        self.publish(metrics, step, epoch=epoch)
        self.validation = {k: v for k, v in metrics.items() if isinstance(v, float)}
        if self.runtime.is_global_zero and self.validation:
            console(_step_line(step, max_steps, self.validation))

    def summary(self, ended: str, seconds: float, paths: dict[str, str | None]) -> str:
        """The closing lines of a fit: how it ``ended`` (``done at step 6``) and its wall time, the final training
        and validation losses, the rate over the whole fit, and where its files are (``paths``: name → path)."""
        values = {self.loss_name: self.callback_metrics.get(self.loss_name)}
        values.update({k: v for k, v in self.validation.items() if k.endswith("loss")})
        shown = [f"{k} {v:.4g}" for k, v in values.items() if isinstance(v, (int, float))]
        tp = self.throughput
        if tp is not None and tp.last > tp.started:
            rate, unit = (tp.total_tokens, "tokens/s") if tp.total_tokens else (tp.total_samples, "samples/s")
            shown.append(f"{rate / (tp.last - tp.started):,.0f} {unit}")
        lines = [f"distrain: {ended} in {_duration(seconds)}"]
        lines[0] += f": {', '.join(shown)}" if shown else ""
        width = max(map(len, paths), default=0)
        lines += [f"  {name:<{width}}  {path}" for name, path in paths.items() if path]
        return "\n".join(lines)

    def memory_stats(self, step_parts: list[float] | None = None) -> dict[str, Any]:
        """torch's memory numbers and the host/GPU readings of ``monitor.py``, and this rank's ``step_parts``
        (``StepTimer.window``) when given. On several ranks: the maximum over ranks under each plain name,
        ``_min``/``_mean`` beside it, ``mem_per_rank_mb`` (each rank's last torch memory number) and ``step_parts``
        (every rank's parts, for ``_stragglers``), all in one all-gather."""
        rt = self.runtime
        if self.monitor is None:
            self.monitor = SystemMonitor(rt.device, announce=rt.is_global_zero)
        torch_mem = rt.accelerator.memory_stats(rt.device)
        local = {**torch_mem, **self.monitor.sample(), **dict(zip(PARTS, step_parts or []))}
        if rt.world_size == 1:
            return {k: v for k, v in local.items() if v == v}  # NaN: not available here
        per_rank = rt.all_gather(torch.tensor(list(local.values()), dtype=torch.float64)).tolist()
        out: dict[str, Any] = across_ranks(list(local), per_rank)
        out["mem_per_rank_mb"] = [r[len(torch_mem) - 1] for r in per_rank]
        if step_parts:
            out["step_parts"] = [r[-len(PARTS) :] for r in per_rank]
        return out

    def _stragglers(self, per_rank: list[list[float]] | None, step: int) -> dict[str, Any]:
        """The straggler of the window that ends at ``step`` (``stragglers.py``), as metrics, once the same rank has
        been the slow one in windows in a row over ``PERSISTS_STEPS`` steps: a busy machine's noise moves from rank
        to rank and is never named. Rank 0 says so on the console when one is first named, when the same rank is
        slow for another cause (its data, then its compute), and when none is left."""
        first, self._window_first_step = self._window_first_step, step + 1
        found = find_straggler(per_rank, self.straggler_threshold) if per_rank else None
        same = found is not None and self._suspect is not None and self._suspect[0] == found.rank
        self._suspect = None if found is None else (found.rank, self._suspect[1] if same else first)
        since = self._suspect[1] if self._suspect else step
        named = found if found is not None and step - since + 1 >= PERSISTS_STEPS else None
        before, self.straggler = self.straggler, named
        if self.runtime.is_global_zero:
            if named is not None and (before is None or before.rank != named.rank):
                console(named.line(since, step))
            elif named is not None and before.cause != named.cause:
                console(named.line(first, step))
            elif named is None and before is not None:
                console(f"distrain: no straggler over steps {first}-{step} (rank {before.rank} caught up)")
        return named.metrics() if named is not None else {}

    def publish(self, metrics: dict[str, Any], step: int, to_loggers: bool = True, epoch: int | None = None) -> None:
        """``epoch``: the loggers' records carry it, as Lightning's do (a CSV's rows of validation metrics too)."""
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        self.callback_metrics.update({**numbers, **self.collector.aliases(numbers)})
        self.logged_metrics = metrics
        if to_loggers and self.runtime.is_global_zero:
            record = metrics if epoch is None else {"epoch": epoch, **metrics}
            for lg in self.loggers:
                lg.log_metrics(record, step)

    def finalize(self) -> None:
        if self.runtime.is_global_zero:
            for lg in self.loggers:
                lg.finalize()


def print_fit_summary(trainer, first_step: int, seconds: float) -> None:
    """The end of a fit on the console: how it ended, its numbers, and where its files are."""
    from distrain.callbacks import PlotSummary

    ended = f"done at step {trainer.global_step}"
    if trainer.preempted:
        ended = f"stopped by signal {trainer.preempted} at step {trainer.global_step} (`last` resumes it)"
    if first_step:
        ended += f" (resumed from step {first_step})"
    checkpoint = trainer.checkpoint_callback
    plot = next((c.last_path for c in trainer.callbacks if isinstance(c, PlotSummary)), None)
    events = next((lg.log_dir for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
    paths = {
        # Lightning's callback without save_last has no last_model_path (""): its best is on disk
        "checkpoint": (checkpoint.last_model_path or checkpoint.best_model_path) if checkpoint is not None else None,
        "plot": plot,
        "tensorboard": f"tensorboard --logdir {events}" if events is not None and events.is_dir() else None,
    }
    print(trainer.metrics.summary(ended, seconds, paths), flush=True)
