"""FSDP gradient reduction is skipped on accumulation micro-steps, or made on each with ``sync_each_micro_batch``
(counted, on real gloo ranks)."""

import pytest
import torch.distributed as dist

import distrain
from helpers import TinyGPT, loader, make_trainer, run_ranks


def _count_reduce_scatters(rank, tmp, accumulate, each=False):
    calls = []
    real = dist.reduce_scatter_single

    def counting(*args, **kwargs):  # pass-through instrumentation: the real collective still runs
        calls.append(1)
        return real(*args, **kwargs)

    dist.reduce_scatter_single = counting
    try:
        trainer, _ = make_trainer(
            tmp,
            strategy=distrain.FSDPStrategy(sync_each_micro_batch=each),
            devices=2,
            max_steps=3,
            accumulate_grad_batches=accumulate,
            enable_checkpointing=False,
            logger=False,
        )
        trainer.fit(TinyGPT(), loader(4))
    finally:
        dist.reduce_scatter_single = real
    return len(calls), trainer.global_step


@pytest.mark.slow
def test_no_reduce_scatter_on_accumulation_micro_steps(tmp_path):
    (plain, steps), _ = run_ranks(_count_reduce_scatters, 2, tmp_path / "a", 1)
    (accumulated, steps_acc), _ = run_ranks(_count_reduce_scatters, 2, tmp_path / "b", 4)
    assert steps == steps_acc == 3
    assert plain >= 3 and plain % 3 == 0  # one per sharded unit per optimizer step
    assert accumulated == plain  # 12 micro-steps, reductions only on the 3 optimizer steps
    (each, steps_each), _ = run_ranks(_count_reduce_scatters, 2, tmp_path / "c", 4, True)
    assert steps_each == 3 and each == 4 * plain  # sync_each_micro_batch: on every one of the 12 micro-steps
