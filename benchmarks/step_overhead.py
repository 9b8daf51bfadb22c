"""distrain's per-step host cost against a hand-written loop, on a model so small that a step takes
well under a millisecond: what is left is the loop's own bookkeeping (hooks, metrics, the non-finite
check, the hang watch), which a large GPU step hides only when it never waits for the device.

    python benchmarks/step_overhead.py [--steps 400] [--rounds 3] [--device cpu|cuda]

Both runners train the same MLP with the same fused AdamW (``distrain.optim.adamw``) on the same
batches. Rounds alternate hand-written / distrain so drift in machine load hits both. The table
shows each runner's median step time, distrain's overhead over the loop in µs per step (each round
against the loop run just before it, then the median), and the
host reads of tensor values per step (``item()``, ``float()``, ``bool()``, ``tolist()``, ``numpy()``):
on a GPU each is a host–device sync, the thing that lets the device run dry between steps. Only
steady-state steps count: the first ``--warmup`` and every logging step are left out of both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distrain
from distrain.optim import adamw

HOST_READS = ("item", "__float__", "__int__", "__bool__", "tolist", "numpy")
WIDTH, BATCH = 64, 16


class HostReads:
    """Counts the host reads of tensor values while ``counting`` is set."""

    def __init__(self):
        self.counting, self.count = False, 0
        self._originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def __enter__(self):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, self._counted(original))
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)

    def _counted(self, original):
        def read(tensor, *args, **kwargs):
            self.count += self.counting
            return original(tensor, *args, **kwargs)

        return read


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))


def data(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(steps * BATCH, WIDTH, generator=g), torch.randn(steps * BATCH, 1, generator=g))


def counted_steps(args) -> range:
    """The steps (1-based) both runners time: after the warm-up, none of distrain's logging steps."""
    return range(args.warmup + 1, args.steps + 1)


def handwritten(args, reads: HostReads) -> tuple[list[float], float]:
    device = torch.device(args.device)
    model = mlp().to(device)
    opt = adamw(model, lr=1e-3, weight_decay=0.0)
    stamps, counted, reads_in = {}, set(counted_steps(args)) - logging_steps(args), 0
    for step, (x, y) in enumerate(DataLoader(data(args.steps), batch_size=BATCH), start=1):
        reads.count, reads.counting = 0, step in counted
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        reads.counting = False
        reads_in += reads.count
        stamps[step] = time.perf_counter()
    return step_times(stamps, counted), reads_in / len(counted)


class Regression(distrain.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return adamw(self.net, lr=1e-3, weight_decay=0.0)


class Stamps(distrain.Callback):
    """The end of each step, and the host reads inside the counted ones (from the step's first hook to its last)."""

    def __init__(self, counted: set[int], reads: HostReads):
        self.counted, self.reads, self.stamps, self.reads_in = counted, reads, {}, 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.reads.count, self.reads.counting = 0, trainer.global_step + 1 in self.counted

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.reads.counting = False
        self.reads_in += self.reads.count
        self.stamps[trainer.global_step] = time.perf_counter()


def logging_steps(args) -> set[int]:
    """distrain's logging steps and the ones right after (whose time includes the logging): out of both runners."""
    every = args.log_every
    return {s for s in range(1, args.steps + 1) if s % every in (0, 1)}


def with_distrain(args, reads: HostReads, root: str) -> tuple[list[float], float]:
    counted = set(counted_steps(args)) - logging_steps(args)
    stamps = Stamps(counted, reads)
    trainer = distrain.Trainer(
        accelerator=args.device,
        devices=1,
        strategy="single",
        max_steps=args.steps,
        log_every_n_steps=args.log_every,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[stamps],
    )
    trainer.fit(Regression(), DataLoader(data(args.steps), batch_size=BATCH))
    return step_times(stamps.stamps, counted), stamps.reads_in / len(counted)


def step_times(stamps: dict[int, float], counted: set[int]) -> list[float]:
    return [stamps[s] - stamps[s - 1] for s in sorted(counted) if s - 1 in stamps]


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a step this small runs fastest on one thread, and alike in both runners
    rows = {"hand-written loop": ([], []), "distrain Trainer (defaults)": ([], [])}
    with HostReads() as reads, tempfile.TemporaryDirectory() as root:
        for _ in range(args.rounds):
            for name, run in zip(rows, (lambda: handwritten(args, reads), lambda: with_distrain(args, reads, root))):
                times, per_step = run()
                rows[name][0].append(statistics.median(times))
                rows[name][1].append(per_step)
    hand = rows["hand-written loop"][0]
    print(f"\n{args.device}, MLP {WIDTH} wide, batch {BATCH}, {args.steps} steps × {args.rounds} rounds (median step)")
    print("| runner | µs/step (rounds) | overhead µs/step (rounds) | host reads/step |\n|---|---|---|---|")
    for name, (times, per_step) in rows.items():
        # each round's distrain run against the loop run just before it: drift in the machine's speed cancels
        paired = [(t - h) * 1e6 for t, h in zip(times, hand)]
        rounds = " · ".join(f"{t * 1e6:.0f}" for t in times)
        overhead = f"{statistics.median(paired):+.0f} ({' · '.join(f'{p:+.0f}' for p in paired)})"
        print(f"| {name} | {statistics.median(times) * 1e6:.0f} ({rounds}) | {overhead} | {max(per_step):.2f} |")


if __name__ == "__main__":
    main()
