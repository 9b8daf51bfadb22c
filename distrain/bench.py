"""``distrain bench``: tokens/s, step time and MFU of the built-in GPT sizes under each strategy.

Each (size, strategy) row runs in a fresh ``distrain bench --one`` process group (the same code
path as ``distrain train``: Trainer, strategy, precision), on random tokens, timing the optimizer
steps after a warm-up. On a GPU it trains in bf16-mixed and MFU is against the GPU's listed dense
bf16 peak; on a CPU, in fp32, and MFU is against this machine's measured fp32 matmul rate (the
best a CPU core does on one large matmul), marked with ``*``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_SIZES = ("gpt-tiny", "gpt-mini")
DEFAULT_STRATEGIES = ("single", "ddp", "fsdp", "deepspeed_stage_3")


def bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="distrain bench", description="tokens/s, step time and MFU of the built-in GPT sizes per strategy"
    )
    p.add_argument(
        "--sizes",
        nargs="+",
        default=list(DEFAULT_SIZES),
        help="built-in GPT sizes, or folders holding a Hugging Face causal LM's config.json",
    )
    p.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES))
    p.add_argument("--devices", type=int, help="ranks for multi-process strategies (default: every local device)")
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch per rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step (a pipeline's)")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (allocation, compilation)")
    p.add_argument("--precision", help="default: bf16-mixed on a GPU, 32-true on a CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile (training.compile)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--one", nargs=2, metavar=("SIZE", "STRATEGY"), help=argparse.SUPPRESS)  # a row's process
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def _hf_config_dir(size: str) -> bool:
    return (Path(size) / "config.json").is_file()


def main(args: argparse.Namespace) -> int:
    import torch  # here, not at the top: `distrain bench --help` answers without loading torch

    if args.one:
        return run_one(args)
    from distrain.models.gpt import GPT_SIZES

    unknown = [s for s in args.sizes if s not in GPT_SIZES and not _hf_config_dir(s)]
    if unknown:
        print(
            f"distrain: error: unknown size {unknown[0]!r}; choose from {', '.join(GPT_SIZES)}, or a folder with a "
            "Hugging Face causal LM's config.json",
            file=sys.stderr,
        )
        return 2
    from distrain.strategies import registry

    gpu = torch.cuda.is_available()
    precision = args.precision or ("bf16-mixed" if gpu else "32-true")
    devices = args.devices or (torch.cuda.device_count() if gpu else min(2, os.cpu_count() or 1))
    print(
        f"distrain bench: {'GPU ' + torch.cuda.get_device_name() if gpu else 'CPU'}, {precision}, "
        f"{devices} rank(s) for multi-process strategies, micro-batch {args.batch_size} × {args.seq_len} tokens, "
        f"{args.steps} timed steps after {args.warmup}{', compiled' if args.compile else ''}",
        flush=True,
    )
    header = f"{'model':<10} {'strategy':<20} {'ranks':>5} {'tokens/s':>11} {'step ms':>9} {'MFU':>7}"
    print(header)
    print("-" * len(header), flush=True)
    rows = []
    for size in args.sizes:
        for strategy in args.strategies:
            ranks = 1 if registry.runs_one_process(strategy) else devices
            row = _run_row(args, size, strategy, precision, ranks)
            rows.append(row)
            if "error" in row:
                print(f"{size:<10} {strategy:<20} {row['ranks']:>5}  failed: {row['error']}", flush=True)
                continue
            mfu = f"{100 * row['mfu']:.1f}%{'*' if row['peak_measured'] else ''}" if row.get("mfu") else "-"
            print(
                f"{size:<10} {strategy:<20} {row['ranks']:>5} {row['tokens_per_sec']:>11,.0f} "
                f"{1000 * row['step_time']:>9.1f} {mfu:>7}",
                flush=True,
            )
    if any(r.get("peak_measured") for r in rows):
        print("* MFU against this CPU's measured fp32 matmul rate (it has no listed peak)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


def _run_row(args, size: str, strategy: str, precision: str, ranks: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "row.json"
        cmd = [
            sys.executable, "-m", "distrain.cli", "bench", "--one", size, strategy, "--result", str(result),
            "--devices", str(ranks), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--precision", precision,
            "--accumulate", str(args.accumulate),
        ]  # fmt: skip
        if args.compile:
            cmd.append("--compile")
        env = {**os.environ, "DISTRAIN_BENCH_DIR": tmp}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        if done.returncode != 0 or not result.is_file():
            lines = [ln for ln in (done.stderr or done.stdout).strip().splitlines() if ln.strip()]
            error = lines[-1] if lines else f"ended with {_exit_status(done.returncode)} and no output"
            return {"size": size, "strategy": strategy, "ranks": ranks, "error": error}
        return json.loads(result.read_text())


def _exit_status(code: int) -> str:
    """``exit code 1``, or ``SIGKILL`` with what usually sends it."""
    if code >= 0:
        return f"exit code {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    return name + (" (killed: the machine ran out of memory? see dmesg)" if name == "SIGKILL" else "")


class _StepTimer:
    """Wall time of each optimizer step on rank 0 (the device synchronized first)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.times: list[float] = []

    def mark(self) -> None:
        self.runtime.accelerator.synchronize(self.runtime.device)
        self.times.append(time.perf_counter())


def run_one(args) -> int:
    import torch  # here, not at the top: `distrain bench --help` answers without loading torch
    from torch.utils.data import DataLoader, Dataset

    import distrain
    from distrain.models.lm import GPTLanguageModel

    size, strategy = args.one

    hf = _hf_config_dir(size)
    vocab = 256
    if hf:  # a model the built-in sizes never were: a Hugging Face causal LM from its config, weights initialized
        from distrain.hf import models
        from distrain.hf.tasks import TASK_MODULES, config_dict

        hf_config = models.load_config(size)
        vocab = hf_config.vocab_size

    class RandomTokens(Dataset):
        def __init__(self, n: int):
            g = torch.Generator().manual_seed(0)
            self.data = torch.randint(0, vocab, (n, args.seq_len + 1), generator=g)

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            if hf:  # full-length samples: the planner's batch
                return {"input_ids": self.data[i, :-1]}
            return self.data[i, :-1], self.data[i, 1:]

    class Timer(distrain.Callback):
        def on_fit_start(self, trainer, module):
            self.timer = _StepTimer(trainer.runtime)
            self.timer.mark()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.timer.mark()

        def on_train_end(self, trainer, module):  # the job's ranks: ddp_torchft's replica groups all count
            self.ranks = len(trainer.strategy.all_gather_job_object(trainer.global_rank))

    timer = Timer()
    total = args.warmup + args.steps
    trainer = distrain.Trainer(
        accelerator="auto",
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=total,
        accumulate_grad_batches=args.accumulate,
        log_every_n_steps=total,
        default_root_dir=os.environ.get("DISTRAIN_BENCH_DIR", tempfile.gettempdir()),
        callbacks=[timer],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_plots=False,
        compile=args.compile,
    )
    if hf:
        module = TASK_MODULES["causal_lm"](model_name=size, hf_config=config_dict(hf_config), pretrained=False)
    else:
        module = GPTLanguageModel(model_name=size, block_size=args.seq_len, total_steps=total, lr_schedule="constant")
    n = args.batch_size * trainer.world_size * args.accumulate * (total + 1)
    trainer.fit(module, DataLoader(RandomTokens(n), batch_size=args.batch_size, shuffle=True, drop_last=True))
    if not trainer.is_global_zero or trainer.strategy.data_parallel_rank != 0:  # one row for the job
        return 0
    steps = np_diff(timer.timer.times)[args.warmup :]
    step_time = statistics.median(steps)
    # tensor-parallel ranks and pipeline stages share their samples: only data-parallel ranks add tokens
    tokens_per_sec = args.batch_size * args.accumulate * args.seq_len * trainer.data_parallel_size / step_time
    rt = trainer.runtime
    peak = rt.accelerator.peak_flops(rt.device, rt.precision.compute_dtype)
    measured = peak is None and rt.device.type == "cpu"
    if measured:
        peak = cpu_matmul_flops(torch.get_num_threads())
    flops = module.flops_per_token()
    row = {
        "size": size,
        "strategy": strategy,
        "ranks": timer.ranks,
        "precision": args.precision,
        "compile": args.compile,
        "tokens_per_sec": tokens_per_sec,
        "step_time": step_time,
        "mfu": tokens_per_sec * flops / (peak * timer.ranks) if peak else None,
        "peak_flops_per_rank": peak,
        "peak_measured": measured,
        "device": torch.cuda.get_device_name() if rt.device.type == "cuda" else "cpu",
    }
    Path(args.result).write_text(json.dumps(row))
    return 0


def np_diff(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def cpu_matmul_flops(threads: int, n: int = 1024, repeats: int = 5) -> float:
    """The fp32 FLOP/s of a large square matmul with ``threads`` threads: a CPU's practical peak."""
    import torch  # here, not at the top: `distrain bench --help` answers without loading torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        best = min(_timed(lambda: a @ b) for _ in range(repeats))
        return 2 * n**3 / best
    finally:
        torch.set_num_threads(previous)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
