"""The loop a user would write by hand, on the row ``distrain bench`` measures: the same built-in GPT, random
tokens, micro-batch and sequence, bf16 autocast on a GPU, ``torch.compile`` when asked, the fused AdamW with the
same parameter groups (``distrain.optim.adamw``), and the same clock (the device synchronized at each step's end,
the median step after the warm-up). Prints one line, and the row as JSON with ``--json``, for the ratio
``distrain bench`` / hand-written (issue 59's table; ``scripts/gpu_session.sh`` runs both).

    python benchmarks/handwritten_gpt.py --size gpt-1.3b --batch-size 8 --seq-len 2048 --compile
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from distrain.models.gpt import GPT, gpt_config
from distrain.optim import adamw


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="gpt-124m")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    config = gpt_config(args.size, block_size=args.seq_len)
    model = GPT(config).to(device)
    optimizer = adamw(model, 1e-3, 0.01)  # GPTLanguageModel's defaults, which distrain bench trains
    step = torch.compile(model) if args.compile else model
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    total = args.warmup + args.steps
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, config.vocab_size, (args.batch_size * total, args.seq_len + 1), generator=g)
    stamps = []
    for x in DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True):
        x = x.to(device, non_blocking=True)
        with autocast:
            loss = step(x[:, :-1], x[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
    step_time = statistics.median(b - a for a, b in zip(stamps[args.warmup :], stamps[args.warmup + 1 :]))
    row = {
        "runner": "hand-written",
        "size": args.size,
        "compile": args.compile,
        "tokens_per_sec": args.batch_size * args.seq_len / step_time,
        "step_time": step_time,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    print(f"hand-written {args.size}{' compile' if args.compile else ''}: {row['tokens_per_sec']:,.0f} tokens/s")
    if args.json:
        Path(args.json).write_text(json.dumps(row))


if __name__ == "__main__":
    main()
