"""How long a checkpoint save stalls training: synchronous against ``async_save`` (DCP's ``async_save``).

    python benchmarks/async_save.py [--width 4096 --layers 10 --steps 12]

One process on the CPU, an MLP big enough that a synchronous save takes over a second (10 × 4096² weights:
168M parameters, 2 GB with AdamW's state). Each run trains ``--steps`` steps and saves once after step 2 the way
``ModelCheckpoint`` does (``CheckpointManager.save``); the next save or the end of the run commits a background
one (``complete_pending``), here timed after the last step. The stall is the time the loop spends inside those two
calls: for a synchronous save, the whole write; for an asynchronous one, the copy into host memory and whatever of
the write the remaining steps did not hide. The table prints both and their ratio (the goal: ≤ 10%).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distrain


class MLP(distrain.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class TimedSave(distrain.Callback):
    """Saves once after step ``at`` and commits it after the last step, timing both calls."""

    def __init__(self, at: int, root: str):
        self.at, self.root = at, root
        self.save_s = self.commit_s = 0.0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            start = time.perf_counter()
            trainer.checkpoints.save(f"{self.root}/step-{self.at}")
            self.save_s = time.perf_counter() - start
        if trainer.global_step == trainer.max_steps:
            start = time.perf_counter()
            trainer.checkpoints.complete_pending()
            self.commit_s = time.perf_counter() - start


def run(background: bool, width: int, layers: int, steps: int) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory(dir=".") as root:
        timer = TimedSave(2, root)
        trainer = distrain.Trainer(
            accelerator="cpu",
            strategy="single",
            max_steps=steps,
            async_save=background,
            callbacks=[timer],
            enable_checkpointing=False,
            logger=False,
            enable_progress_bar=False,
            enable_plots=False,
            default_root_dir=root,
        )
        data = DataLoader(TensorDataset(torch.randn(steps * 8, width)), batch_size=8)
        start = time.perf_counter()
        trainer.fit(MLP(width, layers), data)
        return timer.save_s, timer.commit_s, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    params = args.layers * (args.width**2 + args.width)
    gib = params * 12 / 2**30  # weights, gradients and two AdamW moments, fp32
    print(f"MLP {args.layers} × {args.width}²: {params / 1e6:.0f}M parameters, {gib:.1f} GiB with AdamW")
    rows = {name: run(name == "async", args.width, args.layers, args.steps) for name in ("sync", "async")}
    print(f"{'save':>6} | {'in save()':>9} | {'at commit':>9} | {'stall':>6} | {'run':>6}")
    for name, (save_s, commit_s, total) in rows.items():
        print(f"{name:>6} | {save_s:>8.2f}s | {commit_s:>8.2f}s | {save_s + commit_s:>5.2f}s | {total:>5.1f}s")
    sync_stall, async_stall = sum(rows["sync"][:2]), sum(rows["async"][:2])
    print(f"async stall / sync save: {async_stall / sync_stall:.1%}")


if __name__ == "__main__":
    main()
