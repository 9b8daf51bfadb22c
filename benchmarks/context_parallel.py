"""Long sequences on this machine: what context parallelism buys one rank.

For one process and for context parallelism over 2 and 4 ranks (``ModelParallelStrategy(context_parallel_size=N)``,
DeepSpeed-Ulysses or the ring, whichever the heads take, on gloo), each rank's measured peak of tensor memory over two
optimizer steps (every storage alive at once, ``plan_measure.StoragePeak``) at a few sequence lengths, one sequence per
step; from those, the longest sequence each layout trains within a fixed budget per rank (peak = a + b·T fitted through
the two longest lengths measured: activations grow linearly with the tokens a rank holds, and CPU SDPA keeps no T×T
matrix); and the tokens per second of the whole job at a length every layout fits (rank 0's wall time of the second
step).

    python benchmarks/context_parallel.py [--budget-mib 96] [--lengths 1024 2048 4096] [--heads 4]

The model is the built-in GPT at gpt-tiny's width (128) with 2 blocks; fp32 on CPU. Its 4 heads split over 2 and 4
ranks (Ulysses); ``--heads 1`` (the same parameters and attention FLOPs) splits over none: the ring runs it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int):
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, 256, (n, length + 1), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


def _measure(length: int, context: int, workdir: str, heads: int) -> tuple[int, float]:
    """This rank's peak tensor bytes over two steps at ``length`` tokens, and the second step's seconds."""
    from plan_measure import StoragePeak

    import distrain
    from distrain.models.gpt import GPT, GPTConfig

    class LongGPT(distrain.Module):
        def __init__(self):
            super().__init__()
            self.gpt = None

        def configure_model(self):
            if self.gpt is None:
                self.gpt = GPT(GPTConfig(n_layer=2, n_head=heads, n_embd=128, block_size=length))

        def training_step(self, batch, batch_idx):
            return self.gpt(*batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Clock(distrain.Callback):  # the second step: from the first step's end to its own
        def __init__(self):
            self.ends = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())

    clock = Clock()
    strategy = (
        "single"
        if context == 1
        else distrain.ModelParallelStrategy(tensor_parallel_size=1, context_parallel_size=context)
    )
    tracker = StoragePeak()
    with tracker:
        trainer = distrain.Trainer(
            accelerator="cpu",
            devices=context,
            strategy=strategy,
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_plots=False,
            default_root_dir=workdir,
            callbacks=[clock],
        )
        trainer.fit(LongGPT(), torch.utils.data.DataLoader(_Tokens(2, length), batch_size=1))
    return tracker.peak_bytes(), clock.ends[1] - clock.ends[0]


def _rank(rank: int, context: int, lengths: list[int], port: int, out: str, heads: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(context)
    )
    os.environ.update(LOCAL_WORLD_SIZE=str(context), OMP_NUM_THREADS="1")
    results = []
    with tempfile.TemporaryDirectory() as work:
        for length in lengths:
            results.append(_measure(length, context, work, heads))
    torch.save(results, os.path.join(out, f"{rank}.pt"))


def run(context: int, lengths: list[int], heads: int = 4) -> list[tuple[int, float]]:
    """Per length: the largest peak over the ranks, and rank 0's step seconds."""
    from distrain.cluster import find_free_port

    with tempfile.TemporaryDirectory() as out:
        if context == 1:
            _rank_results = [[_measure(length, 1, out, heads) for length in lengths]]
        else:
            arguments = (context, lengths, find_free_port(), out, heads)
            mp.start_processes(_rank, arguments, nprocs=context, start_method="spawn")
            _rank_results = [torch.load(os.path.join(out, f"{r}.pt")) for r in range(context)]
    return [(max(r[i][0] for r in _rank_results), _rank_results[0][i][1]) for i in range(len(lengths))]


def longest_within(lengths: list[int], peaks: list[int], budget: int) -> int:
    """The longest sequence whose peak stays within ``budget``: the line through the two longest lengths measured."""
    (t1, p1), (t2, p2) = sorted(zip(lengths, peaks))[-2:]
    slope = (p2 - p1) / (t2 - t1)
    return int((budget - (p2 - slope * t2)) / slope) if slope > 0 else 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=float, default=96.0)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--heads", type=int, default=4, help="attention heads of the 128-wide model")
    args = parser.parse_args(argv)
    from distrain.parallel.context_parallel import engine_for

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    budget = int(args.budget_mib * 2**20)
    results = {n: run(n, args.lengths, args.heads) for n in args.contexts}

    print(
        f"peak tensor memory per rank (MiB) and tokens/s of the job, {args.heads} head(s), {os.cpu_count()} CPU cores, "
        "gloo, fp32"
    )
    header = "| layout | " + " | ".join(f"{t} tokens" for t in args.lengths)
    print(header + f" | longest within {args.budget_mib:g} MiB/rank |")
    print("|---" * (len(args.lengths) + 2) + "|")
    base = results[args.contexts[0]]
    for n, rows in results.items():
        cells = [f"{peak / 2**20:.1f} MiB, {t / seconds:,.0f} tok/s" for t, (peak, seconds) in zip(args.lengths, rows)]
        longest = longest_within(args.lengths, [p for p, _ in rows], budget)
        name = "one process" if n == 1 else f"CP={n} ({engine_for([args.heads], n, 1, 'the model')})"
        print(f"| {name} | " + " | ".join(cells) + f" | {longest:,} tokens |")
    print()
    for n, rows in list(results.items())[1:]:
        ratios = ", ".join(f"{b[0] / r[0]:.2f}×" for r, b in zip(rows, base))
        print(f"CP={n}: peak per rank {ratios} smaller than one process's at {', '.join(map(str, args.lengths))}")


if __name__ == "__main__":
    main()
