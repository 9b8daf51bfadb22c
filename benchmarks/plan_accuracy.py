"""The memory planner's prediction against the measured peak, per rank, on 2 CPU ranks (gloo).

    python benchmarks/plan_accuracy.py                 # the full grid (about an hour on 2 cores)
    python benchmarks/plan_accuracy.py --grid ci       # the cases the test suite asserts
    python benchmarks/plan_accuracy.py --grid pipeline [--world 4]   # pipeline schedules, per stage
    python benchmarks/plan_accuracy.py --models gpt-tiny tiny-llama --strategies ddp zero3

Measured: torch's MemTracker in real mode around ``Trainer.fit`` (2 optimizer steps), the largest
peak of tensor memory over the ranks (every tensor from building the model to the last step; not
RSS). Predicted: ``distrain plan``'s peak for the same run, made without allocating the model.
ZeRO runs use small buckets (hidden² elements, HF's rule for "auto") so the model, not the
buckets, is what is measured; ``--default-buckets`` adds ZeRO rows with DeepSpeedStrategy's
default 2e8-element buckets (1.5 GiB of fp32 buffers per rank, allocated whole).
"""

from __future__ import annotations

import argparse
import tempfile
import time

from plan_measure import ACCURACY_CASES, PIPELINE_CASES, Case, hf_dirs, measure_in_processes, predict

MODELS = ("gpt-tiny", "gpt-mini", "gpt-small", "tiny-llama", "tiny-bert")
STRATEGIES = ("ddp", "fsdp:FULL_SHARD", "fsdp:SHARD_GRAD_OP", "zero1", "zero2", "zero3")
BATCHES = {"gpt-tiny": (4, 16), "gpt-mini": (2, 8), "gpt-small": (2, 8), "tiny-llama": (4, 16), "tiny-bert": (4, 16)}
HIDDEN = {"gpt-tiny": 128, "gpt-mini": 384, "gpt-small": 512, "tiny-llama": 32, "tiny-bert": 32}


def full_grid(models, strategies, default_buckets: bool) -> list[Case]:
    cases = []
    for model in models:
        for strategy in strategies:
            if (model, strategy) == ("tiny-bert", "zero3"):
                continue  # BERT's weight init indexes the padding row zero.Init has partitioned away (IndexError)
            for ac in (False, True):
                for b in BATCHES[model]:
                    bucket = HIDDEN[model] ** 2 if strategy.startswith("zero") else None
                    cases.append(Case(model, strategy, ac, b, bucket=bucket))
        if default_buckets:
            cases += [
                Case(model, s, False, BATCHES[model][0])
                for s in strategies
                if s.startswith("zero") and (model, s) != ("tiny-bert", "zero3")
            ]
    # DeepSpeed last: its engines leave global state (activation checkpointing config) behind
    return sorted(cases, key=lambda c: c.strategy.startswith("zero"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--grid", choices=("full", "ci", "pipeline"), default="full")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    parser.add_argument("--default-buckets", action="store_true")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument(
        "--measured",
        metavar="OUTPUT",
        help="reuse the measured column of an earlier run's printed table (predictions are made anew)",
    )
    args = parser.parse_args()
    cases = {"ci": ACCURACY_CASES, "pipeline": PIPELINE_CASES.get(args.world, [])}.get(args.grid)
    if cases is None:
        cases = full_grid(args.models, args.strategies, args.default_buckets)
    mb = 2**20
    print(f"\n{args.world} CPU ranks (gloo), seq 128 tokens, fp32, 2 optimizer steps; per-rank peak of tensor memory\n")
    header = f"{'configuration':<46} | {'predicted MiB':>13} | {'measured MiB':>12} | {'error':>7}"
    print(header)
    print("-" * len(header), flush=True)
    errors, measure_s, predict_s = [], 0.0, 0.0
    with tempfile.TemporaryDirectory() as workdir:
        hf = hf_dirs(workdir)
        # fresh ranks per model and engine: each process then holds a bounded number of finished runs
        chunks: dict[tuple, list[Case]] = {}
        for case in cases:
            chunks.setdefault((case.model, case.strategy.startswith("zero")), []).append(case)
        earlier = _measured_in(args.measured) if args.measured else {}
        for chunk in chunks.values():
            start = time.perf_counter()
            if all(c.label in earlier for c in chunk):
                measured = [[earlier[c.label]] for c in chunk]
            else:
                measured = measure_in_processes(chunk, args.world, hf, workdir)
            measure_s += time.perf_counter() - start
            for case, peaks in zip(chunk, measured):
                start = time.perf_counter()
                pred = predict(case, args.world, hf).peak
                predict_s += time.perf_counter() - start
                meas = max(peaks)
                err = (pred - meas) / meas
                errors.append(abs(err))
                print(f"{case.label:<46} | {pred / mb:>13.2f} | {meas / mb:>12.2f} | {100 * err:>+6.1f}%", flush=True)
    mean = sum(errors) / len(errors)
    print(
        f"\n{len(cases)} configurations: largest error {100 * max(errors):.1f}%, mean {100 * mean:.1f}%; "
        f"measuring took {measure_s:.0f} s, predicting {predict_s:.0f} s"
    )


def _measured_in(path: str) -> dict[str, int]:
    """label → measured bytes, from a table this script printed."""
    out = {}
    for line in open(path):
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 4 and cells[2].replace(".", "").isdigit():
            out[cells[0]] = int(float(cells[2]) * 2**20)
    return out


if __name__ == "__main__":
    main()
