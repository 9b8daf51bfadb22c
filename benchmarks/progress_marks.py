"""What hang diagnosis costs a training step: the per-phase progress record (distrain/distributed/watch.py).

    python benchmarks/progress_marks.py [--marks 20000]

Two gloo ranks; rank 0 hosts the rendezvous store (as under distrain's own launcher), rank 1
writes to it over TCP. Each row is the mean time of one ``Runtime.progress`` call that enters a
new phase (a store write), and of one that repeats the current phase (accumulation micro-steps:
no write). The Trainer enters 5 phases per optimizer step.
"""

from __future__ import annotations

import argparse
import os
import time

import torch.multiprocessing as mp

from distrain.cluster import find_free_port

PHASES = ("forward/backward", "optimizer step", "logging", "stop-signal check", "callbacks after the step")


def _rank(rank: int, port: int, marks: int, out: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
    )
    from distrain.distributed import shutdown
    from distrain.runtime import Runtime

    rt = Runtime(accelerator="cpu", strategy="ddp", devices=2)
    rt.setup_environment()
    rt.barrier()
    start = time.perf_counter()
    for i in range(marks):
        rt.mark_phase(i // len(PHASES), PHASES[i % len(PHASES)])
    new_phase = (time.perf_counter() - start) / marks
    start = time.perf_counter()
    for _ in range(marks):
        rt.mark_phase(None, PHASES[-1])
    same_phase = (time.perf_counter() - start) / marks
    rt.barrier()
    out[rank] = (new_phase, same_phase)
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--marks", type=int, default=20000)
    args = parser.parse_args()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_rank, args=(find_free_port(), args.marks, out), nprocs=2, start_method="spawn")
        print(f"{'rank':>22} | {'new phase':>10} | {'same phase':>10} | {'per step (5 phases)':>19}")
        for rank in sorted(out.keys()):
            new, same = out[rank]
            who = "0 (hosts the store)" if rank == 0 else "1 (store over TCP)"
            print(f"{who:>22} | {new * 1e6:>8.2f}us | {same * 1e6:>8.2f}us | {5 * new * 1e6:>17.1f}us")


if __name__ == "__main__":
    main()
