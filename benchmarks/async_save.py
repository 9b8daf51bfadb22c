"""How long a checkpoint save stalls training: synchronous against ``async_save`` (DCP's ``async_save``).

    python benchmarks/async_save.py [--width 4096 --layers 10 --steps 12]

One process on the CPU, an MLP big enough that a synchronous save takes over a second (10 × 4096² weights:
168M parameters, 2 GB with AdamW's state). Each run trains ``--steps`` steps and saves after steps 2 and 7 the way
``ModelCheckpoint`` does (``CheckpointManager.save``: it first commits a background save still pending); the end of
the run commits the last one (``complete_pending``). The stall of a save is the time the loop spends in those calls:
for a synchronous save, the whole write; for an asynchronous one, the copy into host memory and whatever of the
previous write the steps between did not hide. The first asynchronous save also pays for allocating its host
buffers (page faults: DCP's stager keeps them, keyed by the live tensors, for every later save). The table prints
each save's stall and the ratio of the later ones (the goal: ≤ 10%).
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


SAVE_AT = (2, 7)


class TimedSave(distrain.Callback):
    """Saves after each step of ``SAVE_AT`` and commits the last save after the last step, timing each call."""

    def __init__(self, root: str):
        self.root = root
        self.stalls: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        start = time.perf_counter()
        if trainer.global_step in SAVE_AT:
            trainer.checkpoints.save(f"{self.root}/step-{trainer.global_step}")
        elif trainer.global_step == trainer.max_steps:
            trainer.checkpoints.complete_pending()
        else:
            return
        self.stalls.append(time.perf_counter() - start)


def run(background: bool, width: int, layers: int, steps: int) -> tuple[list[float], float]:
    with tempfile.TemporaryDirectory(dir=".") as root:
        timer = TimedSave(root)
        trainer = distrain.Trainer(
            accelerator="cpu",
            strategy="single",
            devices=1,
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
        return timer.stalls, time.perf_counter() - start


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
    print(f"{'save':>6} | {'step ' + str(SAVE_AT[0]):>8} | {'step ' + str(SAVE_AT[1]):>8} | {'end':>6} | {'run':>6}")
    for name, (stalls, total) in rows.items():
        first, second, end = stalls
        print(f"{name:>6} | {first:>7.2f}s | {second:>7.2f}s | {end:>5.2f}s | {total:>5.1f}s")
    print(f"async stall / sync save, step {SAVE_AT[1]}: {rows['async'][0][1] / rows['sync'][0][1]:.1%}")
    first = rows["async"][0][0] / rows["sync"][0][0]
    print(f"async stall / sync save, step {SAVE_AT[0]} (host buffers allocated): {first:.1%}")


if __name__ == "__main__":
    main()
