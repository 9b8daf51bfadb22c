"""Replica groups over a slow link: tokens/s and final loss of synchronous ``ddp_torchft`` against DiLoCo and local
SGD meeting every H steps, measured with the link between the groups rate-limited.

    sudo python benchmarks/slow_link.py [--rate 1gbit] [--steps 60] [--every 8] [--model gpt-mini]

Two replica groups of one rank each train the built-in GPT in a private network namespace. Its loopback, the only
link the groups share, is shaped with tc's token-bucket filter (``tbf``; this machine's kernel has no ``netem``),
so every byte between them (torchft's gloo all-reduce, its lighthouse and stores) passes at ``--rate``, both
directions together (loopback has one queue: a full-duplex link of ``--rate`` would carry twice as much; the
planner's column is asked for half the rate). A group of
one rank has no link inside it: the shaping falls on the cross-group traffic alone. Each way runs twice, with the
link shaped and unshaped, on the same seed, data and number of samples.

Per way, the table shows: tokens/s of the whole job over the steps after the first ``--warmup`` (wall clock between
those steps' log lines, meetings included), the final training loss (the mean of the last 5 steps, both groups'
ranks alike), the cross-group megabytes per step (distrain's ``cross_group_mb`` metric), and what ``distrain plan``
predicts for the same job with ``--inter-node-bandwidth`` at the shaped rate.

DiLoCo runs with outer momentum 0.5 (``distributed.outer_momentum``): the paper's 0.9 diverges on models this small.
Needs root (network namespaces, tc) and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = f"dtslow{os.getpid()}"
RATE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)bit$")
BITS = {"k": 1e3, "m": 1e6, "g": 1e9}


def _bytes_per_second(rate: str) -> float:
    found = RATE.match(rate)
    if not found:
        raise SystemExit(f"--rate {rate!r}: expected a number of kbit, mbit or gbit, e.g. 1gbit or 200mbit")
    return float(found.group(1)) * BITS[found.group(2)] / 8


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True)


def namespace_up(rate: str | None) -> None:
    _ip("netns", "add", NAMESPACE)
    _ip("netns", "exec", NAMESPACE, "ip", "link", "set", "lo", "up")
    if rate:  # burst: one 64 KiB TCP segment train; latency: how long a packet may queue before it is dropped
        shape = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", "256kb", "latency", "200ms"]
        _ip("netns", "exec", NAMESPACE, *shape)


def namespace_down() -> None:
    subprocess.run(["ip", "netns", "del", NAMESPACE], check=False, capture_output=True)


WAYS = {
    "synchronous (gradients every step)": [],
    "local SGD every H": ["distributed.semi_sync=local_sgd"],
    "DiLoCo every H": ["distributed.semi_sync=diloco", "distributed.outer_momentum=0.5"],
}


STEP_LINE = re.compile(r"step (\d+)/\d+ \|")


def train(out: Path, args, extra: list[str]) -> tuple[list[dict], dict[int, float]]:
    """The job's replica-0 metrics, and the wall-clock time each step's console line arrived."""
    command = [
        "ip", "netns", "exec", NAMESPACE, sys.executable, "-m", "distrain.cli", "train",
        "--model-name", args.model, "--strategy", "ddp_torchft", "--devices", "1",
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--max-steps", str(args.steps),
        "--output-dir", str(out), "distributed.replica_groups=2", f"distributed.sync_every={args.every}",
        "logging.progress_bar=false", "logging.log_every_n_steps=1", "logging.plot_summary=false",
        "logging.use_tensorboard=false", "training.val_check_interval=0", "checkpointing.save_every_n_steps=null",
        "checkpointing.export_hf=false", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    arrived: dict[int, float] = {}
    lines: list[str] = []
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + args.timeout
    for line in proc.stdout:
        lines.append(line)
        found = STEP_LINE.search(line)
        if found:
            arrived.setdefault(int(found.group(1)), time.monotonic())  # the first group to print it
        if time.monotonic() > deadline:
            proc.kill()
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(command)}\nfailed ({proc.returncode}):\n{''.join(lines)[-3000:]}")
    metrics = out / "replica_0" / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines() if line], arrived


def summarize(run: tuple[list[dict], dict[int, float]], args) -> dict:
    rows, arrived = run
    steps = [r for r in rows if "loss" in r and "step" in r]
    timed = sorted(s for s in arrived if s > args.warmup)
    if len(timed) < 2:
        raise SystemExit(f"only {len(timed)} step lines after step {args.warmup}: raise --steps")
    seconds = arrived[timed[-1]] - arrived[timed[0]]
    tokens = 2 * args.batch_size * args.seq_len * (len(timed) - 1)  # both groups' samples
    cross = [r["cross_group_mb"] for r in steps if "cross_group_mb" in r]
    return {
        "tokens_per_sec": tokens / seconds,
        "final_loss": statistics.fmean(r["loss"] for r in steps[-5:]),
        "cross_group_mb_per_step": (cross[-1] - cross[0]) / (len(cross) - 1) if len(cross) > 1 else None,
    }


def planned(args, extra: list[str], rate: str) -> float | None:
    """The planner's tokens/s for this way's row, the link between the groups at ``rate``."""
    command = [
        sys.executable, "-m", "distrain.cli", "plan", "--model-name", args.model, "--strategy", "ddp_torchft",
        "--devices", "1", "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--json",
        # on loopback both directions pass the one shaped queue: each direction gets half of --rate
        "--inter-node-bandwidth", str(_bytes_per_second(rate) / 2 / 1e9), "distributed.replica_groups=2",
        f"distributed.sync_every={args.every}", "training.activation_checkpointing=false", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DISTRAIN_PLAN_CACHE": "off"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        print(f"plan failed: {done.stderr[-500:]}", file=sys.stderr)
        return None
    rows = [r for r in json.loads(done.stdout)["rows"] if r["this_run"]]
    return rows[0]["tokens_per_second"] if rows else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit", help="the link between the groups (tc's units: 1gbit, 200mbit)")
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=8, help="steps left out of tokens/s (start-up, first meeting)")
    parser.add_argument("--every", type=int, default=8, help="H: steps between the groups' meetings")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--no-plan", action="store_true", help="skip the planner's prediction")
    args = parser.parse_args()
    _bytes_per_second(args.rate)
    if os.geteuid() != 0:
        raise SystemExit("slow_link.py needs root: it makes a network namespace and shapes its link with tc")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in WAYS.items():
            row = {"way": name}
            for shaped in (None, args.rate):
                namespace_down()
                namespace_up(shaped)
                try:
                    started = time.monotonic()
                    summary = summarize(train(Path(tmp) / f"{len(results)}-{shaped}", args, extra), args)
                    print(f"  {name}, link {shaped or 'unshaped'}: {summary} ({time.monotonic() - started:.0f} s)")
                finally:
                    namespace_down()
                row[shaped or "unshaped"] = summary
            row["plan"] = None if args.no_plan else planned(args, extra, args.rate)
            results.append(row)
    print(
        f"\n{args.model}, 2 replica groups × 1 rank, micro-batch {args.batch_size} × {args.seq_len} tokens, "
        f"{args.steps} steps (tokens/s over the steps after {args.warmup}), H = {args.every}, {os.cpu_count()} CPU "
        f"cores; the link between the groups: tc tbf at {args.rate}\n"
    )
    header = [
        "way", "tokens/s, unshaped", f"tokens/s at {args.rate}", f"planned at {args.rate}", "final loss",
        "cross-group MB/step",
    ]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in results:
        fast, slow = row["unshaped"], row[args.rate]
        plan = f"{row['plan']:,.0f}" if row["plan"] else "-"
        cross = slow["cross_group_mb_per_step"]
        cells = [
            row["way"], f"{fast['tokens_per_sec']:,.0f}", f"{slow['tokens_per_sec']:,.0f}", plan,
            f"{slow['final_loss']:.4f}", "-" if cross is None else f"{cross:.2f}",
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
