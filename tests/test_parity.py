"""Same seed + same global batch ⇒ same losses, whatever the strategy and world size."""

import pytest

import distrain
from helpers import TinyGPT, loader, make_trainer, run_ranks

STEPS = 8


def _train(tmp, strategy, devices, per_rank_batch, accumulate, experts=0):
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
    module = TinyGPT(n_experts=experts)
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


def _mixture_ranks(rank, tmp):
    return {s: _train(tmp / s, s, 2, per_rank_batch=4, accumulate=1, experts=4) for s in ("ddp", "fsdp")}


@pytest.mark.slow
def test_a_mixture_of_experts_under_ddp_and_fsdp_equals_one_process(tmp_path):
    """The GPT with 4 experts per block, top-2 routing, its load-balancing loss in the loss. The loss is taken per
    sequence, so it does not depend on which sequences share a micro-batch: two ranks and one process accumulating
    group the global batch differently (with the loss over a micro-batch they drifted apart by 1e-4 in four
    steps)."""
    single_losses, single_val = _train(tmp_path / "single", "single", 1, per_rank_batch=4, accumulate=2, experts=4)
    for by_strategy in run_ranks(_mixture_ranks, 2, tmp_path):
        for strategy, (losses, val) in by_strategy.items():
            assert len(losses) == STEPS, strategy
            for a, b in zip(single_losses, losses):
                assert abs(a - b) <= 1e-5 * abs(a), (strategy, single_losses, losses)
            assert abs(val - single_val) <= 1e-5 * abs(single_val), strategy
