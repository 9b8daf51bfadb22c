"""torch.compile on the built-in GPT: compile time and per-step speed against eager, in one process
(CPU here, the GPU when there is one; bf16 autocast on a GPU). The same switch as
``training.compile`` / ``Trainer(compile=True)``: under single/DDP the whole network is compiled,
under FSDP each block (``--per-block`` measures that).

    python benchmarks/compile_speed.py [--sizes gpt-tiny gpt-mini] [--steps 10] [--per-block]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from distrain.models.gpt import GPT, Block, gpt_config
from distrain.optim import adamw


def run(size: str, compiled: bool, per_block: bool, steps: int, device: torch.device, batch: int, seq: int):
    torch.manual_seed(0)
    torch._dynamo.reset()  # each row compiles from scratch (the on-disk inductor cache may still help)
    model = GPT(gpt_config(size, block_size=seq)).to(device)
    if compiled:
        targets = [m for m in model.modules() if isinstance(m, Block)] if per_block else [model]
        for m in targets:
            m.forward = torch.compile(m.forward)
    opt = adamw(model, 1e-3, 0.1)
    x = torch.randint(0, 256, (batch, seq), device=device)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        with autocast:
            loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[2:])  # first step (compiles), steady state


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["gpt-tiny", "gpt-mini"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--per-block", action="store_true", help="compile each block (the FSDP way)")
    ap.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}; batch {args.batch} × {args.seq}; {args.steps} steps")
    print(f"{'model':<10} {'eager ms/step':>14} {'compiled ms/step':>17} {'speed-up':>9} {'compile s':>10}")
    for size in args.sizes:
        eager_first, eager = run(size, False, args.per_block, args.steps, device, args.batch, args.seq)
        first, compiled = run(size, True, args.per_block, args.steps, device, args.batch, args.seq)
        print(
            f"{size:<10} {eager * 1e3:>14.1f} {compiled * 1e3:>17.1f} {eager / compiled:>8.2f}x "
            f"{first - eager_first:>10.1f}"
        )


if __name__ == "__main__":
    main()
