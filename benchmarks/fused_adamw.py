"""AdamW step time: torch's for-each implementation against its fused kernel, on this machine's
CPU (and on CUDA when present), for the built-in GPT sizes. Decides distrain's default
(``distrain.optim.fused_adamw_default``): fused where it is not slower.

    python benchmarks/fused_adamw.py [--sizes gpt-tiny gpt-mini gpt-small] [--steps 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from distrain.models.gpt import GPT, gpt_config


def step_time(model: torch.nn.Module, fused: bool, steps: int, device: torch.device) -> float:
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-3, fused=fused, foreach=None if fused else True)
    for _ in range(3):  # state allocation and warm-up
        opt.step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["gpt-tiny", "gpt-mini", "gpt-small"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (a rank's share of the cores)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {args.threads} CPU thread(s); median of {args.steps} optimizer steps")
    print(f"{'device':<6} {'model':<10} {'params':>10} {'for-each ms':>12} {'fused ms':>10} {'fused/for-each':>15}")
    for device in devices:
        for size in args.sizes:
            torch.manual_seed(0)
            model = GPT(gpt_config(size)).to(device)
            n = sum(p.numel() for p in model.parameters())
            foreach = step_time(model, False, args.steps, device)
            fused = step_time(model, True, args.steps, device)
            print(
                f"{device.type:<6} {size:<10} {n / 1e6:>9.1f}M {foreach * 1e3:>12.2f} {fused * 1e3:>10.2f} "
                f"{fused / foreach:>15.2f}"
            )


if __name__ == "__main__":
    main()
