"""Per-rank memory and speed of each strategy on the built-in GPT, 2 CPU ranks (gloo).

    python benchmarks/strategies.py [--model gpt-small] [--steps 12]

For DDP, each FSDP sharding, each DeepSpeed ZeRO stage, a 2-stage pipeline (GPipe, 1F1B) and tensor
parallelism (TP=2): bytes of parameters, gradients and optimizer state held by one rank (measured from
the tensors, just before the optimizer step; for ZeRO just after it, its fp32 master partitions counted
as optimizer state), their sum relative to DDP, the rank's peak RSS (fresh processes per row), and
tokens/s relative to DDP. Every row trains the same global batch per step: the two ranks of a pipeline
or a TP group see the same samples, so they take twice the per-rank batch (a pipeline as 2 micro-batches).

Tokens/s on CPU say nothing about GPU speed, least of all for model parallelism: a pipeline's stages
wait for each other (the bubble) and TP's per-layer collectives run over gloo on shared cores here,
where on GPUs they overlap with compute over NVLink. The bytes are what carries over.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

import distrain
from distrain.cluster import find_free_port
from distrain.data import byte_datasets
from distrain.models.gpt import Block
from distrain.models.lm import GPTLanguageModel

WARMUP = 3
ROWS = [
    ("ddp", lambda: "ddp"),
    ("fsdp FULL_SHARD", lambda: distrain.FSDPStrategy(sharding_strategy="FULL_SHARD")),
    ("fsdp SHARD_GRAD_OP", lambda: distrain.FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")),
    ("fsdp NO_SHARD", lambda: distrain.FSDPStrategy(sharding_strategy="NO_SHARD")),
    ("fsdp FULL_SHARD + act. ckpt", lambda: distrain.FSDPStrategy(activation_checkpointing_policy={Block})),
    ("fsdp FULL_SHARD + cpu offload", lambda: distrain.FSDPStrategy(cpu_offload=True)),
    ("deepspeed ZeRO-1", lambda: "deepspeed_stage_1"),
    ("deepspeed ZeRO-2", lambda: "deepspeed_stage_2"),
    ("deepspeed ZeRO-2 + offload opt.", lambda: "deepspeed_stage_2_offload"),
    ("deepspeed ZeRO-3", lambda: "deepspeed_stage_3"),
    ("deepspeed ZeRO-3 + offload both", lambda: "deepspeed_stage_3_offload"),
    ("pipeline 2 stages, GPipe", lambda: distrain.PipelineStrategy(stages=2, schedule="GPipe")),
    ("pipeline 2 stages, 1F1B", lambda: distrain.PipelineStrategy(stages=2, schedule="1F1B")),
    ("tensor parallel 2", lambda: distrain.ModelParallelStrategy(tensor_parallel_size=2)),
]
#: rows whose two ranks hold one model replica: (per-rank batch factor, micro-batches per step)
ONE_REPLICA = {"pipeline 2 stages, GPipe": (1, 2), "pipeline 2 stages, 1F1B": (1, 2), "tensor parallel 2": (2, 1)}


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


class Measure(distrain.Callback):
    def __init__(self):
        self.model_state = None
        self.times = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if hasattr(optimizer, "optimizer"):  # a DeepSpeed ZeRO optimizer: measured after its step
            return
        if self.model_state is None or trainer.global_step == 1:
            params = [p for p in module.parameters()]
            opt = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
            self.model_state = (
                sum(_local_bytes(p) for p in params),
                sum(_local_bytes(p.grad) for p in params if p.grad is not None),
                sum(_local_bytes(v) for v in opt),
            )

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter())
        optimizer = trainer.optimizers[0]
        if hasattr(optimizer, "optimizer") and trainer.global_step == 2:
            self.model_state = _zero_bytes(module, optimizer)


def _zero_bytes(module, zero_optimizer) -> tuple[int, int, int]:
    """ZeRO's per-rank state after a step: the rank's parameters (its partition under stage 3),
    no gradients (freed after the step; ZeRO-2/3 only ever hold their partition's), and the
    optimizer side: fp32 master partitions plus their Adam moments."""
    params = sum(_local_bytes(getattr(p, "ds_tensor", p)) for p in module.parameters())
    # stage 3 hands its fp32 partitions to the inner optimizer only during step(): ask ZeRO itself
    masters = (
        getattr(zero_optimizer, "fp32_partitioned_groups_flat", None) or zero_optimizer.single_partition_of_fp32_groups
    )
    moments = [
        v
        for s in zero_optimizer.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim()
    ]
    return params, 0, sum(_local_bytes(t) for t in masters + moments)


def rank_main(rank, row, args, port, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
    )
    name, make = ROWS[row]
    factor, accumulate = ONE_REPLICA.get(name, (1, 1))
    batch = args.batch * factor
    train_set, _ = byte_datasets("builtin:stdlib", args.seq_len, 1_000_000, 0.05)
    measure = Measure()
    trainer = distrain.Trainer(
        accelerator="cpu",
        strategy=make(),
        devices=2,
        max_steps=args.steps,
        accumulate_grad_batches=accumulate,
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[measure],
        log_every_n_steps=1000,
    )
    torch.manual_seed(0)
    module = GPTLanguageModel(args.model, block_size=args.seq_len, lr_schedule="constant")
    trainer.fit(module, DataLoader(train_set, batch_size=batch, shuffle=True, drop_last=True))
    steady = measure.times[WARMUP:]
    tokens_per_step = batch * accumulate * args.seq_len * trainer.data_parallel_size  # the same for every row
    tok_s = (len(steady) - 1) * tokens_per_step / (steady[-1] - steady[0])
    peak_rss = trainer.runtime.accelerator.memory_stats(trainer.runtime.device)["mem_peak_rss_mb"]
    if rank == 0:
        queue.put((name, *measure.model_state, peak_rss, tok_s))
    trainer.runtime.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    results = []
    for row in range(len(ROWS)):  # fresh processes per row: peak RSS is per process
        mp.start_processes(rank_main, args=(row, args, find_free_port(), queue), nprocs=2, start_method="spawn")
        results.append(queue.get())
    mb = 2**20
    ddp_state = sum(results[0][1:4])
    ddp_tok = results[0][5]
    print(
        f"\n{args.model}, 2 CPU ranks (gloo), batch {args.batch}×{args.seq_len} per rank, {args.steps} steps; "
        "per-rank figures\n"
    )
    header = (
        f"{'strategy':<30} | {'params MB':>9} | {'grads MB':>8} | {'optim MB':>8} | {'state vs DDP':>12} | "
        f"{'peak RSS MB':>11} | {'tok/s':>7} | {'vs DDP':>6}"
    )
    print(header)
    print("-" * len(header))
    for name, p, g, o, rss, tok in results:
        print(
            f"{name:<30} | {p / mb:>9.1f} | {g / mb:>8.1f} | {o / mb:>8.1f} | {(p + g + o) / ddp_state:>12.3f} | "
            f"{rss:>11.0f} | {tok:>7.0f} | {tok / ddp_tok:>6.3f}"
        )


if __name__ == "__main__":
    main()
