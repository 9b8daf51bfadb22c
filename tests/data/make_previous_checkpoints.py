"""Writes the checkpoints in tests/data/previous/ (run once, with the distrain of that time).

tests/test_compat.py resumes them with today's distrain: a checkpoint written by an earlier release
must keep resuming. Regenerate only when the format changes on purpose (and keep the old ones).

    OMP_NUM_THREADS=1 python tests/data/make_previous_checkpoints.py tests/data/previous  # as the tests run
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/helpers.py

import distrain  # noqa: E402
from helpers import TinyGPT, loader, make_trainer, run_ranks  # noqa: E402

STEPS = 3


def train(out: Path, strategy: str, devices: int) -> None:
    trainer, _ = make_trainer(out, strategy=strategy, devices=devices, max_steps=STEPS, accumulate_grad_batches=2,
                              gradient_clip_val=1.0, logger=False)
    distrain.seed_everything(0)
    trainer.fit(TinyGPT(dropout=0.1), loader(4))


def _fsdp_rank(rank: int, out: Path) -> None:
    train(out, "fsdp", 2)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    train(root / "single", "single", 1)
    run_ranks(_fsdp_rank, 2, root / "fsdp")
