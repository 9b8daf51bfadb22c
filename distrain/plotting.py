"""Pictures of runs: loss, learning rate, throughput, MFU, memory and the gradient norm (a mixture of experts: the
experts' load balance) against the optimizer step,
read from each run's ``metrics.jsonl``. Several runs overlay (one colour each), e.g. the same job
under ddp / fsdp / zero-3, or a run and its resumed continuation.

``distrain plot RUN_DIR [RUN_DIR ...] -o out.png`` draws it; every Trainer run also writes it to
``<output_dir>/plots/summary.png`` when training ends (``distrain.callbacks.PlotSummary``).
Matplotlib's object API is used (no pyplot): nothing global is touched, no display is needed.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
FIGSIZE = (15.0, 8.0)  # inches; at DPI this is the PNG's size in pixels
DPI = 100


def metrics_file(run: str | os.PathLike) -> Path:
    """A run directory (or its metrics.jsonl itself) → the metrics file."""
    path = Path(run)
    return path if path.is_file() else path / METRICS_FILE


def read_metrics(run: str | os.PathLike) -> list[dict[str, Any]]:
    path = metrics_file(run)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics file (a run directory holds {METRICS_FILE})")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(path.read_text().splitlines()):  # a run killed mid-write: the last line is cut
                break
            raise ValueError(f"{path}:{n}: not a JSON line") from None
    return records


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key``, sorted by step. A step logged twice (a resumed run repeats the
    steps after its checkpoint) keeps the later record: the run that continued."""
    by_step: dict[int, float] = {}
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and "step" in r:
            by_step[int(r["step"])] = float(v)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _labels(runs: list[str | os.PathLike]) -> list[str]:
    """Short names that tell the runs apart: the directory name, with its parent when needed."""
    paths = [metrics_file(r).resolve().parent for r in runs]
    names = [p.name for p in paths]
    if len(set(names)) < len(names):
        names = [f"{p.parent.name}/{p.name}" for p in paths]
    return names


# (title, y label, [(key, line style, what it is)], scale): memory in MiB is drawn in GiB
_MEMORY = [
    ("mem_max_allocated_mb", "-", "peak allocated (torch)"),
    ("mem_reserved_mb", "--", "reserved (torch)"),
    ("gpu_mem_used_mb", ":", "used (NVML)"),
    ("mem_peak_rss_mb", "-", "peak RSS (process)"),
]


def plot_runs(
    runs: list[str | os.PathLike], output: str | os.PathLike, labels: list[str] | None = None, title: str | None = None
) -> Path:
    """Draw ``runs`` (run directories or metrics files) into the PNG ``output``; returns its path."""
    fig = draw_runs(runs, labels, title)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, output)  # a reader never sees half a PNG
    return output


def draw_runs(runs: list[str | os.PathLike], labels: list[str] | None = None, title: str | None = None):
    """The figure of ``runs`` (a matplotlib ``Figure``, not yet saved)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    if not runs:
        raise ValueError("plot_runs: no run to draw")
    data = [read_metrics(r) for r in runs]
    labels = list(labels) if labels else _labels(runs)
    colours = [f"C{i % 10}" for i in range(len(runs))]
    has = lambda key: any(series(d, key)[0] for d in data)  # noqa: E731

    fig = Figure(figsize=FIGSIZE, dpi=DPI)  # a fixed layout: constrained layout triples the drawing time
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3, sharex=True)
    ax_loss, ax_lr, ax_tps, ax_mfu, ax_mem, ax_last = axes.flat

    def draw(ax, key, scale=1.0, style="-", marker=None):
        for d, colour in zip(data, colours):
            steps, values = series(d, key)
            if steps:
                ax.plot(steps, [v * scale for v in values], style, color=colour, marker=marker, markersize=4)

    def styles_legend(ax, entries, loc="best"):
        handles = [Line2D([], [], color="0.3", linestyle=s, marker=m) for _, s, m in entries]
        ax.legend(handles, [name for name, _, _ in entries], fontsize=8, loc=loc)

    # loss: training (every logged step) and validation (markers)
    draw(ax_loss, "loss")
    draw(ax_loss, "val_loss", style="--", marker="o")
    ax_loss.set(title="Loss", ylabel="loss (as logged: mean per token/sample)")
    styles_legend(ax_loss, [("train", "-", None), ("validation", "--", "o")])

    draw(ax_lr, "lr")
    ax_lr.set(title="Learning rate", ylabel="learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))

    throughput = "tokens_per_sec" if has("tokens_per_sec") else "samples_per_sec"
    draw(ax_tps, throughput)
    ax_tps.set(
        title="Throughput (all ranks)",
        ylabel="tokens / s" if throughput == "tokens_per_sec" else "samples / s",
    )

    if has("mfu"):
        draw(ax_mfu, "mfu", scale=100)
        ax_mfu.set(title="Model FLOPs utilization", ylabel="MFU (% of the device's peak)")
    else:  # CPUs and unknown GPUs have no listed peak: show the step time instead
        draw(ax_mfu, "step_time", scale=1000)
        ax_mfu.set(title="Step time (MFU unknown for this device)", ylabel="time per optimizer step (ms)")

    shown = [(key, style, name) for key, style, name in _MEMORY if has(key)]
    for key, style, _ in shown:
        draw(ax_mem, key, scale=1 / 1024, style=style)
    ax_mem.set(title="Memory (the fullest rank)", ylabel="GiB")
    ax_mem.set_ylim(bottom=0)  # growth reads as a share of what is used
    if shown:
        styles_legend(ax_mem, [(name, style, None) for _, style, name in shown], loc="lower right")

    if has("moe_load_max_over_mean"):  # a mixture of experts: a run collapsing onto one expert shows here
        draw(ax_last, "moe_load_max_over_mean")
        shown = [("busiest expert / mean", "-", None)]
        if has("moe_aux_loss"):  # the built-in GPT's; a Hugging Face model's is transformers' own affair
            draw(ax_last, "moe_aux_loss", style="--")
            shown.append(("balance loss", "--", None))
        ax_last.set(title="Expert load (the least balanced layer)", ylabel="1.0 when even")
        styles_legend(ax_last, shown)
    elif has("grad_norm"):
        draw(ax_last, "grad_norm")
        ax_last.set(title="Gradient norm (before clipping)", ylabel="L2 norm of all gradients")
    else:
        draw(ax_last, "host_cpu_percent")
        ax_last.set(title="CPU utilization (the busiest rank)", ylabel="% of one core")

    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        if not ax.lines:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="0.5")
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    run_handles = [Line2D([], [], color=c, linewidth=3) for c in colours]
    fig.legend(run_handles, labels, loc="upper right", ncols=min(len(labels), 6), fontsize=10, frameon=False)
    fig.suptitle(title or "distrain", x=0.06, ha="left", fontsize=14)
    fig.subplots_adjust(left=0.06, right=0.985, bottom=0.07, top=0.9, wspace=0.25, hspace=0.22)
    return fig
