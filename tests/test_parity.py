"""Same seed + same global batch ⇒ same losses, whatever the strategy and world size."""

import pytest

import distrain
from helpers import TinyGPT, loader, make_trainer, run_ranks

STEPS = 8


def _train(tmp, strategy, devices, per_rank_batch, accumulate):
    trainer, rec = make_trainer(
        tmp,
        strategy=strategy,
        devices=devices,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=1.0,
        enable_checkpointing=False,
        logger=False,
    )
    distrain.seed_everything(0)
    module = TinyGPT()
    trainer.fit(module, loader(per_rank_batch), loader(4, n=30, shuffle=False))
    return rec.losses, trainer.callback_metrics["val_loss"]


def _ddp_rank(rank, tmp, k):
    return _train(tmp, "ddp", k, per_rank_batch=4, accumulate=1)


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3])
def test_single_process_accumulation_equals_ddp(tmp_path, k):
    single_losses, single_val = _train(tmp_path / "single", "single", 1, per_rank_batch=4, accumulate=k)
    results = run_ranks(_ddp_rank, k, tmp_path / "ddp", k)
    for ddp_losses, ddp_val in results:
        assert len(ddp_losses) == len(single_losses) == STEPS
        for a, b in zip(single_losses, ddp_losses):
            assert abs(a - b) <= 1e-5 * abs(a), (single_losses, ddp_losses)
        # the validation set (30 samples) splits unevenly over 3 ranks: still the exact mean
        assert abs(single_val - ddp_val) <= 1e-5 * abs(single_val)
    assert single_losses[-1] < single_losses[0]
