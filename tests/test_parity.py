"""Same seed + same global batch ⇒ same losses, whatever the strategy and world size."""

import pytest

import distrain
from helpers import TinyGPT, loader, make_trainer, run_ranks

STEPS = 8


def _train(tmp, strategy, devices, per_rank_batch, accumulate, experts=0, clip=1.0, norms=False):
    trainer, rec = make_trainer(
        tmp,
        strategy=strategy,
        devices=devices,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        enable_checkpointing=False,
        logger=False,
    )
    distrain.seed_everything(0)
    module = TinyGPT(n_experts=experts)
    trainer.fit(module, loader(per_rank_batch), loader(4, n=30, shuffle=False))
    if norms:
        return rec.losses, trainer.callback_metrics["val_loss"], rec.grad_norms
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


#: below the mixtures' gradient norms (about 0.8): every step clipped, so a norm that missed another rank's experts
#: would show in the losses
CLIP = 0.3


def _mixture_ranks(rank, tmp, devices, layouts):
    """Each layout's (losses, val loss, gradient norms, experts this rank holds per layer: whole over its FSDP
    shards)."""
    out = {}
    for s, ep in layouts:
        trainer, rec = make_trainer(
            tmp / f"{s}{ep}",
            strategy=s,
            devices=devices,
            max_steps=STEPS,
            gradient_clip_val=CLIP,
            enable_checkpointing=False,
            logger=False,
            expert_parallel_size=ep,
        )
        distrain.seed_everything(0)
        module = TinyGPT(n_experts=4)
        trainer.fit(module, loader(8 // devices), loader(4, n=30, shuffle=False))
        held = module.gpt.blocks[0].mlp.experts.fc.shape[0]
        out[(s, ep)] = (rec.losses, trainer.callback_metrics["val_loss"], rec.grad_norms, held)
    return out


def _assert_mixtures_match(single, by_strategy) -> None:
    """Every layout's losses, validation loss and gradient norms (before clipping: every expert's gradient counted
    once, at the scale of the mean over the global batch) are one process's, within fp32 rounding."""
    single_losses, single_val, single_norms = single
    for layout, (losses, val, norms, held) in by_strategy.items():
        assert held == 4 // layout[1], layout  # each rank holds 4 / expert_parallel_size experts
        assert len(losses) == len(norms) == STEPS, layout
        for a, b in [*zip(single_losses, losses), *zip(single_norms, norms)]:
            assert abs(a - b) <= 1e-5 * abs(a), (layout, single_losses, losses, single_norms, norms)
        assert abs(val - single_val) <= 1e-5 * abs(single_val), layout


@pytest.mark.slow
def test_a_mixture_of_experts_under_ddp_and_fsdp_equals_one_process(tmp_path):
    """The GPT with 4 experts per block, top-2 routing, its load-balancing loss in the loss, on 2 ranks: every
    expert on every rank, and each rank 2 of them (expert parallelism). The loss is taken per sequence, so it does
    not depend on which sequences share a micro-batch: two ranks and one process accumulating group the global batch
    differently (with the loss over a micro-batch they drifted apart by 1e-4 in four steps)."""
    single = _train(tmp_path / "single", "single", 1, per_rank_batch=4, accumulate=2, experts=4, clip=CLIP, norms=True)
    layouts = [("ddp", 1), ("fsdp", 1), ("ddp", 2), ("fsdp", 2)]
    for by_strategy in run_ranks(_mixture_ranks, 2, tmp_path, 2, layouts):
        _assert_mixtures_match(single, by_strategy)


@pytest.mark.slow
def test_experts_split_over_two_ranks_each_sharded_over_two_equal_one_process(tmp_path):
    """Four ranks: expert parallel 2 × FSDP 2 (each layer's 2 experts on a rank sharded with the rank that holds the
    same ones, the rest of the model over all four), and 2 × DDP 2, against one process on the same global batch."""
    single = _train(tmp_path / "single", "single", 1, per_rank_batch=8, accumulate=1, experts=4, clip=CLIP, norms=True)
    for by_strategy in run_ranks(_mixture_ranks, 4, tmp_path, 4, [("fsdp", 2), ("ddp", 2)]):
        _assert_mixtures_match(single, by_strategy)
