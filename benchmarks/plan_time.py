"""The planner's predicted step time against the measured one, per strategy, on this machine.

Each measured row is a ``distrain bench`` row (a fresh process group through the real Trainer, the
median optimizer step after a warm-up); the prediction is ``distrain plan``'s for the same job, with
this machine's rates measured just before (``timing.cpu_hardware``). Ratios are taken in one run. The
strategies are measured ``--rounds`` times, every other pass in reverse order, and each ratio is against the
mean: on a machine that drifts within a run, a row measured later runs slower (GPT-2 on 2 CPU ranks: about
10% between the first position and the last), and one order alone would charge that to the model.

    python benchmarks/plan_time.py [--sizes gpt-mini gpt-small ./gpt2-config-dir] [--devices 2] [--batch-size 8]
                                   [--measure]

A size may be a folder holding a Hugging Face causal LM's ``config.json`` (``--sizes``): a model none of the
built-in sizes is, planned from its config and measured with its weights initialized.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from distrain.bench import _hf_config_dir, _run_row, bench_parser
from distrain.planner.estimate import Estimator, Job
from distrain.planner.machine import resolve_hardware
from distrain.planner.model_stats import ModelSpec
from distrain.planner.plan import option_for_run

STRATEGIES = (
    "single", "ddp", "fsdp", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3", "model_parallel", "pipeline"
)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["gpt-mini", "gpt-small"])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (a pipeline's)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="passes over the strategies, every other one in reverse order; each measured step time is their mean",
    )
    p.add_argument("--measure", action="store_true", help="measure this machine's rates again (and keep them)")
    a = p.parse_args()
    gpu = torch.cuda.is_available()
    precision = "bf16-mixed" if gpu else "32-true"
    bench_args = bench_parser().parse_args(
        ["--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--steps", str(a.steps)]
        + ["--warmup", str(a.warmup), "--accumulate", str(a.accumulate)]
    )
    rates = {}
    for ranks in sorted({1 if s == "single" else a.devices for s in a.strategies}):  # threads per rank differ
        hw = resolve_hardware(gpu, precision, ranks, measure=a.measure)
        rates[ranks] = hw
        busy = ""
        if hw.blocking_collective_seconds:  # what a collective costs between computations (tensor parallel's)
            busy = f"; between computations {hw.blocking_bandwidth / 1e9:.2f} GB/s + "
            busy += f"{hw.blocking_collective_seconds * 1e6:.0f} us/call"
        print(f"rates with {ranks} rank(s): {hw.source}: matmul {hw.matmul_flops / 1e9:.1f} GFLOP/s, "
              f"memory {hw.memory_bandwidth / 1e9:.1f} GB/s, {hw.op_seconds * 1e6:.1f} us/op, "
              f"link {hw.intra_bandwidth / 1e9:.2f} GB/s + {hw.collective_seconds * 1e6:.0f} us/call"
              + busy)  # fmt: skip
    header = (
        f"{'model':<10} {'strategy':<18} {'ranks':>5} {'predicted ms':>12} {'(compute+opt+comm)':>22}"
        f" {'measured ms':>11} {'pred/meas':>9}"
    )
    print(header + "\n" + "-" * len(header), flush=True)
    worst = 0.0
    for size in a.sizes:
        if _hf_config_dir(size):  # a Hugging Face model the built-in sizes never were
            spec = ModelSpec.huggingface(size, a.seq_len, task="causal_lm")
        else:
            spec = ModelSpec.builtin_gpt(size, a.seq_len)
        predicted, measured, errors = {}, {s: [] for s in a.strategies}, {}
        for strategy in a.strategies:
            ranks = 1 if strategy == "single" else a.devices
            job = Job(spec, a.batch_size, precision, ranks, accumulate=a.accumulate, gpu=gpu)
            predicted[strategy] = Estimator(job).step_time(option_for_run(strategy, job), rates[ranks])
        for turn in range(a.rounds):  # every other pass in reverse: a row measured later runs slower on a machine
            for strategy in a.strategies if turn % 2 == 0 else a.strategies[::-1]:  # that drifts; the mean evens it
                ranks = 1 if strategy == "single" else a.devices
                row = _run_row(bench_args, size, strategy, precision, ranks)
                if "error" in row:
                    errors[strategy] = row["error"]
                else:
                    measured[strategy].append(row["step_time"])
        for strategy in a.strategies:
            ranks, p = 1 if strategy == "single" else a.devices, predicted[strategy]
            parts = f"{p.compute * 1e3:.0f}+{p.optimizer * 1e3:.0f}+{p.communication * 1e3:.0f}"
            first = f"{size:<10} {strategy:<18} {ranks:>5} {p.seconds * 1e3:>12.0f} {parts:>22}"
            if strategy in errors or not measured[strategy]:
                print(f"{first}  failed: {errors.get(strategy)}")
                continue
            mean = sum(measured[strategy]) / len(measured[strategy])
            ratio = p.seconds / mean
            worst = max(worst, abs(ratio - 1))
            each = " / ".join(f"{t * 1e3:.0f}" for t in measured[strategy])
            print(f"{first} {mean * 1e3:>11.0f} {ratio:>9.2f}   (passes: {each})", flush=True)
    print(f"largest error: {100 * worst:.0f}% (goal: within 25%)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
