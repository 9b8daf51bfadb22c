"""Expert parallelism against FSDP and DDP alone: a tiny mixture-of-experts GPT on 2 and 4 CPU ranks (gloo).

    python benchmarks/moe_expert_parallel.py [--worlds 2 4] [--steps 8] [--warmup 3] [--quick]

The model is the built-in ``GPTLanguageModel`` (gpt-tiny: 4 blocks, width 128) with each block's MLP a mixture of 8
experts, top-2 routing; the experts are ~93% of its parameters. For each world size (all of its rows in one set of
ranks, one after the other): ``fsdp`` and ``ddp`` alone (EP 1), and with ``expert_parallel_size`` 2 and = world
(``Trainer(strategy=..., expert_parallel_size=N)``, ``distrain/parallel/expert_parallel.py``). Every rank trains
``--batch`` sequences of ``--seq-len`` bytes of the built-in corpus per step, so the global batch is the same for
every row of one world size.

Columns: the experts of each layer a rank holds (whole experts: under FSDP they are further sharded over the ranks
that hold the same ones); ``state MiB/rank``, the bytes of parameters + gradients + AdamW state a rank holds,
measured in the ranks from the tensors just before each optimizer step (local shards: a DTensor counts its
``to_local()``), the largest over steps and ranks, and the experts' part of it; tokens/s of the whole job, timed by a
callback on rank 0 from the end of the last warm-up step to the end of the last step (global tokens = world × batch
× seq-len per step, counted as the Trainer's logged ``tokens_per_sec`` counts them, a rank's tokens × data-parallel
size, but over the timed steps only: the Trainer's window here would include the warm-up); and both relative to
``fsdp`` EP 1 at the same world size (ratios within one run; tokens/s the median over ``--rounds``, its ratio the
median of each round's against fsdp EP 1 of the same round, the rounds' in parentheses). Not counted: activations,
and FSDP's transient all-gathered weights (with EP 1 each layer's whole experts are gathered for its forward and
backward; with EP a rank only ever materializes its own experts).

How to read it. DDP replicates the experts on every rank: EP = N divides their bytes by N. FSDP already shards
everything over the world, and with EP the experts are sharded over (EP ranks) × (ranks holding the same experts)
= the world again: the bytes of state per rank do not change with EP under FSDP, what changes is the communication
(an all-to-all of the routed tokens instead of an all-gather and reduce-scatter of the experts' weights) and the
transient gathered weights. Tokens/s on a shared 2-core CPU over gloo only say how the collectives' volume and
count compare here, not GPU speed. A footnote under the table names any row whose model is not the GPT as defined
(its output head no longer tied to the token embedding).

Measured on a 2-core CPU, 2026-11-29 (``--worlds 2 4 --steps 6 --warmup 3 --rounds 2``, batch 4 × 128; 71 s on
idle cores), abridged: each row's median tokens/s, its ratio the median of the rounds', and ``distrain plan``'s
tokens/s for the row on this machine's kept CPU rates (``planned_tokens_per_second``):

    | strategy | world | EP | experts/rank | state MiB/rank | tokens/s | vs fsdp EP 1 | planned | planned / measured |
    | --- | --- | --- | --- | --- | --- | --- | --- | --- |
    | fsdp | 2 | 1 | 8 | 34.42 | 4,854 | 1.00× | 8,308 | 1.71 |
    | fsdp | 2 | 2 | 4 | 34.42 | 4,669 | 0.97× | 6,518 | 1.40 |
    | ddp | 2 | 1 | 8 | 68.83 | 7,737 | 1.61× | 9,191 | 1.19 |
    | ddp | 2 | 2 | 4 | 36.83 | 6,633 | 1.38× | 6,600 | 0.99 |
    | fsdp | 4 | 1 | 8 | 17.21 | 5,080 | 1.00× | 9,177 | 1.81 |
    | fsdp | 4 | 2 | 4 | 17.21 | 4,395 | 0.86× | 7,935 | 1.81 |
    | fsdp | 4 | 4 | 2 | 17.21 | 4,744 | 0.93× | 8,219 | 1.73 |
    | ddp | 4 | 1 | 8 | 68.83 | 8,616 | 1.70× | 9,933 | 1.15 |
    | ddp | 4 | 4 | 2 | 20.83 | 6,817 | 1.34× | 8,205 | 1.20 |

Under DDP, EP = N divides the experts' share of a rank's state by N (64 → 32 → 16 MiB; the whole 68.8 → 20.8 MiB at
world 4); under FSDP it stays at 1/world with or without EP. (A first run of this benchmark found FSDP with EP
holding 0.12-0.25 MiB more: on that path, a model built in ``configure_model`` on the meta device, its output head
came out untied from the token embedding; fixed, and tested in tests/test_expert_parallel.py.) Speed on these 2
cores: DDP beats FSDP (the model is small, FSDP's per-layer gathers cost more than they save), and EP measured
0.79-0.96× the same strategy without it: its all-to-alls cost more here than the expert gathers they save.

The plan against it. The plan now says EP is slower too (0.72-0.90×); before the tokens' all-to-all was planned as
waited for (``timing.Collective.awaited``) it said 1.05-1.18×. Its absolute figures hold for DDP (0.99-1.20 of
measured) but not for FSDP over these stacked experts (1.40-1.81): that gap is the planner's, open (docs/plan.md).
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

N_EXPERTS, TOP_K = 8, 2


def rows_for(world: int, experts: int = N_EXPERTS) -> list[tuple[str, int]]:
    """(strategy, expert_parallel_size) of one world size's rows; an EP that does not divide the experts left out."""
    rows = [("fsdp", 1), ("fsdp", 2), ("fsdp", world), ("ddp", 1), ("ddp", world)]
    seen, out = set(), []
    for strategy, ep in rows:
        if (strategy, ep) not in seen and world % ep == 0 and experts % ep == 0:
            seen.add((strategy, ep))
            out.append((strategy, ep))
    return out


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _measure_callback():
    import distrain

    class Measure(distrain.Callback):
        """Just before each optimizer step: this rank's parameters, gradients and optimizer state (total, experts'
        part), the largest seen; at each step's end, the time."""

        def __init__(self):
            self.state = (0, 0)
            self.ends: list[float] = []

        def on_before_optimizer_step(self, trainer, module, optimizer):
            experts = {id(p) for name, p in module.named_parameters() if ".experts." in name}
            total = part = 0
            for p in module.parameters():
                held = _local_bytes(p) + (_local_bytes(p.grad) if p.grad is not None else 0)
                state = optimizer.state.get(p, {})
                held += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
                total += held
                part += held if id(p) in experts else 0
            self.state = max(self.state, (total, part))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())

    return Measure()


def _train(world: int, strategy: str, ep: int, args, train_set, root: str) -> dict:
    import distrain
    from distrain.models.lm import GPTLanguageModel

    measure = _measure_callback()
    trainer = distrain.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        expert_parallel_size=ep,
        max_steps=args.warmup + args.steps,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_plots=False,
        logger=False,
        log_every_n_steps=10_000,
        default_root_dir=root,
        callbacks=[measure],
        seed=0,
    )
    module = GPTLanguageModel(
        args.model, block_size=args.seq_len, n_experts=N_EXPERTS, top_k=TOP_K, lr_schedule="constant"
    )
    trainer.fit(module, DataLoader(train_set, batch_size=args.batch, shuffle=True, drop_last=True))
    ends = measure.ends[args.warmup - 1 :]
    tokens = (len(ends) - 1) * args.batch * args.seq_len * world
    return {
        "state": measure.state,
        "experts_per_rank": module.gpt.blocks[0].mlp.experts.fc.shape[0],  # a DTensor's shape: whole experts
        "tok_s": tokens / (ends[-1] - ends[0]),
        "tied": module.gpt.head.weight is module.gpt.tok_emb.weight,  # the GPT ties its embedding and output head
    }


def _rank(rank: int, world: int, rows: list[tuple[str, int]], args, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)  # up to 4 ranks on a few cores: one thread each
    from distrain.data import byte_datasets

    train_set, _ = byte_datasets("builtin:stdlib", args.seq_len, 1_000_000, 0.05)
    results: dict[tuple[str, int], list[dict]] = {row: [] for row in rows}
    with tempfile.TemporaryDirectory() as root:
        for round_ in range(args.rounds):  # every row once per round: drift in the machine's load hits them all
            for strategy, ep in rows:
                workdir = os.path.join(root, f"{strategy}{ep}-{round_}")
                results[(strategy, ep)].append(_train(world, strategy, ep, args, train_set, workdir))
    (Path(out) / f"{rank}.pkl").write_bytes(pickle.dumps(results))
    from distrain.distributed import shutdown

    shutdown()


def run_world(world: int, args) -> dict[tuple[str, int], dict]:
    """Every row of one world size in one set of ranks, ``--rounds`` times: the largest state over the ranks and
    rounds, rank 0's tokens/s of each round."""
    from distrain.cluster import find_free_port

    rows = rows_for(world)
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, rows, args, find_free_port(), out), nprocs=world, start_method="spawn")
        per_rank = [pickle.loads((Path(out) / f"{r}.pkl").read_bytes()) for r in range(world)]
    return {
        row: {
            "state": max(run["state"] for r in per_rank for run in r[row]),
            "experts_per_rank": per_rank[0][row][0]["experts_per_rank"],
            "tok_s": [run["tok_s"] for run in per_rank[0][row]],
            "tied": all(run["tied"] for r in per_rank for run in r[row]),
        }
        for row in rows
    }


def planned_tokens_per_second(world: int, strategy: str, ep: int, args) -> float:
    """What ``distrain plan`` predicts for the row on this machine (its CPU rates, as kept): the step's compute, the
    gradients' collectives and, with EP, the tokens' all-to-alls (``planner/models/replicated.py``)."""
    from distrain.planner import Job, ModelSpec, Option
    from distrain.planner.estimate import Estimator
    from distrain.planner.machine import resolve_hardware

    spec = ModelSpec.builtin_gpt(args.model, args.seq_len, n_experts=N_EXPERTS, top_k=TOP_K)
    job = Job(spec, args.batch, "32-true", world)
    experts = ep if ep > 1 else None
    option = (
        Option("fsdp", sharding="FULL_SHARD", experts=experts) if strategy == "fsdp" else Option("ddp", experts=experts)
    )
    step = Estimator(job).step_time(option, resolve_hardware(False, "32-true", world))
    return world * args.batch * args.seq_len / step.seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=8, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="each row this many times, in turn (median tokens/s)")
    parser.add_argument("--quick", action="store_true", help="world 2 only, one round of 3 timed steps after 2")
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds, args.steps, args.warmup, args.rounds = [2], 3, 2, 1
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--warmup, --steps and --rounds must be at least 1")

    start = time.perf_counter()
    planned = {(w, s, ep): planned_tokens_per_second(w, s, ep, args) for w in args.worlds for s, ep in rows_for(w)}
    results = {world: run_world(world, args) for world in args.worlds}
    mib = 2**20
    print(
        f"\n{args.model}, {N_EXPERTS} experts top-{TOP_K}, batch {args.batch}×{args.seq_len} per rank, "
        f"{args.warmup} warm-up + {args.steps} timed steps × {args.rounds} rounds, {os.cpu_count()} CPU cores, gloo, "
        "fp32 "
        f"({time.perf_counter() - start:.0f} s)\n"
    )
    print(
        "| strategy | world | EP | experts/rank | state MiB/rank | experts' MiB | vs fsdp EP 1 "
        "| tokens/s | vs fsdp EP 1 | planned tokens/s | planned / measured |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for world, rows in results.items():
        base = rows[("fsdp", 1)]
        for (strategy, ep), r in rows.items():
            total, experts = r["state"]
            # each round against fsdp EP 1 of the same round, then the median
            ratios = [t / b for t, b in zip(r["tok_s"], base["tok_s"])]
            rounds = f" ({' · '.join(f'{x:.2f}' for x in ratios)})" if len(ratios) > 1 else ""
            print(
                f"| {strategy} | {world} | {ep} | {r['experts_per_rank']} | {total / mib:.2f} | {experts / mib:.2f} "
                f"| {total / base['state'][0]:.2f}× | {statistics.median(r['tok_s']):,.0f} "
                f"| {statistics.median(ratios):.2f}×{rounds} | {planned[world, strategy, ep]:,.0f} "
                f"| {planned[world, strategy, ep] / statistics.median(r['tok_s']):.2f} |"
            )
    untied = [f"{s} EP {ep} (world {w})" for w, rows in results.items() for (s, ep), r in rows.items() if not r["tied"]]
    if untied:
        print(
            f"\nNot the same model: in {', '.join(untied)} the output head's weight is no longer the token embedding's "
            "(the GPT ties them); the rank holds, computes and updates both, which the bytes above include"
        )


if __name__ == "__main__":
    main()
