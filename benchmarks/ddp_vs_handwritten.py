"""distrain's DDP Trainer vs a hand-written DistributedDataParallel loop, same workload, same run.

    python benchmarks/ddp_vs_handwritten.py [--model gpt-tiny] [--steps 60] [--rounds 3]

Both train the same GPT on the built-in byte corpus on 2 CPU ranks (gloo), each rank using
cores/2 threads. Rounds alternate hand-written / distrain so drift in machine load hits both;
the table shows tokens/s per round (steady state: the first steps of each run are excluded)
and the median ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import distrain
from distrain.cluster import find_free_port
from distrain.data import byte_datasets
from distrain.models.gpt import GPT, gpt_config
from distrain.models.lm import GPTLanguageModel
from distrain.optim import adamw

WARMUP = 5


def handwritten(args, train_set) -> float:
    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(gpt_config(args.model, block_size=args.seq_len)))
    # the optimizer distrain's GPT module builds (fused AdamW where torch has it): the ratio measures the loop
    opt = adamw(model.module, lr=1e-3, weight_decay=0.0)
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch, sampler=sampler, drop_last=True)
    times = []
    for step, (x, y) in enumerate(loader):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter())
        if step + 1 == args.steps:
            break
    return _tokens_per_sec(times, args)


class StepTimes(distrain.Callback):
    def __init__(self):
        self.times = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter())


def with_distrain(args, train_set) -> float:
    torch.manual_seed(0)
    timer = StepTimes()
    trainer = distrain.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_steps=args.steps,
        gradient_clip_val=1.0,
        log_every_n_steps=50,
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[timer],
    )
    module = GPTLanguageModel(
        args.model, block_size=args.seq_len, learning_rate=1e-3, weight_decay=0.0, lr_schedule="constant"
    )
    trainer.fit(module, DataLoader(train_set, batch_size=args.batch, shuffle=True, drop_last=True))
    return _tokens_per_sec(timer.times, args)


def _tokens_per_sec(times, args) -> float:
    steady = times[WARMUP:]
    tokens = (len(steady) - 1) * args.batch * args.seq_len * dist.get_world_size()
    return tokens / (steady[-1] - steady[0])


def rank_main(rank, args, port, results):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    dist.init_process_group("gloo")
    train_set, _ = byte_datasets("builtin:stdlib", args.seq_len, 2_000_000, 0.05)
    rows = []
    for _ in range(args.rounds):
        hand = handwritten(args, train_set)
        ours = with_distrain(args, train_set)
        rows.append((hand, ours))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(rank_main, args=(args, find_free_port(), results), nprocs=2, start_method="spawn")
    rows = results.get()
    print(
        f"\n{args.model}, 2 CPU ranks (gloo), batch {args.batch}×{args.seq_len} per rank, "
        f"{args.steps} steps/run (first {WARMUP} excluded)\n"
    )
    print(f"{'round':>5} | {'hand-written tok/s':>18} | {'distrain tok/s':>14} | {'ratio':>6}")
    print("-" * 54)
    for i, (hand, ours) in enumerate(rows):
        print(f"{i + 1:>5} | {hand:>18,.0f} | {ours:>14,.0f} | {ours / hand:>6.3f}")
    ratio = statistics.median(o / h for h, o in rows)
    print(f"\nmedian ratio distrain / hand-written: {ratio:.3f}")


if __name__ == "__main__":
    main()
